"""scripts/random_data.py: prompts of exactly N tokens and pairs of HH-RLHF-like lengths, as the scripts tokenize
them, under the tokenizer a random_model.py directory loads back with."""

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from random_data import HH_LENGTHS, pair_rows, prompt_rows  # noqa: E402
from random_model import full_vocab_tokenizer, save_random_model  # noqa: E402

from common.data.preferences import load_pairs, tokenize_pairs
from common.data.prompts import load_train_eval, tokenize_prompts
from common.train.model import load_tokenizer, stop_token_ids

HH_MEANS = {"prompt": 125.3, "chosen": 40.8, "rejected": 51.0}  # measured, in the module docstring


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("random_model") / "tiny"
    save_random_model("tiny", str(path))
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.mark.parametrize("prompt_len", [1, 7, 1024])
def test_every_prompt_is_exactly_n_tokens(model_dir, tmp_path, prompt_len):
    data = write_jsonl(tmp_path / "prompts.jsonl", prompt_rows(20, prompt_len, seed=0))
    train, held_out = load_train_eval(data, "prompt", "answer", eval_size=4)  # as ppo.py reads --dataset
    tokenized, dropped = tokenize_prompts(train + held_out, load_tokenizer(model_dir), max_prompt_len=prompt_len)
    assert dropped == 0 and {len(row["prompt_ids"]) for row in tokenized} == {prompt_len}
    # The same under the word-level tokenizer random_model.py saves (AutoTokenizer may build another from it).
    words = full_vocab_tokenizer(4096)
    assert {len(words(row["prompt"])["input_ids"]) for row in train} == {prompt_len}


def test_pairs_tokenize_to_their_drawn_lengths_with_hh_rlhf_means(model_dir, tmp_path):
    rows = pair_rows(2000, seed=0)
    pairs, stats = load_pairs(write_jsonl(tmp_path / "pairs.jsonl", rows))  # as dpo.py reads --dataset
    assert len(pairs) == 2000 and stats["identical"] == stats["empty_response"] == 0
    tokenizer = load_tokenizer(model_dir)
    tokenized, token_stats = tokenize_pairs(pairs, tokenizer, max_len=4096,
                                            stop_ids=stop_token_ids(model_dir, tokenizer))
    assert token_stats["truncated"] == token_stats["identical"] == 0 and len(tokenized) == 2000
    for row, ids in zip(rows, tokenized):  # a digit per token; each response ends in the EOS dpo.py appends
        assert len(ids["prompt_ids"]) == len(row["prompt"].split())
        assert len(ids["chosen_ids"]) == len(row["chosen"].split()) + 1
        assert ids["chosen_ids"][-1] == ids["rejected_ids"][-1] == tokenizer.eos_token_id
    for column, key in [("prompt", "prompt_ids"), ("chosen", "chosen_ids"), ("rejected", "rejected_ids")]:
        lengths = [len(ids[key]) for ids in tokenized]
        assert min(lengths) >= HH_LENGTHS[column][0] and max(lengths) <= HH_LENGTHS[column][-1]
        assert statistics.mean(lengths) == pytest.approx(HH_MEANS[column], rel=0.08)


def test_same_seed_same_rows():
    assert prompt_rows(3, 5, seed=1) == prompt_rows(3, 5, seed=1) != prompt_rows(3, 5, seed=2)
    assert pair_rows(3, seed=1) == pair_rows(3, seed=1) != pair_rows(3, seed=2)
