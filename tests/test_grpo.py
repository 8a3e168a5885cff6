"""GRPO math against hand-computed values, and FSDP2 on 2 gloo ranks == 1 rank (with different packings)."""

import math
import os

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

import grpo
from common.train.logprobs import compute_logprobs
from common.train.model import shard_model
import launcher
from gloo import finish_gloo, free_port, init_gloo


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    # group 0: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    expected = 0.5 / math.sqrt(1 / 3)
    adv = grpo.group_advantages(rewards, scale=True)
    assert torch.allclose(adv[0], torch.tensor([expected, -expected, -expected, expected]), atol=1e-4)
    assert torch.equal(adv[1], torch.zeros(4))  # zero-variance group: no signal
    assert torch.allclose(grpo.group_advantages(rewards, scale=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("advantage, ratio, expected_loss, expected_clipped", [
    (1.0, 1.5, -1.28, True),    # positive advantage: ratio capped at 1 + clip_high
    (1.0, 0.5, -0.5, False),    # positive advantage, ratio below 1: the lower clip does not apply
    (-1.0, 0.5, 0.8, True),     # negative advantage: ratio floored at 1 - clip_low
    (-1.0, 1.5, 1.5, False),    # negative advantage, ratio above 1: no clip, full penalty
    (1.0, 1.1, -1.1, False),    # inside the trust region
])
def test_policy_loss_clip_bounds(advantage, ratio, expected_loss, expected_clipped):
    old = torch.tensor([[-1.0]])
    logprobs = (old + math.log(ratio)).requires_grad_()
    loss, clipped, _ = grpo.policy_loss(logprobs, old, torch.tensor([[advantage]]), clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(expected_loss, abs=1e-5)
    assert clipped.item() == expected_clipped
    loss.sum().backward()
    # A clipped token passes no gradient; an unclipped one passes -advantage * ratio.
    assert logprobs.grad.item() == pytest.approx(0.0 if expected_clipped else -advantage * ratio, abs=1e-5)


def test_k3_kl_by_hand():
    logprobs, ref = torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.5)]])
    loss, _, kl = grpo.policy_loss(logprobs, logprobs, torch.zeros(1, 1), 0.2, 0.2, ref_logprobs=ref, kl_coef=0.1)
    assert kl.item() == pytest.approx(2 - math.log(2) - 1, abs=1e-6)  # ratio ref/pi = 2
    assert loss.item() == pytest.approx(0.1 * (2 - math.log(2) - 1), abs=1e-6)


TOKEN_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", (1 + 2 + 3 + 4 + 5 + 6) / 6),
    ("seq-mean-token-mean", (2 + 4 + 5.5) / 3),
    ("seq-mean-token-sum-norm", (6 + 4 + 11) / (3 * 4)),  # max_response_len 4
])
def test_loss_aggregation_by_hand_and_split_invariant(mode, expected):
    whole = grpo.aggregate_loss(TOKEN_LOSS, MASK, mode, num_tokens=6, num_seqs=3, max_response_len=4)
    assert whole.item() == pytest.approx(expected)
    # Micro-batches of 1 and 2 sequences add up to the same loss: the normaliser is the mini-batch's.
    parts = grpo.aggregate_loss(TOKEN_LOSS[:1], MASK[:1], mode, 6, 3, 4) + \
        grpo.aggregate_loss(TOKEN_LOSS[1:], MASK[1:], mode, 6, 3, 4)
    assert parts.item() == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------------------------
# FSDP2: one update on 2 gloo ranks (half the samples each) equals the same update on 1 rank.

def tiny_model():
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=40, max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def fixed_batch(num_samples: int = 8):
    g = torch.Generator().manual_seed(1)
    samples = []
    for i in range(num_samples):
        prompt = torch.randint(3, 40, (2 + i % 3,), generator=g).tolist()
        response = torch.randint(3, 40, (1 + (i * 5) % 4,), generator=g).tolist()
        samples.append(dict(prompt_ids=prompt, response_ids=response, logprobs=[-1.0] * len(response),
                            advantage=float(i % 2) - 0.5 + 0.1 * i, loss_weight=1.0))
    return samples


