"""grpo.py end to end under torchrun (2 gloo ranks), with a tiny budget: it completes, its checkpoint reloads,
W&B offline writes its run, and bad input stops every rank with a clear error instead of hanging."""

import glob
import json
import os
import re
import signal
import time
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--steps", "2", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16", "--eval-every", "0"]


def torchrun(args: list[str], tmp_path, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(ROOT, "grpo.py"), *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_rank_run_completes_and_checkpoint_reloads(tmp_path):
    out = tmp_path / "run"
    result = torchrun([*TINY, "--output-dir", str(out), "--track", "--kl-coef", "0.01"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out greedy accuracy" in result.stdout + result.stderr
    checkpoint = out / "hf_step_2"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert (checkpoint / "tokenizer.json").exists() or (checkpoint / "tokenizer_config.json").exists()
    # The saved weights are the trained ones, not the initialisation the same seed would give.
    from common.model import load_model, load_tokenizer
    initial = load_model(None, load_tokenizer(None), seed=1)
    changed = [not torch.equal(p, initial.state_dict()[n]) for n, p in model.state_dict().items() if n in initial.state_dict()]
    assert any(changed)
    # W&B offline: the run directory is written under the output dir.
    runs = glob.glob(str(out / "wandb" / "offline-run-*"))
    assert runs and glob.glob(os.path.join(runs[0], "*.wandb"))


def test_reward_function_that_raises_stops_every_rank(tmp_path):
    """Raised in a reward process (--reward-workers 1): the message still names the error and the sample."""
    (tmp_path / "bad_reward.py").write_text(
        "def reward(prompt, completion, answer):\n    raise ZeroDivisionError('boom')\n")
    result = torchrun([*TINY, "--output-dir", str(tmp_path / "run"), "--reward-fn", "bad_reward.py:reward",
                       "--reward-workers", "1"], tmp_path)
    assert result.returncode != 0
    assert "ZeroDivisionError" in result.stderr and "boom" in result.stderr and "sample" in result.stderr


def test_missing_dataset_file_is_a_clear_error(tmp_path):
    result = torchrun([*TINY, "--dataset", "nope.jsonl"], tmp_path, nproc=1)
    assert result.returncode != 0
    assert "nope.jsonl" in result.stderr


def test_custom_jsonl_dataset_and_reward(tmp_path):
    rows = [{"question": f"{a} + {b} =", "solution": str(a + b)} for a in range(6) for b in range(6)]
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "reward.py").write_text(
        "def reward(prompt, completion, answer):\n    return float(completion.strip().startswith(answer))\n")
    result = torchrun(["--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--eval-size", "4",
                       "--dataset", "data.jsonl", "--prompt-key", "question", "--answer-key", "solution",
                       "--reward-fn", "reward.py:reward", "--activation-checkpointing",
                       "--output-dir", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]


def test_default_run_learns_the_builtin_task(builtin_sync_run):
    """The README's first command: from random weights, held-out greedy accuracy from below 0.2 to at least 0.8."""
    result, _ = builtin_sync_run
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"held-out greedy accuracy: ([\d.]+) before training -> ([\d.]+) after", result.stdout + result.stderr)
    before, after = float(match.group(1)), float(match.group(2))
    assert before < 0.2 and after >= 0.8, (before, after)


# ---------------------------------------------------------------------------------------------------------------
# Reliability: a run killed at any moment continues with nothing lost.

# A reward that varies within every group (a hash of the completion), so that every step updates the weights.
HASH_REWARD = "import zlib\ndef reward(prompt, completion, answer):\n    return zlib.crc32(completion.encode()) % 3 / 2\n"
RESUMABLE = ["--steps", "12", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16", "--eval-every", "3",
             "--save-state-every", "2", "--keep-checkpoints", "0", "--num-mini-batches", "2", "--epochs", "2",
             "--reward-fn", "hash_reward.py:reward"]


def launch(args: list[str], cwd, nproc: int = 2) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(ROOT, "grpo.py"), *args]
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 180):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()[-3000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun starts its workers in sessions of their own)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    os.kill(pid, signal.SIGKILL)  # first, so that it restarts nothing
    for child in children:
        kill_tree(child)


def metrics_by_step(run_dir) -> dict[int, dict]:
    """The last logged metrics of each step (a resumed run logs again the steps after its checkpoint), without
    timings, which no two runs share."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        entry = json.loads(line)
        by_step[entry["step"]] = {k: v for k, v in entry.items() if not k.startswith(("time/", "perf/"))}
    return by_step


def test_killed_run_resumes_exactly(tmp_path):
    """A run SIGKILLed after its second checkpoint and resumed matches an uninterrupted one, metric for metric and
    weight for weight. The killed run scores its rewards in reward processes (--reward-workers 2) and the whole
    one in the ranks' own processes, so the same comparison also shows the two ways of scoring agree."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    (tmp_path / "hash_reward.py").write_text(HASH_REWARD)
    assert torchrun([*RESUMABLE, "--output-dir", str(whole)], tmp_path).returncode == 0

    proc = launch([*RESUMABLE, "--output-dir", str(killed), "--reward-workers", "2"], tmp_path)
    wait_for(lambda: (killed / "state_000004" / "COMPLETE").exists(), proc)  # after its second checkpoint
    kill_tree(proc.pid)
    proc.wait()
    assert not (killed / "hf_step_12").exists()  # it really died before the end

    result = torchrun([*RESUMABLE, "--output-dir", str(killed), "--reward-workers", "2"], tmp_path)  # --resume auto
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout + result.stderr
    expected, got = metrics_by_step(whole), metrics_by_step(killed)
    assert sorted(got) == list(range(13))
    for step in expected:
        assert got[step] == expected[step], f"step {step} differs"
    final_whole = AutoModelForCausalLM.from_pretrained(whole / "hf_step_12").state_dict()
    final_killed = AutoModelForCausalLM.from_pretrained(killed / "hf_step_12").state_dict()
    assert all(torch.equal(final_whole[k], final_killed[k]) for k in final_whole)


def test_sigterm_saves_a_loadable_state(tmp_path):
    from common.resume import latest_checkpoint, read_trainer_state
    out = tmp_path / "run"
    proc = launch(["--steps", "500", "--save-state-every", "0", "--eval-every", "0", "--track", "--output-dir", str(out)],
                  tmp_path)
    wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 4,
             proc)
    proc.send_signal(signal.SIGTERM)  # torchrun passes it on to its workers, as Slurm's preemption does
    output = proc.communicate(timeout=120)[0]
    assert "saved the training state" in output
    state = latest_checkpoint(str(out))
    assert state is not None
    step = read_trainer_state(state)["step"]
    assert 3 <= step < 500
    result = torchrun(["--steps", str(step + 2), "--eval-every", "0", "--track", "--output-dir", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {state} at step {step}" in result.stdout + result.stderr
    # The resumed run continues the same W&B run: two offline run directories, one run id (the name's last part).
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and runs[0].rsplit("-", 1)[1] == runs[1].rsplit("-", 1)[1]
