"""Restarted without a human: `torchrun --max-restarts N` starts every worker again when one dies, and the run
continues from its newest state (common/run/distributed.py's per-attempt store, --resume auto); a failure that repeats
at the same step is shown once. Through torchrun itself, on CPU."""

import json
import os
import subprocess
import sys

import pytest

from test_grpo_e2e import ROOT, TINY
from test_split import read_metrics


pytestmark = pytest.mark.faults


def torchrun_with_restarts(args: list[str], cwd, nproc: int, restarts: int, crash: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
           "NANORL_TEST_CRASH": crash}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max-restarts", str(restarts), os.path.join(ROOT, "grpo.py"), *args]
    return subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=400)


def test_a_killed_rank_is_restarted_and_the_run_continues(tmp_path):
    """kill -9 of the rollout rank of a split run as it starts batch 4 (which it does only after state 2 was saved):
    torchrun restarts every worker, which resume from state 2 by themselves; every step's row is there once, and the
    W&B run goes on under the same id. (Colocated, tests/test_slurm.py kills a trainer under torchrun in a job.)"""
    out = tmp_path / "run"
    result = torchrun_with_restarts([*TINY, "--rollout-ranks", "1", "--steps", "4", "--save-state-every", "2",
                                     "--track", "--output-dir", str(out)], tmp_path, nproc=3, restarts=1,
                                    crash="generate:4:rank=2:once")
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"resumed from {out / 'state_000002'} at step 2" in result.stdout
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r] == [1, 2, 3, 4]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({run.name.rsplit("-", 1)[1] for run in runs}) == 1


def test_a_failure_that_repeats_is_shown_once(tmp_path):
    """A bug at step 2 on every attempt: torchrun gives up after its one restart, and the traceback is printed once,
    the restart's failure as one line saying it is the same."""
    out = tmp_path / "run"
    result = torchrun_with_restarts([*TINY, "--steps", "3", "--save-state-every", "1", "--output-dir", str(out)],
                                    tmp_path, nproc=2, restarts=1, crash="update:2:raise")
    assert result.returncode != 0
    assert result.stdout.count("RuntimeError: test crash point update at step 2") == 1, result.stdout[-4000:]
    assert result.stdout.count("failed again with the same error as before torchrun's restart 1") == 1
    assert [json.loads(line)["step"] for line in open(out / "metrics.jsonl")] == [0, 1]