def update_once(rank: int, world: int, port: int, loss_agg: str, out_dir: str, episodes: bool = False,
                correction: str | None = None):
    init_gloo(rank, world, port)
    model = shard_model(tiny_model(), torch.device("cpu"))
    # Different token budgets per world size: the split into micro-batches must not change the gradient.
    # (mis: one mini-batch, as the rejected samples leave each rank's list and would change which samples share one)
    args = grpo.Args(loss_agg=loss_agg, max_tokens_per_micro_batch=12 if world == 2 else 40,
                     num_mini_batches=1 if correction == "mis" else 2,
                     max_response_len=7 if episodes else 4, tis_cap=correction and 2.0,
                     off_policy_correction=correction or "tis")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # not Adam: Adam hides a wrong gradient scale
    # Rank r takes samples r, r + world, ...: with no shuffle, mini-batch k then holds the same global samples
    # for 1 and 2 ranks.
    samples = (episode_batch(0.0) if episodes else fixed_batch())[rank::world]
    for s, lp in zip(samples, compute_logprobs(model, samples, 16, args.temperature, torch.device("cpu"))):
        s["old_logprobs"] = lp - 0.05
        if correction:  # the engine's log-probs of a response continued over versions: off by up to 1.2 a token
            s["logprobs"] = (s["old_logprobs"] + torch.tensor([0.3, -1.2, 0.1, 0.9, -0.4])[:len(lp)]
                             * (1 + len(s["prompt_ids"]) % 2)).tolist()
    if correction == "mis":
        grpo.reject_mismatched_sequences(samples, args.tis_cap)
    stats = grpo.update_policy(model, optimizer, samples, args, world, torch.device("cpu"), generator=None)
    loss = torch.tensor([stats["loss"]], dtype=torch.float64)
    dist.all_reduce(loss)
    state = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"loss": loss.item() / world, "state": state}, os.path.join(out_dir, f"world{world}.pt"))
    finish_gloo()



@pytest.mark.parametrize("loss_agg, episodes, correction", [
    ("all-token-mean", False, None), ("token-mean", False, None), ("seq-mean-token-mean", False, None),
    ("all-token-mean", True, None), ("all-token-mean", False, "tis"), ("all-token-mean", False, "icepop"),
    ("all-token-mean", False, "mis"), ("token-mean", False, "decoupled")])
def test_two_ranks_match_one_rank(tmp_path, loss_agg, episodes, correction):
    """Also with multi-turn episodes (observation tokens masked), whose token counts differ from their lengths, and
    with each off-policy correction on engine log-probs of continued responses (mis rejects some of them)."""
    for world in (1, 2):
        launcher.spawn(update_once, args=(world, free_port(), loss_agg, str(tmp_path), episodes, correction),
                       nprocs=world)
    one, two = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2.pt")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4)
    initial = dict(tiny_model().named_parameters())
    for name, weight in one["state"].items():
        assert not torch.allclose(weight, initial[name].detach()), f"{name} did not change"  # the update did something
        torch.testing.assert_close(two["state"][name], weight, rtol=1e-4, atol=1e-5)


