"""Prompt datasets for RL: load (prompt, reference answer) rows, tokenize them, and deal them out to ranks.

RL post-training reads only prompts and the answers the reward checks against; the model writes the rest.
Rows come from the built-in synthetic task or a dataset read by common/data/dataset_reader.py (a local file, a local
directory, a hub dataset). The held-out set is the dataset's eval split, another dataset's (a
benchmark's own test set), or a seeded hold-out of the training rows. A prompt is a string or a conversation (a list
of {"role", "content"} messages, as many hub datasets hold it), which the tokenizer's chat template renders.
`PromptSampler` gives every data-parallel rank its slice of the same seeded global batch, so a run on 1 rank
and on N ranks sees the same prompts, and a resumed run continues with exactly the batches it would have seen.
"""

from dataclasses import dataclass

import torch

from common.data.dataset_reader import check_eval_dataset, check_table, read_split, train_eval_tables

DEFAULT_EVAL_SIZE = 256


@dataclass
class EvalDataArgs:
    """The flags of a held-out set from elsewhere, every script's (each script's Args extends it)."""
    eval_dataset: str | None = None
    """held-out rows from elsewhere (a benchmark's own test set; prompts, or dpo.py's pairs and rows): a local file, a
    local directory or a hub dataset, as --dataset takes them; all of --dataset's "train" split then trains. Unset:
    --dataset's --eval-split, or a hold-out"""
    eval_dataset_config: str | None = None
    """configuration name of --eval-dataset (a hub dataset, or a snapshot of one)"""
    eval_dataset_split: str = "test"
    """split of --eval-dataset to evaluate on (a local file has none: all of its rows)"""

    fixed_on_resume = ("eval_dataset", "eval_dataset_config", "eval_dataset_split")  # flags a resumed run keeps


@dataclass
class PromptDataArgs(EvalDataArgs):
    """The prompt data's flags of the scripts that sample responses to prompts (grpo.py, ppo.py; dpo.py reads pairs
    and has its own): each such script's Args extends it."""
    dataset: str | None = None
    """HF hub dataset, a local .jsonl/.json/.parquet/.csv (also compressed: .jsonl.gz), or a local directory of
    splits (train.jsonl and test.jsonl, a hub snapshot's data/ shards, or save_to_disk's); unset: the built-in task"""
    dataset_config: str | None = None
    """configuration name of a hub dataset or of a snapshot of one (e.g. `main` for openai/gsm8k)"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt: a string, or a conversation (a list of {"role", "content"} messages,
    rendered by the chat template; the reward function gets its last user message)"""
    eval_split: str = "test"
    """split to evaluate on, of a hub dataset or a local directory (training takes its "train" split); a local file,
    or a dataset without this split, holds out --eval-size rows of the training data instead"""
    eval_size: int | None = None
    """number of held-out prompts evaluated (the first of the eval split or of --eval-dataset); unset: 256, or a
    tenth of the training data when they are held out of it and it has fewer than 2,560 rows"""
    chat_template: bool | None = None
    """wrap prompts in the tokenizer's chat template; unset: when the tokenizer has one"""

    fixed_on_resume = (*EvalDataArgs.fixed_on_resume, "dataset", "dataset_config", "prompt_key", "eval_split",
                       "eval_size", "chat_template")



