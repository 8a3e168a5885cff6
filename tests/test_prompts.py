import gzip
import json
import sys
import types

import datasets
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from common.data.prompts import PromptSampler, default_prompt_eval_size, load_rows, load_train_eval, tokenize_prompts

# Numeric answers, as in GSM8K-style files: they come back as text.
ROWS = [{"question": "one plus one", "answer": 2}, {"question": "two plus two", "answer": 4}]


def write_rows(path, rows):
    if path.name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.name.endswith(".jsonl.gz"):
        path.write_bytes(gzip.compress("".join(json.dumps(row) + "\n" for row in rows).encode()))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        path.write_text("question,answer\n" + "".join(f"{r['question']},{r['answer']}\n" for r in rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def make_tokenizer():
    """Word-level tokenizer over a tiny vocabulary; BOS is prepended when add_special_tokens=True."""
    words = ["[UNK]", "[BOS]", "user", "assistant", ":", "one", "two", "plus", "a", "b", "c", "d"]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="[BOS]")


# ---- loading ----


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv", ".jsonl.gz"])
def test_load_local_file(tmp_path, suffix):
    path = write_rows(tmp_path / f"data{suffix}", ROWS)
    rows = load_rows(path, "ignored", "question", "answer")
    assert rows == [{"prompt": "one plus one", "answer": "2"}, {"prompt": "two plus two", "answer": "4"}]


def test_unknown_local_format_is_named(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("one plus one\n")
    with pytest.raises(ValueError, match="a local file must end in one of .jsonl, .json, .parquet, .csv"):
        load_rows(str(path), "train", "question", "answer")


def test_conversation_prompts(tmp_path):
    """A prompt column of chat messages (the conversational format of many hub datasets): the template renders the
    whole conversation; the reward sees the last user message."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one plus one"}]
    path = write_rows(tmp_path / "chat.jsonl", [{"question": messages, "answer": 2}])
    rows = load_rows(path, "train", "question", "answer")
    assert rows == [{"prompt": "one plus one", "answer": "2", "messages": messages}]
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    kept, _ = tokenize_prompts(rows, tokenizer, max_prompt_len=100)
    assert tokenizer.decode(kept[0]["prompt_ids"]) == "[UNK] : [UNK] [UNK] user : one plus one"
    with pytest.raises(ValueError, match="conversations .* need the tokenizer's chat template"):
        tokenize_prompts(rows, make_tokenizer(), max_prompt_len=100)
    bad = write_rows(tmp_path / "bad.jsonl", [{"question": [{"role": "assistant", "content": "hi"}], "answer": 1}])
    with pytest.raises(ValueError, match="row 0 column 'question': the conversation has no 'user' message"):
        load_rows(bad, "train", "question", "answer")


def test_missing_file_is_named(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_rows(path, "train", "question", "answer")


def test_missing_column_lists_existing_columns(tmp_path):
    path = write_rows(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(ValueError) as error:
        load_rows(path, "train", "problem", "answer")
    message = str(error.value)
    assert "problem" in message and "question" in message and "answer" in message


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_rows(str(path), "train", "question", "answer")


def test_empty_parquet(tmp_path):
    path = str(tmp_path / "empty.parquet")
    datasets.Dataset.from_dict({"question": [], "answer": []}).to_parquet(path)
    with pytest.raises(ValueError, match="empty"):
        load_rows(path, "train", "question", "answer")


def test_malformed_file_is_one_short_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "a", "answer": 1}\n{"question": \n')
    with pytest.raises(ValueError, match="bad.jsonl") as error:
        load_rows(str(path), "train", "question", "answer")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "rows, expected",
    [
        ([{"q": "a", "a": [1, 2]}, {"q": "b", "a": [3]}], ["row 0", "'a'", "list"]),
        ([{"q": "a", "a": {"x": 1}}], ["row 0", "'a'", "dict"]),
        ([{"q": "a", "a": "1"}, {"q": "b", "a": None}], ["row 1", "'a'", "NoneType"]),
        ([{"q": 7, "a": "1"}], ["row 0", "'q'", "string"]),
        ([{"q": "a", "a": "1"}, {"q": "b", "a": "2"}, {"q": "  \n", "a": "3"}], ["row 2", "'q'", "empty"]),
    ],
)
def test_bad_values_name_row_and_column(tmp_path, rows, expected):
    path = write_rows(tmp_path / "data.jsonl", rows)
    with pytest.raises(ValueError) as error:
        load_rows(path, "train", "q", "a")
    assert all(word in str(error.value) for word in expected), str(error.value)


def test_hub_failure_is_short_and_suggests_local_file(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'org/name' on the Hub\n" + "long trace\n" * 50)

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ValueError) as error:
        load_rows("org/name", "train", "question", "answer")
    message = str(error.value)
    assert "org/name" in message and "hub" in message and ".jsonl" in message and "\n" not in message
    assert isinstance(error.value.__cause__, ConnectionError)


# ---- train / eval split ----


def test_local_file_hold_out_is_seeded_and_disjoint(tmp_path):
    rows = [{"question": f"q{i}", "answer": i} for i in range(20)]
    path = write_rows(tmp_path / "data.jsonl", rows)
    train, evaluation = load_train_eval(path, "question", "answer", eval_size=5, seed=3)
    assert len(train) == 15 and len(evaluation) == 5
    prompts = [row["prompt"] for row in train + evaluation]
    assert sorted(prompts) == sorted(f"q{i}" for i in range(20))  # disjoint and complete
    assert load_train_eval(path, "question", "answer", eval_size=5, seed=3) == (train, evaluation)
    _, other_eval = load_train_eval(path, "question", "answer", eval_size=5, seed=4)
    assert other_eval != evaluation
    with pytest.raises(ValueError, match="eval_size"):
        load_train_eval(path, "question", "answer", eval_size=20)


@pytest.mark.parametrize("num_rows, held_out", [(36, 3), (300, 30), (5000, 256), (9, 1)])
def test_default_hold_out_is_a_tenth_of_a_small_file(tmp_path, num_rows, held_out):
    path = write_rows(tmp_path / "data.jsonl", [{"question": f"q{i}", "answer": i} for i in range(num_rows)])
    train, evaluation = load_train_eval(path, "question", "answer")
    assert len(evaluation) == held_out and len(train) == num_rows - held_out


def test_default_eval_size_is_the_hold_out_the_data_gets(tmp_path):
    """--eval-size unset (a script's resolve_defaults): a tenth of a small file, counted as load_train_eval holds it
    out; 256 where the held-out rows come from elsewhere (an eval split, --eval-dataset, the built-in task)."""
    def flags(**given):
        return types.SimpleNamespace(**{"dataset": None, "dataset_config": None, "eval_split": "test",
                                        "eval_dataset": None, **given})

    for num_rows in (36, 300, 5000, 9):
        path = write_rows(tmp_path / f"data{num_rows}.jsonl", numbered("q", num_rows))
        size = default_prompt_eval_size(flags(dataset=path))
        assert size == len(load_train_eval(path, "question", "answer")[1]) == min(256, max(1, num_rows // 10))
    (tmp_path / "split").mkdir()
    write_rows(tmp_path / "split" / "train.jsonl", numbered("t", 10))
    write_rows(tmp_path / "split" / "test.jsonl", numbered("e", 4))
    assert default_prompt_eval_size(flags(dataset=str(tmp_path / "split"))) == 256
    assert default_prompt_eval_size(flags(dataset=str(tmp_path / "data36.jsonl"), eval_dataset="elsewhere")) == 256
    assert default_prompt_eval_size(flags()) == 256


def fake_hub(monkeypatch, splits):
    table = {name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: datasets.DatasetDict(table))


def test_hub_uses_eval_split_capped_at_eval_size(monkeypatch):
    train_rows = [{"question": f"t{i}", "answer": i} for i in range(6)]
    test_rows = [{"question": f"e{i}", "answer": i} for i in range(4)]
    fake_hub(monkeypatch, {"train": train_rows, "test": test_rows})
    train, evaluation = load_train_eval("org/name", "question", "answer", eval_size=3)
    assert [row["prompt"] for row in train] == [f"t{i}" for i in range(6)]
    assert [row["prompt"] for row in evaluation] == ["e0", "e1", "e2"]


def test_hub_without_eval_split_holds_out(monkeypatch):
    fake_hub(monkeypatch, {"train": [{"question": f"t{i}", "answer": i} for i in range(6)]})
    train, evaluation = load_train_eval("org/name", "question", "answer", eval_size=2)
    assert len(train) == 4 and len(evaluation) == 2
    assert not {row["prompt"] for row in train} & {row["prompt"] for row in evaluation}
    with pytest.raises(ValueError, match="validation"):
        load_train_eval("org/name", "question", "answer", train_split="validation")


def test_builtin_task_uses_synthetic_splits(monkeypatch):
    def make_synthetic_rows(split):
        return [{"prompt": f"{split} {i}", "answer": str(i)} for i in range(10)]

    monkeypatch.setitem(sys.modules, "common.data.synthetic", types.SimpleNamespace(make_synthetic_rows=make_synthetic_rows))
    assert load_rows(None, "train", "ignored", "ignored")[0] == {"prompt": "train 0", "answer": "0"}
    train, evaluation = load_train_eval(None, "ignored", "ignored", eval_size=3)
    assert len(train) == 10 and [row["prompt"] for row in evaluation] == ["test 0", "test 1", "test 2"]


# ---- local directories and a held-out set of one's own ----


def numbered(prefix, n):
    return [{"question": f"{prefix}{i}", "answer": i} for i in range(n)]


def prompts(rows):
    return [row["prompt"] for row in rows]


def test_directory_of_split_files_evaluates_on_its_test_split(tmp_path):
    """train.jsonl and test.jsonl, as a paper's data release or a benchmark keeps them: all of train trains, the
    first --eval-size rows of test are held out (256 by default, here all 4)."""
    write_rows(tmp_path / "train.jsonl", numbered("t", 10))
    write_rows(tmp_path / "test.jsonl", numbered("e", 4))
    train, evaluation = load_train_eval(str(tmp_path), "question", "answer", eval_size=3)
    assert prompts(train) == [f"t{i}" for i in range(10)] and prompts(evaluation) == ["e0", "e1", "e2"]
    assert prompts(load_train_eval(str(tmp_path), "question", "answer")[1]) == ["e0", "e1", "e2", "e3"]
    assert prompts(load_rows(str(tmp_path), "test", "question", "answer")) == ["e0", "e1", "e2", "e3"]


def test_hub_snapshot_directory_reads_its_shards(tmp_path):
    """A hub dataset's snapshot as downloaded for a cluster: parquet shards under data/, named by split."""
    (tmp_path / "data").mkdir()
    write_rows(tmp_path / "data" / "train-00000-of-00002.parquet", numbered("t", 3))
    write_rows(tmp_path / "data" / "train-00001-of-00002.parquet", numbered("u", 2))
    write_rows(tmp_path / "data" / "validation-00000-of-00001.parquet", numbered("v", 2))
    train, evaluation = load_train_eval(str(tmp_path), "question", "answer", eval_split="validation")
    assert sorted(prompts(train)) == ["t0", "t1", "t2", "u0", "u1"] and prompts(evaluation) == ["v0", "v1"]


def test_snapshot_of_several_configurations_needs_one_named(tmp_path):
    """A snapshot whose README.md lists configurations (openai/gsm8k's main and socratic): --dataset-config picks
    one; without it, one line names them."""
    for config in ("main", "socratic"):
        (tmp_path / config).mkdir()
        write_rows(tmp_path / config / "train-00000-of-00001.parquet", numbered(f"{config}-t", 3))
        write_rows(tmp_path / config / "test-00000-of-00001.parquet", numbered(f"{config}-e", 2))
    (tmp_path / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
        f"  - split: test\n    path: {c}/test-*\n" for c in ("main", "socratic")) + "---\n")
    train, evaluation = load_train_eval(str(tmp_path), "question", "answer", config="socratic")
    assert prompts(train) == ["socratic-t0", "socratic-t1", "socratic-t2"]
    assert prompts(evaluation) == ["socratic-e0", "socratic-e1"]
    with pytest.raises(ValueError, match=r"holds several configurations, \['main', 'socratic'\]: name one"):
        load_train_eval(str(tmp_path), "question", "answer")


def test_save_to_disk_directories(tmp_path):
    """save_to_disk's directories go through load_from_disk: a DatasetDict has splits; a Dataset is one table, held
    out from exactly as the same rows in a file are."""
    splits = {"train": numbered("t", 6), "validation": numbered("v", 3)}
    datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(
        str(tmp_path / "dict"))
    train, evaluation = load_train_eval(str(tmp_path / "dict"), "question", "answer", eval_split="validation",
                                        eval_size=2)
    assert prompts(train) == [f"t{i}" for i in range(6)] and prompts(evaluation) == ["v0", "v1"]
    datasets.Dataset.from_list(numbered("t", 20)).save_to_disk(str(tmp_path / "one"))
    path = write_rows(tmp_path / "same.jsonl", numbered("t", 20))
    held_out = load_train_eval(str(tmp_path / "one"), "question", "answer", eval_size=5, seed=3)
    assert held_out == load_train_eval(path, "question", "answer", eval_size=5, seed=3)
    assert len(held_out[1]) == 5


def test_directory_without_the_eval_split_holds_out_as_a_file_does(tmp_path):
    write_rows(tmp_path / "train.jsonl", numbered("t", 20))
    assert (load_train_eval(str(tmp_path), "question", "answer", eval_size=5, seed=3)
            == load_train_eval(str(tmp_path / "train.jsonl"), "question", "answer", eval_size=5, seed=3))


def test_missing_split_names_the_splits_found(tmp_path):
    (tmp_path / "bench").mkdir()
    write_rows(tmp_path / "bench" / "test.jsonl", numbered("e", 2))
    write_rows(tmp_path / "bench" / "validation.jsonl", numbered("v", 2))
    bench = str(tmp_path / "bench")
    with pytest.raises(ValueError, match=r"bench: no split 'train'; existing splits: \['validation', 'test'\]"):
        load_train_eval(bench, "question", "answer")
    train_file = write_rows(tmp_path / "train.json", numbered("t", 4))
    with pytest.raises(ValueError, match=r"bench: no split 'dev'; existing splits: \['validation', 'test'\]"):
        load_train_eval(train_file, "question", "answer", eval_dataset=bench, eval_dataset_split="dev")


def test_unreadable_directories_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="could not read the directory .*empty as a dataset") as error:
        load_train_eval(str(tmp_path / "empty"), "question", "answer")
    assert "\n" not in str(error.value)
    with pytest.raises(FileNotFoundError, match="dataset not found: /nonexistent/gsm8k"):
        load_train_eval("/nonexistent/gsm8k", "question", "answer")


def test_eval_dataset_file_is_the_held_out_set(tmp_path):
    """--eval-dataset FILE (GSM8K's own test.jsonl, say): its first --eval-size rows are held out, and none of the
    training file's: all of it trains."""
    train_file = write_rows(tmp_path / "train.jsonl", numbered("t", 10))
    eval_file = write_rows(tmp_path / "bench.csv", numbered("e", 6))
    train, evaluation = load_train_eval(train_file, "question", "answer", eval_size=4, eval_dataset=eval_file)
    assert prompts(train) == [f"t{i}" for i in range(10)] and prompts(evaluation) == ["e0", "e1", "e2", "e3"]
    _, evaluation = load_train_eval(train_file, "question", "answer", eval_dataset=eval_file)
    assert prompts(evaluation) == [f"e{i}" for i in range(6)]  # fewer than 256: all of them


def test_eval_dataset_directory_and_hub_id(tmp_path, monkeypatch):
    """--eval-dataset DIR takes --eval-dataset-split of it, a hub id too (with --eval-dataset-config); the training
    directory's own test split is then not used."""
    write_rows(tmp_path / "train.jsonl", numbered("t", 5))
    write_rows(tmp_path / "test.jsonl", numbered("own", 5))
    (tmp_path / "bench").mkdir()
    write_rows(tmp_path / "bench" / "validation.jsonl", numbered("v", 3))
    train, evaluation = load_train_eval(str(tmp_path), "question", "answer", eval_dataset=str(tmp_path / "bench"),
                                        eval_dataset_split="validation")
    assert prompts(train) == [f"t{i}" for i in range(5)] and prompts(evaluation) == ["v0", "v1", "v2"]
    real_load_dataset = datasets.load_dataset
    hub = datasets.DatasetDict({"test": datasets.Dataset.from_list(numbered("hub", 4))})
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda path, *args, **kwargs: asked.append((path, *args)) or hub
                        if path == "org/bench" else real_load_dataset(path, *args, **kwargs))
    _, evaluation = load_train_eval(str(tmp_path), "question", "answer", eval_size=2, eval_dataset="org/bench",
                                    eval_dataset_config="main")
    assert prompts(evaluation) == ["hub0", "hub1"] and asked == [("org/bench", "main")]


