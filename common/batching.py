"""Token-budget micro-batches, packed without padding and balanced over data-parallel ranks.

RL rollouts have long-tailed lengths, so a micro-batch here is a token budget, not a sample count:
- sequences are packed end to end into one row [1, total], position ids restarting at 0 per sequence; the
  attention finds the sequence boundaries from them (or from cu_seqlens) and never crosses one;
- every rank gets about the same token work (largest-first greedy), and runs the same number of micro-batches,
  so FSDP's collectives pair up (a rank short of work runs a zero-weight dummy pass);
- log-probs are computed only at the scored positions, through the LM head in chunks, so the float32
  [tokens, vocab] logits never exist for a whole micro-batch;
- every step is bookkept by sample index, so results come back in the samples' original order.

The loss stays independent of the split because its normalisers (token and sequence counts) are counted over the
whole mini-batch on all ranks, and every micro-batch adds its share (see grpo.aggregate_loss).
"""

import functools
import heapq
import inspect
import types

import torch
import torch.distributed as dist
from torch.distributed.fsdp import register_fsdp_forward_method


# ---------------------------------------------------------------------------------------------------------------
# Planning: which samples go together. Plain Python on lengths, identical on every rank.


def plan_micro_batches(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Groups sample indices into micro-batches of at most `max_tokens` tokens each (first-fit decreasing).

    Longest first, each into the first micro-batch it fits in: close to the fewest micro-batches possible.
    """
    micro_batches, loads = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > max_tokens:
            raise ValueError(f"a sequence of {lengths[i]} tokens does not fit the micro-batch budget of "
                             f"{max_tokens} tokens: raise --max-tokens-per-micro-batch or lower the length limits")
        for mb, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                micro_batches[mb].append(i)
                loads[mb] += lengths[i]
                break
        else:
            micro_batches.append([i])
            loads.append(lengths[i])
    return micro_batches


def sequence_cost(length: int, attention_weight: float = 0.0) -> float:
    """Work of one sequence: its tokens (the matmuls), plus attention_weight * length^2 (the attention).

    For a decoder, attention_weight ~ 2 * num_layers * hidden_size / num_params weighs both in FLOPs."""
    return length + attention_weight * length * length


def balance_across_ranks(lengths: list[int], world_size: int, attention_weight: float = 0.0) -> list[list[int]]:
    """Splits sample indices into `world_size` parts of about equal cost (largest first, onto the least loaded).

    The heaviest and lightest part differ by at most one sequence's cost. Returns each part's indices, ascending.
    """
    parts = [[] for _ in range(world_size)]
    heap = [(0.0, rank) for rank in range(world_size)]  # (load, rank): the least loaded rank on top
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, rank = heapq.heappop(heap)
        parts[rank].append(i)
        heapq.heappush(heap, (load + sequence_cost(lengths[i], attention_weight), rank))
    return [sorted(part) for part in parts]


def equalize_micro_batches(micro_batches: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """Brings a rank's plan to exactly `count` micro-batches (the maximum over ranks).

    Splits the heaviest micro-batch of two or more sequences in two while it can (the work gets spread, not added),
    then appends empty micro-batches: the training loop runs those as a zero-weight pass on a dummy sequence.
    """
    if len(micro_batches) > count:
        raise ValueError(f"cannot bring {len(micro_batches)} micro-batches down to {count}")
    micro_batches = [list(mb) for mb in micro_batches]
    while len(micro_batches) < count:
        splittable = [mb for mb in micro_batches if len(mb) > 1]
        if not splittable:
            micro_batches.append([])
            continue
        heaviest = max(splittable, key=lambda mb: sum(lengths[i] for i in mb))
        halves = balance_across_ranks([lengths[i] for i in heaviest], 2)
        micro_batches.remove(heaviest)
        micro_batches += [[heaviest[j] for j in half] for half in halves]
    return micro_batches


def restore_order(parts: list[list[int]], results: list[list]) -> list:
    """Inverse of splitting: `parts` hold the original indices of each part's items, `results` each part's
    per-item results in the same order. Returns all results in original order (checks `parts` is a permutation)."""
    total = sum(len(p) for p in parts)
    out, seen = [None] * total, [False] * total
    for part, part_results in zip(parts, results, strict=True):
        if len(part) != len(part_results):
            raise ValueError(f"a part of {len(part)} indices came back with {len(part_results)} results")
        for i, result in zip(part, part_results):
            if not 0 <= i < total or seen[i]:
                raise ValueError(f"index {i} is out of range or appears twice: the parts are not a permutation")
            out[i], seen[i] = result, True
    return out


# ---------------------------------------------------------------------------------------------------------------
# Collectives: moving samples between ranks and agreeing on the micro-batch count.


def share_samples_evenly(samples: list, lengths: list[int], world_size: int, rank: int,
                         attention_weight: float = 0.0) -> tuple[list, list[int]]:
    """Collective: re-deals all ranks' samples so that each rank gets about the same token work.

    Samples are small (token ids and a few numbers), so every rank gathers all of them (all_gather_object) and
    keeps its part. Global order is rank-major: rank 0's samples, then rank 1's... Returns this rank's samples and
    their global indices (pass those to gather_in_original_order to bring per-sample results back).
    """
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (samples, lengths))
    all_samples = [s for part, _ in everyone for s in part]
    all_lengths = [n for _, part in everyone for n in part]
    mine = balance_across_ranks(all_lengths, world_size, attention_weight)[rank]
    return [all_samples[i] for i in mine], mine


def gather_in_original_order(results: list, global_indices: list[int], world_size: int) -> list:
    """Collective: every rank's per-sample results (for its samples `global_indices`), in global order."""
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (global_indices, results))
    return restore_order([indices for indices, _ in everyone], [part for _, part in everyone])


