"""DPO and KTO: the losses against values worked out by hand and their known value while policy == reference; then
the step's pieces on the tiny model: pairs packed == padded, the cached reference == a live one (and a changed key
recomputes), the start-up check catches a broken mask, 1 rank == 2 ranks (KTO's reference point gathered over
ranks), online pairs with ties."""

import math
import os

import pytest
import torch

import dpo
import launcher
from common.data import preference_source
from common.data.preferences import unpair
from gloo import finish_gloo, free_port, init_gloo


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def log1p_exp(x):  # -log sigmoid(-x) = log(1 + e^x)
    return math.log(1 + math.exp(x))


def loss(loss_type, beta, policy=(-1.0, -3.0), ref=(-2.0, -2.0), lengths=None, **kwargs):
    """preference_loss on one pair. The defaults give chosen log-ratio -1 - (-2) = 1, rejected -3 - (-2) = -1,
    and h = 1 - (-1) = 2."""
    tensors = [torch.tensor([value]) for value in (*policy, *ref)]
    if lengths is not None:
        kwargs |= {"chosen_lengths": torch.tensor([lengths[0]]), "rejected_lengths": torch.tensor([lengths[1]])}
    losses, chosen_rewards, rejected_rewards = dpo.preference_loss(*tensors, loss_type, beta, **kwargs)
    return losses.item(), chosen_rewards.item(), rejected_rewards.item()


def test_sigmoid_by_hand():
    # h = 2, beta = 0.5: -log sigmoid(1) = log(1 + e^-1)
    value, chosen_reward, rejected_reward = loss("sigmoid", 0.5)
    assert value == pytest.approx(log1p_exp(-1.0), abs=1e-6)
    assert (chosen_reward, rejected_reward) == pytest.approx((0.5 * 1, 0.5 * -1))
    # cDPO with eps = 0.1: 0.9 * -log sigmoid(1) + 0.1 * -log sigmoid(-1)
    smoothed, _, _ = loss("sigmoid", 0.5, label_smoothing=0.1)
    assert smoothed == pytest.approx(0.9 * log1p_exp(-1.0) + 0.1 * log1p_exp(1.0), abs=1e-6)


def test_sigmoid_gradient_by_hand():
    # d/d(policy_chosen) of -log sigmoid(beta h) = -beta * (1 - sigmoid(beta h)) = -0.5 * sigmoid(-1)
    policy_chosen = torch.tensor([-1.0], requires_grad=True)
    losses, _, _ = dpo.preference_loss(policy_chosen, torch.tensor([-3.0]), torch.tensor([-2.0]),
                                       torch.tensor([-2.0]), "sigmoid", 0.5)
    losses.sum().backward()
    assert policy_chosen.grad.item() == pytest.approx(-0.5 * sigmoid(-1.0), abs=1e-6)


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 5.0])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2, 0.4])
def test_sigmoid_at_zero_margin_is_ln2_for_any_beta_and_smoothing(beta, label_smoothing):
    # h = 0 with policy != reference: (-1 - -3) - (-2 - -4) = 0
    value, _, _ = loss("sigmoid", beta, policy=(-1.0, -3.0), ref=(-2.0, -4.0), label_smoothing=label_smoothing)
    assert value == pytest.approx(math.log(2), abs=1e-6)


def test_larger_beta_at_positive_margin_lowers_the_loss():
    values = [loss("sigmoid", beta)[0] for beta in (0.1, 0.5, 1.0, 2.0)]
    assert values == sorted(values, reverse=True) and len(set(values)) == 4
    # ...and smoothing raises it: the flipped-label term penalises a large margin
    assert loss("sigmoid", 1.0, label_smoothing=0.2)[0] > loss("sigmoid", 1.0)[0]


def test_robust_by_hand():
    # h = 2, beta = 0.5, eps = 0.1: (0.9 * -log sigmoid(1) + 0.1 * log sigmoid(-1)) / 0.8
    value, _, _ = loss("robust", 0.5, label_smoothing=0.1)
    assert value == pytest.approx((0.9 * log1p_exp(-1.0) - 0.1 * log1p_exp(1.0)) / 0.8, abs=1e-6)
    assert loss("robust", 0.5)[0] == pytest.approx(loss("sigmoid", 0.5)[0])  # eps = 0: plain DPO


