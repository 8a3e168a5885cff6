"""PPO with a learned critic (Schulman et al. 2017, https://arxiv.org/abs/1707.06347), for RLHF as in
Ouyang et al. 2022 (https://arxiv.org/abs/2203.02155) and as verl / OpenRLHF run it.

Each response token is an action. Its reward is minus a KL penalty to a frozen reference model, and the last
response token also gets the sequence's score. A critic (a value head on a copy of the model) predicts V for
the state before each response token; GAE turns rewards and values into per-token advantages, whitened over the
whole batch of every rank, and returns (the critic's targets). The policy takes PPO's clipped surrogate, the
critic a clipped squared error, both normalised by the token count of the whole mini-batch on all ranks.

Each step: rollout -> reward (rule and/or reward model) -> values and log-probs -> advantages (GAE, whitened) ->
update critic and policy -> weight sync -> log -> checkpoint. Before the policy first moves, the critic warms up on
the first batch until it explains enough of the returns' variance (--critic-warmup-ev): a fresh critic's values are
noise, and advantages made from them would push the policy at random. The math functions take right-padded
[batch, seq] tensors over response tokens with a float mask (1 for a real token, 0 for padding). Samples come from
common/rollout/rollouts.py (colocated vLLM or split placement, async). With --lora-rank both policy and critic train
adapters on frozen bases (common/train/lora.py), the critic's value head in full, and the KL's reference is the policy's
own base with its adapters off. The critic keeps a base of its own, frozen in bf16 (2 bytes a parameter, parked in CPU
memory with --offload): sharing the policy's would save that copy but make one module of two models (two adapters
switched per pass, one FSDP unit, one state), and a --critic-model could no longer differ from the policy. Left out
on purpose: adaptive KL control, a reward model's own chat template (its tokenizer re-tokenizes the text as is), a
critic sharing the policy's body.

    torchrun --nproc_per_node 2 ppo.py                  # built-in tiny model and task, CPU, about a minute
    torchrun --nproc_per_node 8 ppo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k \\
        --dataset-config main --prompt-key question --reward-fn gsm8k
"""

from dataclasses import asdict, dataclass

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
from common.train.loading import load_critic_model, load_frozen_reward_model, load_policy, load_reference
from common.train.lora import LoraArgs, adapters_off, check_lora_args, default_lr
from common.train.model import load_tokenizer, model_config
from common.train.moe import MoeArgs, RoutingReplayArgs, check_routing_replay, router_aux_loss, router_metrics
from common.train.off_policy import (CorrectionArgs, importance_weights, reject_mismatched_sequences,
                                     rollout_mismatch_metrics)
from common.train.offload import Offloader
from common.train.optim import clip_and_step, make_optimizer
from common.train.stats import explained_variance, masked_whiten
from common.train.value_models import compute_values, packed_values, reward_model_scores


# A sample is one response (or one multi-turn episode) as a dict; the stage that adds each key:
#   rollout (rollouts.next_batch): prompt_ids, response_ids, logprobs (the engine's, None on steps that do not ask
#     for them), finished (ended at a stop token), reward, version (of the weights that generated it); with --env /
#     --tools also response_mask (0 on observation tokens), turns, tool_calls, tool_errors, env_seconds,
#     env_timeout; a mixture of experts with --routing-replay: routes
#   reward (add_scores): model_score (the reward model's, 0 without one), score (what the last token earns)
#   values and log-probs (step 3): old_values, old_logprobs, ref_logprobs (--kl-coef above 0)
#   advantages (add_advantages): mask (1 on the model's own tokens), raw_advantages, advantages (whitened), returns


