"""GRPO: Group Relative Policy Optimization (DeepSeekMath, https://arxiv.org/abs/2402.03300).

For each prompt, sample a group of responses, score them with a verifiable reward, and use each response's
reward relative to its group (minus the group mean, over the group std) as its advantage: no value network.
The policy is then updated with PPO's clipped surrogate, here with DAPO's separate low/high clip bounds
(https://arxiv.org/abs/2503.14476), an optional k3 KL penalty to a frozen reference model, and a choice of
loss aggregation (`--no-scale-rewards` with `--loss-agg seq-mean-token-sum-norm` gives Dr. GRPO,
https://arxiv.org/abs/2503.20783). Groups whose rewards are all equal carry no signal and get no passes.

Each step: rollout -> reward -> advantages -> old/ref log-probs -> policy update -> weight sync -> log -> checkpoint.
Training runs under FSDP2 on packed token-budget micro-batches; rollouts come from vLLM on GPUs or from the trained
model itself (HF generate) on CPU, on every rank (colocated, the default) or on `--rollout-ranks K` ranks of their
own (split placement), which with `--async-rollout` generate the next batch while the trainers train on this one,
one update behind, corrected by truncated importance sampling (`--tis-cap`). Where samples come from is
common/rollouts.py's business; this file is the algorithm. Left out on purpose: DAPO's dynamic sampling (refilling
the batch with informative groups), overlong reward shaping.

    torchrun --nproc_per_node 2 grpo.py                  # built-in tiny model and task, CPU, about a minute
    torchrun --nproc_per_node 8 grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k \\
        --dataset-config main --prompt-key question --reward-fn gsm8k
"""

import os
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from common.batching import batching_metrics, pad_rows, plan_equal_micro_batches, share_samples_evenly
from common.distributed import finish_distributed, max_over_ranks, sum_over_ranks
from common.errors import check_ranges, parse_args, run_main
from common.logger import start_logging
from common.logprobs import compute_logprobs, packed_response_logprobs, sample_lengths, use_packed_attention
from common.model import load_model, load_tokenizer, shard_model
from common.optim import BadStepCounter, clip_and_step, make_optimizer
from common.perf import StepPerf
from common.resume import Checkpoints
from common.rollouts import (Rollouts, check_rollout_args, fill_rollout_defaults, load_prompts, mismatch_metrics,
                             serve_rollouts)
from common.rundir import open_run_dir
from common.signals import stop_agreed
from common.split import init_placement


