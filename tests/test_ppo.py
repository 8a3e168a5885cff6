"""PPO math against hand-computed values (with the split-invariant means and statistics ppo.py takes from
common/train/batching.py), and the global statistics on 2 gloo ranks == 1 rank."""

import json
import math
import os

import pytest
import torch

import ppo
import launcher
from gloo import finish_gloo, free_port, init_gloo


def test_resolve_defaults_chooses_and_prints_the_eval_size(tmp_path):
    """--eval-size unset: resolve_defaults sets it (a tenth of a 36-row file, held out of it) and names it among the
    values chosen for you; given, it stays as it is and is not named."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(36)))
    args = ppo.Args(dataset=str(path))
    assert "--eval-size 3" in ppo.resolve_defaults(args)[0] and args.eval_size == 3
    args = ppo.Args(dataset=str(path), eval_size=5)
    assert "--eval-size" not in ppo.resolve_defaults(args)[0] and args.eval_size == 5
    args = ppo.Args()  # the built-in task: the first 256 rows of its test split
    assert "--eval-size 256" in ppo.resolve_defaults(args)[0] and args.eval_size == 256


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
    launcher.spawn(global_stats, args=(2, free_port(), str(tmp_path)), nprocs=2)
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


# ---------------------------------------------------------------------------------------------------------------
# The pieces of a step on real (tiny) models: scores, the critic and reward model, the two updates, the warmup.

def tiny_models(seed: int = 0):
    """The built-in tiny policy and its critic (the same body, a value head), unsharded."""
    from common.train.tiny_model import build_tiny_tokenizer
    from common.train.model import load_model
    from common.train.value_models import load_critic
    tokenizer = build_tiny_tokenizer()
    return load_model(None, tokenizer, seed), load_critic(None, None, tokenizer, seed), tokenizer


def step_samples(n: int = 8, seed: int = 3) -> list[dict]:
    """Samples as Rollouts hands them out, with the fields a PPO step adds before its update."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        prompt = torch.randint(5, 35, (int(torch.randint(3, 6, (1,), generator=gen)),), generator=gen).tolist()
        response = torch.randint(5, 35, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
        samples.append(dict(prompt_ids=prompt, response_ids=response, logprobs=[-3.0] * len(response),
                            finished=bool(i % 2), reward=float(i % 3 == 0), mask=torch.ones(len(response))))
    return samples


def test_scores_sit_on_the_last_token_and_cut_responses_pay_the_penalty():
    """One response that ended at a stop token and one cut at the length limit (--missing-eos-penalty 0.5): each
    score lands on the response's last token, and the KL term (kl_coef 0.1, k1 by hand) on every token."""
    args = ppo.Args(missing_eos_penalty=0.5, kl_coef=0.1, gamma=1.0, lam=1.0)
    samples = [dict(prompt_ids=[1], response_ids=[5, 6], reward=1.0, finished=True, old_logprobs=torch.tensor([-1.0, -2.0]),
                    ref_logprobs=torch.tensor([-1.5, -2.0]), old_values=torch.zeros(2)),
               dict(prompt_ids=[1], response_ids=[5, 6, 7], reward=1.0, finished=False,
                    old_logprobs=torch.tensor([-1.0, -1.0, -1.0]), ref_logprobs=torch.tensor([-1.0, -1.0, -1.0]),
                    old_values=torch.zeros(3))]
    ppo.add_scores(samples, args, None, None, None, torch.device("cpu"))
    assert [s["score"] for s in samples] == [1.0, 0.5]
    ppo.add_advantages(samples, args, torch.device("cpu"))  # gamma = lam = 1, V = 0: returns = rewards to go
    # Row 0: token rewards [-0.1 * 0.5, 0 + 1.0] -> returns [0.95, 1.0]; row 1: [0, 0, 0.5] -> [0.5, 0.5, 0.5].
    assert torch.allclose(samples[0]["returns"], torch.tensor([0.95, 1.0]))
    assert torch.allclose(samples[1]["returns"], torch.tensor([0.5, 0.5, 0.5]))


def pieces_worker(rank: int, world: int, port: int, out_dir: str):
    """On `world` gloo ranks: the same 8 samples (dealt out by rank), one PPO update of critic and policy; the
    separation of the two models; the reward model against a hand-run forward; the critic warmup."""
    from common.train.logprobs import compute_logprobs
    from common.train.model import shard_model
    from common.train.value_models import compute_values, reward_model_scores
    init_gloo(rank, world, port)
    cpu = torch.device("cpu")
    args = ppo.Args(max_response_len=4, kl_coef=0.0, critic_lr=1e-2, lr=1e-2, max_tokens_per_micro_batch=16)
    policy, critic, tokenizer = tiny_models()
    policy, critic = shard_model(policy, cpu), shard_model(critic, cpu)
    # SGD: its step is linear in the gradient, so 1 rank and 2 ranks agree to float precision (Adam's first steps
    # amplify the rounding noise of near-zero gradients to a whole lr).
    optimizer = torch.optim.SGD(policy.parameters(), lr=args.lr)
    critic_optimizer = torch.optim.SGD(critic.parameters(), lr=args.critic_lr)
    samples = step_samples()[rank::world]
    ppo.add_scores(samples, args, None, None, None, cpu)
    for s, v in zip(samples, compute_values(critic, samples, 16, cpu)):
        s["old_values"] = v
    for s, lp in zip(samples, compute_logprobs(policy, samples, 16, 1.0, cpu)):
        s["old_logprobs"] = lp
    ppo.add_advantages(samples, args, cpu)
    full = lambda model: {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    policy_before, critic_before = full(policy), full(critic)
    ppo.update_critic(critic, critic_optimizer, samples, args, world, cpu, None)
    policy_after_critic_step = full(policy)
    ppo.update_policy(policy, optimizer, samples, args, world, cpu, None)
    critic_after = full(critic)
    results = {"policy_untouched_by_critic": all(torch.equal(policy_before[n], p)
                                                 for n, p in policy_after_critic_step.items()),
               "critic_untouched_by_policy": all(torch.equal(critic_after[n], p)
                                                 for n, p in full(critic).items()),
               "critic_moved": any(not torch.equal(critic_before[n], p) for n, p in critic_after.items()),
               "policy": full(policy), "critic": critic_after}
    if world == 1:
        # A one-label sequence classifier as reward model: its score at each sequence's last token, by hand.
        from transformers import AutoModelForSequenceClassification
        torch.manual_seed(0)
        rm = AutoModelForSequenceClassification.from_config(policy.config.__class__.from_dict(
            {**policy.config.to_dict(), "num_labels": 1, "pad_token_id": tokenizer.pad_token_id}))
        plain = [rm(input_ids=torch.tensor([s["prompt_ids"] + s["response_ids"]])).logits[0, 0].item()
                 for s in samples]
        packed = reward_model_scores(shard_model(rm, cpu, trainable=False), tokenizer, tokenizer, samples, 16, cpu)
        results["rm"] = (plain, packed)
        # The warmup stops as soon as the critic explains enough; a threshold it cannot reach uses every update.
        for threshold, most in [(-1e9, 5), (1e9, 3)]:
            warm = ppo.Args(critic_warmup_ev=threshold, critic_warmup_steps=most, max_tokens_per_micro_batch=16,
                            max_response_len=4)
            scheduler = torch.optim.lr_scheduler.LambdaLR(critic_optimizer, lambda s: 1.0)
            results[f"warmup_{most}"] = ppo.warm_up_critic(critic, critic_optimizer, scheduler, samples, warm, 1, cpu)
            results[f"warmup_{most}"]["scheduler_steps"] = scheduler.last_epoch  # the schedule counts its updates
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"pieces{world}.pt"))
    finish_gloo()


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_pieces")
    for world in (1, 2):
        launcher.spawn(pieces_worker, args=(world, free_port(), str(out)), nprocs=world)
    return torch.load(out / "pieces1.pt"), torch.load(out / "pieces2.pt")


