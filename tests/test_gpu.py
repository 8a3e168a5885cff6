"""The colocated vLLM path on one GPU: weight sync equality (sharding/vllm_sync.py) and log-prob parity between
vLLM's sampled tokens and the trainer's forward pass (common/rollout/vllm_engine.py). Skipped without CUDA and vllm.

Run: python -m pytest -m gpu tests/test_gpu.py
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

from gloo import free_port

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# vocab 1000 is not a multiple of 64, so vLLM pads the embedding: the check must see the padding rows.
# initializer_range 0.1 gives logits with a std of about 1.6, so log-probs depend on the weights.
CONFIG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=1000, tie_word_embeddings=True, rope_theta=1e6, initializer_range=0.1,
              max_position_embeddings=512)


@pytest.fixture(scope="module")
def nccl_world():
    """A world of one, on NCCL, as torchrun would start it."""
    if not dist.is_initialized():
        # vLLM's external_launcher reads RANK and LOCAL_RANK from the environment, like torchrun sets them.
        for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(free_port())).items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    return torch.device("cuda", 0)


def test_offload_between_phases_changes_nothing(nccl_world):
    """Three AdamW steps of an FSDP2 model with it and its optimizer parked in CPU memory between them
    (common/train/offload.py, ppo.py --offload) end at the weights of three steps without; parked, neither holds GPU
    memory. A moment lost or left behind on the way would change the weights or fail the step."""
    from common.train.model import shard_model
    from common.train.offload import Offloader
    from common.train.optim import make_optimizer

    local = lambda t: t.to_local() if hasattr(t, "to_local") else t

    def train(offload: bool) -> dict:
        torch.manual_seed(0)
        model = shard_model(AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG), dtype=torch.float32), nccl_world)
        optimizer, _ = make_optimizer(model, 1e-3, 0.0, 0, 0.99)
        offloader = Offloader(offload, nccl_world)
        ids = torch.randint(0, 1000, (4, 64), device=nccl_world)
        for _ in range(3):
            with offloader.on_gpu(model, optimizer):
                model(ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                tensors = [local(p) for p in model.parameters()] + [
                    local(v) for state in optimizer.state.values() for k, v in state.items() if k != "step"]
                in_use, size = torch.cuda.memory_allocated(), sum(t.numel() * t.element_size() for t in tensors)
            if offload:
                held = [tuple(t.shape) for t in tensors if t.untyped_storage().nbytes()]
                assert not held, held[:5]
                assert torch.cuda.memory_allocated() <= in_use - size  # freed: the weights and both Adam moments
        with offloader.on_gpu(model):
            return {name: p.full_tensor().cpu() for name, p in model.named_parameters()}

    plain, parked = train(False), train(True)
    assert plain.keys() == parked.keys()
    for name in plain:  # the same kernels on the same data; a tolerance only for atomics in backward
        torch.testing.assert_close(parked[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    norm = plain["model.norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))  # the steps moved the weights (a norm starts at ones)


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, nccl_world):
    """A world of one (NCCL), a tiny FSDP2 Qwen2 policy and a vLLM engine that starts with dummy weights."""
    pytest.importorskip("vllm")
    from common.rollout.vllm_engine import VLLMRolloutEngine
    from common.train.model import shard_model

    config = Qwen2Config(**CONFIG)
    model_dir = tmp_path_factory.mktemp("tiny_qwen2")
    config.save_pretrained(model_dir)
    torch.manual_seed(0)
    policy = shard_model(AutoModelForCausalLM.from_config(config, dtype=torch.float32), torch.device("cuda", 0))
    engine = VLLMRolloutEngine(str(model_dir), tp_size=1, gpu_memory_utilization=0.2, max_model_len=256,
                               stop_token_ids=[], seed=0, enforce_eager=True)
    return policy, engine


def test_sync_makes_vllm_equal_the_trainer(colocated):
    policy, engine = colocated
    policy.reshard()  # the perturbations below must hit the sharded master weights, not a gathered copy
    metrics = engine.update_weights(policy)  # dummy weights -> trainer weights
    expected_bytes = sum(p.numel() for p in policy.parameters()) * 2  # bf16; the tied head is counted once
    assert metrics["sync/gb"] == pytest.approx(expected_bytes / 1e9)
    engine.check_weights(policy)

    # A trainer update that has not been synced yet must be caught, and named.
    k_proj = policy.model.layers[1].self_attn.k_proj.weight
    with torch.no_grad():
        k_proj.add_(0.5)
    with pytest.raises(RuntimeError, match=r"layers\.1\.self_attn\.k_proj\.weight"):
        engine.check_weights(policy)

    # The training-loop cycle at every sleep level: sleep, a trainer update, wake and sync. Each level must free at
    # least the KV cache; level 0 must leave the weights in place (the sync overwrites them there), level 1's wake-up
    # must not bring the parked, stale weights back over the synced ones, and level 2's maps memory that the sync
    # must fill entirely.
    from sharding.vllm_sync import check_weight_sync
    engine.update_weights(policy)
    kv_bytes = engine._allocated_bytes("kv_cache")
    for level in (0, 1, 2):
        engine.sleep_level = level
        free = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert torch.cuda.mem_get_info()[0] - free >= kv_bytes, level
        if level == 0:
            check_weight_sync(policy, engine.vllm_model)  # asleep, and the weights are still the synced ones
        with torch.no_grad():
            k_proj.add_(0.5)
        engine.update_weights(policy)
        engine.check_weights(policy)

    # A rollout after a level-0 sleep without a sync (an evaluation's weights again) maps the KV cache back itself.
    engine.sleep_level = 0
    engine.sleep()
    [[completion]] = engine.generate([[1, 2, 3]], n=1, max_tokens=4, temperature=1.0, top_p=1.0, seed=0,
                                     ignore_eos=True)
    assert len(completion.response_ids) == 4 and not engine.asleep
    # The wake-up follows the level the engine slept at, even if the level changed in between.
    engine.sleep()
    engine.sleep_level = 2
    engine.update_weights(policy)
    engine.check_weights(policy)
    assert not any(a.is_asleep for a in engine._allocations("kv_cache"))  # the KV cache is mapped again
    # A level-0 sleep refuses to free the KV cache under unfinished requests (a generate cut short).
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    engine.llm.enqueue([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2), use_tqdm=False)
    engine.sleep_level = 0
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.sleep()
    while engine.llm.llm_engine.has_unfinished_requests():
        engine.llm.llm_engine.step()
    engine.sleep_level = 2

    # Level 2 drops the weights: woken without a sync they hold whatever the memory held (vLLM issue 29341 served
    # such weights silently). The trainer has moved since the last sync, so the memory cannot happen to hold the
    # right values, and the check must fail.
    with torch.no_grad():
        k_proj.add_(0.5)
    engine.sleep()
    with pytest.raises(RuntimeError, match="no weights: call update_weights"):
        engine.generate([[1, 2, 3]], n=1, max_tokens=4, temperature=1.0, top_p=1.0, seed=0)
    engine.llm.wake_up()  # behind the engine's back: weights and KV cache, without a sync
    engine.asleep = False
    with pytest.raises(RuntimeError, match="weight sync check failed"):
        engine.check_weights(policy)
    engine.update_weights(policy)
    engine.check_weights(policy)

    with torch.no_grad():
        policy.model.embed_tokens.weight.mul_(1.5)  # the tied embedding is also vLLM's lm_head
    with pytest.raises(RuntimeError, match=r"embed_tokens"):
        engine.check_weights(policy)
    engine.update_weights(policy)
    engine.check_weights(policy)


def test_vllm_logprobs_match_the_trainer(colocated):
    from common.train.model import token_logprobs

    policy, engine = colocated
    engine.update_weights(policy)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (int(length),), generator=generator).tolist()
               for length in torch.randint(4, 20, (8,), generator=generator)]

    def generate(seed):
        # Cached prompt blocks would change the prefill batch shapes, hence the last bits of the logits.
        engine.llm.reset_prefix_cache()
        return engine.generate(prompts, n=2, max_tokens=32, temperature=1.0, top_p=1.0, seed=seed)

    outputs = generate(123)
    assert [len(group) for group in outputs] == [2] * len(prompts)
    # The same per-request seeds give the same samples; another step's seed gives others.
    again, other = generate(123), generate(124)
    responses = [c.response_ids for group in outputs for c in group]
    assert responses == [c.response_ids for group in again for c in group]
    assert responses != [c.response_ids for group in other for c in group]

    # An fp32 copy of the trainer's weights is the reference: the trainer computes in bf16 (FSDP2 mixed
    # precision) and so does vLLM, so each is off the exact log-probs by bf16 rounding. With the same weights
    # vLLM is no further off than the trainer's own rounding allows; stale or mis-sliced weights are off by O(1).
    config = policy.config
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).cuda().eval()
    reference.load_state_dict({k: v.full_tensor() for k, v in policy.state_dict().items()})
    vllm_diffs, trainer_diffs, pair_diffs, vllm_logprobs = [], [], [], []
    for prompt, group in zip(prompts, outputs):
        for completion in group:
            assert len(completion.response_ids) == 32 and not completion.finished  # no stop tokens: cut at 32
            assert len(completion.logprobs) == len(completion.response_ids)
            ids = torch.tensor([prompt + completion.response_ids], device="cuda")
            with torch.no_grad():
                trainer_lp, _ = token_logprobs(policy, ids, torch.ones_like(ids), temperature=1.0)
                exact_lp, _ = token_logprobs(reference, ids, torch.ones_like(ids), temperature=1.0)
            trainer_lp = trainer_lp[0, len(prompt) - 1:].cpu()  # the log-probs of the response tokens
            exact_lp = exact_lp[0, len(prompt) - 1:].cpu()
            vllm_lp = torch.tensor(completion.logprobs)
            vllm_diffs.append((vllm_lp - exact_lp).abs())
            trainer_diffs.append((trainer_lp - exact_lp).abs())
            pair_diffs.append((vllm_lp - trainer_lp).abs())
            vllm_logprobs.append(vllm_lp)
    vllm_err, trainer_err, pair = (torch.cat(d).mean().item() for d in (vllm_diffs, trainer_diffs, pair_diffs))
    print(f"mean |vLLM - fp32| {vllm_err:.4f}, |trainer bf16 - fp32| {trainer_err:.4f}, |vLLM - trainer| {pair:.4f}")
    # Log-probs spread far from uniform (log 1/1000 = -6.9), so a small error says the weights are the same.
    assert torch.cat(vllm_logprobs).std() > 0.5
    assert vllm_err < 2 * trainer_err + 0.01, (
        f"vLLM is off the fp32 log-probs by {vllm_err:.4f}, the bf16 trainer by {trainer_err:.4f}")


def test_each_group_is_handed_over_as_soon_as_it_is_complete(colocated):
    """generate's on_finish gets every prompt's group exactly once, the same one generate returns, and (with
    responses of different lengths) some of them while other requests are still generating: what lets grpo.py
    score rewards during generation."""
    policy, engine = colocated
    engine.update_weights(policy)
    prompts = [[1 + i, 2 + i, 3 + i] for i in range(16)]
    handed, unfinished = {}, []

    def on_finish(i, group):
        assert i not in handed
        handed[i] = group
        unfinished.append(engine.llm.llm_engine.get_num_unfinished_requests())

    stop_ids, engine.stop_token_ids = engine.stop_token_ids, list(range(0, 1000, 10))  # ~1 in 10 tokens stops
    try:
        outputs = engine.generate(prompts, n=4, max_tokens=64, temperature=1.0, top_p=1.0, seed=5,
                                  on_finish=on_finish)
    finally:
        engine.stop_token_ids = stop_ids
    assert sorted(handed) == list(range(len(prompts))) and all(handed[i] is outputs[i] for i in handed)
    assert all(len(group) == 4 for group in outputs)
    assert len({len(c.response_ids) for group in outputs for c in group}) > 1
    assert max(unfinished) > 0, unfinished


def test_a_phase_cut_by_stop_continues_in_the_next(colocated):
    """generate_until (partial rollouts): stopped after 5 engine steps, the running requests come back with their
    tokens and as many log-probs, vLLM holds none of them any more (so the engine can sleep), and continued from
    their tokens with the rest of their budget they end at exactly max_tokens; requests that end early go to
    on_finish, once each."""
    from common.rollout.completion import Request

    policy, engine = colocated
    engine.update_weights(policy)
    requests = [Request(i, [1 + i, 2 + i, 3 + i], max_tokens=40 if i % 2 else 3, seed=i) for i in range(8)]
    finished, asked = {}, iter(range(10**6))
    cut, busy = engine.generate_until(requests, 1.0, 1.0, on_finish=lambda k, c: finished.setdefault(k, c),
                                      stop=lambda: next(asked) >= 5)
    assert sorted(finished) == [0, 2, 4, 6] and all(len(c.response_ids) == 3 for c in finished.values())
    assert sorted(cut) == [1, 3, 5, 7] and busy and busy[-1][1] == 4
    assert all(0 < len(c.response_ids) < 40 and len(c.logprobs) == len(c.response_ids) for c in cut.values())
    assert not engine.llm.llm_engine.has_unfinished_requests()
    engine.sleep()
    later = [Request(k, [1 + k, 2 + k, 3 + k] + c.response_ids, 40 - len(c.response_ids), seed=k,
                     position=len(c.response_ids)) for k, c in cut.items()]
    still_cut, _ = engine.generate_until(later, 1.0, 1.0, on_finish=lambda k, c: finished.setdefault(k, c),
                                         stop=lambda: False)
    assert not still_cut and sorted(finished) == list(range(8))
    assert all(len(cut[k].response_ids) + len(finished[k].response_ids) == 40 for k in cut)
    assert all(math.isfinite(x) and x <= 0 for c in finished.values() for x in c.logprobs)


def test_a_lora_policy_reaches_vllm_merged(colocated):
    """--lora-sync merged (the default): a LoRA policy's adapters go merged into its base weights, checked like any
    other weights; an adapter changed after the sync is found under its layer's weight."""
    from types import SimpleNamespace

    from common.train.lora import add_lora
    from common.train.model import shard_model

    _, engine = colocated
    torch.manual_seed(0)
    model = add_lora(AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG), dtype=torch.float32),
                     SimpleNamespace(lora_rank=8, lora_alpha=16.0, lora_targets=None), seed=1)
    with torch.no_grad():  # trained adapters (B starts at zero, which would merge to the base)
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    policy = shard_model(model, torch.device("cuda", 0))
    engine.update_weights(policy)
    engine.check_weights(policy)
    with torch.no_grad():
        policy.model.layers[1].self_attn.v_proj.lora_B["default"].weight.add_(0.5)
    with pytest.raises(RuntimeError, match=r"layers\.1\.self_attn\.v_proj\.weight"):
        engine.check_weights(policy)
    engine.update_weights(policy)
    engine.check_weights(policy)


