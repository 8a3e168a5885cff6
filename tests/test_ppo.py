"""PPO math against hand-computed values, and the global statistics on 2 gloo ranks == 1 rank."""

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

import ppo
from gloo import finish_gloo, free_port, init_gloo


def test_token_rewards_by_hand():
    # Row 0: cut at the length limit (3 tokens, the full width). Row 1: stopped at EOS after 2 tokens.
    # Row 2: no response tokens at all. Padded positions hold junk that must not show.
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, 9.0], [7.0, 7.0, 7.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.4, -0.3, -9.0], [-7.0, -7.0, -7.0]])
    scores = torch.tensor([1.0, -1.0, 5.0])
    rewards, kl = ppo.token_rewards(scores, mask, logprobs, ref, kl_coef=0.1)
    # k1 = logprobs - ref: row 0 [0.5, -1.0, 0.0], row 1 [0.2, 0.0, pad], row 2 all padding.
    assert torch.allclose(kl, torch.tensor([[0.5, -1.0, 0.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    # -0.1 * k1, plus the score on the last real token: row 0 at t=2 (0 + 1.0), row 1 at t=1 (-0.0 - 1.0).
    expected = torch.tensor([[-0.05, 0.1, 1.0], [-0.02, -1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(rewards, expected)
    # No KL term: the scores alone, at the same positions.
    only_scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.0]])
    for rewards, kl in [ppo.token_rewards(scores, mask, logprobs, ref, kl_coef=0.0),
                        ppo.token_rewards(scores, mask, logprobs, None, kl_coef=0.1)]:
        assert torch.equal(rewards, only_scores)
    assert torch.equal(kl, torch.zeros(3, 3))  # ref_logprobs None


def test_gae_by_hand():
    gamma, lam = 0.9, 0.8  # gamma * lam = 0.72
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [-0.1, 2.0, 99.0]])  # junk reward and value on row 1's padding
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, 77.0]])
    advantages, returns = ppo.gae(rewards, values, mask, gamma, lam)
    # Row 0, from the end (V after the last token is 0):
    #   t=2: delta = 1 + 0.9 * 0 - 0.7 = 0.3                         A = 0.3
    #   t=1: delta = 0 + 0.9 * 0.7 - 0.6 = 0.03                      A = 0.03 + 0.72 * 0.3 = 0.246
    #   t=0: delta = 0 + 0.9 * 0.6 - 0.5 = 0.04                      A = 0.04 + 0.72 * 0.246 = 0.21712
    # Row 1 (ends at t=1; t=2 is padding):
    #   t=1: delta = 2.0 + 0.9 * 0 - 0.5 = 1.5                       A = 1.5
    #   t=0: delta = -0.1 + 0.9 * 0.5 - 1.0 = -0.65                  A = -0.65 + 0.72 * 1.5 = 0.43
    expected_adv = torch.tensor([[0.21712, 0.246, 0.3], [0.43, 1.5, 0.0]])
    expected_ret = torch.tensor([[0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7], [0.43 + 1.0, 1.5 + 0.5, 0.0]])
    torch.testing.assert_close(advantages, expected_adv, rtol=0, atol=1e-6)
    torch.testing.assert_close(returns, expected_ret, rtol=0, atol=1e-6)
    # Not even a NaN on padding reaches a real token.
    values[1, 2], rewards[1, 2] = float("nan"), float("nan")
    torch.testing.assert_close(ppo.gae(rewards, values, mask, gamma, lam)[0], expected_adv, rtol=0, atol=1e-6)