def test_ipo_by_hand_on_per_token_averages():
    # averages: policy -1/2, -3/4; reference -2/2, -2/4 -> h = (-0.5 + 0.75) - (-1 + 0.5) = 0.75
    # beta = 0.5: 1 / (2 beta) = 1 -> (0.75 - 1)^2 = 0.0625
    value, chosen_reward, rejected_reward = loss("ipo", 0.5, lengths=(2, 4))
    assert value == pytest.approx(0.0625, abs=1e-6)
    assert (chosen_reward, rejected_reward) == pytest.approx((0.5 * (-0.5 + 1), 0.5 * (-0.75 + 0.5)))
    with pytest.raises(ValueError, match="ipo averages log-probs per token: pass chosen_lengths"):
        loss("ipo", 0.5)


def test_hinge_by_hand():
    assert loss("hinge", 0.5)[0] == pytest.approx(0.0)  # relu(1 - 0.5 * 2)
    assert loss("hinge", 0.25)[0] == pytest.approx(0.5)  # relu(1 - 0.25 * 2)
    assert loss("hinge", 0.25, policy=(-3.0, -1.0))[0] == pytest.approx(1 + 0.25 * 2)  # h = (-3 + 1) - 0 = -2


def test_apo_zero_by_hand():
    # chosen log-ratio 1, rejected -1, beta 0.5: 1 - sigmoid(0.5) + sigmoid(-0.5)
    value, _, _ = loss("apo-zero", 0.5)
    assert value == pytest.approx(1 - sigmoid(0.5) + sigmoid(-0.5), abs=1e-6)


def test_sppo_hard_by_hand():
    # chosen log-ratio 1, rejected -1: (1 - 1/(2 beta))^2 + (-1 + 1/(2 beta))^2
    assert loss("sppo-hard", 0.5)[0] == pytest.approx(0.0)  # 1/(2 beta) = 1: both at their targets
    assert loss("sppo-hard", 1.0)[0] == pytest.approx(0.5**2 + 0.5**2)
    assert loss("sppo-hard", 0.25)[0] == pytest.approx((1 - 2) ** 2 + (-1 + 2) ** 2)


def test_simpo_by_hand():
    # averages: -2/2 = -1 and -6/3 = -2; beta 2, gamma 1: -log sigmoid(2 * (-1 + 2) - 1) = log(1 + e^-1)
    value, chosen_reward, rejected_reward = loss("simpo", 2.0, policy=(-2.0, -6.0), lengths=(2, 3), simpo_gamma=1.0)
    assert value == pytest.approx(log1p_exp(-1.0), abs=1e-6)
    assert (chosen_reward, rejected_reward) == pytest.approx((2 * -1, 2 * -2))
    # no reference: it is not read at all
    losses, _, _ = dpo.preference_loss(torch.tensor([-2.0]), torch.tensor([-6.0]), None, None, "simpo", 2.0,
                                       simpo_gamma=1.0, chosen_lengths=torch.tensor([2]),
                                       rejected_lengths=torch.tensor([3]))
    assert losses.item() == pytest.approx(value)


def test_losses_are_per_pair():
    policy_chosen, policy_rejected = torch.tensor([-1.0, -2.0, -5.0]), torch.tensor([-3.0, -2.0, -1.0])
    reference = torch.full((3,), -2.0)
    losses, chosen_rewards, _ = dpo.preference_loss(policy_chosen, policy_rejected, reference, reference, "sigmoid",
                                                    1.0)
    # h per pair: 2, 0, -4
    assert losses.tolist() == pytest.approx([log1p_exp(-2.0), math.log(2), log1p_exp(4.0)], abs=1e-6)
    assert chosen_rewards.tolist() == pytest.approx([1.0, 0.0, -3.0]) and not chosen_rewards.requires_grad


@pytest.mark.parametrize("loss_type", [t for t in dpo.LOSS_TYPES if t not in ("simpo", "kto")])  # kto: below
@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_loss_at_reference_matches_preference_loss(loss_type, beta):
    smoothing = 0.1 if loss_type in dpo.SMOOTHED_LOSS_TYPES else 0.0
    logps = (torch.tensor([-7.0, -0.5]), torch.tensor([-3.0, -12.0]))  # any values: policy == reference
    lengths = {"chosen_lengths": torch.tensor([4, 1]), "rejected_lengths": torch.tensor([2, 9])}
    losses, chosen_rewards, rejected_rewards = dpo.preference_loss(*logps, *logps, loss_type, beta, smoothing,
                                                                   **lengths)
    expected = dpo.loss_at_reference(loss_type, beta, smoothing)
    assert losses.tolist() == pytest.approx([expected] * 2, abs=1e-6)
    assert chosen_rewards.tolist() == [0.0, 0.0] and rejected_rewards.tolist() == [0.0, 0.0]


