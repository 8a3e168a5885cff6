"""How long a step's responses run, for the capacity planner (common/run/planner.py): decoding waits for the longest,
and the KV cache it reads grows with the square of each. The mean alone does not say how long the longest is: that
depends on how the responses end (a trained model's own lengths, or a random model's fixed chance of ending at every
token), and on how many are sampled.
"""

import math


def response_lengths(setup, fit: dict) -> tuple[float, float]:
    """The step's longest response (the engine steps decoding waits for) and the mean of the squared lengths (what the
    KV cache reads grow with). "natural" lengths (a trained model's, whose tail the mean does not tell): a fitted
    multiple of the mean, and the mean squared. "geometric" ones (every token ends the response with one probability:
    random weights, random_model.py --stop-every): exponential lengths of a mean mu cut at the cap, mu the one whose
    capped mean is response_len; the longest of n is mu x H_n (the harmonic number) on average, n the step's samples
    (it waits for the slowest engine), and responses that all run to the cap (mean = cap) give the cap. Both at most
    max_response_len. setup: the planner's Setup."""
    cap, mean = setup.max_response_len, min(setup.response_len, setup.max_response_len)
    if setup.response_lengths == "natural":
        return min(cap, fit["longest_over_mean"] * mean), mean ** 2
    if mean >= 0.995 * cap:  # every response runs to the cap
        return cap, cap ** 2
    low, high = mean, 1e3 * cap  # mu: the capped mean mu (1 - exp(-cap / mu)) grows with mu
    for _ in range(100):
        mu = (low + high) / 2
        low, high = (mu, high) if mu * (1 - math.exp(-cap / mu)) < mean else (low, mu)
    harmonic = sum(1 / k for k in range(1, int(setup.samples) + 1))
    # E[min(X, cap)^2] = integral over x < cap of 2 x P(X > x) = 2 mu^2 (1 - exp(-cap / mu) (1 + cap / mu))
    return min(cap, mu * harmonic), 2 * mu ** 2 * (1 - math.exp(-cap / mu) * (1 + cap / mu))
