"""Benchmark generation throughput of the colocated vLLM engine inside the training loop against the same engine
standalone, on the same model, prompts and lengths, in one run.

Standalone: the engine generates round after round with nothing in between (the weights synced once).
In the loop: every round first does what a training step does around a rollout: sleep the engine, one FSDP2
forward/backward/optimizer step on the policy, update_weights (wake, sync, wake), then generate.
Only the generate call is timed; every response is exactly --new-tokens long (ignore_eos). The ratio
in-loop / standalone shows what sleeping, syncing and sharing the GPU with the trainer cost the rollout.
--standalone-only skips the trainer entirely (the engine keeps its dummy weights): a plain vLLM baseline.

    torchrun --nproc_per_node 1 benchmarks/bench_rollout.py --out benchmarks/results/rollout_0.5b_1gpu.json
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/ and sharding/
from bench_sync import SHAPES, build_policy, qwen2_config, report, save_config, slowest  # noqa: E402  (same folder)
from common.rollout.vllm_engine import VLLMRolloutEngine  # noqa: E402
from common.run.distributed import all_reduce_sum, init_distributed  # noqa: E402
from common.train.model import token_logprobs  # noqa: E402


def train_step(policy, optimizer, batch: int, seq: int, vocab: int, generator: torch.Generator) -> None:
    """One policy-gradient-shaped step on random tokens: forward with float log-probs, backward, AdamW."""
    ids = torch.randint(0, vocab, (batch, seq), generator=generator).cuda()
    logprobs, _ = token_logprobs(policy, ids, torch.ones_like(ids), temperature=1.0)  # [batch, seq - 1]
    (-logprobs.mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed_generate(engine, prompts: list[list[int]], new_tokens: int, seed: int, device) -> tuple[float, float]:
    """Returns (generated tokens over all ranks per second, seconds of the slowest rank)."""
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    outputs = engine.generate(prompts, n=1, max_tokens=new_tokens, temperature=1.0, top_p=1.0, seed=seed,
                              ignore_eos=True)
    seconds = time.perf_counter() - start
    # Ranks of one TP group return disjoint slices of their replica's outputs, so the sum counts each token once.
    tokens, = all_reduce_sum([sum(len(c.response_ids) for group in outputs for c in group)], device)
    seconds, = slowest([seconds], device)
    return tokens / seconds, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--tp", type=int, default=1, help="vLLM tensor-parallel size")
    parser.add_argument("--num-prompts", type=int, default=256, help="prompts per replica (TP group) and round")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per phase")
    parser.add_argument("--gpu-memory", type=float, default=0.5, help="vLLM's share of each GPU")
    parser.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs in vLLM")
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-seq", type=int, default=512)
    parser.add_argument("--standalone-only", action="store_true", help="no trainer: vLLM alone, dummy weights")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()

    rank, world, device = init_distributed()
    config = qwen2_config(args.shape)
    model_dir = save_config(config, f"/tmp/nanorl_bench_{args.shape}", rank)
    policy = optimizer = None
    if not args.standalone_only:
        policy = build_policy(config, device, torch.float32)  # fp32 master weights, bf16 compute: the trainer's setup
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-6)
    engine = VLLMRolloutEngine(model_dir, tp_size=args.tp, gpu_memory_utilization=args.gpu_memory,
                               max_model_len=args.prompt_len + args.new_tokens, stop_token_ids=[], seed=0,
                               enforce_eager=args.eager)

    # Each rank brings its share of its replica's prompts, as the training loop does.
    generator = torch.Generator().manual_seed(rank)
    prompts = torch.randint(0, config.vocab_size, (args.num_prompts // args.tp, args.prompt_len),
                            generator=generator).tolist()
    if policy is not None:
        engine.update_weights(policy)
    timed_generate(engine, prompts, args.new_tokens, seed=0, device=device)  # warm-up, not reported

    standalone = [timed_generate(engine, prompts, args.new_tokens, seed=1 + r, device=device)[0]
                  for r in range(args.rounds)]
    in_loop, sync_seconds = [], []
    for r in range(0 if args.standalone_only else args.rounds):
        engine.sleep()
        train_step(policy, optimizer, args.train_batch, args.train_seq, config.vocab_size, generator)
        sync_seconds.append(engine.update_weights(policy)["sync/seconds"])
        in_loop.append(timed_generate(engine, prompts, args.new_tokens, seed=100 + r, device=device)[0])

    result = {
        "shape": args.shape, "gpus": world, "tp": args.tp, "replicas": world // args.tp,
        "device": torch.cuda.get_device_name(device), "cuda_graphs": not args.eager,
        "prompts_per_replica": args.num_prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "standalone_tokens_per_s": statistics.median(standalone), "standalone_rounds": standalone,
        "torch": torch.__version__, "vllm": __import__("vllm").__version__,
    }
    if in_loop:
        result.update({"in_loop_tokens_per_s": statistics.median(in_loop), "in_loop_rounds": in_loop,
                       "in_loop_over_standalone": statistics.median(in_loop) / statistics.median(standalone),
                       "sync_seconds_median": statistics.median(sync_seconds)})
    if rank == 0:
        report(result, args.out)


if __name__ == "__main__":
    main()
