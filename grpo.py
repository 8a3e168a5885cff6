"""GRPO: Group Relative Policy Optimization (DeepSeekMath, https://arxiv.org/abs/2402.03300).

For each prompt, sample a group of responses, score them with a verifiable reward, and use each response's
reward relative to its group (minus the group mean, over the group std) as its advantage: no value network.
The policy is then updated with PPO's clipped surrogate, here with DAPO's separate low/high clip bounds
(https://arxiv.org/abs/2503.14476), an optional k3 KL penalty to a frozen reference model, and a choice of
loss aggregation (`--no-scale-rewards` with `--loss-agg seq-mean-token-sum-norm` gives Dr. GRPO,
https://arxiv.org/abs/2503.20783). Groups whose rewards are all equal carry no signal and are left out.

Each step: rollout -> reward -> advantages -> old/ref log-probs -> policy update -> weight sync -> log -> checkpoint.
Training runs under FSDP2 on packed token-budget micro-batches; rollouts come from vLLM on GPUs or from the trained
model itself (HF generate) on CPU, on every rank (colocated, the default) or on `--rollout-ranks K` ranks of their
own (split placement: `rollout_worker` below), which with `--async-rollout` generate the next batch while the
trainers train on this one, one update behind, corrected by truncated importance sampling (`--tis-cap`).
Left out on purpose: DAPO's dynamic sampling (refilling the batch with informative groups), overlong reward shaping.

    torchrun --nproc_per_node 2 grpo.py                  # built-in tiny model and task, CPU, about a minute
    torchrun --nproc_per_node 8 grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k \\
        --dataset-config main --prompt-key question --reward-fn gsm8k
"""

import collections
import os
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from common.batching import (TrainingMemoryPeak, batching_metrics, equalize_micro_batches, memory_in_use, mfu,
                             pack_sequences, packed_token_logprobs, pad_rows, peak_flops, plan_micro_batches,
                             share_samples_evenly, use_packed_attention)
from common.data import PromptSampler, load_train_eval, tokenize_prompts
from common.distributed import (all_reduce_sum, finish_distributed, init_distributed, max_over_ranks, quiet_libraries,
                                raise_on_all_ranks)
from common.logger import Logger, StageTimer
from common.model import (checkpoint_dtype, load_model, load_tokenizer, save_model_config, shard_model,
                          stop_token_ids)
from common.errors import parse_args, run_main
from common.resume import (BadStepCounter, is_bad_number, load_training_state, prune_checkpoints, read_trainer_state,
                           save_training_state, set_hyperparameters)
from common.rundir import open_run_dir
from common.signals import crash_point, exit_on_stop_signals, install_stop_handlers, stop_agreed, stop_requested
from common.rewards import RewardScorer
from common.rollout import make_rollout_engine, resolve_engine_kind
from common.split import (behaviour_version, check_shapes, close_link, eval_versions, init_split, load_into_module,
                          recv_header, recv_object, recv_weights, send_header, send_object, send_weights,
                          staleness_metrics, tis_metrics, weight_versions)
from sharding.checkpoint import save_hf_checkpoint
from sharding.vllm_sync import trainer_weights, weight_shapes


