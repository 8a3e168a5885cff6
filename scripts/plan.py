"""The capacity planner (common/run/planner.py) from the command line: for a model, a machine, the lengths, the batch and
the flags, the expected memory per GPU by part and the step time by stage, and the flags that would make a
configuration that does not fit fit.

    python scripts/plan.py --model Qwen/Qwen2.5-7B-Instruct --gpus 1 --gpu H100 --lora-rank 32 \\
        --prompt-len 512 --response-len 400 --max-response-len 512 --prompts-per-step 32 --group-size 8
    python scripts/plan.py --shape 1.5b --response-len 2000 --max-response-len 8192 --prompts-per-step 16
    python scripts/plan.py --validate benchmarks/results/planner/measured_runs.json   # predicted against measured
    python scripts/plan.py --fit benchmarks/results/planner/measured_runs.json        # refit common/run/planner.py's FIT

--model takes a local directory or a hub id whose config.json can be read (no weights are loaded); --shape one of
scripts/random_model.py's shapes (Qwen2.5's, and the mixtures of experts qwen3-moe-tiny, olmoe-tiny, olmoe-1b-4b, olmoe-1b-7b,
qwen3-30b-a3b) or smollm2 (SmolLM2-135M), for a machine without the hub.

    python scripts/plan.py --shape qwen3-30b-a3b --gpus 1 --gpu H200 --lora-rank 32 --activation-checkpointing
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/
from common.run.planner import FIT, GPUS, Setup, Shape, describe, memory, step_time  # noqa: E402

def shape_named(name: str) -> Shape:
    from transformers import LlamaConfig

    from scripts.random_model import LLAMA_SHAPES, MOE_SHAPES, SHAPES, model_config
    if name in ("smollm2", "135m"):
        return Shape.from_config(LlamaConfig(**LLAMA_SHAPES["135m"]))  # SmolLM2-135M's sizes
    if name not in SHAPES and name not in MOE_SHAPES:
        raise SystemExit(f"error: --shape {name}: one of {', '.join([*SHAPES, *MOE_SHAPES])}, smollm2")
    return Shape.from_config(model_config(name))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("the model (one of)")
    what.add_argument("--model", help="a model directory or hub id: its config.json gives the sizes")
    what.add_argument("--shape", help="a shape of scripts/random_model.py: Qwen2.5's (0.5b, 1.5b, 7b, ...), a mixture "
                      "of experts (qwen3-moe-tiny, olmoe-tiny, olmoe-1b-4b, olmoe-1b-7b, qwen3-30b-a3b), or smollm2")
    machine = p.add_argument_group("the machine")
    machine.add_argument("--gpus", type=int, default=1, help="training GPUs (colocated: they also generate)")
    machine.add_argument("--gpu", choices=sorted(GPUS), default="H100", help="the GPU kind: peak FLOP/s, memory "
                         "bandwidth and memory")
    machine.add_argument("--gpu-memory", type=float, default=None, help="GB of one GPU (1e9 bytes), if not the "
                         "kind's (H100 85, H200 150)")
    batch = p.add_argument_group("the lengths and the batch (tokens)")
    batch.add_argument("--prompt-len", type=float, default=256, help="mean prompt tokens")
    batch.add_argument("--max-prompt-len", type=int, default=None, help="the longest prompt (sizes the KV cache); "
                       "default: --prompt-len")
    batch.add_argument("--response-len", type=float, default=512, help="mean response tokens")
    batch.add_argument("--max-response-len", type=int, default=1024, help="the longest response: decoding takes "
                       "as many engine steps")
    batch.add_argument("--response-lengths", choices=["natural", "geometric"], default="natural", help="how the "
                       "longest response of a step (what decoding waits for) follows from the mean: natural, a trained "
                       "model's (a fitted multiple of the mean); geometric, a random-weight model's (random_model.py, "
                       "--stop-every), whose longest of n is the untruncated mean x H_n; either at most "
                       "--max-response-len (a mean at the cap: every response runs to it)")
    batch.add_argument("--prompts-per-step", type=int, default=16, help="prompts per step over all GPUs")
    batch.add_argument("--group-size", type=int, default=16, help="responses per prompt")
    batch.add_argument("--max-tokens-per-micro-batch", type=int, default=16384, help="the token budget of one "
                       "packed pass (the scripts' flag)")
    flags = p.add_argument_group("the scripts' flags the figures depend on")
    flags.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="the compute dtype of training "
                       "and vLLM (fp32: activations and KV cache twice as large, slower matmuls)")
    flags.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank (0: full fine-tuning)")
    flags.add_argument("--offload", action="store_true", help="ppo.py --offload: other models and the optimizer wait "
                       "in CPU memory outside their phases")
    flags.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward: "
                       "activations of one layer, each layer's input kept")
    flags.add_argument("--compile", action="store_true", help="torch.compile'd layers (a higher MFU)")
    flags.add_argument("--sequence-parallel", type=int, default=1, help="ranks each packed row is split over")
    flags.add_argument("--shard-size", type=int, default=None, help="hybrid sharding: ranks a model is sharded over")
    flags.add_argument("--rollout-tp", type=int, default=1, help="vLLM tensor-parallel size")
    flags.add_argument("--rollout-eager", action="store_true", help="vLLM without CUDA graphs (slower decoding)")
    flags.add_argument("--rollout-sleep-level", type=int, default=None, help="what vLLM frees while training "
                       "(default: the scripts' choice)")
    flags.add_argument("--no-rollout", action="store_true", help="no colocated engine (offline dpo.py)")
    flags.add_argument("--critic", action="store_true", help="ppo.py: a critic as large as the policy")
    flags.add_argument("--reference", action="store_true", help="a frozen reference model in memory (--kl-coef > 0 "
                       "without LoRA, dpo.py --ref-cache none)")
    flags.add_argument("--pairs", action="store_true", help="dpo.py: each sample is a pair of responses")
    checks = p.add_argument_group("the planner itself")
    checks.add_argument("--validate", metavar="RUNS", help="predict every committed run in RUNS (JSON) and compare")
    checks.add_argument("--fit", metavar="RUNS", help="fit FIT's coefficients to RUNS and print them")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    if not (args.validate or args.fit) and bool(args.model) == bool(args.shape):
        p.error("give --model or --shape")
    return args


def setup_from_args(args) -> Setup:
    return Setup(gpus=args.gpus, gpu=args.gpu, gpu_memory_gb=args.gpu_memory, prompt_len=args.prompt_len,
                 max_prompt_len=args.max_prompt_len or math.ceil(args.prompt_len), response_len=args.response_len,
                 max_response_len=args.max_response_len, samples=args.prompts_per_step * args.group_size,
                 max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, precision=args.precision,
                 lora_rank=args.lora_rank, offload=args.offload, activation_checkpointing=args.activation_checkpointing,
                 compile=args.compile, sequence_parallel=args.sequence_parallel, shard_size=args.shard_size,
                 rollout=not args.no_rollout, rollout_tp=args.rollout_tp, rollout_eager=args.rollout_eager,
                 response_lengths=args.response_lengths,
                 sleep_level=args.rollout_sleep_level, critic=args.critic, reference=args.reference, pairs=args.pairs)


# ---------------------------------------------------------------------------------------------------------------
# The committed runs: what each was, as a Setup, and what it measured.

COVERED = ("bench_train", "grpo", "ppo", "dpo")


def run_setup(run: dict) -> tuple[Shape, Setup] | None:
    """A committed run (benchmarks/results/planner/measured_runs.json) as the planner's inputs, or None for runs
    it does not model (split placement, synchronous or not: the planner models one colocated engine; benches of one
    stage, shared GPUs). The training bench's num_samples are each rank's (each sequence-parallel group's): the
    step's samples are that many times the groups. A random-weight model's responses are geometric in length (it
    samples its end token with one probability at every token); a trained model's natural."""
    c, m = run["config"], run["model"]
    if run["kind"] not in COVERED or c.get("placement") in ("split", "split_async") or run.get("shared_gpu"):
        return None
    if c.get("mode") not in (None, "packed", "compiled", "compiled_layers", "synced"):
        return None  # bench_train's padded baseline: not the scripts' path
    from transformers import PretrainedConfig
    moe = {k: m[k] for k in ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                             "shared_expert_intermediate_size") if k in m}  # a mixture of experts' sizes, if any
    shape = Shape.from_config(PretrainedConfig(
        hidden_size=m["hidden_size"], intermediate_size=m["intermediate_size"], num_hidden_layers=m["num_hidden_layers"],
        num_attention_heads=m["num_attention_heads"], num_key_value_heads=m["num_key_value_heads"],
        vocab_size=m["vocab_size"], tie_word_embeddings=m["tie_word_embeddings"], head_dim=m.get("head_dim"), **moe))
    pairs = run["kind"] == "dpo" and not c.get("online")  # online DPO generates samples and trains pairs of them
    samples = c.get("dpo_pairs_per_step") or c.get("num_samples") or (c.get("prompts_per_step") or 0) * (
        c.get("group_size") or 1)
    prompt = c.get("prompt_len")
    response = c.get("response_len_mean")
    trained = 1.0  # the share of the samples the update passes
    if run["kind"] == "grpo" and not code_passes_every_sample(run):
        trained = informative_fraction(run)
    if run["kind"] == "dpo" and c.get("online") and run["measured"].get("pairs_per_step_median") and samples:
        trained = min(1.0, 2 * run["measured"]["pairs_per_step_median"] / samples)  # both responses of each pair
    if pairs and c.get("tokens_per_step") and samples:  # two rows of (prompt + response) a pair
        prompt, response = c["tokens_per_step"] / samples / 2 * 0.6, c["tokens_per_step"] / samples / 2 * 0.4
    if not samples or prompt is None or response is None:
        return None
    if run["kind"] == "bench_train":  # every group of --sequence-parallel ranks steps through the same num_samples
        samples *= (c.get("train_gpus") or run["num_gpus"]) // (c.get("sequence_parallel") or 1)
    rollout = run["kind"] in ("grpo", "ppo") or (run["kind"] == "dpo" and c.get("placement") == "colocated")
    kv = c.get("kv_cache_gib")
    setup = Setup(
        gpus=c.get("train_gpus") or run["num_gpus"], gpu=run["device"], prompt_len=prompt,
        max_prompt_len=c.get("max_prompt_len") or math.ceil(prompt), response_len=response,
        max_response_len=c.get("max_response_len") or math.ceil(response), samples=samples,
        max_tokens_per_micro_batch=c.get("max_tokens_per_micro_batch") or 16384, precision=c.get("precision") or "bf16",
        lora_rank=c.get("lora_rank") or 0, offload=bool(c.get("offload")),
        activation_checkpointing=bool(c.get("activation_checkpointing")),
        compile=bool(c.get("compile")) or c.get("mode") in ("compiled", "compiled_layers"), shard_size=c.get("shard_size"),
        sequence_parallel=c.get("sequence_parallel") or 1,
        rollout=rollout, rollout_tp=c.get("rollout_tp") or 1, rollout_eager=bool(c.get("rollout_eager")),
        response_lengths="geometric" if m.get("description", "").startswith("random-weight") else "natural",
        sleep_level=c.get("sleep_level"), kv_cache_gb=None if kv is None else kv * 2**30 / 1e9,
        critic=bool(c.get("critic")), reference=bool(c.get("reference")) and c.get("reference_in_memory", True),
        pairs=pairs, epochs=c.get("epochs") or 1,
        old_logprobs_pass=run["kind"] == "ppo" or (c.get("epochs") or 1) > 1 or (c.get("num_mini_batches") or 1) > 1
        or (run["kind"] == "grpo" and code_passes_every_sample(run)),
        vllm_memory_gb=c["rollout_gpu_memory"] * GPUS[run["device"]][2] if 0 < (c.get("rollout_gpu_memory") or 0) <= 1
        else None, trained_fraction=trained, trainer_cache_kept=code_keeps_trainer_cache(run))
    return shape, setup


