"""DPO (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290) and KTO (Ethayarajh et al. 2024,
https://arxiv.org/abs/2402.01306): preference optimisation without a reward model.

DPO trains on pairs of responses to one prompt, one preferred (chosen), one not (rejected): the policy's log-prob
gain over a frozen reference is an implicit reward, r = beta * log(pi / pi_ref), and the loss -log sigmoid(r_chosen -
r_rejected) is the Bradley-Terry likelihood that the chosen response wins. `--loss-type` swaps in a variant (IPO,
hinge/SLiC, robust, APO-zero, SPPO-hard, SimPO: a few lines each in `preference_loss`); `--sft-weight` adds RPO's NLL.
KTO (`--loss-type kto`) needs only responses labelled desirable or not: each reward is pushed above or below a
reference point, the policy's current KL from the reference (`kto_loss`); a pair is two such rows. Examples come
from a dataset (e.g. HH-RLHF), or online (Guo et al. 2024, https://arxiv.org/abs/2402.04792) from the policy's own
samples, the reward picking the winner: common/data/preference_source.py's business.

Each step: examples -> reference log-probs (cached, computed once by the initial policy, or a frozen copy) -> policy
log-probs in packed micro-batches -> loss -> update -> (online: weight sync) -> log -> checkpoint. At the first step
the policy equals the reference, so the loss must equal its known value (ln 2 for DPO) and every implicit reward 0:
the run checks it, which catches masking, packing, precision and prompt-boundary bugs at once. Left out on purpose:
a reference model of another architecture, reward-model ensembles, length-controlled DPO.

    torchrun --nproc_per_node 2 dpo.py                   # built-in task, synthetic pairs, CPU, about a minute
    torchrun --nproc_per_node 2 dpo.py --loss-type kto   # the same pairs as desirable and undesirable rows
    torchrun --nproc_per_node 2 dpo.py --online          # pairs sampled from the policy, ranked by the reward
    torchrun --nproc_per_node 8 dpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset Anthropic/hh-rlhf \\
        --dataset-config harmless-base
"""

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from common.data.preference_source import (PreferenceDataArgs, default_eval_size, example_length, example_logps,
                                           example_source, held_out_metrics, load_examples, reference_for,
                                           response_lengths, share_examples)
from common.data.preferences import unpair
from common.rollout.args import RolloutArgs, check_rollout_args, default_response_len, fill_rollout_defaults
from common.rollout.reward_check import check_reward_fits
from common.rollout.rollouts import make_rollouts
from common.rollout.serve import serve_rollouts
from common.rollout.split import init_placement
from common.run.checkpoints import Checkpoints, TrainedModel
from common.run.cli import check_ranges, chosen_values, run_main
from common.run.distributed import finish_distributed, quiet_libraries, sum_over_ranks
from common.run.logger import start_logging
from common.run.packages import check_packages
from common.run.run_plan import plan_run
from common.run.rundir import RunArgs, fixed_on_resume, open_run_dir
from common.run.signals import install_stop_handlers, stop_agreed
from common.train.batching import empty_backward, plan_equal_micro_batches
from common.train.logprobs import model_token_mask
from common.train.loading import load_frozen_reward_model, load_policy
from common.train.lora import LoraArgs, check_lora_args, default_lr
from common.train.model import load_tokenizer, model_config
from common.train.moe import MoeArgs, router_aux_loss, router_metrics
from common.train.optim import clip_and_step, make_optimizer


# An example, a dict, as the update takes it, and where each key comes from:
#   a pair (common/data/preferences.py, or make_online_pairs from the policy's samples): prompt_ids, chosen_ids,
#     rejected_ids; online multi-turn episodes also chosen_mask, rejected_mask (the model's own tokens)
#   KTO's unpaired row (unpair): prompt_ids, completion_ids, label (desirable or not), kl_ids (a KL partner's
#     completion from another prompt)
#   reference (ReferenceLogps.add_to, before the update): ref, the reference log-probs of its two sequences


