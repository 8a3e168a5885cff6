"""What the python tool's bubblewrap sandbox (issue 55) costs, against the sandbox before it, in the same run.

Per call: a `print(1)` round trip and a 50 ms computation (50 ms of CPU time), before and after alternating, so a
machine whose load changes affects both alike; the median, the 90th percentile and calls per second of one worker.
Rollouts: multi-turn episodes through the real path (`EnvWorkers` -> `ToolEnv` -> `python`) with no model: each
episode makes `--turns` python calls and answers; episodes per second with `--workers` environment processes. With
no generation to hide it, this is the worst case for the ratio (a real rollout also waits on the model).

    python benchmarks/bench_sandbox.py --calls 60 --episodes 40 --out benchmarks/results/sandbox_cpu.json

The sandbox before is read from git (`--before`, the commit before issue 55's change) and loaded as a tools file.
With a model generating between the calls: `benchmarks/bench_episodes.py --python-tool` (this file's ForcedPython
environment, the same before and after, in the same run).
"""

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.rollout.environments import TOOL_CALL, EnvWorkers, ToolEnv  # noqa: E402
from common.rollout.reward_fns import load_reward_fn  # noqa: E402
from common.rollout.tools import load_tools, run_sandboxed  # noqa: E402

COMPUTE_50MS = ("import time\nstart = time.process_time()\nwhile time.process_time() - start < 0.05:\n    pass\n"
                "print(1)\n")
SNIPPET = "print(sum(range(1000)))"  # what each python call of a rollout runs
PYTHON_CALL = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": SNIPPET}}) + "</tool_call>"


def tools_before(commit: str, directory: str) -> tuple[str, types.ModuleType]:
    """The python tool as it was at `commit`: a tools file (its `python` only) and the module, to time directly.
    commit may also be the path of that commit's common/rollout/tools.py, for a checkout without git history
    (`git show c93a5b4:common/rollout/tools.py > tools_c93a5b4.py` where there is one)."""
    source = Path(commit).read_text() if Path(commit).is_file() else subprocess.run(
        ["git", "show", f"{commit}:common/rollout/tools.py"], cwd=ROOT, check=True, capture_output=True,
        text=True).stdout
    header = source[:source.index("# ---")]  # imports and constants
    body = source[source.index("CLONE_NEWUSER"):source.index("def check_sandbox")]
    text = (header + body).replace("def run_sandboxed(", "def _run_sandboxed(").replace(
        "= run_sandboxed(", "= _run_sandboxed(")
    path = os.path.join(directory, "tools_before.py")
    Path(path).write_text(text)
    module = types.ModuleType("tools_before")
    exec(compile(text, path, "exec"), module.__dict__)
    return path, module


def time_calls(runs: dict, code: str, calls: int) -> dict:
    seconds = {name: [] for name in runs}
    for _ in range(calls):
        for name, run in runs.items():  # alternating: the same load for both
            start = time.perf_counter()
            status, output = run(code)
            seconds[name].append(time.perf_counter() - start)
            assert status == 0 and output.strip() == "1", (name, status, output)
    result = {}
    for name, values in seconds.items():
        values.sort()
        result[name] = {"median_ms": round(1000 * statistics.median(values), 1),
                        "p90_ms": round(1000 * values[int(0.9 * len(values))], 1),
                        "calls_per_s": round(len(values) / sum(values), 1)}
    result["added_ms"] = round(result["after"]["median_ms"] - result["before"]["median_ms"], 1)
    return result


def episodes_per_second(tools: str, episodes: int, turns: int, workers: int) -> float:
    env = EnvWorkers(None, tools, "none", timeout_s=120, workers=workers)
    try:
        start = time.perf_counter()
        turn = {}
        for key in range(episodes):
            env.reset(key, {"prompt": "", "answer": "499500"}, f"episode {key}")
        while env.pending():
            for key, value, _ in env.results(block=True):
                assert value is not None, "a call ran past its time"
                turn[key] = turn.get(key, -1) + 1
                if turn[key] < turns:
                    env.step(key, PYTHON_CALL)
                elif turn[key] == turns:
                    env.step(key, "499500")
        return episodes / (time.perf_counter() - start)
    finally:
        env.close()


class ForcedPython:
    """An episode of row["turns"] turns whose every turn but the last makes exactly one python call through the
    real tool path (`ToolEnv` -> `python` -> the sandbox), whatever the model wrote: PYTHON_CALL is appended to the
    turn's text, and calls of the model's own are taken out. The last turn is the answer (ToolEnv scores it).
    row["tools"]: "python" (the sandbox now) or the tools file of tools_before (the sandbox before). The tool is
    offered to the model as `--tools python` offers it (the same schema before and after)."""

    def __init__(self, row: dict):
        self.env = ToolEnv(row, tools_of(row["tools"]), load_reward_fn("none"))
        self.tools, self.turns, self.seen = self.env.tools, int(row["turns"]), 0

    def step(self, reply: str):
        self.seen += 1
        reply = TOOL_CALL.sub("", reply)
        return self.env.step(reply if self.seen >= self.turns else reply + PYTHON_CALL)


@functools.cache
def tools_of(spec: str) -> list:
    return load_tools(spec)  # once per process: the before file is executed on loading


def make_forced_python_env(row: dict) -> ForcedPython:
    return ForcedPython(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60, help="calls of each kind, before and after each")
    parser.add_argument("--episodes", type=int, default=40)
    parser.add_argument("--turns", type=int, default=3, help="python calls per episode")
    parser.add_argument("--workers", type=int, default=2, help="environment processes")
    parser.add_argument("--rounds", type=int, default=3, help="rollout measurements of each, alternating")
    parser.add_argument("--before", default="c93a5b4", help="a commit with the sandbox before issue 55, or its "
                        "common/rollout/tools.py")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        path, before = tools_before(args.before, directory)
        runs = {"before": before._run_sandboxed, "after": run_sandboxed}
        for run in runs.values():  # warm the page cache
            run("print(1)")
        result = {"machine": f"{platform.node()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start",
                  "user": "root" if os.geteuid() == 0 else "unprivileged",
                  "print(1)": time_calls(runs, "print(1)", args.calls),
                  "compute 50 ms": time_calls(runs, COMPUTE_50MS, args.calls)}
        rates = {"before": [], "after": []}
        for _ in range(args.rounds):
            rates["before"].append(episodes_per_second(path, args.episodes, args.turns, args.workers))
            rates["after"].append(episodes_per_second("python", args.episodes, args.turns, args.workers))
        result["rollout"] = {"episodes": args.episodes, "python calls per episode": args.turns,
                             "workers": args.workers,
                             **{f"{k}_episodes_per_s": round(statistics.median(v), 2) for k, v in rates.items()},
                             "after_over_before": round(statistics.median(rates["after"])
                                                        / statistics.median(rates["before"]), 3)}
        result["load at end"] = round(os.getloadavg()[0], 1)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