def informative_fraction(run: dict) -> float:
    """GRPO trains the groups with signal only: their median share over the run's steps after the first, from its
    committed metrics (1 where there are none)."""
    root = Path(__file__).resolve().parents[1]
    for name in run["source"]["files"]:
        path = root / name
        if name.endswith("metrics.jsonl") and path.is_file():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            shares = [r["reward/informative_frac"] for r in rows if r.get("step", 0) >= 2 and
                      "reward/informative_frac" in r]
            if shares:
                return max(statistics.median(shares), 0.01)
    return 1.0


def code_passes_every_sample(run: dict) -> bool:
    """grpo.py before 2026-11-24 trained every sample, groups without signal too (5878864, late on 2026-11-23, passes
    only those with it), and took the old log-probs in a forward pass of its own (b795667, 2026-11-24, takes them from
    the update's own pass when there is one optimizer step a batch)."""
    return run.get("date", "") < "2026-11-24"


def code_keeps_trainer_cache(run: dict) -> bool:
    """Runs made before 0fd545a (2026-11-24, morning) handed the trainer's cached blocks back before every wake-up."""
    text = json.dumps(run).lower()
    return run.get("date", "") > "2026-11-24" or (run.get("date") == "2026-11-24" and "lease1" not in run["id"]
                                                   and "before 0fd545a" not in text)


