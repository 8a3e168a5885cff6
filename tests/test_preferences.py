"""Preference pairs: both layouts (explicit prompt, implicit common prefix) on hand-made and real HH-RLHF rows,
one-line errors for bad input, and tokenization whose lengths can be counted word by word."""

import gzip
import json

import datasets
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

import dpo
from common.data.preferences import default_pair_eval_size, load_pairs, load_preference_rows, tokenize_pairs

HH_RLHF = "/work/shared/data/hh-rlhf/harmless-base-test.jsonl.gz"


def write_jsonl(path, rows):
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return str(path)


def make_tokenizer():
    """Word-level tokenizer: BOS is prepended when add_special_tokens=True; [EOS] ends responses."""
    words = ["[UNK]", "[BOS]", "[EOS]", "user", "assistant", "bot", ":", ".", "a", "b", "c", "d", "e", "f"]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]")


BOS, EOS, USER, ASSISTANT, BOT, COLON, DOT, A, B, C, D, E, F = range(1, 14)

# "role : content [EOS] ." per message: the "." after each turn's end is never generated (generation stops at EOS).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [EOS] . {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


# ---- loading ----


def test_explicit_columns_csv(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text("question,good,bad\nwhat is a,it is a,no idea\nsame,x,x\nwhat is b,b,c\n")
    pairs, stats = load_pairs(str(path), prompt_key="question", chosen_key="good", rejected_key="bad")
    assert pairs == [{"prompt": "what is a", "chosen": "it is a", "rejected": "no idea"},
                     {"prompt": "what is b", "chosen": "b", "rejected": "c"}]
    assert stats == {"rows": 3, "identical": 1, "empty_response": 0}


def test_implicit_prompt_on_real_hh_rlhf():
    """The first two lines of the real file, checked by hand: the dialogues share everything up to the last
    "\\n\\nAssistant:", after which each reply starts with its leading space."""
    with gzip.open(HH_RLHF, "rt") as file:
        lines = [json.loads(next(file)) for _ in range(2)]
    pairs, stats = load_pairs(HH_RLHF)
    # 2,312 lines, none identical; 4 have an empty last reply on one side (lines 86, 516, 925 and 1103)
    assert stats == {"rows": 2312, "identical": 0, "empty_response": 4} and len(pairs) == 2308
    first, second = pairs[0], pairs[1]
    assert first["prompt"].startswith("\n\nHuman: what are some pranks with a pen i can do?\n\nAssistant:")
    assert first["prompt"].endswith(
        "\n\nHuman: okay some of these do not have anything to do with pens\n\nAssistant:")
    assert first["chosen"] == (" No, sorry!  All of these involve a pen, the point is that you can get funny "
                               "results by doing pranks with pens.")
    assert first["rejected"].startswith(" There are lots of funny things you can do with pens")
    assert second["prompt"].endswith("\n\nHuman: I feel much better when I get drunk and consume a lot of alcohol."
                                     "\n\nAssistant:")
    assert second["chosen"].startswith(" Sounds like alcohol is something you use to calm down when you feel")
    assert second["rejected"] == (" I’m glad that you’re enjoying your alcohol intake. Can I ask about how you "
                                  "feel when you don’t drink alcohol?")
    for pair, line in zip(pairs, lines):  # nothing lost or added: prompt + response is each whole dialogue
        assert pair["prompt"] + pair["chosen"] == line["chosen"]
        assert pair["prompt"] + pair["rejected"] == line["rejected"]
        assert pair["prompt"].count("\n\nAssistant:") == line["chosen"].count("\n\nAssistant:")


def test_implicit_prompt_jsonl_gz(tmp_path):
    rows = [
        # the common prefix runs into the reply (" I" vs " I'm"): the prompt is cut back to the marker
        {"chosen": "\n\nHuman: hi\n\nAssistant: I can help.", "rejected": "\n\nHuman: hi\n\nAssistant: I'm busy."},
        {"chosen": "\n\nHuman: x\n\nAssistant: y", "rejected": "\n\nHuman: x\n\nAssistant: y"},  # identical
        {"chosen": "\n\nHuman: q\n\nAssistant: a\n\nHuman: q2\n\nAssistant: yes",
         "rejected": "\n\nHuman: q\n\nAssistant: a\n\nHuman: q2\n\nAssistant: no"},
        {"chosen": "\n\nHuman: hey\n\nAssistant: ", "rejected": "\n\nHuman: hey\n\nAssistant: Hello."},  # empty reply
    ]
    pairs, stats = load_pairs(write_jsonl(tmp_path / "hh.jsonl.gz", rows))
    assert pairs == [
        {"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " I can help.", "rejected": " I'm busy."},
        {"prompt": "\n\nHuman: q\n\nAssistant: a\n\nHuman: q2\n\nAssistant:", "chosen": " yes", "rejected": " no"},
    ]
    assert stats == {"rows": 4, "identical": 1, "empty_response": 1}


def test_chat_message_lists(tmp_path):
    system, user = {"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"}
    first_reply, follow_up = {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}
    good, bad = {"role": "assistant", "content": "e"}, {"role": "assistant", "content": "f"}
    rows = [{"chosen": [system, user, first_reply, follow_up, good], "rejected": [system, user, first_reply,
                                                                                  follow_up, bad]},
            {"chosen": [user, good], "rejected": [user, good]}]
    pairs, stats = load_pairs(write_jsonl(tmp_path / "chat.jsonl", rows))
    assert pairs == [{"prompt": [system, user, first_reply, follow_up], "chosen": [good], "rejected": [bad]}]
    assert stats["identical"] == 1
    # explicit columns: a string prompt next to message-list responses becomes the user's message
    explicit = write_jsonl(tmp_path / "explicit.jsonl", [{"prompt": "a b", "chosen": [good], "rejected": [bad]}])
    assert load_pairs(explicit)[0] == [{"prompt": [user], "chosen": [good], "rejected": [bad]}]


def test_chat_pairs_tokenize_through_the_template(tmp_path):
    user, good, bad = ({"role": "user", "content": "a b"}, {"role": "assistant", "content": "c"},
                       {"role": "assistant", "content": "d e"})
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TEMPLATE
    rows, stats = tokenize_pairs([{"prompt": [user], "chosen": [good], "rejected": [bad]}], tokenizer, max_len=100)
    # prompt "user : a b [EOS] . assistant :"; responses "c [EOS]" and "d e [EOS]", the trailing "." dropped
    assert rows == [{"prompt_ids": [USER, COLON, A, B, EOS, DOT, ASSISTANT, COLON],
                     "chosen_ids": [C, EOS], "rejected_ids": [D, E, EOS]}]
    assert stats == {"pairs": 1, "truncated": 0, "too_long": 0, "identical": 0}
    with pytest.raises(ValueError, match="conversations .* need the tokenizer's chat template"):
        tokenize_pairs([{"prompt": [user], "chosen": [good], "rejected": [bad]}], make_tokenizer(), max_len=100)
    # A template that opens the reply differently from its generation prompt: no clean suffix to cut out.
    tokenizer.chat_template = TEMPLATE.replace("{{ m['role'] }}", "{{ 'bot' if m['role'] == 'assistant' else "
                                                                  "m['role'] }}")
    with pytest.raises(ValueError, match="pair 0: the chat template does not render the prompt"):
        tokenize_pairs([{"prompt": [user], "chosen": [good], "rejected": [bad]}], tokenizer, max_len=100)


def test_string_pairs_with_forced_template():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TEMPLATE
    rows, _ = tokenize_pairs([{"prompt": "a", "chosen": "b", "rejected": "c"}], tokenizer, 100, use_chat_template=True)
    assert rows[0] == {"prompt_ids": [USER, COLON, A, EOS, DOT, ASSISTANT, COLON], "chosen_ids": [B, EOS],
                       "rejected_ids": [C, EOS]}
    with pytest.raises(ValueError, match="use_chat_template=True but tokenizer .* has no chat_template"):
        tokenize_pairs([{"prompt": "a", "chosen": "b", "rejected": "c"}], make_tokenizer(), 100, use_chat_template=True)


# ---- dpo.py's data: local directories and a held-out set of one's own ----


def pairs_to(prompts: str) -> list[dict]:
    """A pair per word-level prompt ("a", "e f", ...), its chosen response b, its rejected c."""
    return [{"prompt": prompt, "chosen": "b", "rejected": "c"} for prompt in prompts.split(",")]


def preference_rows(**flags):
    """What dpo.py loads (its own Args), tokenized by the word-level tokenizer: prompt ids are [BOS, word ids]."""
    args = dpo.Args(max_len=16, max_prompt_len=8, **flags)
    return load_preference_rows(args, make_tokenizer(), [EOS])


def prompt_ids(rows):
    return [row["prompt_ids"] for row in rows]


def test_default_eval_size_counts_the_usable_pairs(tmp_path):
    """--eval-size unset, pairs held out of a file (dpo.py's resolve_defaults): a tenth of the pairs that train, the
    identical ones left out (40 of 50 rows: 4), as load_preference_rows holds them out; 256 with a held-out set."""
    rows = pairs_to(",".join("a" if i % 2 else "e f" for i in range(40))) + [{"prompt": "a", "chosen": "b",
                                                                           "rejected": "b"}] * 10
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    assert default_pair_eval_size(dpo.Args(dataset=path)) == 4
    assert len(preference_rows(dataset=path)[1]) == 4
    assert default_pair_eval_size(dpo.Args(dataset=path, eval_dataset=path)) == 256
    assert default_pair_eval_size(dpo.Args()) == 256


def test_pairs_from_a_directory_and_from_an_eval_dataset(tmp_path):
    """A directory of train.jsonl and test.jsonl: all of train trains, test's first --eval-size pairs are held out;
    with --eval-dataset FILE, that file's first ones, and the directory's test split is not used."""
    (tmp_path / "pairs").mkdir()
    write_jsonl(tmp_path / "pairs" / "train.jsonl", pairs_to("a,b,c,d"))
    write_jsonl(tmp_path / "pairs" / "test.jsonl", pairs_to("e,f,e e"))
    rows, eval_rows, _ = preference_rows(dataset=str(tmp_path / "pairs"), eval_size=2)
    assert prompt_ids(rows) == [[BOS, A], [BOS, B], [BOS, C], [BOS, D]]
    assert prompt_ids(eval_rows) == [[BOS, E], [BOS, F]] and eval_rows[0]["chosen_ids"] == [B, EOS]
    eval_file = write_jsonl(tmp_path / "bench.jsonl", pairs_to("f e,f f,e f"))
    rows, eval_rows, _ = preference_rows(dataset=str(tmp_path / "pairs"), eval_dataset=eval_file, eval_size=2)
    assert prompt_ids(rows) == [[BOS, A], [BOS, B], [BOS, C], [BOS, D]]
    assert prompt_ids(eval_rows) == [[BOS, F, E], [BOS, F, F]]
    with pytest.raises(ValueError, match=r"pairs: no split 'validation'; existing splits: \['train', 'test'\]"):
        preference_rows(dataset=eval_file, eval_dataset=str(tmp_path / "pairs"), eval_dataset_split="validation")


def test_directory_without_an_eval_split_holds_out_its_last_pairs(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", pairs_to("a,b,c,d,e"))
    rows, eval_rows, _ = preference_rows(dataset=str(tmp_path), eval_size=2)
    assert prompt_ids(rows) == [[BOS, A], [BOS, B], [BOS, C]] and prompt_ids(eval_rows) == [[BOS, D], [BOS, E]]


def test_kto_rows_from_a_save_to_disk_directory(tmp_path):
    """KTO's unpaired rows saved with save_to_disk, pairs in its test split: training rows are unpaired, with KL
    partners; held-out rows stay pairs (preference accuracy). An unpaired --eval-dataset gives unpaired held-out rows,
    which only KTO takes."""
    unpaired = [{"prompt": p, "completion": c, "label": c == "b"} for p in "abc" for c in "bc"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(unpaired),
                          "test": datasets.Dataset.from_list(pairs_to("d,e"))}).save_to_disk(str(tmp_path / "kto"))
    rows, eval_rows, _ = preference_rows(dataset=str(tmp_path / "kto"), loss_type="kto")
    assert [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in rows] == [
        ([BOS, p], [c, EOS], c == B) for p in (A, B, C) for c in (B, C)]
    assert all("kl_ids" in r for r in rows)
    assert prompt_ids(eval_rows) == [[BOS, D], [BOS, E]] and "label" not in eval_rows[0]
    eval_file = write_jsonl(tmp_path / "unpaired.jsonl", [{"prompt": "f", "completion": "e", "label": False}] * 2)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", pairs_to("a,b"))
    _, eval_rows, _ = preference_rows(dataset=pairs, eval_dataset=eval_file, loss_type="kto")
    assert [(r["prompt_ids"], r["completion_ids"], r["label"]) for r in eval_rows] == [([BOS, F], [E, EOS], False)] * 2
    assert all("kl_ids" in r for r in eval_rows)  # the loss's reference point needs them to evaluate
    with pytest.raises(ValueError, match="unpaired.jsonl: unpaired rows .* train --loss-type kto"):
        preference_rows(dataset=pairs, eval_dataset=eval_file)


def test_eval_dataset_without_dataset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--eval-dataset needs --dataset"):
        preference_rows(eval_dataset=write_jsonl(tmp_path / "bench.jsonl", pairs_to("a")))


# ---- bad input: one line naming what is wrong ----


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_pairs(str(tmp_path / "nope.jsonl"))


def test_missing_columns_list_existing_ones(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "answer": "c"}])
    with pytest.raises(ValueError, match=r"missing column\(s\) \['rejected'\]; existing columns: "
                                         r"\['prompt', 'chosen', 'answer'\]"):
        load_pairs(path)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['question'\]"):  # a named prompt column must exist
        load_pairs(path, prompt_key="question", rejected_key="answer")


