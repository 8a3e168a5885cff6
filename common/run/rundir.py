"""A run's directory: one run per directory, named by its flags, resumed only by the command that made it.

- The default name carries a short hash of the flags that define the run (`grpo_builtin_s1_3fa94c`), so the same
  command resumes its run and a different one starts afresh elsewhere. Flags that only say how long or how the
  run is run (`--steps`, cadences, logging, memory knobs) are left out of the hash: changing them continues the run.
- A lock (`.lock`, flock-ed by the launch's rank 0, naming its pid and host) refuses a second live run in the same
  directory; the kernel drops the lock when its holder dies, so a dead run's lock is simply taken over.
- Each state saves the flags; on resume every flag that differs is printed, and applied, unless it makes the saved
  state meaningless (the model, data, group size, seed...: the script's `fixed` flags), which stops the run.
- `--resume none` in a directory that holds another run is refused unless `--overwrite`, which clears that run's
  states, exports and metrics first.
"""

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

from common.run import errors
from common.run.distributed import decided_by_rank0
from common.run.resume import CHECKPOINT_NAME, newest_intact_checkpoint, read_trainer_state, resolve_resume

# How long, how often and how a run is run, not what it computes: left out of the run name, changeable on resume.
NOT_DEFINING = ("steps", "eval_every", "save_every", "save_state_every", "keep_checkpoints", "resume", "overwrite",
                "output_dir", "run_name", "track", "wandb_project", "reward_workers", "reward_timeout",
                "rollout_gpu_memory", "rollout_eager", "rollout_sleep_level", "sync_bucket_mb", "check_weight_sync",
                "max_bad_steps", "max_tokens_per_micro_batch", "activation_checkpointing", "compile", "offload",
                "logprob_diff_every", "hang_timeout", "sequence_parallel", "shard_size")
UNSPOKEN = ("resume", "overwrite", "output_dir", "run_name")  # differ between launches by design: never listed
RUN_FILE = "run.json"
_locks = {}  # directory -> its lock file, held open for the life of the process: closing it would drop the lock


