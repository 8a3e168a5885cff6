"""Split placement: some ranks only train, others only generate, and the two sides talk over a small link.

`torchrun --nproc_per_node N script.py --rollout-ranks K` makes the first N - K ranks trainers and the last K
rollout ranks. Each side gets a torch.distributed world of its own (its default process group): the trainers run
FSDP2 over theirs exactly as in colocated mode, and vLLM's `external_launcher` on the rollout ranks sees a world of
K ranks, its tensor-parallel groups among them. The link joins trainer 0 with every rollout rank through two
process groups built on torchrun's store: a gloo one for samples (pickled Python objects) and one on the device's
backend (NCCL on GPUs) for weights, streamed in size-bounded buckets after each update.

Stopping (a stop signal on any rank): every update the trainers complete is saved. A rollout rank that gets the
signal finishes the batch in hand and sends it flagged `stop`, so the trainers train it, save and stop; trainers
that stop send the STOP header where the next version would go, and take (and drop) whatever the rollout ranks still
send, up to their last message, `{"step": "stopped"}`. Nothing is cut in the middle: both sides leave after their
usual closing meeting on the link.

Versions: the weights after k optimizer updates are version k. The batch trained at step k (1-based) is generated
with version k - 1 in synchronous mode, and with version max(start, k - 1 - max_staleness) with --async-rollout:
the rollout ranks generate batch k + 1 while the trainers train on batch k. Both sides compute the same schedule
of versions the trainers send (`weight_versions`), so every message on the link pairs up without a handshake.

In-flight updates (--async-rollout --partial-rollouts): a rollout phase starts from version max(start, k - 2), one
batch ahead of the trainers, and takes every newer version as it comes, between two engine steps: trainer 0 writes
each header (its version, or STOP) in torchrun's store under its index before it broadcasts it, and a rollout rank
that finds the next index there cuts its running responses, joins the broadcast, and continues them under the new
weights (common/rollout/partial.py). Evaluated versions are taken at a phase's end only (an evaluation needs the
engine to itself): the trainers wait for that phase.
"""

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from common.run.distributed import init_distributed, launch_store, use_store
from common.train.model import init_sharding
from common.train.sequence_parallel import init_sequence_parallel
from sharding.vllm_sync import buckets, hf_name, num_bytes


@dataclass
class Placement:
    role: str  # "colocated" (every rank trains and generates), "train" or "rollout"
    rank: int  # within the role's own world (the default process group)
    world: int
    num_trainers: int
    num_rollout: int
    samples_link: object = None  # gloo process group: trainer 0 (link rank 0) and rollout rank r (link rank 1 + r)
    weights_link: object = None  # the same members, on the device's backend
    store: object = None  # torchrun's store (link members): trainer 0 writes each weight header there too
    headers: int = 0  # the headers trainer 0 has sent, or a rollout rank received

    @property
    def on_link(self) -> bool:
        return self.samples_link is not None

    @property
    def split(self) -> bool:
        return self.role != "colocated"

    @property
    def trains(self) -> bool:
        return self.role != "rollout"


def init_placement(num_rollout: int, sequence_parallel: int = 1,
                   shard_size: int | None = None) -> tuple[Placement, torch.device]:
    """Collective over every process torchrun started: with num_rollout 0 one world where every rank trains and
    generates; else the split worlds below. The training ranks form sequence-parallel groups of `sequence_parallel`
    (common/train/sequence_parallel.py) and shard models within groups of `shard_size` (common/train/model.py's
    init_sharding)."""
    if num_rollout:
        placement, device = init_split(num_rollout)
    else:
        rank, world, device = init_distributed()
        placement = Placement("colocated", rank, world, world, 0)
    if placement.trains:
        init_sequence_parallel(sequence_parallel)
        init_sharding(shard_size, device)
    return placement, device


