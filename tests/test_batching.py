"""Token-budget batching (common/train/batching.py): plans checked by hand and by invariant, packing, and a GRPO loss whose
gradients do not depend on the split (budget 64 == one micro-batch == 2 ranks), with the packed forward under
FSDP2 equal to the plain one."""

import os
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from common.run.distributed import all_reduce_sum, max_over_ranks
from common.train.batching import (balance_across_ranks, batching_metrics, equalize_micro_batches,
                                   gather_in_original_order, pack_sequences, pad_rows, plan_micro_batches,
                                   restore_order, share_samples_evenly)
from common.train.logprobs import packed_token_logprobs
from common.train.model import shard_model
import launcher
from gloo import finish_gloo, free_port, init_gloo



def tiny_model(attn: str = "sdpa", hidden_size: int = 32):
    torch.manual_seed(0)
    # initializer_range 0.2: logits far from uniform, so a token attending across a boundary changes its log-prob.
    config = Qwen2Config(hidden_size=hidden_size, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=40, max_position_embeddings=128, tie_word_embeddings=True,
                         initializer_range=0.2, attn_implementation=attn)
    return Qwen2ForCausalLM(config)


def random_seqs(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 40) for _ in range(rng.randrange(2, 20))] for _ in range(n)]


# ---------------------------------------------------------------------------------------------------------------
# Plans.

def test_plan_micro_batches_by_hand():
    # First-fit decreasing: 5+4 fill the first budget of 9, then 3+3+2+1 the second.
    assert plan_micro_batches([3, 5, 1, 4, 2, 3], max_tokens=9) == [[1, 3], [0, 5, 4, 2]]
    with pytest.raises(ValueError, match="12 tokens .* budget of 10 tokens"):
        plan_micro_batches([3, 12], max_tokens=10)


