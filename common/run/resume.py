"""Resumable training state: everything needed to continue a run as if it never stopped.

A training-state checkpoint holds the sharded model
and optimizer (torch.distributed.checkpoint, so a run can resume on a different number of ranks), the scheduler,
step, data position, every rank's RNG, and small extras such as the W&B run id. The key idea is atomicity: all of
it is written into `state_<step>.tmp/`, a `COMPLETE` marker goes in last, then the directory is renamed; a run
killed mid-save leaves no directory that `latest_checkpoint` would pick. The marker lists every file with its
size, so a state damaged later (a deleted or truncated shard) is recognised and the previous one used instead.
HF-format export is separate (sharding/checkpoint.py); when a trainer saves, exports and resumes is
common/run/checkpoints.py's `Checkpoints`.

    <output_dir>/state_000010/
        .metadata, __<rank>_0.distcp   model + optimizer shards (DCP)
        trainer_state.json             step, world size, scheduler, sampler, extra
        rng_rank<r>.pt                 Python, NumPy, torch (CPU and CUDA) RNG of rank r
        rollouts_rank<r>.pt            --partial-rollouts: rank r's responses in flight, continued on resume
        COMPLETE                       {"files": {name: size in bytes}}
"""

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from common.run.distributed import raise_on_all_ranks

# What a state holds of a model that trains: its trained parameters (all of them, or a LoRA model's adapters); loading
# it leaves the frozen ones as --model gave them.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
LOAD_TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True, strict=False)
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
CHECKPOINT_NAME = re.compile(r"state_(\d+)")  # full match only: state_000010.tmp / .old are never loaded


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _fsync_dir(path: str) -> None:
    """Makes a rename or a new file inside `path` survive a machine crash, not just a killed process."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: str, write) -> None:
    """write(file) then fsync, so the COMPLETE marker written after it never outlives the data it vouches for."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict:
    numpy_state = np.random.get_state(legacy=False)
    numpy_state["state"]["key"] = numpy_state["state"]["key"].tolist()  # plain ints: loads with weights_only=True
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device (init_distributed sets it)
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    numpy_state["state"]["key"] = np.array(numpy_state["state"]["key"], dtype=np.uint32)
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _seed_rng(step: int, rank: int) -> None:
    seed = (step * 1_000_003 + rank) % 2**32
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def save_training_state(path_root: str, step: int, model, optimizer, scheduler, sampler, extra: dict,
                        more: dict | None = None) -> str:
    """Collective: every rank calls it. Writes <path_root>/state_<step:06d> atomically and returns its path.

    scheduler and sampler may be None; extra must be JSON-serialisable (e.g. {"wandb_run_id": ...}).
    more: other trained models, {name: (model, optimizer, scheduler)} (PPO's critic), saved alongside.
    path_root must be a filesystem every rank sees (shared across nodes).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    final = os.path.join(path_root, f"state_{step:06d}")
    tmp = final + ".tmp"
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            os.makedirs(tmp)
        except OSError as e:
            error = e
    raise_on_all_ranks(error)  # also the barrier: the directory exists before anyone writes into it

    dcp.save(_sharded_state(model, optimizer, more), checkpoint_id=tmp)  # raises on every rank
    try:
        _write_synced(os.path.join(tmp, f"rng_rank{rank}.pt"), lambda f: torch.save(_rng_state(), f))
        rank_state = sampler.rank_state_dict() if hasattr(sampler, "rank_state_dict") else None
        if rank_state is not None:  # what this rank alone holds (partial rollouts' responses in flight)
            _write_synced(os.path.join(tmp, f"rollouts_rank{rank}.pt"), lambda f: torch.save(rank_state, f))
        if rank == 0:
            trainer_state = {"step": step, "world_size": world,
                             "scheduler": None if scheduler is None else scheduler.state_dict(),
                             "sampler": None if sampler is None else sampler.state_dict(), "extra": extra,
                             "schedulers": {name: s.state_dict() for name, (_, _, s) in (more or {}).items()
                                            if s is not None}}
            _write_synced(os.path.join(tmp, TRAINER_STATE),
                          lambda f: f.write(json.dumps(trainer_state, indent=1).encode()))
    except Exception as e:  # noqa: BLE001 - re-raised on every rank below
        error = e
    raise_on_all_ranks(error)  # every rank has written its part

    if rank == 0:
        try:
            files = {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
            _write_synced(os.path.join(tmp, COMPLETE), lambda f: f.write(json.dumps({"files": files}).encode()))
            _fsync_dir(tmp)
            if os.path.exists(final):  # saving the same step again: move the old one aside first, never half-delete
                shutil.rmtree(final + ".old", ignore_errors=True)
                os.replace(final, final + ".old")
            os.replace(tmp, final)
            _fsync_dir(path_root)
            shutil.rmtree(final + ".old", ignore_errors=True)
        except OSError as e:
            error = e
    raise_on_all_ranks(error)  # no rank goes on (or exits) before the checkpoint is complete
    return final


def latest_checkpoint(path_root: str) -> str | None:
    """The newest state_<step> directory under path_root holding its COMPLETE marker, or None."""
    if not os.path.isdir(path_root):
        return None
    steps = [int(match.group(1)) for name in os.listdir(path_root)
             if (match := CHECKPOINT_NAME.fullmatch(name)) and os.path.isfile(os.path.join(path_root, name, COMPLETE))]
    return os.path.join(path_root, f"state_{max(steps):06d}") if steps else None


def checkpoint_damage(path: str) -> str | None:
    """What is wrong with a complete checkpoint's files (missing or of another size than saved), or None."""
    with open(os.path.join(path, COMPLETE)) as f:
        try:
            files = json.load(f)["files"]
        except (json.JSONDecodeError, KeyError, TypeError):
            return None  # a marker from before manifests: nothing to check against
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes instead of {size}"
    return None


