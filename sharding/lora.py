"""LoRA adapters (peft's) in the layouts weights leave the trainer in: merged into their base weights (what the
weight sync to vLLM and a full HF export take) and PEFT's adapter files (what `PeftModel.from_pretrained` and vLLM's
LoRA loading read).

peft wraps each adapted linear layer `<layer>` of the model: `<layer>.base_layer.weight` is the frozen base W
[out, in], `<layer>.lora_A.default.weight` is A [r, in] and `<layer>.lora_B.default.weight` is B [out, r], and the
layer computes W x + s B A x with s = alpha / r. Merged, it is the plain linear layer `<layer>.weight` = W + s B A,
the name and shape of the base checkpoint. In PEFT's files an adapter weight is named
`base_model.model.<layer>.lora_A.weight` (no adapter name), beside an adapter_config.json, and a module trained in
full beside the adapters (a critic's value head, `modules_to_save`) is `base_model.model.<module>.weight`.
"""

import os

import torch

ADAPTER = "default"  # the one adapter a model here has: peft's name for it
PEFT_PREFIX = "base_model.model."


def is_lora_layer(module: torch.nn.Module) -> bool:
    """A linear layer peft adapted (lora.Linear: base_layer, lora_A, lora_B)."""
    return hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")


def lora_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """peft's adapted layers of the model (none without LoRA)."""
    return [module for module in model.modules() if is_lora_layer(module)]


def is_adapter_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_trained_weight(name: str, heads: tuple[str, ...]) -> bool:
    """What a LoRA model trains: its adapters, and the modules trained in full beside them (a critic's value head)."""
    return is_adapter_weight(name) or name.split(".", 1)[0] in heads


def base_name(name: str) -> str:
    """The checkpoint name of an adapted layer's base weight: "q_proj.base_layer.weight" -> "q_proj.weight"."""
    return name.replace(".base_layer.", ".")


def adapter_weights(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [r, in], B [out, r], scaling) of an adapted layer's adapter (parameters, possibly FSDP2-sharded)."""
    return layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight, layer.scaling[ADAPTER]


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + s B A of full tensors, computed in fp32 (the caller casts the result to the dtype it sends or saves)."""
    return base.float() + scaling * (b.float() @ a.float())


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """{module name of each adapted layer: its scaling s} (empty without LoRA)."""
    return {name: module.scaling[ADAPTER] for name, module in model.named_modules() if is_lora_layer(module)}


def merged_state_dict(state: dict[str, torch.Tensor], layer_scalings: dict[str, float]) -> dict[str, torch.Tensor]:
    """A full state dict of a LoRA model (the model's own names, full tensors) -> the base architecture's state dict
    with every adapted layer merged (W + s B A under `<layer>.weight`, in fp32: the caller casts)."""
    merged = {}
    for name, tensor in state.items():
        if is_adapter_weight(name):
            continue
        layer = name.removesuffix(".base_layer.weight")
        if layer in layer_scalings:
            a, b = state[f"{layer}.lora_A.{ADAPTER}.weight"], state[f"{layer}.lora_B.{ADAPTER}.weight"]
            tensor = merge(tensor, a, b, layer_scalings[layer])
        merged[base_name(name)] = tensor
    return merged


def peft_file_name(name: str) -> str:
    """The name of a trained weight in PEFT's adapter file: "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    -> "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"."""
    return PEFT_PREFIX + name.replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")


def save_peft_adapter(state: dict[str, torch.Tensor], config, path: str, dtype: torch.dtype) -> None:
    """Writes adapter_model.safetensors (the adapters, and the full weights of config.modules_to_save, in `dtype`)
    and adapter_config.json into `path`. state: the model's full state dict, or its trained part."""
    from safetensors.torch import save_file

    heads = tuple(config.modules_to_save or ())
    tensors = {peft_file_name(name): tensor.to(dtype).contiguous() for name, tensor in state.items()
               if is_trained_weight(name, heads)}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(path)