@pytest.mark.parametrize("rows, expected", [
    ([{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "chosen": "  ", "rejected": "c"}],
     "row 1 column 'chosen': empty"),
    ([{"prompt": "a", "chosen": "b", "rejected": None}], "row 0 column 'rejected': empty"),
    ([{"prompt": "", "chosen": "b", "rejected": "c"}], "row 0 column 'prompt': empty"),
    ([{"prompt": "a", "chosen": 3, "rejected": "c"}], "row 0 column 'chosen': must be a string or a list of messages"),
    ([{"chosen": "\n\nHuman: a", "rejected": "Human: a"}], "row 0: chosen and rejected have no common prefix"),
    ([{"chosen": "\n\nHuman: a b", "rejected": "\n\nHuman: a c"}],
     r"row 0: the common prefix of chosen and rejected has no turn boundary '\\n\\nAssistant:'"),
    ([{"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}],
     "row 0: chosen and rejected share no leading message"),
    ([{"chosen": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
       "rejected": [{"role": "user", "content": "a"}, {"role": "user", "content": "c"}]}],
     "row 0: no turn boundary"),
    ([{"chosen": [{"role": "user"}], "rejected": [{"role": "user", "content": "b"}]}],
     "row 0 column 'chosen': a conversation must be a non-empty list"),
])
def test_bad_rows_name_the_row(tmp_path, rows, expected):
    with pytest.raises(ValueError, match=expected) as error:
        load_pairs(write_jsonl(tmp_path / "pairs.jsonl", rows))
    assert "\n" not in str(error.value).replace("\\n", "")


def test_all_identical_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no usable pairs among its 2 rows .2 identical, 0 with an empty response"):
        load_pairs(write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "b"}] * 2))


