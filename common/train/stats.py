"""Statistics over the real tokens of every rank, on right-padded [batch, seq] tensors with a float mask (1 for a real
token, 0 for padding): the same numbers whatever the split of the batch over ranks and micro-batches. PPO whitens
its advantages with them and gates its critic's warm-up on the explained variance.
"""

import torch
import torch.distributed as dist


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
