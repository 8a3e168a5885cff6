"""How busy the rollout engine was through one step's rollout, for one or more runs: the share of the rollout's
requests still running after each engine step, against seconds (from the run directory's rollout_busy.jsonl, which
rank 0, or split placement's rollout rank 0, writes for vLLM rollouts and for --partial-rollouts).

    python scripts/plot_busy.py runs/defaults runs/partial --step 3 --out busy.png

A synchronous rollout's curve falls to a long tail of a few sequences decoding alone; a partial rollout's phase
ends while most of its requests still run.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_trace(run_dir: str, step: int) -> dict:
    """The newest record of `step` in a run's rollout_busy.jsonl (a resumed run may have written the step twice)."""
    path = os.path.join(run_dir, "rollout_busy.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: no rollout_busy.jsonl in {run_dir} (written by vLLM rollouts and --partial-rollouts)")
    with open(path) as f:
        records = [r for r in (json.loads(line) for line in f if line.strip()) if r["step"] == step]
    if not records:
        raise SystemExit(f"error: {path} has no rollout of step {step}")
    return records[-1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories")
    p.add_argument("--step", type=int, default=2, help="the step whose rollout is drawn")
    p.add_argument("--names", nargs="*", help="a label per run (default: the directories' names)")
    p.add_argument("--out", default="busy.png")
    args = p.parse_args(argv)
    names = args.names or [os.path.basename(os.path.normpath(r)) for r in args.runs]
    if len(names) != len(args.runs):
        p.error(f"--names gives {len(names)} labels for {len(args.runs)} runs")
    fig, ax = plt.subplots(figsize=(7, 4))
    for run, name in zip(args.runs, names):
        trace = read_trace(run, args.step)
        seconds = [0.0] + [t for t, _ in trace["busy"]]
        running = [1.0] + [n / max(trace["requests"], 1) for _, n in trace["busy"]]
        ax.step(seconds, running, where="post", label=f"{name} ({trace['requests']} requests)")
    ax.axhline(0.1, color="grey", linestyle=":", linewidth=1)  # below it: the low-busy tail (perf/rollout_low_busy_frac)
    ax.set_xlabel("seconds into the rollout")
    ax.set_ylabel("share of requests still running")
    ax.set_title(f"rollout of step {args.step}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}: {len(args.runs)} run(s), step {args.step}")


if __name__ == "__main__":
    main()
