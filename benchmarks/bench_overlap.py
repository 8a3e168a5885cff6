"""The same-GPU overlap experiment: can one GPU generate the next batch while it trains on this one?

One GPU holds both a FSDP2 policy (fp32 master weights, bf16 compute, AdamW) and an awake vLLM engine (no sleep:
both stay resident, so each gets less memory than in the colocated loop). Measured in one run, same work each way:
  generate alone, train alone (--train-steps policy-gradient-shaped steps on random tokens),
  sequential: generate, then train (what synchronous colocated GRPO does, minus sleep/wake);
  overlapped: generate in a second thread on its own CUDA stream while the main thread trains.
speedup = sequential / overlapped. The rule we set: keep overlap on one GPU in grpo.py only if speedup >= 1.2
for the 0.5B shape; otherwise record the numbers (benchmarks/README.md) and leave it out.

    torchrun --nproc_per_node 1 benchmarks/bench_overlap.py --out benchmarks/results/overlap_0.5b_1gpu.json
"""

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/ and sharding/
from bench_rollout import train_step  # noqa: E402  (same folder)
from bench_sync import SHAPES, build_policy, qwen2_config, report, save_config  # noqa: E402
from common.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402
from common.run.distributed import init_distributed  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--train-steps", type=int, default=4, help="training steps per round")
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--train-seq", type=int, default=768)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpu-memory", type=float, default=0.35, help="vLLM's share of the GPU (it stays awake)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    rank, world, device = init_distributed()
    if world != 1:
        raise SystemExit("one GPU: torchrun --nproc_per_node 1")
    config = qwen2_config(args.shape)
    policy = build_policy(config, device, torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    engine = VLLMRolloutEngine(save_config(config, f"/tmp/nanorl_bench_{args.shape}", rank), tp_size=1,
                               gpu_memory_utilization=args.gpu_memory, max_model_len=args.prompt_len + args.new_tokens,
                               stop_token_ids=[], seed=0)
    engine.update_weights(policy)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (args.num_prompts, args.prompt_len), generator=generator).tolist()
    side = torch.cuda.Stream(device)

    def generate(seed: int) -> None:
        with torch.cuda.stream(side):
            engine.generate(prompts, n=1, max_tokens=args.new_tokens, temperature=1.0, top_p=1.0, seed=seed,
                            ignore_eos=True)
        side.synchronize()

    def train() -> None:
        for _ in range(args.train_steps):
            train_step(policy, optimizer, args.train_batch, args.train_seq, config.vocab_size, generator)
        torch.cuda.synchronize(device)

    def timed(fn) -> float:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        return time.perf_counter() - start

    def overlapped(seed: int) -> None:
        thread = threading.Thread(target=generate, args=(seed,))
        thread.start()
        train()
        thread.join()

    generate(0), train()  # warm-up (CUDA graphs, allocator), not reported
    results = {"generate": [], "train": [], "sequential": [], "overlapped": []}
    for r in range(args.rounds):
        results["generate"].append(timed(lambda: generate(1 + r)))
        results["train"].append(timed(train))
        results["sequential"].append(timed(lambda: (generate(100 + r), train())))
        results["overlapped"].append(timed(lambda: overlapped(200 + r)))
    medians = {f"{k}_s": statistics.median(v) for k, v in results.items()}
    result = {"shape": args.shape, "device": torch.cuda.get_device_name(device), "prompts": args.num_prompts,
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "train_steps": args.train_steps,
              "train_batch": args.train_batch, "train_seq": args.train_seq, **medians, "rounds": results,
              "speedup": medians["sequential_s"] / medians["overlapped_s"],
              "vllm": __import__("vllm").__version__, "torch": torch.__version__}
    result["keep"] = result["speedup"] >= 1.2
    report(result, args.out)


if __name__ == "__main__":
    main()
