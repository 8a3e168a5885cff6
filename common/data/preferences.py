"""Preference data for DPO and KTO: load (prompt, chosen, rejected) pairs or unpaired (prompt, completion, label)
rows, and tokenize them into id lists.

A pair is a prompt and two responses to it: the one people preferred (chosen) and the other (rejected).
Files hold pairs in one of two layouts: explicit prompt/chosen/rejected columns, or only chosen/rejected whole
dialogues that share every turn but the last reply (HH-RLHF), whose prompt is then their common prefix, cut back to
the turn boundary where that reply starts. Values are strings, or conversations (lists of {"role", "content"}
messages) which stay lists until the tokenizer's chat template renders them. Tokenized, a pair is three id lists:
the prompt's, and each response's alone (without the prompt), ending in a stop token so the model learns to stop.
KTO's unpaired rows have one completion and a label (true: desirable); pairs become two such rows (chosen desirable,
rejected undesirable), so one file trains either loss.
"""

import os

import torch

from common.data.dataset_reader import check_eval_dataset, check_table, first_line, read_split, train_eval_tables
from common.data.prompts import default_prompt_eval_size, held_out_size
from common.data.synthetic import make_synthetic_pairs

# HH-RLHF's dialogues ("\n\nHuman: ...\n\nAssistant: ...") end the prompt with the last marker both sides share.
ASSISTANT_MARKER = "\n\nAssistant:"


def load_pairs(
    dataset: str,
    prompt_key: str = "prompt",
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    config: str | None = None,
    split: str = "train",
    assistant_marker: str = ASSISTANT_MARKER,
) -> tuple[list[dict], dict]:
    """(pairs, stats) from a local .jsonl/.json/.parquet/.csv file (also compressed: .jsonl.gz), one split of a local
    directory or of a hub dataset.

    Each pair is {"prompt", "chosen", "rejected"}, all strings or all message lists. Without a `prompt_key` column
    (and with prompt_key left at "prompt"), the prompt is the common start of the chosen and rejected dialogues: for
    strings, up to and including the last `assistant_marker` both share; for conversations, the shared leading
    messages up to an assistant reply. A local file has a single split, so `split` is ignored for it.
    An empty or mistyped value is an error naming its row and column, as is a dialogue pair with no common prefix
    or no turn boundary in it (the prompt then needs a column of its own).
    stats: {"rows": rows read, "identical": pairs skipped because chosen == rejected (nothing to prefer),
    "empty_response": dialogues skipped because a side's last reply is empty (HH-RLHF has a few)}.
    """
    return pairs_from_table(*read_split(dataset, config, split), prompt_key, chosen_key, rejected_key, assistant_marker)


def pairs_from_table(table, dataset: str, prompt_key: str = "prompt", chosen_key: str = "chosen",
                     rejected_key: str = "rejected",
                     assistant_marker: str = ASSISTANT_MARKER) -> tuple[list[dict], dict]:
    """load_pairs of a table already read (`dataset`: its name for messages)."""
    columns = table.column_names
    explicit = prompt_key in columns
    # A prompt column the user named must exist; only the default name may be absent (then the prompt is implicit).
    check_table(table, [chosen_key, rejected_key] + ([prompt_key] if prompt_key != "prompt" else []), dataset)
    try:  # Arrow keeps the raw bytes: text is decoded only here
        chosen, rejected = list(table[chosen_key]), list(table[rejected_key])
        prompts = list(table[prompt_key]) if explicit else [None] * len(chosen)
    except UnicodeDecodeError as error:
        raise ValueError(f"{dataset}: the file is not valid UTF-8 text ({error}); save it as UTF-8") from error

    pairs, stats = [], {"rows": len(chosen), "identical": 0, "empty_response": 0}
    for index, (prompt, chosen_value, rejected_value) in enumerate(zip(prompts, chosen, rejected)):
        where = f"{dataset}: row {index}"
        chosen_value = _check_value(chosen_value, f"{where} column {chosen_key!r}")
        rejected_value = _check_value(rejected_value, f"{where} column {rejected_key!r}")
        if explicit:
            pair = _same_form(_check_value(prompt, f"{where} column {prompt_key!r}"), chosen_value, rejected_value)
        elif isinstance(chosen_value, str) != isinstance(rejected_value, str):
            raise ValueError(f"{where}: {chosen_key!r} and {rejected_key!r} must both be strings or both conversations")
        elif chosen_value == rejected_value:
            pair = {"chosen": chosen_value, "rejected": rejected_value}  # counted as identical just below
        else:
            pair = split_common_prompt(chosen_value, rejected_value, where, assistant_marker)
        if pair["chosen"] == pair["rejected"]:
            stats["identical"] += 1
        elif _is_empty(pair["chosen"]) or _is_empty(pair["rejected"]):
            stats["empty_response"] += 1
        else:
            pairs.append(pair)
    if not pairs:
        raise ValueError(f"{dataset}: no usable pairs among its {len(chosen)} rows "
                         f"({stats['identical']} identical, {stats['empty_response']} with an empty response)")
    return pairs, stats