@pytest.mark.parametrize("sync, level", [("adapter", 0), ("adapter", 1), ("merged", None)])
def test_lora_runs_with_every_sync_checked(tmp_path, sync, level):
    """grpo.py --lora-rank 8 on a small random Qwen2 with vLLM, both ways of reaching it: --lora-sync adapter (the base
    loaded once, each update's adapters through vLLM's LoRA layers, at sleep levels 0 and 1, which parks the LoRA
    buffers with the weights) and merged; --check-weight-sync compares base and adapters (or the merged weights)
    after every sync, and vLLM's log-probs stay those of the trainer."""
    import json
    import subprocess
    import sys

    from scripts.random_model import full_vocab_tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG), dtype=torch.bfloat16).save_pretrained(model_dir)
    full_vocab_tokenizer(1000).save_pretrained(model_dir)
    flags = ["--model", str(model_dir), "--lora-rank", "8", "--lora-sync", sync, "--check-weight-sync",
             "--rollout-engine", "vllm", "--rollout-eager", "--steps", "4", "--lr", "1e-3", "--prompts-per-step", "8",
             "--group-size", "8", "--max-response-len", "16", "--eval-every", "2", "--eval-size", "16",
             "--logprob-diff-every", "1", "--output-dir", str(tmp_path / "run")]
    flags += [] if level is None else ["--rollout-sleep-level", str(level)]
    flags += ["--precision", "bf16"]  # vLLM's LoRA kernels refuse fp32 (--precision auto's choice for this model)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                             os.path.join(root, "grpo.py"), *flags], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["rollout/logprob_diff"] for r in rows if "rollout/logprob_diff" in r]
    print(sync, level, "logprob diffs", diffs, "sync seconds", [r.get("time/sync") for r in rows])
    assert diffs and max(diffs) < 0.05, diffs
    assert (tmp_path / "run" / "hf_step_4" / "adapter_model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------
# Mixture-of-experts models (sharding/vllm_moe.py): transformers' fused experts into vLLM's fused-MoE layer.

MOE_EXPORT_LOGPROBS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

path, prompts = sys.argv[1], json.loads(sys.argv[2])
llm = LLM(model=path, skip_tokenizer_init=True, gpu_memory_utilization=0.25, max_model_len=256, enforce_eager=True,
          dtype="bfloat16", seed=0)
outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                       SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)
vllm_lp = [[ranked[token].logprob for token, ranked in zip(p[1:], o.prompt_logprobs[1:])] for p, o in zip(prompts, outputs)]
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
hf_lp = []
for p in prompts:
    ids = torch.tensor([p], device="cuda")
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    hf_lp.append(logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist())
print("LOGPROBS " + json.dumps({"vllm": vllm_lp, "hf": hf_lp}))
"""


def run_moe_grpo(tmp_path, shape: str, nproc: int = 1, more: tuple = (), **sizes) -> list[dict]:
    """grpo.py with --check-weight-sync on scripts/random_model.py's tiny `shape` (initialised at std 0.1, so that
    log-probs depend on the weights; `sizes` override its config's) and a reward of varied values (the weights move
    every step); its metric rows."""
    import json
    import subprocess
    import sys

    from scripts.random_model import full_vocab_tokenizer, model_config
    from test_grpo_e2e import HASH_REWARD

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config, tokenizer = model_config(shape), full_vocab_tokenizer(4096)
    config.update(sizes)
    config.initializer_range, config.eos_token_id, config.pad_token_id = 0.1, tokenizer.eos_token_id, \
        tokenizer.pad_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    (tmp_path / "hash_reward.py").write_text(HASH_REWARD)
    flags = ["--model", str(tmp_path / "model"), "--check-weight-sync", "--rollout-engine", "vllm", "--rollout-eager",
             "--precision", "bf16", "--steps", "3", "--lr", "1e-3", "--prompts-per-step", "8", "--group-size", "8",
             "--max-response-len", "16", "--eval-every", "2", "--eval-size", "16", "--logprob-diff-every", "1",
             "--reward-fn", "hash_reward.py:reward", "--skip-reward-check", "--output-dir", str(tmp_path / "run"),
             *more]
    try:
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 str(nproc), os.path.join(root, "grpo.py"), *flags], cwd=tmp_path, capture_output=True,
                                text=True, timeout=420, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired as e:  # say where it stood (a caller's own time limit would show nothing)
        pytest.fail(f"grpo.py ran past 420 s; its output ends: {(e.stdout or b'')[-3000:].decode(errors='replace')}"
                    f"{(e.stderr or b'')[-3000:].decode(errors='replace')}")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("shape", ["qwen3-moe-tiny", "olmoe-tiny"])
def test_moe_runs_with_every_sync_checked_and_exports_to_vllm(tmp_path, shape):
    """A tiny Qwen3-MoE and a tiny OLMoE (2 layers, 8 experts, top-2) through grpo.py with vLLM: every sync is checked
    expert by expert (a mismatch would stop the run), vLLM's log-probs stay the trainer's, and the HF export loads in
    vLLM with the log-probs from_pretrained gives it."""
    import json
    import subprocess
    import sys

    rows = run_moe_grpo(tmp_path, shape)
    checks = [r["time/check_sync"] for r in rows if "time/check_sync" in r]
    diffs = [r["rollout/logprob_diff"] for r in rows if "rollout/logprob_diff" in r]
    print(shape, "checks", len(checks), "logprob diffs", diffs, "grad norms", [r.get("policy/grad_norm") for r in rows])
    assert len(checks) >= 3  # the first sync, and one after each update that a rollout or evaluation used
    assert any(r.get("policy/grad_norm", 0) > 0 for r in rows)  # the weights moved between the checked syncs
    assert diffs and max(diffs) < 0.15, diffs  # bf16 on both sides, and routers that may flip on near ties

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4096, (24,), generator=generator).tolist() for _ in range(4)]
    result = subprocess.run([sys.executable, "-c", MOE_EXPORT_LOGPROBS, str(tmp_path / "run" / "hf_step_3"),
                             json.dumps(prompts)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    logprobs = json.loads(result.stdout.split("LOGPROBS ", 1)[1].splitlines()[0])  # vLLM prints after it
    vllm_lp, hf_lp = torch.tensor(logprobs["vllm"]), torch.tensor(logprobs["hf"])
    print(shape, "export: mean |vLLM - from_pretrained|", (vllm_lp - hf_lp).abs().mean().item(), "std", hf_lp.std())
    assert hf_lp.std() > 0.5  # far from uniform: the log-probs depend on the weights
    assert (vllm_lp - hf_lp).abs().mean() < 0.1


RANK0_LOAD = """
import os, sys
from types import SimpleNamespace
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from common.train.lora import add_lora
from common.train.model import load_model, read_dtypes, shard_model