# ---------------------------------------------------------------------------------------------------------------
# Packing: one row, no padding.


def pack_sequences(seqs: list[list[int]], num_scored: list[int] | None = None) -> dict:
    """Packs token sequences end to end into one row. The last num_scored[i] tokens of sequence i are the ones
    whose log-probs are wanted (default: all but its first); position t predicts token t + 1 of its own sequence.

    Returns (on CPU; packed_token_logprobs moves what it needs):
      input_ids    [1, total]   the sequences end to end
      position_ids [1, total]   0, 1, ... per sequence: the rotary positions, and the sequence boundaries for sdpa,
                                eager and flex attention in transformers (they build a block-diagonal causal mask)
      cu_seqlens   [n + 1]      int32 start offsets and the total (varlen attention kernels take these)
      max_seqlen   int
      target_index [scored]     positions whose next token is scored
      targets      [scored]     the scored tokens
      num_scored   list[int]    per sequence: split per-token results with torch.split(x, num_scored)
    An empty `seqs` gives a 2-token dummy sequence (one scored token) for a rank's zero-weight filler pass.
    """
    if not seqs:
        seqs, num_scored = [[0, 0]], [1]
    if num_scored is None:
        num_scored = [len(s) - 1 for s in seqs]
    input_ids, position_ids, target_index, targets, offsets = [], [], [], [], [0]
    for seq, scored in zip(seqs, num_scored, strict=True):
        if not 0 <= scored < len(seq):
            raise ValueError(f"cannot score {scored} tokens of a {len(seq)}-token sequence (the first has no context)")
        start = offsets[-1]
        input_ids += seq
        position_ids += range(len(seq))
        target_index += range(start + len(seq) - scored - 1, start + len(seq) - 1)
        targets += seq[len(seq) - scored:]
        offsets.append(start + len(seq))
    return {"input_ids": torch.tensor([input_ids]), "position_ids": torch.tensor([position_ids]),
            "cu_seqlens": torch.tensor(offsets, dtype=torch.int32), "max_seqlen": max(map(len, seqs)),
            "target_index": torch.tensor(target_index, dtype=torch.long),
            "targets": torch.tensor(targets, dtype=torch.long), "num_scored": list(num_scored)}


def pad_rows(rows: list, value: float = 0.0) -> torch.Tensor:
    """Per-sequence 1-D tensors (or lists) of different lengths -> [n, longest], right-padded with `value`.
    Brings flat per-token results back to the [batch, seq] layout the loss functions take."""
    rows = [r if torch.is_tensor(r) else torch.tensor(r, dtype=torch.float32) for r in rows]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