@dataclass
class Args:
    # model and data
    model: str | None = None
    """HF hub id or local directory of a causal LM; unset: the built-in tiny model (random init)"""
    dataset: str | None = None
    """HF hub dataset or a local .jsonl/.json/.parquet/.csv (also compressed: .jsonl.gz); unset: the built-in task"""
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
    """processes per rank that run the reward, scoring each prompt's responses as soon as they are generated, while
    the rest still generate; unset: 2 with vLLM, 1 with hf (whose generate returns every response at once)"""
    chat_template: bool | None = None
    """wrap prompts in the tokenizer's chat template; unset: when the tokenizer has one"""
    system_prompt: str | None = None
    """a system message put before every prompt (without a chat template: a paragraph before it)"""
    prompt_template: str | None = None
    """a text holding {prompt}, which each prompt replaces before the chat template applies; e.g. for GSM8K:
    '{prompt}\nLet us think step by step and output the final answer after ####.'"""
    skip_reward_check: bool = False
    """do not stop when the reward scores fewer than 90% of the held-out rows' own gold answers as correct (for
    rewards whose gold answers are not completions)"""

    # rollout
    rollout_engine: Literal["auto", "vllm", "hf"] = "auto"
    """vllm on GPUs when installed, else hf (the trained model's own generate, slow but runs anywhere)"""
    rollout_tp: int = 1
    """vLLM tensor-parallel size; each group of this many ranks forms one generation replica"""
    rollout_gpu_memory: float | None = None
    """vLLM's memory. Unset: a KV cache that holds a step's sequences at once (a replica's prompts x --group-size, or
    its held-out prompts, of up to --max-prompt-len + --max-response-len tokens; at most 40% of the GPU), as mapping
    it back after each sleep takes about 1-5 ms per GB. Up to 1: vLLM's share of the GPU for weights and KV cache.
    Above 1: GiB of KV cache. Sized in GiB (unset or above 1), vLLM skips its start-up memory profiling, which fails
    when other processes on the GPU change their memory use meanwhile"""
    rollout_eager: bool = False
    """disable vLLM's CUDA graphs and compilation (faster start-up, slower generation)"""
    rollout_sleep_level: int | None = None
    """what colocated vLLM frees while the trainer runs: 0 its KV cache only (its weights stay on the GPU and the sync
    overwrites them in place: the fastest sync, for the memory of vLLM's weights); 1 its weights too, parked in CPU
    memory; 2 its weights too, dropped (the sync maps them back empty and fills them). Unset: 0 while vLLM's weights
    take at most 15% of the GPU, else 2 (benchmarks/README.md)"""
    sync_bucket_mb: int = 512
    """size of the buckets the trainer's weights are streamed to vLLM in"""
    check_weight_sync: bool = False
    """after each weight sync, compare vLLM's weights with the trainer's and fail on a mismatch (colocated)"""
    rollout_ranks: int = 0
    """split placement: the last K ranks only generate (K / --rollout-tp replicas) and the others only train; the
    trainers stream new weights to them after each update. 0: every rank trains and generates (colocated)"""
    async_rollout: bool = False
    """with --rollout-ranks: generate the next batch while the trainers train on this one (corrected by --tis-cap)"""
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
    warmup_steps: int = 0
    """linear learning-rate warmup over this many updates (none by default: faster learning, benchmarks/README.md)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_beta2: float = 0.99
    """AdamW's second-moment decay (0.999 is the usual default elsewhere)"""
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
    loss_agg: Literal["all-token-mean", "token-mean", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"] = "all-token-mean"
    """token losses to one number: their sum / all response tokens of the batch (TRL's 'dapo'); mean over the tokens
    of groups with signal; mean over sequences of their token mean; of their token sum / max-response-len (Dr. GRPO)"""
    num_mini_batches: int = 1
    """optimizer steps per rollout batch (the batch is split into this many mini-batches)"""
    epochs: int = 1
    """passes over each rollout batch"""
    max_tokens_per_micro_batch: int = 16384
    """token budget of one forward/backward pass: sequences are packed end to end (no padding) up to this many"""
    tis_cap: float | None = None
    """truncated importance sampling: weight each token by min(p_trainer / p_rollout, cap) against the rollout
    engine's numerical mismatch and its older weights with --async-rollout; unset: off, or 2 with --async-rollout"""
    logprob_diff_every: int = 10
    """measure rollout/logprob_diff (how far the rollout engine's log-probs of the sampled tokens are from the
    trainer's) on the first step and every this many after (0: never); vLLM's per-token bookkeeping of its log-probs
    costs about a quarter of a small model's rollout time. --tis-cap needs them: every step then"""
    activation_checkpointing: bool = False
    """recompute each decoder layer in backward to save memory"""
    compile: bool = False
    """torch.compile each decoder layer (dynamic shapes, for packed rows): fused kernels, most gain for small models"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """GPU arithmetic of training and of vLLM's rollouts: bf16 over fp32 master weights, or fp32 on both sides (their
    log-probs agree to 0.002 per token against 0.04: on SmolLM2-135M it learns far faster per step, at 1.5x the step
    time: benchmarks/README.md); auto: fp32 for models under 0.3B parameters, else bf16"""

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
    hang_timeout: float | None = 1800.0
    """seconds a rank may go without progress (one stage of a step, such as the rollout, the update or a save, or
    the gap between two) before the run counts as hung: every rank writes its Python stacks to <output-dir>/hangs/,
    one line names the stage, the step and the ranks elsewhere, and the run exits non-zero, for torchrun
    --max-restarts or Slurm to restart it; None: wait for ever"""
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
                   "group_size", "prompts_per_step", "max_prompt_len", "chat_template", "system_prompt",
                   "prompt_template")


def check_args(args: Args, world: int) -> None:
    """Flag values and combinations that cannot work, each with a one-line error (before any model is loaded).
    world: the ranks that train (all of them, or those left by --rollout-ranks)."""
    check_ranges(args, positive=["lr", "max_grad_norm", "hang_timeout"],
                 at_least_one=["steps", "epochs", "num_mini_batches", "eval_size", "max_tokens_per_micro_batch"],
                 non_negative=["warmup_steps", "weight_decay", "clip_low", "clip_high", "kl_coef", "eval_every",
                               "logprob_diff_every", "save_every", "save_state_every", "keep_checkpoints"])
    check_rollout_args(args, world)
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
    """Per-token GRPO loss, all tensors [batch, seq] (advantages [batch, 1]): returns the token losses, whether each
    token was clipped, and the k3 KL estimate to the reference."""
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
    if mode in ("token-mean", "all-token-mean"):  # num_tokens: of the groups with signal, or all of the batch
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / (num_seqs * max_response_len)
    raise ValueError(f"unknown --loss-agg {mode!r}")


def add_group_advantages(samples: list[dict], args: Args) -> None:
    """Each sample's advantage relative to its prompt's group (samples come prompt-major, group_size per prompt), and
    a loss weight: 0 for groups whose rewards are all equal (no signal)."""
    rewards = torch.tensor([s["reward"] for s in samples], dtype=torch.float32).view(-1, args.group_size)
    advantages = group_advantages(rewards, args.scale_rewards)
    informative = (rewards.std(dim=1) > 0).repeat_interleave(args.group_size)
    for s, a, keep in zip(samples, advantages.flatten().tolist(), informative.tolist()):
        s["advantage"], s["loss_weight"] = a, float(keep)


def one_step_per_batch(args: Args) -> bool:
    """One optimizer step per rollout batch: the old policy of the PPO ratio (the trainer's weights before the
    update) is the policy being updated, so the ratio is exactly 1 and the old log-probs need no pass of their own
    (as in TRL's GRPOTrainer). With --async-rollout the samples come from an older policy all the same; TIS weighs
    that, against these log-probs."""
    return args.epochs == 1 and args.num_mini_batches == 1


def update_policy(model, optimizer, samples: list[dict], args: Args, world: int, device, generator) -> dict[str, float]:
    """PPO-style epochs over mini-batches of the rollout batch; one optimizer step per mini-batch. Each mini-batch
    runs as packed token-budget micro-batches; the loss normalisers count the whole mini-batch on all ranks, so the
    gradient does not depend on how it is split. Samples are shuffled with `generator` each epoch (None keeps their
    order). Returns this rank's sums of the update's statistics."""
    batch_tokens = sum_over_ranks({"t": sum(len(s["response_ids"]) for s in samples)}, device)["t"]  # all groups
    samples = [s for s in samples if s["loss_weight"] > 0]  # no signal: exact zeros in every sum, so no passes
    sums = dict.fromkeys(["loss", "pg_clipfrac", "kl", "entropy", "tokens", "grad_norm", "opt_steps", "skipped"], 0.0)
    for _ in range(args.epochs):
        order = torch.randperm(len(samples), generator=generator) if generator is not None else torch.arange(len(samples))
        # tensor_split: exactly num_mini_batches parts on every rank, even where ranks hold different sample counts
        # (chunk would give some ranks fewer parts, and their collectives would pair up wrongly).
        for mini_indices in torch.tensor_split(order, args.num_mini_batches):
            mini = [samples[i] for i in mini_indices.tolist()]
            totals = sum_over_ranks({"tokens": sum(len(s["response_ids"]) * s["loss_weight"] for s in mini),
                                     "seqs": sum(s["loss_weight"] > 0 for s in mini)}, device)
            if totals["tokens"] == 0:  # every group in this mini-batch had equal rewards, on every rank
                continue
            norm = batch_tokens / args.num_mini_batches if args.loss_agg == "all-token-mean" else totals["tokens"]
            for mb in plan_equal_micro_batches(sample_lengths(mini), args.max_tokens_per_micro_batch, device):
                mbs = [mini[i] for i in mb]
                logprobs, entropy = packed_response_logprobs(model, mbs, args.temperature, with_entropy=True)
                if not mbs:  # this rank ran out of samples: a zero-weight pass keeps FSDP's collectives in step
                    (logprobs[0].sum() * 0.0).backward()
                    continue
                logprobs, entropy = pad_rows(logprobs), pad_rows(entropy)  # [n, longest response]
                if one_step_per_batch(args):  # ratio 1, the log-probs' gradient; kept for rollout/logprob_diff
                    old = logprobs.detach()
                    for s, lp in zip(mbs, old.cpu()):
                        s["old_logprobs"] = lp[:len(s["response_ids"])]
                else:
                    old = pad_rows([s["old_logprobs"] for s in mbs]).to(device)
                mask = pad_rows([[s["loss_weight"]] * len(s["response_ids"]) for s in mbs]).to(device)
                advantages = torch.tensor([[s["advantage"]] for s in mbs], device=device)  # [n, 1]
                ref = pad_rows([s["ref_logprobs"] for s in mbs]).to(device) if "ref_logprobs" in mbs[0] else None
                tis = None
                if args.tis_cap is not None:  # p_trainer / p_rollout on the sampled tokens, capped
                    tis = (old - pad_rows([s["logprobs"] for s in mbs]).to(device)).exp().clamp(max=args.tis_cap)
                token_loss, clipped, kl = policy_loss(logprobs, old, advantages, args.clip_low, args.clip_high,
                                                      ref, args.kl_coef, tis)
                loss = aggregate_loss(token_loss, mask, args.loss_agg, norm, totals["seqs"], args.max_response_len)
                (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already a global mean
                with torch.no_grad():
                    sums["loss"] += loss.item() * world
                    sums["pg_clipfrac"] += (clipped * mask).sum().item()
                    sums["kl"] += (kl * mask).sum().item()
                    sums["entropy"] += (entropy * mask).sum().item()
                    sums["tokens"] += mask.sum().item()
            grad_norm = clip_and_step(model, optimizer, args.max_grad_norm)  # None: NaN/inf, the step is skipped
            sums["skipped"] += grad_norm is None
            sums["grad_norm"] += grad_norm or 0.0
            sums["opt_steps"] += grad_norm is not None
    return sums


def step_metrics(samples: list[dict], generated: list[dict], stats: dict, args: Args, world: int, device) -> dict:
    """Collective: what is logged of a step, over all ranks. generated: the samples as they came from the rollout
    (before they were shared out for training); samples: this rank's training share, with its log-probs."""
    lengths, scored = sample_lengths(samples), [s for s in samples if s["loss_weight"] > 0]  # those trained on
    mismatch = mismatch_metrics(scored, args.tis_cap or 1.0)  # the engine's log-probs against the trainer's
    sums = sum_over_ranks({
        "reward": sum(s["reward"] for s in generated), "correct": sum(s["reward"] > 0 for s in generated),
        "count": len(generated), "response_tokens": sum(len(s["response_ids"]) for s in generated),
        "truncated": sum(not s["finished"] for s in generated),
        "informative": sum(s["loss_weight"] > 0 for s in generated), "total_tokens": sum(lengths),
        "trained_tokens": sum(sample_lengths(scored)),
        "lp_diff": mismatch["lp_diff"], "lp_tokens": mismatch["lp_tokens"],
        "scored": sum(len(s["response_ids"]) for s in scored),
        "tis_weight": mismatch["tis_weight_sum"], "tis_capped": mismatch["tis_capped"], **stats}, device)
    count, tokens, opt_steps = sums["count"], max(sums["scored"], 1), max(sums["opt_steps"] / world, 1)
    trained = max(sums["tokens"], 1)
    metrics = {
        "reward/mean": sums["reward"] / count, "reward/accuracy": sums["correct"] / count,
        "reward/informative_frac": sums["informative"] / count,
        "response/length_mean": sums["response_tokens"] / count, "response/truncated_frac": sums["truncated"] / count,
        **({"rollout/logprob_diff": sums["lp_diff"] / sums["lp_tokens"]} if sums["lp_tokens"] else {}),  # trained
        "loss/policy": sums["loss"] / world / opt_steps, "loss/kl": sums["kl"] / trained,
        "policy/clip_frac": sums["pg_clipfrac"] / trained, "policy/entropy": sums["entropy"] / trained,
        "policy/grad_norm": sums["grad_norm"] / world / opt_steps, "update/skipped": sums["skipped"] / world,
        "total_tokens": sums["total_tokens"], "trained_tokens": sums["trained_tokens"],
        **batching_metrics(plan_equal_micro_batches(lengths, args.max_tokens_per_micro_batch, device), lengths, device)}
    if args.tis_cap is not None and sums["scored"]:  # the truncated importance weights min(p_old / p_rollout, cap)
        metrics.update({"tis/weight_mean": sums["tis_weight"] / tokens, "tis/capped_frac": sums["tis_capped"] / tokens,
                        "tis/ratio_max": max_over_ranks(mismatch["tis_ratio_max"], device)})
    return metrics


def resolve_defaults(args: Args) -> None:
    """The flags left unset, from the task: the built-in one is tiny and starts from random weights."""
    builtin = args.dataset is None
    args.reward_fn = args.reward_fn or ("synthetic" if builtin else "gsm8k")
    args.max_response_len = (2 if builtin else 1024) if args.max_response_len is None else args.max_response_len
    args.lr = (5e-4 if args.model is None else 1e-6) if args.lr is None else args.lr
    fill_rollout_defaults(args)  # the engine, reward processes, TIS with async rollouts, --precision auto


def main():
    args = parse_args(Args)
    given = asdict(args)  # as on the command line: they name the run (common/rundir.py)
    placement, device = init_placement(args.rollout_ranks)  # colocated, or split into trainers and rollout ranks
    resolve_defaults(args)
    check_args(args, placement.num_trainers)
    rank, world = placement.rank, placement.world
    torch.manual_seed(args.seed)

    # The run's directory, locked for this run and resumed from its newest intact training state (--resume auto);
    # the prompts, with the answers the reward checks.
    run_dir = open_run_dir("grpo", given, asdict(args), FIXED_ON_RESUME)
    tokenizer = load_tokenizer(args.model)
    train_rows, eval_rows, data_notes = load_prompts(args, tokenizer)
    if not placement.trains:  # split placement's rollout ranks: generate and score for the trainers, to the end
        return serve_rollouts(args, placement, tokenizer, train_rows, eval_rows, device, run_dir.path,
                              run_dir.start_step)

    # Model, reference model, optimizer.
    policy = shard_model(load_model(args.model, tokenizer, args.seed), device, args.activation_checkpointing,
                         compile_layers=args.compile, precision=args.precision)
    reference = None
    if args.kl_coef > 0:
        reference = shard_model(load_model(args.model, tokenizer, args.seed), device, trainable=False,
                                compile_layers=args.compile, precision=args.precision)
        use_packed_attention(reference, device)
    num_params = sum(p.numel() for p in policy.parameters())
    optimizer, scheduler = make_optimizer(policy, args.lr, args.weight_decay, args.warmup_steps, args.adam_beta2)
    logger, timer = start_logging(args, run_dir, rank, device, data_notes, num_params)
    rollouts = Rollouts(args, placement, policy, tokenizer, train_rows, eval_rows, device, run_dir.path,
                        run_dir.start_step, logger, timer)
    bad_steps, perf = BadStepCounter(args.max_bad_steps), StepPerf(num_params, device, world)
    checkpoints = Checkpoints(args, run_dir, logger, timer, tokenizer, rollouts, bad_steps,
                              {"policy": (policy, optimizer, scheduler, args.lr)}, {"": policy},
                              probes=[train_rows[0]["prompt"]])
    checkpoints.resume()
    if initial_eval := rollouts.start():  # a fresh run evaluates its initial weights (colocated)
        logger.log(0, {**initial_eval, **timer.pop()}, advance=False)
    timer.pop()

    stop = False
    for step in range(run_dir.start_step + 1, args.steps + 1):
        step_start = timer.start_step(step)
        # Seeded per step (and rank), so a resumed run shuffles its mini-batches as an uninterrupted one would.
        generator = torch.Generator().manual_seed((args.seed * 7919 + rank) * 1_000_003 + step)

        # 1. Rollout: group_size responses per prompt, each scored by the reward as soon as its group is complete.
        generated, metrics = rollouts.next_batch(step)
        # 2-3. Rewards -> advantages relative to each prompt's group.
        add_group_advantages(generated, args)
        # Every rank takes about the same token work: samples move between ranks (the loss is a global mean anyway).
        samples, _ = share_samples_evenly(generated, sample_lengths(generated), world, rank)

        # 4. Log-probs of the sampled tokens under the current (old) policy and the reference (groups with signal).
        # With one optimizer step per batch the old policy is the one being updated: its log-probs come from the
        # update's own forward pass (detached), not from a pass of their own.
        perf.start()
        with timer("logprobs"):
            budget, kept = args.max_tokens_per_micro_batch, [s for s in samples if s["loss_weight"] > 0]
            if not one_step_per_batch(args):
                for s, lp in zip(kept, compute_logprobs(policy, kept, budget, args.temperature, device)):
                    s["old_logprobs"] = lp
            if reference is not None:
                for s, lp in zip(kept, compute_logprobs(reference, kept, budget, args.temperature, device)):
                    s["ref_logprobs"] = lp

        # 5. Policy update.
        with timer("update"):
            stats = update_policy(policy, optimizer, samples, args, world, device, generator)
            if stats["opt_steps"]:  # the schedule counts updates (a batch of equal-reward groups makes none)
                scheduler.step()

        # 6. Weight sync to the rollout engines (not after a stop signal on any rank: every rank saves and stops).
        stop = stop_agreed(device)
        metrics.update(rollouts.publish(step, stop))

        # 7. Log.
        metrics.update(step_metrics(samples, generated, stats, args, world, device))
        bad_steps.record(metrics["update/skipped"] > 0, step)  # raises on every rank after --max-bad-steps in a row
        total_tokens, step_seconds = metrics.pop("total_tokens"), time.perf_counter() - step_start
        trained = metrics.pop("trained_tokens") * args.epochs  # the update passes only samples with signal
        metrics.update({"policy/lr": scheduler.get_last_lr()[0], "time/step": step_seconds,
                        "perf/tokens_per_s": total_tokens / step_seconds,
                        "perf/train_tokens_per_s": trained / timer.seconds["time/update"],
                        **perf.metrics(trained, timer.seconds["time/update"], rollouts.rollout_memory),
                        **rollouts.evaluate(step)})  # held-out greedy accuracy, when due
        checkpoints.export(step)
        logger.log(step, {**metrics, **timer.pop()})

        # 8. Checkpoint: a resumable training state.
        checkpoints.save(step, stop)
        if stop:
            break

    checkpoints.say_if_nothing_to_do()
    if not stop and run_dir.start_step <= args.steps:  # past --steps already: said above, and its export is elsewhere
        logger.print(f"held-out greedy accuracy: {rollouts.first_eval['eval/accuracy']:.3f} before training -> "
                     f"{rollouts.last_eval['eval/accuracy']:.3f} after {args.steps} steps; model saved to "
                     f"{os.path.join(run_dir.path, f'hf_step_{args.steps}')}")
    logger.close()
    rollouts.close()
    finish_distributed(exit_process=placement.split)

if __name__ == "__main__":
    run_main(main)