def test_gae_limits():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.5, -1.0, 2.0], [1.0, 3.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]])
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t, and the return is that sum (Monte Carlo).
    advantages, returns = ppo.gae(rewards, values, mask, 1.0, 1.0)
    mc = torch.tensor([[1.5, 1.0, 2.0], [4.0, 3.0, 0.0]])
    torch.testing.assert_close(returns, mc)
    torch.testing.assert_close(advantages, (mc - values) * mask)
    # lam = 0: one-step TD, A_t = r_t + gamma * V_{t+1} - V_t.
    advantages, _ = ppo.gae(rewards, values, mask, 0.9, 0.0)
    td = torch.tensor([[0.5 + 0.9 * 0.2 - 0.1, -1.0 + 0.9 * 0.3 - 0.2, 2.0 - 0.3],
                       [1.0 + 0.9 * 0.5 - 0.4, 3.0 - 0.5, 0.0]])
    torch.testing.assert_close(advantages, td)


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 5.0], [3.0, 4.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    # Real tokens 1, 2, 3, 4: mean 2.5, biased var (2.25 + 0.25 + 0.25 + 2.25) / 4 = 1.25.
    std = math.sqrt(1.25 + 1e-8)
    expected = torch.tensor([[-1.5 / std, -0.5 / std, 0.0], [0.5 / std, 1.5 / std, 0.0]])  # padding -> 0
    torch.testing.assert_close(ppo.masked_whiten(x, mask), expected)
    # shift_mean=False keeps the mean: (x - 2.5) / std + 2.5 on real tokens.
    torch.testing.assert_close(ppo.masked_whiten(x, mask, shift_mean=False), (expected + 2.5) * mask)
    # One real token, or none: no variance to divide by, no NaN.
    assert torch.equal(ppo.masked_whiten(x, torch.tensor([[1.0, 0, 0], [0, 0, 0]])), torch.zeros(2, 3))
    assert torch.equal(ppo.masked_whiten(x, torch.zeros(2, 3)), torch.zeros(2, 3))


@pytest.mark.parametrize("advantage, ratio, expected_loss, expected_clipped", [
    (1.0, 1.5, -1.28, True),    # A > 0, r above 1 + 0.28: max(-1.5, -1.28) = -1.28, the clipped branch
    (-1.0, 0.5, 0.8, True),     # A < 0, r below 1 - 0.2: max(0.5, 0.8) = 0.8, the clipped branch
    (1.0, 0.5, -0.5, False),    # A > 0, r below 1 - 0.2: max(-0.5, -0.8) = -0.5, the lower bound does not bind
    (-1.0, 1.5, 1.5, False),    # A < 0, r above 1 + 0.28: max(1.5, 1.28) = 1.5, full penalty
    (2.0, 1.1, -2.2, False),    # inside [0.8, 1.28]: -2 * 1.1
])
def test_policy_loss_clip_bounds(advantage, ratio, expected_loss, expected_clipped):
    old = torch.tensor([[-1.0]])
    logprobs = (old + math.log(ratio)).requires_grad_()
    loss, clipped = ppo.policy_loss(logprobs, old, torch.tensor([[advantage]]), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert clipped.item() == expected_clipped
    loss.sum().backward()
    # d(-A * r)/d logprob = -A * r; a clipped token passes nothing.
    assert logprobs.grad.item() == pytest.approx(0.0 if expected_clipped else -advantage * ratio, abs=1e-6)


@pytest.mark.parametrize("value, ret, expected_loss, expected_clipped", [
    # old value 1.0, value_clip 0.2: the clipped value lies in [0.8, 1.2].
    (1.5, 2.0, 0.32, True),     # above: max((1.5 - 2)^2, (1.2 - 2)^2) = max(0.25, 0.64); 0.5 * 0.64
    (0.5, 0.0, 0.32, True),     # below: max((0.5 - 0)^2, (0.8 - 0)^2) = max(0.25, 0.64); 0.5 * 0.64
    (1.5, 0.0, 1.125, False),   # above but moving away from R: max(2.25, 1.44) = 2.25; 0.5 * 2.25
    (1.1, 2.0, 0.405, False),   # inside: both (1.1 - 2)^2 = 0.81; 0.5 * 0.81
])
def test_value_loss_clip_bounds(value, ret, expected_loss, expected_clipped):
    values = torch.tensor([[value]], requires_grad=True)
    loss, clipped = ppo.value_loss(values, torch.tensor([[1.0]]), torch.tensor([[ret]]), value_clip=0.2)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-6)
    assert clipped.item() == expected_clipped
    loss.sum().backward()
    # d(0.5 (v - R)^2)/dv = v - R; the clipped branch is constant in v.
    assert values.grad.item() == pytest.approx(0.0 if expected_clipped else value - ret, abs=1e-6)
    unclipped, none_clipped = ppo.value_loss(values, torch.tensor([[1.0]]), torch.tensor([[ret]]), value_clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (value - ret) ** 2) and not none_clipped.item()


def test_token_mean_share_adds_up_whatever_the_split():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mean = (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8 + 9) / 9  # = 5
    for splits in [[4], [1, 3], [2, 2], [3, 1], [1, 1, 2], [1, 1, 1, 1]]:  # micro-batches (or ranks) of rows
        parts = zip(token_loss.split(splits), mask.split(splits))
        assert sum(ppo.token_mean_share(loss, m, num_tokens=9).item() for loss, m in parts) == pytest.approx(mean)
    # A mean per micro-batch would not: [rows 0-1] and [rows 2-3] give (10 / 4 + 35 / 5) / 2 = 4.75, not 5.
    per_micro_batch = [(loss * m).sum() / m.sum() for loss, m in zip(token_loss.split(2), mask.split(2))]
    assert (sum(per_micro_batch) / 2).item() == pytest.approx(4.75)


def test_explained_variance_by_hand():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 2.0, 50.0], [3.0, 4.0, -50.0]])  # junk on padding
    # Real returns 1, 2, 3, 4: mean 2.5, biased Var[R] = 1.25.
    assert ppo.explained_variance(returns.clone(), returns, mask) == pytest.approx(1.0)  # perfect critic
    assert ppo.explained_variance(torch.full((2, 3), 2.5), returns, mask) == pytest.approx(0.0)  # V = mean R
    # V = 1, 2, 3, 3: R - V = 0, 0, 0, 1, mean 0.25, Var = (3 * 0.0625 + 0.5625) / 4 = 0.1875.
    values = torch.tensor([[1.0, 2.0, 0.0], [3.0, 3.0, 0.0]])
    assert ppo.explained_variance(values, returns, mask) == pytest.approx(1 - 0.1875 / 1.25)  # 0.85
    # V = 0, or V = 2R - 2.5 (R - V = 2.5 - R): either way Var[R - V] = Var[R], so 0 as well.
    assert ppo.explained_variance(torch.zeros(2, 3), returns, mask) == pytest.approx(0.0)
    assert ppo.explained_variance(2 * returns - 2.5, returns, mask) == pytest.approx(0.0)
    # V = 2.5 - 2 (R - 2.5): R - V = 3 (R - 2.5), Var = 9 * 1.25: 1 - 9 = -8, worse than predicting the mean.
    assert ppo.explained_variance(2.5 - 2 * (returns - 2.5), returns, mask) == pytest.approx(-8.0)
    # Returns that do not vary: 1.0 if the critic is exact (up to a constant), else 0.0; never NaN.
    flat = torch.full((2, 3), 0.3)
    assert ppo.explained_variance(flat.clone(), flat, mask) == 1.0
    assert ppo.explained_variance(flat + 7.0, flat, mask) == 1.0  # Var[R - V] = 0: V - R is constant
    assert ppo.explained_variance(values, flat, mask) == 0.0
    assert ppo.explained_variance(values, returns, torch.zeros(2, 3)) == 1.0  # no real tokens


