"""PPO with a learned critic (Schulman et al. 2017, https://arxiv.org/abs/1707.06347), for RLHF as in
Ouyang et al. 2022 (https://arxiv.org/abs/2203.02155) and as verl / OpenRLHF run it.

Each response token is an action. Its reward is minus a KL penalty to a frozen reference model, and the last
response token also gets the sequence's score. A critic (a value head on a copy of the model) predicts V for
the state before each response token; GAE turns rewards and values into per-token advantages, whitened over the
whole batch of every rank, and returns (the critic's targets). The policy takes PPO's clipped surrogate, the
critic a clipped squared error, both normalised by the token count of the whole mini-batch on all ranks.

Every function below takes right-padded [batch, seq] tensors over response tokens with a float mask (1 for a real
response token, 0 for padding). This file holds the math only so far: main() is to come.

    torchrun --nproc_per_node 2 ppo.py
"""

import torch
import torch.distributed as dist


@torch.no_grad()
def token_rewards(scores, mask, logprobs, ref_logprobs, kl_coef: float):
    """Per-token rewards: -kl_coef * KL on every response token, plus the score on each row's last real token.

    scores: [batch]; mask, logprobs, ref_logprobs: [batch, seq]. The KL is k1, logprobs - ref_logprobs, as in
    Ouyang et al.: summed over a sampled response it is an unbiased estimate of the sequence's KL, which the return
    then carries back to every earlier token. The last real token is where the episode ends, whether the response
    stopped at EOS or was cut at the length limit; a row with no response tokens gets no score.
    ref_logprobs None: no KL term (kl is zeros). Returns (rewards, kl), both [batch, seq], 0 on padding.
    """
    kl = torch.zeros_like(mask) if ref_logprobs is None else torch.where(mask > 0, logprobs - ref_logprobs, 0.0)
    rewards = -kl_coef * kl
    lengths = mask.sum(-1).long()  # right padding: the last real token sits at lengths - 1
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    rewards[rows, lengths[rows] - 1] += scores[rows].to(rewards.dtype)
    return rewards, kl


@torch.no_grad()
def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438), per row.

    rewards, values, mask: [batch, seq]; values[:, t] is V of the state before response token t. Backwards from
    the end: delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where V and A after
    the last real token are 0 (the episode ends there). A padded position leaves the running V_{t+1} and A_{t+1}
    as they were, so nothing of it (whatever its value or reward) reaches a real token.
    Returns (advantages, returns = advantages + values), both [batch, seq], 0 on padding.
    """
    real = mask > 0  # torch.where, not multiplying by the mask: a NaN in a padded value stays out too
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])  # [batch]
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(real[:, t], advantage, 0.0)
        next_value = torch.where(real[:, t], values[:, t], next_value)
        next_advantage = torch.where(real[:, t], advantage, next_advantage)
    return advantages, torch.where(real, advantages + values, 0.0)


@torch.no_grad()
def masked_mean_var(x, mask):
    """Mean and biased variance (divide by N) of x over the real tokens of every rank, as float64 scalars.

    One all_reduce of (sum, sum of squares, count) when torch.distributed is initialised; this rank alone if not.
    A batch with no real tokens anywhere gives mean 0 and variance 0.
    """
    real = mask > 0
    x = torch.where(real, x.double(), 0.0)  # float64 before squaring: x may be bf16
    stats = torch.stack([x.sum(), (x * x).sum(), real.sum().double()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stats)
    total, total_sq, count = stats.unbind()
    count = count.clamp(min=1)
    mean = total / count
    return mean, (total_sq / count - mean * mean).clamp(min=0)  # E[x^2] - E[x]^2 in float64; rounding can go < 0


@torch.no_grad()
def masked_whiten(x, mask, shift_mean: bool = True, eps: float = 1e-8):
    """(x - mean) / std over the real tokens of all data-parallel ranks; 0 on padding. x, mask: [batch, seq].

    The variance is the biased one (divide by N, see masked_mean_var), so the real tokens of the result have mean 0
    and biased std 1 (up to eps). verl whitens with the unbiased variance of each rank's own batch; here every rank
    whitens with the same global statistics, so the advantages do not depend on how the batch is split over ranks
    (at N in the thousands the two variances differ by a factor N / (N - 1)). shift_mean=False keeps the mean and
    scales only the spread, (x - mean) / std + mean, as verl and TRL do.
    """
    mean, var = masked_mean_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask > 0, whitened, 0.0).to(x.dtype)


def policy_loss(logprobs, old_logprobs, advantages, clip_low: float, clip_high: float):
    """PPO's clipped surrogate per token: max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), r = pi / pi_old.

    All [batch, seq]. Returns (token_loss, clipped), clipped where the clipped branch is the larger: those tokens
    pass no gradient. Separate low / high bounds as in DAPO (https://arxiv.org/abs/2503.14476); equal is PPO's.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped  # pessimistic: no gain past the clip


def value_loss(values, old_values, returns, value_clip: float | None):
    """The critic's clipped squared error per token: 0.5 * max((v - R)^2, (old_v + clip(v - old_v, +-c) - R)^2).

    All [batch, seq]; old_values are the critic's values at rollout time. As with the policy's clip, the max takes
    the larger error, so the critic gains nothing from moving more than value_clip away from its rollout values.
    Returns (token_loss, clipped), clipped where the clipped branch is the larger (no gradient through it).
    value_clip None: the plain 0.5 * (v - R)^2, nothing clipped.
    """
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def token_mean_share(token_loss, mask, num_tokens: float):
    """This micro-batch's share of the mini-batch's token mean: sum(token_loss * mask) / num_tokens.

    num_tokens counts the real tokens of the whole mini-batch over all ranks and micro-batches, so the shares of
    all micro-batches of all ranks add up to the mini-batch mean whatever the split. (FSDP averages gradients over
    ranks: backward on share * world.) A mean per micro-batch instead weighs the tokens of a short micro-batch
    more and changes the effective learning rate with the split: verl's critic loss once did.
    """
    return (token_loss * mask).sum() / num_tokens


@torch.no_grad()
def explained_variance(values, returns, mask) -> float:
    """1 - Var[R - V] / Var[R] over the real tokens of all ranks: 1 for a perfect critic, 0 for one that predicts
    the mean return everywhere, negative for one worse than that. values, returns, mask: [batch, seq].

    Biased variances, as masked_whiten. When the returns do not vary (Var[R] <= 1e-8, or no real tokens), the
    ratio means nothing: 1.0 if the critic is exact there too (Var[R - V] <= 1e-8), else 0.0, as scikit-learn's
    explained_variance_score does; never NaN, so a logged curve has no holes.
    """
    _, var_returns = masked_mean_var(returns, mask)
    _, var_residual = masked_mean_var(returns - values, mask)
    if var_returns <= 1e-8:
        return 1.0 if var_residual <= 1e-8 else 0.0
    return float(1 - var_residual / var_returns)
