"""Log-probs of given tokens under a model, the quantity every loss here is built from, on packed rows.

The decoder body runs over a packed row (common/train/batching.py), then the LM head runs in chunks on the scored
positions only, so the float32 [tokens, vocab] logits never exist for a whole micro-batch, in forward or backward.
Each packed sequence attends to itself only (use_packed_attention): on GPU through torch's varlen kernels (flash
attention in bf16, memory-efficient attention in fp32), on CPU through sdpa per sequence length.
The rollout engine's log-probs of the same tokens are measured against the trainer's in common/train/off_policy.py.
"""

import functools
import inspect
import types

import torch
from torch.distributed.fsdp import register_fsdp_forward_method

from common.train.batching import pack_sequences, plan_equal_micro_batches
from common.train.moe import pack_routes, router_hooks
from common.train.sequence_parallel import (gather_scored, heads_to_sequence, local_part, sequence_parallel_size,
                                      sequence_to_heads)


class ChunkedTokenLogprobs(torch.autograd.Function):
    """log softmax(hidden @ weight.T / temperature)[targets], chunk by chunk of tokens.

    Only one chunk's float32 logits [chunk, vocab] exist at a time, in forward and in backward, which
    recomputes them: d log p(target) / d logits = onehot(target) - softmax(logits).
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk_tokens: int, with_entropy: bool,
                fused: bool):
        # hidden [tokens, d], weight [vocab, d], targets [tokens]
        stats = _compiled(_chunk_stats) if fused else _chunk_stats
        logprobs = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else None
        for start in range(0, len(hidden), chunk_tokens):
            chunk = slice(start, start + chunk_tokens)
            logits = hidden[chunk] @ weight.T  # [chunk, vocab]
            logprobs[chunk], logsumexp[chunk], chunk_entropy = stats(logits, targets[chunk], temperature, with_entropy)
            if with_entropy:
                entropy[chunk] = chunk_entropy
        ctx.save_for_backward(hidden, weight, targets, logsumexp)
        ctx.temperature, ctx.chunk_tokens, ctx.fused = temperature, chunk_tokens, fused
        if with_entropy:
            ctx.mark_non_differentiable(entropy)  # a metric only
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, logsumexp = ctx.saved_tensors
        grad_of_logits = _compiled(_grad_logits_fused) if ctx.fused else _grad_logits
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # summed over chunks
        for start in range(0, len(hidden), ctx.chunk_tokens):
            chunk = slice(start, start + ctx.chunk_tokens)
            logits = hidden[chunk] @ weight.T  # [chunk, vocab], recomputed
            grad_logits = grad_of_logits(logits, targets[chunk], logsumexp[chunk], grad_logprobs[chunk],
                                         ctx.temperature, hidden.dtype)
            grad_hidden[chunk] = grad_logits @ weight
            grad_weight += (grad_logits.T @ hidden[chunk]).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


# The per-chunk math over [chunk, vocab] logits: memory-bound passes, which is where a small model's head spends
# its time. Eager, each op is one pass, done in place on one float32 buffer to keep memory low; compiled
# (compile_model), each function below becomes one or two fused kernels.

def _chunk_stats(logits, targets, temperature: float, with_entropy: bool):
    """-> float32 log-probs of targets, logsumexp, and entropy (None without with_entropy), each [chunk]."""
    logits = logits.float() / temperature
    logsumexp = logits.logsumexp(-1)
    logprobs = logits.gather(-1, targets[:, None]).squeeze(-1) - logsumexp
    entropy = None
    if with_entropy:  # H = -sum p log p
        logits_lp = logits.sub_(logsumexp[:, None])  # in place: log-probs [chunk, vocab]
        entropy = -(logits_lp.exp() * logits_lp).sum(-1)
    return logprobs, logsumexp, entropy


def _grad_logits(logits, targets, logsumexp, grad_logprobs, temperature: float, dtype: torch.dtype):
    """d loss / d logits = (onehot(target) - softmax(logits / T)) * dL/dlogp / T, as dtype [chunk, vocab]."""
    grad = logits.float().div_(temperature).sub_(logsumexp[:, None]).exp_().neg_()  # -softmax, in place
    grad.scatter_add_(-1, targets[:, None], torch.ones_like(grad[:, :1]))
    return grad.mul_(grad_logprobs[:, None] / temperature).to(dtype)


def _grad_logits_fused(logits, targets, logsumexp, grad_logprobs, temperature: float, dtype: torch.dtype):
    """_grad_logits written for torch.compile: the one-hot as a comparison instead of a scatter, so one kernel
    reads the logits and writes the gradient (in eager mode this would hold several float32 [chunk, vocab])."""
    probs = (logits.float() / temperature - logsumexp[:, None]).exp()
    is_target = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]
    return (torch.where(is_target, 1.0 - probs, -probs) * (grad_logprobs / temperature)[:, None]).to(dtype)


@functools.cache
def _compiled(function):
    return torch.compile(function, dynamic=True)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                           chunk_tokens: int = 2048, with_entropy: bool = False, fused: bool = False):
    """Log-probs [tokens] (float32) of `targets` under logits = hidden @ weight.T / temperature, and their entropies
    (no gradient) with `with_entropy`. hidden [tokens, d], weight [vocab, d] (a bias-free LM head), targets [tokens].

    Peak memory grows with chunk_tokens * vocab, not tokens * vocab (2048 x 151936 floats: 1.2 GB).
    fused: the per-chunk math torch.compiled into fused kernels (same values up to float rounding)."""
    return ChunkedTokenLogprobs.apply(hidden, weight, targets, temperature, chunk_tokens, with_entropy, fused)


def _packed_forward(self, input_ids, position_ids, target_index, targets, attention_kwargs: dict, temperature: float,
                    chunk_tokens: int, with_entropy: bool):
    """Runs as a forward of the root model (see packed_token_logprobs), so FSDP gathers the head's weight."""
    hidden = self.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                             **attention_kwargs).last_hidden_state  # [1, total, d]
    head = self.get_output_embeddings()
    return chunked_token_logprobs(hidden[0, target_index], head.weight, targets, temperature, chunk_tokens,
                                  with_entropy, fused=getattr(self, "compiled_head", False))


