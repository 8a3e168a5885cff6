"""Ablations: one training script under several variants of its flags and several seeds, a few runs at a time on one
GPU, and a table of what each variant learned (training reward over the last steps, held-out accuracy), averaged
over the seeds.

    python scripts/ablate.py --out OUT --seeds 1 2 --parallel 6 \\
        --base "grpo.py --model /tmp/smollm2 --dataset addition.jsonl --prompt-key question --steps 30 ..." \\
        --variant base= --variant all-tokens="--loss-agg all-token-mean" --variant beta2="--adam-beta2 0.999"

Runs that share a GPU slow each other down, so compare learning here, not step times (bench_vs_trl.py times a run
alone). A run whose start-up fails before its first step (vLLM measures free memory at start, and a neighbour can
disturb that) is tried once more. With --deadline the runs still going are stopped with SIGTERM (they finish the
step, save and exit) and the table covers the steps they reached. OUT/summary.json holds the table and each run's
curves; `scripts/plot.py OUT/*_s1` overlays them.
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the script and the flags every run shares (no --seed or --output-dir)")
    p.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                   help="a variant: its name and the flags it adds (repeat; 'base=' adds none)")
    p.add_argument("--out", required=True, help="directory for the runs (NAME_sSEED), their logs and summary.json")
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--parallel", type=int, default=4, help="runs at a time")
    p.add_argument("--stagger", type=float, default=20.0, help="seconds between two starts")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which running runs are stopped")
    p.add_argument("--last", type=int, default=10, help="the training reward is averaged over this many last steps")
    p.add_argument("--nproc", action="append", default=[], metavar="NAME=N",
                   help="processes (GPUs) of a variant's runs, e.g. split placement's async=2 (default 1)")
    p.add_argument("--gpus", default=None, help="GPUs to share out, e.g. 0,1: each one-process run gets the next one "
                   "in turn, a run of N processes the first N (default: what CUDA_VISIBLE_DEVICES gives)")
    args = p.parse_args(argv)
    args.variants = dict(v.split("=", 1) if "=" in v else (v, "") for v in args.variant)
    if len(args.variants) != len(args.variant):
        p.error("two --variant share a name")
    try:
        args.nproc = {name: int(n) for name, n in (v.split("=", 1) for v in args.nproc)}
    except ValueError:
        p.error(f"--nproc takes NAME=N, got {args.nproc}")
    if set(args.nproc) - set(args.variants):
        p.error(f"--nproc names no variant: {sorted(set(args.nproc) - set(args.variants))}")
    return args


def read_metrics(path: str) -> list[dict]:
    """The rows of a run directory's metrics.jsonl."""
    with open(os.path.join(path, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_summary(rows: list[dict], last: int) -> dict:
    """A run's reward over its last `last` steps, its held-out accuracy first and last, and the steps it reached."""
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"steps": max((r["step"] for r in rows), default=0),
            "reward_last": statistics.mean(rewards[-last:]) if rewards else None,
            "eval_first": evals[0][1] if evals else None, "eval_last": evals[-1][1] if len(evals) > 1 else None,
            "eval_curve": evals, "reward_curve": rewards}


def table(runs: dict[str, dict], variants: list[str], seeds: list[int]) -> list[dict]:
    """One row per variant: the seeds' mean of each figure, and the figures per seed."""
    rows = []
    for name in variants:
        got = [runs[f"{name}_s{s}"] for s in seeds if f"{name}_s{s}" in runs]
        row = {"variant": name, "seeds": len(got)}
        for key in ("reward_last", "eval_first", "eval_last", "steps"):
            values = [g[key] for g in got if g[key] is not None]
            row[key] = statistics.mean(values) if values else None
            row[f"{key}_per_seed"] = [g[key] for g in got]
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    base = shlex.split(args.base)
    jobs = [(name, seed) for seed in args.seeds for name in args.variants]  # seed-major: a cut batch has whole seeds
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    pending, running, tries, start = list(jobs), {}, {}, time.time()

    gpus, launched = args.gpus.split(",") if args.gpus else None, 0

    def launch(name: str, seed: int) -> None:
        nonlocal launched
        run_dir, nproc = os.path.join(args.out, f"{name}_s{seed}"), args.nproc.get(name, 1)
        # --standalone: torchrun takes a free port, so runs here and anything else on the machine never collide
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                   os.path.join(ROOT, base[0]),
                   *base[1:], *shlex.split(args.variants[name]), "--seed", str(seed), "--output-dir", run_dir,
                   "--resume", "none", "--overwrite"]
        run_env = dict(env)
        if gpus:
            run_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[:nproc] if nproc > 1 else [gpus[launched % len(gpus)]])
            launched += nproc == 1
        tries[(name, seed)] = tries.get((name, seed), 0) + 1
        log = open(os.path.join(args.out, f"{name}_s{seed}.log"), "a")
        print(f"start {name} seed {seed} (try {tries[(name, seed)]}, GPUs {run_env.get('CUDA_VISIBLE_DEVICES', '-')}): "
              f"{shlex.join(command)}", flush=True)
        running[(name, seed)] = subprocess.Popen(command, env=run_env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    last_start, stopping = 0.0, False
    while pending or running:
        if args.deadline and not stopping and time.time() - start > args.deadline:
            stopping, pending = True, []
            print(f"deadline: stopping {len(running)} runs", flush=True)
            for proc in running.values():
                proc.send_signal(signal.SIGTERM)
        for job, proc in list(running.items()):
            if proc.poll() is None:
                continue
            del running[job]
            rows = os.path.join(args.out, f"{job[0]}_s{job[1]}", "metrics.jsonl")
            started = os.path.exists(rows) and any(r["step"] > 0 for r in read_metrics(os.path.dirname(rows)))
            print(f"end {job[0]} seed {job[1]}: exit {proc.returncode}", flush=True)
            if proc.returncode != 0 and not started and tries[job] < 2 and not stopping:
                pending.insert(0, job)  # failed before its first step: once more
        if pending and len(running) < args.parallel and time.time() - last_start >= args.stagger:
            launch(*pending.pop(0))
            last_start = time.time()
        time.sleep(1)

    runs = {}
    for name, seed in jobs:
        path = os.path.join(args.out, f"{name}_s{seed}")
        if os.path.exists(os.path.join(path, "metrics.jsonl")):
            runs[f"{name}_s{seed}"] = run_summary(read_metrics(path), args.last)
    rows = table(runs, list(args.variants), args.seeds)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"base": args.base, "variants": args.variants, "seeds": args.seeds, "table": rows, "runs": runs}, f,
                  indent=1)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"| variant | seeds | reward, mean of the last {args.last} steps | held-out accuracy first -> last | steps |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} ({args.variants[r['variant']] or 'no flags'}) | {r['seeds']} | {fmt(r['reward_last'])} "
              f"({', '.join(fmt(v) for v in r['reward_last_per_seed'])}) | {fmt(r['eval_first'])} -> "
              f"{fmt(r['eval_last'])} ({', '.join(fmt(v) for v in r['eval_last_per_seed'])}) | {fmt(r['steps'])} |")


if __name__ == "__main__":
    main()