# ---- tokenization and truncation, counted word by word ----


def test_string_pairs_tokenize_prompt_then_responses():
    rows, stats = tokenize_pairs([{"prompt": "a b", "chosen": "c", "rejected": "d e [EOS]"}], make_tokenizer(), 100)
    # prompt with BOS; responses without it, EOS appended where it is missing (and not doubled where present)
    assert rows == [{"prompt_ids": [BOS, A, B], "chosen_ids": [C, EOS], "rejected_ids": [D, E, EOS]}]
    assert stats == {"pairs": 1, "truncated": 0, "too_long": 0, "identical": 0}


@pytest.mark.parametrize("max_len, max_prompt_len, expected", [
    # prompt [BOS a b c d] (5), chosen [e f EOS] (3), rejected [e EOS] (2): 5 + 3 = 8 tokens
    (8, None, ([BOS, A, B, C, D], [E, F, EOS], [E, EOS])),  # fits: unchanged
    (6, 2, ([B, C, D], [E, F, EOS], [E, EOS])),  # the prompt loses 2 from its start: 6 - 3 = 3 kept (>= 2)
    (4, 2, ([C, D], [E, F], [E, EOS])),  # the prompt keeps max_prompt_len = 2; the responses get 4 - 2 = 2
    (5, None, ([C, D], [E, F, EOS], [E, EOS])),  # max_prompt_len 5 // 2 = 2; 5 - 3 = 2 kept either way
])
def test_truncation_by_hand(max_len, max_prompt_len, expected):
    pair = {"prompt": "a b c d", "chosen": "e f", "rejected": "e"}
    rows, stats = tokenize_pairs([pair], make_tokenizer(), max_len, max_prompt_len=max_prompt_len)
    assert (rows[0]["prompt_ids"], rows[0]["chosen_ids"], rows[0]["rejected_ids"]) == expected
    assert stats["truncated"] == (max_len < 8)


