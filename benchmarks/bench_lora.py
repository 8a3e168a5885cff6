"""Benchmark the two ways a LoRA policy's adapters reach a colocated vLLM engine (--lora-sync), at a Qwen2.5 shape:

  merged   the adapters merged into the base weights, W + s B A, streamed like full fine-tuning's weights; vLLM runs
           the plain model;
  adapter  the base loaded once, each update's adapters (A and B, about 160 MB at 7B and rank 32 in bf16) written as
           a PEFT directory and loaded as a new vLLM LoRA adapter; vLLM runs its LoRA kernels beside the base.

One mode per launch (a process holds one vLLM engine). A random-weight model with LoRA adapters of --rank on every
linear layer of the decoder (B random, as after training) is FSDP2-sharded on one GPU, its engine started as the
scripts start it, then: the training loop's cycle (sleep, an update that changes every adapter, update_weights)
--iters times per sleep level, the sync's seconds and the wake's; the check of the last sync (--check-weight-sync's,
base and adapters); decoding --prompts x --group-size sequences of exactly --tokens new tokens (after a short
warm-up); and the mean |log-prob difference| between vLLM and the trainer on the sampled tokens of --compare of them.

    python scripts/random_model.py --shape 7b --out /tmp/qwen7b
    torchrun --nproc_per_node 1 benchmarks/bench_lora.py --model /tmp/qwen7b --mode merged --out merged.json
    torchrun --nproc_per_node 1 benchmarks/bench_lora.py --model /tmp/qwen7b --mode adapter --out adapter.json
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/ and sharding/
from common.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402
from common.run.distributed import init_distributed  # noqa: E402
from common.train.logprobs import compute_logprobs, use_packed_attention  # noqa: E402
from common.train.lora import add_lora  # noqa: E402
from common.train.model import load_tokenizer, save_model_config, shard_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model directory (scripts/random_model.py)")
    parser.add_argument("--mode", choices=["merged", "adapter"], required=True)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--levels", type=int, nargs="+", default=None,
                        help="sleep levels to time the sync at; unset: 0 and 2 (merged), 0 and 1 (adapter)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--compare", type=int, default=16, help="sequences whose log-probs the trainer recomputes")
    parser.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs and compilation")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()

    rank, world, device = init_distributed()
    tokenizer = load_tokenizer(args.model)
    lora = SimpleNamespace(lora_rank=args.rank, lora_alpha=args.alpha, lora_targets=None)
    # The base straight in bf16 on the GPU (the scripts load fp32 on the CPU and keep a frozen base in bf16 alike:
    # common/train/model.py), adapters in fp32 as the scripts train them.
    model = add_lora(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map=device),
                     lora, seed=1)
    with torch.no_grad():  # adapters as after training: B is zero at the start, which would merge into the base
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.data = param.data.float()
                if ".lora_B." in name:
                    param.normal_(0, 1e-3)
    policy = shard_model(model, device)
    use_packed_attention(policy, device)
    config_dir = save_model_config(args.model, tokenizer, f"/tmp/nanorl_bench_lora_{args.mode}")
    targets = sorted(policy.peft_config["default"].target_modules)
    started = time.perf_counter()
    engine = VLLMRolloutEngine(
        config_dir, tp_size=1, gpu_memory_utilization=None, max_model_len=args.prompt_len + args.tokens,
        stop_token_ids=[tokenizer.eos_token_id], seed=0, enforce_eager=args.eager,
        max_sequences=args.prompts * args.group_size,
        lora={"rank": args.rank, "targets": targets, "dir": f"/tmp/nanorl_bench_lora_{args.mode}/adapters"}
        if args.mode == "adapter" else None)
    result = {"mode": args.mode, "model": args.model, "rank": args.rank, "alpha": args.alpha,
              "device": torch.cuda.get_device_name(device), "eager": args.eager,
              "params": sum(p.numel() for p in policy.parameters()),
              "adapter_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
              "engine_start_seconds": time.perf_counter() - started, "default_sleep_level": engine.sleep_level,
              "kv_cache_gib": engine.kv_cache_gib, "torch": torch.__version__,
              "vllm": __import__("vllm").__version__, "levels": {}}
    first = engine.update_weights(policy)  # the first sync (adapter: the base too); timed apart
    result["first_sync"] = first

    def train_step():
        """What an update changes: every adapter (the base is frozen)."""
        with torch.no_grad():
            for param in policy.parameters():
                if param.requires_grad:
                    param.add_(1e-4)

    for level in args.levels or ([0, 2] if args.mode == "merged" else [0, 1]):
        engine.sleep_level, rows = level, []
        for _ in range(args.iters):
            train_step()
            engine.sleep()
            rows.append(engine.update_weights(policy))
        result["levels"][str(level)] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"level {level}: {result['levels'][str(level)]}", flush=True)
    checked = time.perf_counter()
    engine.check_weights(policy)  # --check-weight-sync: the merged weights, or the base and the adapters
    result["check_seconds"], result["check_passed"] = time.perf_counter() - checked, True

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, len(tokenizer) - 10, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.prompts)]
    engine.generate(prompts[:4], n=2, max_tokens=16, temperature=1.0, top_p=1.0, seed=1, ignore_eos=True)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = engine.generate(prompts, n=args.group_size, max_tokens=args.tokens, temperature=1.0, top_p=1.0, seed=0,
                              ignore_eos=True)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.response_ids) for group in outputs for c in group)
    result.update(decode_seconds=seconds, decode_tokens=tokens, decode_tokens_per_s=tokens / seconds)
    engine.sleep()

    samples = [{"prompt_ids": prompt, "response_ids": c.response_ids, "logprobs": c.logprobs}
               for prompt, group in zip(prompts, outputs) for c in group][:args.compare]
    trainer = compute_logprobs(policy, samples, 16384, 1.0, device)
    diffs = torch.cat([(torch.tensor(s["logprobs"]) - lp).abs() for s, lp in zip(samples, trainer)])
    result.update(logprob_diff_mean=diffs.mean().item(), logprob_diff_max=diffs.max().item(),
                  peak_memory_gb=torch.cuda.max_memory_allocated(device) / 1e9)
    print(json.dumps(result, indent=2))
    if args.out and rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    engine.close()


if __name__ == "__main__":
    main()
