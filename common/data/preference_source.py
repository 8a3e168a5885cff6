"""Where a preference step's examples come from, and their reference log-probs: what dpo.py's loop gets in one call.

An example is a prompt and two responses whose log-probs training takes in one packed micro-batch: a pair's chosen
and rejected responses (DPO), or KTO's completion and its KL partner (another row's completion to this prompt, for
the reference point). `DatasetExamples` draws them from a dataset with a seeded sampler; `OnlineExamples` samples
responses from the policy through the shared rollouts, scores them and lets the script pair them. Both have the
same calls (`start`, `next_batch`, `publish`, `evaluate_task`, `close`, and the state that checkpoints save), so the
loop has no offline/online branch. `ReferenceLogps` gives the reference policy's log-probs: computed once by the
initial policy and cached on disk (offline), or from a frozen copy of the model every step.
"""

import hashlib
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.data.preferences import default_pair_eval_size, load_preference_rows
from common.data.prompts import EvalDataArgs, PromptSampler, default_prompt_eval_size, load_prompts
from common.run.distributed import sum_over_ranks
from common.train.batching import plan_equal_micro_batches, share_samples_evenly
from common.train.loading import load_reference
from common.train.logprobs import packed_response_logprobs
from common.train.lora import adapters_off
from common.train.model import stop_token_ids
from common.train.sequence_parallel import data_parallel
from common.train.value_models import reward_model_scores



@dataclass
class PreferenceDataArgs(EvalDataArgs):
    """The preference data's flags (dpo.py's Args extends it)."""
    dataset: str | None = None
    """pairs (or KTO's unpaired rows): a hub dataset, a local .jsonl/.json/.parquet/.csv (.gz too) or a directory of
    them (grpo.py --help); unset: the built-in task's pairs (its right answer over a wrong one). --online: prompts"""
    dataset_config: str | None = None
    """configuration name of a hub dataset or of a snapshot of one (e.g. `harmless-base` for Anthropic/hh-rlhf)"""
    prompt_key: str = "prompt"
    """column of the prompt; a file without it holds whole dialogues, whose common start is the prompt"""
    chosen_key: str = "chosen"
    """column of the preferred response (or whole dialogue)"""
    rejected_key: str = "rejected"
    """column of the other response (or whole dialogue)"""
    completion_key: str = "completion"
    """KTO's unpaired rows: the response (without it and --label-key, pairs give a desirable and an undesirable row)"""
    label_key: str = "label"
    """KTO's unpaired rows: the column saying whether the response is desirable (true) or not (false)"""
    eval_split: str = "test"
    """split of a hub dataset or directory to evaluate on ("train" trains); without it, the last --eval-size pairs"""
    eval_size: int | None = None
    """held-out pairs or rows (--online: prompts); unset: 256, or a tenth of training data of fewer than 2,560"""
    chat_template: bool | None = None
    """wrap the text in the tokenizer's chat template; unset: for conversations (lists of messages) only"""

    fixed_on_resume = (*EvalDataArgs.fixed_on_resume, "dataset", "dataset_config", "prompt_key", "chosen_key",
                       "rejected_key", "completion_key", "label_key", "eval_split", "eval_size", "chat_template")

def response_pair(example: dict) -> tuple[list[int], list[int]]:
    """The two responses of an example: a pair's chosen and rejected; an unpaired row's completion and KL partner."""
    if "chosen_ids" in example:
        return example["chosen_ids"], example["rejected_ids"]
    return example["completion_ids"], example["kl_ids"]


def response_masks(example: dict) -> tuple[list[int] | None, list[int] | None]:
    """The masks of response_pair's two responses where they are multi-turn episodes (1 on the model's own tokens, 0
    on observations: only the model's tokens count), else None."""
    if "chosen_ids" in example:
        return example.get("chosen_mask"), example.get("rejected_mask")
    return example.get("completion_mask"), example.get("kl_mask")


def response_lengths(example: dict) -> list[int]:
    """How many of each response's tokens are the model's own (all of them, but for multi-turn episodes)."""
    return [len(ids) if mask is None else sum(mask) for ids, mask in zip(response_pair(example),
                                                                       response_masks(example))]