@dataclass
class RunArgs:
    """The flags every script shares (each script's Args extends it): the optimizer's fixed settings and memory
    options, then the run itself: where it writes, how often it saves, how it resumes, when it counts as broken or
    hung, and W&B."""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_beta2: float = 0.99
    """AdamW's second-moment decay (0.999 is the usual default elsewhere)"""
    max_tokens_per_micro_batch: int = 16384
    """token budget of one forward/backward pass: sequences are packed end to end into rows of up to this many"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """GPU arithmetic of training and of vLLM's rollouts: bf16 over fp32 master weights, or fp32 on both sides
    (log-probs agree to 0.002 per token against 0.04; SmolLM2 learned addition much faster in fp32 with GRPO, PPO and
    online DPO: benchmarks/README.md); auto: fp32 for models under 0.3B parameters, else bf16 (dpo.py offline: bf16)"""
    activation_checkpointing: bool = False
    """recompute each decoder layer in backward to save memory; on GPUs, when neither this nor
    --no-activation-checkpointing is given, the capacity planner turns it on where the step would not fit without it
    (and says so at start-up)"""
    sequence_parallel: int = 1
    """split each packed row's tokens over N ranks (Ulysses: an all-to-all around attention trades tokens for heads),
    for sequences whose activations do not fit one GPU: groups of N consecutive ranks train the same samples, each
    holding 1/N of every row's tokens (--max-tokens-per-micro-batch counts the whole row). The attention heads must
    divide by N. The update equals the one without it"""
    shard_size: int | None = None
    """hybrid sharding (HSDP): shard each model within groups of K consecutive ranks (a node's GPUs, so that the
    parameter all-gathers stay inside it) and replicate it across the groups (only gradient reductions cross nodes);
    unset: shard over every training rank. Memory per GPU is that of K-way sharding"""
    compile: bool = False
    """torch.compile each decoder layer of the models that train or score (dynamic shapes, for packed rows): fewer,
    fused kernels, which small models gain most from; the first steps take longer while it compiles"""
    save_every: int = 0
    """write an HF-format checkpoint every this many steps; 0: only at the end"""
    save_state_every: int = 50
    """write a resumable training state (sharded model and optimizer, scheduler, data position, RNG) every this
    many steps; 0: only at the end and on a stop signal (SIGTERM, SIGUSR1, Ctrl-C)"""
    keep_checkpoints: int = 2
    """resumable training states kept in the output dir (the newest); 0 keeps all"""
    resume: str = "auto"
    """auto: continue from the newest intact training state in the output dir, if any; none: start afresh (refused
    where another run's files are, unless --overwrite); or the path of a state_<step> directory"""
    overwrite: bool = False
    """delete the run already in the output dir (its states, exports and metrics) and start afresh"""
    max_bad_steps: int = 5
    """stop after this many steps in a row whose update was skipped for a NaN/inf loss or gradient norm"""
    hang_timeout: float | None = 1800.0
    """seconds a rank may go without progress (one stage of a step, such as the rollout, the update or a save, or
    the gap between two) before the run counts as hung: every rank writes its Python stacks to <output-dir>/hangs/,
    one line names the stage, the step and the ranks elsewhere, and the run exits non-zero, for torchrun
    --max-restarts or Slurm to restart it; None: wait for ever"""
    output_dir: str | None = None
    """where checkpoints, metrics and W&B files go; unset: runs/<run-name>. One run at a time per directory"""
    run_name: str | None = None
    """unset: <script>_<dataset>_s<seed>_<hash of the flags that define the run>, so that the same command resumes
    its run and a changed one starts a new run (--steps, cadences, logging and memory flags are not in the hash)"""
    seed: int = 1
    """seed for the model init, data order and sampling"""
    track: bool = False
    """log to Weights & Biases (respects WANDB_MODE, e.g. offline)"""
    wandb_project: str = "nanorl"
    """W&B project"""

    fixed_on_resume = ("seed",)  # flags a resumed run keeps: see fixed_on_resume below


def fixed_on_resume(args_class: type, *own: str) -> tuple[str, ...]:
    """The flags a resumed run cannot change, whose saved state (weights, optimizer, data position) would mean nothing
    with another value: the script's `own` and those each shared flag class it extends names in its
    `fixed_on_resume`."""
    shared = [name for base in args_class.__mro__ for name in vars(base).get("fixed_on_resume", ())]
    return tuple(dict.fromkeys([*own, *shared]))


@dataclass
class RunDir:
    name: str
    path: str
    resume_from: str | None  # the state directory to continue from, or None
    notes: list[str] = field(default_factory=list)  # what rank 0 found and decided, to print once
    start_step: int = 0  # the step the resumed state was saved at (0: a fresh run)
    saved: dict = field(default_factory=dict)  # the resumed state's extras (W&B run id, the script's own)


def default_run_name(script: str, given: dict) -> str:
    """<script>_<dataset>_s<seed>_<hash of the defining flags as given on the command line>."""
    dataset = "builtin" if given.get("dataset") is None else \
        os.path.basename(str(given["dataset"]).rstrip("/")).split(".")[0]
    defining = {k: v for k, v in sorted(given.items()) if k not in NOT_DEFINING}
    digest = hashlib.sha1(json.dumps(defining, sort_keys=True, default=str).encode()).hexdigest()[:6]
    return f"{script}_{dataset}_s{given.get('seed')}_{digest}"


def open_run_dir(script: str, given: dict, resolved: dict, fixed: tuple[str, ...]) -> RunDir:
    """Collective over every process of the launch. `given`: the flags as parsed (they name the run); `resolved`:
    after the script filled in its defaults (what states save and resumes compare); `fixed`: flags that cannot
    change on resume. Raises (on every rank) a one-line error for a directory in use or a run that does not match.
    """
    name = given["run_name"] or default_run_name(script, given)
    path = given["output_dir"] or os.path.join("runs", name)

    def decide() -> dict:
        os.makedirs(path, exist_ok=True)
        _lock(path)
        notes = []
        if given["overwrite"]:
            cleared = clear_run(path)
            if cleared:
                notes.append(f"--overwrite: cleared the previous run in {path} ({cleared})")
        found = describe_run(path)
        if given["resume"] == "none":
            if found:
                raise ValueError(f"{path} already holds a run ({found}); --resume auto continues it, --overwrite "
                                 f"replaces it, or pick another --output-dir / --run-name")
            resume_from = None
        elif given["resume"] == "auto":
            resume_from, skipped = newest_intact_checkpoint(path)
            notes += skipped
        else:
            resume_from = resolve_resume(given["resume"], path)
        if resume_from is not None:
            saved = read_trainer_state(resume_from)["extra"].get("args")
            if saved is not None:
                notes += compare_flags(saved, resolved, fixed, resume_from)
        elif found:  # stopped before its first state: nothing to resume, start over if it was the same run
            if os.path.isfile(os.path.join(path, RUN_FILE)):
                with open(os.path.join(path, RUN_FILE)) as f:
                    compare_flags(json.load(f)["args"], resolved, fixed, path)
            notes.append(f"{path}: no complete training state to resume ({found}); starting afresh")
            clear_run(path)
        if resume_from is None:
            with open(os.path.join(path, RUN_FILE), "w") as f:
                json.dump({"command": sys.argv, "args": resolved}, f, indent=1, default=str)
        return {"resume_from": resume_from, "notes": notes}

    decided = decided_by_rank0("run_dir", decide)
    errors.record_reports_in(path)
    resumed = read_trainer_state(decided["resume_from"]) if decided["resume_from"] else {"step": 0, "extra": {}}
    return RunDir(name, path, decided["resume_from"], decided["notes"], resumed["step"], resumed["extra"])


def _lock(path: str) -> None:
    """Rank 0 holds <path>/.lock for the rest of its life; a live holder elsewhere makes this raise."""
    if os.path.realpath(path) in _locks:  # this process holds it already
        return
    lock_path = os.path.join(path, ".lock")
    f = open(lock_path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        try:
            holder = json.loads(f.read() or "{}")
        except json.JSONDecodeError:
            holder = {}
        f.close()
        raise ValueError(f"{path} is in use by another run (pid {holder.get('pid', '?')} on "
                         f"{holder.get('host', '?')}, started {holder.get('started', '?')}); wait for it to end or stop "
                         f"it, or use another --output-dir / --run-name") from None
    f.seek(0)
    f.truncate()
    f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                        "started": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}))
    f.flush()
    _locks[os.path.realpath(path)] = f


