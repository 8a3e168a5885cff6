"""LoRA (common/train/lora.py, sharding/lora.py): the adapters start at the base model, the reference with adapters off is
the base after training too, 1 rank == 2 ranks, the merged weights vLLM gets are the adapted model, exports load
through peft (and merged through transformers) with the trained model's log-probs, states hold the adapters alone and
resume exactly, and bad flags are one line."""

import json
import os
from types import SimpleNamespace

import launcher
import pytest
import torch
import torch.distributed as dist
from gloo import finish_gloo, free_port, init_gloo
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config, Qwen2ForCausalLM

import grpo
from common.train.logprobs import compute_logprobs
from common.train.lora import adapters_off, add_lora, check_lora_args, linear_layer_names
from common.train.model import shard_model
from test_grpo import fixed_batch
from test_grpo_e2e import HASH_REWARD, assert_one_line_error, metric_rows, torchrun

CPU = torch.device("cpu")
LINEARS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def lora_args(rank: int = 4, alpha: float = 8.0, targets=None, **more) -> SimpleNamespace:
    return SimpleNamespace(**{"lora_rank": rank, "lora_alpha": alpha, "lora_targets": targets, "export_merged": False,
                              "lora_sync": "merged", **more})


def base_model() -> Qwen2ForCausalLM:
    """Qwen2 with grouped-query attention and q/k/v biases, the same weights every call."""
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=40, max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config)