@dataclass
class Args(RunArgs, RolloutArgs, LoraArgs, PreferenceDataArgs, MoeArgs):
    model: str | None = None
    """HF hub id or local directory of a causal LM; unset: the built-in tiny model (random init)"""
    max_len: int | None = None
    """most tokens of prompt + response: longer pairs lose prompt tokens from the start, then response tokens from
    the end; unset: 16 for the built-in task, else 1024"""
    max_prompt_len: int | None = None
    """the prompt keeps at least this many of its last tokens when a pair is cut; unset: half of --max-len (with
    --online: prompts longer than this are dropped, 256 unless set)"""

    # online DPO
    online: bool = False
    """sample the pairs from the policy (vLLM on GPUs): of --group-size responses, the best against the worst"""
    group_size: int = 8
    """with --online: responses sampled per prompt"""
    prompts_per_step: int = 64
    """with --online: prompts per step over all ranks"""
    reward_model: str | None = None
    """with --online: an AutoModelForSequenceClassification checkpoint (one label) that scores each response"""
    ref_update_every: int = 0
    """with --online: copy the policy into the reference every this many steps (iterative DPO); 0: never"""

    # optimisation
    steps: int | None = None
    """number of steps (one optimizer update each); unset: 150 for the built-in task, else one epoch of the pairs"""
    pairs_per_step: int = 32
    """offline: pairs (KTO: rows) per step over all ranks"""
    lr: float | None = None
    """AdamW learning rate; unset: 1e-3 for the built-in tiny model (random init), else 5e-7"""
    warmup_steps: int = 5
    """linear learning-rate warmup over this many updates"""
    beta: float = 0.1
    """how far the policy may move from the reference: the implicit reward is beta * log(pi / pi_ref)"""
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "apo-zero", "sppo-hard", "simpo", "kto"] = "sigmoid"
    """sigmoid (DPO), ipo, hinge, robust, apo-zero, sppo-hard, simpo (no reference, length-normalised) or kto
    (unpaired rows: each response desirable or not)"""
    label_smoothing: float = 0.0
    """with sigmoid (cDPO), robust or simpo: the probability that a preference label is wrong"""
    simpo_gamma: float = 0.0
    """with simpo: the margin the chosen response must win by"""
    kto_desirable_weight: float = 1.0
    """with kto: the weight of desirable rows' losses. For unbalanced data the KTO paper's rule of thumb: choose the
    weights so that desirable_weight x desirable rows / (undesirable_weight x undesirable rows) is in [1, 4/3]"""
    kto_undesirable_weight: float = 1.0
    """with kto: the weight of undesirable rows' losses (see --kto-desirable-weight)"""
    sft_weight: float | None = None
    """weight of the chosen (KTO: desirable) responses' mean per-token NLL added to the loss (RPO): keeps their
    log-probs from falling with the rejected ones'; unset: 1 for the built-in task (its answers are right), else 0"""
    ref_cache: str = "runs/ref_cache"
    """where the reference log-probs, computed once by the initial policy, are kept under a key of the model, data,
    template and lengths (a later run on the same rows reuses them); none (and --online): a frozen copy instead"""
    skip_start_check: bool = False
    """do not stop the run when the first step's loss and rewards differ from their values at policy == reference"""
    eval_every: int = 25
    """held-out evaluation (preference, and greedy task accuracy where prompts have answers) every this many steps"""


# Flags a resumed run cannot change: its saved state (weights, optimizer, data position) would mean nothing.
FIXED_ON_RESUME = fixed_on_resume(Args, "model", "online", "group_size", "prompts_per_step", "pairs_per_step",
                                  "max_len", "max_prompt_len")


