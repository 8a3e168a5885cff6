"""common/run/planner.py and scripts/plan.py: the memory and time arithmetic on cases computed by hand (a dense model, a
mixture of experts), the flags it proposes for a configuration that does not fit, the scripts' flags as its inputs, the
committed validation table (predicted against measured) as the fit gives it, and a stage that runs out of memory as one
line."""

import math
import os
from dataclasses import replace
import subprocess
import sys

import pytest

import grpo
from common.run.planner import HEADROOM, Setup, Shape, fixes, fits, memory, step_time
from common.run.run_plan import setup_of_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMPLE = {"act_h": 10.0, "act_i": 4.0, "compile_act_share": 0.5, "ckpt_h": 2.0, "logit_copies": 2.0,
          "overhead_gb": 1.0, "vllm_overhead_gb": 2.0, "mfu_at_1b": 0.5, "mfu_per_decade": 0.0, "compile_gain": 1.0,
          "fp32_share": 0.5, "moe_share": 0.5, "layer_pass_s": 0.01, "compile_pass_share": 1.0, "longest_over_mean": 2.0,
          "decode_bw_share": 0.5, "decode_layer_s": 0.001, "decode_layer_eager_s": 0.002, "decode_token_s": 1e-5,
          "decode_tp_layer_s": 0.0005, "prefill_mfu": 0.5, "sync_gb_s": 100.0, "sync_s": 0.1}


def test_memory_and_time_by_hand():
    """hidden 1000, MLP 3000, 10 layers, 10 heads of 100 (5 kv), vocabulary 10,000, untied."""
    shape = Shape(hidden=1000, intermediate=3000, layers=10, heads=10, kv_heads=5, vocab=10_000, tied=False)
    layer = 1000 * 100 * (2 * 10 + 2 * 5) + 3 * 1000 * 3000 + 2 * 1000  # q, o: 1000x1000; k, v: 1000x500; MLP; norms
    assert shape.layer_params == layer == 12_002_000
    assert shape.params == 10 * layer + 2 * 10_000 * 1000 + 1000 == 140_021_000
    setup = Setup(gpus=2, gpu="H100", gpu_memory_gb=80, prompt_len=100, max_prompt_len=100, response_len=300,
                  max_response_len=400, samples=64, max_tokens_per_micro_batch=4096, sleep_level=2)
    mem = memory(shape, setup, SIMPLE)
    p, gb = shape.params, 1e9
    tokens = 4096  # 64 x 400 / 2 GPUs = 12,800 a GPU, in micro-batches of 4,096
    assert mem["training"]["weights"] == pytest.approx(4 * p / 2 / gb)
    assert mem["training"]["gradients"] == pytest.approx(4 * p / 2 / gb)
    assert mem["training"]["optimizer"] == pytest.approx(8 * p / 2 / gb)
    assert mem["training"]["gathered"] == pytest.approx((2 * layer + 20_001_000) * 2 / gb)
    assert mem["training"]["activations"] == pytest.approx(tokens * 10 * (10 * 1000 + 4 * 3000) / gb)
    assert mem["training"]["logits"] == pytest.approx(2 * 2048 * 10_000 * 4 / gb)
    # The KV cache the scripts size: 32 sequences of 512 tokens, 2 x 10 layers x 5 kv heads x 100 x 2 bytes a token.
    kv = min(max(0.5, 1.1 * 32 * 512 * 2 * 10 * 5 * 100 * 2 / 2**30), 0.4 * 80e9 / 2**30) * 2**30 / gb
    vllm = p * 2 / gb + kv + 2.0
    cached = sum(mem["training"].values())
    assert mem["rollout"] == pytest.approx({"trainer (cached)": cached, "vllm weights": p * 2 / gb, "kv cache": kv,
                                           "vllm workspace": 2.0})
    assert mem["peak"] == pytest.approx(max(cached, cached + vllm))
    # AdamW's step needs 4 bytes a trained parameter (0.28 GB a GPU): less than the backward freed before it.
    assert mem["training"]["optimizer step"] == 0
    # Time: 6 FLOPs a parameter and token for the 64 x 400 tokens, and attention's 6 x 10 layers x (10 heads x 100) x
    # 400^2 for each of the 64 sequences, over two GPUs at 50% of 989 TFLOP/s, plus a fixed cost per layer and
    # micro-batch (4 micro-batches a GPU); decoding 400 steps (min(400, 2 x 300)) of 10 layers x 1 ms and the
    # weights read at half of 3.35 TB/s, each of a GPU's 32 sequences reading its KV cache over its own 300 tokens
    # (100 x 300 + 300^2 / 2 tokens), 10 us a generated token, plus the prefill; a sync 0.1 s and the weights.
    times = step_time(shape, setup, SIMPLE)
    attention = 64 * 6 * 10 * 1000 * 400**2
    assert times["update"] == pytest.approx((6 * p * 64 * 400 + attention) / (2 * 989e12 * 0.5) + 4 * 10 * 0.01)
    kv_read = 32 * (100 * 300 + 300**2 / 2) * 2 * 10 * 5 * 100 * 2
    launches = 400 * 10 * 0.001 + 32 * 300 * 1e-5
    reads = (400 * p * 2 + kv_read) / (3.35e12 * 0.5)
    prefill = 32 * 100 * 2 * p / (989e12 * 0.5)
    assert times["rollout"] == pytest.approx(launches + reads + prefill)
    assert times["sync"] == pytest.approx(0.1 + p * 2 / 100e9)
    # Eager (2 ms a layer) the CPU's launches overlap the GPU's reads: the slower of the two, here the launches; with
    # --rollout-tp 2 each layer's all-reduces add 0.5 ms and each engine reads half the weights for 64 sequences.
    eager = step_time(shape, replace(setup, rollout_eager=True), SIMPLE)
    assert eager["rollout"] == pytest.approx(max(400 * 10 * 0.002 + 32 * 300 * 1e-5, reads) + prefill)
    tp = step_time(shape, replace(setup, rollout_tp=2), SIMPLE)
    tp_reads = (400 * p + 64 * (100 * 300 + 300**2 / 2) * 2 * 10 * 5 * 100) / (3.35e12 * 0.5)
    assert tp["rollout"] == pytest.approx(400 * 10 * 0.0015 + 64 * 300 * 1e-5 + tp_reads + prefill)


