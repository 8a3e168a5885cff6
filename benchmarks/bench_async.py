"""Step time of synchronous colocated GRPO against async split placement on the same GPUs, in one run.

Runs grpo.py on a random-weight model of the chosen shape with the same prompts, lengths, reward and steps:
  colocated:        every GPU trains (FSDP2) and generates (vLLM, one replica per GPU), one phase after the
                    other; each prompt's responses are scored in reward processes as soon as they are complete,
                    while the rest still generate (the default);
  split_async:      half the GPUs generate (--rollout-ranks), the other half train, the rollout one step ahead
                    (--async-rollout).
The reward runs math-verify (parse and verify of a \\boxed{} expression made from a hash of the response, plus
the hash's parity so that every group has a spread of rewards and every step trains), which costs what verifying
one math answer costs.
Reads the runs' metrics.jsonl and reports, over steps 2 .. steps-2, the median step time, generation, reward and
training seconds, the throughput ratios, and for split the overlap efficiency max(generation, training) / step
time (1.0: the step is as long as its longer phase, perfect overlap). Step 1 is warm-up; in split placement the
last step that pushes weights is steps-2 (no batch needs version steps-1), so steps-1 would not wait for the
rollout ranks and its wait would land in the final step, which also saves.

    python benchmarks/bench_async.py --gpus 2 --shape 0.5b --out benchmarks/results/async_0.5b_2gpu.json
    python benchmarks/bench_async.py --gpus 2 --shape 0.5b --runs colocated  # some of the runs
    python benchmarks/bench_async.py --gpus 2 --shape 0.5b --report-only --steps 6 --work DIR  # re-read finished runs
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench_sync import report  # same folder

ROOT = Path(__file__).resolve().parents[1]

REWARD = """import zlib
from common.rollout.reward_fns import math_reward

def reward(prompt, completion, answer):
    h = zlib.crc32(completion.encode())
    expression = f"\\\\boxed{{\\\\frac{{{h % 97 + 1}}}{{{h % 89 + 2}}} + {h % 13}}}"
    return math_reward(prompt, expression, "\\\\frac{1}{2}") + h % 2
"""
RUNS = {
    "colocated": ["--rollout-gpu-memory", "0.4"],
    "split_async": ["--async-rollout", "--rollout-gpu-memory", "0.85"],  # + --rollout-ranks gpus/2
}


def run(name: str, gpus: int, extra: list[str], args, work: Path) -> None:
    out = work / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
           str(ROOT / "grpo.py"), "--model", str(work / "model"), "--reward-fn", f"{work / 'reward.py'}:reward", "--skip-reward-check",
           "--lr", "1e-5", "--steps", str(args.steps), "--eval-every", "0", "--eval-size", str(args.eval_size),
           "--max-response-len", str(args.response_len), "--prompts-per-step", str(args.prompts),
           "--group-size", str(args.group_size), "--save-state-every", "0", "--resume", "none", "--overwrite",
           "--rollout-engine", "vllm", "--output-dir", str(out), *extra]
    print(" ".join(cmd), flush=True)
    with open(work / f"{name}.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)


def measured_rows(out: Path, steps: int) -> list[dict]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r for r in rows if "time/step" in r and 2 <= r["step"] <= steps - 2]


def median(rows: list[dict], *keys: str) -> float:
    return statistics.median(sum(r.get(k, 0.0) for k in keys) for r in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--shape", default="0.5b")
    parser.add_argument("--steps", type=int, default=7, help="steps per run; 2 .. steps-2 are measured")
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=1024, help="the cap on response lengths")
    parser.add_argument("--stop-every", type=int, default=200,
                        help="random_model.py --stop-every: responses end after ~N tokens (geometric, long-tailed); "
                             "0: every response runs to --response-len")
    parser.add_argument("--eval-size", type=int, default=32)
    parser.add_argument("--work", default=None, help="scratch folder (default: one per shape and GPU count)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per grpo.py run")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS),
                        help="which runs to make (the report reads every run found in the scratch folder)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--report-only", action="store_true", help="read the metrics of runs already in --work")
    args = parser.parse_args()
    if args.steps < 4:
        raise SystemExit("--steps must be at least 4: steps 2 .. steps-2 are measured")

    work = Path(args.work or f"/tmp/nanorl_bench_async_{args.shape}_{args.gpus}gpu")
    work.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        (work / "reward.py").write_text(REWARD)
        if not (work / "model" / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "scripts/random_model.py"), "--shape", args.shape, "--out",
                            str(work / "model"), "--stop-every", str(args.stop_every)], check=True)
        for name in args.runs:
            extra = RUNS[name] + (["--rollout-ranks", str(args.gpus // 2)] if name == "split_async" else [])
            run(name, args.gpus, extra, args, work)
    rows = {name: measured_rows(work / name, args.steps) for name in RUNS if (work / name / "metrics.jsonl").exists()}
    # Training = the trainer's compute (old log-probs, update); the weight sync is reported apart, since in split
    # placement it also holds the wait for the rollout ranks to take the new weights.
    train_keys = ("time/logprobs", "time/update")
    any_rows = next(iter(rows.values()))
    result = {
        "shape": args.shape, "gpus": args.gpus, "steps_measured": len(any_rows), "prompts": args.prompts,
        "group_size": args.group_size, "response_len": args.response_len, "stop_every": args.stop_every,
        "response_len_mean": statistics.mean(r["response/length_mean"] for r in any_rows),
        "response_truncated_frac": statistics.mean(r["response/truncated_frac"] for r in any_rows),
    }
    if "colocated" in rows:
        c = rows["colocated"]
        result["colocated"] = {"step_s": median(c, "time/step"), "generate_s": median(c, "time/rollout"),
                               "reward_s": median(c, "time/reward"), "train_s": median(c, *train_keys),
                               "sync_s": median(c, "time/sync")}
    if "split_async" in rows:
        split = rows["split_async"]
        s = result["split_async"] = {
            "step_s": median(split, "time/step"), "generate_s": median(split, "time/rollout_generate"),
            "reward_s": median(split, "time/rollout_reward"), "train_s": median(split, *train_keys),
            "sync_s": median(split, "time/sync"), "wait_s": median(split, "time/rollout_wait"),
            "staleness_mean": statistics.mean(r["rollout/staleness_mean"] for r in split),
            # grpo.py leaves the TIS statistics out of a step where no group had signal
            "tis_weight_mean": statistics.mean(r["tis/weight_mean"] for r in split if "tis/weight_mean" in r)}
        s["overlap_efficiency"] = max(s["generate_s"] + s["reward_s"], s["train_s"]) / s["step_s"]
        if "colocated" in rows:
            result["split_over_colocated_throughput"] = result["colocated"]["step_s"] / s["step_s"]
    result["per_step"] = {name: [{k: r[k] for k in r if k.startswith(("time/", "perf/"))} for r in rows[name]]
                          for name in rows}
    report(result, args.out)


if __name__ == "__main__":
    main()