def resolve_defaults(args: Args, world: int = 1, device: torch.device = torch.device("cpu")) -> list[str]:
    """Every value chosen for the user, in one place: the flags left unset, from the task (the built-in one is tiny
    and starts from random weights; offline --steps is one epoch, set once the data is loaded: load_examples);
    then, once the flags are checked, the held-out size (which may count the data's rows) and activation
    checkpointing where the planner forecasts that the step would not fit without it (GPUs only). Returns the lines
    printed at start-up: the values chosen, and the forecast."""
    unset = asdict(args)
    builtin = args.dataset is None
    args.lr = default_lr(1e-3 if args.model is None else 5e-7, args) if args.lr is None else args.lr
    args.max_len = (16 if builtin else 1024) if args.max_len is None else args.max_len
    args.max_prompt_len = args.max_prompt_len or (256 if args.online else args.max_len // 2)
    args.max_response_len = default_response_len(args) if args.max_response_len is None else args.max_response_len
    args.reward_fn = args.reward_fn or ("synthetic" if builtin else "none" if args.reward_model else "gsm8k")
    args.steps = args.steps or (150 if builtin else None)
    args.sft_weight = (1.0 if builtin else 0.0) if args.sft_weight is None else args.sft_weight
    if not args.online and args.precision == "auto":
        args.precision = "bf16"  # auto's fp32 was measured with online rollouts only
    if args.online or builtin:  # rollouts: online, the pairs; the built-in task, greedy evaluation
        fill_rollout_defaults(args)  # the engine, reward processes, --precision auto
    args.ref_cache = "none" if args.online else args.ref_cache  # online, the pairs are new every step
    check_args(args, world)  # one line for a flag that cannot work, before the planner reads the model
    args.eval_size = default_eval_size(args) if args.eval_size is None else args.eval_size  # may count the rows
    forecast = plan_run(args, world, device, model_config(args.model))  # may turn --activation-checkpointing on
    return [chosen_values(unset, asdict(args)), *forecast]


def check_args(args: Args, world: int) -> None:
    """Flag values and combinations that cannot work, each with a one-line error (before any model is loaded)."""
    check_ranges(args, at_least_one=["steps", "pairs_per_step", "eval_size", "max_tokens_per_micro_batch", "max_len"],
                 positive=["lr", "max_grad_norm", "hang_timeout", "kto_desirable_weight", "kto_undesirable_weight"],
                 non_negative=["warmup_steps", "weight_decay", "sft_weight", "ref_update_every", "eval_every",
                               "save_every", "save_state_every", "keep_checkpoints"])
    check_loss_args(args.loss_type, args.beta, args.label_smoothing, args.simpo_gamma)
    check_lora_args(args)
    if args.online:
        check_rollout_args(args, world)
        if args.group_size < 2:
            raise ValueError("--group-size must be at least 2: a pair is the best and the worst of a group")
        if args.reward_fn == "none" and args.reward_model is None:
            raise ValueError("--reward-fn none needs --reward-model: every response would tie")
    else:
        if args.pairs_per_step % world:
            raise ValueError(f"--pairs-per-step {args.pairs_per_step} must be divisible by the {world} training ranks")
        for name in ("rollout_ranks", "async_rollout", "reward_model", "ref_update_every"):
            if getattr(args, name):
                raise ValueError(f"--{name.replace('_', '-')} needs --online (offline pairs come from the dataset)")
    if 2 * args.max_len > args.max_tokens_per_micro_batch:
        raise ValueError(f"--max-tokens-per-micro-batch {args.max_tokens_per_micro_batch} must hold one whole pair: "
                         f"2 x --max-len = {2 * args.max_len}")
    check_packages(args)  # a flag whose package is missing: one line with the pip command (the checks above need none)


def make_online_pairs(samples: list[dict], args: Args) -> tuple[list[dict], dict]:
    """Per prompt (group_size samples in a row), its best response against its worst by the reward; a group whose
    rewards all tie gives no pair. KTO takes the two as a desirable and an undesirable row, each with a KL partner
    from another prompt of the batch. Returns the examples and this rank's sums for the log."""
    pairs, gaps = [], []
    for start in range(0, len(samples), args.group_size):
        group = samples[start:start + args.group_size]
        best, worst = max(group, key=lambda s: s["score"]), min(group, key=lambda s: s["score"])
        if best["score"] > worst["score"]:
            masks = ({"chosen_mask": model_token_mask(best), "rejected_mask": model_token_mask(worst)}
                     if "response_mask" in best else {})  # multi-turn: the model's own tokens
            pairs.append({"prompt_ids": best["prompt_ids"], "chosen_ids": best["response_ids"],
                          "rejected_ids": worst["response_ids"], **masks})
            gaps.append(best["score"] - worst["score"])
    groups = len(samples) // args.group_size
    sums = {"groups": groups, "ties": groups - len(pairs), "reward_gap": sum(gaps)}
    if args.loss_type == "kto":
        return unpair(pairs, args.max_prompt_len + args.max_response_len, args.seed), sums
    return pairs, sums


# ---------------------------------------------------------------------------------------------------------------
# The update.

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "apo-zero", "sppo-hard", "simpo", "kto")
SMOOTHED_LOSS_TYPES = ("sigmoid", "robust", "simpo")  # the ones label_smoothing applies to