@dataclass
class Args(RunArgs, RolloutArgs, CorrectionArgs, LoraArgs, PromptDataArgs, MoeArgs, RoutingReplayArgs):
    # model (the data flags are PromptDataArgs's, common/data/prompts.py)
    model: str | None = None
    """HF hub id or local directory of a causal LM; unset: the built-in tiny model (random init)"""
    reward_model: str | None = None
    """an AutoModelForSequenceClassification checkpoint (one label) that scores each whole response, frozen"""
    missing_eos_penalty: float = 0.0
    """subtracted from the score of a response cut at --max-response-len (it never reached a stop token)"""

    # rollout
    prompts_per_step: int = 64
    """prompts per step over all ranks"""
    group_size: int = 4
    """responses sampled per prompt (each is its own episode: PPO's advantages come from the critic)"""
    max_prompt_len: int = 256
    """prompts longer than this many tokens are dropped (and counted)"""

    # optimisation
    steps: int = 120
    """number of PPO steps (rollout + update)"""
    lr: float | None = None
    """the policy's AdamW learning rate; unset: 5e-4 for the built-in tiny model (random init), else 1e-6"""
    critic_lr: float | None = None
    """the critic's AdamW learning rate; unset: 1e-3 for the built-in tiny model, else 1e-5"""
    warmup_steps: int = 5
    """linear learning-rate warmup over this many updates (policy and critic)"""
    critic_model: str | None = None
    """checkpoint the critic starts from: a causal LM, or a sequence-classification reward model whose score head
    becomes the value head; unset: the policy's own initial weights"""
    gamma: float = 1.0
    """discount of later rewards"""
    lam: float = 0.95
    """GAE's lambda: 1 uses the whole observed return (high variance), 0 only the critic's next value (high bias)"""
    kl_coef: float = 0.001
    """weight of the KL to the frozen initial policy: per token in the reward (k1), or in the loss (k3) with
    --kl-in-loss; 0 loads no reference model"""
    kl_in_loss: bool = False
    """put the KL penalty in the policy loss (k3, as GRPO does) instead of the reward"""
    clip_low: float = 0.2
    """PPO ratio clip below: ratio >= 1 - clip_low"""
    clip_high: float = 0.2
    """PPO ratio clip above: ratio <= 1 + clip_high"""
    value_clip: float | None = 0.5
    """clipped value loss: the critic's values move at most this far from their rollout-time values; None: unclipped"""
    entropy_coef: float = 0.0
    """weight of an entropy bonus in the policy loss"""
    critic_warmup_ev: float = 0.5
    """before the policy first moves, the critic trains on the first batch until its explained variance on it
    reaches this (or --critic-warmup-steps runs out): a fresh critic's values are noise"""
    critic_warmup_steps: int = 20
    """most critic updates of that warmup; 0: no warmup"""
    num_mini_batches: int = 1
    """optimizer steps per rollout batch (the batch is split into this many mini-batches)"""
    epochs: int = 1
    """passes over each rollout batch"""
    offload: bool = False
    """keep on the GPU only what each phase uses: the critic, the reference and the reward model wait in CPU memory
    until their pass, and each optimizer's moments until its update (one copy in and out per phase; the policy's
    weights stay for rollouts and syncs). What lets the 1.5B shape train on an 80 GB GPU: benchmarks/README.md"""

    # evaluation, checkpoints, logging
    eval_every: int = 25
    """greedy evaluation on the held-out prompts every this many steps (and before and after training)"""


# Flags a resumed run cannot change: its saved state (weights, optimizer, data position) would mean nothing.
FIXED_ON_RESUME = fixed_on_resume(Args, "model", "critic_model", "reward_model", "group_size", "prompts_per_step",
                                  "max_prompt_len")