def test_loss_at_reference_by_hand():
    assert dpo.loss_at_reference("sigmoid", 0.1, label_smoothing=0.3) == pytest.approx(math.log(2))
    assert dpo.loss_at_reference("robust", 0.1, label_smoothing=0.3) == pytest.approx(math.log(2))
    assert dpo.loss_at_reference("ipo", 0.5) == pytest.approx(1.0)  # (1 / (2 * 0.5))^2
    assert dpo.loss_at_reference("ipo", 0.1) == pytest.approx(25.0)  # (1 / 0.2)^2
    assert dpo.loss_at_reference("hinge", 0.1) == 1.0 and dpo.loss_at_reference("apo-zero", 3.0) == 1.0
    assert dpo.loss_at_reference("sppo-hard", 0.1) == pytest.approx(2 * 25.0)
    assert dpo.loss_at_reference("simpo", 2.0, simpo_gamma=1.0) is None


def test_kto_loss_by_hand():
    # log-ratios 1 (desirable) and -1 (undesirable), z0 = 0.5, beta = 2: values sigmoid(2 * 0.5) = sigmoid(1) and
    # sigmoid(2 * (0.5 + 1)) = sigmoid(3); losses w_D (1 - sigmoid(1)) and w_U (1 - sigmoid(3))
    policy, ref, desirable = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0]), torch.tensor([True, False])
    losses, rewards = dpo.kto_loss(policy, ref, desirable, 0.5, 2.0, desirable_weight=1.5, undesirable_weight=0.5)
    assert losses.tolist() == pytest.approx([1.5 * (1 - sigmoid(1.0)), 0.5 * (1 - sigmoid(3.0))], abs=1e-6)
    assert rewards.tolist() == pytest.approx([2.0, -2.0]) and not rewards.requires_grad
    # the gradient of a desirable row's loss pushes its log-prob up: -w beta sigmoid(x)(1 - sigmoid(x)), x = 1
    logps = torch.tensor([-1.0], requires_grad=True)
    dpo.kto_loss(logps, torch.tensor([-2.0]), torch.tensor([True]), 0.5, 2.0)[0].sum().backward()
    assert logps.grad.item() == pytest.approx(-2.0 * sigmoid(1.0) * (1 - sigmoid(1.0)), abs=1e-6)


def test_kto_loss_at_reference_by_hand():
    # every value sigmoid(0) = 1/2: the loss is half each row's weight, averaged over the rows
    assert dpo.loss_at_reference("kto", 0.1) == pytest.approx(0.5)
    assert dpo.loss_at_reference("kto", 0.1, desirable_share=0.25, desirable_weight=2.0,
                                 undesirable_weight=1.0) == pytest.approx((0.25 * 2.0 + 0.75 * 1.0) / 2)
    losses, rewards = dpo.kto_loss(torch.tensor([-4.0, -9.0]), torch.tensor([-4.0, -9.0]), torch.tensor([True, False]),
                                   0.0, 0.3)
    assert losses.tolist() == [0.5, 0.5] and rewards.tolist() == [0.0, 0.0]


def test_sft_loss_by_hand():
    # mean NLL per token: 2 / 2 and 6 / 3
    assert dpo.sft_loss(torch.tensor([-2.0, -6.0]), torch.tensor([2, 3])).tolist() == pytest.approx([1.0, 2.0])


@pytest.mark.parametrize("kwargs, message", [
    ({"loss_type": "nope"}, "unknown loss type 'nope'; known: sigmoid, ipo"),
    ({"beta": 0.0}, "beta must be greater than 0"),
    ({"loss_type": "hinge", "label_smoothing": 0.1}, "label smoothing applies to sigmoid, robust, simpo, not to hinge"),
    ({"loss_type": "robust", "label_smoothing": 0.5}, r"label smoothing must be in \[0, 0.5\)"),
    ({"simpo_gamma": 1.0}, "simpo_gamma applies to simpo only"),
])
def test_bad_settings_are_one_line(kwargs, message):
    settings = {"loss_type": "sigmoid", "beta": 0.1} | kwargs
    with pytest.raises(ValueError, match=message):
        dpo.loss_at_reference(**settings)
    with pytest.raises(ValueError, match=message):
        loss(settings.pop("loss_type"), settings.pop("beta"), **settings)