def init_split(num_rollout: int, timeout_minutes: int = 30) -> tuple[Placement, torch.device]:
    """Collective over every process torchrun started: the two role worlds and the link between them."""
    import os
    if "RANK" not in os.environ:
        raise ValueError("--rollout-ranks needs several processes: launch with torchrun --nproc_per_node N")
    store, global_rank, global_world = launch_store()
    store.set_timeout(timedelta(minutes=timeout_minutes))
    use_store(store, global_rank, global_world)
    num_trainers = global_world - num_rollout
    if not 0 < num_rollout < global_world:
        raise ValueError(f"--rollout-ranks {num_rollout} must leave at least one of the {global_world} ranks to train")
    role = "rollout" if global_rank >= num_trainers else "train"
    rank = global_rank - num_trainers if role == "rollout" else global_rank
    world = num_rollout if role == "rollout" else num_trainers
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # The trainers wait in collectives while the rollout ranks start vLLM, generate and evaluate: the same
    # generous timeout on every group.
    timeout = timedelta(minutes=timeout_minutes)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.PrefixStore(f"nanorl_{role}", store),
                            rank=rank, world_size=world, timeout=timeout, **({"device_id": device} if cuda else {}))
    # Code that reads the launcher's variables (vLLM's external_launcher reads RANK) sees its role's world.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    placement = Placement(role, rank, world, num_trainers, num_rollout)
    if global_rank == 0 or role == "rollout":
        placement.store = store
        link_rank = 0 if role == "train" else 1 + rank
        placement.samples_link = dist.ProcessGroupGloo(dist.PrefixStore("nanorl_link_samples", store), link_rank,
                                                       1 + num_rollout, timeout)
        weights_store = dist.PrefixStore("nanorl_link_weights", store)
        if cuda:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            placement.weights_link = dist.ProcessGroupNCCL(weights_store, link_rank, 1 + num_rollout, options)
        else:
            placement.weights_link = dist.ProcessGroupGloo(weights_store, link_rank, 1 + num_rollout, timeout)
    return placement, device


def close_link(placement: Placement) -> None:
    """Collective over the link, at the end of a run: its members meet once more. The link's groups are left
    alone, never destroyed: their C++ teardown racing with the peer's is a way for a gloo thread to abort the
    process, and every split-placement process ends with os._exit (common.run.distributed.finish_distributed)."""
    if placement.on_link:
        placement.samples_link.allreduce([torch.zeros(1)]).wait()


# ---------------------------------------------------------------------------------------------------------------
# Versions and staleness: the schedule both sides follow.

def behaviour_version(step: int, start_step: int, max_staleness: int) -> int:
    """The weight version the batch for `step` is generated with: step - 1 when synchronous (max_staleness 0),
    up to max_staleness versions older with async rollouts, never older than the version the run started from."""
    return max(start_step, step - 1 - max_staleness)


def in_flight_updates(args) -> bool:
    """--async-rollout --partial-rollouts: the rollout ranks take new versions between engine steps."""
    return args.async_rollout and args.partial_rollouts


def generation_lag(args) -> int:
    """How many versions behind the trainers the generation of a batch may start: 0 synchronously, --max-staleness
    with --async-rollout, 1 with in-flight updates (newer versions then come during the phase)."""
    return 1 if in_flight_updates(args) else args.max_staleness if args.async_rollout else 0


def eval_versions(start_step: int, steps: int, eval_every: int) -> list[int]:
    """Versions evaluated on the held-out prompts: the initial weights of a fresh run, every eval_every, the last."""
    first = [0] if start_step == 0 else []
    return first + [k for k in range(start_step + 1, steps + 1) if eval_every and k % eval_every == 0 or k == steps]


def weight_versions(start_step: int, steps: int, max_staleness: int, eval_every: int,
                    in_flight: bool = False) -> list[int]:
    """Versions the trainers send, in order: the starting weights (the rollout engine holds none of its own), each
    version a later batch is generated with (in_flight: every version a later batch could use: each one the
    trainers make before the last), and each version to be evaluated."""
    needed = {behaviour_version(k, start_step, max_staleness) for k in range(start_step + 1, steps + 1)}
    if in_flight:
        needed = set(range(start_step, steps))
    return sorted(needed | set(eval_versions(start_step, steps, eval_every)) | {start_step})


def staleness_metrics(versions: list[int], trainer_version: int, max_staleness: int) -> dict[str, float]:
    """Sums for one rank's samples; raises if a sample is older than allowed (a bookkeeping bug, never expected)."""
    lags = [trainer_version - v for v in versions]
    if lags and (max(lags) > max_staleness or min(lags) < 0):
        raise RuntimeError(f"samples of weight versions {sorted(set(versions))} reached the trainer at version "
                           f"{trainer_version}: staleness must be in [0, {max_staleness}]")
    return {"staleness_sum": float(sum(lags)), "staleness_max": float(max(lags, default=0))}


# ---------------------------------------------------------------------------------------------------------------
# Samples: pickled objects from the rollout ranks to trainer 0.

@dataclass
class PendingSend:
    works: list  # gloo sends complete only once the receiver has posted its receive
    buffers: tuple  # kept alive until then

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def send_object(link, obj, dst: int) -> PendingSend:
    """Starts sending `obj` to link rank `dst` and returns at once; wait() on the result before reusing the link
    for the next object if the receiver must see them in order."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return PendingSend([link.send([size], dst, 0), link.send([payload], dst, 1)], (size, payload))


def recv_object(link, src: int):
    size = torch.zeros(1, dtype=torch.int64)
    link.recv([size], src, 0).wait()
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    link.recv([payload], src, 1).wait()
    return pickle.loads(payload.numpy().tobytes())


# ---------------------------------------------------------------------------------------------------------------
# Weights: trainer 0 broadcasts each version to the rollout ranks in buckets.

def plan_buckets(sizes_bytes: list[int], limit_bytes: int) -> list[list[int]]:
    """The indices of the tensors in each bucket, as the sender's stream groups them (sharding.vllm_sync.buckets)."""
    return list(buckets(range(len(sizes_bytes)), sizes_bytes.__getitem__, limit_bytes))


