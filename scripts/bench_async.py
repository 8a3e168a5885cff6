"""Step time of synchronous colocated GRPO against async split placement on the same GPUs, in one run.

Runs grpo.py twice on a random-weight model of the chosen shape with the same prompts, lengths and steps:
  colocated: every GPU trains (FSDP2) and generates (vLLM, one replica per GPU), one phase after the other;
  split:     half the GPUs generate (--rollout-ranks), the other half train, the rollout one step ahead
             (--async-rollout).
Reads both runs' metrics.jsonl and reports, over steps 2 .. steps-2, the median step time, generation and training
seconds, the throughput ratio, and for split the overlap efficiency max(generation, training) / step time (1.0:
the step is as long as its longer phase, perfect overlap). Step 1 is warm-up; in split placement the last step
that pushes weights is steps-2 (no batch needs version steps-1), so steps-1 would not wait for the rollout ranks
and its wait would land in the final step, which also saves.

    python scripts/bench_async.py --gpus 2 --shape 0.5b --out benchmarks/results/async_0.5b_2gpu.json
    python scripts/bench_async.py --gpus 2 --shape 0.5b --report-only --steps 6 --work DIR  # re-read a finished run
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench_sync import report  # same folder

ROOT = Path(__file__).resolve().parents[1]

REWARD = "import zlib\ndef reward(prompt, completion, answer):\n    return float(zlib.crc32(completion.encode()) % 2)\n"


def run(name: str, gpus: int, extra: list[str], args, work: Path) -> list[dict]:
    out = work / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
           str(ROOT / "grpo.py"), "--model", str(work / "model"), "--reward-fn", f"{work / 'reward.py'}:reward",
           "--lr", "1e-5", "--steps", str(args.steps), "--eval-every", "0", "--eval-size", str(args.eval_size),
           "--max-response-len", str(args.response_len), "--prompts-per-step", str(args.prompts),
           "--group-size", str(args.group_size), "--save-state-every", "0", "--resume", "none",
           "--rollout-engine", "vllm", "--output-dir", str(out), *extra]
    print(" ".join(cmd), flush=True)
    if not args.report_only:
        with open(work / f"{name}.log", "w") as log:
            subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [r for r in rows if "time/step" in r and 2 <= r["step"] <= args.steps - 2]


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
    parser.add_argument("--out", default=None)
    parser.add_argument("--report-only", action="store_true", help="read the metrics of runs already in --work")
    args = parser.parse_args()
    if args.steps < 4:
        raise SystemExit("--steps must be at least 4: steps 2 .. steps-2 are measured")

    work = Path(args.work or f"/tmp/nanorl_bench_async_{args.shape}_{args.gpus}gpu")
    work.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        (work / "reward.py").write_text(REWARD)
        subprocess.run([sys.executable, str(ROOT / "scripts/random_model.py"), "--shape", args.shape, "--out",
                        str(work / "model"), "--stop-every", str(args.stop_every)], check=True)
    colocated = run("colocated", args.gpus, ["--rollout-gpu-memory", "0.4"], args, work)
    split = run("split_async", args.gpus, ["--rollout-ranks", str(args.gpus // 2), "--async-rollout",
                                           "--rollout-gpu-memory", "0.85"], args, work)
    # Training = the trainer's compute (old log-probs, update); the weight sync is reported apart, since in split
    # placement it also holds the wait for the rollout ranks to take the new weights.
    train_keys = ("time/logprobs", "time/update")
    result = {
        "shape": args.shape, "gpus": args.gpus, "steps_measured": len(split), "prompts": args.prompts,
        "group_size": args.group_size, "response_len": args.response_len, "stop_every": args.stop_every,
        "response_len_mean": statistics.mean(r["response/length_mean"] for r in split),
        "response_truncated_frac": statistics.mean(r["response/truncated_frac"] for r in split),
        "colocated": {"step_s": median(colocated, "time/step"), "generate_s": median(colocated, "time/rollout"),
                      "reward_s": median(colocated, "time/reward"), "train_s": median(colocated, *train_keys),
                      "sync_s": median(colocated, "time/sync")},
        "split_async": {"step_s": median(split, "time/step"), "generate_s": median(split, "time/rollout_generate"),
                        "reward_s": median(split, "time/rollout_reward"), "train_s": median(split, *train_keys),
                        "sync_s": median(split, "time/sync"), "wait_s": median(split, "time/rollout_wait"),
                        "staleness_mean": statistics.mean(r["rollout/staleness_mean"] for r in split),
                        "tis_weight_mean": statistics.mean(r["tis/weight_mean"] for r in split)},
        "per_step": {"colocated": [{k: r[k] for k in r if k.startswith("time/")} for r in colocated],
                  "split_async": [{k: r[k] for k in r if k.startswith("time/")} for r in split]},
    }
    s = result["split_async"]
    s["overlap_efficiency"] = max(s["generate_s"] + s["reward_s"], s["train_s"]) / s["step_s"]
    result["split_over_colocated_throughput"] = result["colocated"]["step_s"] / s["step_s"]
    report(result, args.out)


if __name__ == "__main__":
    main()