def _rows_from_table(table, source: str, prompt_key: str, answer_key: str) -> list[dict]:
    check_table(table, [prompt_key, answer_key], source)
    try:  # Arrow keeps the raw bytes: text is decoded only here
        prompts, answers = list(table[prompt_key]), list(table[answer_key])
    except UnicodeDecodeError as error:
        raise ValueError(f"{source}: the file is not valid UTF-8 text ({error}); save it as UTF-8") from error
    rows = []
    for index, (prompt, answer) in enumerate(zip(prompts, answers)):
        where = f"{source}: row {index} column {prompt_key!r}"
        messages = None
        if isinstance(prompt, list):  # a conversation
            messages = _check_messages(prompt, where)
            prompt = next(m["content"] for m in reversed(messages) if m["role"] == "user")
        elif not isinstance(prompt, str):
            raise ValueError(f"{where}: prompt must be a string or a list of messages, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError(f"{where}: prompt is empty or whitespace-only")
        # Numeric answers (GSM8K-style) are fine as text; lists, dicts and nulls have no single sensible string.
        if not isinstance(answer, (str, int, float)):
            raise ValueError(
                f"{source}: row {index} column {answer_key!r}: answer must be a string or a number, "
                f"got {type(answer).__name__}"
            )
        rows.append({"prompt": prompt, "answer": str(answer)} | ({"messages": messages} if messages else {}))
    return rows


def _check_messages(messages: list, where: str) -> list[dict]:
    """A conversation as chat templates take it: {"role", "content"} dicts with a user turn among them."""
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise ValueError(f"{where}: a conversation must be a non-empty list of {{'role': ..., 'content': ...}} "
                         f"messages")
    if not any(m["role"] == "user" for m in messages):
        raise ValueError(f"{where}: the conversation has no 'user' message")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def load_rows(
    dataset: str | None, split: str, prompt_key: str, answer_key: str, config: str | None = None
) -> list[dict]:
    """[{"prompt": str, "answer": str}, ...] of one split of the built-in synthetic task (dataset None), a local file,
    a local directory or the hub. A local file has a single split, so `split` is ignored for it (load_train_eval
    holds out eval rows instead)."""
    if dataset is None:
        from common.data.synthetic import make_synthetic_rows  # imported here: only the built-in task needs it
        # (tests/test_prompts.py stands a module in for it)

        return make_synthetic_rows(split)
    return _rows_from_table(*read_split(dataset, config, split), prompt_key, answer_key)


def held_out_size(num_train_rows: int | None = None) -> int:
    """How many rows are held out when --eval-size is unset: 256, or a tenth of the training data when they are held
    out of its `num_train_rows` rows (None: they come from elsewhere) and it has fewer than 2,560."""
    return DEFAULT_EVAL_SIZE if num_train_rows is None else max(1, min(DEFAULT_EVAL_SIZE, num_train_rows // 10))


def default_prompt_eval_size(args, count_rows=lambda train: len(train[0])) -> int:
    """--eval-size's default for a script's prompts (its resolve_defaults): held_out_size, which reads the training
    split to count its rows only where the held-out prompts would be cut from it (a file, or a dataset without
    --eval-split, and no --eval-dataset); load_prompts reads it again, from the datasets library's cache.
    count_rows(train table): the rows it holds (dpo.py's pairs count those it keeps)."""
    if args.dataset is None or args.eval_dataset is not None:
        return held_out_size()
    train, held_out = train_eval_tables(args.dataset, args.dataset_config, args.eval_split)
    return held_out_size(None if held_out is not None else count_rows(train))


def _hold_out(rows: list[dict], eval_size: int | None, seed: int, source: str) -> tuple[list[dict], list[dict]]:
    """A seeded random eval_size rows for evaluation, the rest for training; eval_size None: 256, or a tenth of a
    smaller file (held_out_size)."""
    if eval_size is None:
        eval_size = held_out_size(len(rows))
    if eval_size >= len(rows):
        raise ValueError(f"{source}: eval_size={eval_size} leaves none of its {len(rows)} rows for training")
    permutation = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    split_at = len(rows) - eval_size
    return [rows[i] for i in permutation[:split_at]], [rows[i] for i in permutation[split_at:]]


def load_train_eval(
    dataset: str | None,
    prompt_key: str,
    answer_key: str,
    config: str | None = None,
    train_split: str = "train",
    eval_split: str = "test",
    eval_size: int | None = None,
    seed: int = 0,
    eval_dataset: str | None = None,
    eval_dataset_config: str | None = None,
    eval_dataset_split: str = "test",
) -> tuple[list[dict], list[dict]]:
    """(train_rows, eval_rows): the first eval_size (None: 256) rows of the held-out table (train_eval_tables: an
    --eval-dataset, or the dataset's eval split), or without one a seeded hold-out of eval_size rows (None: 256, or
    a tenth of a training set of fewer than 2,560 rows), disjoint from the rest, which train."""
    check_eval_dataset(dataset, eval_dataset)
    if dataset is None:
        from common.data.synthetic import make_synthetic_rows

        return make_synthetic_rows("train"), make_synthetic_rows("test")[:eval_size or DEFAULT_EVAL_SIZE]
    train, held_out = train_eval_tables(dataset, config, eval_split, eval_dataset, eval_dataset_config,
                                        eval_dataset_split, train_split)
    train_rows = _rows_from_table(*train, prompt_key, answer_key)
    if held_out is None:
        return _hold_out(train_rows, eval_size, seed, dataset)
    eval_table, name = held_out
    eval_table = eval_table.select(range(min(eval_size or DEFAULT_EVAL_SIZE, len(eval_table))))
    return train_rows, _rows_from_table(eval_table, name, prompt_key, answer_key)


def tokenize_prompts(
    rows: list[dict], tokenizer, max_prompt_len: int, use_chat_template: bool | None = None,
    template: str | None = None, system_prompt: str | None = None,
) -> tuple[list[dict], int]:
    """Returns (copies of rows with "prompt_ids" added, number dropped for being longer than max_prompt_len).

    use_chat_template None means: use the tokenizer's chat template when it has one. template: a text holding
    "{prompt}", which the prompt (a conversation's last user message) replaces before the chat template applies;
    system_prompt: the conversation's system message (without a chat template: a paragraph before the prompt).
    The rows' "prompt" stays as it was: it is what the reward function sees.
    """
    if not rows:
        raise ValueError("no prompts to tokenize")
    if template is not None and "{prompt}" not in template:
        raise ValueError(f"--prompt-template must hold {{prompt}}, where each prompt goes: {template!r}")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if use_chat_template is None:
        use_chat_template = has_template
    if use_chat_template and not has_template:
        name = tokenizer.name_or_path or type(tokenizer).__name__
        raise ValueError(f"use_chat_template=True but tokenizer {name!r} has no chat_template")
    if any("messages" in row for row in rows) and not use_chat_template:
        raise ValueError("the prompts are conversations (lists of messages), which need the tokenizer's chat template"
                         + ("" if has_template else f": {tokenizer.name_or_path or 'this tokenizer'} has none"))
    conversations = [formatted_conversation(row, template, system_prompt) for row in rows]
    if use_chat_template:
        # transformers 5 returns a BatchEncoding by default; return_dict=False gives plain lists of ids.
        all_ids = tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    else:  # one user message, maybe after a system message: plain text
        texts = ["\n\n".join(m["content"] for m in conversation) for conversation in conversations]
        all_ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    kept = [{**row, "prompt_ids": list(ids)} for row, ids in zip(rows, all_ids) if len(ids) <= max_prompt_len]
    if not kept:
        lengths = [len(ids) for ids in all_ids]
        raise ValueError(
            f"all {len(rows)} prompts are longer than max_prompt_len={max_prompt_len} tokens "
            f"(shortest {min(lengths)}, longest {max(lengths)})"
        )
    return kept, len(rows) - len(kept)


def formatted_conversation(row: dict, template: str | None, system_prompt: str | None) -> list[dict]:
    """The row's prompt as messages: its conversation (or one user message), the last user message put into the
    template, a system message first (replacing the conversation's own)."""
    messages = [dict(m) for m in row.get("messages") or [{"role": "user", "content": row["prompt"]}]]
    if template is not None:
        last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last_user]["content"] = template.replace("{prompt}", messages[last_user]["content"])
    if system_prompt is not None:
        messages = [{"role": "system", "content": system_prompt}] + [m for m in messages if m["role"] != "system"]
    return messages


class PromptSampler:
    """Deterministic infinite stream of prompt batches for one data-parallel rank.

    Each epoch is a permutation of all rows seeded with seed + epoch. Every rank computes the same permutation,
    takes the next global batch (prompts_per_rank * world_size indices) and keeps its own contiguous slice.
    """

    def __init__(self, rows: list[dict], prompts_per_rank: int, rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} out of range for world_size {world_size}")
        self.rows = rows
        self.prompts_per_rank = prompts_per_rank
        self.rank = rank
        self.global_batch_size = prompts_per_rank * world_size
        if len(rows) < self.global_batch_size:
            raise ValueError(
                f"dataset has {len(rows)} rows, fewer than one global batch of {self.global_batch_size} "
                f"({prompts_per_rank} prompts per rank x {world_size} ranks)"
            )
        self.seed = seed
        self.epoch = 0
        self.position = 0  # index into this epoch's permutation where the next global batch starts
        self._permutation = self._permutation_of(self.epoch)

    def _permutation_of(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.rows), generator=generator).tolist()

    def next_batch(self) -> list[dict]:
        # The tail of an epoch that does not fill a whole global batch is dropped (those rows come back,
        # reshuffled, in later epochs), so every global batch has the same size on every rank.
        if self.position + self.global_batch_size > len(self.rows):
            self.epoch += 1
            self.position = 0
            self._permutation = self._permutation_of(self.epoch)
        global_batch = self._permutation[self.position : self.position + self.global_batch_size]
        self.position += self.global_batch_size
        start = self.rank * self.prompts_per_rank
        return [self.rows[i] for i in global_batch[start : start + self.prompts_per_rank]]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_rows": len(self.rows)}

    def load_state_dict(self, state: dict):
        if state["num_rows"] != len(self.rows):
            raise ValueError(f"sampler state is for {state['num_rows']} rows but this dataset has {len(self.rows)}")
        self.epoch, self.position = state["epoch"], state["position"]
        self._permutation = self._permutation_of(self.epoch)


def load_prompts(args, tokenizer) -> tuple[list[dict], list[dict], list[str]]:
    """(train rows, held-out rows, notes to print): the prompts of --dataset with the answers the reward checks,
    tokenized as the model will see them."""
    train_rows, eval_rows = load_train_eval(args.dataset, args.prompt_key, args.answer_key, args.dataset_config,
                                            eval_split=args.eval_split, eval_size=args.eval_size, seed=args.seed,
                                            eval_dataset=args.eval_dataset,
                                            eval_dataset_config=args.eval_dataset_config,
                                            eval_dataset_split=args.eval_dataset_split)
    formats = (args.max_prompt_len, args.chat_template, args.prompt_template, args.system_prompt)
    train_rows, dropped = tokenize_prompts(train_rows, tokenizer, *formats)
    eval_rows, eval_dropped = tokenize_prompts(eval_rows, tokenizer, *formats)
    return train_rows, eval_rows, [
        f"{len(train_rows)} train / {len(eval_rows)} eval prompts; dropped {dropped} / {eval_dropped} longer than "
        f"--max-prompt-len {args.max_prompt_len}",
        f"the first prompt, as the model sees it: {tokenizer.decode(train_rows[0]['prompt_ids'])[:400]!r}"]