def _check_value(value, where: str) -> str | list[dict]:
    """A non-empty string or conversation; messages are copied down to their role and content (Arrow gives every
    message each key any message of the column has, set to None)."""
    if isinstance(value, list):
        if not value or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                and isinstance(m.get("content"), str) for m in value):
            raise ValueError(f"{where}: a conversation must be a non-empty list of "
                             f"{{'role': ..., 'content': ...}} messages")
        value = [{"role": m["role"], "content": m["content"]} for m in value]
    elif value is not None and not isinstance(value, str):
        raise ValueError(f"{where}: must be a string or a list of messages, got {type(value).__name__}")
    if value is None or _is_empty(value):
        raise ValueError(f"{where}: empty (null, or whitespace only)")
    return value


def _is_empty(value: str | list[dict]) -> bool:
    texts = [value] if isinstance(value, str) else [m["content"] for m in value]
    return not any(text.strip() for text in texts)


def _same_form(prompt, chosen, rejected) -> dict:
    """All three as strings, or all as conversations when any is one: a lone string then becomes one message (the
    user's for the prompt, the assistant's for a response), so the chat template renders the pair as one dialogue."""
    if any(isinstance(value, list) for value in (prompt, chosen, rejected)):
        prompt = _as_messages(prompt, "user")
        chosen, rejected = _as_messages(chosen, "assistant"), _as_messages(rejected, "assistant")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _as_messages(value: str | list[dict], role: str) -> list[dict]:
    return value if isinstance(value, list) else [{"role": role, "content": value}]


def split_common_prompt(chosen, rejected, where: str, assistant_marker: str = ASSISTANT_MARKER) -> dict:
    """{"prompt", "chosen", "rejected"} from two whole dialogues (both strings or both message lists): the prompt is
    their common start, cut back to where an assistant reply begins; each response is the rest of its dialogue.

    HH-RLHF: "\\n\\nHuman: hi\\n\\nAssistant: Hello!" and "...\\n\\nAssistant: Go away." give the prompt
    "\\n\\nHuman: hi\\n\\nAssistant:" and the responses " Hello!" and " Go away.".
    """
    if isinstance(chosen, str):
        shared = os.path.commonprefix([chosen, rejected])
        if not shared:
            raise ValueError(f"{where}: chosen and rejected have no common prefix to take as the prompt "
                             f"(no prompt column); give the prompt in a column of its own")
        # The common prefix can run into the reply ("...Assistant: I" + "'m sorry" / "t is"): back to the marker.
        end = shared.rfind(assistant_marker)
        if end < 0:
            raise ValueError(f"{where}: the common prefix of chosen and rejected has no turn boundary "
                             f"{assistant_marker!r} to end the prompt at; give the prompt in a column of its own")
        end += len(assistant_marker)
        return {"prompt": chosen[:end], "chosen": chosen[end:], "rejected": rejected[end:]}
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise ValueError(f"{where}: chosen and rejected share no leading message to take as the prompt "
                         f"(no prompt column); give the prompt in a column of its own")

    def starts_reply(k: int) -> bool:  # message k opens an assistant reply on both sides
        return k < len(chosen) and k < len(rejected) and chosen[k]["role"] == rejected[k]["role"] == "assistant"

    boundary = next((k for k in range(shared, 0, -1) if starts_reply(k)), None)
    if boundary is None:
        raise ValueError(f"{where}: no turn boundary: the {shared} message(s) chosen and rejected share are not "
                         f"followed by an assistant reply on both sides")
    return {"prompt": chosen[:boundary], "chosen": chosen[boundary:], "rejected": rejected[boundary:]}