def check_args(args: Args, world: int) -> None:
    """Flag values and combinations that cannot work, each with a one-line error (before any model is loaded).
    world: the ranks that train (all of them, or those left by --rollout-ranks)."""
    check_ranges(args, positive=["lr", "critic_lr", "max_grad_norm", "value_clip", "hang_timeout"],
                 at_least_one=["steps", "epochs", "num_mini_batches", "eval_size", "max_tokens_per_micro_batch"],
                 non_negative=["warmup_steps", "weight_decay", "clip_low", "clip_high", "kl_coef", "entropy_coef",
                               "missing_eos_penalty", "critic_warmup_steps", "eval_every", "logprob_diff_every",
                               "save_every", "save_state_every", "keep_checkpoints"])
    check_rollout_args(args, world)
    check_lora_args(args)
    check_routing_replay(args, model_config(args.model))
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name) <= 1:
            raise ValueError(f"--{name} must be between 0 and 1, got {getattr(args, name)}")
    if args.reward_fn == "none" and args.reward_model is None:
        raise ValueError("--reward-fn none needs --reward-model: the responses would all score 0")
    if args.prompts_per_step * args.group_size // world < args.num_mini_batches:
        raise ValueError(f"--num-mini-batches {args.num_mini_batches} is more than the samples per rank")
    if args.max_prompt_len + args.max_response_len > args.max_tokens_per_micro_batch:
        longest = args.max_prompt_len + args.max_response_len
        raise ValueError(f"--max-tokens-per-micro-batch {args.max_tokens_per_micro_batch} must hold one whole "
                         f"sequence: --max-prompt-len + --max-response-len = {longest}")
    check_packages(args)  # a flag whose package is missing: one line with the pip command (the checks above need none)


@torch.no_grad()
def padded(samples: list[dict], key: str, device: torch.device) -> torch.Tensor:
    """The per-token values under `key` of each sample (e.g. its response log-probs) as [n, longest] on `device`,
    right-padded with 0."""
    return pad_rows([s[key] for s in samples]).to(device)


# Means over the real tokens of every rank, on right-padded [batch, seq] tensors with a float mask (1 for a real token,
# 0 for padding): the same numbers whatever the split of the batch over ranks and micro-batches (and common/train/
# stats.py's whitening and explained variance).

def token_mean_share(token_loss: torch.Tensor, mask: torch.Tensor, num_tokens: float) -> torch.Tensor:
    """This micro-batch's share of the mini-batch's token mean: sum(token_loss * mask) / num_tokens, where num_tokens
    counts the real tokens of the whole mini-batch over all ranks, so the shares of all micro-batches of all ranks add
    up to the mini-batch mean whatever the split (FSDP averages gradients over ranks: backward on share * world). A
    mean per micro-batch instead weighs the tokens of a short micro-batch more and changes the effective learning rate
    with the split: verl's critic loss once did. token_loss, mask: [batch, seq]."""
    return (token_loss * mask).sum() / num_tokens


def token_rewards(scores, mask, logprobs, ref_logprobs, kl_coef: float):
    """Per-token rewards: -kl_coef * KL on every response token, plus the score on each row's last real token, where
    the episode ends (at EOS or at the length limit; in a multi-turn episode, the model's last token).
    scores: [batch]; mask, logprobs, ref_logprobs: [batch, seq]. The KL is k1, logprobs - ref_logprobs, as in
    Ouyang et al.: summed over a sampled response it is an unbiased estimate of the sequence's KL, which the return
    carries back to every earlier token. ref_logprobs None: no KL term (kl is zeros).
    Returns (rewards, kl), both [batch, seq], 0 on padding."""
    kl = torch.zeros_like(mask) if ref_logprobs is None else torch.where(mask > 0, logprobs - ref_logprobs, 0.0)
    rewards = -kl_coef * kl
    positions = torch.arange(mask.shape[1], device=mask.device)
    last = torch.where(mask > 0, positions, -1).max(dim=-1).values  # the last real (model's own) token of each row
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards, kl


@torch.no_grad()
def gae(rewards, values, mask, gamma: float, lam: float):
    """Generalised advantage estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438), per row.
    rewards, values, mask: [batch, seq]; values[:, t] is V of the state before response token t. Backwards from
    the end: delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, where V and A after
    the last real token are 0. A padded position leaves the running V_{t+1} and A_{t+1} as they were, so nothing of
    it reaches a real token. The observation tokens of a multi-turn episode (mask 0, common/rollout/episodes.py) are
    not actions and are skipped the same way: the model's last token before an observation bootstraps from V at its
    first token after it, the state that includes the observation, with one step of discount.
    Returns (advantages, returns = advantages + values), both [batch, seq], 0 on padding."""
    real = mask > 0  # torch.where, not multiplying by the mask: a NaN in a padded value stays out too
    advantages = torch.zeros_like(rewards)
    next_value = next_advantage = torch.zeros_like(rewards[:, 0])  # [batch]
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(real[:, t], advantage, 0.0)
        next_value = torch.where(real[:, t], values[:, t], next_value)
        next_advantage = torch.where(real[:, t], advantage, next_advantage)
    return advantages, torch.where(real, advantages + values, 0.0)


