"""Multi-turn episodes end to end (2 gloo ranks, the built-in tiny model): the default --env lookup run learns to
call its tool; every script and placement runs episodes; a run with an environment resumes exactly; a stuck
environment is stopped and counted, a crashing one stops the run with one line naming the sample and the turn."""

import json
import re

import pytest

from test_grpo_e2e import ROOT, assert_one_line_error, metric_rows, torchrun

TINY = ["--steps", "3", "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8", "--eval-every", "0"]

ENV_FILE = '''
import time

class Env:
    """Asks for one more number; {trigger}."""
    def __init__(self, row):
        self.row, self.turns = row, 0

    def step(self, reply):
        self.turns += 1
        {action}
        if self.turns == 1:
            return [{{"role": "user", "content": "again"}}], 0.0, False
        return [], float(self.row["answer"] in reply), True

def make_env(row):
    return Env(row)
'''


def test_default_lookup_run_learns_to_call_its_tool(tmp_path):
    """`torchrun --nproc_per_node 2 grpo.py --env lookup`: the largest number is hidden, so only the lookup gives it
    away: held-out greedy accuracy from a guess (below 0.2) to at least 0.8, with about one call per episode."""
    result = torchrun(["--env", "lookup", "--output-dir", str(tmp_path / "run")], tmp_path, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    before, after = map(float, re.search(r"held-out greedy accuracy: ([\d.]+) before training -> ([\d.]+) after",
                                         output).groups())
    assert before < 0.2 and after >= 0.8, (before, after)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "episode/tool_calls_mean" in r][-1]
    assert last["episode/tool_calls_mean"] > 0.8 and last["episode/turns_mean"] > 1.8


@pytest.mark.parametrize("script, flags", [
    ("grpo.py", ["--rollout-ranks", "1", "--prompts-per-step", "2"]),
    ("grpo.py", ["--rollout-ranks", "1", "--async-rollout", "--prompts-per-step", "2"]),
    ("ppo.py", []),
    ("dpo.py", ["--online"]),
], ids=["grpo-split", "grpo-async", "ppo", "dpo-online"])
def test_episodes_in_every_script_and_placement(tmp_path, script, flags):
    args = [*TINY, *flags, "--env", "lookup", "--output-dir", str(tmp_path / "run")]
    if script == "dpo.py":
        args = [a for a in args if a not in ("--eval-every", "0")][:-2] + ["--output-dir", str(tmp_path / "run")]
    result = torchrun(args, tmp_path, script=script)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 3 and all(1 <= r["episode/turns_mean"] <= 4 for r in steps)


def test_a_run_with_an_environment_resumes_exactly(tmp_path):
    """Killed after step 4's row was written (before its state), resumed: every row once and equal to an
    uninterrupted run's (episodes are not resumed: a step is the unit)."""
    args = ["--steps", "6", "--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8", "--eval-every", "3",
            "--save-state-every", "2", "--keep-checkpoints", "0", "--env", "lookup"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert torchrun([*args, "--output-dir", str(whole)], tmp_path).returncode == 0
    crashed = torchrun([*args, "--output-dir", str(killed)], tmp_path, env={"NANORL_TEST_CRASH": "after_row:4"})
    assert crashed.returncode != 0
    result = torchrun([*args, "--output-dir", str(killed)], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    got, expected = metric_rows(killed), metric_rows(whole)
    assert [row["step"] for row in got] == list(range(7)) and got == expected


def test_a_stuck_environment_is_stopped_and_counted(tmp_path):
    """An environment stuck on some rows' second turn: each such call is killed after --env-timeout, its episode
    ends with reward 0, the run goes on and counts them."""
    (tmp_path / "env.py").write_text(ENV_FILE.format(
        trigger="stuck forever on the second turn of rows whose answer is even",
        action='if self.turns == 2 and int(self.row["answer"]) % 2 == 0:\n            time.sleep(10**6)'))
    result = torchrun([*TINY, "--steps", "2", "--env", "env.py:make_env", "--env-timeout", "1",
                       "--max-response-len", "4", "--max-turn-len", "1", "--output-dir", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("episode/env_timeouts", 0) for r in rows) > 0


def test_a_crashing_environment_stops_the_run_naming_sample_and_turn(tmp_path):
    (tmp_path / "env.py").write_text(ENV_FILE.format(
        trigger="raises on the second turn", action='if self.turns == 2:\n            raise ValueError("broken env")'))
    result = torchrun([*TINY, "--env", "env.py:make_env", "--max-response-len", "4", "--max-turn-len", "1",
                       "--output-dir", str(tmp_path / "run")], tmp_path)
    assert_one_line_error(result, "ValueError: broken env")
    assert re.search(r"the environment raised on sample \d+ of prompt \d+ \('max [\d ]+ ='\), turn 2: ValueError: "
                     r"broken env \(env.py:\d+\)", result.stdout + result.stderr)


def test_the_docs_environment_runs_as_written(tmp_path):
    """docs/agents.md's complete environment (guess the number), copied from it, trains on the built-in task."""
    page = open(f"{ROOT}/docs/agents.md").read()
    code = page.split("a complete one:\n\n```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "guess.py").write_text(code)
    result = torchrun([*TINY, "--env", "guess.py:make_env", "--max-turns", "3", "--max-response-len", "6",
                       "--output-dir", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("episode/turns_mean", 0) > 1 for r in rows)