@dataclass
class Args:
    # model and data
    model: str | None = None
    """HF hub id or local directory of a causal LM; unset: the built-in tiny model (random init)"""
    dataset: str | None = None
    """HF hub dataset name or a local .jsonl/.json/.parquet/.csv file (also compressed, e.g. .jsonl.gz); unset: the
    built-in synthetic task"""
    dataset_config: str | None = None
    """configuration name of a hub dataset (e.g. `main` for openai/gsm8k)"""
    prompt_key: str = "prompt"
    """dataset column holding the prompt: a string, or a conversation (a list of {"role", "content"} messages,
    rendered by the chat template; the reward function gets its last user message)"""
    answer_key: str = "answer"
    """dataset column holding the reference answer passed to the reward function"""
    eval_split: str = "test"
    """hub dataset split to evaluate on; a local file holds out --eval-size rows instead"""
    eval_size: int | None = None
    """number of held-out prompts evaluated; unset: 256, or a tenth of a local file of fewer than 2,560 rows"""
    reward_fn: str | None = None
    """gsm8k, math, synthetic or path/to/file.py:function; unset: synthetic for the built-in task, else gsm8k"""
    reward_workers: int | None = None
    """processes per rank that run the reward function, scoring each prompt's responses as soon as they are
    generated, while the rest still generate; unset: 2 with vLLM, 1 with hf (whose generate returns every response
    at once)"""
    chat_template: bool | None = None
    """wrap prompts in the tokenizer's chat template; unset: when the tokenizer has one"""

    # rollout
    rollout_engine: Literal["auto", "vllm", "hf"] = "auto"
    """vllm on GPUs when installed, else hf (the trained model's own generate, slow but runs anywhere)"""
    rollout_tp: int = 1
    """vLLM tensor-parallel size; each group of this many ranks forms one generation replica"""
    rollout_gpu_memory: float = 0.5
    """fraction of GPU memory vLLM may take for weights and KV cache"""
    rollout_eager: bool = False
    """disable vLLM's CUDA graphs and compilation (faster start-up, slower generation)"""
    sync_bucket_mb: int = 512
    """size of the buckets the trainer's weights are streamed to vLLM in"""
    check_weight_sync: bool = False
    """after each weight sync, compare vLLM's weights with the trainer's and fail on a mismatch (colocated)"""
    rollout_ranks: int = 0
    """split placement: the last K ranks only generate (K / --rollout-tp replicas) and the others only train; the
    trainers stream new weights to them after each update. 0: every rank trains and generates (colocated)"""
    async_rollout: bool = False
    """with --rollout-ranks: generate the next batch while the trainers train on this one (off-policy by up to
    --max-staleness updates, corrected with --tis-cap)"""
    max_staleness: int = 1
    """with --async-rollout: how many updates behind the trainer the weights that generated a batch may be"""
    prompts_per_step: int = 16
    """prompts per step over all ranks"""
    group_size: int = 16
    """responses sampled per prompt"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use the same temperature)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
    max_prompt_len: int = 256
    """prompts longer than this many tokens are dropped (and counted)"""
    max_response_len: int | None = None
    """maximum new tokens per response (generation also stops at EOS); unset: 2 for the built-in task, else 1024"""

    # optimisation
    steps: int = 200
    """number of GRPO steps (rollout + update)"""
    lr: float | None = None
    """AdamW learning rate; unset: 5e-4 for the built-in tiny model (random init), else 1e-6"""
    warmup_steps: int = 5
    """linear learning-rate warmup over this many updates"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    clip_low: float = 0.2
    """PPO ratio clip below: ratio >= 1 - clip_low"""
    clip_high: float = 0.28
    """PPO ratio clip above: ratio <= 1 + clip_high (DAPO's clip-higher)"""
    kl_coef: float = 0.0
    """weight of the k3 KL penalty to the frozen initial policy; 0 loads no reference model"""
    scale_rewards: bool = True
    """divide advantages by the group's reward std (--no-scale-rewards: Dr. GRPO)"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how token losses become one number: mean over all tokens; mean over sequences of their token mean;
    mean over sequences of their token sum / max-response-len (Dr. GRPO)"""
    num_mini_batches: int = 1
    """optimizer steps per rollout batch (the batch is split into this many mini-batches)"""
    epochs: int = 1
    """passes over each rollout batch"""
    max_tokens_per_micro_batch: int = 16384
    """token budget of one forward/backward pass: sequences are packed end to end (no padding) up to this many"""
    tis_cap: float | None = None
    """truncated importance sampling: weight each token by min(p_trainer / p_rollout, cap) to correct for the
    rollout engine's numerical mismatch and, with --async-rollout, its older weights; unset: off, or 2 with
    --async-rollout"""
    activation_checkpointing: bool = False
    """recompute each decoder layer in backward to save memory"""

    # evaluation, checkpoints, logging
    eval_every: int = 25
    """greedy evaluation on the held-out prompts every this many steps (and before and after training)"""
    save_every: int = 0
    """write an HF-format checkpoint every this many steps; 0: only at the end"""
    save_state_every: int = 50
    """write a resumable training state (sharded model and optimizer, scheduler, data position, RNG) every this
    many steps; 0: only at the end and on SIGTERM"""
    keep_checkpoints: int = 2
    """resumable training states kept in the output dir (the newest); 0 keeps all"""
    resume: str = "auto"
    """auto: continue from the newest intact training state in the output dir, if any; none: start afresh (refused
    where another run's files are, unless --overwrite); or the path of a state_<step> directory"""
    overwrite: bool = False
    """delete the run already in the output dir (its states, exports and metrics) and start afresh"""
    reward_timeout: float | None = 30.0
    """seconds one reward call may take: a slower one is stopped (its process killed and replaced), scores 0 and is
    counted (reward/timeouts); None: no limit"""
    max_bad_steps: int = 5
    """stop after this many steps in a row whose update was skipped for a NaN/inf loss or gradient norm"""
    output_dir: str | None = None
    """where checkpoints, metrics and W&B files go; unset: runs/<run-name>. One run at a time per directory"""
    run_name: str | None = None
    """unset: grpo_<dataset>_s<seed>_<hash of the flags that define the run>, so that the same command resumes its
    run and a changed one starts a new run (--steps, cadences, logging and memory flags are not in the hash)"""
    seed: int = 1
    """seed for the model init, data order and sampling"""
    track: bool = False
    """log to Weights & Biases (respects WANDB_MODE, e.g. offline)"""
    wandb_project: str = "nanorl"
    """W&B project"""


# Flags a resumed run cannot change: its saved state (weights, optimizer, data position) would mean nothing.
FIXED_ON_RESUME = ("model", "dataset", "dataset_config", "prompt_key", "answer_key", "eval_split", "eval_size", "seed",
                   "group_size", "prompts_per_step", "max_prompt_len", "chat_template")


def check_args(args: Args, world: int) -> None:
    """Flag values and combinations that cannot work, each with a one-line error (before any model is loaded).
    world: the ranks that train (all of them, or those left by --rollout-ranks)."""
    for name, value, low in [("lr", args.lr, 0), ("temperature", args.temperature, 0), ("top_p", args.top_p, 0),
                             ("max_grad_norm", args.max_grad_norm, 0), ("reward_timeout", args.reward_timeout, 0)]:
        if value is not None and not value > low:
            hint = " (greedy decoding has no sampling distribution to train on)" if name == "temperature" else ""
            raise ValueError(f"--{name.replace('_', '-')} must be greater than {low}, got {value}{hint}")
    for name in ["steps", "prompts_per_step", "max_response_len", "max_prompt_len", "epochs", "num_mini_batches",
                 "eval_size", "max_tokens_per_micro_batch", "reward_workers", "rollout_tp"]:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ["warmup_steps", "weight_decay", "clip_low", "clip_high", "kl_coef", "eval_every", "save_every",
                 "save_state_every", "keep_checkpoints", "rollout_ranks"]:
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if args.top_p > 1:
        raise ValueError(f"--top-p must be at most 1, got {args.top_p}")
    if args.prompts_per_step % world:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must be divisible by the {world} training ranks")
    generating = args.rollout_ranks or world
    if generating % args.rollout_tp:
        raise ValueError(f"--rollout-tp {args.rollout_tp} must divide the number of generating ranks ({generating})")
    if args.rollout_ranks and args.prompts_per_step % args.rollout_ranks:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must be divisible by --rollout-ranks "
                         f"{args.rollout_ranks}")
    if args.async_rollout and not args.rollout_ranks:
        raise ValueError("--async-rollout needs --rollout-ranks K: ranks that generate while the others train")
    if args.max_staleness < 1:
        raise ValueError("--max-staleness must be at least 1")
    if args.group_size < 2:
        raise ValueError("--group-size must be at least 2: advantages are relative to the group")
    if args.prompts_per_step * args.group_size // world < args.num_mini_batches:
        raise ValueError(f"--num-mini-batches {args.num_mini_batches} is more than the samples per rank")
    if args.max_prompt_len + args.max_response_len > args.max_tokens_per_micro_batch:
        raise ValueError(f"--max-tokens-per-micro-batch {args.max_tokens_per_micro_batch} must hold one whole sequence: "
                         f"--max-prompt-len + --max-response-len = {args.max_prompt_len + args.max_response_len}")