def example_length(example: dict) -> int:
    """Tokens an example takes in a packed micro-batch: the prompt twice, both responses once."""
    first, second = response_pair(example)
    return 2 * len(example["prompt_ids"]) + len(first) + len(second)


def example_logps(model, examples: list[dict], which: tuple[int, ...] = (0, 1)) -> list[torch.Tensor]:
    """Summed log-probs [examples] of the responses `which` (0: chosen / completion, 1: rejected / KL partner) of
    every example (of the model's own tokens, where a response is a multi-turn episode), all in one packed forward;
    an empty `examples` runs a dummy (a rank's zero-weight filler pass), and each result is then its one value."""
    sequences = [dict(prompt_ids=e["prompt_ids"], response_ids=response_pair(e)[k], mask=response_masks(e)[k])
                 for e in examples for k in which]
    logprobs, _ = packed_response_logprobs(model, sequences, temperature=1.0)
    masks = [s["mask"] for s in sequences] or [None]  # none: the dummy pass
    sums = torch.stack([lp.sum() if mask is None else (lp * torch.tensor(mask, device=lp.device)).sum()
                        for lp, mask in zip(logprobs, masks)])  # example-major: [e0 r0, e0 r1, e1 r0, ...]
    return [sums[k::len(which)] for k in range(len(which))] if examples else [sums] * len(which)


@torch.no_grad()
def reference_logps(model, rows: list[dict], budget: int, rank: int, world: int, device) -> list[tuple[float, float]]:
    """Collective: every row's two summed log-probs under `model`, each rank (or sequence-parallel group) computing a
    share."""
    group, groups = data_parallel(rank, world)
    mine = list(range(group, len(rows), groups))
    out = {}
    for mb in plan_equal_micro_batches([example_length(rows[i]) for i in mine], budget, device):
        first, second = example_logps(model, [rows[mine[j]] for j in mb])
        out.update({mine[j]: (a, b) for j, a, b in zip(mb, first.tolist(), second.tolist())})
    model.reshard()
    everyone = [None] * world
    dist.all_gather_object(everyone, out)
    merged = {i: pair for part in everyone for i, pair in part.items()}
    return [merged[i] for i in range(len(rows))]


def model_fingerprint(model: str | None, seed: int) -> str:
    """What identifies the reference's weights: the built-in model's seed, or the checkpoint's files (names, sizes,
    times: a retrained checkpoint in the same directory is another model)."""
    if model is None:
        return f"builtin:{seed}"
    if not os.path.isdir(model):
        return f"hub:{model}"
    files = sorted(f for f in os.listdir(model) if f.endswith((".safetensors", ".bin", ".json")))
    return json.dumps([model, [(f, os.path.getsize(os.path.join(model, f)),
                                os.path.getmtime(os.path.join(model, f))) for f in files]])


def cached_reference_logps(policy, train_rows: list[dict], eval_rows: list[dict], args, rank: int, world: int,
                           device, logger) -> dict[int, tuple[float, float]]:
    """Collective, before the first update (the policy is the reference then). The reference log-probs of the
    held-out rows and of the training rows the run's --steps will sample, kept in --ref-cache under a key of the
    model, the precision and the exact token ids of all rows (so data, template and lengths are in it): a later run
    on the same rows computes only what the cache lacks, and no reference model sits in memory while training.
    Numbers every row ("index": train rows first) and returns {index: (first, second)}."""
    rows = train_rows + eval_rows
    for i, row in enumerate(rows):
        row["index"] = i
    needed = rows_in_use(train_rows, args.pairs_per_step, args.seed, args.steps) + [r["index"] for r in eval_rows]
    key = hashlib.sha1((model_fingerprint(args.model, args.seed) + args.precision + json.dumps(
        [(r["prompt_ids"], *response_pair(r)) for r in rows])).encode()).hexdigest()[:16]
    path = os.path.join(args.ref_cache, f"{key}.pt")
    try:
        cache = torch.load(path) if os.path.isfile(path) else {}
    except Exception:  # noqa: BLE001 - a damaged cache file is recomputed, not trusted
        cache = {}
    missing = sorted(set(needed) - set(cache))
    if missing:
        cache.update(zip(missing, reference_logps(policy, [rows[i] for i in missing],
                                                  args.max_tokens_per_micro_batch, rank, world, device)))
        if rank == 0:
            os.makedirs(args.ref_cache, exist_ok=True)
            torch.save(cache, path + f".tmp{os.getpid()}")
            os.replace(path + f".tmp{os.getpid()}", path)
        dist.barrier()
    logger.print(f"reference log-probs of {len(needed)} rows: {len(needed) - len(missing)} from {path}, "
                 f"{len(missing)} computed")
    return cache


