"""Move the trainer's FSDP2 weights into a vLLM model living in the same process, and check that they arrived.

The key idea: every rank gathers each full parameter (`DTensor.full_tensor`, one collective per parameter, the same
ones in the same order on every rank) and hands it to vLLM's own `load_weights`, which keeps only the slice that
this rank's tensor-parallel shard needs. Tensors go in size-bounded buckets, so the extra memory is about one bucket
and never a whole state dict. The check recomputes, on every rank, the slice vLLM should hold and compares it
element by element with what vLLM actually holds. A LoRA model's adapted layers go as their merged weights
W + s B A (sharding/lora.py), under the base checkpoint's names: vLLM, like the check, sees the base architecture;
or, into a vLLM with LoRA layers of its own (sharding/vllm_lora.py), the base alone, and the adapters apart.
A mixture-of-experts layer's experts go as transformers' fused tensors, which vLLM's loader takes as they are for
the families of sharding/vllm_moe.py (which also says where the check finds each expert).
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from sharding.lora import adapter_weights, base_name, is_adapter_weight, is_lora_layer, merge
from sharding.vllm_lora import adapter_slices, fused_module, is_vllm_lora_layer, lora_base_names
from sharding.vllm_moe import expert_slices, is_vllm_moe_layer

# Wrappers (activation checkpointing, FSDP1, torch.compile) that insert a level into parameter names.
WRAPPER_NAME_PARTS = ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod.")


def hf_name(name: str) -> str:
    """The checkpoint name of a trainer parameter, e.g. "model.layers.0.mlp.up_proj.weight"."""
    for part in WRAPPER_NAME_PARTS:
        name = name.replace(part, "")
    return name.removeprefix("module.")  # DDP


def full_tensor(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole parameter in `dtype` on this rank. Collective for a sharded DTensor: call it on every rank."""
    param = param.detach()
    if isinstance(param, DTensor) and param.device_mesh.size() == 1:  # one GPU: the shard is the whole tensor
        param = param.to_local()  # and plain tensors skip DTensor's per-op overhead
    if not isinstance(param, DTensor):
        return param.to(dtype)
    return param.to(dtype).full_tensor()  # cast the shard first: the all-gather moves half the bytes of fp32


def loaded_parameters(model: torch.nn.Module, tied: bool):
    """(checkpoint name, parameter) of every weight vLLM loads, in the model's order: only parameters (the buffers
    of HF decoder models, rotary inv_freq, are recomputed by vLLM, never loaded), and no lm_head when it is tied
    (vLLM's tied models share embed_tokens and skip "lm_head." when loading). A LoRA model's adapted layers appear
    once, by their base weight under its checkpoint name (trainer_weights merges the adapters into it). Decided by
    names alone, so every rank takes part in the same collectives."""
    for name, param in model.named_parameters():
        name = hf_name(name)
        if is_adapter_weight(name):
            continue  # merged into their base weight
        name = base_name(name)
        if not (tied and name == "lm_head.weight"):
            yield name, param


def weight_shapes(model: torch.nn.Module) -> list[tuple[str, torch.Size]]:
    """(checkpoint name, full shape) of every weight `trainer_weights` yields, in its order; works on any copy of
    the architecture (FSDP2-sharded, plain, or on the meta device)."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    return [(name, p.shape) for name, p in loaded_parameters(model, tied)]


def has_lora_layers(vllm_model: torch.nn.Module | None) -> bool:
    """vLLM built with enable_lora: it takes a LoRA model's base and adapters apart (sharding/vllm_lora.py)."""
    return getattr(vllm_model, "lora_manager", None) is not None


