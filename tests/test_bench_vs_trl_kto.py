"""benchmarks/bench_vs_trl.py kto: TRL gets the very rows ours trains on, step by step (ours' pairs split into a
desirable and an undesirable row, the pairs ours drops left out, in the order ours' sampler draws them), and the
held-out preference accuracy computed for TRL's model is ours' definition (a padded batch == one sequence at a time ==
the log-probs summed by hand; a tie counts as wrong). With TRL installed, its worker runs two steps on a tiny model."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_vs_trl import (kto_rows, ours_command, pair_logps, parse_args, preference_metrics,  # noqa: E402
                          trl_command)
from scripts.random_data import pair_rows  # noqa: E402
from scripts.random_model import save_random_model  # noqa: E402

import dpo
from common.data.preferences import load_preference_rows, tokenize_pairs
from common.data.prompts import PromptSampler
from common.train.model import load_tokenizer, stop_token_ids

PAIRS_PER_STEP, EVAL_SIZE, MAX_LEN = 8, 6, 64
NO_CUT = 2048  # longer than any prompt + response of pair_rows (835 + 557 tokens at most)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("random_model") / "tiny"
    save_random_model("tiny", str(path))
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """40 pairs of HH-RLHF-like lengths (long prompts get cut at MAX_LEN), one of which ours drops: its two responses
    are words outside the vocabulary, both <unk> once tokenized."""
    rows = pair_rows(40, seed=0)
    rows.insert(5, {"prompt": "0 1 2", "chosen": "unknown", "rejected": "unseen"})
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def bench_args(model_dir, data, *flags, max_len=MAX_LEN):
    return parse_args(["kto", "--model", model_dir, "--data", data, "--out", "unused", "--eval-size", str(EVAL_SIZE),
                       "--pairs-per-step", str(PAIRS_PER_STEP), "--max-len", str(max_len), *flags])


def ours_rows(model_dir, data, max_len):
    """What dpo.py --loss-type kto loads, with its own Args and defaults."""
    args = dpo.Args(model=model_dir, dataset=data, loss_type="kto", eval_size=EVAL_SIZE, max_len=max_len,
                    pairs_per_step=PAIRS_PER_STEP)
    dpo.resolve_defaults(args)
    tokenizer = load_tokenizer(model_dir)
    return load_preference_rows(args, tokenizer, stop_token_ids(model_dir, tokenizer))


@pytest.mark.parametrize("max_len", [NO_CUT, MAX_LEN])
@pytest.mark.parametrize("steps", [None, 10])  # one epoch; more than one (the sampler reshuffles)
def test_trl_trains_on_ours_rows_step_by_step(model_dir, data, steps, max_len):
    args = bench_args(model_dir, data, *(["--steps", str(steps)] if steps else []), max_len=max_len)
    tokenizer = load_tokenizer(model_dir)
    trl_rows, held_out, trl_steps = kto_rows(args, tokenizer)
    rows, eval_rows, stats = ours_rows(model_dir, data, max_len)
    assert stats["identical"] == 1 and len(rows) == 2 * (40 + 1 - EVAL_SIZE - 1)  # the unknown-word pair is dropped
    assert trl_steps == (steps or len(rows) // PAIRS_PER_STEP) and len(trl_rows) == trl_steps * PAIRS_PER_STEP
    assert not any(row["prompt"] == "0 1 2" for row in trl_rows)
    # The held-out pairs are ours', token for token.
    pair = lambda row: (row["prompt_ids"], row["chosen_ids"], row["rejected_ids"])
    assert [pair(r) for r in held_out] == [pair(r) for r in eval_rows] and len(held_out) == EVAL_SIZE
    if max_len != NO_CUT:  # a row's cut depends on its pair's other response: only uncut rows read back alone
        assert stats["truncated"] > 0
        return
    # TRL's text, tokenized as ours tokenizes, is ours' sampler's rows, batch after batch.
    assert stats["truncated"] == 0
    tokenized, _ = tokenize_pairs(trl_rows, tokenizer, max_len, None, max_len // 2,
                                  stop_token_ids(model_dir, tokenizer), ("completion",))
    sampler = PromptSampler(rows, PAIRS_PER_STEP, 0, 1, args.seed)
    drawn = [row for _ in range(trl_steps) for row in sampler.next_batch()]
    key = lambda row: (row["prompt_ids"], row["completion_ids"], row["label"])
    assert [key(r) for r in tokenized] == [key(r) for r in drawn]
    assert sum(r["label"] for r in drawn) > 0 and sum(not r["label"] for r in drawn) > 0


def test_pair_logps_padded_equals_one_at_a_time_and_by_hand(model_dir, data):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    _, held_out, _ = kto_rows(bench_args(model_dir, data), load_tokenizer(model_dir))
    padded, alone = pair_logps(model, held_out, micro_batch=5), pair_logps(model, held_out, micro_batch=1)
    assert padded.shape == (EVAL_SIZE, 2)
    assert torch.allclose(padded, alone, atol=1e-4)
    row = held_out[0]  # the rejected response's log-probs, summed by hand
    ids = row["prompt_ids"] + row["rejected_ids"]
    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    by_hand = sum(logps[t - 1, ids[t]].item() for t in range(len(row["prompt_ids"]), len(ids)))
    assert padded[0, 1].item() == pytest.approx(by_hand, abs=1e-3)


def test_preference_metrics_by_hand():
    # policy == reference: every margin 0, a tie, so no pair is right; DPO's loss ln 2
    assert preference_metrics(torch.zeros(4, 2), beta=0.1) == {
        "eval/preference_accuracy": 0.0, "eval/margin": 0.0, "eval/loss": pytest.approx(math.log(2))}
    # margins beta * (chosen - rejected) = 0.5, -0.5, 0: one right of three
    metrics = preference_metrics(torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]]), beta=0.5)
    expected_loss = -(F.logsigmoid(torch.tensor(0.5)) + F.logsigmoid(torch.tensor(-0.5))).item() / 3 + math.log(2) / 3
    assert metrics == {"eval/preference_accuracy": pytest.approx(1 / 3), "eval/margin": pytest.approx(0.0),
                       "eval/loss": pytest.approx(expected_loss)}


def test_both_sides_get_the_same_settings(model_dir, data):
    args = bench_args(model_dir, data, "--beta", "0.2", "--lr", "1e-6", "--steps", "5")
    ours = ours_command(args, 3, "OUT", 29503)
    flag = lambda name: ours[ours.index(name) + 1]
    assert ours[3:5] == ["--master-port", "29503"] and ours[5].endswith("dpo.py")
    assert (flag("--loss-type"), flag("--beta"), flag("--lr"), flag("--steps"), flag("--pairs-per-step"),
            flag("--max-len"), flag("--eval-size"), flag("--seed")) == ("kto", "0.2", "1e-06", "5", "8", "64", "6", "3")
    assert (flag("--kto-desirable-weight"), flag("--kto-undesirable-weight")) == ("1", "1")
    worker = parse_args(trl_command(args, 3, "OUT")[2:])  # the TRL worker reads back what the bench was given
    assert worker.trl_worker and worker.seed == 3 and worker.out == "OUT"
    assert {k: v for k, v in vars(worker).items() if k not in ("trl_worker", "seed", "out")} == \
        {k: v for k, v in vars(args).items() if k not in ("trl_worker", "seed", "out")}


def test_trl_worker_two_steps(model_dir, data, tmp_path):
    """TRL's KTOTrainer on the tiny model, two steps of 8 rows: at step 1 the policy is the reference, so TRL's KTO
    loss is 1 - sigmoid(0) = 0.5 and held-out accuracy is 0 before training (every margin a tie)."""
    pytest.importorskip("trl")
    out = tmp_path / "bench"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_vs_trl.py"), "kto", "--model", model_dir, "--data", data,
               "--out", str(out), "--eval-size", str(EVAL_SIZE), "--pairs-per-step", str(PAIRS_PER_STEP),
               "--max-len", str(MAX_LEN), "--trl-micro-batch", "4", "--steps", "2", "--eval-every", "1",
               "--lr", "1e-3", "--only", "trl"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TQDM_DISABLE": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "trl_s1" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, "eval/preference_accuracy": 0.0, "eval/margin": 0.0,
                       "eval/loss": pytest.approx(math.log(2))}
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["loss/preference"] == pytest.approx(0.5, abs=1e-5)
    assert rows[1]["kto/kl"] == pytest.approx(0, abs=1e-4)
    assert all(r["time/step"] > 0 and 0 <= r["eval/preference_accuracy"] <= 1 for r in rows[1:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"]["trl_s1"]["steps"] == 2 and "KL" in summary["differences"]