def compared(run: dict, shape: Shape, setup: Setup, fit: dict) -> dict:
    """Predicted and measured peak memory (GB per GPU) and step time (s) of a committed run (run_setup's inputs)."""
    m = run["measured"]
    mem, times = memory(shape, setup, fit), step_time(shape, setup, fit)
    row = {"id": run["id"], "kind": run["kind"]}
    if m.get("peak_memory_gb") and run.get("validation_use") == "memory_and_time" or m.get("oom"):
        if run["kind"] == "bench_train":  # PyTorch's own peak: no CUDA context, no vLLM
            row["memory"] = (mem["allocated"], m["peak_memory_gb"])
        else:
            row["memory"] = (mem["peak"], m["peak_memory_gb"])
        row["oom"] = bool(m.get("oom"))
    if m.get("step_seconds") and run["kind"] != "bench_train":
        row["step"] = (times["step"], m["step_seconds"])
    measured_update = m.get("update_seconds")
    if measured_update:
        row["update"] = (times["update"], measured_update)
    if m.get("rollout_seconds") and "rollout" in times:
        row["rollout"] = (times["rollout"], m["rollout_seconds"])
    if m.get("sync_seconds") and "sync" in times:  # fitted on, not printed
        row["sync"] = (times["sync"], m["sync_seconds"])
    return row