def _run_files(path: str) -> list[str]:
    """What a run leaves in its directory: states (also unfinished ones), HF exports, metrics, its flags."""
    names = []
    for name in sorted(os.listdir(path)):
        base = name.split(".")[0]
        if CHECKPOINT_NAME.fullmatch(base) or base.startswith("hf_step_") or name in ("metrics.jsonl", RUN_FILE):
            names.append(name)
    return names


def describe_run(path: str) -> str:
    """What run `path` holds, in a few words ("" for none)."""
    files = _run_files(path)
    states = sorted(int(m.group(1)) for n in files if (m := CHECKPOINT_NAME.fullmatch(n)))
    parts = [f"states up to step {states[-1]}"] if states else []
    exports = [n for n in files if n.startswith("hf_step_") and "." not in n]
    parts += [f"{len(exports)} exports"] if exports else []
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics):
        with open(metrics) as f:
            rows = sum(1 for line in f if line.strip())
        parts += [f"metrics of {rows} steps"] if rows else []
    return ", ".join(parts)


def clear_run(path: str) -> str:
    """Deletes the run in `path` (its lock and W&B files stay); returns what was there."""
    found = describe_run(path)
    for name in _run_files(path):
        target = os.path.join(path, name)
        shutil.rmtree(target) if os.path.isdir(target) else os.remove(target)
    return found


def compare_flags(saved: dict, current: dict, fixed: tuple[str, ...], state: str) -> list[str]:
    """Lines that say which flags differ from the run saved in `state`; raises if a fixed one does."""
    changed = [k for k in current if k in saved and saved[k] != current[k] and k not in UNSPOKEN]
    refused = [k for k in changed if k in fixed]
    flag = lambda k: "--" + k.replace("_", "-")
    if refused:
        what = ", ".join(f"{flag(k)} {current[k]} (saved: {saved[k]})" for k in refused)
        raise ValueError(f"{what} differs from the run saved in {state}, which it would make meaningless; use "
                         f"another --output-dir / --run-name, or --overwrite to start afresh there")
    if not changed:
        return []
    return ["resuming with changed flags, applied: " + ", ".join(f"{flag(k)} {saved[k]} -> {current[k]}"
                                                              for k in changed)]
