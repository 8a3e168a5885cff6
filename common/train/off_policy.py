"""Off-policy correction: the trainer learns from tokens that the rollout engine sampled, with its own numerics and,
with --async-rollout or --partial-rollouts, older weights. The flags (`CorrectionArgs`), each token's importance
weight against the policy that sampled it (TIS, IcePop's band mask, decoupled PPO's plain ratio), the rejection of
whole responses too far off (MIS), and the metrics of the mismatch (rollout/logprob_diff, rollout/mismatch_kl,
tis/*). The scripts' losses apply the weights (grpo.py, ppo.py).
"""

import math
from dataclasses import dataclass
from typing import Literal

import torch

from common.run.distributed import all_reduce_sum, max_over_ranks
from common.train.logprobs import model_token_mask


@dataclass
class CorrectionArgs:
    """The flags of the off-policy correction of scripts whose loss takes importance ratios (grpo.py, ppo.py)."""
    tis_cap: float | None = None
    """truncated importance sampling: weight each token by min(p_trainer / p_rollout, cap) against the rollout
    engine's numerical mismatch and its older weights (--async-rollout, --partial-rollouts); unset: off, or 2 with
    those. It is the band [1 / cap, cap] of icepop and mis"""
    off_policy_correction: Literal["tis", "icepop", "mis", "decoupled"] = "tis"
    """with --tis-cap, each token's weight from ratio = p_trainer / p_rollout: tis min(ratio, cap); icepop the ratio
    inside the band, 0 outside; mis whole responses whose geometric-mean ratio leaves the band are rejected;
    decoupled the ratio uncapped (AReaL's decoupled PPO). docs/long-responses.md compares them"""
    logprob_diff_every: int = 10
    """measure rollout/logprob_diff (how far the rollout engine's log-probs of the sampled tokens are from the
    trainer's) on the first step and every this many after (0: never); vLLM's per-token bookkeeping of its log-probs
    costs about a quarter of a small model's rollout time. --tis-cap needs them: every step then"""


def importance_weights(old: torch.Tensor, behaviour: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """Per-token weights [n, seq] of the loss against the policy that sampled each token: ratio = p_old / p_behaviour
    (old: the trainer's log-probs, behaviour: the engine's). tis: min(ratio, cap) (truncated importance sampling);
    icepop: the ratio where it lies in [1 / cap, cap], else 0, the token left out (IcePop's two-sided mask);
    decoupled: the ratio itself (AReaL's decoupled PPO: the clip is around the trainer's log-probs at sampling
    time, the importance weight against the engine's); mis: 1 (whole sequences were kept or rejected before the
    update, reject_mismatched_sequences)."""
    ratio = (old - behaviour).exp()
    if mode == "tis":
        return ratio.clamp(max=cap)
    if mode == "icepop":
        return torch.where((ratio >= 1 / cap) & (ratio <= cap), ratio, torch.zeros_like(ratio))
    if mode == "decoupled":
        return ratio
    if mode == "mis":
        return torch.ones_like(ratio)
    raise ValueError(f"unknown --off-policy-correction {mode!r}")


def reject_mismatched_sequences(samples: list[dict], cap: float) -> int:
    """--off-policy-correction mis: a sample whose geometric-mean ratio over its own tokens, exp(mean(log p_old -
    log p_behaviour)), leaves [1 / cap, cap] is rejected: its loss weight becomes 0, so it takes no part in the loss
    nor in any normaliser (counting rejected tokens in the denominator is a bug the field has had). Needs
    "old_logprobs" before the update. Returns how many were rejected."""
    rejected = 0
    for s in samples:
        if s.get("loss_weight", 1.0) == 0 or s["logprobs"] is None:
            continue
        mask = torch.as_tensor(model_token_mask(s), dtype=torch.bool)
        log_ratio = (s["old_logprobs"] - torch.as_tensor(s["logprobs"], dtype=torch.float32))[mask].mean().item()
        if abs(log_ratio) > math.log(cap):
            s["loss_weight"], s["rejected"] = 0.0, True
            rejected += 1
    return rejected


def mismatch_metrics(samples: list[dict], cap: float) -> dict:
    """How far the rollout engine's log-probs ("logprobs") are from the trainer's ("old_logprobs"), summed over one
    rank's samples that carry them (not every step asks for them: wants_rollout_logprobs): the absolute difference
    and the token count (rollout/logprob_diff), and the truncated importance weights min(p_old / p_behaviour, cap)
    that correct for the engine's numerical mismatch and older weights: the weight sum, how many tokens were
    capped, and the largest uncapped ratio. Observation tokens of episodes are not the model's: left out."""
    measured = [s for s in samples if s["logprobs"] is not None]
    if not measured:
        return {"lp_diff": 0.0, "lp_tokens": 0, "mismatch_kl": 0.0, "tis_weight_sum": 0.0, "tis_capped": 0.0,
                "tis_ratio_max": 0.0}
    generated = torch.cat([torch.as_tensor(model_token_mask(s), dtype=torch.bool) for s in measured])
    diff = (torch.cat([s["old_logprobs"] for s in measured]) - torch.cat(
        [torch.as_tensor(s["logprobs"], dtype=torch.float32) for s in measured]))[generated]  # the model's tokens
    ratio = diff.exp()
    return {"lp_diff": diff.abs().sum().item(), "lp_tokens": diff.numel(),
            "mismatch_kl": (ratio - 1 - diff).sum().item(),  # k3 of KL(engine || trainer) on the engine's samples
            "tis_weight_sum": ratio.clamp(max=cap).sum().item(), "tis_capped": (ratio > cap).sum().item(),
            "tis_ratio_max": ratio.max().item()}


def rollout_mismatch_metrics(samples: list[dict], tis_cap: float | None, device) -> dict[str, float]:
    """Collective: mismatch_metrics over every rank's samples, as logged: rollout/logprob_diff (where measured) and,
    with a TIS cap, the mean truncated importance weight, the share of capped tokens and the largest ratio."""
    mismatch = mismatch_metrics(samples, tis_cap or 1.0)
    sums = all_reduce_sum([mismatch["lp_diff"], mismatch["lp_tokens"], mismatch["tis_weight_sum"],
                           mismatch["tis_capped"], mismatch["mismatch_kl"]], device)
    diff, tokens, weight, capped, kl = sums
    metrics = {"rollout/logprob_diff": diff / tokens, "rollout/mismatch_kl": kl / tokens} if tokens else {}
    if tis_cap is not None and tokens:
        metrics.update({"tis/weight_mean": weight / tokens, "tis/capped_frac": capped / tokens,
                        "tis/ratio_max": max_over_ranks(mismatch["tis_ratio_max"], device)})
    return metrics