# ---------------------------------------------------------------------------------------------------------------
# The step's pieces on the built-in tiny model.

def tiny_pairs(n: int = 6, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    draw = lambda low, high: torch.randint(5, 35, (int(torch.randint(low, high, (1,), generator=gen)),),
                                           generator=gen).tolist()
    return [{"prompt_ids": draw(2, 6), "chosen_ids": draw(1, 4), "rejected_ids": draw(1, 4), "index": i}
            for i in range(n)]


def test_online_pairs_take_best_against_worst_and_skip_ties():
    args = dpo.Args(group_size=3)
    scores = [0.0, 1.0, 0.5, 1.0, 1.0, 1.0, 0.2, 0.0, 0.9]  # three prompts; the second one's group ties
    samples = [{"prompt_ids": [p], "response_ids": [10 + i], "score": s} for i, s in enumerate(scores)
               for p in [i // 3]]
    pairs, sums = dpo.make_online_pairs(samples, args)
    assert [(p["chosen_ids"], p["rejected_ids"]) for p in pairs] == [([11], [10]), ([18], [17])]
    assert sums == {"groups": 3, "ties": 1, "reward_gap": pytest.approx(1.0 + 0.9)}


def pieces_worker(rank: int, world: int, port: int, out_dir: str):
    from common.train.tiny_model import build_tiny_tokenizer
    from common.train.model import load_model, shard_model, token_logprobs
    init_gloo(rank, world, port)
    cpu = torch.device("cpu")
    tokenizer = build_tiny_tokenizer()
    policy = shard_model(load_model(None, tokenizer, 0), cpu)
    args = dpo.Args(max_tokens_per_micro_batch=24, lr=1e-2, max_len=16, sft_weight=0.0,
                    ref_cache=os.path.join(out_dir, "cache"))
    pairs = tiny_pairs()
    results = {}
    if world == 1:
        # Packed (both responses of each pair in one row, several pairs per micro-batch) == one padded sequence each.
        plain = load_model(None, tokenizer, 0)
        chosen, rejected = preference_source.example_logps(policy, pairs)
        by_hand = []
        for p in pairs:
            for side in ("chosen_ids", "rejected_ids"):
                ids = torch.tensor([p["prompt_ids"] + p[side]])
                lp, _ = token_logprobs(plain, ids, torch.ones_like(ids), 1.0)
                by_hand.append(lp[0, -len(p[side]):].sum().item())
        results["packed"] = (torch.stack([chosen, rejected], 1).flatten().tolist(), by_hand)
        # The cache == a live frozen reference; the same rows again come from the cache; other rows, another key.
        class Quiet:
            def print(self, message):
                results.setdefault("notes", []).append(message)
        args.steps = 1  # with 6 pairs a step and no held-out ones: the cache holds all 6
        args.pairs_per_step = 6
        cached = preference_source.cached_reference_logps(policy, pairs, [], args, rank, world, cpu, Quiet())
        live = preference_source.reference_logps(shard_model(load_model(None, tokenizer, 0), cpu), pairs,
                                                 args.max_tokens_per_micro_batch, rank, world, cpu)
        results["cache"] = ([cached[i] for i in range(6)], live)
        preference_source.cached_reference_logps(policy, pairs, [], args, rank, world, cpu, Quiet())
        preference_source.cached_reference_logps(policy, tiny_pairs(seed=1), [], args, rank, world, cpu, Quiet())
        results["cache_files"] = sorted(os.listdir(args.ref_cache))
        # The start-up check: passes while the policy is the reference, fails when the policy's log-probs are taken
        # one token off (a broken response mask: the last prompt token scored as if it were the response's).
        for p, pair in zip(pairs, live):
            p["ref"] = pair
        sums = dpo.train_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), pairs, None, args, world, cpu)
        dpo.check_start(sums, args)
        shifted = [{**p, "prompt_ids": p["prompt_ids"][:-1], "chosen_ids": p["prompt_ids"][-1:] + p["chosen_ids"],
                    "rejected_ids": p["prompt_ids"][-1:] + p["rejected_ids"]} for p in pairs]
        sums = dpo.train_step(policy, torch.optim.SGD(policy.parameters(), lr=0.0), shifted, None, args, world, cpu)
        try:
            dpo.check_start(sums, args)
            results["broken_check"] = None
        except ValueError as e:
            results["broken_check"] = str(e)
    # One step (SGD: linear in the gradient) on every pair, dealt out over `world` ranks.
    mine = pairs[rank::world]
    for p in mine:
        p["ref"] = (-3.0, -3.5)
    sums = dpo.train_step(policy, torch.optim.SGD(policy.parameters(), lr=args.lr), mine, None, args, world, cpu)
    results["weights"] = {n: p.full_tensor().clone() for n, p in policy.named_parameters()}
    results["loss"] = sum_over(sums["loss"], cpu)
    # KTO: the same pairs as desirable and undesirable rows, with KL partners; its reference point z0 is one number
    # over every rank's rows, so one step on 2 ranks equals one on 1 (and at policy == reference the loss is 1/2).
    kto = dpo.Args(**{**vars(args), "loss_type": "kto", "sft_weight": 0.5})
    rows = unpair(tiny_pairs(seed=2), max_len=16, seed=0)
    for r in rows:
        r["ref"] = (-3.0 - r["label"], -50.0)  # not the policy's: rewards and a reference point z0 > 0
    reference = preference_source.ReferenceLogps(budget=kto.max_tokens_per_micro_batch, device=cpu)
    kto_policy = shard_model(load_model(None, tokenizer, 0), cpu)
    sums = dpo.train_step(kto_policy, torch.optim.SGD(kto_policy.parameters(), lr=args.lr), rows[rank::world],
                          reference, kto, world, cpu)
    results["kto_weights"] = {n: p.full_tensor().clone() for n, p in kto_policy.named_parameters()}
    results["kto"] = (sum_over(sums["loss"], cpu), sums["kl"])
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"world{world}.pt"))
    finish_gloo()