def test_plan_micro_batches_invariants():
    rng = random.Random(0)
    lengths = [min(int(rng.lognormvariate(4, 1)), 500) + 1 for _ in range(300)]
    plan = plan_micro_batches(lengths, max_tokens=1000)
    assert sorted(i for mb in plan for i in mb) == list(range(300))  # every sample exactly once
    loads = [sum(lengths[i] for i in mb) for mb in plan]
    assert max(loads) <= 1000
    assert len(plan) <= -(-sum(lengths) // 1000) + 1  # within one micro-batch of the lower bound


def test_balance_across_ranks():
    # Largest first onto the least loaded: 10 -> rank 0, then the ten 1s fill rank 1 to 10.
    assert balance_across_ranks([1] * 5 + [10] + [1] * 5, 2) == [[5], [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]]
    rng = random.Random(1)
    lengths = [rng.randrange(1, 4000) for _ in range(100)]
    parts = balance_across_ranks(lengths, 8)
    assert sorted(i for p in parts for i in p) == list(range(100))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # the greedy's guarantee
    # A quadratic attention term moves work away from the rank holding the longest sequence.
    assert balance_across_ranks([100, 90, 20, 20], 2) == [[0, 3], [1, 2]]  # 120 vs 110 tokens
    # costs 100 + 0.01 * 100^2 = 200 vs 171 + 24 + 24 = 219
    assert balance_across_ranks([100, 90, 20, 20], 2, attention_weight=0.01) == [[0], [1, 2, 3]]


def test_equalize_micro_batches_splits_then_pads():
    lengths = [8, 4, 4, 3]
    plan = [[0], [1, 2, 3]]
    # One split: the heaviest splittable micro-batch [1, 2, 3] (11 tokens) becomes [1, 3] (7) and [2] (4).
    assert sorted(map(sorted, equalize_micro_batches(plan, lengths, 3))) == [[0], [1, 3], [2]]
    five = equalize_micro_batches(plan, lengths, 5)
    assert sorted(map(sorted, five)) == [[], [0], [1], [2], [3]]  # nothing left to split: one empty filler
    with pytest.raises(ValueError):
        equalize_micro_batches(plan, lengths, 1)


def test_restore_order_round_trip_and_checks():
    parts = [[4, 0], [2], [1, 3]]
    results = [[f"r{i}" for i in part] for part in parts]
    assert restore_order(parts, results) == ["r0", "r1", "r2", "r3", "r4"]
    with pytest.raises(ValueError, match="permutation"):
        restore_order([[0, 1], [1]], [[0, 1], [1]])
    with pytest.raises(ValueError, match="came back"):
        restore_order([[0, 1]], [[0]])


# ---------------------------------------------------------------------------------------------------------------
# Packing and log-probs.

def test_pack_sequences_by_hand():
    packed = pack_sequences([[5, 6, 7], [8, 9], [3, 4, 5, 6]], num_scored=[2, 1, 1])
    assert packed["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3, 4, 5, 6]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert packed["cu_seqlens"].tolist() == [0, 3, 5, 9] and packed["max_seqlen"] == 4
    # Position t predicts token t + 1: 6 and 7 from positions 0 and 1, 9 from 3, the final 6 from 7.
    assert packed["target_index"].tolist() == [0, 1, 3, 7]
    assert packed["targets"].tolist() == [6, 7, 9, 6]
    assert pack_sequences([[1, 2, 3]])["target_index"].tolist() == [0, 1]  # default: all but the first
    dummy = pack_sequences([])
    assert dummy["input_ids"].shape == (1, 2) and dummy["num_scored"] == [1]
    with pytest.raises(ValueError):
        pack_sequences([[1, 2]], num_scored=[2])


def test_pad_rows():
    rows = pad_rows([torch.tensor([1.0, 2.0]), [3.0], torch.tensor([4.0, 5.0, 6.0])])
    assert rows.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]


# ---------------------------------------------------------------------------------------------------------------
# On gloo ranks: a GRPO token-mean loss whose gradient must not depend on the budget or the ranks, and FSDP2.

def grpo_samples():
    rng = random.Random(5)
    samples = []
    for i in range(10):
        prompt = [rng.randrange(3, 40) for _ in range(rng.randrange(2, 7))]
        response = [rng.randrange(3, 40) for _ in range(rng.randrange(1, 12))]
        samples.append(dict(prompt_ids=prompt, response_ids=response, advantage=rng.uniform(-1, 1),
                            loss_weight=float(i != 3),  # one sample from a zero-variance group
                            old_logprobs=[rng.uniform(-4, -2) for _ in response]))
    return samples


def grpo_backward(model, samples, max_tokens, world, device, fillers=0):
    """One mini-batch of the GRPO update on packed micro-batches, as grpo.update_policy would run it."""
    import grpo  # here, not at the top: grpo pulls in datasets and tyro, which the GPU test below does not need
    args = grpo.Args(loss_agg="token-mean", max_response_len=12)
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    # The loss normalisers count the whole mini-batch on every rank, whatever the split.
    num_tokens, num_seqs = all_reduce_sum(
        [sum(len(s["response_ids"]) * s["loss_weight"] for s in samples),
         sum(s["loss_weight"] > 0 for s in samples)], device)
    plan = plan_micro_batches(lengths, max_tokens)
    plan = equalize_micro_batches(plan, lengths, max_over_ranks(len(plan), device)) + [[]] * fillers
    total = 0.0
    for mb in plan:
        mb_samples = [samples[i] for i in mb]
        packed = pack_sequences([s["prompt_ids"] + s["response_ids"] for s in mb_samples],
                                [len(s["response_ids"]) for s in mb_samples])
        logprobs, _ = packed_token_logprobs(model, packed, args.temperature, chunk_tokens=8)
        if not mb:  # a filler pass: zero weight, but the same collectives as the other ranks
            (logprobs.sum() * 0.0).backward()
            continue
        logprobs = pad_rows(torch.split(logprobs, packed["num_scored"]))  # [n, longest response]
        old = pad_rows([s["old_logprobs"] for s in mb_samples])
        mask = pad_rows([[s["loss_weight"]] * len(s["response_ids"]) for s in mb_samples])
        advantages = torch.tensor([[s["advantage"]] for s in mb_samples])
        token_loss, _, _ = grpo.policy_loss(logprobs, old, advantages, args.clip_low, args.clip_high)
        loss = grpo.aggregate_loss(token_loss, mask, args.loss_agg, num_tokens, num_seqs, args.max_response_len)
        (loss * world).backward()
        total += loss.item() * world
    return total, len(plan)


def split_invariance_run(rank, world, device) -> dict:
    samples = grpo_samples()
    mine = samples[rank::world]  # as generated: each rank its own prompts
    results = {}
    for name, budget, fillers in [("whole", 10_000, 0), ("budget64", 64, 0), ("budget64_filler", 64, 1)]:
        model = shard_model(tiny_model(), device)
        if world > 1:  # re-deal by token work
            mine_lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in mine]
            share, share_indices = share_samples_evenly(mine, mine_lengths, world, rank)
        else:
            share, share_indices = mine, list(range(len(mine)))
        loss, count = grpo_backward(model, share, budget, world, device, fillers)
        loss = all_reduce_sum([loss], device)[0] / world  # each rank's share is scaled by world for FSDP's mean
        results[name] = {"loss": loss, "micro_batches": count,
                         "grads": {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}}
    # Per-sample results come back in the original (rank-major) order.
    back = gather_in_original_order([s["advantage"] for s in share], share_indices, world)
    results["order_ok"] = back == [s["advantage"] for r in range(world) for s in samples[r::world]]
    share_lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in share]
    results["metrics"] = batching_metrics(plan_micro_batches(share_lengths, 64), share_lengths, device)
    return results


