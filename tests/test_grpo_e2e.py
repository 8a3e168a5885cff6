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

import launcher
import pytest
import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--steps", "2", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16", "--eval-every", "0"]


def torchrun(args: list[str], tmp_path, nproc: int = 2, timeout: int = 240, env: dict | None = None,
             script: str = "grpo.py") -> subprocess.CompletedProcess:
    """The script's ranks as torchrun would start them, forked from a process that imported them once
    (tests/launcher.py)."""
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **(env or {})}
    return launcher.run(script, args, tmp_path, nproc, env, timeout)


def real_torchrun(args: list[str], tmp_path, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """Through torchrun itself, for what depends on it (how it stops ranks when one fails)."""
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
    from common.train.model import load_model, load_tokenizer
    initial = load_model(None, load_tokenizer(None), seed=1)
    changed = [not torch.equal(p, initial.state_dict()[n]) for n, p in model.state_dict().items() if n in initial.state_dict()]
    assert any(changed)
    # W&B offline: the run directory is written under the output dir.
    runs = glob.glob(str(out / "wandb" / "offline-run-*"))
    assert runs and glob.glob(os.path.join(runs[0], "*.wandb"))


def assert_one_line_error(result: subprocess.CompletedProcess, expected: str) -> None:
    """The run failed and said why in one line, once over all ranks, with no traceback of ours (torchrun adds its
    own summary of the failed ranks after it)."""
    output = result.stdout + result.stderr
    assert result.returncode != 0
    lines = [line for line in output.splitlines() if expected in line]
    assert len(lines) == 1 and "error: " in lines[0], output[-3000:]
    assert "grpo.py\", line" not in output and "common/" not in output, output[-3000:]


def test_reward_function_that_raises_stops_every_rank(tmp_path):
    """Raised in a reward process: the message names the error and the sample, once."""
    (tmp_path / "bad_reward.py").write_text(
        "def reward(prompt, completion, answer):\n    raise ZeroDivisionError('boom')\n")
    result = torchrun([*TINY, "--output-dir", str(tmp_path / "run"), "--reward-fn", "bad_reward.py:reward"], tmp_path)
    assert_one_line_error(result, "ZeroDivisionError: boom")
    assert "sample" in result.stderr


def test_bad_flags_are_one_line_once(tmp_path):
    """Through torchrun, which stops the other ranks as soon as one fails: the reporting rank still gets to say it."""
    result = real_torchrun(["--lrr", "1e-3"], tmp_path)
    assert_one_line_error(result, "Unrecognized options: --lrr, 1e-3 (did you mean --lr?)")
    assert_one_line_error(torchrun(["--lr", "-1e-3", "--output-dir", "x"], tmp_path), "--lr must be greater than 0")
    assert_one_line_error(torchrun(["--rollout-ranks", "1", "--check-weight-sync", "--output-dir", "x"], tmp_path),
                          "--check-weight-sync compares a colocated engine's weights with the trainer's")


def test_a_missing_model_directory_is_a_clear_error(tmp_path):
    """A path that looks local is never read as a hub id (Hugging Face's "Repo id must be in the form ...")."""
    assert_one_line_error(torchrun([*TINY, "--model", "/nonexistent/dir"], tmp_path, nproc=1),
                          "--model /nonexistent/dir: no such directory")


def test_weights_broken_by_the_learning_rate_are_one_line(tmp_path):
    """--lr 1e30: the first update leaves finite weights whose logits are not; sampling the next batch says so."""
    result = torchrun([*TINY, "--steps", "3", "--lr", "1e30", "--output-dir", str(tmp_path / "run")], tmp_path)
    assert_one_line_error(result, "step 2: sampling failed: the policy's next-token probabilities are inf or NaN")
    assert "a learning rate too high (--lr 1e+30) is the likely cause" in result.stderr


def test_missing_dataset_file_is_a_clear_error(tmp_path):
    result = torchrun([*TINY, "--dataset", "nope.jsonl"], tmp_path, nproc=1)
    assert_one_line_error(result, "dataset file not found: nope.jsonl")


def test_custom_csv_dataset_and_reward(tmp_path):
    """A small .csv file: read through datasets like the other formats, a tenth held out for evaluation."""
    rows = [f"{a} + {b} =,{a + b}" for a in range(6) for b in range(6)]
    (tmp_path / "data.csv").write_text("question,solution\n" + "\n".join(rows))
    (tmp_path / "reward.py").write_text(
        "def reward(prompt, completion, answer):\n    return float(completion.strip().startswith(answer))\n")
    result = torchrun(["--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--max-response-len", "16",
                       "--dataset", "data.csv", "--prompt-key", "question", "--answer-key", "solution",
                       "--reward-fn", "reward.py:reward", "--activation-checkpointing",
                       "--output-dir", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "33 train / 3 eval prompts" in result.stdout + result.stderr


def test_directory_dataset_with_an_eval_dataset_of_ones_own(tmp_path):
    """--dataset DIR (train.jsonl and test.jsonl) with --eval-dataset FILE: all of train trains, the file's first
    --eval-size prompts are held out (the directory's test split is not used); the flag is fixed on resume."""
    def write(path, pairs):
        path.write_text("".join(json.dumps({"question": f"{a} + {b} =", "solution": str(a + b)}) + "\n"
                                for a, b in pairs))

    (tmp_path / "data").mkdir()
    write(tmp_path / "data" / "train.jsonl", [(a, b) for a in range(6) for b in range(5)])
    write(tmp_path / "data" / "test.jsonl", [(a, 5) for a in range(6)])
    write(tmp_path / "bench.jsonl", [(a, 9) for a in range(8)])
    (tmp_path / "reward.py").write_text(
        "def reward(prompt, completion, answer):\n    return float(completion.strip().startswith(answer))\n")
    flags = ["--steps", "1", "--prompts-per-step", "4", "--group-size", "2", "--max-response-len", "4",
             "--dataset", "data", "--prompt-key", "question", "--answer-key", "solution", "--eval-size", "7",
             "--reward-fn", "reward.py:reward", "--output-dir", str(tmp_path / "run")]
    result = torchrun([*flags, "--eval-dataset", "bench.jsonl"], tmp_path, nproc=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "30 train / 7 eval prompts" in result.stdout + result.stderr  # the directory's test split has 6
    assert_one_line_error(torchrun([*flags, "--eval-dataset", "data"], tmp_path, nproc=1),
                          "--eval-dataset data (saved: bench.jsonl) differs from the run saved in")


def test_default_run_learns_the_builtin_task(builtin_sync_run):
    """The README's first command: from random weights, held-out greedy accuracy from below 0.2 to at least 0.8."""
    result, _ = builtin_sync_run
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"held-out greedy accuracy: ([\d.]+) before training -> ([\d.]+) after", result.stdout + result.stderr)
    before, after = float(match.group(1)), float(match.group(2))
    assert before < 0.2 and after >= 0.8, (before, after)


def test_export_loads_back_as_it_trained(builtin_sync_run):
    """AutoTokenizer + AutoModelForCausalLM on the exported model: the training tokenizer's ids, and greedy answers
    as accurate as the run's own last evaluation (same prompts, same model, a plain HF generate)."""
    from transformers import AutoTokenizer

    from common.data.prompts import load_train_eval
    from common.rollout.reward_fns import load_reward_fn
    from common.train.model import load_tokenizer

    _, run = builtin_sync_run
    export = run / "hf_step_200"
    tokenizer, trained_with = AutoTokenizer.from_pretrained(export), load_tokenizer(None)
    model = AutoModelForCausalLM.from_pretrained(export).eval()
    _, rows = load_train_eval(None, "prompt", "answer")
    ids = [tokenizer(row["prompt"])["input_ids"] for row in rows]
    assert ids == [trained_with(row["prompt"])["input_ids"] for row in rows]
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.ones(len(ids), len(ids[0]), dtype=torch.long),
                             max_new_tokens=2, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    answers = tokenizer.batch_decode(out[:, len(ids[0]):], skip_special_tokens=True)
    reward = load_reward_fn("synthetic")
    accuracy = sum(reward(r["prompt"], a, r["answer"]) for r, a in zip(rows, answers)) / len(rows)
    last_eval = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]["eval/accuracy"]
    assert accuracy == pytest.approx(last_eval, abs=1.5 / len(rows)), (accuracy, last_eval)  # a near-tie may flip


# ---------------------------------------------------------------------------------------------------------------
# Reliability: a run killed at any moment continues with nothing lost.

# A reward that varies within every group (a hash of the completion), so that every step updates the weights.
HASH_REWARD = "import zlib\ndef reward(prompt, completion, answer):\n    return zlib.crc32(completion.encode()) % 3 / 2\n"
RESUMABLE = ["--steps", "12", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16", "--eval-every", "3",
             "--save-state-every", "2", "--keep-checkpoints", "0", "--num-mini-batches", "2", "--epochs", "2",
             "--reward-fn", "hash_reward.py:reward", "--skip-reward-check"]


def launch(args: list[str], cwd, nproc: int = 2, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true", **(env or {})}
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


def metric_rows(run_dir) -> list[dict]:
    """Every row of metrics.jsonl, without timings, which no two runs share."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "perf/"))}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wandb_steps(run_dir) -> list[list[int]]:
    """The history steps of each offline W&B run segment under run_dir, in order (a .wandb file is a LevelDB-style
    log of protobuf records: 32 KiB blocks of chunks with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    segments = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb"))):
        data, pos, record, steps = open(path, "rb").read(), 7, b"", []
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            if kind == 0:
                break
            record = (record if kind in (3, 4) else b"") + data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                parsed = wandb_internal_pb2.Record.FromString(record)
                if parsed.WhichOneof("record_type") == "history":
                    steps.append(parsed.history.step.num)
        segments.append(steps)
    return segments


@pytest.mark.faults  # kills and restarts a whole run: the fault-tolerance step (pytest.ini)
def test_killed_run_resumes_exactly(tmp_path):
    """A run killed twice (SIGKILL on every rank: once after a step's row was written but before its state, once
    right after a state) and resumed each time equals an uninterrupted one, metric for metric and weight for weight,
    with every step's rows exactly once in metrics.jsonl and in W&B. The killed run scores rewards in two processes
    per rank and the whole one in one, so the comparison also shows that scoring does not depend on them. Then its
    newest state is damaged: the next resume says so and falls back to the previous one."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    (tmp_path / "hash_reward.py").write_text(HASH_REWARD)
    assert torchrun([*RESUMABLE, "--output-dir", str(whole)], tmp_path).returncode == 0

    args = [*RESUMABLE, "--output-dir", str(killed), "--reward-workers", "2", "--track"]
    for crash in ["after_row:4", "after_state:8"]:  # between a row and its state; between a state and the next step
        crashed = torchrun(args, tmp_path, env={"NANORL_TEST_CRASH": crash})
        assert crashed.returncode != 0 and not (killed / "hf_step_12").exists(), crashed.stderr[-3000:]
    assert "resumed from" in crashed.stdout + crashed.stderr
    result = torchrun(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {killed / 'state_000008'} at step 8" in result.stdout + result.stderr

    expected, got = metric_rows(whole), metric_rows(killed)
    assert [row["step"] for row in got] == list(range(13))  # each step once: none lost, none twice
    assert got == expected
    # Offline, W&B's history is kept one row per step in the order the segments are synced (it ignores a step it
    # has passed): a resumed segment re-sends what the killed one may have lost, so the last one holds them all.
    segments = wandb_steps(killed)
    assert len(segments) == 3 and segments[-1] == list(range(13))
    assert all(steps == sorted(set(steps)) for steps in segments)
    final_whole = AutoModelForCausalLM.from_pretrained(whole / "hf_step_12").state_dict()
    final_killed = AutoModelForCausalLM.from_pretrained(killed / "hf_step_12").state_dict()
    assert all(torch.equal(final_whole[k], final_killed[k]) for k in final_whole)

    shard = sorted((killed / "state_000012").glob("*.distcp"))[0]
    os.truncate(shard, shard.stat().st_size // 2)
    result = torchrun([*args, "--steps", "13"], tmp_path, nproc=1)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert f"warning: {killed / 'state_000012'} is damaged ({shard.name} has" in output
    assert f"resumed from {killed / 'state_000010'} at step 10" in output


def processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (a test's launches and everything they started)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{pid}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if marker.encode() in environ and not zombie:
            found.append(int(pid))
    return found


@pytest.mark.faults  # a signal to the whole launch: the fault-tolerance step (pytest.ini)
def test_ctrl_c_saves_and_one_run_per_directory(tmp_path):
    """Ctrl-C (SIGINT to torchrun, which passes it on) finishes the step, saves and exits; the same command then
    continues the same W&B run. While the first run lives, a second one in its directory is refused at once."""
    from common.run.resume import latest_checkpoint, read_trainer_state
    out = tmp_path / "run"
    marker = f"NANORL_TEST_{os.getpid()}_ctrl_c"
    proc = launch(["--steps", "500", "--save-state-every", "0", "--eval-every", "0", "--track", "--output-dir", str(out)],
                  tmp_path, env={marker: "1"})
    wait_for(lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 4,
             proc)
    second = torchrun(["--steps", "500", "--output-dir", str(out)], tmp_path, nproc=1)
    assert_one_line_error(second, f"{out} is in use by another run (pid ")
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=120)[0]  # torchrun itself exits 1 on a signal, whatever its workers do
    assert "SIGINT: finishing this step, then saving and stopping" in output and "saved the training state" in output
    assert not processes_with(marker)  # no rank and no reward process outlived it
    state = latest_checkpoint(str(out))
    step = read_trainer_state(state)["step"]
    assert 3 <= step < 500
    result = torchrun(["--steps", str(step + 2), "--eval-every", "0", "--track", "--output-dir", str(out)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {state} at step {step}" in result.stdout + result.stderr
    # The resumed run continues the same W&B run: two offline run directories, one run id (the name's last part).
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and runs[0].rsplit("-", 1)[1] == runs[1].rsplit("-", 1)[1]


# Hangs for good on one prompt of the first step: an endless loop inside one C call (no Python code runs there).
STUCK_REWARD = ("import itertools\ndef reward(prompt, completion, answer):\n    if prompt == STUCK_PROMPT:\n"
                "        sum(itertools.repeat(1))\n    return float(completion.strip() == answer)\n")


def stuck_reward(tmp_path) -> str:
    from common.data.prompts import PromptSampler, load_train_eval
    train, _ = load_train_eval(None, "prompt", "answer")
    first = PromptSampler(train, 4, 0, 2, seed=1).next_batch()[0]["prompt"]  # rank 0's first prompt (seed 1)
    (tmp_path / "stuck.py").write_text(f"STUCK_PROMPT = {first!r}\n" + STUCK_REWARD)
    return "stuck.py:reward"


def test_a_stuck_reward_times_out(tmp_path):
    """With a time limit, the stuck call is stopped (its process killed), scores 0 and is counted; the run goes on."""
    result = torchrun([*TINY, "--output-dir", str(tmp_path / "run"), "--reward-fn", stuck_reward(tmp_path),
                       "--reward-timeout", "2"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metric_rows(tmp_path / "run")
    assert [row["reward/timeouts"] for row in rows if "reward/timeouts" in row] == [4.0, 0.0]  # the group of 4


@pytest.mark.faults  # a signal to the whole launch: the fault-tolerance step (pytest.ini)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_a_stuck_reward_never_hangs_the_run(tmp_path, how):
    """Without a time limit, a reward stuck for good: after SIGTERM to torchrun the calls still unscored 5 s later
    score 0 (counted as time-outs), so the step completes and is saved; SIGKILL of torchrun leaves no orphaned rank
    or reward process."""
    marker = f"NANORL_TEST_{os.getpid()}_{how}"
    out = tmp_path / "run"
    proc = launch([*TINY, "--steps", "3", "--output-dir", str(out), "--reward-fn", stuck_reward(tmp_path),
                   "--reward-timeout", "None"], tmp_path, env={marker: "1"})
    wait_for(lambda: (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text(), proc)  # step 0's row
    if how == "SIGTERM":  # (the generous limits only bound a failure: a stuck run would never end at all)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=180)[0]
        assert output.count("saved the training state at step 1") == 1, output[-3000:]
        [row] = [row for row in metric_rows(out) if row["step"] == 1]
        assert row["reward/timeouts"] >= 1
    else:
        proc.kill()
        proc.wait()
    start = time.time()  # the launch has ended: its ranks and reward processes go with it (they watch their parent)
    while processes_with(marker) and time.time() - start < 120:
        time.sleep(0.2)
    assert not processes_with(marker)


def test_run_names_follow_the_command(tmp_path):
    """The same command resumes its run, a changed one starts another; with the directory given, a changed lr is
    applied (and said), a changed group size refused; --resume none needs --overwrite where a run is."""
    (tmp_path / "hash_reward.py").write_text(HASH_REWARD)
    base = ["--prompts-per-step", "4", "--group-size", "4", "--eval-size", "8", "--eval-every", "0",
            "--reward-fn", "hash_reward.py:reward", "--warmup-steps", "1", "--skip-reward-check"]
    first = torchrun([*base, "--steps", "1"], tmp_path, nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    [run] = (tmp_path / "runs").iterdir()
    more = torchrun([*base, "--steps", "2"], tmp_path, nproc=1)  # --steps is not part of the name: continue
    assert f"resumed from {os.path.join('runs', run.name, 'state_000001')} at step 1" in more.stdout + more.stderr
    other = torchrun([*base, "--steps", "1", "--lr", "1e-3"], tmp_path, nproc=1)
    assert other.returncode == 0 and len(list((tmp_path / "runs").iterdir())) == 2  # a new run, elsewhere

    given = [*base, "--output-dir", str(run)]
    changed = torchrun([*given, "--steps", "3", "--lr", "1e-3"], tmp_path, nproc=1)
    assert "resuming with changed flags, applied: --steps 2 -> 3, --lr 0.0005 -> 0.001" in changed.stdout + changed.stderr
    assert [row["policy/lr"] for row in metric_rows(run) if "policy/lr" in row] == [5e-4, 5e-4, 1e-3]
    assert_one_line_error(torchrun([*given, "--steps", "4", "--group-size", "2"], tmp_path, nproc=1),
                          "--group-size 2 (saved: 4) differs from the run saved in")
    assert_one_line_error(torchrun([*given, "--steps", "1", "--resume", "none"], tmp_path, nproc=1),
                          f"{run} already holds a run (states up to step 3")
    fresh = torchrun([*given, "--steps", "1", "--resume", "none", "--overwrite"], tmp_path, nproc=1)
    assert fresh.returncode == 0 and "cleared the previous run" in fresh.stdout + fresh.stderr
    assert [row["step"] for row in metric_rows(run)] == [0, 1]


def test_two_nodes_on_one_machine_train_with_hybrid_sharding(tmp_path):
    """`torchrun --nnodes 2` twice on localhost, 2 ranks each, --shard-size 2: each model sharded within a "node" and
    replicated across the two; the built-in task trains (30 steps) and both launches end cleanly."""
    from gloo import free_port

    port, out = free_port(), tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    launches = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(n),
                                  "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
                                  os.path.join(ROOT, "grpo.py"), "--shard-size", "2", "--steps", "30",
                                  "--eval-every", "15", "--output-dir", str(out)],
                                 cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for n in (0, 1)]
    outputs = [launch.communicate(timeout=400)[0] for launch in launches]
    assert [launch.returncode for launch in launches] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "hybrid FSDP: sharded within each of 2 groups of 2 ranks, replicated across them" in outputs[0]
    before, after = map(float, re.search(r"held-out greedy accuracy: ([\d.]+) before training -> ([\d.]+) after",
                                         outputs[0]).groups())
    assert after > before + 0.2, (before, after)