def sum_over(value: float, device) -> float:
    from common.run.distributed import all_reduce_sum
    return all_reduce_sum([value], device)[0]


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    out = tmp_path_factory.mktemp("dpo_pieces")
    for world in (1, 2):
        launcher.spawn(pieces_worker, args=(world, free_port(), str(out)), nprocs=world)
    return torch.load(out / "world1.pt"), torch.load(out / "world2.pt")


def test_pairs_packed_equal_padded(pieces):
    packed, by_hand = pieces[0]["packed"]
    assert packed == pytest.approx(by_hand, abs=1e-5)


def test_cached_reference_equals_a_live_one_and_a_new_key_recomputes(pieces):
    cached, live = pieces[0]["cache"]
    assert cached == [pytest.approx(pair, abs=1e-6) for pair in live]
    notes = pieces[0]["notes"]
    assert notes[0].endswith("0 from " + notes[0].split(" from ")[1].split(",")[0] + ", 6 computed")
    assert ": 6 from " in notes[1] and notes[1].endswith(", 0 computed")  # the same rows: all from the cache
    assert notes[2].endswith(", 6 computed") and len(pieces[0]["cache_files"]) == 2  # other rows: another key


def test_resolve_defaults_chooses_and_prints_the_eval_size():
    """--eval-size unset: resolve_defaults sets it (the built-in task: 256 held-out pairs and prompts) and names it
    among the values chosen for you."""
    args = dpo.Args()
    assert "--eval-size 256" in dpo.resolve_defaults(args)[0] and args.eval_size == 256


def test_start_check_catches_a_broken_mask(pieces):
    message = pieces[0]["broken_check"]
    assert message is not None and "the sigmoid loss must be 0.6931 and the implicit rewards 0" in message


def test_two_ranks_step_as_one(pieces):
    one, two = pieces
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, rtol=1e-4, atol=1e-6)


def test_kto_two_ranks_step_as_one(pieces):
    one, two = pieces
    (loss_one, kl_one), (loss_two, kl_two) = one["kto"], two["kto"]
    assert kl_one > 0 and kl_two == pytest.approx(kl_one, rel=1e-5)  # gathered: the same z0 on every rank
    assert loss_two == pytest.approx(loss_one, rel=1e-5)
    for name, weight in one["kto_weights"].items():
        torch.testing.assert_close(two["kto_weights"][name], weight, rtol=1e-4, atol=1e-6)
