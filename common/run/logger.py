"""Logging for every script: one console line per step, a tqdm bar in a terminal, W&B with --track, and per-stage
timers.

Only rank 0 prints, writes <output_dir>/metrics.jsonl and talks to W&B; metrics arriving here are already reduced
over ranks. Every step has its rows in metrics.jsonl exactly once, however often the run was killed and resumed:
a step's rows are written (and synced to disk) before its training state is saved, and a resumed run first drops
the rows after the state it resumes from, which it is about to redo. W&B gets each step once too. A killed run
can lose the rows it sent last (W&B writes them in a process of its own, killed with it), so a resumed run sends
again, from metrics.jsonl, every row from the first step W&B does not have (`run.step`: the server's count when
online; offline, each segment's file repeats them and `wandb sync` keeps one row per step, as W&B ignores steps it
has passed); rows of the steps W&B already has are not sent again.
W&B respects WANDB_MODE (e.g. `WANDB_MODE=offline` writes the run under <output_dir>/wandb with no network).
"""

import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from tqdm import tqdm

from common.run.errors import user_error
from common.run.health import health_report
from common.run.perf import StepPerf, flop_weighted_params
from common.run.run_plan import out_of_memory_report
from common.run.signals import crash_point, signal_point
from common.run.watchdog import Watchdog


@user_error
class OutOfGPUMemory(RuntimeError):
    """A stage ran out of GPU memory: reported in one line, with the flags that would make the step fit."""


