"""CPU offload between phases: a script that holds several models (ppo.py: policy, critic, reference) keeps on the
GPU only what the phase at hand uses, and parks the rest (FSDP2 shards, optimizer moments) in CPU memory.

This is offload by phase, as verl's param/optimizer offload: each model computes on the GPU at full speed, and
pays one copy in and one copy out per phase. (FSDP2's CPUOffloadPolicy instead keeps the shards on the CPU for
good, copies each layer in for every forward and backward, and steps the optimizer on the CPU.)

Parking copies the bytes of each GPU storage (a parameter's FSDP2 shard, an Adam moment) into a pinned CPU buffer
and frees the storage in place (`resize_(0)`, as FSDP2 itself frees unsharded weights); bringing it back restores
the bytes into the same storage. Every tensor object stays what it was, on the same device, so the optimizer, FSDP2
and vLLM's sync keep pointing at them; nothing is re-registered. Pinned buffers make both copies several times
faster than pageable memory (module.to("cpu") lands in pageable memory), and are reused from one park to the next.
"""

from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


def storages(part) -> list[torch.UntypedStorage]:
    """The distinct GPU storages behind a model's parameters or an optimizer's state tensors. Adam's `step`
    counters are left out: torch keeps them on the CPU unless the optimizer is capturable or fused, and either way
    they are tiny."""
    if isinstance(part, torch.optim.Optimizer):
        tensors = [v for state in part.state.values() for k, v in state.items() if torch.is_tensor(v) and k != "step"]
    else:
        tensors = list(part.parameters())
    found = {}
    for tensor in tensors:
        tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = tensor.untyped_storage()
        if tensor.is_cuda and storage.nbytes() > 0:
            found.setdefault(storage.data_ptr(), storage)  # FSDP2's shards of one parameter share a padded storage
    return list(found.values())


def as_bytes(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the whole storage, to copy it with tensor ops."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,))


class Offloader:
    """on_gpu(*parts) brings models and optimizers to the GPU for a with-block and parks them on the CPU after it;
    park(*parts) sends them to the CPU now. Disabled (or on a CPU run), both do nothing."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled = enabled and device.type == "cuda"
        self.device = device
        self.parked = {}  # id(part) -> [(storage, pinned CPU buffer)] of a part now in CPU memory
        self.buffers = {}  # (id(part), index) -> pinned buffer, kept for the next park

    def park(self, *parts) -> None:
        if not self.enabled:
            return
        parking = []
        for part in filter(None, parts):
            if id(part) in self.parked:
                continue
            entries = []
            for i, storage in enumerate(storages(part)):
                buffer = self.buffers.get((id(part), i))
                if buffer is None or buffer.numel() != storage.nbytes():
                    buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
                    self.buffers[id(part), i] = buffer
                buffer.copy_(as_bytes(storage, storage.nbytes()), non_blocking=True)
                entries.append((storage, buffer))
            self.parked[id(part)] = entries
            parking += entries
        torch.cuda.synchronize()  # the bytes are in CPU memory before the GPU storages are freed
        for storage, _ in parking:
            storage.resize_(0)
        torch.cuda.empty_cache()  # the freed blocks go back to the driver: vLLM maps its memory from there

    def bring(self, *parts) -> None:
        for part in filter(None, parts):
            for storage, buffer in self.parked.pop(id(part), []):
                storage.resize_(buffer.numel())
                as_bytes(storage, buffer.numel()).copy_(buffer, non_blocking=True)
        # FSDP2 reads the shards on its own streams (all-gather copy-in): the copies land before anything runs
        torch.cuda.current_stream().synchronize()

    @contextmanager
    def on_gpu(self, *parts):
        if not self.enabled:
            yield
            return
        self.bring(*parts)
        try:
            yield
        finally:
            self.park(*parts)