# ---------------------------------------------------------------------------------------------------------------
# Log-probs through the LM head in chunks.


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[targets], chunk by chunk of tokens.

    Only one chunk's float32 logits [chunk, vocab] exist at a time, in forward and in backward, which
    recomputes them: d log p(target) / d logits = onehot(target) - softmax(logits).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_tokens: int, with_entropy: bool):
        # hidden [tokens, d], weight [vocab, d], targets [tokens]
        logprobs = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        for start in range(0, len(hidden), chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            logits = (hidden[chunk] @ weight.T).float().div_(temperature)  # [chunk, vocab]
            logsumexp[chunk] = logits.logsumexp(-1)
            logprobs[chunk] = logits.gather(-1, targets[chunk, None]).squeeze(-1) - logsumexp[chunk]
            if with_entropy:  # H = -sum p log p
                logits_lp = logits.sub_(logsumexp[chunk, None])  # in place: log-probs [chunk, vocab]
                entropy[chunk] = -(logits_lp.exp() * logits_lp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, logsumexp)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        if with_entropy:
            ctx.mark_non_differentiable(entropy)  # a metric only
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, logsumexp = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # summed over chunks
        for start in range(0, len(hidden), ctx.chunk_tokens):
            chunk = slice(start, start + ctx.chunk_tokens)
            logits = (hidden[chunk] @ weight.T).float().div_(ctx.temperature)  # [chunk, vocab]
            # In place, since each pass over [chunk, vocab] floats costs time: -softmax, + onehot, x dL/dlogp
            grad_logits = logits.sub_(logsumexp[chunk, None]).exp_().neg_()
            grad_logits.scatter_add_(-1, targets[chunk, None], torch.ones_like(grad_logits[:, :1]))
            grad_logits = grad_logits.mul_(grad_logprobs[chunk, None] / ctx.temperature).to(hidden.dtype)
            grad_hidden[chunk] = grad_logits @ weight
            grad_weight += (grad_logits.T @ hidden[chunk]).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                           chunk_tokens: int = 2048, with_entropy: bool = False):
    """Log-probs [tokens] (float32) of `targets` under logits = hidden @ weight.T / temperature, and their entropies
    (no gradient) with `with_entropy`. hidden [tokens, d], weight [vocab, d] (a bias-free LM head), targets [tokens].

    Peak memory grows with chunk_tokens * vocab, not tokens * vocab (2048 x 151936 floats: 1.2 GB)."""
    return ChunkedTokenLogprobs.apply(hidden, weight, targets, temperature, chunk_tokens, with_entropy)


def _packed_forward(self, input_ids, position_ids, target_index, targets, attention_kwargs: dict, temperature: float,
                    chunk_tokens: int, with_entropy: bool):
    """Runs as a forward of the root model (see packed_token_logprobs), so FSDP gathers the head's weight."""
    hidden = self.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             **attention_kwargs).last_hidden_state  # [1, total, d]
    head = self.get_output_embeddings()
    return chunked_token_logprobs(hidden[0, target_index], head.weight, targets, temperature, chunk_tokens,
                                  with_entropy)


def packed_token_logprobs(model, packed: dict, temperature: float, chunk_tokens: int = 2048,
                          with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [scored] of a packed micro-batch's scored tokens under `model` (an HF causal LM, FSDP2-sharded or
    not), in the order of packed["targets"]; split them per sequence with packed["num_scored"].

    The decoder body gives the hidden states, then the LM head runs in chunks on the scored positions only. Both
    must run inside one forward of the root module: FSDP2 gathers the root's weights (embeddings, final norm, head)
    in the root's pre-forward hook, which a direct call of model.base_model skips. So the computation is attached
    as a method of the model and registered as a forward method with FSDP (a no-op for an unsharded model).
    """
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None or getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("packed_token_logprobs handles a plain bias-free LM head only")
    # Re-attached on every call: registering wraps whatever is there, and the model may have been sharded since.
    model.packed_forward = types.MethodType(_packed_forward, model)
    register_fsdp_forward_method(model, "packed_forward")
    device = model.get_input_embeddings().weight.device
    attention_kwargs = {}
    if model.config._attn_implementation == VARLEN_ATTENTION:
        cu_seqlens = packed["cu_seqlens"].to(device)
        attention_kwargs = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                                max_length_q=packed["max_seqlen"], max_length_k=packed["max_seqlen"])
    return model.packed_forward(packed["input_ids"].to(device), packed["position_ids"].to(device),
                                packed["target_index"].to(device), packed["targets"].to(device), attention_kwargs,
                                temperature, chunk_tokens, with_entropy)


# ---------------------------------------------------------------------------------------------------------------
# Attention for packed rows on GPU. transformers' sdpa path works on packed rows too (it builds a block-diagonal
# causal mask from position_ids), but that mask is [total, total]: quadratic in the micro-batch, not the sequences.

VARLEN_ATTENTION = "nanorl_varlen"


@functools.cache
def _keywords(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """A transformers attention function over a packed row with torch's flash-attention varlen kernel.

    query [1, heads, total, head_dim], key/value [1, kv_heads, total, head_dim] -> ([1, total, heads, head_dim], None).
    Each sequence (cu_seq_lens_q) attends causally to itself only: no mask, no wasted work across sequences.
    """
    from torch.nn.attention.varlen import varlen_attn

    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN_ATTENTION} attention needs packed inputs (cu_seq_lens_q): use packed_token_logprobs")
    if dropout:
        raise ValueError(f"{VARLEN_ATTENTION} attention has no dropout")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [total, heads, head_dim]
    options = _keywords(varlen_attn)  # they changed between torch releases
    extra = {"window_size": (-1, 0)} if "window_size" in options else {"is_causal": True}
    if "enable_gqa" in options:
        extra["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:  # grouped-query attention by hand: query head h reads kv head h // group
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    if scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-6:
        if "scale" not in options:
            raise ValueError("this torch's varlen_attn has no `scale`; the model needs a non-default one")
        extra["scale"] = scaling
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, **extra)
    return out.unsqueeze(0), None


def use_packed_attention(model, device: torch.device) -> str:
    """Sets the model's attention for packed rows: the varlen kernel on CUDA, else transformers' sdpa (correct,
    block-diagonal mask, fine for small CPU runs). Call it for training only: the varlen path takes packed rows
    alone (no padded batches, no KV cache). Returns the implementation chosen."""
    from transformers import AttentionInterface

    implementation = "sdpa"
    if device.type == "cuda":
        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
        implementation = VARLEN_ATTENTION
    model.set_attn_implementation(implementation)
    return implementation


# ---------------------------------------------------------------------------------------------------------------
# Metrics.

# Dense bf16 tensor-core peak, FLOP/s, by device-name substring.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def memory_in_use(device: torch.device) -> int:
    """Bytes in use on the GPU, as nvidia-smi counts them: every allocator and process (vLLM, CUDA contexts)."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free