def test_eval_dataset_needs_a_dataset(tmp_path):
    with pytest.raises(ValueError, match="--eval-dataset needs --dataset"):
        load_train_eval(None, "prompt", "answer", eval_dataset=write_rows(tmp_path / "e.jsonl", ROWS))


# ---- tokenization ----


def test_plain_tokenization_drops_long_prompts():
    prompts = ["one", "one plus one plus one", "two plus two"]
    rows = [{"prompt": prompt, "answer": str(i)} for i, prompt in enumerate(prompts)]
    kept, num_dropped = tokenize_prompts(rows, make_tokenizer(), max_prompt_len=4)
    # [BOS] + words: lengths 2, 6, 4 -> the 6-token prompt is dropped
    assert num_dropped == 1
    assert [row["prompt_ids"] for row in kept] == [[1, 5], [1, 6, 7, 6]]
    assert [row["answer"] for row in kept] == ["0", "2"]
    assert "prompt_ids" not in rows[0]  # input rows are left untouched


def test_all_prompts_too_long_is_an_error():
    rows = [{"prompt": "one plus one", "answer": "2"}, {"prompt": "a b c d a b", "answer": "x"}]
    with pytest.raises(ValueError) as error:
        tokenize_prompts(rows, make_tokenizer(), max_prompt_len=3)
    message = str(error.value)
    assert "all 2 prompts" in message and "max_prompt_len=3" in message
    assert "shortest 4" in message and "longest 7" in message


