"""scripts/ablate.py: variants x seeds of a script, and the table it makes of their runs."""

import json
import statistics
import subprocess
import sys

from scripts.ablate import run_summary, table


def test_table_means_over_seeds_by_hand():
    runs = {"a_s1": run_summary([{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "reward/mean": 0.2},
                                 {"step": 2, "reward/mean": 0.4, "eval/accuracy": 0.5}], last=1),
            "a_s2": run_summary([{"step": 0, "eval/accuracy": 0.3}, {"step": 1, "reward/mean": 0.6},
                                 {"step": 2, "reward/mean": 0.8, "eval/accuracy": 0.7}], last=2)}
    assert runs["a_s1"]["reward_last"] == 0.4 and runs["a_s2"]["reward_last"] == 0.7  # the last 1 / 2 steps
    (row,) = table(runs, ["a"], [1, 2, 3])  # seed 3 never ran: left out of the means
    assert row["seeds"] == 2 and abs(row["reward_last"] - 0.55) < 1e-12 and abs(row["eval_last"] - 0.6) < 1e-12
    assert abs(row["eval_first"] - 0.2) < 1e-12 and row["eval_last_per_seed"] == [0.5, 0.7]


def test_two_variants_of_the_builtin_run(tmp_path):
    """Two runs at once on the CPU: the table holds what their metrics.jsonl say, and each variant's flags reached
    its run (its saved arguments hold it), as did its number of processes."""
    out = tmp_path / "abl"
    subprocess.run([sys.executable, "scripts/ablate.py", "--out", str(out), "--base", "grpo.py --steps 2 --eval-every 2",
                    "--variant", "base=", "--variant", "fast=--lr 1e-3", "--nproc", "fast=2", "--parallel", "2",
                    "--stagger", "0", "--last", "2"], check=True, timeout=600)
    assert "health: 1 CPU process" in (out / "base_s1.log").read_text()
    assert "health: 2 CPU processes" in (out / "fast_s1.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    for row in summary["table"]:
        rows = [json.loads(line) for line in (out / f"{row['variant']}_s1" / "metrics.jsonl").read_text().splitlines()]
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
        assert row["steps"] == 2 and row["reward_last"] == statistics.mean(rewards[-2:])
    assert json.loads((out / "fast_s1" / "run.json").read_text())["args"]["lr"] == 1e-3
    assert json.loads((out / "base_s1" / "run.json").read_text())["args"]["lr"] == 5e-4  # the built-in default
