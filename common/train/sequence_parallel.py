"""Sequence parallelism (Ulysses: Jacobs et al. 2023, https://arxiv.org/abs/2309.14509): the tokens of one packed
row split over the N ranks of a sequence-parallel group, so that a 32k-token response trains on ranks that each hold
the activations of 32k / N tokens.

Everything in a decoder layer but attention works token by token, so each rank runs its own slice of the row (its
input ids and position ids). Around attention an all-to-all trades the split: each rank gives away the other ranks'
heads of its tokens and gets its own heads of every token (head group r of N), runs the varlen attention over the
whole row for those heads, and trades back (`heads_to_sequence`, `sequence_to_heads`). Grouped-query attention: the
kv heads split the same way, copied first where there are fewer of them than ranks. The LM head (or a value head)
runs on each rank's scored positions, and `gather_scored` puts the pieces together: every rank of the group holds the
micro-batch's whole log-probs and computes the same loss, while the backward gives each rank the gradient of its
own positions only.

Ranks g*N .. g*N + N - 1 form group g and must feed it the same micro-batches: common/train/batching.py deals samples to
data-parallel groups, not to ranks. Quantities summed over ranks from those samples then count each sample N times,
the same for a normaliser and what it normalises; FSDP divides the summed gradients by the number of groups instead of
ranks, which is what makes the update equal to the one without sequence parallelism (common/train/model.py).
"""

import torch
import torch.distributed as dist

from common.run.shapes import heads_split

_group, _size, _rank = None, 1, 0  # this rank's sequence-parallel group, its size, this rank's place in it


def init_sequence_parallel(size: int) -> None:
    """Collective over the default group: groups of `size` consecutive ranks. size 1: off."""
    global _group, _size, _rank
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"--sequence-parallel {size} must divide the {world} training ranks")
    _group, _size, _rank = None, size, rank % size
    if size == 1:
        return
    for first in range(0, world, size):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            _group = group


def sequence_parallel_size() -> int:
    return _size


def data_parallel(rank: int, world: int) -> tuple[int, int]:
    """(this rank's data-parallel group, the number of groups): the share of samples it computes with its group."""
    return rank // _size, world // _size


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single over the sequence-parallel group of a tensor split into N equal chunks along dim 0; its
    gradient goes back the same way."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()  # (a gradient can come transposed: the collective reads and writes memory in order)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=_group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad)


def check_heads(config, size: int) -> None:
    """One line for a model whose attention heads cannot split over `size` ranks."""
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads_split(heads, kv_heads, size):
        raise ValueError(f"--sequence-parallel {size}: the model's {heads} attention heads ({kv_heads} key-value heads) "
                         f"do not split over {size} ranks (the heads must divide by it, and the key-value heads divide "
                         f"it or divide by it)")


def heads_to_sequence(x: torch.Tensor) -> torch.Tensor:
    """[tokens of this rank, heads, d] -> [tokens of the whole row, heads / N, d]: head group r of every rank's
    tokens, in the row's order."""
    tokens, heads, d = x.shape
    chunks = x.reshape(tokens, _size, heads // _size, d).transpose(0, 1)  # [N, tokens, heads / N, d]: by head group
    return _AllToAll.apply(chunks).reshape(_size * tokens, heads // _size, d)  # from each rank, in order


def sequence_to_heads(x: torch.Tensor) -> torch.Tensor:
    """The inverse of heads_to_sequence: [row tokens, heads / N, d] -> [tokens of this rank, heads, d]."""
    total, heads, d = x.shape
    chunks = _AllToAll.apply(x.reshape(_size, total // _size, heads, d))  # [N, tokens, heads / N, d]
    return chunks.transpose(0, 1).reshape(total // _size, _size * heads, d)


def local_part(packed: dict, index: torch.Tensor) -> tuple[dict, torch.Tensor, torch.Tensor, list[int]]:
    """This rank's slice of a packed micro-batch (common/train/batching.py's pack_sequences): the row padded to a multiple of
    N with a dummy sequence (never read), then the input and position ids of this rank's N-th; the attention keeps
    the whole row's sequence boundaries. `index`: positions of the row a head reads (ascending). Returns the slice,
    the positions of `index` that fall in it (relative to it), which of `index` they are, and how many each rank
    holds (in the row's order: rank r's come after rank r - 1's)."""
    total = packed["input_ids"].shape[1]
    pad = -total % _size
    chunk = (total + pad) // _size
    input_ids = torch.nn.functional.pad(packed["input_ids"], (0, pad))
    position_ids = torch.cat([packed["position_ids"], torch.arange(pad).unsqueeze(0)], dim=1)
    cu_seqlens = packed["cu_seqlens"]
    if pad:
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([total + pad])])
    start = _rank * chunk
    owner = index // chunk  # the rank whose slice holds each position of `index`
    counts, mine = torch.bincount(owner, minlength=_size).tolist(), owner == _rank
    local = {"input_ids": input_ids[:, start:start + chunk], "position_ids": position_ids[:, start:start + chunk],
             "cu_seqlens": cu_seqlens, "max_seqlen": max(packed["max_seqlen"], pad),
             "counted": min(max(packed.get("counted", total) - start, 0), chunk)}  # MoE metrics: not the padding
    if packed.get("routes") is not None:  # MoE routing replay: [layers, total, k], the padding's the router's own
        local["routes"] = torch.nn.functional.pad(packed["routes"], (0, 0, 0, pad), value=-1)[:, start:start + chunk]
    return local, index[mine] - start, mine, counts


class _GatherScored(torch.autograd.Function):
    """The group's pieces of a [scored] vector, in rank order (each rank's `counts[rank]` values); every rank computes
    the same loss from the whole, so the gradient of a rank's piece is its slice of the whole's, no reduction."""

    @staticmethod
    def forward(ctx, local, counts):
        ctx.start, ctx.count = sum(counts[:_rank]), counts[_rank]
        most = max(counts)
        if most == 0:  # nothing scored in the micro-batch (a rank's filler pass): the same on every rank
            return local
        padded = torch.nn.functional.pad(local, (0, most - len(local)))
        pieces = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(pieces, padded.contiguous(), group=_group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.start + ctx.count], None


def gather_scored(local: torch.Tensor | None, counts: list[int]) -> torch.Tensor | None:
    """The whole micro-batch's [scored] values from each rank's piece (None stays None)."""
    return None if local is None else _GatherScored.apply(local, counts)