def randomise_adapters(model, seed: int = 3) -> None:
    """B starts at zero (so that the adapters change nothing); a trained B does not."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)


def gathered(model) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------------------
# The model: adapters on the decoder's linear layers, a frozen base.

def test_adapters_cover_every_linear_layer_and_freeze_the_base():
    model = add_lora(base_model(), lora_args(), seed=1)
    assert linear_layer_names(model) == LINEARS  # the adapted layers' base layers are linear layers too
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(trained) == 2 * len(LINEARS) * 2  # A and B of 7 layers in each of 2 decoder layers
    assert model.peft_config["default"].r == 4 and sorted(model.peft_config["default"].target_modules) == LINEARS
    # The same seed gives the same adapters (every rank builds them alike), and the global stream is left alone.
    again, expected = base_model(), (torch.manual_seed(5), torch.rand(3))[1]
    torch.manual_seed(5)
    add_lora(again, lora_args(), seed=1)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    # Only the named targets, and a critic's value head trains in full beside them.
    critic = add_lora(AutoModelForTokenClassification.from_config(
        Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=40, num_labels=1)), lora_args(targets=["q_proj", "v_proj"]),
        seed=1, heads=("score",))
    trained = sorted(n for n, p in critic.named_parameters() if p.requires_grad)
    assert trained == ["model.layers.0.self_attn.q_proj.lora_A.default.weight",
                       "model.layers.0.self_attn.q_proj.lora_B.default.weight",
                       "model.layers.0.self_attn.v_proj.lora_A.default.weight",
                       "model.layers.0.self_attn.v_proj.lora_B.default.weight", "score.bias", "score.weight"]
    assert critic.peft_config["default"].task_type == "TOKEN_CLS"


@pytest.mark.parametrize("flags, message", [
    (dict(lora_rank=-1), "--lora-rank must be at least 0 (0: full fine-tuning), got -1"),
    (dict(lora_alpha=0.0), "--lora-alpha must be greater than 0"),
    (dict(lora_rank=0, lora_targets=["q_proj"]), "--lora-targets needs --lora-rank"),
    (dict(lora_rank=0, export_merged=True), "--export-merged needs --lora-rank"),
    (dict(lora_rank=0, lora_sync="adapter"), "--lora-sync needs --lora-rank"),
    (dict(lora_sync="adapter", rollout_engine="hf"), "--lora-sync adapter needs vLLM colocated with the trainer"),
    (dict(lora_sync="adapter", rollout_engine="vllm", rollout_ranks=1), "--lora-sync adapter needs vLLM colocated"),
    (dict(lora_sync="adapter", rollout_engine="vllm", rollout_ranks=0, precision="fp32"),
     "--lora-sync adapter: vLLM's LoRA kernels take bf16 or fp16 inputs only"),
])
def test_bad_lora_flags(flags, message):
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        check_lora_args(lora_args(**flags))


def test_a_target_the_model_lacks_names_the_ones_it_has():
    with pytest.raises(ValueError, match="--lora-targets qkv_proj: Qwen2ForCausalLM's decoder layers have no such "
                                         "linear layer; they have down_proj gate_proj k_proj o_proj q_proj up_proj "
                                         "v_proj"):
        add_lora(base_model(), lora_args(targets=["q_proj", "qkv_proj"]), seed=1)


# ---------------------------------------------------------------------------------------------------------------
# The reference: the base model, at the start and after training.

def reference_after_training(rank: int, port: int, out: str):
    """On one gloo rank: log-probs of the base model alone, of the LoRA model at its start, of the LoRA model with its
    adapters off before and after three updates (the reference pass comes first, as in grpo.py with a KL penalty:
    the adapters must still train after it), and with them on after the updates."""
    init_gloo(rank, 1, port)
    samples = fixed_batch()
    base = shard_model(base_model(), CPU, trainable=False, packed_rows=True)
    model = shard_model(add_lora(base_model(), lora_args(), seed=1), CPU, packed_rows=True)
    logps = lambda m: torch.cat(compute_logprobs(m, samples, 64, 1.0, CPU))
    result = {"base": logps(base), "start": logps(model)}
    with adapters_off(model):
        result["off_before"] = logps(model)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    before = gathered(model)
    for s in samples:
        s.update(advantage=1.0 if sum(s["response_ids"]) % 2 else -1.0, loss_weight=1.0)
    for _ in range(3):
        grpo.update_policy(model, optimizer, samples, grpo.Args(max_response_len=4), 1, CPU, None)
    with adapters_off(model):
        result["off_after"] = logps(model)
    result["on_after"] = logps(model)
    after = gathered(model)
    result["changed"] = sorted(n for n in after if not torch.equal(after[n], before[n]))
    result["names"] = sorted(after)
    torch.save(result, os.path.join(out, "reference.pt"))
    finish_gloo()


def test_the_reference_with_adapters_off_is_the_base_after_training(tmp_path):
    launcher.spawn(reference_after_training, args=(free_port(), str(tmp_path)), nprocs=1)
    r = torch.load(tmp_path / "reference.pt")
    assert torch.equal(r["start"], r["base"])  # B = 0: exactly the base model at step 0
    assert torch.equal(r["off_before"], r["base"]) and torch.equal(r["off_after"], r["base"])
    assert (r["on_after"] - r["base"]).abs().max() > 1e-3  # the adapters learned something
    adapters = [n for n in r["names"] if ".lora_" in n]
    assert r["changed"] == adapters  # every adapter trained (after the reference pass), no base weight moved


# ---------------------------------------------------------------------------------------------------------------
# FSDP2: one GRPO update with LoRA on 2 gloo ranks equals the same update on 1 rank.

def lora_update_once(rank: int, world: int, port: int, out_dir: str):
    init_gloo(rank, world, port)
    model = add_lora(base_model(), lora_args(), seed=1)
    randomise_adapters(model)
    model = shard_model(model, CPU)
    args = grpo.Args(max_tokens_per_micro_batch=12 if world == 2 else 40, num_mini_batches=2, max_response_len=4)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    samples = fixed_batch()[rank::world]
    for s, lp in zip(samples, compute_logprobs(model, samples, 16, 1.0, CPU)):
        s["old_logprobs"] = lp - 0.05
    stats = grpo.update_policy(model, optimizer, samples, args, world, CPU, generator=None)
    loss = torch.tensor([stats["loss"]], dtype=torch.float64)
    dist.all_reduce(loss)
    state = gathered(model)
    if rank == 0:
        torch.save({"loss": loss.item() / world, "state": state}, os.path.join(out_dir, f"world{world}.pt"))
    finish_gloo()


def test_two_ranks_match_one_rank_with_lora(tmp_path):
    for world in (1, 2):
        launcher.spawn(lora_update_once, args=(world, free_port(), str(tmp_path)), nprocs=world)
    one, two = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2.pt")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-4)
    initial = add_lora(base_model(), lora_args(), seed=1)
    randomise_adapters(initial)
    initial = dict(initial.named_parameters())
    for name, weight in one["state"].items():
        moved = not torch.equal(weight, initial[name].detach())
        assert moved == (".lora_" in name), name  # the adapters train, the base stays exactly as it was
        torch.testing.assert_close(two["state"][name], weight, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Weights out: merged for vLLM and HF exports, PEFT's adapter directory.

def merged_and_exported(rank: int, port: int, out: str):
    """On one gloo rank: a LoRA model with trained (random) adapters, and what leaves it: the merged stream vLLM would
    get, loaded into the plain base architecture; the adapter export loaded by peft on the base; the merged export
    loaded by transformers; a LoRA critic's adapter export (adapters and value head) loaded by peft on its base. The
    log-probs (values) of each, and of the live models, on the same samples."""
    from peft import PeftModel

    from common.train.tiny_model import build_tiny_tokenizer
    from common.train.value_models import compute_values
    from sharding.checkpoint import save_hf_checkpoint
    from sharding.vllm_sync import trainer_weights, weight_shapes

    init_gloo(rank, 1, port)
    tokenizer, samples = build_tiny_tokenizer(), fixed_batch()
    sharded = lambda m: m if isinstance(m, FSDPModule) else shard_model(m, CPU, trainable=False, packed_rows=True)
    logps = lambda m: torch.cat(compute_logprobs(sharded(m), samples, 64, 1.0, CPU))
    model = add_lora(base_model(), lora_args(), seed=1)
    randomise_adapters(model)
    model = shard_model(model, CPU, packed_rows=True)
    result = {"trained": logps(model), "shapes": weight_shapes(model), "base": logps(base_model())}
    stream = {n: t.clone() for n, t in trainer_weights(model, None, torch.float32)}
    plain = base_model()
    result["stream_names"], result["plain_names"] = list(stream), list(plain.state_dict())
    plain.load_state_dict(stream, strict=False)  # the tied head comes with the embeddings
    result["stream"] = logps(plain)
    for kind in ("adapter", "merged"):
        save_hf_checkpoint(model, tokenizer, os.path.join(out, kind), torch.float32, probes=("max 3 4 =",),
                           adapter=kind == "adapter")
    result["adapter"] = logps(PeftModel.from_pretrained(base_model(), os.path.join(out, "adapter")).base_model.model)
    result["merged"] = logps(AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged")))

    torch.manual_seed(0)
    critic = AutoModelForTokenClassification.from_config(Qwen2Config(**{**base_model().config.to_dict(),
                                                                        "num_labels": 1}))
    critic.save_pretrained(os.path.join(out, "critic_base"))
    critic = add_lora(critic, lora_args(), seed=2, heads=("score",))
    randomise_adapters(critic, seed=4)
    with torch.no_grad():  # a trained value head
        for p in critic.score.parameters():
            p.add_(0.1)
    critic = shard_model(critic, CPU, packed_rows=True)
    result["values"] = torch.cat(compute_values(critic, samples, 64, CPU))
    save_hf_checkpoint(critic, tokenizer, os.path.join(out, "critic"), torch.float32, probes=("max 3 4 =",),
                       adapter=True)
    loaded = PeftModel.from_pretrained(AutoModelForTokenClassification.from_pretrained(
        os.path.join(out, "critic_base")), os.path.join(out, "critic")).base_model.model
    result["loaded_values"] = torch.cat(compute_values(sharded(loaded), samples, 64, CPU))
    torch.save(result, os.path.join(out, "exports.pt"))
    finish_gloo()


def test_merged_weights_and_exports_give_the_trained_model(tmp_path):
    launcher.spawn(merged_and_exported, args=(free_port(), str(tmp_path)), nprocs=1)
    r = torch.load(tmp_path / "exports.pt")
    # The stream holds the base architecture's names and shapes (tied head left out, as vLLM loads it).
    assert r["stream_names"] == [n for n in r["plain_names"] if n != "lm_head.weight"]
    assert [n for n, _ in r["shapes"]] == r["stream_names"]
    assert (r["trained"] - r["base"]).abs().max() > 1e-2  # the adapters change the model
    for kind in ("stream", "adapter", "merged"):
        torch.testing.assert_close(r[kind], r["trained"], rtol=1e-5, atol=1e-5, msg=kind)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["task_type"] == "CAUSAL_LM"
    assert os.listdir(tmp_path / "adapter").count("adapter_model.safetensors") == 1
    assert not (tmp_path / "adapter" / "model.safetensors").exists()  # adapters alone, not the base
    torch.testing.assert_close(r["loaded_values"], r["values"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# The scripts: a LoRA run resumes exactly with states of adapters alone; bad flags are one line.

LORA = ["--lora-rank", "4", "--lora-targets", "q_proj", "v_proj", "up_proj", "--lr", "0.01"]
RESUMABLE = ["--steps", "6", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16", "--eval-every", "3",
             "--save-state-every", "2", "--keep-checkpoints", "0", "--kl-coef", "0.05", "--reward-fn",
             "hash_reward.py:reward", "--skip-reward-check", *LORA]


def test_killed_lora_run_resumes_exactly_from_states_of_adapters_alone(tmp_path):
    """grpo.py --lora-rank with a KL penalty (its reference the base): killed after step 4's state, resumed, it equals
    an uninterrupted run metric for metric and adapter for adapter. The state holds the adapters and their Adam
    moments only; the export is PEFT's adapter directory and, with --export-merged, a full model in merged/. The
    same run directory with another --lora-rank is one line."""
    from torch.distributed.checkpoint import FileSystemReader

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    (tmp_path / "hash_reward.py").write_text(HASH_REWARD)
    assert torchrun([*RESUMABLE, "--output-dir", str(whole)], tmp_path).returncode == 0
    args = [*RESUMABLE, "--output-dir", str(killed), "--export-merged"]
    crashed = torchrun(args, tmp_path, env={"NANORL_TEST_CRASH": "after_state:4"})
    assert crashed.returncode != 0 and not (killed / "hf_step_6").exists(), crashed.stderr[-3000:]
    result = torchrun(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {killed / 'state_000004'} at step 4" in result.stdout + result.stderr
    assert metric_rows(killed) == metric_rows(whole)
    assert metric_rows(whole)[-1]["loss/kl"] > 0  # the reference (the base) differs from the trained policy

    saved = FileSystemReader(str(killed / "state_000006")).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("model.")]
    assert len(weights) == 2 * 3 * 2 and all(".lora_A." in k or ".lora_B." in k for k in weights)  # 2 layers x 3
    assert {k.split(".")[3] for k in saved if k.startswith("optimizer.state.")} == {"layers"}  # adapters' moments
    adapters = {k: v for k, v in _safetensors(whole / "hf_step_6" / "adapter_model.safetensors").items()}
    assert adapters.keys() == _safetensors(killed / "hf_step_6" / "adapter_model.safetensors").keys()
    assert all(torch.equal(v, _safetensors(killed / "hf_step_6" / "adapter_model.safetensors")[k])
               for k, v in adapters.items())
    assert all(k.startswith("base_model.model.model.layers.") for k in adapters)
    assert AutoModelForCausalLM.from_pretrained(killed / "hf_step_6" / "merged") is not None

    other = torchrun([*args, "--lora-rank", "8", "--steps", "8"], tmp_path)
    assert_one_line_error(other, "--lora-rank")


def _safetensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


def test_bad_lora_flags_are_one_line(tmp_path):
    tiny = ["--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "4", "--eval-every", "0"]
    assert_one_line_error(torchrun([*tiny, "--lora-rank", "-2"], tmp_path, nproc=1),
                          "--lora-rank must be at least 0 (0: full fine-tuning), got -2")
    assert_one_line_error(torchrun([*tiny, "--lora-rank", "4", "--lora-targets", "qkv"], tmp_path, nproc=1),
                          "--lora-targets qkv: LlamaForCausalLM's decoder layers have no such linear layer; they have "
                          "down_proj gate_proj k_proj o_proj q_proj up_proj v_proj")
    assert_one_line_error(torchrun(["--lora-rank", "4", "--online", "--ref-update-every", "2"], tmp_path, nproc=1,
                                   script="dpo.py"), "--ref-update-every does not combine with --lora-rank")


# ---------------------------------------------------------------------------------------------------------------
# vLLM's LoRA layers (--lora-sync adapter): the check's layout against a hand-built receiver that loads an adapter
# as vLLM 0.26 does (vllm/lora/layers: cast to its dtype, B times the scaling, B's rows sliced in column-parallel
# parts, A's columns in row-parallel ones, rank padding zero). The real layers are checked on a GPU (test_gpu.py).

class FakeLoRALayer(torch.nn.Module):
    """One of vLLM's LoRA wrappers, reduced to what the check reads, filled by `load` as vLLM's set_lora fills it."""

    def __init__(self, parts: list[tuple[int, int]], in_size: int, tp_rank: int, tp_size: int, max_rank: int,
                 output_ids=None, row_parallel: bool = False):
        super().__init__()
        self.base_layer = torch.nn.Linear(1, 1)
        self.tp_rank, self.tp_size, self.input_size = tp_rank, tp_size, in_size
        if not row_parallel:
            self.output_slices, self.output_ids = tuple(size for size, _ in parts), tuple(output_ids)
        self.lora_a_stacked = tuple(torch.zeros(1, 1, max_rank, in_size, dtype=torch.bfloat16) for _ in parts)
        self.lora_b_stacked = tuple(torch.zeros(1, 1, size, max_rank, dtype=torch.bfloat16) for size, _ in parts)

    def load(self, i: int, a: torch.Tensor, b: torch.Tensor, scaling: float) -> None:
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
        b.mul_(scaling)  # vLLM folds the scaling into B after the cast (LoRALayerWeights.optimize)
        if hasattr(self, "output_ids"):
            size = self.output_slices[i]
            b = b[self.output_ids[i] * size:(self.output_ids[i] + 1) * size]
        elif self.tp_size > 1:
            a = a[:, self.tp_rank * self.input_size:(self.tp_rank + 1) * self.input_size]
        self.lora_a_stacked[i][0, 0, :a.shape[0], :a.shape[1]].copy_(a)
        self.lora_b_stacked[i][0, 0, :b.shape[0], :b.shape[1]].copy_(b)


def test_the_adapter_check_reads_vllm_lora_layout():
    """Qwen2 with 4 query heads, 1 kv head of 8 dims, hidden 32, MLP 64, on tensor-parallel rank 1 of 2 (the kv head
    shared by both ranks): every adapter in the slot equals the trainer's slice; one wrong element, anywhere, is
    found; and the base weights' names go under vLLM's wrappers."""
    from sharding.vllm_lora import adapter_slices, fused_module, lora_base_names, vllm_max_rank

    r, s, t = 4, 2.0, 1
    g = torch.Generator().manual_seed(0)
    full = {name: (torch.randn(r, n_in, generator=g), torch.randn(n_out, r, generator=g))
            for name, n_in, n_out in [("q_proj", 32, 32), ("k_proj", 32, 8), ("v_proj", 32, 8), ("o_proj", 32, 32),
                                      ("gate_proj", 32, 64), ("up_proj", 32, 64), ("down_proj", 64, 32)]}
    vllm = torch.nn.Module()
    vllm.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    layer = torch.nn.Module()
    vllm.add_module("layer", layer)
    layer.qkv_proj = FakeLoRALayer([(16, "q"), (8, "k"), (8, "v")], 32, t, 2, 8, output_ids=(t, 0, 0))
    layer.gate_up_proj = FakeLoRALayer([(32, "g"), (32, "u")], 32, t, 2, 8, output_ids=(t, t))
    layer.o_proj = FakeLoRALayer([(32, "o")], 16, t, 2, 8, row_parallel=True)
    layer.down_proj = FakeLoRALayer([(32, "d")], 32, t, 2, 8, row_parallel=True)
    for name, (a, b) in full.items():
        fused, index = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}.get(name, (name, 0))
        getattr(layer, fused).load(index, a, b, s)

    def mismatches() -> list[str]:
        return [name for name, (a, b) in full.items()
                if not all(torch.equal(got, want) for got, want in adapter_slices(vllm, 0, f"layer.{name}", a, b, s))]

    assert mismatches() == []
    for fused, i, which, where in [("qkv_proj", 1, "lora_b_stacked", (0, 0, 5, 1)),  # k's B (the shared kv head)
                                   ("o_proj", 0, "lora_a_stacked", (0, 0, 2, 15)),  # o's A, this rank's columns
                                   ("gate_up_proj", 0, "lora_a_stacked", (0, 0, 6, 3))]:  # padding past rank 4
        buffer = getattr(getattr(layer, fused), which)[i]
        kept = buffer[where].clone()
        buffer[where] += 1
        assert len(mismatches()) == 1, (fused, which)
        buffer[where] = kept
    assert fused_module(vllm, "layer.k_proj") == ("layer.qkv_proj", 1) and fused_module(vllm, "up_proj") == (
        "gate_up_proj", 1) and fused_module(vllm, "layer.o_proj") == ("layer.o_proj", None)
    rename = lora_base_names(vllm)
    assert rename("layer.k_proj.weight") == "layer.k_proj.base_layer.weight"
    assert rename("layer.down_proj.weight") == "layer.down_proj.base_layer.weight"
    assert rename("layer.input_layernorm.weight") == "layer.input_layernorm.weight"
    assert [vllm_max_rank(n) for n in (4, 8, 17, 512)] == [8, 8, 32, 512]
    with pytest.raises(ValueError, match="--lora-rank 600: vLLM's LoRA layers take ranks up to 512"):
        vllm_max_rank(600)


@pytest.mark.parametrize("script, flags", [
    ("grpo.py", ["--prompts-per-step", "8", "--group-size", "4"]),
    ("ppo.py", ["--prompts-per-step", "8", "--group-size", "4"]),
    ("dpo.py", ["--pairs-per-step", "8"])])
def test_every_script_trains_adapters_with_lora_rank(tmp_path, script, flags):
    """--lora-rank in each script after the README's install: two steps train the adapters alone, and the export is
    PEFT's adapter directory (its A and B matrices, nothing of the base)."""
    out = tmp_path / "run"
    result = torchrun(["--lora-rank", "4", "--steps", "2", "--eval-size", "8", "--eval-every", "0", *flags,
                       "--output-dir", str(out)], tmp_path, script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    adapters = _safetensors(out / "hf_step_2" / "adapter_model.safetensors")
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters), list(adapters)[:5]
