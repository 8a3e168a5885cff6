"""common/train/moe.py on a tiny Qwen3-MoE (2 layers, 8 experts, top-2): replaying the model's own routes changes
nothing, other routes are followed (gate values and gradients as the formula says), the HF engine records the routes
the trainer then takes, the metrics and the load-balancing loss by hand, dense models refused; a GRPO update with
replayed routes is the same on 1 rank, 2 ranks and 2 sequence-parallel ranks; and grpo.py on the tiny MoE resumes
exactly."""

import os

import launcher
import pytest
import torch
import torch.distributed as dist
from gloo import finish_gloo, free_port, init_gloo
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import grpo
from common.rollout.engines import HFRolloutEngine
from common.train.logprobs import compute_logprobs, packed_response_logprobs, use_packed_attention
from common.train.model import decoder_layers, shard_model
from common.train.moe import (check_routing_replay, install_router_hooks, recorded_routes, router_aux_loss,
                              router_hooks, router_metrics)
from common.train.sequence_parallel import init_sequence_parallel
from test_grpo import fixed_batch

CPU = torch.device("cpu")
LAYERS, EXPERTS, TOP_K = 2, 8, 2


def tiny_moe(seed: int = 0, **config) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, head_dim=8,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=EXPERTS, num_experts_per_tok=TOP_K, vocab_size=40,
                                      max_position_embeddings=64, norm_topk_prob=True), **config})
    model = Qwen3MoeForCausalLM(config)
    for layer in model.model.layers:  # (the router starts at zero: every token would tie)
        torch.nn.init.normal_(layer.mlp.gate.weight, std=0.3)
    return model


def with_hooks(model, aux_coef: float = 0.0):
    install_router_hooks(model, decoder_layers(model), aux_coef)
    use_packed_attention(model, CPU)
    return model


def own_routes(model, samples: list[dict]) -> list[torch.Tensor]:
    """The routes the model itself takes on each packed sample, in the engine's layout [length - 1, layers, k]."""
    recorder = recorded_routes(model)
    with recorder, torch.no_grad():
        packed_response_logprobs(model, samples, 1.0)
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    return [r[:-1] for r in torch.split(recorder.steps[0], lengths)]


SAMPLES = fixed_batch()


def test_replaying_the_models_own_routes_changes_nothing():
    model = with_hooks(tiny_moe())
    plain = [s.copy() for s in SAMPLES]
    replayed = [dict(s, routes=r) for s, r in zip(SAMPLES, own_routes(model, SAMPLES))]
    results = []
    for samples in (plain, replayed):
        model.zero_grad()
        logprobs, _ = packed_response_logprobs(model, samples, 0.7)
        torch.cat(logprobs).sum().backward()
        results.append((torch.cat(logprobs).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.equal(results[0][0], results[1][0])
    for name, grad in results[0][1].items():
        assert torch.equal(results[1][1][name], grad), name
    metrics = router_metrics(model, CPU)
    assert metrics["moe/route_agreement"] == 1.0  # counted in the replayed pass only


@pytest.mark.parametrize("replay", [False, True])
def test_activation_checkpointing_recomputes_the_routers_without_counting_twice(replay):
    """With activation checkpointing a layer's forward runs again in backward, router hooks included: the
    recomputation must save what the forward saved (else torch stops the backward) and add no second count. Log-probs,
    every gradient (the load-balancing loss's on the routers too) and the metrics equal those without checkpointing."""
    results = []
    for checkpointing in (False, True):
        model = tiny_moe()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = with_hooks(model, aux_coef=0.5)
        samples = [dict(s, routes=r) for s, r in zip(SAMPLES, own_routes(model, SAMPLES))] if replay else SAMPLES
        logprobs, _ = packed_response_logprobs(model, samples, 0.7)
        (torch.cat(logprobs).sum() + router_aux_loss(model, 1.0)).backward()
        results.append((torch.cat(logprobs).detach(), {n: p.grad for n, p in model.named_parameters()},
                        router_metrics(model, CPU)))
    (plain, plain_grads, plain_metrics), (checked, checked_grads, checked_metrics) = results
    torch.testing.assert_close(checked, plain, rtol=0, atol=1e-6)
    assert plain_grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert checked_metrics == pytest.approx(plain_metrics)
    assert ("moe/route_agreement" in plain_metrics) == replay


def other_routes(routes: torch.Tensor, seed: int) -> torch.Tensor:
    """Top-k sets that differ from `routes` in every row: two experts drawn without replacement, shifted off."""
    g = torch.Generator().manual_seed(seed)
    drawn = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(routes[..., 0].numel())])
    drawn = drawn.view(*routes.shape[:-1], TOP_K).to(routes.dtype)
    same = (drawn.sort(-1).values == routes.sort(-1).values).all(-1, keepdim=True)
    return torch.where(same, (drawn + 1) % EXPERTS, drawn)


