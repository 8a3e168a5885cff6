"""A trainer's saves and its resume, the same in every script (`Checkpoints`): when to export HF-format models and
save training states (common/run/resume.py writes and reads them), what a resumed run restores besides them (this
launch's learning rates and weight decay, the count of bad steps in a row), and what the run says at its end.
"""

import contextlib
import os
from typing import NamedTuple

import torch

from common.run.resume import load_training_state, prune_checkpoints, save_training_state
from common.run.signals import crash_point, stop_requested
from sharding.checkpoint import checkpoint_dtype, save_hf_checkpoint
from sharding.lora import lora_layers


class BadStepCounter:
    """Counts consecutive bad (NaN/inf, skipped) steps and stops the run after max_bad_steps of them in a row.

    One bad step is skipped and logged: a rare overflow should not end a week-long run. Many in a row mean the
    weights or the optimizer state are already broken, and skipping more would only burn compute.
    """

    def __init__(self, max_bad_steps: int):
        if max_bad_steps < 1:
            raise ValueError(f"--max-bad-steps must be at least 1, got {max_bad_steps}")
        self.max_bad_steps, self.in_a_row, self.total = max_bad_steps, 0, 0

    def record(self, bad: bool, step: int) -> None:
        """Call once per step with the same `bad` on every rank; raises RuntimeError at max_bad_steps in a row."""
        if not bad:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row >= self.max_bad_steps:
            raise RuntimeError(
                f"{self.in_a_row} steps in a row (up to step {step}) had a NaN/inf loss or gradient norm and were "
                f"skipped (--max-bad-steps {self.max_bad_steps}); stopping. Resume from an earlier checkpoint with "
                f"a lower --lr or a smaller --max-grad-norm")


def set_hyperparameters(optimizer, scheduler, lr: float, weight_decay: float) -> None:
    """After loading a state: the learning rate and weight decay of this launch's flags, not the saved ones (the
    optimizer's state dict carries its hyperparameters). The schedule (a LambdaLR) keeps its position."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"], group["lr"], group["weight_decay"] = lr, lr * factor, weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class TrainedModel(NamedTuple):
    """A model a training state holds, with what trains it (a frozen one that moves, such as DPO's iteratively
    updated reference, has no optimizer, scheduler or learning rate)."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object = None
    lr: float | None = None