def trainer_weights(model: torch.nn.Module, vllm_model: torch.nn.Module | None, dtype: torch.dtype):
    """Yields (checkpoint name, full tensor) for every weight vLLM loads (`loaded_parameters`), in the same order on
    every rank. vllm_model None: the receiver is not in this process; the trainer's own config says whether the
    head is tied. An adapted layer of a LoRA model gives W + s B A (its three tensors gathered, merged in fp32), or
    its base W alone for a vLLM with LoRA layers of its own.
    """
    config = getattr(vllm_model if vllm_model is not None else model, "config", None)
    tied = getattr(config, "tie_word_embeddings", False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # A forward without backward leaves the root's weights gathered, and named_parameters() would then
            # return that gathered copy, stale after an optimizer step; resharding puts the master weights back.
            module.reshard()
    adapted = {} if has_lora_layers(vllm_model) else \
        {hf_name(name): module for name, module in model.named_modules() if is_lora_layer(module)}
    for name, param in loaded_parameters(model, tied):
        layer = adapted.get(name.removesuffix(".weight"))
        if layer is None:
            yield name, full_tensor(param, dtype)
        else:
            a, b, scaling = adapter_weights(layer)
            base, a, b = (full_tensor(p, p.dtype) for p in (param, a, b))  # gathered as stored: bf16 base, fp32 A, B
            yield name, merge(base, a, b, scaling).to(dtype)


def adapter_tensors(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Collective: {name of each A and B weight ("...q_proj.lora_A.default.weight"): its full tensor in `dtype`} of a
    LoRA model, gathered in the same order on every rank."""
    return {hf_name(name): full_tensor(param, dtype) for name, param in model.named_parameters()
            if is_adapter_weight(hf_name(name))}


def buckets(items, size_of, limit_bytes: int):
    """Yields consecutive `items` in lists whose sizes (size_of(item), bytes) stay within limit_bytes; an item
    bigger than that goes alone. Lazy: a bucket is handed over once the next item would overflow it, so the caller
    holds at most one bucket and one item (a weight stream never gathers a whole state dict)."""
    bucket, bucket_bytes = [], 0
    for item in items:
        size = size_of(item)
        if bucket and bucket_bytes + size > limit_bytes:
            yield bucket
            bucket, bucket_bytes = [], 0
        bucket.append(item)
        bucket_bytes += size
    if bucket:
        yield bucket


def num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@torch.no_grad()
def sync_weights_to_vllm(model: torch.nn.Module, vllm_model: torch.nn.Module, bucket_mb: int,
                         dtype: torch.dtype = torch.bfloat16) -> int:
    """Loads the trainer's current weights into `vllm_model` (vLLM's in-process model); returns the bytes loaded.

    A bucket is loaded once adding the next tensor would take it past `bucket_mb` (a tensor bigger than that,
    like a large embedding, goes alone). Fewer, larger `load_weights` calls amortise vLLM's Python overhead.
    A vLLM with LoRA layers gets the base weights under its wrapped layers' names (their adapters go apart).
    """
    total_bytes, rename = 0, lora_base_names(vllm_model) if has_lora_layers(vllm_model) else (lambda name: name)
    for bucket in buckets(trainer_weights(model, vllm_model, dtype), lambda item: num_bytes(item[1]),
                          bucket_mb * 2**20):
        vllm_model.load_weights([(rename(name), tensor) for name, tensor in bucket])
        total_bytes += sum(num_bytes(tensor) for _, tensor in bucket)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies into vLLM's weights are asynchronous; the caller times the sync
    return total_bytes


def vllm_slices(vllm_model: torch.nn.Module, name: str, full: torch.Tensor):
    """Where the checkpoint tensor `full` lives in this rank's vLLM weights.

    Returns (vLLM parameter name, [(view of vLLM's local tensor, the slice of `full` it must equal), ...]),
    following vLLM's tensor-parallel layouts (vllm/model_executor/layers/linear.py, vocab_parallel_embedding.py):
    - q/k/v_proj are rows of the fused qkv_proj: [q shard | k shard | v shard]. A rank holds q heads
      [tp_rank * n, (tp_rank + 1) * n) and kv heads of shard tp_rank // replicas, where replicas > 1 when
      tp_size > num_kv_heads (each kv head is then copied onto several ranks).
    - gate/up_proj are rows of the fused gate_up_proj: [gate shard | up shard].
    - other column-parallel weights and biases are split along dim 0, row-parallel weights (o_proj, down_proj)
      along dim 1; a row-parallel bias is replicated.
    - embed_tokens / lm_head are split by vocabulary rows; rows past the real vocabulary (padding to a multiple
      of 64 per shard) must be zero.
    - a mixture-of-experts layer's fused experts (gate_up_proj, down_proj) are sliced along the intermediate dim
      in vLLM's fused-MoE layer (sharding/vllm_moe.py).
    - anything else (norms) is replicated and compared whole.
    """
    module_path, param_name = name.rsplit(".", 1)
    leaf = module_path.rpartition(".")[2]
    module_path, index = fused_module(vllm_model, module_path)  # q_proj: part 0 of qkv_proj
    module = vllm_model.get_submodule(module_path)
    if is_vllm_moe_layer(module):
        return expert_slices(module, module_path, param_name, full)

    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if is_vllm_lora_layer(module):  # vLLM's LoRA wrapper: the weights are its base layer's
        module, module_path = module.base_layer, f"{module_path}.base_layer"
    local = getattr(module, param_name).data
    vllm_name = f"{module_path}.{param_name}"

    if isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)) and index is None:
        raise NotImplementedError(f"{name}: checkpoints with already fused {leaf} are not supported")
    if isinstance(module, QKVParallelLinear):
        q_size, k_size = module.num_heads * module.head_size, module.num_kv_heads * module.head_size
        v_size = module.num_kv_heads * module.v_head_size
        offset, size = [(0, q_size), (q_size, k_size), (q_size + k_size, v_size)][index]
        shard = module.tp_rank if index == 0 else module.tp_rank // module.num_kv_head_replicas
        return vllm_name, [(local.narrow(0, offset, size), full.narrow(0, shard * size, size))]
    if isinstance(module, MergedColumnParallelLinear):
        sizes = [s // module.tp_size for s in module.output_sizes]
        offset, size = sum(sizes[:index]), sizes[index]
        return vllm_name, [(local.narrow(0, offset, size), full.narrow(0, module.tp_rank * size, size))]
    if isinstance(module, RowParallelLinear):
        if param_name == "bias":
            return vllm_name, [(local, full)]
        size = local.shape[1]
        return vllm_name, [(local, full.narrow(1, module.tp_rank * size, size))]
    if isinstance(module, ColumnParallelLinear):
        size = local.shape[0]
        return vllm_name, [(local, full.narrow(0, module.tp_rank * size, size))]
    if isinstance(module, VocabParallelEmbedding):
        start, end = module.shard_indices.org_vocab_start_index, module.shard_indices.org_vocab_end_index
        rows = end - start
        return vllm_name, [(local[:rows], full[start:end]), (local[rows:], torch.zeros_like(local[rows:]))]
    if isinstance(module, ReplicatedLinear) or local.shape == full.shape:
        return vllm_name, [(local, full)]
    raise NotImplementedError(f"check_weight_sync does not know how {type(module).__name__} shards {name} "
                              f"(vLLM holds {tuple(local.shape)}, the trainer {tuple(full.shape)})")


def compared_slices(model: torch.nn.Module, vllm_model: torch.nn.Module, dtype: torch.dtype, lora_slot: int | None):
    """Collective. Yields (trainer name, vLLM name, [(view of vLLM's tensor, what it must equal)]) for every weight
    vLLM holds, one full tensor at a time, then for the adapter of each LoRA layer in vLLM's `lora_slot`."""
    for name, full in trainer_weights(model, vllm_model, dtype):
        yield name, *vllm_slices(vllm_model, name, full)
    if lora_slot is None:
        return
    for layer, module in model.named_modules():  # the same order on every rank: each A and B gathered in turn
        if is_lora_layer(module):
            layer, (a, b, scaling) = hf_name(layer), adapter_weights(module)
            a, b = (full_tensor(p, torch.float32) for p in (a, b))
            yield f"{layer} adapter", None, adapter_slices(vllm_model, lora_slot, layer, a, b, scaling)


@torch.no_grad()
def check_weight_sync(model: torch.nn.Module, vllm_model: torch.nn.Module, max_reported: int = 5,
                      lora_slot: int | None = None) -> None:
    """Raises RuntimeError on every rank if any rank's vLLM weights differ from the trainer's (cast to vLLM's dtype).

    Collective: call on every rank. Each rank checks its own tensor-parallel shard element by element, against
    the slice of the trainer's full tensor that vLLM's loader would have put there, and also that every vLLM
    parameter received some trainer tensor. The mismatch count is then summed over all ranks, so all ranks fail
    together (naming the tensors where they failed) instead of one rank raising while the others hang.
    The error quotes float64 sums (checksums) of both sides and the largest difference. With vLLM's LoRA layers
    (sharding/vllm_lora.py), the base weights are compared with the trainer's base, and the adapter in `lora_slot`
    of every LoRA buffer with the trainer's adapters.

    Limits: the layouts known are those of Qwen2/Llama-style dense decoders (fused qkv_proj and gate_up_proj,
    column/row-parallel linears, vocab-parallel embeddings, replicated norms) and the MoE families of
    sharding/vllm_moe.py (vLLM's fused experts, tensor-parallel), unquantized, without pipeline or expert
    parallelism. A module of another kind raises NotImplementedError unless it holds the whole tensor.
    The check compares against vLLM's own layout rules, so it finds stale, missing, misnamed or wrongly placed
    weights (a sync that was skipped or overwritten by a wake-up), not a bug inside vLLM's loader; the log-prob
    gap between vLLM and the trainer covers that.
    """
    vllm_params = dict(vllm_model.named_parameters())
    dtype = next(iter(vllm_params.values())).dtype
    covered, mismatches = set(), []
    for name, vllm_name, pairs in compared_slices(model, vllm_model, dtype, lora_slot):
        covered.add(vllm_name)
        for actual, expected in pairs:
            if not torch.equal(actual, expected):
                diff = (actual.float() - expected.float()).abs().max().item()
                mismatches.append(f"{name} -> {vllm_name}: vLLM sum {actual.double().sum().item():.6f}, trainer sum "
                                  f"{expected.double().sum().item():.6f}, max |diff| {diff:.3g}")
                break
    mismatches += [f"{n}: vLLM parameter received no trainer tensor" for n in vllm_params if n not in covered]

    failed_ranks, total = int(bool(mismatches)), len(mismatches)
    if dist.is_initialized():
        count = torch.tensor([failed_ranks, total], device=next(iter(vllm_params.values())).device)
        dist.all_reduce(count)
        failed_ranks, total = count.tolist()
    if mismatches:
        shown = "\n  ".join(mismatches[:max_reported])
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(f"weight sync check failed on rank {rank} ({len(mismatches)} tensors):\n  {shown}")
    if failed_ranks:
        raise RuntimeError(f"weight sync check failed on {failed_ranks} other rank(s), {total} tensors in all")
