import collections

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.data.synthetic import (NUM_VALUES, NUMBERS_PER_PROMPT, build_tiny_tokenizer, make_synthetic_rows,
                                   synthetic_reward, tiny_model_config)


def prompt_numbers(prompt):
    return [int(word) for word in prompt.split()[1:-1]]


def test_splits_are_disjoint_deterministic_and_cover_every_triple():
    train, test = make_synthetic_rows("train"), make_synthetic_rows("test")
    assert make_synthetic_rows("train") == train and make_synthetic_rows("test") == test
    assert make_synthetic_rows("test", seed=1) != test
    train_prompts, test_prompts = {row["prompt"] for row in train}, {row["prompt"] for row in test}
    assert len(train_prompts) == len(train) and len(test_prompts) == len(test)
    assert len(train_prompts | test_prompts) == NUM_VALUES**NUMBERS_PER_PROMPT  # every ordered triple, each in one split
    # No test prompt is a reordering of a training prompt.
    number_sets = lambda rows: {tuple(sorted(prompt_numbers(row["prompt"]))) for row in rows}
    assert not number_sets(train) & number_sets(test)


def test_answers_are_the_largest_number_and_chance_is_low():
    test = make_synthetic_rows("test")
    for row in make_synthetic_rows("train")[:100] + test:
        assert row["answer"] == str(max(prompt_numbers(row["prompt"])))
    most_common_answer_count = collections.Counter(row["answer"] for row in test).most_common(1)[0][1]
    assert most_common_answer_count / len(test) < 0.2  # always guessing one number stays below 0.2


def test_tokenizer_round_trips_prompt_answer_and_save_load(tmp_path):
    tokenizer = build_tiny_tokenizer()
    assert tokenizer.chat_template is None
    prompt_ids = tokenizer("max 7 13 2 =")["input_ids"]
    assert len(prompt_ids) == 5 and tokenizer.unk_token_id not in prompt_ids  # one token per word, no BOS added
    assert tokenizer.decode(prompt_ids) == "max 7 13 2 ="
    answer_ids = tokenizer("13")["input_ids"]
    assert len(answer_ids) == 1
    response_ids = answer_ids + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(response_ids, skip_special_tokens=True) == "13"

    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded("max 7 13 2 =")["input_ids"] == prompt_ids
    assert (loaded.eos_token, loaded.pad_token) == ("<eos>", "<pad>")
    # specials, "max" and "=", the numbers, and "lookup" and "?" of --env lookup
    assert len(loaded) == len(tokenizer) == 3 + 2 + NUM_VALUES + 2


def test_reward_reads_the_first_number():
    assert synthetic_reward("max 7 13 2 =", "13", "13") == 1.0
    assert synthetic_reward("max 7 13 2 =", "= 13 7", "13") == 1.0  # words before the first number are ignored
    assert synthetic_reward("max 7 13 2 =", "7 13", "13") == 0.0  # only the first number counts
    assert synthetic_reward("max 7 13 2 =", "130", "13") == 0.0
    assert synthetic_reward("max 7 13 2 =", "max = =", "13") == 0.0
    assert synthetic_reward("max 7 13 2 =", "", "13") == 0.0


def test_config_builds_a_model_over_the_whole_vocabulary():
    tokenizer = build_tiny_tokenizer()
    config = tiny_model_config(tokenizer)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id and config.pad_token_id == tokenizer.pad_token_id
    assert config.bos_token_id is not None
    model = AutoModelForCausalLM.from_config(config)
    assert model.get_input_embeddings().weight.shape[0] == len(tokenizer)
    input_ids = torch.tensor([tokenizer("max 7 13 2 =")["input_ids"]])
    assert model(input_ids=input_ids).logits.shape == (1, 5, len(tokenizer))