def group_advantages(rewards: torch.Tensor, scale: bool, eps: float = 1e-6) -> torch.Tensor:
    """rewards: [prompts, group] -> advantages of the same shape: (r - group mean) [/ group std]."""
    advantages = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        advantages = advantages / (rewards.std(dim=1, keepdim=True) + eps)
    return advantages


def policy_loss(logprobs, old_logprobs, advantages, clip_low, clip_high, ref_logprobs=None, kl_coef=0.0,
                tis_weights=None):
    """Per-token GRPO loss. All tensors [batch, seq] (advantages broadcast per sequence as [batch, 1]).

    Returns the token losses, whether each token was clipped, and the k3 KL estimate to the reference.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # pessimistic bound: no gain from moving the ratio past the clip
    if tis_weights is not None:
        loss = loss * tis_weights
    kl = torch.zeros_like(loss)
    if ref_logprobs is not None:
        delta = ref_logprobs - logprobs
        kl = torch.exp(delta) - delta - 1  # k3: unbiased, always >= 0 (http://joschu.net/blog/kl-approx.html)
        loss = loss + kl_coef * kl
    return loss, clipped > unclipped, kl


def aggregate_loss(token_loss, mask, mode: str, num_tokens: float, num_seqs: float, max_response_len: int):
    """Sum this micro-batch's share of the mini-batch loss.

    token_loss, mask: [batch, seq]. num_tokens / num_seqs count the whole mini-batch over all ranks and micro-batches,
    so the sum of this over micro-batches (and the average over ranks, times world size) is the mini-batch loss,
    whatever the split.
    """
    masked = token_loss * mask
    if mode == "token-mean":
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (num_seqs * max_response_len)
    raise ValueError(f"unknown --loss-agg {mode!r}")


def sample_lengths(samples: list[dict]) -> list[int]:
    return [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]


def plan_equal_micro_batches(samples: list[dict], max_tokens: int, device) -> list[list[int]]:
    """Token-budget micro-batches of `samples`, as many on every rank (FSDP's collectives must pair up)."""
    lengths = sample_lengths(samples)
    plan = plan_micro_batches(lengths, max_tokens)
    return equalize_micro_batches(plan, lengths, max_over_ranks(len(plan), device))


def packed_response_logprobs(model, samples: list[dict], temperature: float, with_entropy: bool = False):
    """Packs prompt + response of each sample into one row; returns per-sample response log-probs (and entropies)."""
    packed = pack_sequences([s["prompt_ids"] + s["response_ids"] for s in samples],
                            [len(s["response_ids"]) for s in samples] if samples else None)
    logprobs, entropy = packed_token_logprobs(model, packed, temperature, with_entropy=with_entropy)
    split = lambda x: None if x is None else list(x.split(packed["num_scored"]))
    return split(logprobs), split(entropy)


@torch.no_grad()
def compute_logprobs(model, samples: list[dict], max_tokens: int, temperature: float, device) -> list[torch.Tensor]:
    """Each sample's response-token log-probs under `model` ([len(response)] on CPU), in sample order."""
    out = [None] * len(samples)
    for mb in plan_equal_micro_batches(samples, max_tokens, device):  # an empty mb runs a dummy: same collectives
        logprobs, _ = packed_response_logprobs(model, [samples[i] for i in mb], temperature)
        for i, lp in zip(mb, logprobs):
            out[i] = lp.float().cpu()
    model.reshard()  # FSDP2 keeps the root's weights gathered after a forward with no backward: free them
    return out


def update_policy(model, optimizer, samples: list[dict], args: Args, world: int, device, generator) -> dict[str, float]:
    """PPO-style epochs over mini-batches of the rollout batch; one optimizer step per mini-batch.

    Each mini-batch runs as packed token-budget micro-batches; the loss normalisers count the whole mini-batch on
    all ranks, so the gradient does not depend on how it is split. Samples are shuffled with `generator` each
    epoch (None keeps their order).
    """
    sums = dict.fromkeys(["loss", "pg_clipfrac", "kl", "entropy", "tokens", "grad_norm", "opt_steps", "skipped"], 0.0)
    for _ in range(args.epochs):
        order = torch.randperm(len(samples), generator=generator) if generator is not None else torch.arange(len(samples))
        # tensor_split: exactly num_mini_batches parts on every rank, even where ranks hold different sample counts
        # (chunk would give some ranks fewer parts, and their collectives would pair up wrongly).
        for mini_indices in torch.tensor_split(order, args.num_mini_batches):
            mini = [samples[i] for i in mini_indices.tolist()]
            num_tokens, num_seqs = all_reduce_sum([sum(len(s["response_ids"]) * s["loss_weight"] for s in mini),
                                                   sum(s["loss_weight"] > 0 for s in mini)], device)
            if num_tokens == 0:  # every group in this mini-batch had equal rewards, on every rank
                continue
            optimizer.zero_grad(set_to_none=True)
            for mb in plan_equal_micro_batches(mini, args.max_tokens_per_micro_batch, device):
                mbs = [mini[i] for i in mb]
                logprobs, entropy = packed_response_logprobs(model, mbs, args.temperature, with_entropy=True)
                if not mbs:  # this rank ran out of samples: a zero-weight pass keeps FSDP's collectives in step
                    (logprobs[0].sum() * 0.0).backward()
                    continue
                logprobs, entropy = pad_rows(logprobs), pad_rows(entropy)  # [n, longest response]
                old = pad_rows([s["old_logprobs"] for s in mbs]).to(device)
                mask = pad_rows([[s["loss_weight"]] * len(s["response_ids"]) for s in mbs]).to(device)
                advantages = torch.tensor([[s["advantage"]] for s in mbs], device=device)  # [n, 1]
                ref = pad_rows([s["ref_logprobs"] for s in mbs]).to(device) if "ref_logprobs" in mbs[0] else None
                tis = None
                if args.tis_cap is not None:  # p_trainer / p_rollout on the sampled tokens, capped
                    tis = (old - pad_rows([s["logprobs"] for s in mbs]).to(device)).exp().clamp(max=args.tis_cap)
                token_loss, clipped, kl = policy_loss(logprobs, old, advantages, args.clip_low, args.clip_high,
                                                      ref, args.kl_coef, tis)
                loss = aggregate_loss(token_loss, mask, args.loss_agg, num_tokens, num_seqs, args.max_response_len)
                (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already a global mean
                with torch.no_grad():
                    sums["loss"] += loss.item() * world
                    sums["pg_clipfrac"] += (clipped * mask).sum().item()
                    sums["kl"] += (kl * mask).sum().item()
                    sums["entropy"] += (entropy * mask).sum().item()
                    sums["tokens"] += mask.sum().item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if is_bad_number(grad_norm):  # the global norm: a NaN/inf on any rank shows here on every rank
                optimizer.zero_grad(set_to_none=True)  # skip: one NaN in Adam's moments would spoil every later step
                sums["skipped"] += 1
                continue
            sums["grad_norm"] += grad_norm
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # no gradients held through the rollout
            sums["opt_steps"] += 1
    return sums


def generate_and_score(engine, scorer: RewardScorer, tokenizer, rows: list[dict], **sampling) -> list[list]:
    """engine.generate on the rows' prompts; each prompt's group goes to the scorer as soon as it is complete, so
    with reward workers its scoring overlaps the generation of the others (collect_rewards gets the results)."""
    def score(i: int, completions: list) -> None:
        texts = [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions]
        scorer.submit(i, [rows[i]["prompt"]] * len(texts), texts, [rows[i]["answer"]] * len(texts))

    return engine.generate([r["prompt_ids"] for r in rows], on_finish=score, **sampling)


def collect_rewards(scorer: RewardScorer) -> tuple[list[list[float]], int]:
    """Collective: the rewards of the groups generated since the last call, by prompt, and how many reward calls
    timed out. A reward function that fails on any rank stops every rank with its message (instead of leaving the
    others in a collective)."""
    error, rewards, timeouts = None, [], 0
    try:
        rewards, timeouts = scorer.collect()
    except Exception as e:  # noqa: BLE001 - re-raised on every rank below
        error = e
    raise_on_all_ranks(error)
    return rewards, timeouts


def build_samples(prompts: list[dict], outputs, scorer: RewardScorer, args: Args,
                  version: int) -> tuple[list[dict], int]:
    """Collective (rewards): one dict per response with its reward, its advantage relative to its prompt's group,
    a loss weight (0 for groups whose rewards are all equal: no signal) and the weight version that generated it;
    and the number of reward calls that timed out."""
    samples = [dict(prompt_ids=p["prompt_ids"], response_ids=c.response_ids, logprobs=c.logprobs,
                    finished=c.finished, version=version) for p, group in zip(prompts, outputs) for c in group]
    rewards, timeouts = collect_rewards(scorer)
    rewards = torch.tensor(rewards, dtype=torch.float32).view(len(prompts), args.group_size)
    advantages = group_advantages(rewards, args.scale_rewards)
    informative = (rewards.std(dim=1) > 0).repeat_interleave(args.group_size)
    for s, r, a, keep in zip(samples, rewards.flatten().tolist(), advantages.flatten().tolist(), informative.tolist()):
        s["reward"], s["advantage"], s["loss_weight"] = r, a, float(keep)
    return samples, timeouts


def evaluate(engine, eval_rows, scorer, tokenizer, args: Args, rank: int, world: int, device) -> dict[str, float]:
    """Greedy pass@1 and mean reward on the held-out prompts, split evenly over ranks."""
    per_rank = -(-len(eval_rows) // world)
    mine = eval_rows[rank * per_rank:(rank + 1) * per_rank]
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine = mine + [eval_rows[0]] * (per_rank - len(mine))  # every rank generates the same number of prompts
    generate_and_score(engine, scorer, tokenizer, mine, n=1, max_tokens=args.max_response_len, temperature=1.0,
                       top_p=1.0, seed=0, greedy=True)
    rewards = [group[0] for group in collect_rewards(scorer)[0]]
    total, reward_sum, correct = all_reduce_sum(
        [sum(weights), sum(w * r for w, r in zip(weights, rewards)), sum(w * (r > 0) for w, r in zip(weights, rewards))],
        device)
    return {"eval/accuracy": correct / total, "eval/reward": reward_sum / total}


def rollout_worker(args: Args, placement, device, tokenizer, train_rows, eval_rows, scorer, stop_ids,
                   output_dir: str, start_step: int) -> None:
    """Split placement (--rollout-ranks), on a rollout rank: receive weights, generate, score, send; repeat.

    The trainers send the versions of `weight_versions`, and this side receives each one just before the first
    batch that needs it (so with --async-rollout it generates with weights up to --max-staleness updates old),
    evaluates the versions due for evaluation, and sends each batch to trainer 0 without waiting for it to arrive:
    up to max(1, staleness) batches may be on their way while this side waits for the next version.
    The last message carries the evaluations of the last versions; the trainers save after it.
    """
    staleness = args.max_staleness if args.async_rollout else 0
    if start_step >= args.steps:  # resumed at the end: the trainers have nothing to send either
        scorer.close()
        return finish_distributed(exit_process=True)
    model_dir = save_model_config(args.model, tokenizer, os.path.join(output_dir, f"model_config_rollout{placement.rank}"))
    if args.rollout_engine == "vllm":
        engine = make_rollout_engine("vllm", None, model_dir, tokenizer, stop_ids, placement.rank, args.rollout_tp,
                                     args.rollout_gpu_memory, args.max_prompt_len + args.max_response_len, args.seed,
                                     args.rollout_eager, args.sync_bucket_mb)
        with torch.device("meta"):  # names and shapes only
            shapes = weight_shapes(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)))
        dtype, load, loaded = torch.bfloat16, engine.vllm_model.load_weights, engine.llm.reset_prefix_cache
    else:
        model = load_model(args.model, tokenizer, args.seed).to(device)  # overwritten by the first version received
        engine = make_rollout_engine("hf", model, model_dir, tokenizer, stop_ids, placement.rank, args.rollout_tp,
                                     0.0, 0, args.seed, False, 0)
        shapes, dtype, load, loaded = weight_shapes(model), torch.float32, load_into_module(model), lambda: None
    # After the engine, which may set handlers of its own. Nothing to save here: the trainers save, and a resumed run
    # sends the weights back.
    exit_on_stop_signals()
    sampler = PromptSampler(train_rows, args.prompts_per_step // placement.world, placement.rank, placement.world,
                            args.seed)
    for _ in range(start_step):  # the trainers' data position: batches are a function of the step
        sampler.next_batch()
    versions = weight_versions(start_step, args.steps, staleness, args.eval_every)
    to_evaluate = set(eval_versions(start_step, args.steps, args.eval_every))
    held, evals, seconds, pending = None, {}, {}, collections.deque()
    pending.append(send_object(placement.samples_link, shapes, 0))  # trainer 0 checks them against its own

    def receive_through(version: int) -> None:
        """Receives every scheduled version up to `version`, evaluating those due."""
        nonlocal held
        while versions and versions[0] <= version:
            received = recv_header(placement, device)
            assert received == versions.pop(0), f"weight version {received} arrived out of schedule"
            start = time.perf_counter()
            recv_weights(placement, shapes, dtype, args.sync_bucket_mb, device, load)
            loaded()  # vLLM: cached prompt KV was computed with the old weights
            seconds["sync"] = seconds.get("sync", 0.0) + time.perf_counter() - start
            held = received
            if held in to_evaluate:
                start = time.perf_counter()
                evals[held] = evaluate(engine, eval_rows, scorer, tokenizer, args, placement.rank,
                                       placement.world, device)
                seconds["eval"] = seconds.get("eval", 0.0) + time.perf_counter() - start

    def send(message: dict) -> None:
        # A send completes once trainer 0 receives it, and trainer 0 takes batch k only after it has sent the
        # version that batch k + staleness is generated with: so up to `staleness` batches stay in flight.
        while len(pending) >= max(1, staleness):
            pending.popleft().wait()
        message.update(evals=dict(evals), seconds=dict(seconds))
        evals.clear(), seconds.clear()
        pending.append(send_object(placement.samples_link, message, 0))

    for step in range(start_step + 1, args.steps + 1):
        receive_through(behaviour_version(step, start_step, staleness))
        prompts = sampler.next_batch()
        start = time.perf_counter()
        outputs = generate_and_score(engine, scorer, tokenizer, prompts, n=args.group_size,
                                     max_tokens=args.max_response_len, temperature=args.temperature,
                                     top_p=args.top_p, seed=args.seed * 1_000_003 + step)
        seconds["generate"] = time.perf_counter() - start
        start = time.perf_counter()  # what scoring adds after generation
        samples, reward_timeouts = build_samples(prompts, outputs, scorer, args, version=held)
        seconds["reward"] = time.perf_counter() - start
        send({"step": step, "samples": samples, "reward_timeouts": reward_timeouts})
    receive_through(args.steps)  # the last versions (evaluation only)
    send({"step": None, "samples": [], "reward_timeouts": 0})
    while pending:
        pending.popleft().wait()
    close_link(placement)
    scorer.close()
    finish_distributed(exit_process=True)


def main():
    args = parse_args(Args)
    given = asdict(args)  # as on the command line: they name the run (common/rundir.py)
    placement = None  # colocated: every rank trains and generates
    if args.rollout_ranks:  # split: each role gets a world of its own (see common/split.py)
        placement, device = init_split(args.rollout_ranks)
        rank, world = placement.rank, placement.world
    else:
        rank, world, device = init_distributed()
    training = placement is None or placement.role == "train"
    quiet_libraries()
    tp = args.rollout_tp
    prompts_per_rank = args.prompts_per_step // world
    # Defaults that depend on the task: the built-in one is tiny and starts from random weights.
    builtin = args.dataset is None
    args.reward_fn = args.reward_fn or ("synthetic" if builtin else "gsm8k")
    args.max_response_len = (2 if builtin else 1024) if args.max_response_len is None else args.max_response_len
    args.lr = (5e-4 if args.model is None else 1e-6) if args.lr is None else args.lr
    if args.async_rollout and args.tis_cap is None:
        args.tis_cap = 2.0
    args.rollout_engine = resolve_engine_kind(args.rollout_engine)
    if args.reward_workers is None:
        args.reward_workers = 2 if args.rollout_engine == "vllm" else 1
    check_args(args, placement.num_trainers if placement else world)
    torch.manual_seed(args.seed)

    # The run's directory: locked for this run, and resumed from its newest intact training state (--resume auto).
    run_dir = open_run_dir("grpo", given, asdict(args), FIXED_ON_RESUME)
    resume_path, output_dir = run_dir.resume_from, run_dir.path
    resumed = read_trainer_state(resume_path) if resume_path else {"step": 0, "extra": {}}
    start_step = resumed["step"]

    # Data and rewards (both roles: in split placement the rollout ranks sample prompts and score responses).
    tokenizer = load_tokenizer(args.model)
    train_rows, eval_rows = load_train_eval(args.dataset, args.prompt_key, args.answer_key, args.dataset_config,
                                            eval_split=args.eval_split, eval_size=args.eval_size, seed=args.seed)
    train_rows, dropped = tokenize_prompts(train_rows, tokenizer, args.max_prompt_len, args.chat_template)
    eval_rows, eval_dropped = tokenize_prompts(eval_rows, tokenizer, args.max_prompt_len, args.chat_template)
    # Reward processes where responses are generated: not on the trainers of split placement.
    scorer = RewardScorer(args.reward_fn, args.reward_timeout, args.reward_workers) if placement is None or \
        not training else None
    # Rollout engines see only token ids and stop at EOS.
    stop_ids = stop_token_ids(args.model, tokenizer)
    if not training:
        return rollout_worker(args, placement, device, tokenizer, train_rows, eval_rows, scorer, stop_ids, output_dir,
                              start_step)

    # Model, reference model, optimizer.
    policy = shard_model(load_model(args.model, tokenizer, args.seed), device, args.activation_checkpointing)
    reference = None
    if args.kl_coef > 0:
        reference = shard_model(load_model(args.model, tokenizer, args.seed), device, trainable=False)
    # Training passes run on packed rows; the colocated HF rollout engine generates with the policy itself, so it
    # keeps an attention that also takes padded batches (transformers' sdpa, which reads packing from position ids).
    if device.type == "cuda" and (args.rollout_engine != "hf" or placement):
        for model in filter(None, [policy, reference]):
            use_packed_attention(model, device)
    num_params, peak = sum(p.numel() for p in policy.parameters()), peak_flops(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.99))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))

    logger = Logger(rank, args.steps, args.track, args.wandb_project, run_dir.name, asdict(args), output_dir,
                    run_id=resumed["extra"].get("wandb_run_id"), start_step=start_step)
    for note in run_dir.notes:
        logger.print(note)
    logger.print(f"{len(train_rows)} train / {len(eval_rows)} eval prompts; dropped {dropped} / {eval_dropped} "
                 f"longer than --max-prompt-len {args.max_prompt_len}")
    # In split placement the rollout ranks draw the prompts; the trainers' sampler only keeps the data position
    # that checkpoints save (batches are a function of the step, so both sides agree).
    sampler = PromptSampler(train_rows, prompts_per_rank, rank, world, args.seed)
    engine = None
    if placement:
        logger.print(f"split placement: {placement.num_trainers} training ranks, {placement.num_rollout} rollout ranks"
                     + (f", async (max staleness {args.max_staleness}, TIS cap {args.tis_cap})"
                        if args.async_rollout else ", synchronous"))
    else:
        model_dir = os.path.join(output_dir, "model_config")  # architecture only: vLLM starts with dummy weights
        if rank == 0:
            save_model_config(args.model, tokenizer, model_dir)
        dist.barrier()
        engine = make_rollout_engine(args.rollout_engine, policy, model_dir, tokenizer, stop_ids, rank, tp,
                                     args.rollout_gpu_memory, args.max_prompt_len + args.max_response_len, args.seed,
                                     args.rollout_eager, args.sync_bucket_mb)
    timer = StageTimer(device)
    synced_step = -1  # the policy version the engine holds

    def sync_engine(step: int) -> dict[str, float]:
        nonlocal synced_step
        if synced_step == step:
            return {}
        with timer("sync"):
            metrics = engine.update_weights(policy)
        if args.check_weight_sync:
            with timer("check_sync"):
                engine.check_weights(policy)
        synced_step = step
        return metrics

    def run_eval(step: int) -> dict[str, float]:
        sync_engine(step)
        with timer("eval"):
            metrics = evaluate(engine, eval_rows, scorer, tokenizer, args, rank, world, device)
        engine.sleep()
        return metrics

    # Split placement: batches arrive from the rollout ranks; new weights go to them (common/split.py).
    staleness = args.max_staleness if args.async_rollout else 0
    versions_to_send = set(weight_versions(start_step, args.steps, staleness, args.eval_every)) if placement else set()
    link_dtype = torch.bfloat16 if args.rollout_engine == "vllm" else torch.float32
    shapes = weight_shapes(policy) if placement else None

    def push_weights(version: int) -> dict[str, float]:
        send_header(placement, version, device)
        with timer("sync"):  # includes waiting for the rollout ranks to take it (when they are still generating)
            num_bytes = send_weights(placement, trainer_weights(policy, None, link_dtype), link_dtype,
                                     args.sync_bucket_mb, device)
        return {"sync/gb": num_bytes / 1e9} if placement.on_link else {}

    def receive_batch(step: int | None) -> dict:
        """Trainer 0 takes one message from every rollout rank; every trainer keeps its slice of the samples.
        step None: the last message, with the evaluations of the last versions."""
        box = [[recv_object(placement.samples_link, 1 + r) for r in range(placement.num_rollout)]
               if placement.on_link else None]
        dist.broadcast_object_list(box, src=0)
        messages = box[0]
        assert all(m["step"] == step for m in messages), f"expected step {step}, got {[m['step'] for m in messages]}"
        samples = [s for m in messages for s in m["samples"]]
        per_rank = len(samples) // world
        return {"samples": samples[rank * per_rank:(rank + 1) * per_rank], "evals": messages[0]["evals"],
                "seconds": {k: max(m["seconds"].get(k, 0.0) for m in messages) for k in messages[0]["seconds"]},
                "reward_timeouts": sum(m["reward_timeouts"] for m in messages) if rank == 0 else 0}

    def log_evals(step: int, evals: dict[int, dict], metrics: dict) -> None:
        """Evaluations from the rollout ranks arrive with later batches and are logged with their version; when
        two land in one step, the earlier gets a row of its own."""
        nonlocal first_eval, last_eval
        for version, result in sorted(evals.items()):
            if "eval/version" in metrics:
                logger.log(step, {k: metrics.pop(k) for k in [*result, "eval/version"]}, advance=False)
            first_eval = result if version == 0 else first_eval
            last_eval = result
            metrics.update({**result, "eval/version": version})

    def save_state(step: int) -> None:
        with timer("save_state"):
            save_training_state(output_dir, step, policy, optimizer, scheduler, sampler,
                                {"wandb_run_id": logger.run_id, "first_eval": first_eval, "last_eval": last_eval,
                                 "bad_steps_in_a_row": bad_steps.in_a_row, "args": asdict(args)})
            prune_checkpoints(output_dir, args.keep_checkpoints)

    # Installed after the engine, which may set handlers of its own: SIGTERM and Ctrl-C now mean "finish the step,
    # save, stop" (common/signals.py).
    install_stop_handlers()
    bad_steps = BadStepCounter(args.max_bad_steps)
    first_eval = last_eval = None
    if resume_path:  # last, so that the restored RNG states are the ones the loop continues with
        if engine is not None:
            engine.sleep()  # the optimizer state that loading allocates needs the memory an awake vLLM holds
        info = load_training_state(resume_path, policy, optimizer, scheduler, sampler)
        set_hyperparameters(optimizer, scheduler, args.lr, args.weight_decay)  # this command's, not the saved ones
        first_eval, last_eval = info["extra"]["first_eval"], info["extra"]["last_eval"]
        bad_steps.in_a_row = info["extra"]["bad_steps_in_a_row"]
        logger.print(f"resumed from {resume_path} at step {start_step}" + ("" if info["exact_rng"] else
                     f" (saved on {info['saved_world_size']} ranks: model, optimizer and data position are exact, "
                     f"random streams re-seeded)"))
    elif engine is not None:
        first_eval = last_eval = run_eval(0)
        logger.log(0, {**first_eval, **timer.pop()}, advance=False)
    if placement and start_step < args.steps:  # the rollout ranks start from the trainers' weights
        if placement.on_link:
            for r in range(placement.num_rollout):
                check_shapes(shapes, recv_object(placement.samples_link, 1 + r), r)
        push_weights(start_step)
        timer.pop()

    for step in range(start_step + 1, args.steps + 1):
        step_start = time.perf_counter()
        rollout_memory = 0  # bytes in use on this GPU while vLLM is awake (colocated)
        # Seeded per step (and rank), so a resumed run shuffles its mini-batches as an uninterrupted one would.
        generator = torch.Generator().manual_seed((args.seed * 7919 + rank) * 1_000_003 + step)
        if placement:  # 1-3 happened on the rollout ranks: generation, rewards, advantages
            sampler.next_batch()  # the data position only
            with timer("rollout_wait"):
                batch = receive_batch(step)
            samples, reward_timeouts = batch["samples"], batch["reward_timeouts"]
            metrics = {f"time/rollout_{k}": v for k, v in batch["seconds"].items()}
            log_evals(step, batch["evals"], metrics)
        else:
            metrics = sync_engine(step - 1)
            # 1. Rollout: group_size responses per prompt.
            prompts = sampler.next_batch()
            with timer("rollout"):  # rewards are scored meanwhile, each group as soon as it is complete
                outputs = generate_and_score(engine, scorer, tokenizer, prompts, n=args.group_size,
                                             max_tokens=args.max_response_len, temperature=args.temperature,
                                             top_p=args.top_p, seed=args.seed * 1_000_003 + step)
            if device.type == "cuda":
                rollout_memory = memory_in_use(device)
            engine.sleep()
            # 2-3. Rewards (every rank scores its own samples; a failure anywhere stops every rank), advantages.
            with timer("reward"):  # what scoring adds after generation
                samples, reward_timeouts = build_samples(prompts, outputs, scorer, args, version=step - 1)
        rollout_sums = [sum(s["reward"] for s in samples), sum(s["reward"] > 0 for s in samples), len(samples),
                        sum(len(s["response_ids"]) for s in samples), sum(not s["finished"] for s in samples),
                        sum(s["loss_weight"] > 0 for s in samples)]
        lag = staleness_metrics([s["version"] for s in samples], step - 1, staleness)

        # Every rank takes about the same token work: samples move between ranks (the loss is a global mean anyway).
        samples, _ = share_samples_evenly(samples, sample_lengths(samples), world, rank)

        # 4. Log-probs of the sampled tokens under the current (old) policy and the reference.
        training_memory = TrainingMemoryPeak(device) if device.type == "cuda" else None
        with timer("logprobs"):
            budget = args.max_tokens_per_micro_batch
            for s, lp in zip(samples, compute_logprobs(policy, samples, budget, args.temperature, device)):
                s["old_logprobs"] = lp
            if reference is not None:
                for s, lp in zip(samples, compute_logprobs(reference, samples, budget, args.temperature, device)):
                    s["ref_logprobs"] = lp

        # 5. Policy update.
        with timer("update"):
            stats = update_policy(policy, optimizer, samples, args, world, device, generator)
            if stats["opt_steps"]:  # the schedule counts updates (a batch of equal-reward groups makes none)
                scheduler.step()

        stop = stop_agreed(device)  # SIGTERM / Ctrl-C on any rank: every rank saves and stops at this step
        if placement and not stop and step in versions_to_send:  # taken before the rollout ranks' next batch
            metrics.update(push_weights(step))
        if placement and step == args.steps:  # the evaluations of the last versions, before the last save
            log_evals(step, receive_batch(None)["evals"], metrics)
            close_link(placement)

        # 6. Log: sums over ranks, then means.
        lengths = sample_lengths(samples)
        metrics.update(batching_metrics(plan_equal_micro_batches(samples, budget, device), lengths, device))
        tis = (tis_metrics([s["old_logprobs"] for s in samples], [s["logprobs"] for s in samples], args.tis_cap)
               if args.tis_cap is not None else tis_metrics([], [], 0.0))  # zeros: nothing to report
        sums = all_reduce_sum(rollout_sums + [lag["staleness_sum"], tis["tis_weight_sum"], tis["tis_capped"]] + [
            sum((s["old_logprobs"] - torch.tensor(s["logprobs"])).abs().sum().item() for s in samples), sum(lengths),
            stats["loss"], stats["pg_clipfrac"], stats["kl"], stats["entropy"], stats["tokens"], stats["grad_norm"],
            stats["opt_steps"], stats["skipped"], reward_timeouts], device)
        (reward_sum, correct, count, response_tokens, truncated, informative_count, staleness_sum, tis_sum, tis_capped,
         lp_diff, total_tokens,
         loss, clipfrac, kl, entropy, trained_tokens, grad_norm, opt_steps, skipped, timeouts) = sums
        opt_steps = max(opt_steps / world, 1)
        update_seconds, step_seconds = timer.seconds["time/update"], time.perf_counter() - step_start
        metrics.update({
            "reward/mean": reward_sum / count, "reward/accuracy": correct / count,
            "reward/informative_frac": informative_count / count,
            "response/length_mean": response_tokens / count, "response/truncated_frac": truncated / count,
            "rollout/logprob_diff": lp_diff / max(response_tokens, 1),
            "loss/policy": loss / world / opt_steps, "loss/kl": kl / max(trained_tokens, 1),
            "policy/clip_frac": clipfrac / max(trained_tokens, 1), "policy/entropy": entropy / max(trained_tokens, 1),
            "policy/grad_norm": grad_norm / world / opt_steps, "policy/lr": scheduler.get_last_lr()[0],
            "perf/tokens_per_s": total_tokens / step_seconds, "time/step": step_seconds,
            "perf/train_tokens_per_s": total_tokens * args.epochs / update_seconds,
        })
        metrics.update({"update/skipped": skipped / world, "reward/timeouts": timeouts})
        if training_memory is not None:  # the step's peak on the fullest GPU: generating or training, all included
            metrics["perf/peak_memory_gb"] = max_over_ranks(max(rollout_memory, training_memory.peak()) / 1e9, device)
        if placement:  # how many updates old the weights that generated this batch were
            metrics.update({"rollout/staleness_mean": staleness_sum / count,
                            "rollout/staleness_max": max_over_ranks(lag["staleness_max"], device)})
        if args.tis_cap is not None:  # the truncated importance weights min(p_old / p_rollout, cap) per token
            metrics.update({"tis/weight_mean": tis_sum / max(response_tokens, 1),
                            "tis/capped_frac": tis_capped / max(response_tokens, 1),
                            "tis/ratio_max": max_over_ranks(tis["tis_ratio_max"], device)})
        bad_steps.record(skipped > 0, step)  # raises on every rank after --max-bad-steps in a row
        train_mfu = mfu(num_params, total_tokens * args.epochs, update_seconds, peak, num_gpus=world)
        if train_mfu is not None:
            metrics["perf/mfu"] = train_mfu
        metrics.update(timer.pop())
        if engine is not None and (args.eval_every and step % args.eval_every == 0 or step == args.steps):
            last_eval = run_eval(step)
            metrics.update(last_eval)
            metrics.update(timer.pop())
        if args.save_every and step % args.save_every == 0 or step == args.steps:
            with timer("save"):
                save_hf_checkpoint(policy, tokenizer, os.path.join(output_dir, f"hf_step_{step}"),
                                   checkpoint_dtype(args.model), probes=[train_rows[0]["prompt"]])
            metrics.update(timer.pop())
        logger.log(step, metrics)  # before the state: a state never exists without its step's row
        crash_point("after_row", step)
        if stop or args.save_state_every and step % args.save_state_every == 0 or step == args.steps:
            save_state(step)  # its time is logged with the next step
        crash_point("after_state", step)
        if stop:
            logger.print(f"{stop_requested() or 'a signal on another rank'}: saved the training state at step "
                         f"{step}; run the same command again to continue")
            logger.close()
            close_scorer(scorer)
            return finish_distributed(exit_process=placement is not None)

    if start_step >= args.steps:
        logger.print(f"{resume_path} is already at step {start_step} of {args.steps}: nothing to do "
                     f"(--resume none starts afresh, --steps trains further)")
    logger.print(f"held-out greedy accuracy: {first_eval['eval/accuracy']:.3f} before training -> "
                 f"{last_eval['eval/accuracy']:.3f} after {args.steps} steps; model saved to "
                 f"{os.path.join(output_dir, f'hf_step_{args.steps}')}")
    logger.close()
    close_scorer(scorer)
    finish_distributed(exit_process=placement is not None)


def close_scorer(scorer: RewardScorer | None) -> None:
    if scorer is not None:  # split placement's trainers score nothing
        scorer.close()


if __name__ == "__main__":
    run_main(main)