def test_the_longest_response_follows_from_how_responses_end():
    """Decoding waits for the step's longest response. A trained model's ("natural"): a fitted multiple of the mean,
    at most the cap. A random model's ("geometric", one chance of ending at every token): exponential lengths, the
    longest of n of mean mu is mu x H_n; all at the cap when the mean is the cap; a capped mean of
    1000 (1 - exp(-0.512)) = 400.7 under a cap of 512 is mu = 1000, whose longest of 256 (6,124) the cap cuts."""
    from common.run.response_lengths import response_lengths
    base = Setup(response_len=100, max_response_len=8192, samples=4)
    assert response_lengths(base, SIMPLE) == (200, 100**2)
    assert response_lengths(replace(base, response_len=5000), SIMPLE) == (8192, 5000**2)
    longest, mean_square = response_lengths(replace(base, response_lengths="geometric"), SIMPLE)
    assert longest == pytest.approx(100 * (1 + 1 / 2 + 1 / 3 + 1 / 4))  # mu = 100: the cap is 82 means away
    assert mean_square == pytest.approx(2 * 100**2)  # an exponential's second moment
    capped = Setup(response_len=1000 * (1 - math.exp(-0.512)), max_response_len=512, samples=256,
                   response_lengths="geometric")
    assert response_lengths(capped, SIMPLE)[0] == 512
    assert response_lengths(replace(capped, response_len=512), SIMPLE) == (512, 512**2)