def policy_loss(logprobs, old_logprobs, advantages, clip_low: float, clip_high: float):
    """PPO's clipped surrogate per token: max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high)), r = pi / pi_old.
    All [batch, seq]. Returns (token_loss, clipped), clipped where the clipped branch is the larger: those tokens
    pass no gradient. Separate low / high bounds as in DAPO (https://arxiv.org/abs/2503.14476); equal is PPO's."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped  # pessimistic: no gain past the clip


def value_loss(values, old_values, returns, value_clip: float | None):
    """The critic's clipped squared error per token: 0.5 * max((v - R)^2, (old_v + clip(v - old_v, +-c) - R)^2).
    All [batch, seq]; old_values: the critic's at rollout time. As with the policy's clip, the max takes the larger
    error, so the critic gains nothing from moving more than value_clip away from its rollout values. Returns
    (token_loss, clipped), clipped where the clipped branch is the larger (no gradient). value_clip None: unclipped."""
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped = (old_values + torch.clamp(values - old_values, -value_clip, value_clip) - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def add_scores(samples: list[dict], args: Args, reward_model, rm_tokenizer, tokenizer, device) -> None:
    """Collective (the reward model): each sample's score, for its last token; a response cut short pays the penalty."""
    model_scores = [0.0] * len(samples) if reward_model is None else reward_model_scores(
        reward_model, rm_tokenizer, tokenizer, samples, args.max_tokens_per_micro_batch, device)
    for s, model_score in zip(samples, model_scores):
        s["model_score"] = model_score
        s["score"] = s["reward"] + model_score - args.missing_eos_penalty * (not s["finished"])


def add_old_values_and_logprobs(samples: list[dict], policy, critic, reference, offload, args: Args, device) -> None:
    """The critic's values, the policy's log-probs and (--kl-coef) the reference's, as the samples were generated."""
    budget = args.max_tokens_per_micro_batch
    with offload.on_gpu(critic):
        for s, values in zip(samples, compute_values(critic, samples, budget, device)):
            s["old_values"] = values
    for s, lp in zip(samples, compute_logprobs(policy, samples, budget, args.temperature, device)):
        s["old_logprobs"] = lp
    if args.tis_cap and args.off_policy_correction == "mis":  # responses too far off: no part in the policy loss
        reject_mismatched_sequences(samples, args.tis_cap)
    if args.kl_coef > 0:
        with offload.on_gpu(reference), adapters_off(policy):  # with LoRA: the base model, the reference
            for s, lp in zip(samples, compute_logprobs(reference or policy, samples, budget, args.temperature, device)):
                s["ref_logprobs"] = lp


def add_advantages(samples: list[dict], args: Args, device) -> None:
    """Collective (whitening): per-token rewards (with the KL unless --kl-in-loss), GAE advantages and returns from
    the rollout-time values, and the advantages whitened over every rank's tokens."""
    for s in samples:
        # 1 on the model's own tokens (every response token, single-turn; not observations): the updates read it too
        s["mask"] = torch.tensor(model_token_mask(s), dtype=torch.float32)
    mask = padded(samples, "mask", device)
    kl_coef = 0.0 if args.kl_in_loss else args.kl_coef
    ref = padded(samples, "ref_logprobs", device) if "ref_logprobs" in samples[0] else None
    scores = torch.tensor([s["score"] for s in samples], device=device)
    rewards, _ = token_rewards(scores, mask, padded(samples, "old_logprobs", device), ref, kl_coef)
    advantages, returns = gae(rewards, padded(samples, "old_values", device), mask, args.gamma, args.lam)
    whitened = masked_whiten(advantages, mask)
    for i, s in enumerate(samples):
        n = len(s["response_ids"])
        s["raw_advantages"], s["advantages"], s["returns"] = (x[i, :n].cpu() for x in (advantages, whitened, returns))


