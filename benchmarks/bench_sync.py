"""Benchmark the FSDP2 -> vLLM weight sync at Qwen2.5 shapes: seconds, GB/s and the extra GPU memory it takes.

A random-weight model of the chosen shape is sharded with FSDP2 over all ranks, a colocated vLLM engine is
started (tensor parallel --tp, one replica per --tp ranks), then the training loop's cycle is repeated:
sleep, update_weights (wake, sync, wake). Each cycle is run --iters times per sleep level, in one run:
  none: no sleep, the pure transfer (what the sync costs at best);
  0: the KV cache freed by sleep and mapped back after the sync; the weights stay (--rollout-sleep-level 0);
  1: weights parked in CPU memory by sleep and copied back by the wake-up, only to be overwritten;
  2: weights dropped by sleep, the wake-up maps empty memory and the sync fills it (--rollout-sleep-level 2).
The KV cache is sized as the training scripts size it by default, for --sequences sequences of 1,024 tokens
(common/rollout/vllm_engine.py kv_cache_gib), unless --gpu-memory says otherwise: mapping it back is most of a wake-up.
The time of an iteration is the slowest rank's; the report gives medians per level (sleep, wake, transfer, and the
in-loop sync = wake + transfer, as the training loop logs it), their ratio to the pure transfer, and the check of
the last sync at every level (check_weight_sync).

    torchrun --nproc_per_node 1 benchmarks/bench_sync.py --shape 0.5b --tp 1 --out benchmarks/results/sync_0.5b_1gpu.json
    torchrun --nproc_per_node 4 benchmarks/bench_sync.py --shape 7b --tp 2 --out benchmarks/results/sync_7b_4gpu_tp2.json
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/ and sharding/
from common.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402
from common.run.distributed import init_distributed  # noqa: E402
from common.train.model import shard_model  # noqa: E402
from scripts.random_model import SHAPES, qwen2_config  # noqa: E402

def save_config(config: Qwen2Config, path: str, rank: int) -> str:
    """config.json only: the engine starts with dummy weights and gets the real ones from the trainer.
    The folder is per launch (torchrun's port), so benches may run side by side on one machine."""
    path = f"{path}_{os.environ.get('MASTER_PORT', '0')}"
    if rank == 0:
        config.save_pretrained(path)
    dist.barrier()
    return path


def build_policy(config: Qwen2Config, device: torch.device, master_dtype: torch.dtype) -> torch.nn.Module:
    """Random weights, initialised on the GPU (fast even at 7B), then FSDP2-sharded as the trainer does."""
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=master_dtype)
    return shard_model(model, device)


def report(result: dict, out: str | None) -> None:
    """Prints the result and writes it as JSON to `out` (if given)."""
    print(json.dumps(result, indent=2))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=2)


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--master-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                        help="dtype of the trainer's sharded weights (the sync casts them to bf16)")
    parser.add_argument("--gpu-memory", type=float, default=None,
                        help="vLLM's share of each GPU; above 1: GiB of KV cache; unset: sized for --sequences")
    parser.add_argument("--sequences", type=int, default=256, help="sequences the default KV cache holds at once")
    parser.add_argument("--sleep-levels", nargs="+", choices=["none", "0", "1", "2"], default=["none", "0", "1", "2"],
                        help="cycles to time: none (pure transfer), then the engine's sleep levels")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()

    rank, world, device = init_distributed()
    config = qwen2_config(args.shape)
    model_dir = save_config(config, f"/tmp/nanorl_bench_{args.shape}", rank)
    policy = build_policy(config, device, getattr(torch, args.master_dtype))
    engine = VLLMRolloutEngine(model_dir, tp_size=args.tp, gpu_memory_utilization=args.gpu_memory,
                               max_model_len=1024, stop_token_ids=[], seed=0, enforce_eager=True,
                               sync_bucket_mb=args.bucket_mb, max_sequences=args.sequences)
    default_level = engine.sleep_level
    engine.update_weights(policy)  # the first sync replaces the dummy weights; not timed

    result = {
        "shape": args.shape, "gpus": world, "tp": args.tp, "replicas": world // args.tp,
        "device": torch.cuda.get_device_name(device), "master_dtype": args.master_dtype, "bucket_mb": args.bucket_mb,
        "params": sum(p.numel() for p in policy.parameters()), "kv_cache_gib": engine.kv_cache_gib,
        "gpu_memory": args.gpu_memory, "sequences": args.sequences, "default_sleep_level": default_level,
        "torch": torch.__version__, "vllm": __import__("vllm").__version__, "levels": {},
    }
    for level in args.sleep_levels:
        times, extra_bytes = {"sleep": [], "wake": [], "transfer": [], "in_loop": []}, []
        for _ in range(args.iters):
            with torch.no_grad():  # a training step changes every weight: the check below must see this sync's
                for p in policy.parameters():
                    p.add_(1e-2)
            dist.barrier()
            start = time.perf_counter()
            if level != "none":
                engine.sleep_level = int(level)
                engine.sleep()
            slept = time.perf_counter() - start
            dist.barrier()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            metrics = engine.update_weights(policy)
            # vLLM's own memory is mapped and unmapped under the allocator's accounting, so this delta is the sync's.
            extra = torch.cuda.max_memory_allocated() - before
            s, w, z, e = slowest([metrics["sync/seconds"], metrics["sync/wake_seconds"], slept, extra], device)
            for key, value in zip(("transfer", "wake", "sleep", "in_loop"), (s, w, z, s + w)):
                times[key].append(value)
            extra_bytes.append(e)
        start = time.perf_counter()
        engine.check_weights(policy)  # raises on a mismatch
        check_seconds = time.perf_counter() - start
        gb = metrics["sync/gb"]
        result["sync_gb"] = gb
        result["levels"][level] = {
            **{f"{k}_seconds_median": statistics.median(v) for k, v in times.items()},
            "in_loop_seconds": times["in_loop"], "transfer_gb_per_s_median": gb / statistics.median(times["transfer"]),
            "peak_extra_gib_max": max(extra_bytes) / 2**30, "check_passed": True, "check_seconds": check_seconds}
    if "none" in result["levels"]:
        pure = result["levels"]["none"]["transfer_seconds_median"]
        for level in result["levels"].values():
            level["in_loop_over_pure_transfer"] = level["in_loop_seconds_median"] / pure
    if rank == 0:
        report(result, args.out)


if __name__ == "__main__":
    main()