def test_chat_template_ids():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant : {% endif %}"
    )
    rows = [{"prompt": "one plus two", "answer": "3"}]
    kept, num_dropped = tokenize_prompts(rows, tokenizer, max_prompt_len=100)
    # "user : one plus two assistant :" (the template's text carries no BOS; special tokens are not added twice)
    assert num_dropped == 0 and kept[0]["prompt_ids"] == [2, 4, 5, 7, 6, 3, 4]
    plain, _ = tokenize_prompts(rows, tokenizer, max_prompt_len=100, use_chat_template=False)
    assert plain[0]["prompt_ids"] == [1, 5, 7, 6]


def test_forcing_chat_template_without_one_is_an_error():
    with pytest.raises(ValueError, match="chat_template"):
        tokenize_prompts([{"prompt": "one", "answer": "1"}], make_tokenizer(), 10, use_chat_template=True)


# ---- sampler ----


def numbered_rows(n):
    return [{"prompt": str(i), "answer": str(i)} for i in range(n)]


def stream(sampler, num_batches):
    return [[int(row["prompt"]) for row in sampler.next_batch()] for _ in range(num_batches)]


def test_rank_slices_partition_the_global_batch():
    rows = numbered_rows(17)
    one_rank = stream(PromptSampler(rows, prompts_per_rank=4, rank=0, world_size=1, seed=5), 10)
    rank0 = stream(PromptSampler(rows, prompts_per_rank=2, rank=0, world_size=2, seed=5), 10)
    rank1 = stream(PromptSampler(rows, prompts_per_rank=2, rank=1, world_size=2, seed=5), 10)
    for global_batch, mine, theirs in zip(one_rank, rank0, rank1):
        assert not set(mine) & set(theirs)
        assert mine + theirs == global_batch