def test_a_mixture_of_experts_holds_every_expert_and_computes_with_its_top_k():
    """qwen3-moe-tiny (hidden 64, 2 layers, 4 heads of 16 / 2 kv, 8 experts of MLP 32, 2 a token, vocabulary 4096,
    untied) by hand: memory counts every expert and the routers, FLOPs the active parameters, decoding reads them all.
    Against the models transformers builds (on the meta device), the count differs only by what the planner leaves
    out as it does for dense models: q/k norms and attention biases. LoRA adapts the decoder's nn.Linear layers only:
    attention's, and Qwen2-MoE's shared expert and its gate."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common.run.planner import mfu
    from common.train.lora import add_lora
    from scripts.random_model import model_config
    shape = Shape.from_config(model_config("qwen3-moe-tiny"))
    attention, expert, router, norms = 64 * 16 * (2 * 4 + 2 * 2), 3 * 64 * 32, 64 * 8, 2 * 64
    assert (shape.experts, shape.experts_per_token, shape.intermediate) == (8, 2, 32)
    assert shape.layer_params == attention + 8 * expert + router + norms == 62_080
    assert shape.params == 2 * 62_080 + 2 * 4096 * 64 + 64 == 648_512
    assert shape.active_params == shape.params - 2 * (8 - 2) * expert == 574_784
    assert shape.lora_params(4) == 2 * 4 * ((64 + 64) * 2 + (64 + 32) * 2) == 3584  # q, o; k, v
    qwen2_moe = AutoConfig.for_model("qwen2_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=4096)
    shared = Shape.from_config(qwen2_moe)
    assert shared.params == shape.params + 2 * (3 * 64 * 48 + 64)  # the shared expert and its gate in each layer
    assert shared.active_params == shape.active_params + 2 * (3 * 64 * 48 + 64)
    assert shared.lora_params(4) == 3584 + 2 * 4 * (3 * (64 + 48) + 65)
    for config in (model_config("qwen3-moe-tiny"), model_config("olmoe-tiny"), qwen2_moe):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        left_out = sum(p.numel() for name, p in model.named_parameters() if "_norm." in name or name.endswith(".bias"))
        assert sum(p.numel() for p in model.parameters()) - left_out == Shape.from_config(config).params
        add_lora(model, SimpleNamespace(lora_rank=4, lora_alpha=8.0, lora_targets=None), seed=0)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == Shape.from_config(config).lora_params(4)
    # Memory: every expert's fp32 weights; activations of 2 experts of 32 a token, plus the hidden state copied into
    # each and their outputs (2 x 2 x 64 bf16) and the router's fp32 logits and probabilities (2 x 8 x 4 bytes).
    setup = Setup(gpus=1, gpu="H100", gpu_memory_gb=80, prompt_len=100, max_prompt_len=100, response_len=300,
                  max_response_len=400, samples=8, sleep_level=2)
    mem, times, p, active = memory(shape, setup, SIMPLE), step_time(shape, setup, SIMPLE), shape.params, 574_784
    assert mem["training"]["weights"] == pytest.approx(4 * p / 1e9)
    assert mem["training"]["activations"] == pytest.approx(8 * 400 * 2 * (10 * 64 + 4 * 2 * 32 + 2 * 2 * 64 * 2
                                                                          + 2 * 8 * 4) / 1e9)
    # Time: 6 FLOPs an active parameter and token, at moe_share (0.5) of a dense model's MFU (0.5); decoding reads
    # every expert.
    attention_flops = 8 * 6 * 2 * 4 * 16 * 400**2
    assert times["update"] == pytest.approx((6 * active * 8 * 400 + attention_flops) / (989e12 * 0.5 * 0.5)
                                            + 2 * 0.01)
    kv_read = 8 * (100 * 300 + 300**2 / 2) * 2 * 2 * 2 * 16 * 2
    prefill = 8 * 100 * 2 * active / (989e12 * 0.5)
    reads = (400 * 2 * p + kv_read) / (3.35e12 * 0.5)
    assert times["rollout"] == pytest.approx(400 * 2 * 0.001 + 8 * 300 * 1e-5 + reads + prefill)
    # The MFU's size is the active parameters': qwen3-30b-a3b's 3.35B, not its 30.5B.
    from scripts.plan import shape_named
    big = shape_named("qwen3-30b-a3b")
    assert (round(big.params / 1e8), round(big.active_params / 1e7)) == (305, 335)
    assert mfu(big, setup, {**SIMPLE, "mfu_per_decade": 0.1}) == pytest.approx((0.5 + 0.1 * math.log10(3.353)) * 0.5)


def test_a_configuration_that_does_not_fit_gets_the_flags_that_would():
    """A 7B shape's full fine-tuning on one GPU cannot fit (122 GB of weights, gradients and moments); with LoRA at
    long micro-batches only activation checkpointing or smaller micro-batches bring it under the headroom."""
    from scripts.plan import shape_named
    seven = shape_named("7b")
    full = Setup(gpus=1, gpu="H100", prompt_len=512, max_prompt_len=512, response_len=512, max_response_len=512,
                 samples=256, max_tokens_per_micro_batch=16384)
    assert not fits(seven, full)
    assert [flag for flag, _ in fixes(seven, full)] == ["--activation-checkpointing --lora-rank 32"]
    assert all(peak <= HEADROOM * full.memory_gb for _, peak in fixes(seven, full))
    lora = Setup(**{**full.__dict__, "lora_rank": 32, "max_tokens_per_micro_batch": 65536, "response_len": 4096,
                    "max_response_len": 4096})
    assert not fits(seven, lora)
    found = [flag for flag, _ in fixes(seven, lora)]
    assert found and found[0] == "--activation-checkpointing", found


def test_the_optimizer_step_can_be_the_peak():
    """7B full fine-tuning with activation checkpointing on single sequences: the backward keeps little, and AdamW's
    step holds weights, gradients and moments with the square root of the second moments, 4 + 4 + 8 + 4 = 20 bytes a
    parameter: 152 GB on one GPU (bench_train ran out of memory there on an H200 at 8k tokens, with 148.5 GB
    allocated), half of it a GPU over two (measured 76.2 GB at 16k and 32k tokens, with and without
    --sequence-parallel 2)."""
    from scripts.plan import shape_named
    seven = shape_named("7b")
    one = Setup(gpus=1, gpu="H200", prompt_len=256, max_prompt_len=256, response_len=7936, max_response_len=7936,
                samples=1, max_tokens_per_micro_batch=8192, activation_checkpointing=True, rollout=False)
    assert memory(seven, one)["allocated"] == pytest.approx(20 * seven.params / 1e9)
    assert not fits(seven, one)
    two = Setup(**{**one.__dict__, "gpus": 2, "sequence_parallel": 2, "response_len": 16128,
                   "max_tokens_per_micro_batch": 16384})  # one 16k sequence split over two ranks
    assert memory(seven, two)["allocated"] == pytest.approx(10 * seven.params / 1e9)


def test_the_scripts_flags_as_the_planners_inputs():
    args = grpo.Args(prompts_per_step=32, group_size=8, max_prompt_len=512, max_response_len=1024, lora_rank=16,
                     kl_coef=0.1, sequence_parallel=2, shard_size=4, precision="bf16", rollout_tp=2,
                     rollout_engine="vllm")
    setup = setup_of_run(args, 8, "NVIDIA H200", 150.0)
    assert (setup.gpus, setup.gpu, setup.samples, setup.prompt_len, setup.response_len) == (8, "H200", 256, 512, 1024)
    assert (setup.lora_rank, setup.sequence_parallel, setup.shard_size, setup.rollout_tp) == (16, 2, 4, 2)
    assert setup.rollout and not setup.reference and not setup.critic  # with LoRA the reference is the base itself
    assert (setup.vllm_memory_gb, setup.kv_cache_gb) == (None, None)  # unset --rollout-gpu-memory: the default sizes
    # --rollout-gpu-memory: up to 1 a share of the GPU for all of vLLM, above 1 GiB of KV cache.
    assert setup_of_run(grpo.Args(**{**args.__dict__, "rollout_gpu_memory": 0.5}), 8, "H200", 150.0).vllm_memory_gb \
        == 75.0
    assert setup_of_run(grpo.Args(**{**args.__dict__, "rollout_gpu_memory": 10.0}), 8, "H200", 150.0).kv_cache_gb \
        == pytest.approx(10 * 2**30 / 1e9)
    # The trainers of split placement hold no engine, nor does a run that generates with HF.
    for change in ({"rollout_ranks": 2}, {"rollout_engine": "hf"}):
        assert not setup_of_run(grpo.Args(**{**args.__dict__, **change}), 6, "H200", 150.0).rollout, change


def test_sequence_parallelism_is_proposed_only_where_the_heads_split():
    """A shape of 12 heads and 6 key-value heads splits over 2 ranks (6 each, 3 kv) and 6, not over 4 (6 kv heads
    neither divide by 4 nor divide 4): the planner must not propose a flag that start-up rejects."""
    from common.train.sequence_parallel import heads_split
    assert heads_split(12, 6, 2) and heads_split(12, 6, 6) and not heads_split(12, 6, 4) and heads_split(12, 2, 4)
    setup = Setup(gpus=8, gpu="H100", gpu_memory_gb=24, prompt_len=4096, max_prompt_len=4096, response_len=8192,
                  max_response_len=8192, samples=64, max_tokens_per_micro_batch=65536, lora_rank=32, rollout=False)
    proposed = lambda kv_heads: {flag.split()[-1] for flag, _ in fixes(Shape(
        hidden=768, intermediate=3072, layers=12, heads=12, kv_heads=kv_heads, vocab=50_000, tied=True), setup)
        if flag.startswith("--sequence-parallel")}
    assert proposed(12) == {"2", "4"}  # every head its own key-value head: 4 would fit and works
    assert proposed(6) == {"2"}


def test_the_committed_validation_table_is_what_the_fit_gives():
    """benchmarks/results/planner/validation.md is `scripts/plan.py --validate` over the committed runs with the
    committed coefficients: change either, and this says the table must be made again."""
    result = subprocess.run([sys.executable, "scripts/plan.py", "--validate",
                             "benchmarks/results/planner/measured_runs.json"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    with open(os.path.join(ROOT, "benchmarks/results/planner/validation.md")) as f:
        assert result.stdout == f.read()
    memory_line = next(line for line in result.stdout.splitlines() if line.startswith("memory:"))
    within, runs = map(int, memory_line.split()[1:4:2])
    assert within / runs >= 0.8, memory_line


def test_plan_help_explains_every_input():
    from scripts.plan import build_parser
    actions = [a for a in build_parser()._actions if a.dest != "help"]
    assert len(actions) > 25 and all(a.help for a in actions), [a.dest for a in actions if not a.help]
    result = subprocess.run([sys.executable, "scripts/plan.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "--max-response-len" in result.stdout


def test_a_stage_out_of_memory_is_one_line(tmp_path):
    """A CUDA out-of-memory error in a stage (simulated at a crash point: CPU has none) stops the run with one line
    naming the stage and the step, no traceback."""
    from test_grpo_e2e import TINY, assert_one_line_error, torchrun
    result = torchrun([*TINY, "--steps", "3", "--output-dir", str(tmp_path / "run")], tmp_path,
                      env={"NANORL_TEST_CRASH": "update:2:oom"})
    assert_one_line_error(result, "out of GPU memory in stage 'update' of step 2")


def test_out_of_memory_at_start_up_is_one_line(tmp_path):
    """The same at start-up, where the engine is made beside the trainer's weights (Qwen3-30B-A3B with LoRA on one
    H200 stops there): one line, no traceback."""
    from test_grpo_e2e import TINY, assert_one_line_error, torchrun
    result = torchrun([*TINY, "--steps", "1", "--output-dir", str(tmp_path / "run")], tmp_path,
                      env={"NANORL_TEST_CRASH": "start-up:0:oom"})
    assert_one_line_error(result, "out of GPU memory at start-up")


def test_start_up_plan_turns_checkpointing_on_where_the_step_would_not_fit(monkeypatch):
    """plan_run on a GPU (its two CUDA queries stood in for: CPU has none): the built-in model's step needs more than
    the 90% of a 4 GB GPU without activation checkpointing (3.15 GB of overhead alone), so an unset flag turns on and
    the line says so; given on the command line (--no-activation-checkpointing), the user's choice stands."""
    import sys

    import torch

    from common.rollout.args import fill_rollout_defaults
    from common.run import run_plan as planner
    from common.train.model import model_config
    monkeypatch.setattr(planner, "_plan", None)  # what plan_run sets goes with the test
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 4e9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    for argv, expected in ([], True), (["--no-activation-checkpointing"], False):
        monkeypatch.setattr(sys, "argv", ["grpo.py", *argv])
        args = grpo.Args(max_response_len=64, activation_checkpointing=False, rollout_engine="vllm")
        fill_rollout_defaults(args)
        lines = planner.plan_run(args, 1, torch.device("cuda", 0), model_config(None))
        assert args.activation_checkpointing is expected
        assert any(line.startswith("planner: --activation-checkpointing on") for line in lines) is expected, lines
        assert any(line.startswith("planner: peak:") for line in lines), lines
        # The step at every response's limit, as memory is sized: the line says it is an upper bound.
        assert any(line.startswith("planner: step:") and "every response runs to --max-response-len, an upper bound"
                   in line for line in lines), lines
