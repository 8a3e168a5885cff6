"""dpo.py end to end on 2 gloo ranks: offline and online defaults learn the built-in task, a killed run resumes
exactly, and a real HH-RLHF-format file trains through the implicit-prompt path."""

import math
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from test_grpo_e2e import assert_one_line_error, metric_rows, torchrun


def dpo(args, tmp_path, **kwargs):
    return torchrun(args, tmp_path, script="dpo.py", **kwargs)


def accuracies(output: str) -> dict[str, tuple[float, float]]:
    return {kind: (float(before), float(after)) for kind, before, after in
            re.findall(r"held-out (preference|greedy task) accuracy: ([\d.]+) before training -> ([\d.]+)", output)}


def first_row_of_a_learned_builtin_run(args, tmp_path) -> dict:
    """Runs dpo.py on the built-in task, checks it learned (held-out preference accuracy at least 0.9, greedy task
    accuracy up by at least 0.3) and returns its step-1 metrics row."""
    result = dpo(args, tmp_path, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    found = accuracies(output)
    assert found["preference"][1] >= 0.9, found
    assert found["greedy task"][1] - found["greedy task"][0] >= 0.3, found
    [run] = (tmp_path / "runs").glob("dpo_builtin_s1_*")
    return next(row for row in metric_rows(run) if row["step"] == 1)


def test_offline_default_learns_the_builtin_task(tmp_path):
    """`torchrun --nproc_per_node 2 dpo.py`: held-out preference accuracy at least 0.9, and greedy task accuracy up
    by at least 0.3."""
    first = first_row_of_a_learned_builtin_run([], tmp_path)
    assert abs(first["loss/preference"] - math.log(2)) < 1e-6 and abs(first["rewards/margin"]) < 1e-6


def test_kto_default_learns_the_builtin_task(tmp_path):
    """`torchrun --nproc_per_node 2 dpo.py --loss-type kto`: the built-in pairs as desirable and undesirable rows;
    held-out preference accuracy at least 0.9 and greedy task accuracy up by at least 0.3; step 1 at policy ==
    reference: loss 1/2 (half of each row's weight 1), reference point and rewards 0."""
    first = first_row_of_a_learned_builtin_run(["--loss-type", "kto"], tmp_path)
    assert abs(first["loss/preference"] - 0.5) < 1e-6 and first["kto/kl"] == 0.0
    assert abs(first["rewards/desirable"]) < 1e-6 and abs(first["rewards/undesirable"]) < 1e-6


def test_online_default_learns_the_builtin_task(tmp_path):
    """`torchrun --nproc_per_node 2 dpo.py --online`: greedy task accuracy at least 0.8."""
    result = dpo(["--online"], tmp_path, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert accuracies(output)["greedy task"][1] >= 0.8, accuracies(output)


def test_online_steps_without_pairs_pass_the_start_check(tmp_path):
    """A step whose groups all tie has no pairs: the check of the loss at policy == reference waits for the first
    step that has some, instead of failing on an empty step's zero loss."""
    (tmp_path / "flat.py").write_text("def reward(prompt, completion, answer):\n    return 0.0\n")
    result = dpo(["--online", "--reward-fn", "flat.py:reward", "--skip-reward-check", "--steps", "2",
                  "--prompts-per-step", "4", "--eval-every", "0", "--eval-size", "4"], tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    [run] = (tmp_path / "runs").glob("dpo_builtin_s1_*")
    assert [(row["pairs/count"], row["pairs/tie_frac"]) for row in metric_rows(run) if "pairs/count" in row] == [
        (0, 1.0), (0, 1.0)]


RESUMABLE = ["--steps", "8", "--pairs-per-step", "16", "--eval-size", "32", "--eval-every", "4",
             "--save-state-every", "2", "--keep-checkpoints", "0"]


@pytest.mark.faults  # kills and restarts a whole run: the fault-tolerance step (pytest.ini)
def test_killed_run_resumes_exactly(tmp_path):
    """Killed after step 3's state: resumed from it, equal to an uninterrupted run metric for metric and weight
    for weight; online too, with the reference refreshed every 2 steps (saved with the state). The finished run,
    launched again, has nothing to do and reports the same before -> after accuracies; with a smaller --steps, none
    (offline DPO only: the run directory's logic, the same for every variant)."""
    for extra in ([], ["--loss-type", "kto"], ["--online", "--prompts-per-step", "8", "--ref-update-every", "2"]):
        whole, killed = tmp_path / f"whole{len(extra)}", tmp_path / f"killed{len(extra)}"  # (2 and 5 flags: apart)
        first = dpo([*RESUMABLE, *extra, "--output-dir", str(whole)], tmp_path)
        assert first.returncode == 0
        if not extra:
            again = dpo([*RESUMABLE, "--output-dir", str(whole)], tmp_path)
            assert "nothing to do" in again.stdout + again.stderr
            assert accuracies(again.stdout + again.stderr) == accuracies(first.stdout + first.stderr) != {}
            fewer = dpo([*RESUMABLE, "--steps", "4", "--output-dir", str(whole)], tmp_path)  # already past it
            assert "nothing to do" in fewer.stdout + fewer.stderr and accuracies(fewer.stdout + fewer.stderr) == {}
        crashed = dpo([*RESUMABLE, *extra, "--output-dir", str(killed)], tmp_path, env={"NANORL_TEST_CRASH":
                                                                                        "after_state:4"})
        assert crashed.returncode != 0
        result = dpo([*RESUMABLE, *extra, "--output-dir", str(killed)], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"resumed from {killed / 'state_000004'} at step 4" in result.stdout + result.stderr
        got, expected = metric_rows(killed), metric_rows(whole)
        assert [r["step"] for r in got] == [r["step"] for r in expected] and got == expected
        a = AutoModelForCausalLM.from_pretrained(whole / "hf_step_8").state_dict()
        b = AutoModelForCausalLM.from_pretrained(killed / "hf_step_8").state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


HH_LINES = [  # the tiny model's word-level tokenizer knows the numbers 0-29, and reads other words as <unk>
    {"chosen": "\n\nHuman: one plus one\n\nAssistant: 2", "rejected": "\n\nHuman: one plus one\n\nAssistant: 3"},
    {"chosen": "\n\nHuman: two plus two\n\nAssistant: 4", "rejected": "\n\nHuman: two plus two\n\nAssistant: 1"},
]


def test_whole_dialogue_pairs_train_and_bad_columns_are_one_line(tmp_path):
    """Pairs given as whole dialogues (HH-RLHF's format, gzipped JSON lines): the prompt is their common start."""
    import gzip
    import json
    lines = [HH_LINES[i % 2] for i in range(40)]
    (tmp_path / "pairs.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode()))
    result = dpo(["--dataset", "pairs.jsonl.gz", "--max-len", "64", "--pairs-per-step", "8", "--steps", "3",
                  "--eval-every", "0", "--output-dir", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "36 train / 4 eval pairs" in result.stdout + result.stderr
    result = dpo(["--dataset", "pairs.jsonl.gz", "--chosen-key", "better", "--output-dir", str(tmp_path / "r2")],
                 tmp_path)
    assert_one_line_error(result, "missing column(s) ['better']; existing columns: ['chosen', 'rejected']")


def test_pairs_from_a_hub_snapshot_directory_with_an_eval_dataset(tmp_path):
    """A hub dataset's snapshot (parquet shards under data/, a train and a test split) with --eval-dataset FILE:
    every train pair trains, the file's first --eval-size pairs are held out, not the snapshot's test split."""
    import datasets
    import json
    (tmp_path / "snapshot" / "data").mkdir(parents=True)
    for shard in range(2):
        datasets.Dataset.from_list([HH_LINES[i % 2] for i in range(12)]).to_parquet(
            str(tmp_path / "snapshot" / "data" / f"train-0000{shard}-of-00002.parquet"))
    datasets.Dataset.from_list(HH_LINES * 3).to_parquet(
        str(tmp_path / "snapshot" / "data" / "test-00000-of-00001.parquet"))
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(x) + "\n" for x in HH_LINES * 5))
    result = dpo(["--dataset", "snapshot", "--eval-dataset", "bench.jsonl", "--eval-size", "8", "--max-len", "64",
                  "--pairs-per-step", "8", "--steps", "2", "--eval-every", "0", "--output-dir", str(tmp_path / "run")],
                 tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "24 train / 8 eval pairs" in result.stdout + result.stderr  # the snapshot's test split has 6


def test_kto_trains_on_an_unpaired_file_and_bad_labels_are_one_line(tmp_path):
    """KTO's own format: rows of prompt, completion and a true/false label (here under other column names), with
    more undesirable rows than desirable ones; held-out rows are unpaired too, scored by label accuracy."""
    import json
    rows = [{"q": f"max {a} {b} {c} =", "a": str(n), "good": n == max(a, b, c)}
            for a, b, c in [(1, 7, 3), (9, 2, 4), (5, 6, 0), (8, 3, 11)] * 5 for n in (a, b, c)]
    (tmp_path / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    flags = ["--loss-type", "kto", "--dataset", "kto.jsonl", "--prompt-key", "q", "--completion-key", "a",
             "--label-key", "good", "--kto-undesirable-weight", "0.5", "--max-len", "16", "--pairs-per-step", "8",
             "--steps", "3", "--eval-every", "0"]
    result = dpo([*flags, "--output-dir", str(tmp_path / "run")], tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "54 train rows / 6 eval rows" in output and "held-out label accuracy: " in output
    rows[3]["good"] = "yes"
    (tmp_path / "kto.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = dpo([*flags, "--output-dir", str(tmp_path / "r2")], tmp_path)
    assert_one_line_error(result, "kto.jsonl: row 3 column 'good': must be true or false, got 'yes'")
    result = dpo(["--dataset", "kto.jsonl", "--prompt-key", "q", "--completion-key", "a", "--label-key", "good",
                  "--output-dir", str(tmp_path / "r3")], tmp_path)
    assert_one_line_error(result, "unpaired rows ('a', 'good') train --loss-type kto")