class StageTimer:
    """`with timer("rollout"): ...` adds the wall time of the block to `time/rollout` for this step. With
    hang_timeout_s, a stage (or, from the loop's first step on, a gap between stages) that takes longer ends the run
    (common/run/watchdog.py). Before the loop, the stages of step 0 are watched (the first sync and evaluation, which
    later steps run too) but not the set-up around them (loading, a resume) nor a stage marked setup (DPO's reference
    pass over the whole dataset)."""

    def __init__(self, device: torch.device, hang_timeout_s: float | None = None, output_dir: str | None = None):
        self.device, self.seconds, self.step = device, defaultdict(float), 0
        self.step_start = time.perf_counter()  # when the step began (start_step)
        self.watchdog = Watchdog(hang_timeout_s, output_dir) if hang_timeout_s else None

    def start_step(self, step: int) -> float:
        """The loop starts `step`; returns the time (time.perf_counter) it did."""
        self.step = step
        self._progress("its start")
        self.step_start = time.perf_counter()
        return self.step_start

    @contextmanager
    def __call__(self, stage: str, waits_for_peers: bool = False, setup: bool = False):
        """waits_for_peers: the stage only waits for the other side of split placement (a batch, a weight version),
        whose own watchdog watches that work: this rank's is paused meanwhile. setup: one-time work before the loop
        whose length no step bounds: not watched."""
        self._progress(f"stage '{stage}'", paused=waits_for_peers or setup)
        signal_point(stage, self.step)
        start = time.perf_counter()
        try:
            crash_point(stage, self.step)
            yield
            if self.device.type == "cuda":  # GPU work is asynchronous: wait for it so time lands in its own stage
                torch.cuda.synchronize(self.device)
        except torch.OutOfMemoryError as error:  # one line: where, what is in use, what would fit (the planner)
            raise OutOfGPUMemory(out_of_memory_report(stage, self.step, error)) from None
        self.seconds[f"time/{stage}"] += time.perf_counter() - start
        self._progress(f"the gap after stage '{stage}'", paused=not self.step)  # before the loop: set-up follows

    def _progress(self, where: str, paused: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(self.step, where, paused)

    def pop(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


# The few metrics worth a column on the console; everything goes to W&B.
CONSOLE_KEYS = {"reward/mean": "reward", "reward/accuracy": "acc", "loss/kl": "kl", "policy/entropy": "ent",
                "response/length_mean": "len", "rollout/logprob_diff": "lp_diff", "sync/gb_per_s": "sync_GB/s",
                "batch/padding_frac": "pad", "perf/tokens_per_s": "tok/s", "perf/mfu": "mfu",
                "perf/peak_memory_gb": "mem_GB", "rollout/staleness_mean": "stale", "tis/weight_mean": "tis",
                "loss/preference": "loss", "kto/kl": "kl", "eval/accuracy": "eval_acc",
                "eval/preference_accuracy": "eval_pref", "eval/label_accuracy": "eval_label"}


def keep_rows_through(path: str, last_step: int) -> list[dict]:
    """Rewrites the metrics file with only the rows of steps <= last_step (a half-written last line goes too);
    returns those rows."""
    if not os.path.isfile(path):
        return []
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
                if row["step"] <= last_step:
                    kept.append(row)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # the run died while writing this line
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return kept


class Logger:
    def __init__(self, rank: int, total_steps: int, track: bool, project: str, run_name: str, config: dict,
                 output_dir: str, run_id: str | None = None, start_step: int = 0):
        self.is_main, self.run, self.metrics_file = rank == 0, None, None
        self.wandb_from = 0  # the first step W&B does not have yet
        if self.is_main:  # every step's metrics as JSON lines, kept with the run (a resumed run appends)
            os.makedirs(output_dir, exist_ok=True)
            path = os.path.join(output_dir, "metrics.jsonl")
            kept = keep_rows_through(path, start_step) if start_step else []
            self.metrics_file = open(path, "a")
        # The bar only where a person watches: in a file (Slurm's log, `> log 2>&1`) its redraws would land on the
        # step lines, so there each step is one line alone.
        self.bar = tqdm(total=total_steps, initial=start_step, desc=run_name, dynamic_ncols=True,
                        disable=not sys.stderr.isatty()) if self.is_main else None
        if track and self.is_main:
            import wandb
            self.run = wandb.init(project=project, name=run_name, config=config, dir=output_dir, id=run_id,
                                  resume="allow" if run_id else None)
            self.wandb_from = self.run.step
            for row in kept:  # what the killed run may not have got through to W&B
                if row["step"] >= self.wandb_from:
                    self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.id

    def print(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message)

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        if not self.is_main:
            return
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        os.fsync(self.metrics_file.fileno())  # on disk before the step's state can be: a resume never lacks the row
        if self.run is not None and step >= self.wandb_from:
            self.run.log(metrics, step=step)
        times = " ".join(f"{k[5:]}={v:.2f}s" for k, v in metrics.items() if k.startswith("time/"))
        shown = " ".join(f"{short}={metrics[k]:.3g}" for k, short in CONSOLE_KEYS.items() if k in metrics)
        tqdm.write(f"step {step:>5} | {shown} | {times}")
        if advance:
            self.bar.update(1)

    def log_step_zero(self, metrics: dict[str, float], timer: StageTimer) -> None:
        """Before the loop: step 0's row, a fresh run's evaluation of its initial weights (`metrics`; none on a resumed
        run or where the rollout ranks evaluate) with the times of the stages that made it. The set-up's stage times
        are dropped either way."""
        if metrics:
            self.log(0, {**metrics, **timer.pop()}, advance=False)
        timer.pop()

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()


def start_logging(args, run_dir, rank: int, world: int, device, notes: list[str],
                  models: list) -> tuple[Logger, StageTimer, StepPerf]:
    """Collective over the `world` training ranks. The run's logger (metrics.jsonl, the console, W&B with --track,
    continuing a resumed run's), its stage timer (which also watches for hangs) and the per-step performance figures
    (MFU of the `models` that train, peak memory); prints the run directory's notes, the script's `notes` and the
    health line (devices, all-reduce bandwidth, disk space for a training state)."""
    trained, flop_params = flop_weighted_params(models)
    logger = Logger(rank, args.steps, args.track, args.wandb_project, run_dir.name, vars(args), run_dir.path,
                    run_id=run_dir.saved.get("wandb_run_id"), start_step=run_dir.start_step)
    health = health_report(device, run_dir.path, trained, args.shard_size, args.sequence_parallel)
    for note in [*run_dir.notes, *notes, *health]:
        logger.print(note)
    return logger, StageTimer(device, args.hang_timeout, run_dir.path), StepPerf(flop_params, device, world)