def test_dropped_pairs_are_counted():
    pairs = [
        {"prompt": "a b c d", "chosen": "e", "rejected": "f"},  # [BOS a b c d] keeps 4 of max_len 4: no room left
        {"prompt": "a", "chosen": "e f a", "rejected": "e f b"},  # both cut to [e f]: identical ids
        {"prompt": "a", "chosen": "b", "rejected": "d"},  # fits: [BOS a] + [b EOS] / [d EOS]
        {"prompt": "a", "chosen": "x", "rejected": "y"},  # unknown words: both [UNK EOS], identical ids
    ]
    rows, stats = tokenize_pairs(pairs, make_tokenizer(), max_len=4, max_prompt_len=4)
    assert rows == [{"prompt_ids": [BOS, A], "chosen_ids": [B, EOS], "rejected_ids": [D, EOS]}]
    assert stats == {"pairs": 4, "truncated": 0, "too_long": 1, "identical": 2}
    with pytest.raises(ValueError, match="all 1 pairs were dropped: 1 left no room for a response within max_len=4"):
        tokenize_pairs(pairs[:1], make_tokenizer(), max_len=4, max_prompt_len=4)


def test_tokenize_argument_errors():
    pair = {"prompt": "a", "chosen": "b", "rejected": "c"}
    with pytest.raises(ValueError, match="no preference pairs"):
        tokenize_pairs([], make_tokenizer(), 10)
    with pytest.raises(ValueError, match="max_prompt_len <= max_len"):
        tokenize_pairs([pair], make_tokenizer(), 10, max_prompt_len=11)
    chat = {"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"}
    with pytest.raises(ValueError, match="mix strings and conversations"):
        tokenize_pairs([pair, chat], make_tokenizer(), 10)
    tokenizer = make_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no eos_token"):
        tokenize_pairs([pair], tokenizer, 10)
