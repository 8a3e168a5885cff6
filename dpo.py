"""DPO: Direct Preference Optimization (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290).

Given pairs of responses to one prompt, one preferred (chosen) and one not (rejected), DPO trains the policy
directly on the preference, with no reward model and no sampling: the policy's log-probability gain over a frozen
reference model is an implicit reward, r = beta * log(pi / pi_ref), and the loss -log sigmoid(r_chosen - r_rejected)
is the Bradley-Terry likelihood that the chosen response wins. beta sets how far the policy may drift from the
reference. Offline, the pairs come from a dataset (e.g. HH-RLHF); online (Guo et al. 2024,
https://arxiv.org/abs/2402.04792), both responses are sampled from the current policy and a judge picks the winner.
`--loss-type` swaps the loss for one of its variants (IPO, hinge/SLiC, robust, APO-zero, SPPO-hard, SimPO); each is
a few lines of `preference_loss` below, with its paper. `--sft-weight` adds RPO's NLL on the chosen response.

    torchrun --nproc_per_node 2 dpo.py

Here so far: the losses. main() (data, FSDP2 training loop, online sampling) is to come.
"""

import math

import torch
import torch.nn.functional as F

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "apo-zero", "sppo-hard", "simpo")
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
                    label_smoothing: float = 0.0, simpo_gamma: float = 0.0, chosen_lengths=None,
                    rejected_lengths=None):
    """Per-pair preference loss and the implicit rewards of both responses.

    policy_*, ref_*: summed log-probs of each response's tokens under the policy and the reference, [pairs]
    (ref_* unused by simpo, may be None). *_lengths: response lengths in tokens, [pairs], needed by ipo and simpo,
    which compare per-token averages. Returns (losses, chosen_rewards, rejected_rewards), each [pairs]; the rewards
    (beta * log-ratio to the reference on the log-probs the loss sees; simpo: beta * average log-prob) are detached,
    for logging (reward accuracy, margins).
    """
    check_loss_args(loss_type, beta, label_smoothing, simpo_gamma)
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


def loss_at_reference(loss_type: str, beta: float, label_smoothing: float = 0.0,
                      simpo_gamma: float = 0.0) -> float | None:
    """Each loss's value while the policy equals the reference (every log-ratio 0, so h = 0): what the first step
    must log, whatever the data; a different value means the policy and the reference do not start equal.

        sigmoid:   -(1 - eps) log 1/2 - eps log 1/2                    = ln 2 (any beta, any eps)
        robust:    ((1 - eps) ln 2 - eps ln 2) / (1 - 2 eps)           = ln 2
        ipo:       (0 - 1/(2 beta))^2                                  = 1 / (4 beta^2)
        hinge:     relu(1 - 0)                                         = 1
        apo-zero:  1 - sigmoid(0) + sigmoid(0)                         = 1
        sppo-hard: (0 - 1/(2 beta))^2 + (0 + 1/(2 beta))^2             = 1 / (2 beta^2)
        simpo:     None: it has no reference, and its first loss depends on the policy's own per-token margin
                   (it is log(1 + e^gamma) only where the policy rates both responses alike).
    """
    check_loss_args(loss_type, beta, label_smoothing, simpo_gamma)
    return {
        "sigmoid": math.log(2),
        "robust": math.log(2),
        "ipo": 1 / (4 * beta**2),
        "hinge": 1.0,
        "apo-zero": 1.0,
        "sppo-hard": 1 / (2 * beta**2),
        "simpo": None,
    }[loss_type]


def sft_loss(chosen_logps_sum, chosen_lengths):
    """RPO's NLL term (Pang et al. 2024, https://arxiv.org/abs/2404.19733), added as `--sft-weight` times this:
    each chosen response's mean per-token negative log-likelihood, [pairs] (summed log-probs and lengths, [pairs]).
    Averaging per response keeps long responses from outweighing short ones, as the paper's length normalisation."""
    return -chosen_logps_sum / chosen_lengths
