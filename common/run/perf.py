"""Performance metrics: model FLOPs utilisation and GPU memory, as logged every step on GPUs. The MFU counts the
parameters a token computes with (flop_weighted_params): a frozen one at 4 of 6 FLOPs, a mixture of experts' expert
weights at the share of them a token runs through."""

import time

import torch

from common.run.distributed import max_over_ranks
from common.run.gpus import GPUS
from sharding.vllm_moe import expert_count, is_moe


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, (flops, _, _) in GPUS.items() if key in name), None)


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


def active_share(config) -> float:
    """The share of a layer's experts each token runs through (top k of them): what an expert weight counts for in
    FLOPs per token, and so in MFU. 1 for a model without experts."""
    if config is None or not is_moe(config):
        return 1.0
    return config.get_text_config().num_experts_per_tok / expert_count(config)


def flop_weighted_params(models: list[torch.nn.Module]) -> tuple[int, float]:
    """(parameters a training state holds, parameters as MFU counts them) of the models that train: a frozen
    parameter takes no weight gradient, so 4 of a trained one's 6 FLOPs per token (forward, gradient of the input);
    a mixture-of-experts layer's expert weights count for the share of them a token runs through (its active
    parameters: top k of the experts)."""
    trained, counted = 0, 0.0
    for model in models:
        share = active_share(getattr(model, "config", None))
        for name, param in model.named_parameters():
            n = param.numel() * (share if ".experts." in name else 1.0)
            trained += param.numel() if param.requires_grad else 0
            counted += n if param.requires_grad else n * 4 / 6
    return trained, counted


def mfu(num_params: int, tokens: float, seconds: float, peak: float | None, num_gpus: int = 1) -> float | None:
    """Model FLOPs utilisation: 6 x parameters x tokens (forward + backward matmuls, no attention) / time / peak.
    tokens: processed by num_gpus GPUs together in `seconds`; peak: one GPU's bf16 FLOP/s (peak_flops)."""
    if peak is None or seconds <= 0:
        return None
    return 6 * num_params * tokens / seconds / (peak * num_gpus)


class StepPerf:
    """A trainer's per-step performance figures: the update's MFU and, on GPUs, the step's peak memory on the
    fullest GPU (generation included). `start()` at the start of the step's training phases, `metrics()` at its end."""

    def __init__(self, num_params: int, device: torch.device, num_gpus: int):
        self.num_params, self.device, self.num_gpus, self.peak = num_params, device, num_gpus, peak_flops(device)
        self.memory = None

    def start(self) -> None:
        self.memory = TrainingMemoryPeak(self.device) if self.device.type == "cuda" else None

    def metrics(self, trained_tokens: float, update_seconds: float, rollout_memory: int = 0) -> dict[str, float]:
        """Collective on GPUs. trained_tokens: tokens the update's passes took over all ranks (times epochs)."""
        out = {}
        if (value := mfu(self.num_params, trained_tokens, update_seconds, self.peak, self.num_gpus)):
            out["perf/mfu"] = value
        if self.memory is not None:
            out["perf/peak_memory_gb"] = max_over_ranks(max(rollout_memory, self.memory.peak()) / 1e9, self.device)
        return out

    def step_metrics(self, tokens: float, timer, rollout_memory: int = 0,
                     trained_tokens: float | None = None) -> dict[str, float]:
        """Collective on GPUs, at the end of a step: its wall time since `timer` (common/run/logger.py's StageTimer)
        started it, its throughput (tokens: every prompt and response token of the step, over all ranks) and
        metrics() of its update (the seconds of the timer's "update" stage; trained_tokens: as metrics() takes them,
        unset: `tokens`)."""
        seconds = time.perf_counter() - timer.step_start
        return {"time/step": seconds, "perf/tokens_per_s": tokens / seconds,
                **self.metrics(tokens if trained_tokens is None else trained_tokens, timer.seconds["time/update"],
                               rollout_memory)}