def fsdp_run() -> dict:
    """The packed path on an unsharded and an FSDP2-sharded copy of one model: it must gather the root's weights
    (embeddings, head) itself."""
    packed = pack_sequences(random_seqs(5, seed=7))
    out = {}
    for name, model in [("plain", tiny_model()), ("fsdp", shard_model(tiny_model(), torch.device("cpu")))]:
        for _ in range(2):  # twice: the second forward starts from resharded weights
            model.zero_grad()
            lp, entropy = packed_token_logprobs(model, packed, 0.8, chunk_tokens=16, with_entropy=True)
            (lp * torch.linspace(-1, 1, len(lp))).sum().backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in model.named_parameters()}
        out[name] = {"lp": lp.detach(), "entropy": entropy, "grads": grads}
    return out


def worker(rank, world, port, out_dir):
    init_gloo(rank, world, port)
    results = {"split": split_invariance_run(rank, world, torch.device("cpu"))}
    if world == 1:
        results["fsdp"] = fsdp_run()
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"world{world}.pt"))
    finish_gloo()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """One gloo run on 1 process and one on 2 (process start-up is most of the time), shared by the tests below."""
    out_dir = tmp_path_factory.mktemp("batching")
    for world in (1, 2):
        launcher.spawn(worker, args=(world, free_port(), str(out_dir)), nprocs=world)
    return torch.load(out_dir / "world1.pt"), torch.load(out_dir / "world2.pt")


def test_gradients_do_not_depend_on_budget_or_ranks(spawned):
    one, two = spawned[0]["split"], spawned[1]["split"]
    reference = one["whole"]
    assert reference["micro_batches"] == 1 and one["budget64"]["micro_batches"] > 1
    assert any(g.abs().sum() > 0 for g in reference["grads"].values())
    for run in (one["budget64"], one["budget64_filler"], two["whole"], two["budget64"], two["budget64_filler"]):
        assert run["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(run["grads"][name], grad, rtol=1e-4, atol=1e-6)
    assert one["order_ok"] and two["order_ok"]
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in grpo_samples()]
    m1, m2 = one["metrics"], two["metrics"]
    assert m1["batch/max_rank_tokens"] == m1["batch/min_rank_tokens"] == sum(lengths)
    assert m1["batch/padding_frac"] == 0.0
    assert m2["batch/max_rank_tokens"] + m2["batch/min_rank_tokens"] == sum(lengths)
    assert m2["batch/max_rank_tokens"] - m2["batch/min_rank_tokens"] <= max(lengths)


def test_packed_logprobs_under_fsdp2(spawned):
    out = spawned[0]["fsdp"]
    torch.testing.assert_close(out["fsdp"]["lp"], out["plain"]["lp"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out["fsdp"]["entropy"], out["plain"]["entropy"], rtol=1e-5, atol=1e-6)
    assert out["plain"]["grads"]["model.embed_tokens.weight"].abs().sum() > 0
    for name, grad in out["plain"]["grads"].items():
        torch.testing.assert_close(out["fsdp"]["grads"][name], grad, rtol=1e-4, atol=1e-6)