def error(pair) -> float:
    predicted, measured = pair
    return predicted / measured - 1


def validate(cases: list[tuple], fit: dict, show: bool = True) -> dict:
    """cases: (run, shape, setup) of each run the planner covers."""
    rows = [compared(*case, fit) for case in cases]
    summary = {}
    for key in ("memory", "step", "update", "rollout"):
        errors = [error(r[key]) for r in rows if key in r and not (key == "memory" and r.get("oom"))]
        if errors:
            summary[key] = {"runs": len(errors), "median_abs": statistics.median(abs(e) for e in errors),
                            "within": sum(abs(e) <= (0.2 if key == "memory" else 0.3) for e in errors)}
    if show:
        print("| run | kind | peak memory GB, predicted / measured | step s | update s | rollout s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows:
            cell = lambda key, unit="": (f"{r[key][0]:.1f} / {r[key][1]:.1f} ({error(r[key]):+.0%})"
                                         + (" (out of memory: a lower bound)" if key == "memory" and r.get("oom")
                                            else "")) if key in r else "-"
            print(f"| {r['id']} | {r['kind']} | {cell('memory')} | {cell('step')} | {cell('update')} | {cell('rollout')} |")
        for key, s in summary.items():
            target = "20%" if key == "memory" else "30%"
            print(f"{key}: {s['within']} of {s['runs']} runs within {target}, median |error| {s['median_abs']:.0%}")
    return summary


# What each coefficient may be (physically plausible ranges), and which comparison fits it.
BOUNDS = {"act_h": (10, 40), "act_i": (4, 16), "compile_act_share": (0.5, 1), "ckpt_h": (2, 8), "logit_copies": (1, 8),
          "overhead_gb": (0.5, 5), "vllm_overhead_gb": (0.5, 6), "mfu_at_1b": (0.1, 0.5), "mfu_per_decade": (0, 0.25),
          "compile_gain": (1, 1.6), "fp32_share": (0.1, 1), "moe_share": (0.2, 1), "layer_pass_s": (0.0005, 0.02), "compile_pass_share": (0.3, 1),
          "longest_over_mean": (1.5, 8), "decode_bw_share": (0.2, 0.9), "decode_layer_s": (1e-5, 5e-4),
          "decode_layer_eager_s": (2e-4, 3e-3), "decode_tp_layer_s": (1e-5, 2e-3), "decode_token_s": (1e-6, 1e-4),
          "prefill_mfu": (0.05, 0.6),
          "sync_gb_s": (10, 600), "sync_s": (0.01, 1)}
FITS = {"memory": ["act_h", "act_i", "compile_act_share", "ckpt_h", "logit_copies", "overhead_gb", "vllm_overhead_gb"],
        "update": ["mfu_at_1b", "mfu_per_decade", "compile_gain", "fp32_share", "moe_share", "layer_pass_s",
                   "compile_pass_share"],
        "rollout": ["longest_over_mean", "decode_bw_share", "decode_layer_s", "decode_layer_eager_s",
                    "decode_tp_layer_s", "decode_token_s", "prefill_mfu"],
        "sync": ["sync_s", "sync_gb_s"]}


def fit_coefficients(cases: list[tuple]) -> dict:
    """Coordinate descent over FIT's coefficients within BOUNDS, each group on its own comparison (memory, update
    time, rollout time, sync time), minimising the mean of log(predicted / measured)^2 (a run that ran out of memory
    counts only
    where the prediction is below what it measured before it did)."""
    fit = dict(FIT)

    def loss(candidate, key) -> float:
        total, count = 0.0, 0
        for case in cases:
            row = compared(*case, candidate)
            if key not in row:
                continue
            ratio = math.log(max(row[key][0], 1e-6) / row[key][1])
            if key == "memory" and row.get("oom"):
                ratio = min(ratio, 0.0)
            total, count = total + ratio ** 2, count + 1
        return total / max(count, 1)

    for key, names in FITS.items():
        best = loss(fit, key)
        for _ in range(5):
            for name in names:
                low, high = BOUNDS[name]
                for factor in (0.5, 0.7, 0.85, 0.95, 1.05, 1.2, 1.4, 2.0):
                    candidate = {**fit, name: min(high, max(low, fit[name] * factor))}
                    value = loss(candidate, key)
                    if value < best - 1e-9:
                        best, fit = value, candidate
        print(f"{key}: mean squared log error {best:.4f}")
    print("FIT = " + json.dumps({k: float(f"{v:.3g}") for k, v in fit.items()}, indent=4))
    return fit


def main(argv=None):
    args = parse_args(argv)
    if args.validate or args.fit:
        with open(args.validate or args.fit) as f:
            runs = json.load(f)["runs"]
        cases = [(run, *inputs) for run in runs if (inputs := run_setup(run)) is not None]
        fit = fit_coefficients(cases) if args.fit else FIT
        validate(cases, fit)
        return
    if args.model:
        from transformers import AutoConfig
        try:
            shape = Shape.from_config(AutoConfig.from_pretrained(args.model))
        except (OSError, ValueError) as e:  # no config.json there, or a hub that cannot be reached
            raise SystemExit(f"error: --model {args.model}: could not read its config ({' '.join(str(e).split())[:200]})")
    else:
        shape = shape_named(args.shape)
    print("\n".join(describe(shape, setup_from_args(args))))


if __name__ == "__main__":
    main()
