"""common/train/sequence_parallel.py: a packed row split over the ranks of a sequence-parallel group gives the log-probs,
entropies, values, loss and gradients of the whole row on one rank (grouped-query attention, sequences of mixed
lengths, a row whose length does not divide), and a GRPO update with N = 2 on 4 ranks (two data-parallel groups)
equals the same update on 4 ranks without it."""

import os

import launcher
import pytest
import torch
import torch.distributed as dist
from gloo import finish_gloo, free_port, init_gloo
from transformers import AutoModelForTokenClassification, Qwen2Config

import grpo
from common.run.distributed import sum_over_ranks
from common.train.logprobs import compute_logprobs, packed_response_logprobs
from common.train.model import init_sharding, shard_model
from common.train.sequence_parallel import check_heads, init_sequence_parallel
from common.train.value_models import packed_values
from test_grpo import fixed_batch, tiny_model

CPU = torch.device("cpu")


def tiny_critic():
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=40, max_position_embeddings=64, num_labels=1)
    return AutoModelForTokenClassification.from_config(config)


def one_pass(rank: int, world: int, size: int, port: int, out: str):
    """Log-probs, entropies and a loss of every sample on every rank of a group, backward, the gathered gradients;
    the critic's values and their gradients too."""
    init_gloo(rank, world, port)
    init_sequence_parallel(size)
    model = shard_model(tiny_model(), CPU, packed_rows=True)
    critic = shard_model(tiny_critic(), CPU, packed_rows=True)
    samples = fixed_batch()  # the same on every rank (one group): 8 sequences of 3-8 tokens, 37 in all
    logprobs, entropy = packed_response_logprobs(model, samples, 0.7, with_entropy=True)
    # As the scripts do: normalised by a count summed over ranks (each rank of a group counts the same samples),
    # scaled by the world for FSDP's average, the logged loss summed over ranks and divided by the world.
    tokens = sum_over_ranks({"tokens": sum(len(s["response_ids"]) for s in samples)}, CPU)["tokens"]
    weights = [torch.linspace(-1, 1, len(lp)) * (1 + i) for i, lp in enumerate(logprobs)]
    loss = sum((w * lp).sum() for w, lp in zip(weights, logprobs)) / tokens
    (loss * world).backward()
    logged = sum_over_ranks({"loss": loss.item() * world}, CPU)["loss"] / world
    values = packed_values(critic, samples)
    (sum((v ** 2).sum() for v in values) / tokens * world).backward()
    result = {"logprobs": torch.cat(logprobs).detach(), "entropy": torch.cat(entropy), "loss": logged,
              "values": torch.cat(values).detach(),
              "grads": {f"{kind}.{n}": p.grad.full_tensor().clone() for kind, net in [("policy", model), ("critic", critic)]
                        for n, p in net.named_parameters()}}
    if rank == 0:
        torch.save(result, os.path.join(out, f"sp{size}.pt"))
    finish_gloo()