STOP = -1  # the header that says no more versions come: the trainers have saved and are stopping


def send_header(placement: Placement, version: int, device: torch.device) -> None:
    """Trainer 0: announces the version whose buckets follow (the receivers check it against their schedule); it is
    written in the store first, where rollout ranks that are generating look for it (in-flight updates)."""
    if placement.on_link:
        placement.store.set(f"nanorl_header_{placement.headers}", str(version))
        placement.headers += 1
        placement.weights_link.broadcast(torch.tensor([version], dtype=torch.int64, device=device), 0).wait()


def recv_header(placement: Placement, device: torch.device) -> int:
    header = torch.zeros(1, dtype=torch.int64, device=device)
    placement.weights_link.broadcast(header, 0).wait()
    placement.headers += 1
    return int(header.item())


def next_header(placement: Placement) -> int | None:
    """Rollout ranks, without waiting: the header trainer 0 is sending them (a version or STOP), None if none yet."""
    key = f"nanorl_header_{placement.headers}"
    return int(placement.store.get(key)) if placement.store.check([key]) else None


def stop_rollout_ranks(placement: Placement, device: torch.device) -> None:
    """Trainer 0, when the trainers stop before the last step (their state already saved): STOP instead of the next
    version, then every message the rollout ranks still send (batches no one will train) up to their last one, and
    the link's closing meeting. The rollout ranks may be in the middle of a batch: this waits for it."""
    if not placement.on_link:
        return
    # Not waited for yet: a rollout rank may first have to finish sending a batch, which only completes once it is
    # received below.
    placement.store.set(f"nanorl_header_{placement.headers}", str(STOP))
    header = placement.weights_link.broadcast(torch.tensor([STOP], dtype=torch.int64, device=device), 0)
    for r in range(placement.num_rollout):
        while recv_object(placement.samples_link, 1 + r)["step"] not in ("stopped", None):
            pass
    header.wait()
    close_link(placement)


def check_shapes(trainer_shapes: list[tuple[str, torch.Size]], rollout_shapes: list[tuple[str, torch.Size]],
                 rollout_rank: int) -> None:
    """Trainer 0, once: the receivers split each bucket by their own list of shapes, so it must be the trainer's."""
    if [(n, tuple(s)) for n, s in trainer_shapes] != [(n, tuple(s)) for n, s in rollout_shapes]:
        mismatch = next(((a, b) for a, b in zip(trainer_shapes, rollout_shapes) if a != b),
                        (len(trainer_shapes), len(rollout_shapes)))
        raise ValueError(f"rollout rank {rollout_rank} expects other weights than the trainer sends: {mismatch}")


@torch.no_grad()
def send_weights(placement: Placement, named_tensors, dtype: torch.dtype, bucket_mb: int,
                 device: torch.device) -> int:
    """Trainers (all of them: `named_tensors` gathers each full tensor collectively); trainer 0 broadcasts each
    bucket as one flat tensor. Returns the bytes sent."""
    total = 0
    for bucket in buckets((tensor.to(dtype).flatten() for _, tensor in named_tensors), num_bytes, bucket_mb * 2**20):
        if placement.on_link:
            flat = torch.cat(bucket).to(device)
            placement.weights_link.broadcast(flat, 0).wait()
            total += num_bytes(flat)
    return total


@torch.no_grad()
def recv_weights(placement: Placement, shapes: list[tuple[str, torch.Size]], dtype: torch.dtype, bucket_mb: int,
                 device: torch.device, load) -> int:
    """Rollout ranks: receives one version bucket by bucket; load([(name, tensor), ...]) takes each bucket."""
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for bucket in plan_buckets([s.numel() * element for _, s in shapes], bucket_mb * 2**20):
        flat = torch.empty(sum(shapes[i][1].numel() for i in bucket), dtype=dtype, device=device)
        placement.weights_link.broadcast(flat, 0).wait()
        views = flat.split([shapes[i][1].numel() for i in bucket])
        load([(shapes[i][0], view.view(shapes[i][1])) for i, view in zip(bucket, views)])
        total += flat.numel() * element
    if device.type == "cuda":
        torch.cuda.synchronize()
    return total


def load_into_module(module: torch.nn.Module):
    """A `load` for recv_weights that copies into a plain (unsharded) model's parameters by checkpoint name."""
    params = {hf_name(name): p for name, p in module.named_parameters()}

    def load(bucket):
        for name, tensor in bucket:
            params[name].data.copy_(tensor)
    return load
