"""Token-budget micro-batches, packed without padding and balanced over data-parallel ranks.

RL rollouts have long-tailed lengths, so a micro-batch here is a token budget, not a sample count:
- sequences are packed end to end into one row [1, total], position ids restarting at 0 per sequence; the
  attention finds the sequence boundaries from them (or from cu_seqlens) and never crosses one;
- every rank gets about the same token work (largest-first greedy), and runs the same number of micro-batches,
  so FSDP's collectives pair up (a rank short of work runs a zero-weight dummy pass);
- every step is bookkept by sample index, so results come back in the samples' original order.

The loss stays independent of the split because its normalisers (token and sequence counts) are counted over the
whole mini-batch on all ranks, and every micro-batch adds its share (see grpo.aggregate_loss, ppo.token_mean_share).
The forward pass over a packed row is in common/train/logprobs.py.
"""

import heapq
import itertools

import numpy as np
import torch
import torch.distributed as dist

from common.run.distributed import max_over_ranks
from common.train.sequence_parallel import data_parallel


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


def mini_batches(samples: list, epochs: int, num_mini_batches: int, generator: torch.Generator | None):
    """Each epoch, the samples shuffled with `generator` (None keeps their order) and cut into `num_mini_batches`
    parts: exactly that many on every rank, even where ranks hold different counts (tensor_split, not chunk)."""
    for _ in range(epochs):
        order = torch.arange(len(samples)) if generator is None else torch.randperm(len(samples), generator=generator)
        for part in torch.tensor_split(order, num_mini_batches):
            yield [samples[i] for i in part.tolist()]


def empty_backward(output: torch.Tensor) -> None:
    """The backward of a rank with no samples in this micro-batch (plan_equal_micro_batches gives every rank the same
    count, and one may run out): a zero-weight pass over an empty batch's output, so that it joins FSDP's
    collectives in step with the others and adds nothing to the gradients."""
    (output.sum() * 0.0).backward()


def shuffle_generator(seed: int, rank: int, world: int, step: int) -> torch.Generator:
    """The generator mini_batches shuffles a step's samples with: seeded per step and data-parallel group (a
    sequence-parallel group's ranks alike: they share their samples), so a resumed run shuffles as an uninterrupted
    one would."""
    group = data_parallel(rank, world)[0]
    return torch.Generator().manual_seed((seed * 7919 + group) * 1_000_003 + step)


# ---------------------------------------------------------------------------------------------------------------
# Collectives: moving samples between ranks and agreeing on the micro-batch count.


def share_samples_evenly(samples: list, lengths: list[int], world_size: int, rank: int,
                         attention_weight: float = 0.0) -> tuple[list, list[int]]:
    """Collective: re-deals all ranks' samples so that each rank gets about the same token work; with sequence
    parallelism, each group of ranks that splits its rows between them (common/train/sequence_parallel.py) gets one share.

    Samples are small (token ids and a few numbers), so every rank gathers all of them (all_gather_object) and
    keeps its part. Global order is rank-major: rank 0's samples, then rank 1's... Returns this rank's samples and
    their global indices (pass those to gather_in_original_order to bring per-sample results back).
    """
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (samples, lengths))
    all_samples = [s for part, _ in everyone for s in part]
    all_lengths = [n for _, part in everyone for n in part]
    group, groups = data_parallel(rank, world_size)
    mine = balance_across_ranks(all_lengths, groups, attention_weight)[group]
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
    for seq, scored in zip(seqs, num_scored, strict=True):
        if not 0 <= scored < len(seq):
            raise ValueError(f"cannot score {scored} tokens of a {len(seq)}-token sequence (the first has no context)")
    # Whole-array operations rather than Python lists: a GRPO batch is ~100k tokens, and lists of Python ints
    # cost tens of milliseconds here, during which the GPU waits.
    lengths, scored = torch.tensor([len(s) for s in seqs]), torch.tensor(num_scored, dtype=torch.long)
    total = int(lengths.sum())
    input_ids = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total))
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    position_ids = torch.arange(total) - offsets[:-1].repeat_interleave(lengths)
    # Sequence i's scored targets are its last scored[i] tokens; each is predicted at the position before it.
    first_target = (offsets[1:] - scored).repeat_interleave(scored)  # per scored token: its sequence's first target
    rank_in_seq = torch.arange(int(scored.sum())) - (scored.cumsum(0) - scored).repeat_interleave(scored)
    target_index = first_target + rank_in_seq - 1
    return {"input_ids": input_ids[None], "position_ids": position_ids[None],
            "cu_seqlens": offsets.to(torch.int32), "max_seqlen": int(lengths.max()),
            "target_index": target_index, "targets": input_ids[target_index + 1], "num_scored": list(num_scored)}


def pad_rows(rows: list, value: float = 0.0) -> torch.Tensor:
    """Per-sequence 1-D tensors (or lists) of different lengths -> [n, longest], right-padded with `value`.
    Brings flat per-token results back to the [batch, seq] layout the loss functions take."""
    rows = [r if torch.is_tensor(r) else torch.tensor(r, dtype=torch.float32) for r in rows]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value)


# On CPU, transformers' attention over a packed row builds a [tokens, tokens] mask: micro-batches stay this small.
CPU_MAX_TOKENS = 2048


def plan_equal_micro_batches(lengths: list[int], max_tokens: int, device: torch.device) -> list[list[int]]:
    """Collective: token-budget micro-batches of sequences of these lengths, as many on every rank (FSDP's
    collectives must pair up)."""
    if device.type == "cpu":
        max_tokens = min(max_tokens, max(CPU_MAX_TOKENS, *lengths, 0))
    plan = plan_micro_batches(lengths, max_tokens)
    return equalize_micro_batches(plan, lengths, max_over_ranks(len(plan), device))


# ---------------------------------------------------------------------------------------------------------------
# Metrics.


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
