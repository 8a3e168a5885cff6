"""The optimizer every script uses: AdamW with a linear warmup and a step that skips NaN/inf gradients (the counter
that stops a run whose updates keep failing is common/run/checkpoints.py's, saved with the training state)."""

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


def is_bad_number(x) -> bool:
    """True for NaN or +-inf (a Python number or a one-element tensor)."""
    return not math.isfinite(float(x))