def attach_forward_method(model, name: str, function, packed: dict) -> tuple[torch.device, dict]:
    """Attaches `function` as the method `name` of `model`, run as a forward of the root module, so that FSDP2
    gathers the root's weights (a direct call of model.base_model would skip its pre-forward hook); re-attached on
    every call, since registering wraps whatever is there and the model may have been sharded since. Returns the
    model's device and the attention arguments of the packed row (its sequence boundaries, for the varlen path)."""
    setattr(model, name, types.MethodType(function, model))
    register_fsdp_forward_method(model, name)
    device = model.get_input_embeddings().weight.device
    attention_kwargs = {}
    if model.config._attn_implementation == VARLEN_ATTENTION:
        cu_seqlens = packed["cu_seqlens"].to(device)
        attention_kwargs = dict(cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                                max_length_q=packed["max_seqlen"], max_length_k=packed["max_seqlen"])
    return device, attention_kwargs


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
    index, targets, counts = packed["target_index"], packed["targets"], None
    if sequence_parallel_size() > 1:  # this rank's slice of the row; the scored pieces gathered after the head
        packed, index, mine, counts = local_part(packed, index)
        targets = targets[mine]
    device, attention_kwargs = attach_forward_method(model, "packed_forward", _packed_forward, packed)
    if (routing := router_hooks(model)) is not None:  # MoE: replayed routes; a training pass counts for the metrics
        routes = packed.get("routes")
        routing.start_pass(None if routes is None else routes.to(device), packed.get("counted"),
                           collect=torch.is_grad_enabled())
    logprobs, entropy = model.packed_forward(packed["input_ids"].to(device), packed["position_ids"].to(device),
                                             index.to(device), targets.to(device), attention_kwargs, temperature,
                                             chunk_tokens, with_entropy)
    if routing is not None:
        routing.collect = False  # (a recomputation in backward, with activation checkpointing, is not counted again)
    if counts is not None:
        logprobs, entropy = gather_scored(logprobs, counts), gather_scored(entropy, counts)
    return logprobs, entropy