def test_other_routes_are_followed_with_the_routers_gradient():
    """A decoder layer's MoE block with replayed routes gives sum_k gate_k expert_k(x), gate = the router's
    probabilities of the given experts, renormalised: outputs and gradients (router weights included) as the formula;
    the whole model's log-probs change."""
    model = with_hooks(tiny_moe())
    block, hooks = model.model.layers[1].mlp, router_hooks(model)
    x = torch.randn(1, 5, 32, requires_grad=True)
    given = other_routes(torch.zeros(5, 1, TOP_K, dtype=torch.long), seed=3)[:, 0]  # [5, k]
    routes = torch.full((LAYERS, 5, TOP_K), -1, dtype=torch.long)
    routes[1] = given
    hooks.start_pass(routes, None, collect=False)
    replayed = block(x)
    hooks.start_pass(None, None, collect=False)
    gate = torch.softmax(x[0] @ block.gate.weight.T, -1).gather(-1, given)
    gate = gate / gate.sum(-1, keepdim=True)
    experts = block.experts
    expected = torch.stack([sum(gate[t, k] * torch.nn.functional.linear(
        experts.act_fn(up.chunk(2)[0]) * up.chunk(2)[1], experts.down_proj[e])
        for k, e in enumerate(given[t].tolist()) for up in [experts.gate_up_proj[e] @ x[0, t]])
        for t in range(5)]).unsqueeze(0)
    torch.testing.assert_close(replayed, expected, rtol=1e-5, atol=1e-6)
    weights = [block.gate.weight, experts.gate_up_proj, x]
    got = torch.autograd.grad(replayed.square().sum(), weights)
    want = torch.autograd.grad(expected.square().sum(), weights)
    assert got[0].abs().sum() > 0  # the router learns through the replayed experts' probabilities
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)

    own = own_routes(model, SAMPLES)
    elsewhere = [dict(s, routes=other_routes(r, seed=i)) for i, (s, r) in enumerate(zip(SAMPLES, own))]
    with torch.no_grad():
        a = torch.cat(packed_response_logprobs(model, SAMPLES, 1.0)[0])
        b = torch.cat(packed_response_logprobs(model, elsewhere, 1.0)[0])
    assert (a - b).abs().max() > 1e-3


