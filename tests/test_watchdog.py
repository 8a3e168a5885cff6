"""A hang ends (common/run/watchdog.py): a rank stuck where the others cannot follow, and the run stops by itself with
every rank's Python stack on disk and one line that says where each rank is."""

import re
import threading
import time

from test_grpo_e2e import TINY, torchrun


def hung_run(tmp_path, point: str, steps: int):
    """The tiny task with --hang-timeout 10 and rank 1 stuck at crash point `point` ("stage:step"): the run must exit
    non-zero with one hang line; (that line, the run's directory)."""
    out = tmp_path / "run"
    result = torchrun([*TINY, "--steps", str(steps), "--hang-timeout", "10", "--output-dir", str(out)], tmp_path,
                      env={"NANORL_TEST_CRASH": f"{point}:rank=1:hang"})
    assert result.returncode != 0
    [line] = [line for line in (result.stdout + result.stderr).splitlines() if "hang:" in line]
    return line, out


def test_a_hung_rank_ends_the_run_with_its_stack(tmp_path):
    """Rank 1 hangs as it starts step 2's log-probs; rank 0 goes on into the update and waits there for it. After
    --hang-timeout both write their stacks, one line names the stage, the step and where the other rank is, and
    the run exits non-zero (for torchrun --max-restarts or Slurm to restart it)."""
    line, out = hung_run(tmp_path, "logprobs:2", steps=3)
    assert re.search(r"error: hang: rank (\d) made no progress for 10 s \(--hang-timeout\) in stage '(update|logprobs)'"
                     r" of step 2; rank (\d) is in stage '(update|logprobs)' of step 2", line), line
    stacks = {rank: (out / "hangs" / f"rank{rank}.txt").read_text() for rank in (0, 1)}
    assert "crash_point" in stacks[1] and "logprobs" in stacks[1].splitlines()[0]  # where it hangs
    assert "update_policy" in stacks[0]  # waiting for rank 1 in the update's collectives


def test_a_hang_in_the_first_evaluation_ends_the_run(tmp_path):
    """Before the loop, step 0's stages are watched too: rank 1 stuck in the evaluation of the initial weights (where
    a tensor-parallel vLLM engine once hung for good) ends the run after --hang-timeout, naming stage 'eval' of step
    0, as a hang in any later step would."""
    line, out = hung_run(tmp_path, "eval:0", steps=2)
    assert re.search(r"error: hang: rank \d made no progress for 10 s \(--hang-timeout\) in stage 'eval' of step 0",
                     line), line
    assert "crash_point" in (out / "hangs" / "rank1.txt").read_text()


def test_trainers_wait_for_a_slow_rollout_start_without_a_false_hang(tmp_path):
    """Split placement: the rollout rank starts its engine (here held at its start-up, a hand-shake, for twice
    --hang-timeout) while both trainers wait, unwatched; only then do step 0's watched stages (the first weight sync)
    begin. The run ends normally."""
    gate = tmp_path / "gate"

    def release():  # once the rollout rank is held, let it go after two timeouts (longer is as good)
        while not (tmp_path / "gate.reached").exists():
            time.sleep(0.1)
        time.sleep(20)
        gate.touch()

    threading.Thread(target=release, daemon=True).start()
    out = tmp_path / "run"
    result = torchrun([*TINY, "--steps", "2", "--hang-timeout", "10", "--rollout-ranks", "1", "--output-dir", str(out)],
                      tmp_path, nproc=3, env={"NANORL_TEST_CRASH": f"start-up:0:rank=2:until={gate}"})
    assert gate.exists()  # it was held
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "hang:" not in output, output[-3000:]
