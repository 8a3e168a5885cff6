"""Throughput of multi-turn rollouts against single-turn rollouts of about the same tokens, one vLLM engine, one run.

Single-turn: --num-prompts prompts x --group-size responses of exactly --new-tokens tokens (ignore_eos), one
`generate`. Multi-turn: the same prompts x --group-size episodes of --turns turns of --new-tokens / --turns tokens
each, an environment (this file's `make_env`) answering every turn but the last with a short user message, streamed
through `run_turns` (common/rollout/episodes.py) with the environments in their processes, as a training step runs them.
Both count generated tokens only (not the observations); the ratio multi / single is what the multi-turn machinery
costs: the environment round trips, the observations' prefill, and turns that wait for their observation.

    torchrun --nproc_per_node 1 benchmarks/bench_episodes.py --model /tmp/smollm2 \\
        --out benchmarks/results/episodes_smollm2_1xh100.json

--python-tool: instead, the python tool's sandbox with the model in the loop (issue 55): the same episodes, each turn
but the last making one python call through the real path (`EnvWorkers` -> `ToolEnv` -> `python` -> the sandbox;
bench_sandbox.py's ForcedPython forces the call whatever the model writes), with the sandbox before issue 55 (read
from git, `--before`) and with bubblewrap, alternating round by round in one run. Both generate the same number of
tokens from the same prompts and get the same tool output (vLLM, which seeds a turn from its episode, samples the
same tokens too), so the ratio after / before is the sandbox's cost to a rollout.

    python benchmarks/bench_episodes.py --python-tool --engine hf --model /tmp/smollm2 --out sandbox_rollout.json

(on a GPU: `torchrun --nproc_per_node 1` and the vLLM engine, the default; benchmarks/README.md has the commands run).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root holds common/ and sharding/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # also where an environment process loads this file
import bench_sandbox  # noqa: E402  (same folder)
from common.rollout.engines import make_rollout_engine  # noqa: E402
from common.rollout.environments import EnvWorkers  # noqa: E402
from common.rollout.episodes import ChatFormat, run_episodes  # noqa: E402
from common.rollout.tools import check_sandbox  # noqa: E402
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
    parser.add_argument("--model", default=None, help="an HF model directory (its chat template renders turns); "
                        "none: the built-in tiny model (no template: a smoke test)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512, help="generated tokens per response / episode")
    parser.add_argument("--turns", type=int, default=4, help="turns per episode")
    parser.add_argument("--env-workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each")
    parser.add_argument("--engine", choices=["vllm", "hf"], default="vllm", help="hf: a CPU dry run of the script")
    parser.add_argument("--python-tool", action="store_true", help="the python tool's sandbox before and after "
                        "(see above) instead of single- against multi-turn")
    parser.add_argument("--before", default="c93a5b4", help="--python-tool: a commit with the sandbox before issue "
                        "55, or its common/rollout/tools.py (bench_sandbox.tools_before)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args()

    scratch = tempfile.TemporaryDirectory()  # --python-tool: the sandbox before, as a tools file
    before_file = working_sandboxes(args.before, scratch.name) if args.python_tool else None
    rank, world, device = init_distributed()
    tokenizer = load_tokenizer(args.model)
    policy = shard_model(load_model(args.model, tokenizer, 0), device, precision="bf16" if args.engine == "vllm" else "fp32")
    model_dir = save_model_config(args.model, tokenizer, "/tmp/nanorl_bench_episodes")
    engine = make_rollout_engine(args.engine, policy, model_dir, tokenizer, [], rank, 1, None, 2048, 0, False, 512,
                                 max_sequences=args.num_prompts * args.group_size)
    engine.update_weights(policy)
    chat = ChatFormat(tokenizer, use_template=getattr(tokenizer, "chat_template", None) is not None)
    prompts = [f"Tell me a long story about the number {i}." for i in range(args.num_prompts)]
    prompt_ids = [chat.opening_ids([{"role": "user", "content": p}], []) for p in prompts]
    env = f"{bench_sandbox.__file__}:make_forced_python_env" if args.python_tool else f"{__file__}:make_env"
    envs = EnvWorkers(env, None, "none", timeout_s=60, workers=args.env_workers)
    per_turn = args.new_tokens // args.turns
    limits = SimpleNamespace(max_turns=args.turns, max_turn_len=per_turn, max_prompt_len=256,
                             max_response_len=2048 - 256,
                             temperature=1.0, top_p=1.0)

    def single(seed: int) -> dict:
        start = time.perf_counter()
        to_the_end = {"ignore_eos": True} if args.engine == "vllm" else {}  # hf: the engine has no stop tokens
        groups = engine.generate(prompt_ids, n=args.group_size, max_tokens=args.new_tokens, temperature=1.0,
                                 top_p=1.0, seed=seed, **to_the_end)
        return {"tokens": sum(len(c.response_ids) for g in groups for c in g), "seconds": time.perf_counter() - start}

    def multi(rows: list[dict], seed: int, python_calls: int = 0) -> dict:
        """python_calls: each episode's tool calls (GoOn's turns end with a user message, not a tool call)."""
        start = time.perf_counter()
        groups = run_episodes(engine, envs, chat, rows, lambda row: [{"role": "user", "content": row["prompt"]}],
                              args.group_size, limits, seed, ignore_eos=True)
        seconds = time.perf_counter() - start
        episodes = [e for g in groups for e in g]
        assert all(e.turns == args.turns and not e.truncated and sum(e.response_mask) == args.turns * per_turn
                   and e.tool_calls == python_calls for e in episodes), \
            [(e.turns, e.truncated, sum(e.response_mask), e.tool_calls) for e in episodes]
        return {"episodes": len(episodes), "tokens": sum(sum(e.response_mask) for e in episodes),
                "observation_tokens": sum(len(e.response_mask) - sum(e.response_mask) for e in episodes),
                "python_calls": sum(e.tool_calls for e in episodes), "seconds": seconds,
                "tool_errors": sum(e.tool_errors for e in episodes)}  # calls that failed (counted, and shown)

    result = {"model": args.model, "engine": args.engine,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "cpus": os.cpu_count(), "load_at_start": round(os.getloadavg()[0], 2), "prompts": args.num_prompts,
              "group_size": args.group_size, "new_tokens": args.new_tokens, "turns": args.turns,
              "tokens_per_turn": per_turn, "env_workers": args.env_workers}
    if args.python_tool:
        result |= sandbox_before_vs_after(args, before_file, prompts, multi)
    else:
        rows = [{"prompt": p, "answer": str(args.turns)} for p in prompts]
        single(0), multi(rows, 0)  # warm-up (CUDA graphs, prefix cache), not reported
        runs = {"single": [single(1 + r) for r in range(args.rounds)],
                "multi": [multi(rows, 1 + r) for r in range(args.rounds)]}
        rate = {k: statistics.median(r["tokens"] / r["seconds"] for r in v) for k, v in runs.items()}
        result |= {"single_tokens_per_s": rate["single"], "multi_tokens_per_s": rate["multi"],
                   "multi_over_single": rate["multi"] / rate["single"], "rounds": runs}
    envs.close()
    scratch.cleanup()
    result |= {"load_at_end": round(os.getloadavg()[0], 2), "torch": torch.__version__}
    print(json.dumps(result, indent=2))
    if args.out and rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def working_sandboxes(commit: str, directory: str) -> str:
    """The python tool's file with the sandbox before issue 55 (bench_sandbox.tools_before), once both sandboxes
    have run a call here: one line before the engine starts where either cannot."""
    before_file, before = bench_sandbox.tools_before(commit, directory)
    check_sandbox()  # bubblewrap: names the package to install
    status, output = before._run_sandboxed("print(1)")
    if status != 0:
        raise SystemExit(f"the sandbox before ({commit}) does not run on this machine: {output.strip()[:200]}")
    return before_file


def sandbox_before_vs_after(args, before_file: str, prompts: list[str], multi) -> dict:
    """--python-tool: rounds of the same episodes with the python tool in the sandbox before issue 55 and in
    bubblewrap, alternating (and which goes first, round by round), so that a change of load hits both alike."""
    rows = {name: [{"prompt": p, "answer": "", "turns": args.turns, "tools": tools} for p in prompts]
            for name, tools in [("before", before_file), ("after", "python")]}
    calls = args.turns - 1
    for name in rows:
        multi(rows[name], 0, calls)  # warm-up (CUDA graphs, the page cache for each sandbox), not reported
    runs = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
            runs[name].append(multi(rows[name], 1 + r, calls))
    rate = {name: {"episodes_per_s": statistics.median(r["episodes"] / r["seconds"] for r in v),
                   "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in v)}
            for name, v in runs.items()}
    return {"before_commit": args.before, "forced": f"{calls} python call(s) per episode, one after each turn but "
            f"the last, each running {bench_sandbox.SNIPPET!r}; ignore_eos: every turn {args.new_tokens // args.turns} "
            "tokens", **rate,
            "after_over_before": rate["after"]["episodes_per_s"] / rate["before"]["episodes_per_s"], "rounds": runs}


if __name__ == "__main__":
    main()