def rows_in_use(rows: list[dict], per_step: int, seed: int, steps: int) -> list[int]:
    """The "index" of every row the first `steps` steps will sample (the sampler's global batches are a function of
    the step, so this is known before training)."""
    sampler = PromptSampler(rows, per_step, 0, 1, seed)
    return sorted({row["index"] for _ in range(steps) for row in sampler.next_batch()})


class ReferenceLogps:
    """The reference policy's log-probs of examples: `frozen` (a model, None with a cache; a LoRA policy, whose base
    is the reference) computes them each time;
    otherwise they come from `cache` ({row "index": (first, second)}, cached_reference_logps). simpo has neither:
    zeros, which it never reads."""

    def __init__(self, frozen=None, cache: dict | None = None, budget: int = 0, device=None):
        self.frozen, self.cache, self.budget, self.device = frozen, cache, budget, device

    def cache_from(self, policy, train_rows: list[dict], eval_rows: list[dict], args, rank: int, world: int, device,
                   logger, timer) -> None:
        """Collective, before the first update (the policy is the reference then), where the run has no frozen
        reference and its loss reads one (offline, but for simpo): the cache (cached_reference_logps)."""
        if self.frozen is None and args.loss_type != "simpo" and not args.online:
            with timer("reference", setup=True):
                self.cache = cached_reference_logps(policy, train_rows, eval_rows, args, rank, world, device, logger)

    @torch.no_grad()
    def mismatched_kl(self, policy, rows: list[dict]) -> float:
        """Collective: an estimate of KL(policy || reference) from mismatched pairs (KTO's reference point): the
        mean over every rank's rows of log pi/pi_ref of the row's prompt with its KL partner's completion ("kl_ids";
        the reference's log-prob from the row's "ref", add_to)."""
        total = 0.0
        for mb in plan_equal_micro_batches([example_length(r) for r in rows], self.budget, self.device):
            (logps,) = example_logps(policy, [rows[i] for i in mb], which=(1,))
            total += sum(lp - rows[i]["ref"][1] for i, lp in zip(mb, logps.tolist()))
        policy.reshard()
        sums = sum_over_ranks({"kl": total, "rows": len(rows)}, self.device)
        return sums["kl"] / max(sums["rows"], 1)

    def add_to(self, examples: list[dict]) -> None:
        """Collective when frozen: sets each example's "ref" to (first, second) summed log-probs."""
        if self.frozen is not None:
            logps = [None] * len(examples)
            with torch.no_grad(), adapters_off(self.frozen):  # a LoRA policy as its own reference: the base
                for mb in plan_equal_micro_batches([example_length(e) for e in examples], self.budget, self.device):
                    first, second = example_logps(self.frozen, [examples[i] for i in mb])
                    for i, a, b in zip(mb, first.tolist(), second.tolist()):
                        logps[i] = (a, b)
            self.frozen.reshard()
        else:
            logps = [self.cache[e["index"]] if self.cache else (0.0, 0.0) for e in examples]
        for e, pair in zip(examples, logps):
            e["ref"] = pair


