"""A LoRA policy's adapters into vLLM's own LoRA layers (`LLM(enable_lora=True)`), instead of merged weights: vLLM
loads the frozen base once, and each update sends it the adapters alone, as a PEFT directory it reads (a new name
and id per version: vLLM keeps adapters cached by id and its prefix cache keyed by name, so a reused one could serve
stale weights).

With LoRA on, vLLM wraps each adapted layer (qkv_proj, gate_up_proj, o_proj, down_proj), whose weights move to
`<module>.base_layer.<weight>` (`lora_base_names` maps the checkpoint's names there). A loaded adapter lives in each
wrapper's `lora_a_stacked` / `lora_b_stacked`, one tensor per fused part (q, k, v; gate, up), [slots, 1, max rank,
in] and [slots, 1, out, max rank], with its scaling alpha / r multiplied into B after the cast to vLLM's dtype.
Tensor parallelism slices B's rows in column-parallel parts (kv heads shared by several ranks when there are fewer
of them than ranks) and A's columns in row-parallel ones (o_proj, down_proj); `adapter_slices` says which slice of
the trainer's full A and B each rank's buffers must equal, for the check after a sync.
"""

import os

import torch

from sharding.lora import save_peft_adapter

MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def vllm_max_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank` (its kernels compute at that rank)."""
    for allowed in MAX_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"--lora-rank {rank}: vLLM's LoRA layers take ranks up to {MAX_RANKS[-1]}; --lora-sync merged "
                     f"has no limit")


def is_vllm_lora_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "base_layer") and hasattr(module, "lora_a_stacked")


def fused_module(vllm_model: torch.nn.Module, module: str) -> tuple[str, int | None]:
    """vLLM's module for a checkpoint module and the part of it the module is: "...self_attn.k_proj" ->
    ("...self_attn.qkv_proj", 1) by the model's packed_modules_mapping; a module vLLM does not fuse: (itself, None)."""
    part_of = {part: (fused, index) for fused, parts in getattr(vllm_model, "packed_modules_mapping", {}).items()
               for index, part in enumerate(parts)}
    parent, _, last = module.rpartition(".")
    if last not in part_of:
        return module, None
    fused, index = part_of[last]
    return (f"{parent}.{fused}" if parent else fused), index


def lora_base_names(vllm_model: torch.nn.Module):
    """A function from a checkpoint name ("...self_attn.q_proj.weight") to the name vLLM's loader takes once the layer
    is wrapped ("...self_attn.q_proj.base_layer.weight"; the loader then fuses q_proj into qkv_proj as usual)."""
    wrapped = {name for name, module in vllm_model.named_modules() if is_vllm_lora_layer(module)}

    def rename(name: str) -> str:
        module, _, leaf = name.rpartition(".")
        return f"{module}.base_layer.{leaf}" if fused_module(vllm_model, module)[0] in wrapped else name
    return rename


def write_adapter(adapters: dict[str, torch.Tensor], config, path: str, dtype: torch.dtype) -> int:
    """Writes a PEFT adapter directory vLLM's LoRARequest reads (adapters: the model's own names of A and B, full
    tensors); returns the bytes written."""
    save_peft_adapter(adapters, config, path, dtype)
    return os.path.getsize(os.path.join(path, "adapter_model.safetensors"))


def adapter_slices(vllm_model: torch.nn.Module, slot: int, layer: str, a: torch.Tensor, b: torch.Tensor,
                   scaling: float):
    """Where the trainer's adapter of `layer` (a checkpoint module name, e.g. "model.layers.0.self_attn.k_proj"; full
    A [r, in] and B [out, r]) lives in this rank's vLLM LoRA buffers of `slot`: [(view of vLLM's buffer, the tensor
    it must equal)], padding past rank r included (zero). Expected values are computed as vLLM does: A and B cast to
    its dtype, then B times scaling."""
    fused, index = fused_module(vllm_model, layer)
    module, index = vllm_model.get_submodule(fused), index or 0
    got_a, got_b = module.lora_a_stacked[index][slot, 0], module.lora_b_stacked[index][slot, 0]
    a, b = a.to(got_a.device, got_a.dtype), b.to(got_b.device, got_b.dtype) * scaling
    if hasattr(module, "output_ids"):  # column-parallel parts: this rank's rows of B
        size = module.output_slices[index]
        b = b.narrow(0, module.output_ids[index] * size, size)
    elif module.tp_size > 1:  # row-parallel: this rank's columns of A
        a = a.narrow(1, module.tp_rank * module.input_size, module.input_size)
    r = a.shape[0]
    return [(got_a[:r], a), (got_b[:, :r], b), (got_a[r:], torch.zeros_like(got_a[r:])),
            (got_b[:, r:], torch.zeros_like(got_b[:, r:]))]