def test_the_hf_engine_records_the_routes_the_trainer_takes():
    """Prompts of different lengths (left-padded), 2 samples each, stopped at different lengths: each completion's
    routes cover its prompt and all its tokens but the last; replayed in a packed pass, they are the trainer's own
    choices (agreement 1) and the log-probs do not move."""
    model = with_hooks(tiny_moe())
    engine = HFRolloutEngine(model, stop_token_ids=list(range(5, 15)), pad_token_id=0, record_routes=True)
    prompts = [[11, 12, 13], [14, 15, 16, 17, 18, 19], [20, 21]]
    groups = engine.generate(prompts, n=2, max_tokens=6, temperature=1.0, top_p=1.0, seed=1)
    samples = []
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert c.routes.shape == (len(prompt) + len(c.response_ids) - 1, LAYERS, TOP_K), c.routes.shape
            samples.append(dict(prompt_ids=prompt, response_ids=c.response_ids, routes=c.routes))
    assert len({len(s["response_ids"]) for s in samples}) > 1
    router_metrics(model, CPU)  # start over
    with torch.no_grad():
        replayed = packed_response_logprobs(model, samples, 1.0)[0]
        plain = packed_response_logprobs(model, [{k: v for k, v in s.items() if k != "routes"} for s in samples], 1.0)[0]
    for a, b in zip(replayed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with torch.enable_grad():  # a training pass counts
        packed_response_logprobs(model, samples, 1.0)
    assert router_metrics(model, CPU)["moe/route_agreement"] == 1.0
    greedy = engine.generate(prompts, n=2, max_tokens=2, temperature=1.0, top_p=1.0, seed=1, greedy=True)
    assert all(c.routes is None for group in greedy for c in group)  # evaluation records nothing


def test_metrics_and_load_balancing_loss_by_hand():
    model = with_hooks(tiny_moe(), aux_coef=0.5)
    hooks = router_hooks(model)
    logits = torch.randn(6, EXPERTS, requires_grad=True)
    experts = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2], [0, 5], [4, 0]])  # expert 0: 5 of the 12 slots
    hooks.start_pass(None, None, collect=True)
    hooks._hook(model.model.layers[0].mlp.gate, 0, (logits, torch.ones(6, 2), experts))
    uniform = torch.zeros(6, EXPERTS)
    hooks._hook(model.model.layers[1].mlp.gate, 1, (uniform, torch.ones(6, 2), torch.arange(12).view(6, 2) % 8))
    metrics = router_metrics(model, CPU)
    assert metrics["moe/max_load/layer0"] == pytest.approx(5 / 12)
    assert metrics["moe/max_load/layer1"] == pytest.approx(2 / 12)  # experts 0-3 twice, 4-7 once
    assert metrics["moe/max_load"] == pytest.approx(5 / 12)
    probs = torch.softmax(logits, -1)
    entropy = -(probs * probs.log()).sum(-1).mean().item()
    assert metrics["moe/router_entropy"] == pytest.approx((entropy + torch.log(torch.tensor(8.0)).item()) / 2)
    # transformers' own loss on one layer, where its top-k is the one given: the same number
    hf_layer0 = load_balancing_loss_func((logits,), EXPERTS, TOP_K)
    chosen = logits.topk(2).indices
    hooks.start_pass(None, None, collect=True)
    hooks._hook(model.model.layers[0].mlp.gate, 0, (logits, torch.ones(6, 2), chosen))
    torch.testing.assert_close(hooks.aux[0], hf_layer0)
    hooks.aux[0].backward()
    assert logits.grad.abs().sum() > 0
    assert "moe/route_agreement" not in router_metrics(model, CPU)  # nothing replayed
    hooks.start_pass(None, 0, collect=True)  # a filler pass (a rank without samples): none of its tokens count
    hooks._hook(model.model.layers[0].mlp.gate, 0, (logits, torch.ones(6, 2), chosen))
    assert hooks.aux[0].item() == 0  # not NaN: a mean over no tokens would poison the loss and the metrics
    hooks.start_pass(None, None, collect=True)
    hooks._hook(model.model.layers[0].mlp.gate, 0, (logits, torch.ones(6, 2), chosen))
    assert router_metrics(model, CPU)["moe/aux_loss"] == pytest.approx(hf_layer0.item())


def test_dense_models_are_unaffected_and_the_flags_refused():
    dense = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, vocab_size=40))
    assert install_router_hooks(dense, decoder_layers(dense)) is None and router_metrics(dense, CPU) == {}
    with pytest.raises(ValueError, match="--router-aux-loss-coef: the model has no experts \\(a dense llama model\\)"):
        install_router_hooks(dense, decoder_layers(dense), 0.01)
    with pytest.raises(ValueError, match="--routing-replay: the model has no experts"):
        check_routing_replay(grpo.Args(routing_replay=True), dense.config)
    with pytest.raises(ValueError, match="--routing-replay: single-turn rollouts only"):
        check_routing_replay(grpo.Args(routing_replay=True, env="lookup"), tiny_moe().config)
    check_routing_replay(grpo.Args(routing_replay=True), tiny_moe().config)
    with pytest.raises(ValueError, match="not aligned"):
        packed_response_logprobs(with_hooks(tiny_moe()), [dict(SAMPLES[0], routes=torch.zeros(5, LAYERS, TOP_K))], 1.0)


# ---------------------------------------------------------------------------------------------------------------
# A GRPO update with replayed routes (not the model's own) and the load-balancing loss on: 1 rank == 2 ranks ==
# 2 sequence-parallel ranks, weights and metrics.

def moe_update(rank: int, world: int, sp: int, port: int, out_dir: str):
    """One GRPO update (2 mini-batches) of the tiny MoE on the fixed batch with replayed routes that are not the
    model's own; on 1 rank also with the load-balancing loss on."""
    routes = [other_routes(r, seed=i) for i, r in enumerate(own_routes(with_hooks(tiny_moe()), SAMPLES))]
    init_gloo(rank, world, port)
    init_sequence_parallel(sp)
    results = {}
    for aux in [0.0, 0.1] if world == 1 else [0.0]:
        model = shard_model(tiny_moe(), CPU, packed_rows=True, router_aux_loss_coef=aux)
        args = grpo.Args(max_tokens_per_micro_batch=12 if world == 2 else 40, num_mini_batches=2, max_response_len=4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        group, groups = rank // sp, world // sp
        samples = [dict(s, routes=r) for s, r in zip(SAMPLES, routes)][group::groups]
        for s, lp in zip(samples, compute_logprobs(model, samples, 16, args.temperature, CPU)):
            s["old_logprobs"] = lp - 0.05
        grpo.update_policy(model, optimizer, samples, args, world, CPU, generator=None)
        results[aux] = {"metrics": router_metrics(model, CPU),
                        "state": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"world{world}_sp{sp}.pt"))
    finish_gloo()