def tokenize_pairs(
    pairs: list[dict],
    tokenizer,
    max_len: int,
    use_chat_template: bool | None = None,
    max_prompt_len: int | None = None,
    stop_ids: list[int] | None = None,
    responses: tuple[str, ...] = ("chosen", "rejected"),
) -> tuple[list[dict], dict]:
    """(rows, stats): rows of {"prompt_ids", "chosen_ids", "rejected_ids"} (lists of ints; the responses' ids exclude
    the prompt), each prompt + response at most max_len tokens. `responses` names the response keys: ("completion",)
    tokenizes KTO's unpaired rows into {"prompt_ids", "completion_ids", "label"} (the label kept as it was).

    Strings: the prompt is tokenized alone (with the tokenizer's special tokens, e.g. BOS) and each response alone
    without special tokens; the row is their concatenation. Tokenizing prompt + response as one text could merge
    tokens across the boundary and leave no clean place to split; this way both responses follow exactly the ids
    generation starts from. (A tokenizer that adds a leading space to every text it starts, like SentencePiece's
    dummy prefix, gives a response one such space more than the joined text would have.)
    Conversations go through the chat template: the prompt with add_generation_prompt=True, the whole dialogue
    without, the response being the rest; a template that does not render the prompt as the dialogue's start is
    an error. use_chat_template None: for conversations only (string pairs such as HH-RLHF's dialogues carry their
    own format); True also wraps string pairs as one user message and one assistant reply.

    Stop: a response keeps everything up to and including its last stop token (`stop_ids`, default the tokenizer's
    EOS; pass the ones generation stops at): what a chat template writes after it, such as a newline between
    turns, is never generated. A response with no stop token gets EOS appended: the model must learn to stop.
    Truncation of a pair whose prompt + longer response exceeds max_len: the prompt loses tokens from its start (a
    BOS there too), as many as needed but keeping at least min(its length, max_prompt_len) (default max_len // 2):
    its end, next to the responses, is what they answer; then both responses lose tokens from their end (a cut
    response loses its stop token: it did not stop there).
    stats: {"pairs": pairs in, "truncated": pairs kept but cut, "too_long": dropped, no room left for a response
    token, "identical": dropped, chosen and rejected ids equal (nothing to prefer, e.g. after the cut)}.
    """
    if not pairs:
        raise ValueError("no preference pairs to tokenize")
    max_prompt_len = max_len // 2 if max_prompt_len is None else max_prompt_len
    if max_len < 2 or not 1 <= max_prompt_len <= max_len:
        raise ValueError(f"need max_len >= 2 and 1 <= max_prompt_len <= max_len, got {max_len} and {max_prompt_len}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos_token: responses must end in one for the model to learn to stop")
    forms = {isinstance(pair["prompt"], list) for pair in pairs}
    if len(forms) > 1:
        raise ValueError("the pairs mix strings and conversations (lists of messages); give them all in one form")
    conversational = forms.pop()
    has_template = getattr(tokenizer, "chat_template", None) is not None
    use_chat_template = conversational if use_chat_template is None else use_chat_template
    name = tokenizer.name_or_path or type(tokenizer).__name__
    if conversational and not (use_chat_template and has_template):
        raise ValueError("the pairs are conversations (lists of messages), which need the tokenizer's chat template"
                         + ("" if has_template else f": tokenizer {name!r} has none"))
    if use_chat_template and not has_template:
        raise ValueError(f"use_chat_template=True but tokenizer {name!r} has no chat_template")

    if use_chat_template:
        prompts, *sides = _tokenize_with_template(pairs, tokenizer, responses)
    else:
        prompts = tokenizer([pair["prompt"] for pair in pairs], add_special_tokens=True)["input_ids"]
        sides = [tokenizer([pair[side] for pair in pairs], add_special_tokens=False)["input_ids"] for side in responses]

    stops = set(stop_ids or [tokenizer.eos_token_id])
    rows, stats = [], {"pairs": len(pairs), "truncated": 0, "too_long": 0, "identical": 0}
    for pair, prompt_ids, *response_ids in zip(pairs, prompts, *sides):
        whole = (list(prompt_ids), *(end_at_stop(list(ids), stops, tokenizer.eos_token_id) for ids in response_ids))
        cut = truncate_pair(whole[0], whole[1:], max_len, max_prompt_len)
        if not cut[1]:  # every response is cut to the same room: all are empty
            stats["too_long"] += 1
        elif len(cut) == 3 and cut[1] == cut[2]:
            stats["identical"] += 1
        else:
            stats["truncated"] += cut != whole
            rows.append({"prompt_ids": cut[0], **{f"{side}_ids": ids for side, ids in zip(responses, cut[1:])},
                         **({"label": pair["label"]} if "label" in pair else {})})
    if not rows:
        raise ValueError(f"all {len(pairs)} pairs were dropped: {stats['too_long']} left no room for a response "
                         f"within max_len={max_len} (max_prompt_len={max_prompt_len}), {stats['identical']} had "
                         f"identical chosen and rejected ids")
    return rows, stats