def reference_for(args, policy, tokenizer, device) -> ReferenceLogps:
    """The reference a run's loss compares the policy with: with --ref-cache none (and --online) a frozen model, the
    LoRA policy's own base or else a copy of --model as it starts; otherwise the cache that cache_from fills. simpo
    has none."""
    frozen = None
    if args.ref_cache == "none" and args.loss_type != "simpo":
        frozen = policy if args.lora_rank else load_reference(args, tokenizer, device)
    return ReferenceLogps(frozen, None, args.max_tokens_per_micro_batch, device)


@torch.no_grad()
def held_out_metrics(policy, reference, rows: list[dict] | None, losses_of, budget: int, rank: int, world: int,
                     device) -> dict:
    """Collective: held-out accuracy of the implicit reward, every rank a share of the rows: on pairs, the chosen
    response's reward above the rejected one's (preference accuracy, with the mean margin and loss); on KTO's
    unpaired rows, the completion's reward on the side of 0 its label says. losses_of(examples, unpaired) ->
    (losses [n], nll, stats) is the script's loss of a packed micro-batch of `budget` tokens; its stats count the
    "correct" and sum the chosen and rejected rewards."""
    if not rows:
        return {}
    group, groups = data_parallel(rank, world)  # a sequence-parallel group's ranks share their rows
    mine, unpaired = rows[group::groups], "label" in rows[0]
    reference.add_to(mine)
    sums = dict.fromkeys(["loss", "correct", "margin"], 0.0) | {"rows": len(mine)}
    for indices in plan_equal_micro_batches([example_length(r) for r in mine], budget, device):
        if not indices:  # this rank ran out of rows: a dummy pass keeps FSDP's collectives in step
            example_logps(policy, [])
            continue
        losses, _, stats = losses_of([mine[i] for i in indices], unpaired)
        sums["loss"] += losses.sum().item()
        sums["correct"] += stats["correct"]
        sums["margin"] += stats.get("reward_chosen", 0) - stats.get("reward_rejected", 0)
    policy.reshard()
    sums = sum_over_ranks(sums, device)
    n = max(sums["rows"], 1)
    if unpaired:
        return {"eval/label_accuracy": sums["correct"] / n}
    return {"eval/preference_accuracy": sums["correct"] / n, "eval/margin": sums["margin"] / n,
            "eval/loss": sums["loss"] / n}


def share_examples(examples: list[dict], world: int, rank: int) -> tuple[list[dict], dict]:
    """Collective: this rank's share of the step's examples, about the same tokens on every rank
    (share_samples_evenly), and what they count before sharing (each example once): "tokens" and "count"."""
    lengths = [example_length(e) for e in examples]
    counted = {"tokens": sum(lengths), "count": len(examples)}
    return share_samples_evenly(examples, lengths, world, rank)[0], counted