def test_replayed_update_on_two_ranks_matches_one_rank(tmp_path):
    """1 rank; 2 data-parallel ranks (4 samples each, smaller micro-batches); 2 sequence-parallel ranks (each half of
    every packed row, its routes sliced alike): the same weights and expert loads. The load-balancing loss (1 rank)
    moves the routers further (it is a mean per micro-batch, so not split-invariant: off in the comparison)."""
    for world, sp in [(1, 1), (2, 1), (2, 2)]:
        launcher.spawn(moe_update, args=(world, sp, free_port(), str(tmp_path)), nprocs=world)
    one = torch.load(tmp_path / "world1_sp1.pt")
    initial = dict(tiny_moe().named_parameters())
    for name in ("world2_sp1.pt", "world2_sp2.pt"):
        other = torch.load(tmp_path / name)[0.0]
        for key in ("moe/max_load", "moe/router_entropy", "moe/route_agreement", "moe/max_load/layer1"):
            assert other["metrics"][key] == pytest.approx(one[0.0]["metrics"][key], rel=1e-6), (name, key)
        for weight, value in one[0.0]["state"].items():
            assert not torch.allclose(value, initial[weight].detach()), f"{weight} did not change"
            torch.testing.assert_close(other["state"][weight], value, rtol=1e-4, atol=1e-5, msg=f"{name} {weight}")
    assert one[0.0]["metrics"]["moe/route_agreement"] < 0.2  # the replayed routes were not the model's own
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(one[0.1]["state"][router], one[0.0]["state"][router], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# grpo.py on the tiny MoE with --routing-replay (the hf engine records the routes), killed after a saved state and
# resumed: the same rows and weights as an uninterrupted run.

def save_tiny_moe(path) -> str:
    from common.train.tiny_model import build_tiny_tokenizer
    tokenizer = build_tiny_tokenizer()
    model = tiny_moe(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_grpo_on_a_tiny_moe_resumes_exactly(tmp_path):
    from test_grpo_e2e import HASH_REWARD, metric_rows, torchrun
    from transformers import AutoModelForCausalLM
    (tmp_path / "hash_reward.py").write_text(HASH_REWARD)
    flags = ["--model", save_tiny_moe(tmp_path / "moe"), "--lr", "1e-3", "--routing-replay", "--steps", "4",
             "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8", "--eval-every", "2",
             "--save-state-every", "2", "--reward-fn", "hash_reward.py:reward", "--skip-reward-check"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    result = torchrun([*flags, "--output-dir", str(whole)], tmp_path, nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    crashed = torchrun([*flags, "--output-dir", str(killed)], tmp_path, nproc=1,
                       env={"NANORL_TEST_CRASH": "after_state:2"})
    assert crashed.returncode != 0
    resumed = torchrun([*flags, "--output-dir", str(killed)], tmp_path, nproc=1)
    assert f"resumed from {killed / 'state_000002'} at step 2" in resumed.stdout + resumed.stderr
    rows = metric_rows(whole)
    assert metric_rows(killed) == rows
    trained = [row for row in rows if "moe/max_load" in row]
    assert len(trained) >= 3 and all(row["moe/route_agreement"] == 1.0 for row in trained)
    a = AutoModelForCausalLM.from_pretrained(whole / "hf_step_4").state_dict()
    b = AutoModelForCausalLM.from_pretrained(killed / "hf_step_4").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_mfu_counts_the_active_experts_only():
    """flop_weighted_params (perf/mfu's parameter count): an expert weight counts top_k / experts of its size, every
    other weight in full; a LoRA model's frozen base at 4 of 6. By hand on the tiny model's own shapes."""
    from common.run.perf import flop_weighted_params

    model = tiny_moe()
    config = model.config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    assert experts == config.num_hidden_layers * config.num_experts * 3 * config.hidden_size \
        * config.moe_intermediate_size  # gate, up and down of every expert
    active = others + experts * config.num_experts_per_tok / config.num_experts
    assert flop_weighted_params([model]) == (experts + others, pytest.approx(active))
    model.requires_grad_(False)
    assert flop_weighted_params([model]) == (0, pytest.approx(active * 4 / 6))
