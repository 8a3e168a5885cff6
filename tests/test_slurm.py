"""scripts/slurm_grpo.sh under a real one-node Slurm (tests/tools/start_slurm.sh starts it; .ci/run does, as root):
a time limit's USR1 saves the step the run is on and requeues the job, which resumes; `scancel` saves the step and
the same sbatch continues; a killed training process is restarted by torchrun inside the job. Each signal reaches
the run at a step fixed by a hand-shake (a crash point that waits for the test), never after a sleep.

Run apart from the main suite (they take minutes), with the other fault tests: `python -m pytest -q -m slurm`
(or -m "faults or slurm"). Skipped, with the reason, where no Slurm can be started (not root, no packages).
"""

import json
import os
import shutil
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slurm
RUN = ["--steps", "5", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16", "--eval-every", "0",
       "--save-state-every", "100"]  # no periodic state before the end: a stop's own save is the only one


@pytest.fixture(scope="module", autouse=True)
def slurm():
    if shutil.which("sbatch") is None and os.geteuid() != 0:
        pytest.skip("no Slurm here, and only root can install and start one (tests/tools/start_slurm.sh)")
    started = subprocess.run(["bash", os.path.join(ROOT, "tests", "tools", "start_slurm.sh")], capture_output=True,
                             text=True, timeout=600)
    if started.returncode != 0:
        pytest.skip(f"could not start a one-node Slurm: {(started.stderr or started.stdout).strip()[-300:]}")


def submit(tmp_path, extra_env: dict, args: list[str] = RUN) -> str:
    env = {**os.environ, "GPUS_PER_NODE": "2", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", **extra_env}
    result = subprocess.run(["sbatch", "--parsable", "--nodes", "1", "--gpus-per-node", "0", "--cpus-per-task", "2",
                             "--chdir", ROOT, f"--output={tmp_path}/job_%j.out", "scripts/slurm_grpo.sh", *args,
                             "--output-dir", str(tmp_path / "run")], env=env, cwd=ROOT, capture_output=True,
                            text=True, check=True)
    return result.stdout.strip().split(";")[0]


def job_field(job: str, name: str) -> str:
    text = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout
    return text.split(f"{name}=", 1)[1].split()[0]


def wait_until(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def wait_for_state(job: str, states: tuple[str, ...], timeout: float = 400) -> str:
    wait_until(lambda: job_field(job, "JobState") in states, f"job {job} to be {'/'.join(states)}", timeout)
    return job_field(job, "JobState")


def log_of(tmp_path, job: str) -> str:
    return (tmp_path / f"job_{job}.out").read_text()


def rows(tmp_path) -> list[int]:
    return [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")]


def stop_at_step_3(tmp_path, job: str, send) -> None:
    """Waits until the run is in step 3's update (held there by its crash point), sends the signal, waits until
    rank 0 has received the stop request, then lets the run go on: it finishes step 3, saves, stops."""
    go = tmp_path / "go"
    wait_until(lambda: (tmp_path / "go.reached").exists(), "the run to reach step 3")
    send()
    wait_until(lambda: "finishing this step, then saving" in log_of(tmp_path, job), "the stop request")
    go.touch()


def test_time_limit_saves_the_step_and_requeues(tmp_path):
    """USR1 to the batch script (what `--signal=B:USR1@600` sends before the time limit): the run saves step 3, the
    job is requeued, runs again, resumes from state 3 and finishes, with every step's row once."""
    job = submit(tmp_path, {"NANORL_TEST_CRASH": f"update:3:rank=0:until={tmp_path / 'go'}"})
    stop_at_step_3(tmp_path, job, lambda: subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True))
    wait_until(lambda: job_field(job, "Restarts") == "1", "the requeue")
    # Slurm holds a requeued job until its credential expires (tests/tools/start_slurm.sh: 10 s), then runs it again.
    assert wait_for_state(job, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED", log_of(tmp_path, job)[-3000:]
    log = log_of(tmp_path, job)
    saved, restarted = log.find("SIGTERM: saved the training state at step 3"), log.find("(restart 1)")
    assert 0 <= saved < restarted, log[-3000:]  # the requeued job started after the save
    assert f"resumed from {tmp_path / 'run' / 'state_000003'} at step 3" in log
    assert rows(tmp_path) == [0, 1, 2, 3, 4, 5]


def test_scancel_saves_the_step_and_the_same_job_continues(tmp_path):
    """scancel (SIGTERM to every process of the job, and torchrun passes it on again): the run saves step 3 and the
    job ends; the same sbatch continues from state 3."""
    job = submit(tmp_path, {"NANORL_TEST_CRASH": f"update:3:rank=0:until={tmp_path / 'go'}"})
    stop_at_step_3(tmp_path, job, lambda: subprocess.run(["scancel", job], check=True))
    wait_for_state(job, ("CANCELLED", "COMPLETED", "FAILED"))
    wait_until(lambda: "saved the training state at step 3" in log_of(tmp_path, job), "the save's line")
    wait_until(lambda: (tmp_path / "run" / "state_000003").is_dir(), "state 3")
    again = submit(tmp_path, {})
    assert wait_for_state(again, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED", log_of(tmp_path, again)[-3000:]
    assert f"resumed from {tmp_path / 'run' / 'state_000003'} at step 3" in log_of(tmp_path, again)
    assert rows(tmp_path) == [0, 1, 2, 3, 4, 5]


def test_a_killed_training_process_is_restarted_in_the_job(tmp_path):
    """kill -9 of training rank 1 in step 3: torchrun (--max-restarts in the script) starts both ranks again, which
    resume from the state saved at step 2, and the job completes by itself."""
    job = submit(tmp_path, {"NANORL_TEST_CRASH": "update:3:rank=1:once"}, [*RUN, "--save-state-every", "2"])
    assert wait_for_state(job, ("COMPLETED", "FAILED", "CANCELLED")) == "COMPLETED", log_of(tmp_path, job)[-3000:]
    log = log_of(tmp_path, job)
    assert job_field(job, "Restarts") == "0"  # the job itself never restarted: torchrun did, inside it
    assert f"resumed from {tmp_path / 'run' / 'state_000002'} at step 2" in log
    assert rows(tmp_path) == [0, 1, 2, 3, 4, 5]