class TrainingMemoryPeak:
    """The GPU memory in use at the peak of a phase in which only PyTorch allocates (training: vLLM sleeps): what
    was in use when the phase began plus the most PyTorch's caching allocator grew during it. PyTorch's own peak
    counters alone mislead here, as they also count the memory of a sleeping vLLM engine, which is not mapped."""

    def __init__(self, device: torch.device):
        self.device, self.start = device, memory_in_use(device)
        self.reserved = torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)

    def peak(self) -> int:
        return self.start + torch.cuda.max_memory_reserved(self.device) - self.reserved


def mfu(num_params: int, tokens: float, seconds: float, peak: float | None, num_gpus: int = 1) -> float | None:
    """Model FLOPs utilisation: 6 x parameters x tokens (forward + backward matmuls, no attention) / time / peak.
    tokens: processed by num_gpus GPUs together in `seconds`; peak: one GPU's bf16 FLOP/s (peak_flops)."""
    if peak is None or seconds <= 0:
        return None
    return 6 * num_params * tokens / seconds / (peak * num_gpus)


def batching_metrics(micro_batches: list[list[int]], lengths: list[int], device: torch.device,
                     padded: bool = False) -> dict[str, float]:
    """Collective: how well this step's plans use the hardware, over all ranks.

    micro_batches: this rank's plan (indices into `lengths`, its sequences' tokens). padded: each micro-batch is
    padded to its longest sequence (computed tokens = count x longest) instead of packed (an empty one runs a
    2-token dummy either way).
    """
    real = sum(lengths[i] for mb in micro_batches for i in mb)
    computed = sum((len(mb) * max(lengths[i] for i in mb) if padded else sum(lengths[i] for i in mb)) if mb else 2
                   for mb in micro_batches)
    biggest = max((sum(lengths[i] for i in mb) for mb in micro_batches), default=0)
    sums = torch.tensor([real, computed, len(micro_batches)], dtype=torch.float64, device=device)
    maxima = torch.tensor([real, -real, len(micro_batches), biggest], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    real_all, computed_all, count_all = sums.tolist()
    max_load, neg_min_load, max_count, max_mb_tokens = maxima.tolist()
    world = dist.get_world_size()
    return {"batch/padding_frac": 1 - real_all / max(computed_all, 1),
            "batch/micro_batches_per_rank": max_count,
            "batch/tokens_per_micro_batch": real_all / max(count_all, 1),
            "batch/max_tokens_per_micro_batch": max_mb_tokens,
            "batch/max_rank_tokens": max_load, "batch/min_rank_tokens": -neg_min_load,
            "batch/rank_imbalance": max_load / max(real_all / world, 1)}
