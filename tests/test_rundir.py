"""Run directories (common/run/rundir.py): names from the defining flags, one live run per directory, refusing to mix
runs, and the flags a resume may and may not change."""

import dataclasses
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from common.run import distributed
from common.run.rundir import (clear_run, compare_flags, default_run_name, describe_run, fixed_on_resume,
                               open_run_dir)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIVEN = {"dataset": None, "seed": 1, "lr": None, "group_size": 16, "steps": 200, "eval_every": 25, "run_name": None,
         "output_dir": None, "resume": "auto", "overwrite": False, "track": False}
FIXED = ("seed", "group_size", "dataset")


@pytest.fixture(autouse=True)
def world_of_one():
    """decided_by_rank0 needs the launch's store: a world of one has its own."""
    distributed.use_store(dist.HashStore(), 0)
    yield
    distributed.use_store(None, 0)


def test_run_name_depends_on_the_defining_flags_only():
    name = default_run_name("grpo", GIVEN)
    assert name.startswith("grpo_builtin_s1_") and len(name.rsplit("_", 1)[1]) == 6
    assert default_run_name("grpo", GIVEN) == name  # the same command: the same run
    assert default_run_name("grpo", {**GIVEN, "steps": 400, "eval_every": 5, "track": True}) == name
    assert default_run_name("grpo", {**GIVEN, "lr": 1e-2}) != name
    assert default_run_name("grpo", {**GIVEN, "group_size": 8}) != name
    assert default_run_name("grpo", {**GIVEN, "dataset": "data/gsm8k.jsonl"}).startswith("grpo_gsm8k_s1_")
    assert default_run_name("ppo", GIVEN).startswith("ppo_builtin_s1_")


def test_changed_flags_are_listed_or_refused():
    saved = {"lr": 5e-4, "steps": 200, "seed": 1, "group_size": 16, "resume": "auto", "output_dir": "a"}
    assert compare_flags(saved, dict(saved), FIXED, "s") == []
    lines = compare_flags(saved, {**saved, "lr": 1e-3, "steps": 400, "output_dir": "b"}, FIXED, "s")
    assert lines == ["resuming with changed flags, applied: --lr 0.0005 -> 0.001, --steps 200 -> 400"]
    with pytest.raises(ValueError, match=r"--group-size 8 \(saved: 16\) differs from the run saved in state_x"):
        compare_flags(saved, {**saved, "group_size": 8}, FIXED, "state_x")


@pytest.mark.parametrize("script", ["grpo", "ppo", "dpo"])
def test_the_data_flags_are_fixed_on_resume(script):
    """A saved data position counts rows of the training set, which the data flags decide (with --eval-dataset, none
    of --dataset's rows are held out): each script refuses to resume with any of them changed."""
    module = importlib.import_module(script)
    data_flags = {"dataset", "dataset_config", "eval_split", "eval_size", "eval_dataset", "eval_dataset_config",
                  "eval_dataset_split"}
    assert data_flags <= {field.name for field in dataclasses.fields(module.Args)}
    assert data_flags <= set(module.FIXED_ON_RESUME)


def fake_state(path, step: int, args: dict):
    state = path / f"state_{step:06d}"
    state.mkdir(parents=True)
    (state / "trainer_state.json").write_text(json.dumps({"step": step, "extra": {"args": args}}))
    (state / "COMPLETE").write_text("ok\n")
    return str(state)


def test_resume_decisions(tmp_path):
    out = tmp_path / "run"
    resolved = {"seed": 1, "group_size": 16, "lr": 5e-4}
    given = {**GIVEN, "output_dir": str(out)}
    fresh = open_run_dir("grpo", given, resolved, FIXED)
    assert fresh.resume_from is None and fresh.path == str(out) and fresh.notes == []
    assert json.loads((out / "run.json").read_text())["args"] == resolved
    state = fake_state(out, 4, resolved)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')

    resumed = open_run_dir("grpo", given, {**resolved, "lr": 1e-3}, FIXED)
    assert resumed.resume_from == state and resumed.notes == [
        "resuming with changed flags, applied: --lr 0.0005 -> 0.001"]
    with pytest.raises(ValueError, match="--group-size 8"):
        open_run_dir("grpo", given, {**resolved, "group_size": 8}, FIXED)
    with pytest.raises(ValueError, match=r"already holds a run \(states up to step 4, metrics of 1 steps\)"):
        open_run_dir("grpo", {**given, "resume": "none"}, resolved, FIXED)
    overwritten = open_run_dir("grpo", {**given, "resume": "none", "overwrite": True}, resolved, FIXED)
    assert overwritten.resume_from is None and "cleared the previous run" in overwritten.notes[0]
    assert not os.path.exists(state) and not (out / "metrics.jsonl").exists()


def test_a_run_stopped_before_its_first_state_starts_over(tmp_path):
    out = tmp_path / "run"
    given, resolved = {**GIVEN, "output_dir": str(out)}, {"seed": 1, "group_size": 16}
    open_run_dir("grpo", given, resolved, FIXED)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    again = open_run_dir("grpo", given, resolved, FIXED)
    assert again.resume_from is None and "starting afresh" in again.notes[0]
    assert not (out / "metrics.jsonl").exists()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # another run's leftovers: not silently replaced
    with pytest.raises(ValueError, match="--group-size 8"):
        open_run_dir("grpo", given, {**resolved, "group_size": 8}, FIXED)


def test_describe_and_clear_leave_other_files(tmp_path):
    fake_state(tmp_path, 2, {})
    (tmp_path / "state_000004.tmp").mkdir()
    (tmp_path / "hf_step_2").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    assert describe_run(str(tmp_path)) == "states up to step 2, 1 exports"
    clear_run(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"] and describe_run(str(tmp_path)) == ""


def test_a_live_run_holds_its_directory(tmp_path):
    """A second run in a directory that a live process holds is refused, naming it; once the holder is gone (even
    SIGKILLed: the kernel drops its lock), the directory is free again."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, torch.distributed as dist\nfrom common.run import distributed\n"
         "from common.run.rundir import open_run_dir\ndistributed.use_store(dist.HashStore(), 0)\n"
         f"open_run_dir('grpo', {dict(GIVEN, output_dir=str(out))!r}, {{}}, ())\nprint('locked', flush=True)\n"
         "time.sleep(60)\n"], env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"{out} is in use by another run \(pid {holder.pid} on "):
            open_run_dir("grpo", {**GIVEN, "output_dir": str(out)}, {}, ())
    finally:
        holder.kill()
        holder.wait()
    assert open_run_dir("grpo", {**GIVEN, "output_dir": str(out)}, {}, ()).resume_from is None


def test_the_flags_fixed_on_resume_are_the_script_s_own_and_each_shared_class_s():
    """Each shared flag class names its own; a script adds its flags. Every class's names arrive once, in order."""
    @dataclasses.dataclass
    class Shared:
        a: int = 0
        fixed_on_resume = ("a",)

    @dataclasses.dataclass
    class Other:
        b: int = 0
        fixed_on_resume = ("b", "a")

    @dataclasses.dataclass
    class Script(Shared, Other):
        c: int = 0

    assert fixed_on_resume(Script, "c", "model") == ("c", "model", "a", "b")
    import grpo  # the LoRA, data, rollout and run flags reach a script's list through its Args' classes
    assert {"lora_rank", "lora_targets", "dataset", "eval_dataset_split", "answer_key", "seed", "model"} <= \
        set(grpo.FIXED_ON_RESUME)
