"""A health line before the first step: the devices and their free memory, the collective library's version and a
measured all-reduce bandwidth between the ranks, and the free disk space of the output directory against the size
of one training state, each with a warning where it is far off (a cluster whose all-reduce crawls because of a
wrong network setting, a disk that cannot hold the next checkpoint).

The bandwidth is the bus bandwidth of an all-reduce (bytes x 2 (n - 1) / n per second, as nccl-tests reports it),
timed on a buffer of a few hundred MB on GPUs (8 MB on CPU) after one warm-up; well under a second on a sound link.
"""

import shutil
import socket
import time

import torch
import torch.distributed as dist

# Floors well below what each kind of link gives (bus bandwidth, GB/s): NVLink 150-450 on one node, PCIe 10-25,
# InfiniBand or RoCE between nodes 10-50. A figure under its floor means something is wrong with the link.
FLOOR_GB_S = {"one node": 5.0, "between nodes": 2.0}


def allreduce_bus_gb_s(device: torch.device, num_bytes: int) -> float:
    """Collective: the all-reduce bus bandwidth over every rank of the default group, in GB/s."""
    world = dist.get_world_size()
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(buffer)  # warm-up: connections and buffers
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(buffer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = max(time.perf_counter() - start, 1e-9)
    return num_bytes * 2 * (world - 1) / world / seconds / 1e9


def state_bytes(num_params: int) -> int:
    """About the size of one training state: fp32 weights and AdamW's two fp32 moments per parameter."""
    return 12 * num_params


def size(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.1f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.1f} MB"


def layout_note(world: int, nodes: int, shard_size: int | None, sequence_parallel: int) -> str:
    """How the training ranks split the work, as --shard-size and --sequence-parallel set it up: FSDP over all of them
    or hybrid (sharded within groups, replicated across), and sequence-parallel groups."""
    size = shard_size or world
    groups = world // size
    note = f"FSDP over {world} rank{'s' if world > 1 else ''}" if groups == 1 else \
        f"FSDP replicated on each of {world} ranks (--shard-size 1: no sharding)" if size == 1 else \
        f"hybrid FSDP: sharded within each of {groups} groups of {size} ranks, replicated across them"
    note += f" on {nodes} node{'s' if nodes > 1 else ''}"
    if sequence_parallel > 1:
        note += f", sequences split over groups of {sequence_parallel}"
    return note


def health_report(device: torch.device, output_dir: str, num_params: int, shard_size: int | None = None,
                  sequence_parallel: int = 1) -> list[str]:
    """Collective over the default group: the health line, then any warnings. num_params: the parameters a training
    state holds (of every model trained); shard_size, sequence_parallel: the run's --shard-size and
    --sequence-parallel."""
    world = dist.get_world_size()
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = len(set(hosts))
    parts = []
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        seen = [None] * world
        dist.all_gather_object(seen, (torch.cuda.get_device_name(device), free / 1e9))
        names = sorted({name for name, _ in seen})
        low, high = min(f for _, f in seen), max(f for _, f in seen)
        parts.append(f"{world} x {' / '.join(names)} (free memory {low:.1f}-{high:.1f} of {total / 1e9:.1f} GB)")
        parts.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    else:
        parts.append(f"{world} CPU process{'es' if world > 1 else ''} (gloo)")
    parts.append(layout_note(world, nodes, shard_size, sequence_parallel))
    warnings = []
    if world > 1:
        link = "one node" if nodes == 1 else "between nodes"
        gb_s = allreduce_bus_gb_s(device, 256 * 2**20 if device.type == "cuda" else 8 * 2**20)
        parts.append(f"all-reduce {gb_s:.1f} GB/s bus bandwidth ({link})")
        if device.type == "cuda" and gb_s < FLOOR_GB_S[link]:
            warnings.append(f"warning: all-reduce runs at {gb_s:.1f} GB/s over {world} GPUs {link}, far below what "
                            f"the link should give (at least {FLOOR_GB_S[link]:g}): check the network (NCCL_DEBUG=INFO "
                            f"shows the transport; a wrong MTU or a missing InfiniBand driver falls back to slow TCP)")
    disk = shutil.disk_usage(output_dir).free
    state = state_bytes(num_params)
    parts.append(f"disk {size(disk)} free, a training state about {size(state)}")
    if disk < 2 * state:
        warnings.append(f"warning: {output_dir} has {size(disk)} free, room for fewer than two training states of "
                        f"about {size(state)} each: a save may fail (--keep-checkpoints sets how many are kept)")
    return ["health: " + "; ".join(parts), *warnings]