@pytest.mark.parametrize("size", [2, 4])
def test_a_row_split_over_ranks_gives_what_one_rank_does(tmp_path, size):
    """The model has 4 query heads and 2 kv heads: N = 2 splits both, N = 4 copies each kv head to two ranks. The row
    of 37 tokens is padded to 38 and 40. Compared with N = 1 to float tolerance."""
    launcher.spawn(one_pass, args=(1, 1, free_port(), str(tmp_path)), nprocs=1)
    launcher.spawn(one_pass, args=(size, size, free_port(), str(tmp_path)), nprocs=size)
    one, split = torch.load(tmp_path / "sp1.pt"), torch.load(tmp_path / f"sp{size}.pt")
    for key in ("logprobs", "entropy", "values"):
        torch.testing.assert_close(split[key], one[key], rtol=1e-5, atol=1e-6, msg=key)
    assert split["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert one["grads"].keys() == split["grads"].keys() and len(one["grads"]) > 20
    for name, grad in one["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(split["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def grpo_update(rank: int, world: int, size: int, port: int, out: str, shard_size: int | None = None):
    """One GRPO update on 4 ranks, with a KL penalty and TIS weights: without sequence parallelism each rank takes 2
    of the 8 samples; with N = 2 each of the two groups takes 4, both of its ranks the same 4 (one mini-batch: the
    partition of the samples differs between the two layouts, the update over all of them does not)."""
    init_gloo(rank, world, port)
    init_sequence_parallel(size)
    init_sharding(shard_size, CPU)
    model = shard_model(tiny_model(), CPU, packed_rows=True)
    group, groups = rank // size, world // size
    samples = fixed_batch()[group::groups]
    for s, lp in zip(samples, compute_logprobs(model, samples, 16, 1.0, CPU)):
        s["old_logprobs"] = lp - 0.05
    for s in samples:
        s["logprobs"] = s["old_logprobs"].tolist()
    args = grpo.Args(max_tokens_per_micro_batch=12, max_response_len=4, kl_coef=0.1, tis_cap=2.0)
    for s, lp in zip(samples, compute_logprobs(model, samples, 16, 1.0, CPU)):
        s["ref_logprobs"] = lp + 0.1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    stats = grpo.update_policy(model, optimizer, samples, args, world, CPU, generator=None)
    sums = sum_over_ranks({k: stats[k] for k in ("loss", "entropy", "tokens", "kl")}, CPU)
    state = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        torch.save({"loss": sums["loss"] / world, "entropy": sums["entropy"] / sums["tokens"],
                    "kl": sums["kl"] / sums["tokens"], "state": state},
                   os.path.join(out, f"grpo_sp{size}_{shard_size}.pt"))
    finish_gloo()


def test_a_grpo_update_on_four_ranks_is_the_same_with_two_groups_of_two(tmp_path):
    """Also with hybrid sharding on top (models sharded within pairs of ranks, replicated across the pairs)."""
    for size, shard_size in [(1, None), (2, None), (2, 2)]:
        launcher.spawn(grpo_update, args=(4, size, free_port(), str(tmp_path), shard_size), nprocs=4)
    plain = torch.load(tmp_path / "grpo_sp1_None.pt")
    initial = dict(tiny_model().named_parameters())
    for name, weight in plain["state"].items():
        assert not torch.allclose(weight, initial[name].detach()), f"{name} did not change"
    for variant in ("grpo_sp2_None.pt", "grpo_sp2_2.pt"):
        split = torch.load(tmp_path / variant)
        for key in ("loss", "entropy", "kl"):
            assert split[key] == pytest.approx(plain[key], rel=1e-5), (variant, key)
        for name, weight in plain["state"].items():
            torch.testing.assert_close(split["state"][name], weight, rtol=1e-4, atol=1e-6, msg=f"{variant} {name}")


def test_heads_that_do_not_split_are_one_line():
    config = Qwen2Config(num_attention_heads=4, num_key_value_heads=2)
    check_heads(config, 4)
    with pytest.raises(ValueError, match="--sequence-parallel 3: the model's 4 attention heads"):
        check_heads(config, 3)
    with pytest.raises(ValueError, match="key-value heads"):
        check_heads(Qwen2Config(num_attention_heads=12, num_key_value_heads=3), 2)


@pytest.mark.parametrize("script, flags", [("grpo.py", ["--kl-coef", "0.05"]), ("ppo.py", []),
                                           ("dpo.py", ["--loss-type", "kto", "--ref-cache", "none"])])
def test_every_script_learns_the_same_with_its_two_ranks_in_one_group(tmp_path, script, flags):
    """Two ranks: two data-parallel ranks, or one sequence-parallel group of two. Three steps of each script log the
    same metrics (to float tolerance; the batch/ ones count a group's whole rows), the critic, a KL penalty and KTO's
    reference point included."""
    from test_grpo_e2e import metric_rows, torchrun

    rows = {}
    for size in (1, 2):
        out = tmp_path / f"sp{size}"
        result = torchrun(["--steps", "3", "--eval-every", "3", "--sequence-parallel", str(size), *flags,
                           "--output-dir", str(out)], tmp_path, script=script)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[size] = [{k: v for k, v in row.items() if not k.startswith("batch/")} for row in metric_rows(out)]
    assert [row["step"] for row in rows[2]] == [0, 1, 2, 3]
    for plain, split in zip(rows[1], rows[2]):
        assert plain.keys() == split.keys()
        for key, value in plain.items():
            assert split[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (plain["step"], key)
