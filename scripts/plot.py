"""Learning curves of one or more runs, from their metrics.jsonl, as one PNG: runs overlaid, each named.

    python scripts/plot.py runs/grpo_builtin_s1_79fe65 runs/ppo_builtin_s1_de18e9 --out curves.png
    python scripts/plot.py a/metrics.jsonl b/metrics.jsonl --names GRPO PPO --metrics reward/mean eval/accuracy

Each panel is one metric over the step: by default the training reward, held-out greedy accuracy, response length
and step time, and any of those a run does not log is left out for that run (DPO logs its held-out preference
accuracy instead of a reward: name the metrics you want with --metrics). Held-out evaluations of split placement,
which reach the log a step or two after the weights they evaluate, are drawn at their weights' version.
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT_METRICS = ("reward/mean", "eval/accuracy", "response/length_mean", "time/step")
TITLES = {"reward/mean": "training reward", "eval/accuracy": "held-out greedy accuracy",
          "response/length_mean": "response length (tokens)", "time/step": "seconds per step",
          "eval/preference_accuracy": "held-out preference accuracy", "loss/preference": "preference loss",
          "critic/explained_variance": "critic explained variance", "reward/accuracy": "training accuracy",
          "episode/tool_calls_mean": "tool calls per episode", "episode/turns_mean": "turns per episode"}


def read_curves(path: str, metrics: list[str]) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} from a run directory or its metrics.jsonl (rows of steps with the metric)."""
    path = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(path):
        raise SystemExit(f"error: no metrics.jsonl at {path}")
    curves = {metric: [] for metric in metrics}
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line a killed run left half written
            for metric in metrics:
                if metric in row:
                    step = row.get("eval/version", row["step"]) if metric.startswith("eval/") else row["step"]
                    curves[metric].append((step, row[metric]))
    return {metric: sorted(points) for metric, points in curves.items()}


def plot(runs: list[str], names: list[str], metrics: list[str], out: str) -> None:
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.4), squeeze=False)
    for index, (run, name) in enumerate(zip(runs, names)):
        curves = read_curves(run, metrics)
        for ax, metric in zip(axes[0], metrics):
            if curves[metric]:
                steps, values = zip(*curves[metric])
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=name,
                        color=f"C{index}")  # one color per run in every panel
    for ax, metric in zip(axes[0], metrics):
        ax.set_title(TITLES.get(metric, metric))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}: {len(runs)} run(s), {', '.join(metrics)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    parser.add_argument("--names", nargs="*", help="one legend name per run (default: the run directory's name)")
    parser.add_argument("--metrics", nargs="*", default=list(DEFAULT_METRICS), help="the metrics to draw, a panel each")
    parser.add_argument("--out", default="curves.png", help="the PNG to write")
    args = parser.parse_args()
    names = args.names or [os.path.basename(os.path.normpath(r if os.path.isdir(r) else os.path.dirname(r) or "."))
                           for r in args.runs]
    if len(names) != len(args.runs):
        raise SystemExit(f"error: {len(args.runs)} runs but {len(names)} --names")
    plot(args.runs, names, args.metrics, args.out)


if __name__ == "__main__":
    main()