def newest_intact_checkpoint(path_root: str) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint whose files are all there, and a warning for each newer one that is damaged."""
    warnings = []
    if not os.path.isdir(path_root):
        return None, warnings
    steps = sorted((int(match.group(1)) for name in os.listdir(path_root)
                    if (match := CHECKPOINT_NAME.fullmatch(name))
                    and os.path.isfile(os.path.join(path_root, name, COMPLETE))), reverse=True)
    for step in steps:
        path = os.path.join(path_root, f"state_{step:06d}")
        damage = checkpoint_damage(path)
        if damage is None:
            return path, warnings
        warnings.append(f"warning: {path} is damaged ({damage}); using the previous complete state instead")
    return None, warnings


def read_trainer_state(path: str) -> dict:
    """{"step", "world_size", "scheduler", "sampler", "extra"} of a checkpoint, without loading the model: what a
    script needs before building anything heavy (e.g. the W&B run id for the logger)."""
    with open(os.path.join(path, TRAINER_STATE)) as f:
        return json.load(f)


def _sharded_state(model, optimizer, more: dict | None) -> dict:
    """This rank's shards (DTensors, no gather) of every model and optimizer, under the names they are saved with: of
    a model that trains, its trained parameters (a LoRA model's adapters, not its frozen base, which --model gives)."""
    state = {}
    for prefix, (m, o) in [("", (model, optimizer)), *((f"{name}_", pair[:2]) for name, pair in (more or {}).items())]:
        if o is None:  # a model trained otherwise (DPO's moving reference)
            state[prefix + "model"] = get_model_state_dict(m)
        else:
            state[prefix + "model"], state[prefix + "optimizer"] = get_state_dict(m, o, options=TRAINED_ONLY)
    return state


def load_training_state(path: str, model, optimizer, scheduler, sampler, more: dict | None = None) -> dict:
    """Collective. Restores model, optimizer, scheduler, sampler and this rank's RNG from a save_training_state dir.

    Returns {"step", "extra", "saved_world_size", "exact_rng"}. The model and optimizer reshard to any world size.
    The RNG comes back exactly only at the saved world size; otherwise every rank is seeded from (step, rank)
    and exact_rng is False. The sampler's position is over the global prompt stream, so it carries over to any
    world size with the same --prompts-per-step.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    error, trainer_state = None, None
    try:
        if not os.path.isfile(os.path.join(path, COMPLETE)):
            raise ValueError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
        trainer_state = read_trainer_state(path)
    except Exception as e:  # noqa: BLE001 - re-raised on every rank below
        error = e
    raise_on_all_ranks(error)

    # get_state_dict gives the structure to load into (this run's shards, an initialised optimizer state);
    # dcp.load fills it from whatever sharding the checkpoint was written with.
    state = _sharded_state(model, optimizer, more)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # DCP raises on every rank; its message does not say which checkpoint
        raise ValueError(f"could not load the training state {path} (damaged? --resume with an older state_<step> "
                         f"directory uses that one): {' '.join(str(e).split())[:300]}") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=LOAD_TRAINED_ONLY)
    for name, (m, o, s) in (more or {}).items():
        if o is None:
            set_model_state_dict(m, state[f"{name}_model"])
            continue
        set_state_dict(m, o, model_state_dict=state[f"{name}_model"], optim_state_dict=state[f"{name}_optimizer"],
                       options=LOAD_TRAINED_ONLY)
        s.load_state_dict(trainer_state["schedulers"][name])
    if scheduler is not None:
        scheduler.load_state_dict(trainer_state["scheduler"])
    if sampler is not None:
        sampler.load_state_dict(trainer_state["sampler"])

    step, saved_world = trainer_state["step"], trainer_state["world_size"]
    files = [os.path.join(path, f"rollouts_rank{r}.pt") for r in range(saved_world)]
    saved = [torch.load(f, weights_only=True) for f in files if os.path.isfile(f)]
    if saved:  # this rank's own part at the same world size; else every rank's, to count what is dropped
        sampler.load_rank_state_dict(saved[rank] if saved_world == world else None, saved)
    rng_file = os.path.join(path, f"rng_rank{rank}.pt")
    exact_rng = saved_world == world and os.path.isfile(rng_file)
    if exact_rng:
        _set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        _seed_rng(step, rank)
    return {"step": step, "extra": trainer_state["extra"], "saved_world_size": saved_world, "exact_rng": exact_rng}


def prune_checkpoints(path_root: str, keep: int) -> None:
    """Deletes all but the newest `keep` complete checkpoints (keep <= 0 keeps all), and leftovers of killed saves.

    Only rank 0 deletes; call it between saves (after save_training_state returned), never during one.
    """
    if _rank() != 0 or not os.path.isdir(path_root):
        return
    complete, leftovers = [], []
    for name in os.listdir(path_root):
        if (match := re.fullmatch(r"state_(\d+)(\.tmp|\.old)?", name)) is None:
            continue
        if match.group(2) is None and os.path.isfile(os.path.join(path_root, name, COMPLETE)):
            complete.append(int(match.group(1)))
        else:
            leftovers.append(name)
    old = sorted(complete)[:-keep] if keep > 0 else []
    for step in old:
        # Renamed before deleting: a deletion killed halfway must not leave a COMPLETE-marked directory with
        # missing shards behind.
        name = f"state_{step:06d}"
        os.replace(os.path.join(path_root, name), os.path.join(path_root, name + ".old"))
        leftovers.append(name + ".old")
    for name in leftovers:
        shutil.rmtree(os.path.join(path_root, name), ignore_errors=True)


def resolve_resume(spec: str, output_dir: str) -> str | None:
    """The checkpoint a --resume value names: "auto" -> the latest complete one in output_dir (None if there is
    none), "none" or "" -> None, else a checkpoint directory that must exist and be complete."""
    if spec == "auto":
        return latest_checkpoint(output_dir)
    if spec in ("none", ""):
        return None
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"--resume {spec}: no such checkpoint directory")
    if not os.path.isfile(os.path.join(spec, COMPLETE)):
        inside = latest_checkpoint(spec)
        hint = f"; did you mean {inside}?" if inside else ""
        raise ValueError(f"--resume {spec}: not a complete checkpoint (no {COMPLETE} marker: its save was interrupted "
                         f"or it is not a state_<step> directory){hint}")
    if damage := checkpoint_damage(spec):
        raise ValueError(f"--resume {spec}: the checkpoint is damaged ({damage})")
    return spec