# ---------------------------------------------------------------------------------------------------------------
# Attention for packed rows. transformers' sdpa path works on packed rows too (it builds a block-diagonal causal mask
# from position_ids), but that mask is [total, total]: quadratic in the micro-batch, not the sequences.

VARLEN_ATTENTION = "nanorl_varlen"


@functools.cache
def _keywords(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """A transformers attention function over a packed row: torch's flash-attention varlen kernel on GPU in bf16, its
    memory-efficient kernel in fp32, and on CPU plain sdpa over the sequences grouped by length (one causal call per
    distinct length).

    query [1, heads, total, head_dim], key/value [1, kv_heads, total, head_dim] -> ([1, total, heads, head_dim], None).
    Each sequence (cu_seq_lens_q) attends causally to itself only: no mask, no wasted work across sequences.
    """
    if cu_seq_lens_q is None:
        raise ValueError(f"{VARLEN_ATTENTION} attention needs packed inputs (cu_seq_lens_q): use packed_token_logprobs")
    if dropout:
        raise ValueError(f"{VARLEN_ATTENTION} attention has no dropout")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [total, heads, head_dim]
    if sequence_parallel_size() > 1:  # this rank holds a slice of the row: trade it for a slice of the heads
        k, v = _repeat_kv(k, v, max(k.shape[1], sequence_parallel_size()))  # fewer kv heads than ranks: copies
        q, k, v = (heads_to_sequence(x) for x in (q, k, v))  # [whole row, heads / N, head_dim]
        out = _varlen_attention(q, k, v, cu_seq_lens_q, max_length_q, scaling)
        return sequence_to_heads(out).unsqueeze(0), None
    return _varlen_attention(q, k, v, cu_seq_lens_q, max_length_q, scaling).unsqueeze(0), None


def _varlen_attention(q, k, v, cu_seq_lens_q, max_length_q, scaling) -> torch.Tensor:
    """[total, heads, head_dim] (k, v: kv heads) -> [total, heads, head_dim], each sequence causal by itself."""
    if not q.is_cuda:
        return _attention_by_length(q, k, v, cu_seq_lens_q, scaling)
    if q.dtype == torch.float32:  # the flash kernel computes in bf16/fp16 only
        k, v = _repeat_kv(k, v, q.shape[1])
        return EfficientVarlenAttention.apply(q, k, v, cu_seq_lens_q, max_length_q, scaling)
    from torch.nn.attention.varlen import varlen_attn

    options = _keywords(varlen_attn)  # they changed between torch releases
    extra = {"window_size": (-1, 0)} if "window_size" in options else {"is_causal": True}
    if "enable_gqa" in options:  # grouped-query attention: newer torch asks for it to be named; the flash kernel
        extra["enable_gqa"] = True  # shares each kv head among its query heads natively, nothing repeated
    if scaling is not None and abs(scaling - q.shape[-1] ** -0.5) > 1e-6:
        if "scale" not in options:
            raise ValueError("this torch's varlen_attn has no `scale`; the model needs a non-default one")
        extra["scale"] = scaling
    return varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, **extra)


def _repeat_kv(k, v, heads: int):
    """Grouped-query attention for kernels that want as many kv heads as query heads: query head h reads kv head
    h // group. k, v [total, kv_heads, head_dim] -> [total, heads, head_dim]."""
    if k.shape[1] == heads:
        return k, v
    return (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (k, v))