rank, cuda = int(os.environ["RANK"]), torch.cuda.is_available()  # (on CPU: gloo, everything in fp32)
device = torch.device("cuda", rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
for path in sys.argv[1:]:
    for rank_of_lora in (0, 4):
        lora = SimpleNamespace(lora_rank=rank_of_lora, lora_alpha=8, lora_targets=None)
        dtype = read_dtypes(device, "bf16", rank_of_lora)[0]  # a LoRA base: read as it is kept
        model = load_model(path, None, 0, dtype=dtype)
        meta = all(p.is_meta for p in model.parameters())
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        sharded = shard_model(add_lora(model, lora, 3), device, precision="bf16")
        if cuda and rank_of_lora == 0 and path.endswith("wide"):  # rank 0's GPU holds its shards and one parameter in flight, not the model
            peak = torch.cuda.max_memory_allocated()
            print(f"PEAK {os.path.basename(path)} rank {rank} {peak / size:.2f} of the fp32 model")
            assert peak < 0.75 * size, (peak, size)
        full = {n: p.full_tensor().cpu() for n, p in sharded.named_parameters()}
        buffers = {n: b.cpu() for n, b in sharded.named_buffers()}
        whole = add_lora(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), lora, 3)
        for n, p in whole.named_parameters():  # a frozen base is kept in the compute dtype (bf16) on a GPU, what
            kept = torch.float32 if p.requires_grad or not cuda else torch.bfloat16  # trains in fp32 (adapters too)
            assert full[n].dtype == kept and torch.equal(full[n], p.detach().to(kept)), (path, n)
        for n, b in whole.named_buffers():
            assert torch.equal(buffers[n], b), (path, n)
        print(f"LOADED {os.path.basename(path)} lora {rank_of_lora} rank {rank} meta {meta} params {len(full)}")