def _tokenize_with_template(pairs: list[dict], tokenizer, responses: tuple[str, ...]) -> tuple[list, ...]:
    """Prompt ids and each side's response ids, the response being the whole dialogue's ids after the prompt's."""
    def render(conversations, add_generation_prompt):
        try:  # transformers 5 returns a BatchEncoding by default; return_dict=False gives plain lists of ids
            return tokenizer.apply_chat_template(conversations, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True, return_dict=False)
        except Exception as error:  # a template's own checks (roles must alternate...) raise from inside Jinja
            raise ValueError(f"the chat template could not render the pairs: {first_line(error)}") from error

    conversations = [_as_messages(pair["prompt"], "user") for pair in pairs]
    prompts = render(conversations, add_generation_prompt=True)
    ids_of = {}
    for side in responses:
        whole = render([c + _as_messages(p[side], "assistant") for c, p in zip(conversations, pairs)], False)
        for index, (prompt_ids, ids) in enumerate(zip(prompts, whole)):
            if list(ids[:len(prompt_ids)]) != list(prompt_ids):
                raise ValueError(f"pair {index}: the chat template does not render the prompt (with "
                                 f"add_generation_prompt=True) as the start of the dialogue with its {side} "
                                 f"response, so the response cannot be cut out as what follows it")
        ids_of[side] = [ids[len(prompt_ids):] for prompt_ids, ids in zip(prompts, whole)]
    return prompts, *(ids_of[side] for side in responses)


def end_at_stop(response_ids: list[int], stop_ids: set[int], eos_id: int) -> list[int]:
    """The response up to and including its last stop token, or with eos_id appended when it has none."""
    last = max((i for i, token in enumerate(response_ids) if token in stop_ids), default=None)
    return response_ids + [eos_id] if last is None else response_ids[: last + 1]


def truncate_pair(prompt_ids: list[int], responses: tuple[list[int], ...], max_len: int,
                  max_prompt_len: int) -> tuple[list[int], ...]:
    """(prompt ids, *response ids) cut so that prompt + each response fits max_len (see tokenize_pairs); unchanged
    if it fits. The responses come back empty when the kept prompt leaves no room."""
    longest = max(len(ids) for ids in responses)
    if len(prompt_ids) + longest <= max_len:
        return (prompt_ids, *responses)
    keep = max(max_len - longest, min(len(prompt_ids), max_prompt_len))
    room = max(0, max_len - keep)
    return (prompt_ids[len(prompt_ids) - keep:], *(ids[:room] for ids in responses))


def load_unpaired(dataset: str, prompt_key: str = "prompt", completion_key: str = "completion",
                  label_key: str = "label", config: str | None = None, split: str = "train") -> tuple[list[dict], dict]:
    """(rows, stats): KTO's unpaired rows {"prompt", "completion", "label"} (label: bool, true = desirable) from a
    local file or one split of a local directory or a hub dataset with those columns; strings or conversations, as
    load_pairs reads them."""
    return unpaired_from_table(*read_split(dataset, config, split), prompt_key, completion_key, label_key)


def unpaired_from_table(table, dataset: str, prompt_key: str = "prompt", completion_key: str = "completion",
                        label_key: str = "label") -> tuple[list[dict], dict]:
    """load_unpaired of a table already read (`dataset`: its name for messages)."""
    check_table(table, [prompt_key, completion_key, label_key], dataset)
    rows, stats = [], {"rows": len(table), "empty_response": 0}
    for index, (prompt, completion, label) in enumerate(zip(table[prompt_key], table[completion_key],
                                                             table[label_key])):
        where = f"{dataset}: row {index}"
        if not isinstance(label, bool):
            raise ValueError(f"{where} column {label_key!r}: must be true or false, got {label!r}")
        completion = _check_value(completion, f"{where} column {completion_key!r}")
        pair = _same_form(_check_value(prompt, f"{where} column {prompt_key!r}"), completion, completion)
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": label})
    return rows, stats


def unpair(rows: list[dict], max_len: int | None = None, seed: int = 0) -> list[dict]:
    """Tokenized pairs -> KTO's unpaired rows: the chosen response desirable, the rejected one undesirable; with
    max_len, each with its KL partner (add_kl_partners)."""
    rows = [{"prompt_ids": row["prompt_ids"], "completion_ids": row[side], "label": side == "chosen_ids",
             **({"completion_mask": row[side.replace("_ids", "_mask")]} if "chosen_mask" in row else {})}
            for row in rows for side in ("chosen_ids", "rejected_ids")]
    return rows if max_len is None else add_kl_partners(rows, max_len, seed)