def update_one_step_per_batch(rank: int, port: int, out_dir: str):
    """One optimizer step per batch, with the old log-probs taken from the update's own forward (the default) and
    from a pass of their own before it."""
    init_gloo(rank, 1, port)
    results, default_rule = {}, grpo.one_step_per_batch
    for name in ("from_update", "own_pass"):
        model = shard_model(tiny_model(), torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        samples = fixed_batch()
        passed = compute_logprobs(model, samples, 64, 1.0, torch.device("cpu"))
        if name == "own_pass":
            for s, lp in zip(samples, passed):
                s["old_logprobs"] = lp
        grpo.one_step_per_batch = default_rule if name == "from_update" else (lambda args: False)
        stats = grpo.update_policy(model, optimizer, samples, grpo.Args(max_response_len=4), 1, torch.device("cpu"),
                                   None)
        results[name] = {"state": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
                         "old": [s["old_logprobs"] for s in samples], "passed": passed, "loss": stats["loss"]}
    torch.save(results, os.path.join(out_dir, "one_step.pt"))
    finish_gloo()


def test_one_step_per_batch_takes_old_logprobs_from_the_update_forward(tmp_path):
    assert grpo.one_step_per_batch(grpo.Args()) and not grpo.one_step_per_batch(grpo.Args(epochs=2))
    assert not grpo.one_step_per_batch(grpo.Args(num_mini_batches=2))
    launcher.spawn(update_one_step_per_batch, args=(free_port(), str(tmp_path)), nprocs=1)
    results = torch.load(tmp_path / "one_step.pt")
    short, full = results["from_update"], results["own_pass"]
    for got, expected in zip(short["old"], full["passed"]):  # kept for rollout/logprob_diff, per response token
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert short["loss"] == pytest.approx(full["loss"], rel=1e-5)
    initial = dict(tiny_model().named_parameters())
    for name, weight in full["state"].items():
        assert not torch.allclose(weight, initial[name].detach()), f"{name} did not change"
        torch.testing.assert_close(short["state"][name], weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("flags, world, message", [
    (dict(group_size=1), 1, "--group-size"),
    (dict(prompts_per_step=3), 2, "divisible"),
    (dict(rollout_tp=2, prompts_per_step=12), 3, "--rollout-tp"),
    (dict(max_tokens_per_micro_batch=100, max_prompt_len=64, max_response_len=64), 1, "one whole sequence"),
    (dict(num_mini_batches=1000), 1, "--num-mini-batches"),
    (dict(reward_workers=0), 1, "--reward-workers must be at least 1"),
    (dict(lr=-1e-3), 1, "--lr must be greater than 0, got -0.001"),
    (dict(lr=0.0), 1, "--lr must be greater than 0"),  # an explicit 0 is refused, not replaced by the default
    (dict(temperature=0.0), 1, "--temperature must be greater than 0, got 0.0 \\(greedy"),
    (dict(max_response_len=0), 1, "--max-response-len must be at least 1, got 0"),
    (dict(top_p=1.5), 1, "--top-p must be at most 1"),
    (dict(eval_size=0), 1, "--eval-size must be at least 1"),
    (dict(reward_timeout=0.0), 1, "--reward-timeout must be greater than 0"),
    (dict(rollout_sleep_level=3), 1, "--rollout-sleep-level must be 0, 1 or 2, got 3"),
    (dict(rollout_gpu_memory=0.0), 1, "--rollout-gpu-memory must be greater than 0"),
])
def test_invalid_flag_values_and_combinations(flags, world, message):
    args = grpo.Args(**{"max_response_len": 2, "lr": 1e-3, **flags})
    with pytest.raises(ValueError, match=message):
        grpo.check_args(args, world)
    grpo.check_args(grpo.Args(max_response_len=2), 1)  # the defaults pass


def nan_update(rank: int, port: int, out_dir: str):
    init_gloo(0, 1, port)
    model = shard_model(tiny_model(), torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    samples = fixed_batch()
    for s, lp in zip(samples, compute_logprobs(model, samples, 64, 1.0, torch.device("cpu"))):
        s["old_logprobs"] = lp
    samples[3]["advantage"] = float("nan")  # one poisoned sample poisons the whole gradient
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    stats = grpo.update_policy(model, optimizer, samples, grpo.Args(max_response_len=4), 1, torch.device("cpu"), None)
    unchanged = all(torch.equal(p.full_tensor(), before[n]) for n, p in model.named_parameters())
    torch.save({"skipped": stats["skipped"], "unchanged": unchanged, "adam_state": len(optimizer.state)},
               os.path.join(out_dir, "nan.pt"))
    finish_gloo()


def test_nan_gradient_skips_the_update(tmp_path):
    launcher.spawn(nan_update, args=(free_port(), str(tmp_path)), nprocs=1)
    result = torch.load(tmp_path / "nan.pt")
    assert result == {"skipped": 1, "unchanged": True, "adam_state": 0}  # no step taken, Adam's moments untouched


def update_with_and_without_silent_groups(rank: int, port: int, out_dir: str):
    """The update on a batch whose odd samples have loss weight 0 (groups without signal), and on the even samples
    alone, from the same weights; records which sequences went through the model."""
    init_gloo(rank, 1, port)
    passed, results = [], {}
    packed = grpo.packed_response_logprobs

    def spy(model, samples, *args, **kwargs):
        passed.extend(len(s["response_ids"]) + len(s["prompt_ids"]) for s in samples)
        return packed(model, samples, *args, **kwargs)

    grpo.packed_response_logprobs = spy
    for name in ("mixed", "informative", "all-token-mean"):  # the last: the mixed batch, normalised by all its tokens
        model = shard_model(tiny_model(), torch.device("cpu"))
        results["initial"] = {"state": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        samples = fixed_batch()
        for i, s in enumerate(samples):
            s["loss_weight"] = float(i % 2 == 0)
        if name == "informative":
            samples = samples[::2]
        for s, lp in zip(samples, compute_logprobs(model, samples, 64, 1.0, torch.device("cpu"))):
            s["old_logprobs"] = lp - 0.05
        passed.clear()
        args = grpo.Args(max_response_len=4, loss_agg="all-token-mean" if name == "all-token-mean" else "token-mean")
        grpo.update_policy(model, optimizer, samples, args, 1, torch.device("cpu"), None)
        results[name] = {"passed": list(passed),
                         "state": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}
    torch.save(results, os.path.join(out_dir, "silent.pt"))
    finish_gloo()


def test_samples_without_signal_get_no_pass_and_change_nothing_and_all_token_mean_scales(tmp_path):
    launcher.spawn(update_with_and_without_silent_groups, args=(free_port(), str(tmp_path)), nprocs=1)
    results = torch.load(tmp_path / "silent.pt")
    informative_lengths = sorted(len(s["prompt_ids"]) + len(s["response_ids"]) for s in fixed_batch()[::2])
    assert sorted(results["mixed"]["passed"]) == informative_lengths  # the zero-weight half never ran
    for name, weight in results["informative"]["state"].items():
        torch.testing.assert_close(results["mixed"]["state"][name], weight)  # old log-probs packed two ways
    # --loss-agg all-token-mean divides the same sum by every response token of the batch: with SGD, the step is the
    # signal-only step scaled by (tokens of groups with signal) / (all response tokens).
    batch = fixed_batch()
    scale = sum(len(s["response_ids"]) for s in batch[::2]) / sum(len(s["response_ids"]) for s in batch)
    assert scale < 0.9
    for name, initial in results["initial"]["state"].items():
        torch.testing.assert_close(results["all-token-mean"]["state"][name] - initial,
                                   scale * (results["informative"]["state"][name] - initial), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Multi-turn episodes: observation tokens (response_mask 0) are context, never part of the loss.

def episode_batch(observation_logprob: float, mask_observations: bool = True):
    """fixed_batch with an observation of two tokens inside every response of 3+ tokens (after its first token),
    whose engine log-probs are `observation_logprob` (the rollout sets 0.0 there: any value must do)."""
    samples = fixed_batch()
    for s in samples:
        s["response_ids"] = s["response_ids"][:1] + [7, 8] + s["response_ids"][1:]
        s["response_mask"] = [1, 0 if mask_observations else 1, 0 if mask_observations else 1] + \
            [1] * (len(s["response_ids"]) - 3)
        s["logprobs"] = [-1.0, observation_logprob, observation_logprob] + [-1.0] * (len(s["response_ids"]) - 3)
    return samples


def update_episodes(rank: int, port: int, out_dir: str):
    init_gloo(rank, 1, port)
    results = {}
    for name, batch in [("a", episode_batch(0.0)), ("b", episode_batch(-30.0)), ("unmasked", episode_batch(0.0, False))]:
        model = shard_model(tiny_model(), torch.device("cpu"))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        args = grpo.Args(max_response_len=7, tis_cap=2.0, loss_agg="all-token-mean", num_mini_batches=2)
        for s, lp in zip(batch, compute_logprobs(model, batch, 64, 1.0, torch.device("cpu"))):
            s["old_logprobs"] = lp - 0.05 * torch.tensor([1.0, 9.0, 9.0] + [1.0] * (len(lp) - 3))
        stats = grpo.update_policy(model, optimizer, batch, args, 1, torch.device("cpu"), None)
        results[name] = {"stats": stats, "state": {n: p.full_tensor().detach().clone()
                                                   for n, p in model.named_parameters()}}
    torch.save(results, os.path.join(out_dir, "episodes.pt"))
    finish_gloo()


def test_observation_tokens_take_no_part_in_the_loss(tmp_path):
    """Two updates on episodes whose observation tokens have wildly different engine and old log-probs (so their
    ratios and TIS weights differ) move the weights identically, count only the model's tokens, and differ from an
    update that wrongly trains on the observations."""
    launcher.spawn(update_episodes, args=(free_port(), str(tmp_path)), nprocs=1)
    results = torch.load(tmp_path / "episodes.pt")
    a, b, unmasked = results["a"], results["b"], results["unmasked"]
    own_tokens = sum(len(s["response_ids"]) - 2 for s in episode_batch(0.0))
    assert a["stats"]["tokens"] == b["stats"]["tokens"] == own_tokens
    assert a["stats"]["loss"] == b["stats"]["loss"] and a["stats"]["pg_clipfrac"] == b["stats"]["pg_clipfrac"]
    for name, weight in a["state"].items():
        assert torch.equal(weight, b["state"][name]), name
    assert any(not torch.allclose(w, unmasked["state"][n]) for n, w in a["state"].items())