def check_loss_args(loss_type: str, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.0) -> None:
    """One-line errors for settings a loss would silently misread or ignore."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss type {loss_type!r}; known: {', '.join(LOSS_TYPES)}")
    if beta <= 0:
        raise ValueError(f"beta must be greater than 0, got {beta}")
    if label_smoothing and loss_type not in SMOOTHED_LOSS_TYPES:
        raise ValueError(f"label smoothing applies to {', '.join(SMOOTHED_LOSS_TYPES)}, not to {loss_type}")
    if not 0 <= label_smoothing < 0.5:  # robust divides by 1 - 2 eps; eps >= 0.5 means the labels are mostly wrong
        raise ValueError(f"label smoothing must be in [0, 0.5), got {label_smoothing}")
    if simpo_gamma and loss_type != "simpo":
        raise ValueError(f"simpo_gamma applies to simpo only, not to {loss_type}")


def preference_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, loss_type: str, beta: float,
                    label_smoothing: float = 0.0, simpo_gamma: float = 0.0, chosen_lengths=None, rejected_lengths=None):
    """Per-pair preference loss and the implicit rewards of both responses.

    policy_*, ref_*: summed log-probs of each response's tokens under the policy and the reference, [pairs]
    (ref_* unused by simpo, may be None). *_lengths: response lengths in tokens, [pairs], needed by ipo and simpo,
    which compare per-token averages. Returns (losses, chosen_rewards, rejected_rewards), each [pairs]; the rewards
    (beta * log-ratio to the reference on the log-probs the loss sees; simpo: beta * average log-prob) are detached.
    """
    check_loss_args(loss_type, beta, label_smoothing, simpo_gamma)
    if loss_type == "kto":
        raise ValueError("kto is not a pair loss: its rows go through kto_loss")
    eps = label_smoothing
    if loss_type in ("ipo", "simpo"):
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(f"loss type {loss_type} averages log-probs per token: pass chosen_lengths and "
                             f"rejected_lengths")
        policy_chosen, policy_rejected = policy_chosen / chosen_lengths, policy_rejected / rejected_lengths
    if loss_type == "simpo":
        # SimPO (Meng et al. 2024, https://arxiv.org/abs/2405.14734): no reference; the reward is the policy's own
        # per-token average log-prob, and the chosen must win by a margin gamma. Label smoothing as in TRL's CPO.
        chosen_rewards, rejected_rewards = beta * policy_chosen, beta * policy_rejected
        margin = chosen_rewards - rejected_rewards - simpo_gamma
        losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        return losses, chosen_rewards.detach(), rejected_rewards.detach()
    if loss_type == "ipo":
        # IPO's beta (its tau) must not depend on response length, so its log-probs are per-token averages, as TRL
        # does since its authors pointed it out (https://github.com/huggingface/trl/pull/1265).
        ref_chosen, ref_rejected = ref_chosen / chosen_lengths, ref_rejected / rejected_lengths
    chosen_logratio = policy_chosen - ref_chosen  # log pi/pi_ref of the chosen response, [pairs]
    rejected_logratio = policy_rejected - ref_rejected
    h = chosen_logratio - rejected_logratio  # = (pi_c - pi_r) - (ref_c - ref_r): 0 while policy == reference

    if loss_type == "sigmoid":
        # DPO (eq. 7); label smoothing eps = conservative DPO (cDPO, Mitchell 2023, https://ericmitchell.ai/cdpo.pdf):
        # the preference label is taken as flipped with probability eps.
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        # Robust DPO (Chowdhury et al. 2024, https://arxiv.org/abs/2403.00409): unbiased under labels flipped with
        # probability eps (cDPO's second term changes sign, and the whole is rescaled).
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "ipo":
        # IPO (Azar et al. 2023, https://arxiv.org/abs/2310.12036, eq. 17): regress h to 1 / (2 beta) instead of
        # pushing it to infinity, which keeps the policy near the reference even on deterministic preferences.
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        # SLiC's hinge (Zhao et al. 2023, https://arxiv.org/abs/2305.10425) on the DPO margin: no loss past 1 / beta.
        losses = torch.relu(1 - beta * h)
    elif loss_type == "apo-zero":
        # APO-zero (D'Oosterlinck et al. 2024, https://arxiv.org/abs/2408.06266, eq. 7): push the chosen reward up
        # and the rejected one down each on its own, not only their difference (for chosen better than the policy).
        losses = 1 - torch.sigmoid(beta * chosen_logratio) + torch.sigmoid(beta * rejected_logratio)
    else:  # sppo-hard
        # SPPO (Wu et al. 2024, https://arxiv.org/abs/2405.00675, eq. 4.7 with eta = 1 / beta) with hard win
        # probabilities 1 and 0: regress each log-ratio on its own to +1/(2 beta) (chosen) and -1/(2 beta) (rejected).
        losses = (chosen_logratio - 1 / (2 * beta)) ** 2 + (rejected_logratio + 1 / (2 * beta)) ** 2
    return losses, (beta * chosen_logratio).detach(), (beta * rejected_logratio).detach()


def loss_at_reference(loss_type: str, beta: float, label_smoothing: float = 0.0, simpo_gamma: float = 0.0,
                      desirable_share: float = 0.5, desirable_weight: float = 1.0,
                      undesirable_weight: float = 1.0) -> float | None:
    """Each loss's value while the policy equals the reference (every log-ratio 0): what the first step must log,
    whatever the data. By hand: sigmoid and robust ln 2 (any beta and smoothing), ipo 1 / (4 beta^2), hinge and
    apo-zero 1, sppo-hard 1 / (2 beta^2), kto half the rows' mean weight (share w_D + (1 - share) w_U) / 2; simpo
    None (no reference: its first loss depends on the policy's own per-token margin)."""
    check_loss_args(loss_type, beta, label_smoothing, simpo_gamma)
    zero, one = torch.zeros(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    if loss_type == "simpo":
        return None
    if loss_type == "kto":
        return sum(share * kto_loss(zero, zero, torch.tensor([label]), 0.0, beta, desirable_weight,
                                    undesirable_weight)[0].item()
                   for share, label in [(desirable_share, True), (1 - desirable_share, False)])
    return preference_loss(zero, zero, zero, zero, loss_type, beta, label_smoothing, simpo_gamma, one, one)[0].item()


def sft_loss(chosen_logps_sum, chosen_lengths):
    """RPO's NLL term (Pang et al. 2024, https://arxiv.org/abs/2404.19733), added as `--sft-weight` times this:
    each chosen response's mean per-token negative log-likelihood, [pairs] (summed log-probs and lengths, [pairs]).
    Averaging per response keeps long responses from outweighing short ones, as the paper's length normalisation."""
    return -chosen_logps_sum / chosen_lengths


def kto_loss(policy_logps, ref_logps, desirable, kl, beta: float, desirable_weight=1.0, undesirable_weight=1.0):
    """KTO's per-row loss (Ethayarajh et al. 2024, https://arxiv.org/abs/2402.01306, eq. 8) and implicit rewards.

    policy_logps, ref_logps: summed log-probs of each row's completion, [rows]; desirable: bool, [rows]; kl: the
    reference point z0 (a float >= 0, train_step). With r = log pi/pi_ref, a completion's value is
    sigmoid(beta (r - z0)) if desirable and sigmoid(beta (z0 - r)) if not, and the loss is its weight times
    (1 - value): desirable completions gain by rising above the reference point, undesirable ones by falling below,
    both saturating. Returns (losses, rewards = beta * r, detached), [rows]."""
    logratio = policy_logps - ref_logps
    losses = torch.where(desirable, desirable_weight * (1 - torch.sigmoid(beta * (logratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - logratio))))
    return losses, (beta * logratio).detach()


SUMMED = (["reward_chosen", "reward_rejected", "logp_chosen", "logp_rejected"],  # micro_batch_losses' sums: pairs,
          ["desirable", "reward_desirable", "reward_undesirable"])  # and KTO's rows


def micro_batch_losses(policy, examples: list[dict], args: Args, device, kl: float = 0.0, loss_type: str = ""):
    """Each example's loss [n] and NLL term [n] in a micro-batch, and sums for the log: pairs through
    preference_loss, KTO's rows through kto_loss with the step's reference point `kl`."""
    loss_type = loss_type or args.loss_type
    ref = torch.tensor([e["ref"] for e in examples], device=device)  # [n, 2]
    lengths = torch.tensor([response_lengths(e) for e in examples], device=device).float()  # [n, 2], own tokens
    if loss_type == "kto":
        (logps,) = example_logps(policy, examples, which=(0,))
        good = torch.tensor([e["label"] for e in examples], device=device)
        losses, rewards = kto_loss(logps, ref[:, 0], good, kl, args.beta, args.kto_desirable_weight,
                                   args.kto_undesirable_weight)
        return losses, sft_loss(logps, lengths[:, 0]) * good, {
            "desirable": good.sum().item(), "reward_desirable": rewards[good].sum().item(),
            "reward_undesirable": rewards[~good].sum().item(), "correct": ((rewards > 0) == good).sum().item()}
    chosen, rejected = example_logps(policy, examples)
    losses, chosen_rewards, rejected_rewards = preference_loss(
        chosen, rejected, ref[:, 0], ref[:, 1], loss_type, args.beta, args.label_smoothing, args.simpo_gamma,
        lengths[:, 0], lengths[:, 1])
    return losses, sft_loss(chosen, lengths[:, 0]), {
        "reward_chosen": chosen_rewards.sum().item(), "reward_rejected": rejected_rewards.sum().item(),
        "correct": (chosen_rewards > rejected_rewards).sum().item(), "logp_chosen": chosen.sum().item(),
        "logp_rejected": rejected.sum().item()}


def train_step(policy, optimizer, examples: list[dict], reference, args: Args, world: int, device) -> dict:
    """One optimizer step on all of this rank's examples, in packed micro-batches; the loss is the mean over every
    rank's examples (normalised by their global count). Returns this rank's sums of the step's statistics."""
    num_examples = sum_over_ranks({"n": len(examples)}, device)["n"]
    # KTO's reference point z0: the step's estimate of KL(policy || reference), clamped at 0 (a number: no gradient).
    kl = max(0.0, reference.mismatched_kl(policy, examples)) if args.loss_type == "kto" else 0.0
    sums = dict.fromkeys(["loss", "sft", "examples", "correct", *SUMMED[args.loss_type == "kto"]], 0.0) | {"kl": kl}
    lengths = [example_length(e) for e in examples]
    for indices in plan_equal_micro_batches(lengths, args.max_tokens_per_micro_batch, device):
        if not indices:  # this rank ran out of examples (FSDP needs its backward all the same)
            empty_backward(example_logps(policy, [])[0])
            continue
        losses, nll, stats = micro_batch_losses(policy, [examples[i] for i in indices], args, device, kl)
        # FSDP averages over ranks; an MoE policy's load-balancing loss (if on) is shared among its examples
        ((losses + args.sft_weight * nll + router_aux_loss(policy, 1.0)).sum() / num_examples * world).backward()
        counted = {"loss": losses.sum().item(), "sft": nll.sum().item(), "examples": len(indices), **stats}
        for key, value in counted.items():
            sums[key] += value
    grad_norm = clip_and_step(policy, optimizer, args.max_grad_norm)  # None: NaN/inf, the step is skipped
    return {**sums, "skipped": float(grad_norm is None), "grad_norm": grad_norm or 0.0}


def step_metrics(sums: dict, args: Args, world: int) -> dict[str, float]:
    """What is logged of an update (sums over all ranks)."""
    n = max(sums["examples"], 1)
    mean = lambda key, count=n: sums.get(key, 0.0) / max(count, 1)
    metrics = {"loss/preference": mean("loss"), "loss/sft": mean("sft"), "pairs/count": sums["count"],
               "rewards/accuracy": mean("correct"), "policy/grad_norm": sums["grad_norm"] / world,
               "update/skipped": sums["skipped"] / world}
    if args.loss_type == "kto":
        return {**metrics, "kto/kl": sums["kl"] / world, "rewards/desirable": mean("reward_desirable",
                sums["desirable"]), "rewards/undesirable": mean("reward_undesirable", n - sums["desirable"])}
    return {**metrics, "rewards/chosen": mean("reward_chosen"), "rewards/rejected": mean("reward_rejected"),
            "rewards/margin": mean("reward_chosen") - mean("reward_rejected"), "logps/chosen": mean("logp_chosen"),
            "logps/rejected": mean("logp_rejected")}


def evaluate(policy, reference, rows: list[dict] | None, task_eval: dict, args: Args, rank: int, world: int,
             device) -> dict:
    """Collective: the held-out rows' accuracy of the implicit reward (held_out_metrics), each micro-batch's by this
    script's loss: KTO's unpaired rows by kto, pairs by the run's pair loss (with kto: DPO's sigmoid, for the margin
    and loss); with the task's greedy accuracy `task_eval`, measured just before."""

    def losses_of(examples: list[dict], unpaired: bool):
        loss_type = "kto" if unpaired else args.loss_type.replace("kto", "sigmoid")
        return micro_batch_losses(policy, examples, args, device, loss_type=loss_type)

    return {**held_out_metrics(policy, reference, rows, losses_of, args.max_tokens_per_micro_batch, rank, world,
                               device), **task_eval}


def check_start(sums: dict, args: Args) -> None:
    """At the first step the policy equals the reference: the loss must be its known value and every implicit
    reward (and KTO's reference point) 0. Anything else is a masking, packing, precision or prompt-boundary bug."""
    n = max(sums["examples"], 1)
    expected = loss_at_reference(args.loss_type, args.beta, args.label_smoothing, args.simpo_gamma,
                                 sums.get("desirable", 0) / n, args.kto_desirable_weight, args.kto_undesirable_weight)
    loss, rewards = sums["loss"] / n, sum(abs(v) for k, v in sums.items() if k.startswith("reward_")) / n
    if expected is not None and not args.skip_start_check and (
            abs(loss - expected) > 2e-3 * max(1.0, expected) or rewards + args.beta * sums["kl"] > 0.05 * args.beta):
        raise ValueError(f"start-up check: at the first step the policy equals the reference, so the "
                         f"{args.loss_type} loss must be {expected:.4f} and the implicit rewards 0, but they are "
                         f"{loss:.4f} and {rewards:.3g} on average (a masking, packing, precision or prompt-boundary "
                         f"bug; --skip-start-check runs anyway)")


def main(args: Args):
    given = asdict(args)  # as on the command line: they name the run (common/run/rundir.py)
    # Colocated or split into trainers and rollout ranks; the trainers' sequence-parallel groups and model sharding.
    placement, device = init_placement(args.rollout_ranks, args.sequence_parallel, args.shard_size)
    install_stop_handlers()  # SIGTERM, SIGUSR1 and Ctrl-C finish the step, save and stop (common/run/signals.py)
    quiet_libraries()  # libraries log warnings only
    chosen = resolve_defaults(args, placement.num_trainers, device)  # every value chosen for you, printed at start
    rank, world = placement.rank, placement.world
    torch.manual_seed(args.seed)

    # Data: offline, pairs or KTO's rows and held-out ones; prompts with answers, online and for the built-in task.
    tokenizer = load_tokenizer(args.model)
    rows, eval_rows, task_rows, eval_task_rows, notes = load_examples(args, tokenizer)
    check_reward_fits(args, eval_task_rows)  # the reward must score the data's own gold answers (if any) as correct
    run_dir = open_run_dir("dpo", given, asdict(args), FIXED_ON_RESUME)
    if not placement.trains:  # split placement's rollout ranks: generate and score for the trainers, to the end
        return serve_rollouts(args, placement, tokenizer, task_rows, eval_task_rows, device, run_dir.path,
                              run_dir.start_step)

    # Models: the policy (LoRA: adapters on a frozen base); a reference unless cached (LoRA: the base); a reward model.
    policy = load_policy(args, tokenizer, device, packed_rows=True)
    reference = reference_for(args, policy, tokenizer, device)  # of examples: a frozen model's log-probs, or cached
    reward_model, rm_tokenizer = load_frozen_reward_model(args, device) if args.reward_model else (None, None)
    optimizer, scheduler = make_optimizer(policy, args.lr, args.weight_decay, args.warmup_steps, args.adam_beta2)
    logger, timer, perf = start_logging(args, run_dir, rank, world, device, chosen + notes, [policy])

    # Where examples come from: the dataset (offline) or the policy's samples, scored and paired (online); the
    # shared rollouts also give greedy task accuracy wherever prompts have answers.
    rollouts = None if task_rows is None else make_rollouts(args, placement, policy, tokenizer, task_rows,
                                                            eval_task_rows, device, run_dir.path, run_dir.start_step,
                                                            logger, timer)
    source = example_source(args, rows, rollouts, make_online_pairs, reward_model, rm_tokenizer, tokenizer, rank, world,
                            device, timer)
    reference.cache_from(policy, rows, eval_rows, args, rank, world, device, logger, timer)  # policy == reference now
    moving = ({"reference": TrainedModel(reference.frozen)} if reference.frozen is not None and args.ref_update_every
              else {})
    checkpoints = Checkpoints(args, run_dir, logger, timer, tokenizer, source,
                              TrainedModel(policy, optimizer, scheduler, args.lr), moving)
    first_eval, last_eval = map(checkpoints.resume().get, ("first_eval", "last_eval"))
    # A fresh colocated run's greedy task accuracy; in split placement the rollout ranks get their first weights.
    initial_task_eval = source.start()
    if not run_dir.resume_from:  # the preference data's held-out accuracy, with the task's
        with timer("eval"):
            first_eval = last_eval = evaluate(policy, reference, eval_rows, initial_task_eval, args, rank, world,
                                              device)
        logger.log(0, {**first_eval, **timer.pop()}, advance=False)
    timer.pop()

    stop, start_checked = False, run_dir.resume_from is not None
    for step in range(run_dir.start_step + 1, args.steps + 1):
        timer.start_step(step)
        # 1. Examples: the step's pairs (KTO: labelled rows), from the dataset or sampled, scored and paired online.
        examples, metrics = source.next_batch(step)
        examples, counted = share_examples(examples, world, rank)  # about the same tokens on every rank

        # 2. Reference log-probs: cached, or from the frozen reference (itself the policy of --ref-update-every ago).
        perf.start()
        with timer("reference"):
            reference.add_to(examples)

        # 3. Update: the preference loss (plus RPO's NLL), one optimizer step.
        with timer("update"):
            stats = train_step(policy, optimizer, examples, reference, args, world, device)
            if not stats["skipped"]:
                scheduler.step()
        sums = sum_over_ranks({**stats, **counted}, device)
        if not start_checked and sums["examples"]:  # the first step with examples (online, all groups may tie)
            check_start(sums, args)
            start_checked = True
        if args.ref_update_every and step % args.ref_update_every == 0:
            with timer("reference"):  # iterative DPO: the reference moves up to the current policy
                reference.frozen.load_state_dict(policy.state_dict())

        # 4. Weight sync to the rollout engines (not after a stop signal on any rank: every rank saves and stops).
        stop = stop_agreed(device)
        metrics.update(source.publish(step, stop))

        # 5. Log.
        metrics.update({**step_metrics(sums, args, world), **router_metrics(policy, device)})  # MoE: expert load
        checkpoints.bad_steps.record(metrics["update/skipped"] > 0, step)  # raises after --max-bad-steps in a row
        metrics.update({"policy/lr": scheduler.get_last_lr()[0],
                        **perf.step_metrics(sums["tokens"], timer, getattr(rollouts, "rollout_memory", 0))})
        if args.eval_every and step % args.eval_every == 0 or step == args.steps:
            with timer("eval"):
                last_eval = evaluate(policy, reference, eval_rows, source.evaluate_task(step), args, rank, world,
                                     device)
            metrics.update(last_eval)
        checkpoints.export(step)
        logger.log(step, {**metrics, **timer.pop()})

        # 6. Checkpoint: a resumable training state.
        checkpoints.save(step, stop, {"first_eval": first_eval, "last_eval": last_eval})
        if stop:
            break

    names = {"eval/preference_accuracy": "preference", "eval/label_accuracy": "label", "eval/accuracy": "greedy task"}
    checkpoints.say_how_it_went(first_eval, last_eval, stop, names)
    logger.close()
    source.close()
    finish_distributed(exit_process=placement.split)


if __name__ == "__main__":
    run_main(main, Args)