dist.destroy_process_group()
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_checkpoint_read_by_rank_0_reaches_every_gpu(tmp_path):
    """Over NCCL on 2 GPUs, a dense and a MoE checkpoint, with and without LoRA (whose frozen base is read in bf16, its
    adapters kept in fp32): rank 1 builds the model on the meta device, and after shard_model every rank's weights and
    buffers equal one process's whole load (common/train/model.from_pretrained, receive_weights). Rank 0's GPU never
    holds the whole model on the way (its peak stays under 0.75 of the fp32 model: half of it is its shards)."""
    import subprocess
    import sys

    from scripts.random_model import full_vocab_tokenizer, model_config

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = []
    for shape in ("tiny", "qwen3-moe-tiny", "wide"):  # wide: 16 layers of 16M parameters, 1 GB in fp32
        config = model_config(shape) if shape != "wide" else Qwen2Config(
            hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=8)
        config.vocab_size = 1000
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / shape)
        full_vocab_tokenizer(1000).save_pretrained(tmp_path / shape)
        paths.append(str(tmp_path / shape))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "--no-python", sys.executable, "-c", RANK0_LOAD, *paths], cwd=root,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")})
    print(result.stdout[-2000:])
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for shape in ("tiny", "qwen3-moe-tiny", "wide"):
        for lora in (0, 4):
            for rank in (0, 1):
                assert f"LOADED {shape} lora {lora} rank {rank} meta {rank == 1}" in result.stdout, (shape, lora, rank)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_moe_sync_is_checked_at_tensor_parallel_size_2(tmp_path):
    """The tiny Qwen3-MoE on 2 GPUs, one vLLM replica of --rollout-tp 2: each rank holds half of every expert's
    intermediate rows (and down_proj's columns), and the check compares that half. Its heads are of dimension 32 (16
    in the shape): a rank's one kv head of 16 hangs vLLM's KV-cache write (common/rollout/vllm_engine.check_kv_width)."""
    rows = run_moe_grpo(tmp_path, "qwen3-moe-tiny", nproc=2, more=("--rollout-tp", "2"), head_dim=32)
    assert sum("time/check_sync" in r for r in rows) >= 3


