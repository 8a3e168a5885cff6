"""Benchmark a training script's model load: rank 0 reads the checkpoint in the dtype read_dtypes gives (a LoRA run's
frozen base in the compute dtype, a policy trained in full in fp32), the other ranks build it on the meta device, then
add_lora and shard_model spread it over the ranks' devices, as grpo.py does at start-up. Reports seconds for the read
and the sharding, each rank's peak resident memory (ru_maxrss), the host's peak memory in use (MemTotal -
MemAvailable, sampled every 0.1 s on rank 0: every rank and everything else on the host) and each GPU's peak.

    torchrun --nproc_per_node 2 benchmarks/bench_load.py --model /tmp/qwen3-30b-a3b --lora-rank 32 --out load.json
"""

import argparse
import json
import resource
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common.run.distributed import init_distributed  # noqa: E402
from common.train.lora import LoraArgs, add_lora  # noqa: E402
from common.train.model import load_model, read_dtypes, shard_model  # noqa: E402


def host_in_use_gb() -> float:
    info = dict(line.split(":") for line in open("/proc/meminfo"))
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) / 1e6


class HostPeak(threading.Thread):
    """The host's peak memory in use while it runs."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.running = host_in_use_gb(), True
        self.start()

    def run(self):
        while self.running:
            self.peak = max(self.peak, host_in_use_gb())
            time.sleep(0.1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an HF checkpoint directory")
    parser.add_argument("--lora-rank", type=int, default=32, help="0: full fine-tuning (read in fp32)")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--out", help="a JSON file for the figures")
    args = parser.parse_args()
    rank, world, device = init_distributed()
    host = HostPeak() if rank == 0 else None
    before = host_in_use_gb()
    dtype = read_dtypes(device, args.precision, args.lora_rank)[0]
    start = time.perf_counter()
    model = load_model(args.model, None, 0, dtype=dtype)
    read_s, read_rss = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    dist.barrier()
    start = time.perf_counter()
    model = shard_model(add_lora(model, LoraArgs(lora_rank=args.lora_rank), 0), device, precision=args.precision)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    shard_s = time.perf_counter() - start
    ours = {"rank": rank, "read_s": round(read_s, 2), "shard_s": round(shard_s, 2),
            "rss_after_read_gb": round(read_rss, 2),
            "rss_peak_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
            "gpu_peak_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 2) if device.type == "cuda" else None}
    ranks = [None] * world
    dist.all_gather_object(ranks, ours)
    if rank == 0:
        host.running = False
        params = sum(p.numel() for p in model.parameters())  # (a DTensor's numel is the whole parameter's)
        result = {"model": args.model, "world": world, "lora_rank": args.lora_rank, "read_dtype": str(dtype),
                  "parameters": params, "parameters_b": round(params / 1e9, 3),
                  "host_in_use_before_gb": round(before, 1), "host_in_use_peak_gb": round(host.peak, 1), "ranks": ranks}
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
