"""ppo.py end to end on 2 gloo ranks: the default learns the built-in task, a killed run resumes exactly (critic
and its optimizer included), split placement with async rollouts runs, and bad input is one line."""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from test_grpo_e2e import HASH_REWARD, assert_one_line_error, metric_rows, torchrun


def ppo(args, tmp_path, **kwargs):
    return torchrun(args, tmp_path, script="ppo.py", **kwargs)


def test_default_run_learns_the_builtin_task(tmp_path):
    """`torchrun --nproc_per_node 2 ppo.py` with no flags: held-out greedy accuracy from below 0.2 to at least 0.8."""
    result = ppo([], tmp_path, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    match = re.search(r"held-out greedy accuracy: ([\d.]+) before training -> ([\d.]+) after", output)
    before, after = float(match.group(1)), float(match.group(2))
    assert before < 0.2 and after >= 0.8, (before, after)


RESUMABLE = ["--steps", "8", "--prompts-per-step", "8", "--group-size", "4", "--eval-size", "16", "--eval-every", "4",
             "--save-state-every", "2", "--keep-checkpoints", "0", "--num-mini-batches", "2", "--epochs", "2",
             "--reward-fn", "hash_reward.py:reward", "--skip-reward-check", "--critic-warmup-steps", "3", "--missing-eos-penalty", "0.1"]


@pytest.mark.faults  # kills and restarts a whole run: the fault-tolerance step (pytest.ini)
def test_killed_run_resumes_exactly(tmp_path):
    """Killed (SIGKILL on every rank) after step 5's row and before its state: the resumed run redoes steps 5 and
    on from state 4, and equals an uninterrupted run metric for metric, policy and critic weight for weight."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    (tmp_path / "hash_reward.py").write_text(HASH_REWARD)
    assert ppo([*RESUMABLE, "--output-dir", str(whole)], tmp_path).returncode == 0
    crashed = ppo([*RESUMABLE, "--output-dir", str(killed)], tmp_path, env={"NANORL_TEST_CRASH": "after_row:5"})
    assert crashed.returncode != 0 and not (killed / "hf_step_8").exists()
    result = ppo([*RESUMABLE, "--output-dir", str(killed)], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {killed / 'state_000004'} at step 4" in result.stdout + result.stderr
    expected, got = metric_rows(whole), metric_rows(killed)
    assert [row["step"] for row in got] == list(range(9)) and got == expected
    assert expected[1]["critic/warmup_updates"] > 0  # the warmup ran (step 1), and was not redone on resume
    for load, sub in [(AutoModelForCausalLM, ""), (AutoModelForTokenClassification, "critic")]:
        a = load.from_pretrained(whole / "hf_step_8" / sub).state_dict()
        b = load.from_pretrained(killed / "hf_step_8" / sub).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_split_placement_with_async_rollouts(tmp_path):
    """2 trainers and 1 rollout rank generating a step ahead, through the same rollout helper as grpo.py."""
    result = ppo(["--rollout-ranks", "1", "--async-rollout", "--steps", "4", "--eval-every", "2", "--eval-size", "16",
                  "--prompts-per-step", "8", "--output-dir", str(tmp_path / "run")], tmp_path, nproc=3)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in metric_rows(tmp_path / "run") if "reward/mean" in r]
    assert [r["rollout/staleness_max"] for r in steps] == [0, 1, 1, 1] and all("tis/weight_mean" in r for r in steps)


def test_a_reward_model_that_is_not_a_classifier_is_one_line(tmp_path):
    from common.train.model import load_model, load_tokenizer
    tokenizer = load_tokenizer(None)
    load_model(None, tokenizer, 0).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    result = ppo(["--reward-model", str(tmp_path / "lm"), "--output-dir", str(tmp_path / "run")], tmp_path)
    assert_one_line_error(result, "not a sequence-classification model (its architectures: ['LlamaForCausalLM'])")
    result = ppo(["--reward-model", "/nonexistent/rm", "--output-dir", str(tmp_path / "run")], tmp_path, nproc=1)
    assert_one_line_error(result, "--reward-model /nonexistent/rm: no such directory")