def test_epochs_reshuffle_and_drop_the_tail():
    rows = numbered_rows(10)
    sampler = PromptSampler(rows, prompts_per_rank=3, rank=0, world_size=1, seed=0)
    epoch0, epoch1 = stream(sampler, 3), stream(sampler, 3)  # 3 batches of 3 per epoch; 1 row dropped each
    assert len(set(sum(epoch0, []))) == 9 and len(set(sum(epoch1, []))) == 9
    assert epoch0 != epoch1
    assert sampler.epoch == 1
    assert stream(PromptSampler(rows, 3, 0, 1, seed=0), 6) == epoch0 + epoch1  # deterministic across instances


def test_resume_continues_the_identical_stream():
    rows = numbered_rows(11)
    uninterrupted = stream(PromptSampler(rows, 2, 1, 2, seed=7), 9)
    first = PromptSampler(rows, 2, 1, 2, seed=7)
    head = stream(first, 4)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    resumed = PromptSampler(rows, 2, 1, 2, seed=7)
    resumed.load_state_dict(state)
    assert head + stream(resumed, 5) == uninterrupted
    with pytest.raises(ValueError, match="rows"):
        PromptSampler(numbered_rows(12), 2, 1, 2, seed=7).load_state_dict(state)


def test_fewer_rows_than_a_global_batch_is_an_error():
    with pytest.raises(ValueError, match="global batch"):
        PromptSampler(numbered_rows(5), prompts_per_rank=3, rank=0, world_size=2, seed=0)


def test_non_utf8_file_is_one_short_error(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"question": "café", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="latin1.jsonl") as error:
        load_rows(str(path), "train", "question", "answer")
    assert "\n" not in str(error.value)


def test_prompt_template_and_system_prompt():
    """The template takes the prompt (the reward still sees it bare); the system prompt comes first: as a system
    message through the chat template, as a paragraph without one."""
    rows = [{"prompt": "one plus two", "answer": "3"}]
    tokenizer = make_tokenizer()
    plain, _ = tokenize_prompts(rows, tokenizer, 100, template="a {prompt} b", system_prompt="c")
    assert tokenizer.decode(plain[0]["prompt_ids"]) == "[BOS] c a one plus two b" and plain[0]["prompt"] == "one plus two"
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    chat, _ = tokenize_prompts(rows, tokenizer, 100, template="a {prompt} b", system_prompt="c")
    assert tokenizer.decode(chat[0]["prompt_ids"]) == "[UNK] : c user : a one plus two b"
    with pytest.raises(ValueError, match="--prompt-template must hold {prompt}"):
        tokenize_prompts(rows, tokenizer, 100, template="no place for it")
