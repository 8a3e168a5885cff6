"""The optimizer every script uses: AdamW with a linear warmup, a step that skips NaN/inf gradients, and the
counter that stops a run whose updates keep failing."""

import math

import torch


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, warmup_steps: int, beta2: float):
    """AdamW (betas 0.9 / beta2) over the parameters that train (a LoRA model's adapters: no moments for its frozen
    base) and a LambdaLR that warms the learning rate up linearly over warmup_steps updates."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, betas=(0.9, beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, warmup_steps)))
    return optimizer, scheduler


def clip_and_step(model: torch.nn.Module, optimizer, max_grad_norm: float) -> float | None:
    """Collective: clips the gradients to max_grad_norm and steps; returns the global gradient norm, or None when
    it is NaN/inf (on any rank: the norm is global), in which case no step is taken. The gradients are cleared
    either way (none are held through a rollout)."""
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not is_bad_number(grad_norm):
        optimizer.step()  # skipped otherwise: one NaN in Adam's moments would spoil every later step
    optimizer.zero_grad(set_to_none=True)
    return None if is_bad_number(grad_norm) else grad_norm


def set_hyperparameters(optimizer, scheduler, lr: float, weight_decay: float) -> None:
    """After loading a state: the learning rate and weight decay of this launch's flags, not the saved ones (the
    optimizer's state dict carries its hyperparameters). The schedule (a LambdaLR) keeps its position."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in optimizer.param_groups:
        group["initial_lr"], group["lr"], group["weight_decay"] = lr, lr * factor, weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def is_bad_number(x) -> bool:
    """True for NaN or +-inf (a Python number or a one-element tensor)."""
    return not math.isfinite(float(x))


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
