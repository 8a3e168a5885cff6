"""CPU offload between phases: a script that holds several models (ppo.py: policy, critic, reference) keeps on the
GPU only what the phase at hand uses, and parks the rest (FSDP2 shards, optimizer moments) in CPU memory.

This is offload by phase, as verl's param/optimizer offload: each model computes on the GPU at full speed, and
pays one copy in and one copy out per phase. (FSDP2's CPUOffloadPolicy instead keeps the shards on the CPU for
good, copies each layer in for every forward and backward, and steps the optimizer on the CPU.)
"""

from contextlib import contextmanager

import torch


def move(part, device) -> None:
    """Moves a model's parameters (FSDP2 re-registers its shards after .to()) or an optimizer's state tensors.

    Optimizer state goes non_blocking both ways: a copy to the CPU lands in pinned memory (from torch's caching
    host allocator, so the next offload reuses it), several times faster than pageable memory, and is waited for
    in Offloader.park; copies to the GPU are ordered on the current stream, before the kernels that read them.
    A model goes to the CPU with a blocking copy: inside .to(), FSDP2 re-pads a rank's shorter last shard with a
    CPU copy_ from the tensor just made, which would read a pinned buffer still being filled (ranks whose count
    does not divide a dimension). Adam's `step` counters stay where they are: torch keeps them on the CPU unless
    the optimizer is capturable or fused, and either way they must not change device under it. The Parameter
    objects survive the move, so the optimizer still points at them.
    """
    if isinstance(part, torch.optim.Optimizer):
        for state in part.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
    else:
        part.to(device, non_blocking=torch.device(device).type == "cuda")


class Offloader:
    """on_gpu(*parts) brings models and optimizers to the GPU for a with-block and parks them on the CPU after it;
    park(*parts) sends them to the CPU now. Disabled (or on a CPU run), both do nothing."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled and device.type == "cuda"
        self.device = device

    def park(self, *parts) -> None:
        if not self.enabled:
            return
        for part in filter(None, parts):
            move(part, "cpu")
        torch.cuda.synchronize()  # the copies are done before the CPU side is read, or saved
        torch.cuda.empty_cache()  # the freed blocks go back to the driver: vLLM maps its memory from there

    @contextmanager
    def on_gpu(self, *parts):
        if not self.enabled:
            yield
            return
        for part in filter(None, parts):
            move(part, self.device)
        try:
            yield
        finally:
            self.park(*parts)
