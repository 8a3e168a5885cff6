"""Mixture-of-experts layers into vLLM: which families nanorl maps, and where each expert's weights land there.

transformers (5.x) keeps a MoE layer's experts as two fused parameters: `mlp.experts.gate_up_proj` [E, 2I, H] (each
expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I]. vLLM 0.26's fused-MoE layer (`FusedMoE`
builds a MoERunner whose `routed_experts` hold the weights) keeps `w13_weight` [E, 2 I_tp, H] and `w2_weight`
[E, H, I_tp], I_tp = I / tp: every tensor-parallel rank holds every expert, sliced along the intermediate dim (its
gate rows, then its up rows, in w13; the same columns of down_proj in w2), each part possibly padded past its slice.
For the families in MAPPED_MOE, vLLM's loader takes the fused tensors under transformers' own names
(RoutedExperts.load_weights, its 3-D case), so the sync streams them as they are, in buckets like any weight;
`expert_slices` says what the check compares. Any other MoE architecture is refused at start-up
(`check_moe_mapped`): its names or layout may differ, and a sync that does not fail would still load nothing right.
"""

import torch

# model_type of the MoE families whose experts reach vLLM under transformers' names, as vLLM 0.26 loads them.
MAPPED_MOE = ("qwen3_moe", "olmoe")
# The config fields by which transformers' MoE configs give their number of routed experts.
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# vLLM's unquantized MoE kernels that keep the checkpoint's layout (FlashInfer's reorder w13 after loading, so a
# later load_weights would write the wrong layout: Hopper picks Triton, Blackwell FlashInfer).
LAYOUT_KEEPING_BACKENDS = ("TRITON", "BATCHED_TRITON")


def expert_count(config) -> int:
    """The routed experts of each MoE layer of a transformers config (or a multimodal one's text part); 0: dense."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return next((n for n in (getattr(config, f, None) for f in EXPERT_COUNTS) if isinstance(n, int) and n > 0), 0)


def is_moe(config) -> bool:
    return expert_count(config) > 0


def check_moe_mapped(config, model: str | None) -> None:
    """One line, at start-up, for a mixture-of-experts model whose experts the sync cannot map into vLLM."""
    if is_moe(config) and config.model_type not in MAPPED_MOE:
        name = ", ".join(config.architectures or []) or config.model_type
        raise ValueError(f"--model {model}: {name} is a mixture-of-experts model whose experts nanorl cannot map "
                         f"into vLLM (it maps model types {', '.join(MAPPED_MOE)}); use --rollout-engine hf")


def is_vllm_moe_layer(module: torch.nn.Module) -> bool:
    return hasattr(module, "routed_experts")  # vLLM's MoERunner


def check_vllm_moe_layout(vllm_model: torch.nn.Module) -> None:
    """One line, at start-up, where vLLM's MoE layers hold their experts other than as checkpoints lay them out: a
    quantized method or a kernel that reorders them after loading (vLLM reorders them once, after its own load; the
    sync's later loads would write the checkpoint's order under it), or experts spread over ranks."""
    for path, layer in vllm_model.named_modules():
        if not is_vllm_moe_layer(layer):
            continue
        experts = layer.routed_experts
        method = experts.quant_method
        backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
        if type(method).__name__ != "UnquantizedFusedMoEMethod" or backend not in LAYOUT_KEEPING_BACKENDS:
            raise ValueError(f"vLLM runs {path} with {type(method).__name__} ({backend}), whose expert layout the "
                             f"weight sync does not write (it writes that of {', '.join(LAYOUT_KEEPING_BACKENDS)})")
        if experts.local_num_experts != experts.global_num_experts:
            raise ValueError(f"vLLM holds {experts.local_num_experts} of {experts.global_num_experts} experts of "
                             f"{path} on this rank: expert parallelism is not supported")


def expert_slices(layer: torch.nn.Module, path: str, name: str, full: torch.Tensor):
    """Where transformers' fused experts tensor `full` ("gate_up_proj" [E, 2I, H] or "down_proj" [E, H, I]) lives in
    this rank's vLLM MoE layer `layer` (at `path`): (vLLM parameter name, [(view of vLLM's local tensor, the slice of
    `full` it must equal)]), by vLLM's loader (RoutedExperts._load_w13 / _load_w2): rank r holds intermediate rows
    (gate, up) or columns (down) [r n, (r + 1) n) with n = I // tp, at the start of each part; padding is not
    compared (vLLM's loader leaves it alone). The layout is that of check_vllm_moe_layout's kernels."""
    experts = layer.routed_experts
    rank, tp = experts.moe_config.tp_rank, experts.moe_config.tp_size
    if name == "gate_up_proj":
        local, inter, hidden = experts.w13_weight.data, full.shape[1] // 2, full.shape[2]
        n, part = inter // tp, experts.w13_weight.shape[1] // 2  # this rank's rows of gate and of up; padded part
        return f"{path}.routed_experts.w13_weight", [
            (local[:, i * part:i * part + n, :hidden], full[:, i * inter + rank * n:i * inter + (rank + 1) * n])
            for i in (0, 1)]  # gate, then up
    if name == "down_proj":
        local, hidden, n = experts.w2_weight.data, full.shape[1], full.shape[2] // tp
        return f"{path}.routed_experts.w2_weight", [(local[:, :hidden, :n], full[:, :, rank * n:(rank + 1) * n])]
    raise NotImplementedError(f"{path}.{name}: not an experts tensor the check knows (gate_up_proj, down_proj)")
