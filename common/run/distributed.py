"""torch.distributed set-up shared by every script: NCCL on GPUs, gloo on CPU, and errors that stop all ranks.

The key idea for errors: a rank that fails alone leaves the others waiting forever in their next collective.
So failures that can happen on one rank (a reward function that raises, say) are caught, shared with every rank,
and raised everywhere with the failing rank's message.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from common.run import errors

kv_store = None  # torchrun's key-value store: reaches every process of the launch, whatever its role
launch_rank, launch_world = 0, 1


def init_distributed() -> tuple[int, int, torch.device]:
    """Returns (rank, world_size, device). Works under torchrun and as a plain `python script.py` (1 process)."""
    if "RANK" not in os.environ:  # plain python: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
    local_rank = int(os.environ["LOCAL_RANK"])
    store, rank, world = launch_store()
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    use_store(store, rank, world)
    return rank, world, device


def launch_store() -> tuple[object, int, int]:
    """(store, rank, world) of this launch. Where the workers share torchrun's own store (its default), the store
    outlives torchrun's restarts of the workers (--max-restarts), and what an earlier attempt wrote there (its ranks'
    addresses, the run directory's decision) must not be taken for this attempt's: each attempt gets a prefix of its
    own. On one node torchrun counts the attempts for every worker alike; across nodes the counts can differ (only
    the node whose worker failed counts a restart), so multi-node launches set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (scripts/slurm_grpo.sh does), which gives every attempt a fresh store and needs no prefix."""
    store, rank, world = next(dist.rendezvous("env://"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store, rank, world
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")):
        if rank == 0:
            print("warning: torchrun --max-restarts over several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                  "every node's environment: without it a restart can hang in its start-up", file=sys.stderr)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"nanorl_attempt_{attempt}", store), rank, world


def use_store(store, global_rank: int, global_world: int = 1) -> None:
    """The store every process of the launch shares (set once the processes have met); each process leaves its pid
    there (tests signal every process of a launch through it: common.run.signals.signal_point)."""
    global kv_store, launch_rank, launch_world
    kv_store, launch_rank, launch_world = store, global_rank, global_world
    errors.use_store(store, global_rank)
    if store is not None:
        store.set(f"nanorl/pid/{global_rank}", str(os.getpid()))


def decided_by_rank0(name: str, decide):
    """Collective over every process of the launch (both roles in split placement): rank 0 of the launch runs
    decide() and every process returns its (JSON-serialisable) result; if it raises, every process raises: rank 0
    its own error, the others PeerFailed. For decisions only one process may take (the lock on a run directory)."""
    key = f"nanorl/decided/{name}"
    if launch_rank == 0:
        try:
            result = decide()
        except Exception as e:
            kv_store.set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        kv_store.set(key, json.dumps({"result": result}))
        return result
    message = json.loads(kv_store.get(key))  # waits for rank 0
    if "error" in message:
        raise errors.PeerFailed(f"rank 0 failed: {message['error']}")
    return message["result"]


def finish_distributed(exit_process: bool = False) -> None:
    """Collective, at the end of a run (everything saved and logged): every rank leaves its world together.

    exit_process: end the process right here. Split placement does (grpo.py --rollout-ranks): a CPU run once
    aborted at interpreter exit on a trainer rank (SIGABRT from a background thread of torch.distributed, the
    failure tests/gloo.py describes), which made torchrun report the finished run as failed.
    """
    dist.barrier()  # gloo aborts a rank whose peer tears down first
    dist.destroy_process_group()
    if exit_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def quiet_libraries() -> None:
    """Silences the progress bars and advice HF libraries print once per rank; our own logger speaks for all.
    Through their environment variables, so that a library the run never uses is not imported for it."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def raise_on_all_ranks(error: BaseException | None) -> None:
    """Collective: if any rank passes an error, every rank raises it (named by rank) instead of hanging."""
    messages = [None] * dist.get_world_size()
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if failed:
        rank, message = failed[0]
        if error is not None and rank == dist.get_rank():
            raise error
        raise errors.PeerFailed(f"rank {rank} failed: {message}")


def sum_over_ranks(values: dict[str, float], device: torch.device) -> dict[str, float]:
    """Collective: each named number summed over all ranks, in one all-reduce (every rank passes the same names)."""
    names = sorted(values)
    return dict(zip(names, all_reduce_sum([float(values[name]) for name in names], device)))


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sums a few Python numbers over all ranks in one collective."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def max_over_ranks(value: int | float, device: torch.device) -> int | float:
    """Collective: the largest `value` of all ranks (e.g. the micro-batch count every rank must run)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return type(value)(t.item())