# ---------------------------------------------------------------------------------------------------------------
# Whitening and explained variance on 2 gloo ranks (different batch sizes and widths) == 1 rank on all the data.

def rank_data():
    """Per rank: (x, values, mask). Rank 0 holds 3 rows of width 4, rank 1 holds 2 rows of width 2."""
    g = torch.Generator().manual_seed(0)
    data = []
    for rows, width, lengths in [(3, 4, [4, 1, 3]), (2, 2, [2, 0])]:
        x = torch.randn(rows, width, generator=g) * 3 + 1
        values = x + torch.randn(rows, width, generator=g)
        mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).float()
        data.append((x, values, mask))
    return data


def global_stats(rank: int, world: int, port: int, out_dir: str):
    init_gloo(rank, world, port)
    x, values, mask = rank_data()[rank]
    torch.save({"whitened": ppo.masked_whiten(x, mask), "kept_mean": ppo.masked_whiten(x, mask, shift_mean=False),
                "ev": ppo.explained_variance(values, x, mask)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finish_gloo()


def pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def test_global_statistics_two_ranks_match_one(tmp_path):
    mp.spawn(global_stats, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    data = rank_data()
    x, values, mask = (torch.cat([pad_to(d[i], 4) for d in data]) for i in range(3))  # 1 rank: all 5 rows
    whitened = ppo.masked_whiten(x, mask)
    real = whitened[mask.bool()]  # 10 real tokens
    assert real.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert real.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(whitened[~mask.bool()], torch.zeros(10))
    kept_mean = ppo.masked_whiten(x, mask, shift_mean=False)
    ev = ppo.explained_variance(values, x, mask)
    for rank, start, end in [(0, 0, 3), (1, 3, 5)]:
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(pad_to(got["whitened"], 4), whitened[start:end])
        torch.testing.assert_close(pad_to(got["kept_mean"], 4), kept_mean[start:end])
        assert got["ev"] == pytest.approx(ev, rel=1e-6)
    assert ev == pytest.approx(1 - (x - values)[mask.bool()].var(unbiased=False) / x[mask.bool()].var(unbiased=False))
