"""Mixture-of-experts models (sharding/vllm_moe.py): the experts the sync streams land where the check looks for them
in vLLM's fused-MoE layout (a hand-built receiver that loads as vLLM 0.26 does, at tensor-parallel sizes 1 and 2,
with padding; one wrong element is found), FSDP2 shards each MoE decoder layer as one unit and trains it, the HF
export loads with from_pretrained and gives the trained model's log-probs, and a MoE family nanorl cannot map is one
line at start-up. The real vLLM layers are checked on a GPU (test_gpu.py)."""

import os
from types import SimpleNamespace

import launcher
import pytest
import torch
from gloo import finish_gloo, free_port, init_gloo
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2Config

from scripts.random_model import model_config
from sharding.vllm_moe import check_moe_mapped, check_vllm_moe_layout
from sharding.vllm_sync import trainer_weights, vllm_slices
from test_grpo_e2e import assert_one_line_error, torchrun

FAMILIES = ["qwen3-moe-tiny", "olmoe-tiny"]


def tiny_moe(shape: str, seed: int = 0):
    """The tiny MoE of scripts/random_model.py (2 layers, 8 experts, top-2), with a 64-token vocabulary."""
    config = model_config(shape)
    config.vocab_size = 64
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


# ---------------------------------------------------------------------------------------------------------------
# The experts in vLLM's layout: a receiver built by hand from vLLM 0.26's RoutedExperts.

class UnquantizedFusedMoEMethod:
    """vLLM's method of unquantized experts, on the kernel Hopper picks (Triton keeps the checkpoint's layout)."""
    unquantized_backend = SimpleNamespace(name="TRITON")


class FakeRoutedExperts(torch.nn.Module):
    """vLLM's RoutedExperts reduced to what the sync and the check touch: w13_weight [E, 2 n, H] and w2_weight [E, H, n]
    with n = I // tp, each part padded by `pad` rows and columns, the rest NaN until loaded (so that an element the
    check compares but nothing wrote cannot pass). `load` is its load_weights for a fused (3-D) checkpoint tensor."""

    def __init__(self, experts: int, hidden: int, inter: int, tp_rank: int, tp_size: int, pad: int):
        super().__init__()
        n = inter // tp_size + pad
        self.moe_config = SimpleNamespace(tp_rank=tp_rank, tp_size=tp_size)
        self.quant_method = UnquantizedFusedMoEMethod()
        self.local_num_experts = self.global_num_experts = experts
        self.w13_weight = torch.nn.Parameter(torch.full((experts, 2 * n, hidden + pad), torch.nan), False)
        self.w2_weight = torch.nn.Parameter(torch.full((experts, hidden + pad, n), torch.nan), False)

    def load(self, name: str, loaded: torch.Tensor) -> None:
        """By the name's ending, as vLLM's fused mapping matches "experts.gate_up_proj" (its halves w1, w3) and
        "experts.down_proj" (w2), then expert by expert."""
        if name.endswith("experts.gate_up_proj"):
            for shard, half in enumerate(loaded.chunk(2, dim=1)):  # gate, then up
                for e, weight in enumerate(half.unbind()):
                    self.load_w13(self.w13_weight.data[e], shard, weight)
        elif name.endswith("experts.down_proj"):
            for e, weight in enumerate(loaded.unbind()):
                self.load_w2(self.w2_weight.data[e], weight)
        else:
            raise ValueError(f"vLLM's fused mapping does not match {name}")

    def load_w13(self, expert: torch.Tensor, shard: int, weight: torch.Tensor) -> None:
        """RoutedExperts._load_w13: this rank's rows of the checkpoint's [I, H], into the start of part `shard`."""
        size, per_rank = expert.shape[0] // 2, weight.shape[0] // self.moe_config.tp_size
        weight = weight.narrow(0, per_rank * self.moe_config.tp_rank, per_rank)
        expert.narrow(0, shard * size, size)[:weight.shape[0], :weight.shape[1]].copy_(weight)

    def load_w2(self, expert: torch.Tensor, weight: torch.Tensor) -> None:
        """RoutedExperts._load_w2: this rank's columns of the checkpoint's [H, I]."""
        per_rank = weight.shape[1] // self.moe_config.tp_size
        weight = weight.narrow(1, per_rank * self.moe_config.tp_rank, per_rank)
        expert[:weight.shape[0], :weight.shape[1]].copy_(weight)