def update_critic(critic, optimizer, samples: list[dict], args: Args, world: int, device, generator) -> dict:
    """Clipped value regression towards the returns, one optimizer step per mini-batch; returns this rank's sums."""
    sums = dict.fromkeys(["value_loss", "value_clipfrac", "critic_tokens", "critic_grad_norm", "critic_steps"], 0.0)
    for mini in mini_batches(samples, args.epochs, args.num_mini_batches, generator):
        (num_tokens,) = all_reduce_sum([model_tokens(mini)], device)
        for indices in plan_equal_micro_batches(sample_lengths(mini), args.max_tokens_per_micro_batch, device):
            micro = [mini[i] for i in indices]
            values = packed_values(critic, micro)
            if not micro:  # this rank ran out of samples (FSDP needs its backward all the same)
                empty_backward(values[0])
                continue
            values, mask = pad_rows(values), padded(micro, "mask", device)
            token_loss, clipped = value_loss(values, padded(micro, "old_values", device),
                                             padded(micro, "returns", device), args.value_clip)
            loss = token_mean_share(token_loss, mask, num_tokens)
            (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already a global mean
            sums["value_loss"] += loss.item() * world
            sums["value_clipfrac"] += (clipped * mask).sum().item()
            sums["critic_tokens"] += mask.sum().item()
        grad_norm = clip_and_step(critic, optimizer, args.max_grad_norm)  # None: NaN/inf, the step is skipped
        sums["critic_grad_norm"] += grad_norm or 0.0
        sums["critic_steps"] += grad_norm is not None
    return sums


def update_policy(policy, optimizer, samples: list[dict], args: Args, world: int, device, generator) -> dict:
    """PPO's clipped surrogate on the whitened per-token advantages (plus the entropy bonus and, with --kl-in-loss,
    the k3 KL to the reference), one optimizer step per mini-batch, normalised like update_critic."""
    sums = dict.fromkeys(["policy_loss", "clipfrac", "approx_kl", "entropy", "policy_tokens", "grad_norm",
                          "opt_steps", "skipped"], 0.0)
    samples = [s for s in samples if "rejected" not in s]  # --off-policy-correction mis: no part, nor in the means
    for mini in mini_batches(samples, args.epochs, args.num_mini_batches, generator):
        # The model's tokens, and every token the routers of an MoE policy route.
        num_tokens, positions = all_reduce_sum([model_tokens(mini), sum(sample_lengths(mini))], device)
        for indices in plan_equal_micro_batches(sample_lengths(mini), args.max_tokens_per_micro_batch, device):
            micro = [mini[i] for i in indices]
            logprobs, entropy = packed_response_logprobs(policy, micro, args.temperature, with_entropy=True)
            if not micro:
                empty_backward(logprobs[0])
                continue
            logprobs, entropy, mask = pad_rows(logprobs), pad_rows(entropy), padded(micro, "mask", device)
            old, advantages = padded(micro, "old_logprobs", device), padded(micro, "advantages", device)
            token_loss, clipped = policy_loss(logprobs, old, advantages, args.clip_low, args.clip_high)
            if args.tis_cap is not None:  # from p_trainer / p_rollout on the sampled tokens (--off-policy-correction)
                token_loss = token_loss * importance_weights(old, padded(micro, "logprobs", device),
                                                             args.off_policy_correction, args.tis_cap)
            token_loss = token_loss - args.entropy_coef * entropy
            if args.kl_in_loss and "ref_logprobs" in micro[0]:
                delta = padded(micro, "ref_logprobs", device) - logprobs
                token_loss = token_loss + args.kl_coef * (delta.exp() - delta - 1)  # k3, always >= 0
            loss = token_mean_share(token_loss, mask, num_tokens)
            aux = router_aux_loss(policy, sum(sample_lengths(micro)) / positions)  # MoE, if on: load balance
            ((loss + aux) * world).backward()
            with torch.no_grad():
                log_ratio = logprobs - old
                sums["policy_loss"] += loss.item() * world
                sums["clipfrac"] += (clipped * mask).sum().item()
                sums["approx_kl"] += ((log_ratio.exp() - 1 - log_ratio) * mask).sum().item()  # k3 of old || new
                sums["entropy"] += (entropy * mask).sum().item()
                sums["policy_tokens"] += mask.sum().item()
        grad_norm = clip_and_step(policy, optimizer, args.max_grad_norm)
        sums["skipped"] += grad_norm is None
        sums["grad_norm"] += grad_norm or 0.0
        sums["opt_steps"] += grad_norm is not None
    return sums


def warm_up_critic(critic, optimizer, scheduler, samples: list[dict], args: Args, world: int, device) -> dict:
    """Before the policy first moves: the critic trains on this first batch, replayed, until its explained variance
    on it reaches --critic-warmup-ev or --critic-warmup-steps runs out. The returns bootstrap from its values, so
    they and the advantages are recomputed after every update; its learning-rate schedule counts these updates."""
    for updates in range(args.critic_warmup_steps + 1):  # at least once: ev and updates are always set
        ev = explained_variance(*(padded(samples, key, device) for key in ("old_values", "returns", "mask")))
        if ev >= args.critic_warmup_ev or updates == args.critic_warmup_steps:
            break
        if update_critic(critic, optimizer, samples, args, world, device, None)["critic_steps"]:
            scheduler.step()
        for s, values in zip(samples, compute_values(critic, samples, args.max_tokens_per_micro_batch, device)):
            s["old_values"] = values
        add_advantages(samples, args, device)
    return {"critic/warmup_updates": updates, "critic/warmup_explained_variance": ev}


def step_metrics(samples: list[dict], generated: list[dict], stats: dict, policy, args: Args, world: int,
                 device) -> dict:
    """Collective: what is logged of a step, over all ranks. generated: the samples as the rollout gave them (this
    rank's share of generation); samples: this rank's training share, with scores, values and advantages."""
    lengths = sample_lengths(samples)
    cat = lambda key: torch.cat([s[key][s["mask"] > 0] for s in samples]) if samples else torch.zeros(0)  # own tokens
    advantages, values, returns = cat("raw_advantages"), cat("old_values"), cat("returns")
    kl = (cat("old_logprobs") - cat("ref_logprobs")) if "ref_logprobs" in samples[0] else torch.zeros(0)
    sums = sum_over_ranks({
        "rule_reward": sum(s["reward"] for s in generated), "correct": sum(s["reward"] > 0 for s in generated),
        "count": len(generated), "response_tokens": sum(len(s["response_ids"]) for s in generated),
        "truncated": sum(not s["finished"] for s in generated), "total_tokens": sum(sample_lengths(generated)),
        "model_score": sum(s["model_score"] for s in samples), "score": sum(s["score"] for s in samples),
        "train_count": len(samples), "tokens": len(advantages), "advantage": advantages.sum().item(),
        "advantage_sq": (advantages ** 2).sum().item(), "value": values.sum().item(), "return": returns.sum().item(),
        "ref_kl": kl.sum().item(), **stats}, device)
    count, tokens, policy_tokens = sums["count"], max(sums["tokens"], 1), max(sums["policy_tokens"], 1)
    steps, critic_steps = max(sums["opt_steps"] / world, 1), max(sums["critic_steps"] / world, 1)
    advantage_mean, train_count = sums["advantage"] / tokens, max(sums["train_count"], 1)
    metrics = {
        "reward/mean": sums["rule_reward"] / count, "reward/accuracy": sums["correct"] / count,
        "reward/model_mean": sums["model_score"] / train_count, "reward/score_mean": sums["score"] / train_count,
        "response/length_mean": sums["response_tokens"] / count, "response/truncated_frac": sums["truncated"] / count,
        "loss/policy": sums["policy_loss"] / world / steps, "loss/value": sums["value_loss"] / world / critic_steps,
        "policy/clip_frac": sums["clipfrac"] / policy_tokens, "policy/approx_kl": sums["approx_kl"] / policy_tokens,
        "policy/entropy": sums["entropy"] / policy_tokens, "policy/kl_ref": sums["ref_kl"] / tokens,
        "policy/grad_norm": sums["grad_norm"] / world / steps, "update/skipped": sums["skipped"] / world,
        "critic/value_mean": sums["value"] / tokens, "critic/return_mean": sums["return"] / tokens,
        "critic/value_clip_frac": sums["value_clipfrac"] / max(sums["critic_tokens"], 1),
        "critic/grad_norm": sums["critic_grad_norm"] / world / critic_steps,
        "critic/explained_variance": explained_variance(*(padded(samples, key, device)
                                                          for key in ("old_values", "returns", "mask"))),
        "advantage/mean": advantage_mean, "total_tokens": sums["total_tokens"],
        "advantage/std": max(sums["advantage_sq"] / tokens - advantage_mean ** 2, 0.0) ** 0.5,
        **batching_metrics(plan_equal_micro_batches(lengths, args.max_tokens_per_micro_batch, device), lengths, device),
        **rollout_mismatch_metrics(samples, args.tis_cap, device),  # the engine's log-probs against the trainer's
        **router_metrics(policy, device)}  # MoE: expert load and router entropy of the update's passes
    return metrics


def resolve_defaults(args: Args, world: int = 1, device: torch.device = torch.device("cpu")) -> list[str]:
    """Every value chosen for the user, in one place: the flags left unset, from the task (the built-in one is tiny
    and starts from random weights); then, once the flags are checked, the held-out size (which may count the
    data's rows) and activation checkpointing where the planner forecasts that the step would not fit without it
    (GPUs only). Returns the lines printed at start-up: the values chosen, and the forecast."""
    unset = asdict(args)
    builtin = args.dataset is None
    args.reward_fn = args.reward_fn or ("synthetic" if builtin else "none" if args.reward_model else "gsm8k")
    args.max_response_len = default_response_len(args) if args.max_response_len is None else args.max_response_len
    args.lr = default_lr(5e-4 if args.model is None else 1e-6, args) if args.lr is None else args.lr
    args.critic_lr = (default_lr(1e-3 if args.model is None else 1e-5, args) if args.critic_lr is None
                      else args.critic_lr)
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

    # The run's directory (locked, and resumed from its newest intact state with --resume auto); the prompts.
    run_dir = open_run_dir("ppo", given, asdict(args), FIXED_ON_RESUME)
    tokenizer = load_tokenizer(args.model)
    train_rows, eval_rows, data_notes = load_prompts(args, tokenizer)
    check_reward_fits(args, eval_rows)  # the reward must score the data's own gold answers as correct
    if not placement.trains:  # split placement's rollout ranks: generate and score for the trainers, to the end
        return serve_rollouts(args, placement, tokenizer, train_rows, eval_rows, device, run_dir.path,
                              run_dir.start_step)

    # Models: the policy and the critic, an optimizer each (with --lora-rank: adapters on frozen bases, the critic's
    # value head trained in full); the frozen reference (with LoRA: the policy's own base) and reward model.
    policy, critic = load_policy(args, tokenizer, device), load_critic_model(args, tokenizer, device)
    reference = load_reference(args, tokenizer, device) if args.kl_coef > 0 and not args.lora_rank else None
    reward_model, rm_tokenizer = load_frozen_reward_model(args, device) if args.reward_model else (None, None)
    optimizer, scheduler = make_optimizer(policy, args.lr, args.weight_decay, args.warmup_steps, args.adam_beta2)
    critic_optimizer, critic_scheduler = make_optimizer(critic, args.critic_lr, args.weight_decay, args.warmup_steps,
                                                        args.adam_beta2)
    offload = Offloader(args.offload, device)  # from here on, each phase brings in what it uses
    offload.park(critic, reference, reward_model)  # before vLLM sizes itself from the free memory

    logger, timer, perf = start_logging(args, run_dir, rank, world, device, chosen + data_notes, [policy, critic])
    rollouts = make_rollouts(args, placement, policy, tokenizer, train_rows, eval_rows, device, run_dir.path,
                             run_dir.start_step, logger, timer)
    checkpoints = Checkpoints(args, run_dir, logger, timer, tokenizer, rollouts,
                              TrainedModel(policy, optimizer, scheduler, args.lr),
                              more={"critic": TrainedModel(critic, critic_optimizer, critic_scheduler, args.critic_lr)},
                              export_more={"critic": critic}, probes=[train_rows[0]["prompt"]],
                              on_gpu=lambda: offload.on_gpu(critic, critic_optimizer, optimizer))
    checkpoints.resume()
    logger.log_step_zero(rollouts.start(), timer)  # a fresh run evaluates its initial weights (colocated)

    stop = False
    for step in range(run_dir.start_step + 1, args.steps + 1):
        timer.start_step(step)
        generator = shuffle_generator(args.seed, rank, world, step)  # of the mini-batches: as a resumed run would

        # 1. Rollout: group_size responses per prompt, each with its rule reward.
        generated, metrics = rollouts.next_batch(step)
        # Every rank takes about the same token work: samples move between ranks (the losses are global means).
        samples, _ = share_samples_evenly(generated, sample_lengths(generated), world, rank)

        # 2. Reward: each response's score (rule reward + reward model - missing-EOS penalty), on its last token.
        perf.start()
        with timer("reward_model"), offload.on_gpu(reward_model):
            add_scores(samples, args, reward_model, rm_tokenizer, tokenizer, device)

        # 3. Values and log-probs at rollout time: the critic, the policy (old), the reference.
        with timer("logprobs"):
            add_old_values_and_logprobs(samples, policy, critic, reference, offload, args, device)

        # 4. Advantages: per-token rewards (score - KL), GAE with the critic's values, whitened over all ranks.
        add_advantages(samples, args, device)
        if step == 1 and args.critic_warmup_steps:  # a fresh critic learns this batch before the policy moves
            with timer("critic_warmup"), offload.on_gpu(critic, critic_optimizer):
                metrics.update(warm_up_critic(critic, critic_optimizer, critic_scheduler, samples, args, world, device))

        # 5. Update the critic, then the policy.
        with timer("update"):
            with offload.on_gpu(critic, critic_optimizer):
                stats = update_critic(critic, critic_optimizer, samples, args, world, device, generator)
            with offload.on_gpu(optimizer):
                stats.update(update_policy(policy, optimizer, samples, args, world, device, generator))
            for sched, steps_taken in [(critic_scheduler, stats["critic_steps"]), (scheduler, stats["opt_steps"])]:
                if steps_taken:  # the schedules count updates
                    sched.step()

        # 6. Weight sync to the rollout engines (not after a stop signal on any rank: every rank saves and stops).
        stop = stop_agreed(device)
        metrics.update(rollouts.publish(step, stop))

        # 7. Log.
        metrics.update(step_metrics(samples, generated, stats, policy, args, world, device))
        checkpoints.bad_steps.record(metrics["update/skipped"] > 0, step)  # raises after --max-bad-steps in a row
        total_tokens = metrics.pop("total_tokens")  # each epoch of the update passes every one of them
        metrics.update({"policy/lr": scheduler.get_last_lr()[0], "critic/lr": critic_scheduler.get_last_lr()[0],
                        **perf.step_metrics(total_tokens, timer, rollouts.rollout_memory, total_tokens * args.epochs),
                        **rollouts.evaluate(step)})  # held-out greedy accuracy, when due
        checkpoints.export(step)
        logger.log(step, {**metrics, **timer.pop()})

        # 8. Checkpoint: a resumable training state, the critic's included.
        checkpoints.save(step, stop)
        if stop:
            break

    checkpoints.say_how_it_went(rollouts.first_eval, rollouts.last_eval, stop, {"eval/accuracy": "greedy"},
                                " (the critic in its critic/)")
    logger.close()
    rollouts.close()
    finish_distributed(exit_process=placement.split)


if __name__ == "__main__":
    run_main(main, Args)