class EfficientVarlenAttention(torch.autograd.Function):
    """Causal attention over a packed row in one call of torch's memory-efficient (cutlass) kernel, the one that
    computes in fp32 too: q, k, v [total, heads, head_dim] (as many kv heads as query heads), cu_seqlens [n + 1]
    int32 -> [total, heads, head_dim]. The kernel takes [batch, tokens, heads, head_dim]: here a batch of one row."""

    CAUSAL = 1  # the kernel's custom_mask_type for causal from the top left (each sequence attends to its past)

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, scale: float | None):
        out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            q[None], k[None], v[None], None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0,
            EfficientVarlenAttention.CAUSAL, compute_log_sumexp=True, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset, cu_seqlens)
        ctx.max_seqlen, ctx.scale = max_seqlen, scale
        return out[0]

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, seed, offset, cu_seqlens = ctx.saved_tensors
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            grad.contiguous()[None], q[None], k[None], v[None], None, out, cu_seqlens, cu_seqlens, ctx.max_seqlen,
            ctx.max_seqlen, lse, 0.0, seed, offset, EfficientVarlenAttention.CAUSAL, False, scale=ctx.scale)
        return dq[0], dk[0], dv[0], None, None, None


def _attention_by_length(q, k, v, cu_seqlens, scaling) -> torch.Tensor:
    """Causal attention of each packed sequence with itself, without a mask: q [total, heads, head_dim], k and v
    [total, kv_heads, head_dim] -> [total, heads, head_dim]. Sequences of one length go through sdpa together."""
    import torch.nn.functional as F

    k, v = _repeat_kv(k, v, q.shape[1])
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    out = torch.empty_like(q)
    for length in lengths.unique().tolist():
        index = starts[lengths == length, None] + torch.arange(length, device=q.device)  # [m, length]
        qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [m, heads, length, head_dim]
        out[index] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling).transpose(1, 2)
    return out


def use_packed_attention(model, device: torch.device) -> str:
    """Sets the model's attention for packed rows (varlen_attention_forward). It takes packed rows alone, no
    padded batches and no KV cache: the HF rollout engine switches a policy to sdpa while it generates with it.
    Returns the implementation's name."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    model.set_attn_implementation(VARLEN_ATTENTION)
    return VARLEN_ATTENTION


# ---------------------------------------------------------------------------------------------------------------
# Per-sample log-probs of responses.


def sample_lengths(samples: list[dict]) -> list[int]:
    return [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]


def model_token_mask(sample: dict) -> list[int]:
    """1 on each response token the model generated, 0 on a multi-turn episode's observation tokens (its
    "response_mask", common/rollout/episodes.py): what losses, log-prob statistics and token counts take."""
    return sample.get("response_mask") or [1] * len(sample["response_ids"])


def model_tokens(samples: list[dict]) -> int:
    """How many response tokens of `samples` the model generated (all of them, single-turn)."""
    return sum(sum(model_token_mask(s)) for s in samples)


def packed_response_logprobs(model, samples: list[dict], temperature: float, with_entropy: bool = False):
    """Packs prompt + response of each sample into one row; returns per-sample response log-probs (and entropies).
    An empty `samples` runs a dummy sequence (a rank's zero-weight filler pass)."""
    packed = pack_sequences([s["prompt_ids"] + s["response_ids"] for s in samples],
                            [len(s["response_ids"]) for s in samples] if samples else None)
    packed["routes"] = pack_routes(samples)  # MoE with --routing-replay: the rollout's experts, else None
    if not samples:
        packed["counted"] = 0  # the dummy sequence counts in no metric
    logprobs, entropy = packed_token_logprobs(model, packed, temperature, with_entropy=with_entropy)
    split = lambda x: None if x is None else list(x.split(packed["num_scored"]))
    return split(logprobs), split(entropy)


@torch.no_grad()
def compute_logprobs(model, samples: list[dict], max_tokens: int, temperature: float, device) -> list[torch.Tensor]:
    """Collective: each sample's response-token log-probs under `model` ([len(response)] on CPU), in sample order."""
    out = [None] * len(samples)
    for mb in plan_equal_micro_batches(sample_lengths(samples), max_tokens, device):  # empty mb: a dummy pass
        logprobs, _ = packed_response_logprobs(model, [samples[i] for i in mb], temperature)
        for i, lp in zip(mb, logprobs):
            out[i] = lp.float().cpu()
    model.reshard()  # FSDP2 keeps the root's weights gathered after a forward with no backward: free them
    return out