def fake_vllm(model, tp_rank: int, tp_size: int, pad: int) -> torch.nn.Module:
    """vLLM's module tree down to each decoder layer's MoE layer (a MoERunner: `mlp.experts.routed_experts`)."""
    config = model.config
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    vllm = torch.nn.Module()
    vllm.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    vllm.model = torch.nn.Module()
    vllm.model.layers = torch.nn.ModuleList()
    for _ in range(config.num_hidden_layers):
        layer = torch.nn.Module()
        layer.mlp = torch.nn.Module()
        layer.mlp.experts = torch.nn.Module()
        layer.mlp.experts.routed_experts = FakeRoutedExperts(config.num_experts, config.hidden_size, inter, tp_rank,
                                                             tp_size, pad)
        vllm.model.layers.append(layer)
    return vllm


@pytest.mark.parametrize("shape", FAMILIES)
def test_the_experts_check_reads_vllm_fused_moe_layout(shape):
    """The experts the sync streams (trainer_weights: transformers' fused names, which vLLM's loader takes as they are
    for these families), loaded as vLLM does on every rank of tensor-parallel sizes 1 and 2, with and without padding:
    every slice the check compares equals the trainer's; one wrong element, in any part of any rank, is found; the
    padding is not compared; and every expert tensor of vLLM receives one of the trainer's."""
    model = tiny_moe(shape)
    experts = {name: full for name, full in trainer_weights(model, None, torch.float32) if ".experts." in name}
    assert sorted(experts) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                     for p in ("gate_up_proj", "down_proj"))
    assert experts["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 2 * 32, 64)  # [E, 2I, H]

    for tp_size, tp_rank, pad in [(1, 0, 0), (2, 0, 0), (2, 1, 0), (2, 1, 3)]:
        vllm = fake_vllm(model, tp_rank, tp_size, pad)
        for name, full in experts.items():
            vllm.get_submodule(name.rsplit(".", 1)[0]).routed_experts.load(name, full)

        def mismatches() -> list[str]:
            return [name for name, full in experts.items()
                    if not all(torch.equal(got, want) for got, want in vllm_slices(vllm, name, full)[1])]

        assert mismatches() == [], (tp_size, tp_rank, pad)
        vllm_names = {vllm_slices(vllm, name, full)[0] for name, full in experts.items()}
        assert vllm_names == {n for n, _ in vllm.named_parameters()}  # the check's coverage: every expert tensor
        layer = vllm.model.layers[1].mlp.experts.routed_experts
        n = 32 // tp_size + pad
        for weight, where in [(layer.w13_weight, (5, 2, 7)),  # expert 5, a gate row
                              (layer.w13_weight, (7, n + 32 // tp_size - 1, 63)),  # expert 7, this rank's last up row
                              (layer.w2_weight, (0, 63, 32 // tp_size - 1))]:  # expert 0, this rank's last column
            kept = weight.data[where].clone()
            weight.data[where] += 1
            assert mismatches() == ["model.layers.1.mlp.experts." + ("down_proj" if weight is layer.w2_weight
                                                                    else "gate_up_proj")], (tp_size, tp_rank, where)
            weight.data[where] = kept
        if pad:  # past each part's slice: what vLLM's loader does not write, and the check does not compare
            assert torch.isnan(layer.w13_weight.data[:, n - 1]).all() and torch.isnan(layer.w2_weight.data[:, 64]).all()


def test_an_unmapped_moe_family_is_one_line_at_start_up(tmp_path):
    """Mixtral (whose vLLM layer names differ from transformers'), and a vLLM that reorders its experts after loading
    (FlashInfer's kernels) or spreads them over ranks: one line each, before anything is synced. Dense models and
    the mapped families pass."""
    for config in (Qwen2Config(), model_config("qwen3-moe-tiny"), model_config("olmoe-tiny")):
        check_moe_mapped(config, "m")
    with pytest.raises(ValueError, match="--model m: mixtral is a mixture-of-experts model whose experts nanorl cannot "
                                         "map into vLLM \\(it maps model types qwen3_moe, olmoe\\)"):
        check_moe_mapped(MixtralConfig(num_local_experts=4), "m")

    vllm = fake_vllm(tiny_moe("olmoe-tiny"), 0, 1, 0)
    check_vllm_moe_layout(vllm)  # the receiver above: Triton's layout, every expert here
    experts = vllm.model.layers[1].mlp.experts.routed_experts
    experts.quant_method.unquantized_backend = SimpleNamespace(name="FLASHINFER_CUTLASS")
    with pytest.raises(ValueError, match="vLLM runs model.layers.1.mlp.experts with UnquantizedFusedMoEMethod "
                                         "\\(FLASHINFER_CUTLASS\\), whose expert layout the weight sync does not write"):
        check_vllm_moe_layout(vllm)
    experts.quant_method, experts.local_num_experts = UnquantizedFusedMoEMethod(), 4
    with pytest.raises(ValueError, match="vLLM holds 4 of 8 experts of model.layers.1.mlp.experts on this rank: "
                                         "expert parallelism is not supported"):
        check_vllm_moe_layout(vllm)

    # Through grpo.py: a random Mixtral with --rollout-engine vllm stops in check_args, before vLLM is needed.
    config = MixtralConfig(hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=4, vocab_size=4096, eos_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "mixtral")
    from scripts.random_model import full_vocab_tokenizer
    full_vocab_tokenizer(4096).save_pretrained(tmp_path / "mixtral")
    result = torchrun(["--model", str(tmp_path / "mixtral"), "--rollout-engine", "vllm", "--output-dir",
                       str(tmp_path / "run")], tmp_path, nproc=1)
    assert_one_line_error(result, "MixtralForCausalLM is a mixture-of-experts model whose experts nanorl cannot map")


# ---------------------------------------------------------------------------------------------------------------
# Training and the HF export: FSDP2 units, a few updates, from_pretrained of the export.

def train_and_export(rank: int, port: int, out: str):
    """On one gloo rank, for each family: the tiny MoE sharded by FSDP2, two GRPO updates, its HF export loaded back
    with from_pretrained. Saves the units FSDP2 made, the log-probs before and after, and the export's."""
    import grpo
    from torch.distributed.fsdp import FSDPModule

    from common.train.tiny_model import build_tiny_tokenizer
    from common.train.logprobs import compute_logprobs
    from common.train.model import decoder_layers, shard_model
    from sharding.checkpoint import save_hf_checkpoint
    from test_grpo import fixed_batch

    init_gloo(rank, 1, port)
    cpu, result = torch.device("cpu"), {}
    for shape in FAMILIES:
        model = shard_model(tiny_moe(shape), cpu, packed_rows=True)
        samples = fixed_batch()
        logps = lambda m: torch.cat(compute_logprobs(m, samples, 64, 1.0, cpu))
        before = logps(model)
        for s, lp in zip(samples, compute_logprobs(model, samples, 64, 1.0, cpu)):
            s["old_logprobs"] = lp
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(2):
            grpo.update_policy(model, optimizer, samples, grpo.Args(max_response_len=4), 1, cpu, None)
        trained = logps(model)
        save_hf_checkpoint(model, build_tiny_tokenizer(), os.path.join(out, shape), torch.float32,
                           probes=("max 3 4 =",))
        loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, shape))
        result[shape] = dict(
            units=[type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)],
            layers=[type(m).__name__ for m in decoder_layers(model)],
            before=before, trained=trained, exported=logps(shard_model(loaded, cpu, trainable=False, packed_rows=True)))
    torch.save(result, os.path.join(out, "result.pt"))
    finish_gloo()


def test_a_trained_moe_exports_to_from_pretrained_with_its_log_probs(tmp_path):
    from safetensors import safe_open

    launcher.spawn(train_and_export, args=(free_port(), str(tmp_path)), nprocs=1)
    result = torch.load(tmp_path / "result.pt")
    for shape, model, layer in zip(FAMILIES, ["Qwen3MoeForCausalLM", "OlmoeForCausalLM"],
                                   ["Qwen3MoeDecoderLayer", "OlmoeDecoderLayer"]):
        r = result[shape]
        # The root, then one unit per decoder layer, experts and router included: nothing of a layer gathered apart.
        assert r["layers"] == [f"FSDP{layer}"] * 2 and r["units"] == [f"FSDP{model}", *r["layers"]]
        assert (r["trained"] - r["before"]).abs().max() > 1e-3  # the updates moved the model
        torch.testing.assert_close(r["exported"], r["trained"], rtol=1e-5, atol=1e-5, msg=shape)
        # The files hold each expert apart, as MoE checkpoints on the hub (and vLLM's loader from disk) have them.
        with safe_open(str(tmp_path / shape / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in names and not any("gate_up" in n for n in names)
