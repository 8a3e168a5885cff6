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
common/rollout/'s business; this file is the algorithm. A mixture-of-experts policy trains the same way
(common/train/moe.py: expert-load metrics, --router-aux-loss-coef, --routing-replay). Left out on purpose: DAPO's
dynamic sampling (refilling the batch with informative groups), overlong reward shaping.

    torchrun --nproc_per_node 2 grpo.py                  # built-in tiny model and task, CPU, about a minute
    torchrun --nproc_per_node 8 grpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k \\
        --dataset-config main --prompt-key question --reward-fn gsm8k
"""

import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from common.data.prompts import PromptDataArgs, default_prompt_eval_size, load_prompts
from common.rollout.args import RolloutArgs, check_rollout_args, default_response_len, fill_rollout_defaults
from common.rollout.reward_check import check_reward_fits
from common.rollout.rollouts import make_rollouts
from common.rollout.serve import serve_rollouts
from common.rollout.split import init_placement
from common.run.checkpoints import Checkpoints, TrainedModel
from common.run.cli import check_ranges, chosen_values, run_main
from common.run.distributed import all_reduce_sum, finish_distributed, quiet_libraries, sum_over_ranks
from common.run.logger import start_logging
from common.run.packages import check_packages
from common.run.run_plan import plan_run
from common.run.rundir import RunArgs, fixed_on_resume, open_run_dir
from common.run.signals import install_stop_handlers, stop_agreed
from common.train.batching import (batching_metrics, empty_backward, mini_batches, pad_rows,
                                   plan_equal_micro_batches, share_samples_evenly, shuffle_generator)
from common.train.logprobs import (compute_logprobs, model_token_mask, model_tokens, packed_response_logprobs,
                                   sample_lengths)
from common.train.loading import load_policy, load_reference
from common.train.lora import LoraArgs, adapters_off, check_lora_args, default_lr
from common.train.model import load_tokenizer, model_config
from common.train.moe import MoeArgs, RoutingReplayArgs, check_routing_replay, router_aux_loss, router_metrics
from common.train.off_policy import (CorrectionArgs, importance_weights, reject_mismatched_sequences,
                                     rollout_mismatch_metrics)
from common.train.optim import clip_and_step, make_optimizer


# A sample is one response (or one multi-turn episode) as a dict; the stage that adds each key:
#   rollout (rollouts.next_batch): prompt_ids, response_ids, logprobs (the engine's, None on steps that do not ask
#     for them), finished (ended at a stop token), reward, version (of the weights that generated it); with --env /
#     --tools also response_mask (0 on observation tokens), turns, tool_calls, tool_errors, env_seconds,
#     env_timeout; a mixture of experts with --routing-replay: routes; with --partial-rollouts: versions (the
#     weight version of each run of tokens: [[version, tokens], ...]; "version" is the first token's)
#   advantages (add_group_advantages): advantage, loss_weight (0 for a group whose rewards are all equal)
#   log-probs (step 4): old_logprobs (with one optimizer step per batch: in update_policy, from the update's own
#     forward pass), ref_logprobs (--kl-coef above 0); rejected (--off-policy-correction mis: loss_weight set to 0)


@dataclass
class Args(RunArgs, RolloutArgs, CorrectionArgs, LoraArgs, PromptDataArgs, MoeArgs, RoutingReplayArgs):
    # model (the data flags are PromptDataArgs's, common/data/prompts.py)
    model: str | None = None
    """HF hub id or local directory of a causal LM; unset: the built-in tiny model (random init)"""

    # rollout
    prompts_per_step: int = 16
    """prompts per step over all ranks"""
    group_size: int = 16
    """responses sampled per prompt"""
    max_prompt_len: int = 256
    """prompts longer than this many tokens are dropped (and counted)"""

    # optimisation
    steps: int = 200
    """number of GRPO steps (rollout + update)"""
    lr: float | None = None
    """AdamW learning rate; unset: 5e-4 for the built-in tiny model (random init), else 1e-6; 10x that with LoRA"""
    warmup_steps: int = 0
    """linear learning-rate warmup over this many updates (none by default: faster learning, benchmarks/README.md)"""
    clip_low: float = 0.2
    """PPO ratio clip below: ratio >= 1 - clip_low"""
    clip_high: float = 0.28
    """PPO ratio clip above: ratio <= 1 + clip_high (DAPO's clip-higher)"""
    kl_coef: float = 0.0
    """weight of the k3 KL penalty to the frozen initial policy (with LoRA: the base, adapters off); 0 loads no
    reference model"""
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
    # evaluation, checkpoints, logging
    eval_every: int = 25
    """greedy evaluation on the held-out prompts every this many steps (and before and after training)"""


# Flags a resumed run cannot change: its saved state (weights, optimizer, data position) would mean nothing.
FIXED_ON_RESUME = fixed_on_resume(Args, "model", "group_size", "prompts_per_step", "max_prompt_len")


def check_args(args: Args, world: int) -> None:
    """Flag values and combinations that cannot work, each with a one-line error (before any model is loaded).
    world: the ranks that train (all of them, or those left by --rollout-ranks)."""
    check_ranges(args, positive=["lr", "max_grad_norm", "hang_timeout"],
                 at_least_one=["steps", "epochs", "num_mini_batches", "eval_size", "max_tokens_per_micro_batch"],
                 non_negative=["warmup_steps", "weight_decay", "clip_low", "clip_high", "kl_coef", "eval_every",
                               "logprob_diff_every", "save_every", "save_state_every", "keep_checkpoints"])
    check_rollout_args(args, world)
    check_lora_args(args)
    check_routing_replay(args, model_config(args.model))
    if args.group_size < 2:
        raise ValueError("--group-size must be at least 2: advantages are relative to the group")
    if args.prompts_per_step * args.group_size // world < args.num_mini_batches:
        raise ValueError(f"--num-mini-batches {args.num_mini_batches} is more than the samples per rank")
    if args.max_prompt_len + args.max_response_len > args.max_tokens_per_micro_batch:
        longest = args.max_prompt_len + args.max_response_len
        raise ValueError(f"--max-tokens-per-micro-batch {args.max_tokens_per_micro_batch} must hold one whole "
                         f"sequence: --max-prompt-len + --max-response-len = {longest}")
    check_packages(args)  # a flag whose package is missing: one line with the pip command (the checks above need none)


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
    that, against these log-probs. mis rejects responses before the update: their log-probs need a pass first."""
    return args.epochs == 1 and args.num_mini_batches == 1 and not (args.tis_cap and args.off_policy_correction == "mis")


def update_policy(model, optimizer, samples: list[dict], args: Args, world: int, device, generator) -> dict[str, float]:
    """PPO-style epochs over mini-batches of the rollout batch; one optimizer step per mini-batch. Each mini-batch
    runs as packed token-budget micro-batches; the loss normalisers count the whole mini-batch on all ranks, so the
    gradient does not depend on how it is split. Samples are shuffled with `generator` each epoch (None keeps their
    order). Returns this rank's sums of the update's statistics."""
    (batch_tokens,) = all_reduce_sum([model_tokens([s for s in samples if "rejected" not in s])], device)  # all groups
    samples = [s for s in samples if s["loss_weight"] > 0]  # no signal: exact zeros in every sum, so no passes
    sums = dict.fromkeys(["loss", "pg_clipfrac", "kl", "entropy", "tokens", "grad_norm", "opt_steps", "skipped"], 0.0)
    for mini in mini_batches(samples, args.epochs, args.num_mini_batches, generator):  # the same count on every rank
        totals = sum_over_ranks({"tokens": sum(sum(model_token_mask(s)) * s["loss_weight"] for s in mini),
                                 "seqs": sum(s["loss_weight"] > 0 for s in mini),
                                 "positions": sum(sample_lengths(mini))}, device)  # MoE: the routers' tokens
        if totals["tokens"] == 0:  # every group in this mini-batch had equal rewards, on every rank
            continue
        norm = batch_tokens / args.num_mini_batches if args.loss_agg == "all-token-mean" else totals["tokens"]
        for indices in plan_equal_micro_batches(sample_lengths(mini), args.max_tokens_per_micro_batch, device):
            micro = [mini[i] for i in indices]
            logprobs, entropy = packed_response_logprobs(model, micro, args.temperature, with_entropy=True)
            if not micro:  # this rank ran out of samples (FSDP needs its backward all the same)
                empty_backward(logprobs[0])
                continue
            logprobs, entropy = pad_rows(logprobs), pad_rows(entropy)  # [n, longest response]
            if one_step_per_batch(args):  # ratio 1, the log-probs' gradient; kept for rollout/logprob_diff
                old = logprobs.detach()
                for s, lp in zip(micro, old.cpu()):
                    s["old_logprobs"] = lp[:len(s["response_ids"])]
            else:
                old = pad_rows([s["old_logprobs"] for s in micro]).to(device)
            # 1 on the model's own tokens of samples with signal (0 on padding and on observations of episodes)
            mask = pad_rows([[s["loss_weight"] * m for m in model_token_mask(s)] for s in micro]).to(device)
            advantages = torch.tensor([[s["advantage"]] for s in micro], device=device)  # [n, 1]
            ref = pad_rows([s["ref_logprobs"] for s in micro]).to(device) if "ref_logprobs" in micro[0] else None
            tis = None
            if args.tis_cap is not None:  # from p_trainer / p_rollout on the sampled tokens (--off-policy-correction)
                tis = importance_weights(old, pad_rows([s["logprobs"] for s in micro]).to(device),
                                         args.off_policy_correction, args.tis_cap)
            token_loss, clipped, kl = policy_loss(logprobs, old, advantages, args.clip_low, args.clip_high,
                                                  ref, args.kl_coef, tis)
            loss = aggregate_loss(token_loss, mask, args.loss_agg, norm, totals["seqs"], args.max_response_len)
            aux = router_aux_loss(model, sum(sample_lengths(micro)) / totals["positions"])  # MoE, if on: load balance
            ((loss + aux) * world).backward()  # FSDP averages gradients over ranks; the loss is already a global mean
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
    # Those trained on, and those --off-policy-correction mis rejected: both have the trainer's log-probs.
    lengths, scored = sample_lengths(samples), [s for s in samples if s["loss_weight"] > 0 or "rejected" in s]
    # Counts of samples as generated, each once (a sequence-parallel group's ranks share the same training samples).
    with_signal = [s for s in generated if s["loss_weight"] > 0]
    sums = sum_over_ranks({
        "reward": sum(s["reward"] for s in generated), "correct": sum(s["reward"] > 0 for s in generated),
        "count": len(generated), "response_tokens": sum(len(s["response_ids"]) for s in generated),
        "truncated": sum(not s["finished"] for s in generated), "informative": len(with_signal),
        "total_tokens": sum(sample_lengths(generated)), "trained_tokens": sum(sample_lengths(with_signal)),
        **stats}, device)
    count, opt_steps = sums["count"], max(sums["opt_steps"] / world, 1)
    trained = max(sums["tokens"], 1)
    metrics = {
        "reward/mean": sums["reward"] / count, "reward/accuracy": sums["correct"] / count,
        "reward/informative_frac": sums["informative"] / count,
        "response/length_mean": sums["response_tokens"] / count, "response/truncated_frac": sums["truncated"] / count,
        "loss/policy": sums["loss"] / world / opt_steps, "loss/kl": sums["kl"] / trained,
        "policy/clip_frac": sums["pg_clipfrac"] / trained, "policy/entropy": sums["entropy"] / trained,
        "policy/grad_norm": sums["grad_norm"] / world / opt_steps, "update/skipped": sums["skipped"] / world,
        "total_tokens": sums["total_tokens"], "trained_tokens": sums["trained_tokens"],
        **batching_metrics(plan_equal_micro_batches(lengths, args.max_tokens_per_micro_batch, device), lengths, device),
        **rollout_mismatch_metrics(scored, args.tis_cap, device)}  # the engine's log-probs against the trainer's
    return metrics


def resolve_defaults(args: Args, world: int = 1, device: torch.device = torch.device("cpu")) -> list[str]:
    """Every value chosen for the user, in one place: the flags left unset, from the task (the built-in one is tiny
    and starts from random weights); then, once the flags are checked, the held-out size (which may count the
    data's rows) and activation checkpointing where the planner forecasts that the step would not fit without it
    (GPUs only). Returns the lines printed at start-up: the values chosen, and the forecast."""
    unset = asdict(args)
    builtin = args.dataset is None
    args.reward_fn = args.reward_fn or ("synthetic" if builtin else "gsm8k")
    args.max_response_len = default_response_len(args) if args.max_response_len is None else args.max_response_len
    args.lr = default_lr(5e-4 if args.model is None else 1e-6, args) if args.lr is None else args.lr
    fill_rollout_defaults(args)  # the engine, reward processes, TIS with async rollouts, --precision auto
    check_args(args, world)  # one line for a flag that cannot work, before the planner reads the model
    args.eval_size = default_prompt_eval_size(args) if args.eval_size is None else args.eval_size  # may count rows
    forecast = plan_run(args, world, device, model_config(args.model))  # may turn --activation-checkpointing on
    return [chosen_values(unset, asdict(args)), *forecast]


def main(args: Args):
    given = asdict(args)  # as on the command line: they name the run (common/run/rundir.py)
    # Colocated or split into trainers and rollout ranks; the trainers' sequence-parallel groups and model sharding.
    placement, device = init_placement(args.rollout_ranks, args.sequence_parallel, args.shard_size)
    install_stop_handlers()  # SIGTERM, SIGUSR1 and Ctrl-C finish the step, save and stop (common/run/signals.py)
    quiet_libraries()  # libraries log warnings only
    chosen = resolve_defaults(args, placement.num_trainers, device)  # every value chosen for you, printed at start
    rank, world = placement.rank, placement.world
    torch.manual_seed(args.seed)

    # The run's directory, locked for this run and resumed from its newest intact training state (--resume auto);
    # the prompts, with the answers the reward checks.
    run_dir = open_run_dir("grpo", given, asdict(args), FIXED_ON_RESUME)
    tokenizer = load_tokenizer(args.model)
    train_rows, eval_rows, data_notes = load_prompts(args, tokenizer)
    check_reward_fits(args, eval_rows)  # the reward must score the data's own gold answers as correct
    if not placement.trains:  # split placement's rollout ranks: generate and score for the trainers, to the end
        return serve_rollouts(args, placement, tokenizer, train_rows, eval_rows, device, run_dir.path,
                              run_dir.start_step)

    # Model (with --lora-rank: adapters on a frozen base), reference model, optimizer.
    policy = load_policy(args, tokenizer, device)
    # The KL penalty's reference: the frozen initial policy; with LoRA, the policy's own base (adapters off).
    reference = load_reference(args, tokenizer, device) if args.kl_coef > 0 and not args.lora_rank else None
    optimizer, scheduler = make_optimizer(policy, args.lr, args.weight_decay, args.warmup_steps, args.adam_beta2)
    logger, timer, perf = start_logging(args, run_dir, rank, world, device, chosen + data_notes, [policy])
    rollouts = make_rollouts(args, placement, policy, tokenizer, train_rows, eval_rows, device, run_dir.path,
                             run_dir.start_step, logger, timer)
    checkpoints = Checkpoints(args, run_dir, logger, timer, tokenizer, rollouts,
                              TrainedModel(policy, optimizer, scheduler, args.lr), probes=[train_rows[0]["prompt"]])
    checkpoints.resume()
    if initial_eval := rollouts.start():  # a fresh run evaluates its initial weights (colocated)
        logger.log(0, {**initial_eval, **timer.pop()}, advance=False)
    timer.pop()

    stop = False
    for step in range(run_dir.start_step + 1, args.steps + 1):
        step_start = timer.start_step(step)
        generator = shuffle_generator(args.seed, rank, world, step)  # of the mini-batches: as a resumed run would

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
            budget, with_signal = args.max_tokens_per_micro_batch, [s for s in samples if s["loss_weight"] > 0]
            if not one_step_per_batch(args):
                for s, lp in zip(with_signal, compute_logprobs(policy, with_signal, budget, args.temperature,
                                                               device)):
                    s["old_logprobs"] = lp
                if args.tis_cap and args.off_policy_correction == "mis":  # responses too far off: no part in the loss
                    metrics["tis/rejected"] = all_reduce_sum([reject_mismatched_sequences(samples, args.tis_cap)],
                                                             device)[0]
            if args.kl_coef > 0:
                with adapters_off(policy):  # with LoRA: the base model, the reference
                    for s, lp in zip(with_signal, compute_logprobs(reference or policy, with_signal, budget,
                                                                   args.temperature, device)):
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
        metrics.update(router_metrics(policy, device))  # MoE: expert load and router entropy of the update's passes
        checkpoints.bad_steps.record(metrics["update/skipped"] > 0, step)  # raises after --max-bad-steps in a row
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

    checkpoints.say_how_it_went(rollouts.first_eval, rollouts.last_eval, stop, {"eval/accuracy": "greedy"})
    logger.close()
    rollouts.close()
    finish_distributed(exit_process=placement.split)


if __name__ == "__main__":
    run_main(main, Args)
