"""The built-in tiny model (common/train/tiny_model.py): one token per word of the built-in task, and a config that
builds a model over the whole vocabulary."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.train.tiny_model import NUM_VALUES, build_tiny_tokenizer, tiny_model_config


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