class Checkpoints:
    """A trainer's saves and its resume, the same in every script. The state holds `policy` and the models of `more`
    by name (PPO's "critic", DPO's moving "reference"); the policy is exported in HF format to hf_step_<step>/, and
    the models of `export_more` to the subdirectories they are named by. `on_gpu()`: a context that brings offloaded
    models in while they are saved or loaded. A script calls `resume()` once everything is built (last, so that the
    restored random streams are the ones the loop continues with), `export()` before a step's row is logged and
    `save()` after it: a training state never exists without its row."""

    def __init__(self, args, run_dir, logger, timer, tokenizer, data, policy: TrainedModel,
                 more: dict[str, TrainedModel] | None = None, export_more: dict[str, torch.nn.Module] | None = None,
                 probes: list[str] | None = None, on_gpu=contextlib.nullcontext):
        self.args, self.run_dir, self.logger, self.timer, self.tokenizer = args, run_dir, logger, timer, tokenizer
        self.data, self.models = data, [policy, *(more or {}).values()]
        self.exports = {"": policy.model, **(export_more or {})}  # subdirectory of hf_step_<step>/ -> model
        self.bad_steps = BadStepCounter(args.max_bad_steps)  # saved with the state: a resumed run counts on
        self.probes, self.on_gpu = probes, on_gpu
        self.policy, self.optimizer, self.scheduler = policy.model, policy.optimizer, policy.scheduler
        self.more = {name: trained[:3] for name, trained in more.items()} if more else None

    def resume(self) -> dict:
        """Restores the newest state (if the run directory chose one) and returns its extras ({} for a fresh run).
        The learning rates and weight decay are this command's, not the saved ones."""
        path = self.run_dir.resume_from
        if path is None:
            return {}
        with self.on_gpu():
            info = load_training_state(path, self.policy, self.optimizer, self.scheduler, self.data, self.more)
        for model, optimizer, scheduler, lr in self.models:
            if optimizer is not None:
                set_hyperparameters(optimizer, scheduler, lr, self.args.weight_decay)
        self.bad_steps.in_a_row = info["extra"]["bad_steps_in_a_row"]
        self.logger.print(f"resumed from {path} at step {info['step']}" + ("" if info["exact_rng"] else
                          f" (saved on {info['saved_world_size']} ranks: model, optimizer and data position are "
                          f"exact, random streams re-seeded)"))
        if getattr(getattr(self.data, "in_flight", None), "dropped", 0):
            self.logger.print(f"dropped the {self.data.in_flight.dropped} responses the saved run had in flight "
                              f"(--partial-rollouts): they are continued only on the same number of ranks, within "
                              f"--max-staleness")
        return info["extra"]

    def export(self, step: int) -> None:
        """HF-format models in <output_dir>/hf_step_<step>/ at --save-every and at the last step. A LoRA model goes
        as PEFT's adapter directory, and with --export-merged also merged into a full model in its merged/."""
        probes = {"probes": self.probes} if self.probes else {}  # texts the saved tokenizer must encode the same
        if self.args.save_every and step % self.args.save_every == 0 or step == self.args.steps:
            with self.timer("save"), self.on_gpu():
                dtype = checkpoint_dtype(self.args.model)
                for subdir, model in self.exports.items():
                    path, lora = os.path.join(self.run_dir.path, f"hf_step_{step}", subdir), bool(lora_layers(model))
                    save_hf_checkpoint(model, self.tokenizer, path, dtype, adapter=lora, **probes)
                    if lora and self.args.export_merged:
                        save_hf_checkpoint(model, self.tokenizer, os.path.join(path, "merged"), dtype, **probes)

    def save(self, step: int, stop: bool, extra: dict | None = None) -> None:
        """A resumable training state at --save-state-every, at the last step and on a stop (then says how to go on);
        its time is logged with the next step. `extra`: what the script wants back from `resume()`."""
        crash_point("after_row", step)
        args = self.args
        if stop or args.save_state_every and step % args.save_state_every == 0 or step == args.steps:
            with self.timer("save_state"), self.on_gpu():
                save_training_state(self.run_dir.path, step, self.policy, self.optimizer, self.scheduler, self.data,
                                    {"wandb_run_id": self.logger.run_id, "bad_steps_in_a_row": self.bad_steps.in_a_row,
                                     "args": vars(args), **(extra or {})}, self.more)
                prune_checkpoints(self.run_dir.path, args.keep_checkpoints)
        crash_point("after_state", step)
        if stop:
            self.logger.print(f"{stop_requested() or 'a signal on another rank'}: saved the training state at step "
                              f"{step}; run the same command again to continue")

    def say_how_it_went(self, first_eval: dict | None, last_eval: dict | None, stop: bool, names: dict[str, str],
                        saved_note: str = "") -> None:
        """At the end: a run resumed at or past --steps says it had nothing to do; one that ran to --steps, each
        held-out accuracy before and after training (`names`: its metric -> its name) and where the model is."""
        start, steps = self.run_dir.start_step, self.args.steps
        if start >= steps:
            self.logger.print(f"{self.run_dir.resume_from} is already at step {start} of {steps}: nothing to do "
                              f"(--steps trains further)")
        if stop or start > steps or not first_eval:  # past --steps: said above, and its export is elsewhere
            return
        self.logger.print("; ".join(f"held-out {name} accuracy: {first_eval[key]:.3f} before training -> "
                                    f"{last_eval[key]:.3f} after {steps} steps" for key, name in names.items()
                                    if key in first_eval)
                          + f"; model saved to {os.path.join(self.run_dir.path, f'hf_step_{steps}')}{saved_note}")