def test_moe_routing_replay_with_vllm(tmp_path):
    """grpo.py on a small random Qwen3-MoE with vLLM, with and without --routing-replay (same seed): with it, vLLM
    returns every token's experts (enable_return_routed_experts), one route per token it ran, [prompt + response - 1,
    layers, k] (common/train/moe.pack_routes refuses any other length), and the trainer runs them: its own top-k
    agrees with them on most tokens (a route one token off would agree on few), and rollout/logprob_diff is no larger
    than without replay. Needs the MoE weight sync into vLLM (--check-weight-sync checks it). Prints both diffs."""
    import json
    import subprocess
    import sys

    from transformers import Qwen3MoeConfig

    from scripts.random_model import full_vocab_tokenizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16,
                            num_experts_per_tok=4, vocab_size=1000, tie_word_embeddings=True, initializer_range=0.1,
                            max_position_embeddings=512)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(model_dir)
    full_vocab_tokenizer(1000).save_pretrained(model_dir)
    diffs, agreement = {}, None
    for replay in (False, True):
        out = tmp_path / f"run_{replay}"
        flags = ["--model", str(model_dir), "--rollout-engine", "vllm", "--rollout-eager", "--check-weight-sync",
                 "--steps", "3", "--lr", "1e-4", "--prompts-per-step", "8", "--group-size", "8",
                 "--max-response-len", "16", "--eval-every", "0", "--eval-size", "16", "--logprob-diff-every", "1",
                 "--precision", "bf16", "--output-dir", str(out)] + (["--routing-replay"] if replay else [])
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                                 "1", os.path.join(root, "grpo.py"), *flags], cwd=tmp_path, capture_output=True,
                                text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        diffs[replay] = [r["rollout/logprob_diff"] for r in rows if "rollout/logprob_diff" in r]
        assert all("moe/max_load" in r for r in rows if "rollout/logprob_diff" in r)
        if replay:
            agreement = [r["moe/route_agreement"] for r in rows if "moe/route_agreement" in r]
    print("logprob_diff without replay", diffs[False], "with", diffs[True], "route agreement", agreement)
    assert agreement and min(agreement) > 0.5, agreement
    assert sum(diffs[True]) <= sum(diffs[False]) * 1.1 + 1e-3, diffs