def add_kl_partners(rows: list[dict], max_len: int, seed: int) -> list[dict]:
    """Each unpaired row gets "kl_ids": the completion of another row, to another prompt, cut to fit max_len after
    this row's prompt. The policy's and the reference's log-probs of such mismatched pairs estimate KL(policy ||
    reference), KTO's reference point. Partners come from a seeded permutation (the next row in it with another
    prompt), so they are fixed for the run and the reference log-probs of both can be cached."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    position = {index: k for k, index in enumerate(order)}
    for i, row in enumerate(rows):
        k = position[i]
        partner = next((rows[order[(k + d) % len(rows)]] for d in range(1, len(rows))
                        if rows[order[(k + d) % len(rows)]]["prompt_ids"] != row["prompt_ids"]), row)
        row["kl_ids"] = partner["completion_ids"][:max(1, max_len - len(row["prompt_ids"]))]
        if "completion_mask" in partner:  # multi-turn episodes: the model's own tokens only
            row["kl_mask"] = partner["completion_mask"][:len(row["kl_ids"])]
    return rows


def rows_of_table(args, table, dataset: str) -> tuple[list[dict], dict, bool]:
    """(rows, stats, unpaired?) of one table of dpo.py's data (`dataset`: its name for messages): KTO's unpaired rows
    where it has --completion-key and --label-key, else pairs."""
    if args.completion_key in table.column_names and args.label_key in table.column_names:
        if args.loss_type != "kto":
            raise ValueError(f"{dataset}: unpaired rows ({args.completion_key!r}, {args.label_key!r}) train "
                             f"--loss-type kto; the other losses need pairs ({args.chosen_key!r}, "
                             f"{args.rejected_key!r})")
        return *unpaired_from_table(table, dataset, args.prompt_key, args.completion_key, args.label_key), True
    return *pairs_from_table(table, dataset, args.prompt_key, args.chosen_key, args.rejected_key), False


def default_pair_eval_size(args) -> int:
    """--eval-size's default for dpo.py's offline data (its resolve_defaults): held_out_size, which reads the
    training rows to count them only where the held-out rows would be cut from them (a file, or a dataset without
    --eval-split, and no --eval-dataset); load_preference_rows reads them again, from the datasets library's cache."""
    return default_prompt_eval_size(args, lambda train: len(rows_of_table(args, *train)[0]))


def load_preference_rows(args, tokenizer, stop_ids) -> tuple[list[dict], list[dict], dict]:
    """Offline data of dpo.py: (train rows, held-out rows, stats). Train rows are tokenized pairs {"prompt_ids",
    "chosen_ids", "rejected_ids"}, or with --loss-type kto unpaired rows {"prompt_ids", "completion_ids", "label",
    "kl_ids"} (from an unpaired file, or split from pairs). Held-out rows are pairs wherever their data has them
    (preference accuracy compares the two responses), else unpaired rows. They are the first --eval-size rows of
    --eval-dataset (then all of --dataset's train split trains) or of --dataset's --eval-split, or without either
    the last --eval-size rows of the training data; --dataset unset: the built-in task's pairs."""
    check_eval_dataset(args.dataset, args.eval_dataset)
    if args.dataset is None:
        train, stats, unpaired = make_synthetic_pairs("train"), {}, False
        held_out, eval_unpaired = make_synthetic_pairs(args.eval_split), False
    else:
        train_table, eval_table = train_eval_tables(args.dataset, args.dataset_config, args.eval_split,
                                                    args.eval_dataset, args.eval_dataset_config,
                                                    args.eval_dataset_split)
        train, stats, unpaired = rows_of_table(args, *train_table)
        if eval_table is not None:
            held_out, _, eval_unpaired = rows_of_table(args, *eval_table)
        else:  # a local file, or no eval split: its last --eval-size rows
            size = args.eval_size or held_out_size(len(train))
            if size >= len(train):
                raise ValueError(f"{args.dataset}: --eval-size {size} leaves none of its {len(train)} rows for "
                                 f"training")
            train, held_out, eval_unpaired = train[:-size], train[-size:], unpaired
    held_out = held_out[:args.eval_size or held_out_size()]

    def tokenize(rows, unpaired):
        return tokenize_pairs(rows, tokenizer, args.max_len, args.chat_template, args.max_prompt_len, stop_ids,
                              ("completion",) if unpaired else ("chosen", "rejected"))

    (rows, token_stats), (eval_rows, _) = tokenize(train, unpaired), tokenize(held_out, eval_unpaired)
    if args.loss_type == "kto":
        rows = add_kl_partners(rows, args.max_len, args.seed) if unpaired else unpair(rows, args.max_len, args.seed)
    if eval_unpaired:
        eval_rows = add_kl_partners(eval_rows, args.max_len, args.seed)
    return rows, eval_rows, {**stats, **token_stats}