def test_a_critic_step_moves_no_policy_weight_and_back(pieces):
    one, _ = pieces
    assert one["policy_untouched_by_critic"] and one["critic_untouched_by_policy"] and one["critic_moved"]


def test_two_ranks_update_as_one(pieces):
    """Whitening, both losses and their normalisers are global: 2 ranks holding half the samples each take the same
    steps as 1 rank holding all of them."""
    one, two = pieces
    for model in ("policy", "critic"):
        for name, weight in one[model].items():
            torch.testing.assert_close(two[model][name], weight, rtol=1e-4, atol=1e-5)


def test_reward_model_scores_match_a_plain_forward(pieces):
    plain, packed = pieces[0]["rm"]
    assert packed == pytest.approx(plain, abs=1e-5)


def test_critic_warmup_stops_on_its_threshold(pieces):
    one, _ = pieces
    assert one["warmup_5"]["critic/warmup_updates"] == 0  # already above a threshold of -1e9
    assert one["warmup_3"]["critic/warmup_updates"] == 3  # never reaches 1e9: stops when the updates run out
    assert one["warmup_5"]["scheduler_steps"] == 0 and one["warmup_3"]["scheduler_steps"] == 3


def test_bad_critic_and_reward_models_are_one_line(tmp_path):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from common.train.value_models import load_critic, load_reward_model
    policy, _, tokenizer = tiny_models()
    config = policy.config
    other_vocab = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "vocab_size": config.vocab_size + 8}))
    other_vocab.save_pretrained(tmp_path / "other_vocab")
    tokenizer.save_pretrained(tmp_path / "other_vocab")
    expected = f"its vocab_size is {config.vocab_size + 8}, the policy's {config.vocab_size}; the critic reads the policy's"
    with pytest.raises(ValueError, match=expected):
        load_critic(None, str(tmp_path / "other_vocab"), tokenizer, 0)
    policy.save_pretrained(tmp_path / "causal")
    tokenizer.save_pretrained(tmp_path / "causal")
    with pytest.raises(ValueError, match=r"not a sequence-classification model \(its architectures: "
                                         r"\['LlamaForCausalLM'\]\)"):
        load_reward_model(str(tmp_path / "causal"))
    critic = load_critic(None, str(tmp_path / "causal"), AutoTokenizer.from_pretrained(tmp_path / "causal"), 0)
    assert critic.score.out_features == 1  # a causal LM is a fine critic: its body, a fresh value head