def example_source(args, rows: list[dict] | None, rollouts, make_pairs, reward_model, rm_tokenizer, tokenizer,
                   rank: int, world: int, device, timer):
    """Where the loop's examples come from: offline, the dataset's `rows` (DatasetExamples); --online, the policy's
    samples from `rollouts`, scored (with the reward model, if any) and paired by make_pairs(samples, args) ->
    (examples, sums), the script's pairing (OnlineExamples). `rollouts` (None where no prompts have answers) also
    measures greedy task accuracy."""
    if not args.online:
        return DatasetExamples(rows, args.pairs_per_step // world, rank, world, args.seed, rollouts)
    return OnlineExamples(rollouts, lambda samples: make_pairs(samples, args), reward_model, rm_tokenizer, tokenizer,
                          args.max_tokens_per_micro_batch, device, timer)


class DatasetExamples:
    """Examples from a dataset, `per_rank` a step, through the seeded sampler (its position is what a checkpoint
    saves). `rollouts` (optional): for greedy task accuracy where prompts have answers (the built-in task)."""

    def __init__(self, rows: list[dict], per_rank: int, rank: int, world: int, seed: int, rollouts=None):
        self.sampler, self.rollouts = PromptSampler(rows, per_rank, rank, world, seed), rollouts

    def start(self) -> dict:
        return self.rollouts.start() if self.rollouts is not None else {}

    def next_batch(self, step: int) -> tuple[list[dict], dict]:
        return self.sampler.next_batch(), {}

    def publish(self, step: int, stop: bool) -> dict:
        return self.rollouts.publish(step, stop) if self.rollouts is not None else {}

    def evaluate_task(self, step: int) -> dict:
        return self.rollouts.evaluate(step, due=True) if self.rollouts is not None else {}

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class OnlineExamples:
    """Examples sampled from the policy: `rollouts` gives each prompt's group of responses with their rule reward,
    `reward_model` (optional) adds its score, and `make_examples(samples) -> (examples, sums)` (the script's
    pairing) turns the scored group into examples. next_batch's metrics are summed over ranks."""

    def __init__(self, rollouts, make_examples, reward_model=None, rm_tokenizer=None, tokenizer=None, budget=0,
                 device=None, timer=None):
        self.rollouts, self.make_examples, self.reward_model = rollouts, make_examples, reward_model
        self.rm_tokenizer, self.tokenizer, self.budget, self.device, self.timer = rm_tokenizer, tokenizer, budget, \
            device, timer

    def next_batch(self, step: int) -> tuple[list[dict], dict]:
        samples, metrics = self.rollouts.next_batch(step)
        with self.timer("reward_model"):
            scores = reward_model_scores(self.reward_model, self.rm_tokenizer, self.tokenizer, samples, self.budget,
                                         self.device) if self.reward_model else None
        for i, s in enumerate(samples):
            s["score"] = s["reward"] + (scores[i] if scores else 0.0)
        examples, sums = self.make_examples(samples)
        sums = sum_over_ranks({**sums, "reward": sum(s["reward"] for s in samples), "samples": len(samples),
                               "response_tokens": sum(len(s["response_ids"]) for s in samples)}, self.device)
        n, groups = max(sums["samples"], 1), max(sums["groups"], 1)
        metrics.update({"reward/mean": sums["reward"] / n, "response/length_mean": sums["response_tokens"] / n,
                        "pairs/tie_frac": sums["ties"] / groups,
                        "pairs/reward_gap": sums["reward_gap"] / max(sums["groups"] - sums["ties"], 1)})
        return examples, metrics

    def start(self) -> dict:
        return self.rollouts.start()

    def publish(self, step: int, stop: bool) -> dict:
        return self.rollouts.publish(step, stop)

    def evaluate_task(self, step: int) -> dict:
        return self.rollouts.evaluate(step, due=True)

    def close(self) -> None:
        self.rollouts.close()

    def state_dict(self) -> dict:
        return self.rollouts.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.rollouts.load_state_dict(state)


def default_eval_size(args) -> int:
    """--eval-size's default for dpo.py (its resolve_defaults), as load_examples reads the data: of the prompts online,
    else of the pairs or KTO's rows (the built-in task's pairs and prompts both: 256)."""
    return default_prompt_eval_size(args) if args.online else default_pair_eval_size(args)


def load_examples(args, tokenizer) -> tuple:
    """dpo.py's data: (train rows, held-out rows, task rows, held-out task rows, notes to print). Offline: pairs or
    KTO's rows and held-out ones (common/data/preferences.py), and --steps' default, one epoch of them; prompts with
    answers where there are any (online: the prompts to sample from; the built-in task: for greedy task accuracy)."""
    rows = eval_rows = task_rows = eval_task_rows = None
    notes = []
    if not args.online:
        rows, eval_rows, stats = load_preference_rows(args, tokenizer, stop_token_ids(args.model, tokenizer))
        args.steps = args.steps or max(1, len(rows) // args.pairs_per_step)
        notes.append(f"{len(rows)} train{' rows' if args.loss_type == 'kto' else ''} / {len(eval_rows)} eval "
                     f"{'rows' if 'label' in eval_rows[0] else 'pairs'}; "
                     + ", ".join(f"{k} {v}" for k, v in stats.items()))
    if args.online or args.dataset is None:
        task_rows, eval_task_rows, task_notes = load_prompts(args, tokenizer)
        notes += task_notes
    return rows, eval_rows, task_rows, eval_task_rows, notes
