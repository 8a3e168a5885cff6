"""Throughput of multi-turn rollouts against single-turn rollouts of about the same tokens, one vLLM engine, one run.

Single-turn: --num-prompts prompts x --group-size responses of exactly --new-tokens tokens (ignore_eos), one
`generate`. Multi-turn: the same prompts x --group-size episodes of --turns turns of --new-tokens / --turns tokens
each, an environment (this file's `make_env`) answering every turn but the last with a short user message, streamed
through `run_turns` (common/rollout/episodes.py) with the environments in their processes, as a training step runs them.
Both count generated tokens only (not the observations); the ratio multi / single is what the multi-turn machinery
costs: the environment round trips, the observations' prefill, and turns that wait for their observation.

    torchrun --nproc_per_node 1 benchmarks/bench_episodes.py --model /tmp/smollm2 \\
        --out benchmarks/results/episodes_smollm2_1xh100.json
"""

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/ and sharding/
from common.rollout.engines import make_rollout_engine  # noqa: E402
from common.rollout.environments import EnvWorkers  # noqa: E402
from common.rollout.episodes import ChatFormat, run_episodes  # noqa: E402
from common.run.distributed import init_distributed  # noqa: E402
from common.train.model import load_model, load_tokenizer, save_model_config, shard_model  # noqa: E402


class GoOn:
    """Asks for more after every turn until the episode has had `turns` of them (a row's "turns")."""

    def __init__(self, row: dict):
        self.turns, self.seen = int(row["answer"]), 0

    def step(self, reply: str):
        self.seen += 1
        if self.seen >= self.turns:
            return [], 1.0, True
        return [{"role": "user", "content": "Go on."}], 0.0, False


def make_env(row: dict) -> GoOn:
    return GoOn(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an HF model directory (its chat template renders turns)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512, help="generated tokens per response / episode")
    parser.add_argument("--turns", type=int, default=4, help="turns per episode")
    parser.add_argument("--env-workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="hf: a CPU dry run of the script")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()

    rank, world, device = init_distributed()
    tokenizer = load_tokenizer(args.model)
    policy = shard_model(load_model(args.model, tokenizer, 0), device, precision="bf16" if args.engine == "vllm" else "fp32")
    model_dir = save_model_config(args.model, tokenizer, "/tmp/nanorl_bench_episodes")
    engine = make_rollout_engine(args.engine, policy, model_dir, tokenizer, [], rank, 1, None, 2048, 0, False, 512,
                                 max_sequences=args.num_prompts * args.group_size)
    engine.update_weights(policy)
    chat = ChatFormat(tokenizer, use_template=True)
    rows = [{"prompt": f"Tell me a long story about the number {i}.", "answer": str(args.turns)}
            for i in range(args.num_prompts)]
    prompt_ids = [chat.opening_ids([{"role": "user", "content": r["prompt"]}], []) for r in rows]
    envs = EnvWorkers(f"{__file__}:make_env", None, "none", timeout_s=60, workers=args.env_workers)
    per_turn = args.new_tokens // args.turns
    limits = SimpleNamespace(max_turns=args.turns, max_turn_len=per_turn, max_prompt_len=256,
                             max_response_len=2048 - 256,
                             temperature=1.0, top_p=1.0)

    def single(seed: int) -> tuple[int, float]:
        start = time.perf_counter()
        to_the_end = {"ignore_eos": True} if args.engine == "vllm" else {}  # hf: the engine has no stop tokens
        groups = engine.generate(prompt_ids, n=args.group_size, max_tokens=args.new_tokens, temperature=1.0,
                                 top_p=1.0, seed=seed, **to_the_end)
        return sum(len(c.response_ids) for g in groups for c in g), time.perf_counter() - start

    def multi(seed: int) -> tuple[int, float]:
        start = time.perf_counter()
        groups = run_episodes(engine, envs, chat, rows, lambda row: [{"role": "user", "content": row["prompt"]}],
                              args.group_size, limits, seed, ignore_eos=True)
        seconds = time.perf_counter() - start
        assert all(e.turns == args.turns and not e.truncated for g in groups for e in g)
        return sum(sum(e.response_mask) for g in groups for e in g), seconds

    single(0), multi(0)  # warm-up (CUDA graphs, prefix cache), not reported
    runs = {"single": [single(1 + r) for r in range(args.rounds)], "multi": [multi(1 + r) for r in range(args.rounds)]}
    envs.close()
    rate = {k: statistics.median(tokens / seconds for tokens, seconds in v) for k, v in runs.items()}
    result = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "prompts": args.num_prompts,
              "group_size": args.group_size, "new_tokens": args.new_tokens, "turns": args.turns,
              "tokens_per_turn": per_turn, "single_tokens_per_s": rate["single"], "multi_tokens_per_s": rate["multi"],
              "multi_over_single": rate["multi"] / rate["single"],
              "rounds": {k: [{"tokens": t, "seconds": s} for t, s in v] for k, v in runs.items()},
              "torch": torch.__version__}
    print(result)
    if args.out and rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(__import__("json").dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