def test_a_new_value_head_starts_at_zero_and_a_reward_models_is_kept(tmp_path):
    """A fresh head (from the policy or a causal LM) gives every value 0, so the first advantages are the rewards;
    a sequence-classification reward model's score head becomes the value head as it is."""
    from transformers import AutoModelForSequenceClassification

    from common.train.value_models import load_critic
    policy, critic, tokenizer = tiny_models()
    assert torch.count_nonzero(critic.score.weight) == 0 and torch.count_nonzero(critic.score.bias) == 0
    torch.manual_seed(0)
    rm = AutoModelForSequenceClassification.from_config(policy.config.__class__.from_dict(
        {**policy.config.to_dict(), "num_labels": 1}))
    rm.save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    from_rm = load_critic(None, str(tmp_path / "rm"), tokenizer, 0)
    assert torch.equal(from_rm.score.weight, rm.score.weight) and torch.count_nonzero(from_rm.score.bias) == 0


def test_gae_and_the_score_skip_observation_tokens():
    """An episode [a0, o, o, a1] (o: observation, mask 0) is the two-action episode [a0, a1]: the score sits on a1,
    a0 bootstraps from V(a1) across the observation, and the observation positions get no advantage or return."""
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 9.0, 0.25]])  # values at observation positions must not matter
    rewards, _ = ppo.token_rewards(torch.tensor([1.0]), mask, torch.zeros(1, 4), None, kl_coef=0.0)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 1.0]]
    advantages, returns = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # a1: delta = 1 - 0.25 = 0.75; a0: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275, A = -0.275 + 0.9 * 0.8 * 0.75 = 0.265
    assert torch.allclose(advantages, torch.tensor([[0.265, 0.0, 0.0, 0.75]]))
    assert torch.allclose(returns, torch.tensor([[0.765, 0.0, 0.0, 1.0]]))
    two_actions, _ = ppo.gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.25]]), torch.ones(1, 2), 0.9, 0.8)
    assert torch.allclose(two_actions, advantages[:, [0, 3]])
