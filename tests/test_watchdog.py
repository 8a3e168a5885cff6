"""A hang ends (common/run/watchdog.py): a rank stuck where the others cannot follow, and the run stops by itself with
every rank's Python stack on disk and one line that says where each rank is."""

import re

from test_grpo_e2e import TINY, torchrun


def test_a_hung_rank_ends_the_run_with_its_stack(tmp_path):
    """Rank 1 hangs as it starts step 2's log-probs; rank 0 goes on into the update and waits there for it. After
    --hang-timeout both write their stacks, one line names the stage, the step and where the other rank is, and
    the run exits non-zero (for torchrun --max-restarts or Slurm to restart it)."""
    out = tmp_path / "run"
    result = torchrun([*TINY, "--steps", "3", "--hang-timeout", "10", "--output-dir", str(out)], tmp_path,
                      env={"NANORL_TEST_CRASH": "logprobs:2:rank=1:hang"})
    output = result.stdout + result.stderr
    assert result.returncode != 0
    [line] = [line for line in output.splitlines() if "hang:" in line]
    assert re.search(r"error: hang: rank (\d) made no progress for 10 s \(--hang-timeout\) in stage '(update|logprobs)'"
                     r" of step 2; rank (\d) is in stage '(update|logprobs)' of step 2", line), line
    stacks = {rank: (out / "hangs" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert "crash_point" in stacks[1] and "logprobs" in stacks[1].splitlines()[0]  # where it hangs
    assert "update_policy" in stacks[0]  # waiting for rank 1 in the update's collectives


def test_a_hang_in_the_first_evaluation_ends_the_run(tmp_path):
    """Before the loop, step 0's stages are watched too: rank 1 stuck in the evaluation of the initial weights (where
    a tensor-parallel vLLM engine once hung for good) ends the run after --hang-timeout, naming stage 'eval' of step
    0, as a hang in any later step would."""
    out = tmp_path / "run"
    result = torchrun([*TINY, "--steps", "2", "--hang-timeout", "10", "--output-dir", str(out)], tmp_path,
                      env={"NANORL_TEST_CRASH": "eval:0:rank=1:hang"})
    output = result.stdout + result.stderr
    assert result.returncode != 0
    [line] = [line for line in output.splitlines() if "hang:" in line]
    assert re.search(r"error: hang: rank \d made no progress for 10 s \(--hang-timeout\) in stage 'eval' of step 0",
                     line), line
    assert "crash_point" in (out / "hangs" / "rank1.txt").read_text()
