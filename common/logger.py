"""Logging for every script: one console line per step, a tqdm bar, W&B with --track, and per-stage timers.

Only rank 0 prints, writes <output_dir>/metrics.jsonl and talks to W&B; metrics arriving here are already reduced
over ranks.
W&B respects WANDB_MODE (e.g. `WANDB_MODE=offline` writes the run under <output_dir>/wandb with no network).
"""

import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from tqdm import tqdm


class StageTimer:
    """`with timer("rollout"): ...` adds the wall time of the block to `time/rollout` for this step."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, defaultdict(float)

    @contextmanager
    def __call__(self, stage: str):
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":  # GPU work is asynchronous: wait for it so time lands in its own stage
            torch.cuda.synchronize(self.device)
        self.seconds[f"time/{stage}"] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


# The few metrics worth a column on the console; everything goes to W&B.
CONSOLE_KEYS = {"reward/mean": "reward", "reward/accuracy": "acc", "loss/kl": "kl", "policy/entropy": "ent",
                "response/length_mean": "len", "rollout/logprob_diff": "lp_diff", "sync/gb_per_s": "sync_GB/s",
                "batch/padding_frac": "pad", "perf/tokens_per_s": "tok/s", "perf/mfu": "mfu",
                "perf/peak_memory_gb": "mem_GB", "rollout/staleness_mean": "stale", "tis/weight_mean": "tis",
                "eval/accuracy": "eval_acc"}


class Logger:
    def __init__(self, rank: int, total_steps: int, track: bool, project: str, run_name: str, config: dict,
                 output_dir: str, run_id: str | None = None, start_step: int = 0):
        self.is_main, self.run, self.metrics_file = rank == 0, None, None
        if self.is_main:  # every step's metrics as JSON lines, kept with the run (a resumed run appends)
            os.makedirs(output_dir, exist_ok=True)
            self.metrics_file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self.bar = tqdm(total=total_steps, initial=start_step, desc=run_name, dynamic_ncols=True) if self.is_main else None
        if track and self.is_main:
            import wandb
            self.run = wandb.init(project=project, name=run_name, config=config, dir=output_dir, id=run_id,
                                  resume="allow" if run_id else None)

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.id

    def print(self, message: str) -> None:
        if self.is_main:
            tqdm.write(message)

    def log(self, step: int, metrics: dict[str, float], advance: bool = True) -> None:
        if not self.is_main:
            return
        if self.run is not None:
            self.run.log(metrics, step=step)
        self.metrics_file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.metrics_file.flush()
        times = " ".join(f"{k[5:]}={v:.2f}s" for k, v in metrics.items() if k.startswith("time/"))
        shown = " ".join(f"{short}={metrics[k]:.3g}" for k, short in CONSOLE_KEYS.items() if k in metrics)
        tqdm.write(f"step {step:>5} | {shown} | {times}")
        if advance:
            self.bar.update(1)

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()
