"""DPO: Direct Preference Optimization (Rafailov et al. 2023, https://arxiv.org/abs/2305.18290).

Given pairs of responses to one prompt, one preferred (chosen) and one not (rejected), DPO trains the policy
directly on the preference, with no reward model and no sampling: the policy's log-probability gain over a frozen
reference model is an implicit reward, r = beta * log(pi / pi_ref), and the loss -log sigmoid(r_chosen - r_rejected)
is the Bradley-Terry likelihood that the chosen response wins. beta sets how far the policy may drift from the
reference. Offline, the pairs come from a dataset (e.g. HH-RLHF); online (Guo et al. 2024,
https://arxiv.org/abs/2402.04792), both responses are sampled from the current policy and a judge picks the winner.
`--loss-type` swaps the loss for one of its variants (IPO, hinge/SLiC, robust, APO-zero, SPPO-hard, SimPO); each is
a few lines of `preference_loss` below, with its paper. `--sft-weight` adds RPO's NLL on the chosen response.

Each step: pairs (a dataset's, or online: the policy's own responses ranked by the reward) -> reference log-probs
(computed once by the initial policy and cached on disk, or a frozen copy) -> policy log-probs of both responses in
one packed micro-batch -> loss -> update -> (online: weight sync) -> log -> checkpoint. At the first step the
policy equals the reference, so the loss must equal its known value (ln 2 for DPO) and every implicit reward 0:
the run checks it, which catches masking, packing, precision and prompt-boundary bugs at once.
Left out on purpose: a reference model of another architecture, reward-model ensembles, length-controlled DPO.

    torchrun --nproc_per_node 2 dpo.py                   # built-in task, synthetic pairs, CPU, about a minute
    torchrun --nproc_per_node 2 dpo.py --online          # pairs sampled from the policy, ranked by the reward
    torchrun --nproc_per_node 8 dpo.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset Anthropic/hh-rlhf \\
        --dataset-config harmless-base
"""

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.batching import plan_equal_micro_batches, share_samples_evenly
from common.distributed import finish_distributed, max_over_ranks, quiet_libraries, sum_over_ranks
from common.errors import check_ranges, parse_args, run_main
from common.health import health_report
from common.logger import Logger, StageTimer
from common.logprobs import packed_response_logprobs, use_packed_attention
from common.model import checkpoint_dtype, load_model, load_tokenizer, shard_model, stop_token_ids
from common.optim import BadStepCounter, clip_and_step, make_optimizer, set_hyperparameters
from common.perf import TrainingMemoryPeak, mfu, peak_flops
from common.preferences import load_pairs, tokenize_pairs
from common.resume import load_training_state, prune_checkpoints, read_trainer_state, save_training_state
from common.rewards import load_reward_fn
from common.rollouts import Rollouts, check_reward_fits, check_rollout_args, fill_rollout_defaults, serve_rollouts
from common.rundir import open_run_dir
from common.signals import crash_point, install_stop_handlers, stop_agreed, stop_requested
from common.split import init_placement
from common.value_models import load_reward_model, reward_model_scores
from sharding.checkpoint import save_hf_checkpoint


@dataclass
class Args:
    # model and data
    model: str | None = None
    """HF hub id or local directory of a causal LM; unset: the built-in tiny model (random init)"""
    dataset: str | None = None
    """preference pairs: HF hub dataset name or a local .jsonl/.json/.parquet/.csv file (also compressed, e.g.
    .jsonl.gz); unset: the built-in task's pairs (the right answer chosen over a wrong one). With --online: the
    prompts and reference answers, as grpo.py's --dataset"""
    dataset_config: str | None = None
    """configuration name of a hub dataset (e.g. `harmless-base` for Anthropic/hh-rlhf)"""
    prompt_key: str = "prompt"
    """column of the prompt; a file without it holds whole dialogues, whose common start is the prompt"""
    chosen_key: str = "chosen"
    """column of the preferred response (or whole dialogue)"""
    rejected_key: str = "rejected"
    """column of the other response (or whole dialogue)"""
    answer_key: str = "answer"
    """with --online: the column of the reference answer the reward function checks"""
    eval_split: str = "test"
    """hub dataset split to evaluate on; a local file holds out its last --eval-size pairs instead"""
    eval_size: int | None = None
    """held-out pairs (with --online: prompts); unset: 256, or a tenth of a local file of fewer than 2,560"""
    chat_template: bool | None = None
    """wrap the text in the tokenizer's chat template; unset: for conversations (lists of messages) only"""
    max_len: int | None = None
    """most tokens of prompt + response: longer pairs lose prompt tokens from the start, then response tokens from
    the end; unset: 16 for the built-in task, else 1024"""
    max_prompt_len: int | None = None
    """the prompt keeps at least this many of its last tokens when a pair is cut; unset: half of --max-len (with
    --online: prompts longer than this are dropped, 256 unless set)"""

    # online DPO
    online: bool = False
    """sample the pairs from the policy: --group-size responses per prompt, the best against the worst by the
    reward (ties skipped), generated by the shared rollout engines (vLLM on GPUs)"""
    group_size: int = 8
    """with --online: responses sampled per prompt"""
    prompts_per_step: int = 64
    """with --online: prompts per step over all ranks"""
    reward_fn: str | None = None
    """with --online: gsm8k, math, synthetic, none or path/to/file.py:function, added to --reward-model's score;
    unset: synthetic for the built-in task, none with --reward-model, else gsm8k"""
    reward_model: str | None = None
    """with --online: an AutoModelForSequenceClassification checkpoint (one label) that scores each response"""
    ref_update_every: int = 0
    """with --online: copy the policy into the reference every this many steps (iterative DPO); 0: never"""
    system_prompt: str | None = None
    """with --online: a system message put before every prompt (without a chat template: a paragraph before it)"""
    prompt_template: str | None = None
    """with --online: a text holding {prompt}, which each prompt replaces before the chat template applies"""
    skip_reward_check: bool = False
    """with --online: do not stop when the reward scores fewer than 90% of the held-out rows' own gold answers as
    correct (for rewards whose gold answers are not completions)"""
    reward_workers: int | None = None
    """processes per rank that run the reward function; unset: 2 with vLLM, 1 with hf"""
    reward_timeout: float | None = 30.0
    """seconds one reward call may take: a slower one is stopped, scores 0 and is counted; None: no limit"""
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
    """with --online, split placement: the last K ranks only generate, the others only train; 0: colocated"""
    async_rollout: bool = False
    """with --rollout-ranks: generate the next batch while the trainers train on this one"""
    max_staleness: int = 1
    """with --async-rollout: how many updates behind the trainer the weights that generated a batch may be"""
    temperature: float = 1.0
    """with --online: sampling temperature (the log-probs DPO trains on are at temperature 1)"""
    top_p: float = 1.0
    """with --online: nucleus sampling threshold"""
    max_response_len: int | None = None
    """with --online: maximum new tokens per response; unset: 2 for the built-in task, else 1024"""

    # optimisation
    steps: int | None = None
    """number of steps (one optimizer update each); unset: 150 for the built-in task, else one epoch of the pairs"""
    pairs_per_step: int = 32
    """offline: pairs per step over all ranks"""
    lr: float | None = None
    """AdamW learning rate; unset: 1e-3 for the built-in tiny model (random init), else 5e-7"""
    warmup_steps: int = 5
    """linear learning-rate warmup over this many updates"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    adam_beta2: float = 0.99
    """AdamW's second-moment decay (0.999 is the usual default elsewhere)"""
    max_grad_norm: float = 1.0
    """gradient clipping norm"""
    beta: float = 0.1
    """how far the policy may move from the reference: the implicit reward is beta * log(pi / pi_ref)"""
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust", "apo-zero", "sppo-hard", "simpo"] = "sigmoid"
    """sigmoid (DPO), ipo, hinge, robust, apo-zero, sppo-hard or simpo (no reference, length-normalised)"""
    label_smoothing: float = 0.0
    """with sigmoid (cDPO), robust or simpo: the probability that a preference label is wrong"""
    simpo_gamma: float = 0.0
    """with simpo: the margin the chosen response must win by"""
    sft_weight: float | None = None
    """weight of the chosen responses' mean per-token NLL added to the loss (RPO): keeps their log-probs from
    falling with the rejected ones'; unset: 1 for the built-in task (its chosen answers are the right ones), else 0"""
    ref_cache: str = "runs/ref_cache"
    """directory where the reference log-probs (computed once, by the initial policy) are kept, under a key of the
    model, data, template and lengths, so a later run on the same pairs skips them; none: a frozen copy of the
    model computes them every step instead (always the case with --online)"""
    skip_start_check: bool = False
    """do not stop the run when the first step's loss and rewards differ from their values at policy == reference"""
    max_tokens_per_micro_batch: int = 16384
    """token budget of one forward/backward pass: pairs are packed end to end, chosen and rejected together"""
    activation_checkpointing: bool = False
    """recompute each decoder layer in backward to save memory"""
    compile: bool = False
    """torch.compile each decoder layer of the models that train or score (dynamic shapes, for packed rows): fewer,
    fused kernels, which small models gain most from; the first steps take longer while it compiles"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """GPU arithmetic of training and of vLLM's rollouts: bf16 over fp32 master weights, or fp32 on both sides (their
    log-probs agree to 0.002 per token against 0.04; on SmolLM2-135M, online DPO reached 0.54 and 0.62 held-out
    accuracy on addition after 20 steps against 0.12 and 0.14 in bf16: benchmarks/README.md); auto: with --online,
    fp32 for models under 0.3B parameters, else bf16 (offline, fp32 is unmeasured)"""

    # evaluation, checkpoints, logging
    eval_every: int = 25
    """held-out evaluation (preference accuracy, and greedy task accuracy where there is a task) every this many
    steps, and before and after training"""
    save_every: int = 0
    """write an HF-format checkpoint every this many steps; 0: only at the end"""
    save_state_every: int = 50
    """write a resumable training state every this many steps; 0: only at the end and on a stop signal"""
    keep_checkpoints: int = 2
    """resumable training states kept in the output dir (the newest); 0 keeps all"""
    resume: str = "auto"
    """auto: continue from the newest intact training state in the output dir, if any; none: start afresh (refused
    where another run's files are, unless --overwrite); or the path of a state_<step> directory"""
    overwrite: bool = False
    """delete the run already in the output dir (its states, exports and metrics) and start afresh"""
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
    """unset: dpo_<dataset>_s<seed>_<hash of the flags that define the run>, so that the same command resumes its
    run and a changed one starts a new run (--steps, cadences, logging and memory flags are not in the hash)"""
    seed: int = 1
    """seed for the model init, data order and sampling"""
    track: bool = False
    """log to Weights & Biases (respects WANDB_MODE, e.g. offline)"""
    wandb_project: str = "nanorl"
    """W&B project"""


# Flags a resumed run cannot change: its saved state (weights, optimizer, data position) would mean nothing.
FIXED_ON_RESUME = ("model", "dataset", "dataset_config", "prompt_key", "chosen_key", "rejected_key", "answer_key",
                   "eval_split", "eval_size", "seed", "online", "group_size", "prompts_per_step", "pairs_per_step",
                   "max_len", "max_prompt_len", "chat_template", "system_prompt", "prompt_template")


def check_args(args: Args, world: int) -> None:
    """Flag values and combinations that cannot work, each with a one-line error (before any model is loaded)."""
    check_ranges(args, positive=["lr", "max_grad_norm", "hang_timeout"],
                 at_least_one=["steps", "pairs_per_step", "eval_size", "max_tokens_per_micro_batch", "max_len"],
                 non_negative=["warmup_steps", "weight_decay", "sft_weight", "ref_update_every", "eval_every",
                               "save_every", "save_state_every", "keep_checkpoints"])
    check_loss_args(args.loss_type, args.beta, args.label_smoothing, args.simpo_gamma)
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


# ---------------------------------------------------------------------------------------------------------------
# Data: pairs to train on and to evaluate with.

def load_pair_rows(args: Args, tokenizer, stop_ids) -> tuple[list[dict], list[dict], dict]:
    """Offline: (train rows, held-out rows, stats) of tokenized pairs {"prompt_ids", "chosen_ids", "rejected_ids"};
    the held-out pairs are a hub dataset's --eval-split, or the last --eval-size pairs of a local file."""
    from common.data import DEFAULT_EVAL_SIZE, _is_local_file
    if args.dataset is None:
        from common.synthetic import make_synthetic_pairs
        train, held_out, stats = make_synthetic_pairs("train"), make_synthetic_pairs("test"), {}
    elif _is_local_file(args.dataset) or args.eval_split is None:
        pairs, stats = load_pairs(args.dataset, args.prompt_key, args.chosen_key, args.rejected_key,
                                  args.dataset_config)
        size = args.eval_size or max(1, min(DEFAULT_EVAL_SIZE, len(pairs) // 10))
        if size >= len(pairs):
            raise ValueError(f"{args.dataset}: --eval-size {size} leaves none of its {len(pairs)} pairs for training")
        train, held_out = pairs[:-size], pairs[-size:]
    else:
        train, stats = load_pairs(args.dataset, args.prompt_key, args.chosen_key, args.rejected_key,
                                  args.dataset_config, split="train")
        held_out, _ = load_pairs(args.dataset, args.prompt_key, args.chosen_key, args.rejected_key,
                                 args.dataset_config, split=args.eval_split)
    held_out = held_out[:args.eval_size or DEFAULT_EVAL_SIZE]
    rows, token_stats = tokenize_pairs(train, tokenizer, args.max_len, args.chat_template, args.max_prompt_len,
                                       stop_ids)
    eval_rows, _ = tokenize_pairs(held_out, tokenizer, args.max_len, args.chat_template, args.max_prompt_len,
                                  stop_ids)
    return rows, eval_rows, {**stats, **token_stats}


def pair_length(pair: dict) -> int:
    """Tokens a pair takes in a packed micro-batch: the prompt twice, both responses once."""
    return 2 * len(pair["prompt_ids"]) + len(pair["chosen_ids"]) + len(pair["rejected_ids"])


def pair_logps(model, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probs [pairs] of the chosen and of the rejected responses, both of every pair in one packed
    forward (an empty `pairs` runs a dummy: a rank's zero-weight filler pass; both results are then its one value)."""
    sequences = [dict(prompt_ids=p["prompt_ids"], response_ids=p[side]) for p in pairs
                 for side in ("chosen_ids", "rejected_ids")]
    logprobs, _ = packed_response_logprobs(model, sequences, temperature=1.0)
    sums = torch.stack([lp.sum() for lp in logprobs])  # chosen, rejected, chosen, rejected, ...
    return (sums[0::2], sums[1::2]) if pairs else (sums, sums)


@torch.no_grad()
def reference_logps(model, rows: list[dict], args: Args, rank: int, world: int, device) -> list[tuple[float, float]]:
    """Collective: every row's (chosen, rejected) summed log-probs under `model`, each rank computing a share."""
    mine = list(range(rank, len(rows), world))
    out = {}
    for mb in plan_equal_micro_batches([pair_length(rows[i]) for i in mine], args.max_tokens_per_micro_batch,
                                       device):
        chosen, rejected = pair_logps(model, [rows[mine[j]] for j in mb])
        out.update({mine[j]: (c, r) for j, c, r in zip(mb, chosen.tolist(), rejected.tolist())})
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


def cached_reference_logps(policy, rows: list[dict], needed: list[int], args: Args, rank: int, world: int, device,
                           logger) -> dict[int, tuple[float, float]]:
    """The reference log-probs of rows[i] for every i in `needed`, computed by the initial policy and kept in
    --ref-cache under a key of the model, the precision and the exact token ids of all rows (so data, template and
    lengths are in it): a later run on the same pairs computes only what the cache lacks, and no reference model
    sits in memory while training. Returns {row index: (chosen, rejected)}."""
    key = hashlib.sha1((model_fingerprint(args.model, args.seed) + args.precision + json.dumps(
        [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in rows])).encode()).hexdigest()[:16]
    path = os.path.join(args.ref_cache, f"{key}.pt")
    try:
        cache = torch.load(path) if os.path.isfile(path) else {}
    except Exception:  # noqa: BLE001 - a damaged cache file is recomputed, not trusted
        cache = {}
    missing = sorted(set(needed) - set(cache))
    if missing:
        cache.update(zip(missing, reference_logps(policy, [rows[i] for i in missing], args, rank, world, device)))
        if rank == 0:
            os.makedirs(args.ref_cache, exist_ok=True)
            torch.save(cache, path + f".tmp{os.getpid()}")
            os.replace(path + f".tmp{os.getpid()}", path)
        dist.barrier()
    logger.print(f"reference log-probs of {len(needed)} pairs: {len(needed) - len(missing)} from {path}, "
                 f"{len(missing)} computed")
    return cache


def rows_in_use(rows: list[dict], args: Args, steps: int) -> list[int]:
    """The indices of the rows the first `steps` steps will sample (the sampler's global batches are a function of
    the step, so this is known before training)."""
    from common.data import PromptSampler
    sampler = PromptSampler(rows, args.pairs_per_step, 0, 1, args.seed)
    return sorted({row["index"] for _ in range(steps) for row in sampler.next_batch()})


def make_online_pairs(samples: list[dict], args: Args) -> tuple[list[dict], dict]:
    """Per prompt (group_size samples in a row), its best response against its worst by the reward; a group whose
    rewards all tie gives no pair. Returns the pairs and this rank's sums for the log."""
    pairs, gaps = [], []
    for start in range(0, len(samples), args.group_size):
        group = samples[start:start + args.group_size]
        best = max(group, key=lambda s: s["score"])
        worst = min(group, key=lambda s: s["score"])
        if best["score"] > worst["score"]:
            pairs.append({"prompt_ids": best["prompt_ids"], "chosen_ids": best["response_ids"],
                          "rejected_ids": worst["response_ids"]})
            gaps.append(best["score"] - worst["score"])
    groups = len(samples) // args.group_size
    return pairs, {"groups": groups, "ties": groups - len(pairs), "reward_gap": sum(gaps)}


# ---------------------------------------------------------------------------------------------------------------
# The update.

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


def train_step(policy, optimizer, pairs: list[dict], args: Args, world: int, device) -> dict[str, float]:
    """One optimizer step on all of this rank's pairs, in packed micro-batches; the loss is the mean over every
    rank's pairs (normalised by their global count). Returns this rank's sums of the step's statistics."""
    sums = dict.fromkeys(["loss", "pairs", "reward_chosen", "reward_rejected", "correct", "logp_chosen",
                          "logp_rejected", "sft", "grad_norm", "skipped"], 0.0)
    num_pairs = sum_over_ranks({"pairs": len(pairs)}, device)["pairs"]
    for mb in plan_equal_micro_batches([pair_length(p) for p in pairs], args.max_tokens_per_micro_batch, device):
        mbs = [pairs[i] for i in mb]
        chosen, rejected = pair_logps(policy, mbs)
        if not mbs:  # this rank ran out of pairs: a zero-weight pass keeps FSDP's collectives in step
            (chosen.sum() * 0.0).backward()
            continue
        ref_chosen = torch.tensor([p["ref_chosen"] for p in mbs], device=device)
        ref_rejected = torch.tensor([p["ref_rejected"] for p in mbs], device=device)
        chosen_lengths = torch.tensor([len(p["chosen_ids"]) for p in mbs], device=device, dtype=torch.float32)
        rejected_lengths = torch.tensor([len(p["rejected_ids"]) for p in mbs], device=device, dtype=torch.float32)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            chosen, rejected, ref_chosen, ref_rejected, args.loss_type, args.beta, args.label_smoothing,
            args.simpo_gamma, chosen_lengths, rejected_lengths)
        nll = sft_loss(chosen, chosen_lengths)
        loss = (losses + args.sft_weight * nll).sum() / num_pairs
        (loss * world).backward()  # FSDP averages gradients over ranks; the loss is already a global mean
        sums["loss"] += losses.sum().item()
        sums["sft"] += nll.sum().item()
        sums["pairs"] += len(mbs)
        sums["reward_chosen"] += chosen_rewards.sum().item()
        sums["reward_rejected"] += rejected_rewards.sum().item()
        sums["correct"] += (chosen_rewards > rejected_rewards).sum().item()
        sums["logp_chosen"] += chosen.sum().item()
        sums["logp_rejected"] += rejected.sum().item()
    grad_norm = clip_and_step(policy, optimizer, args.max_grad_norm)  # None: NaN/inf, the step is skipped
    sums["skipped"], sums["grad_norm"] = float(grad_norm is None), grad_norm or 0.0
    return sums


@torch.no_grad()
def evaluate_pairs(policy, rows: list[dict], ref: list, args: Args, rank: int, world: int, device) -> dict:
    """Collective: held-out preference accuracy (the chosen response's implicit reward above the rejected one's),
    loss and margin, every rank a share of the pairs."""
    mine = list(range(rank, len(rows), world))
    sums = dict.fromkeys(["loss", "correct", "margin", "pairs"], 0.0)
    for mb in plan_equal_micro_batches([pair_length(rows[i]) for i in mine], args.max_tokens_per_micro_batch, device):
        mbs = [mine[j] for j in mb]
        chosen, rejected = pair_logps(policy, [rows[i] for i in mbs])
        if not mbs:
            continue
        lengths = lambda side: torch.tensor([len(rows[i][side]) for i in mbs], device=device, dtype=torch.float32)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            chosen, rejected, torch.tensor([ref[i][0] for i in mbs], device=device),
            torch.tensor([ref[i][1] for i in mbs], device=device), args.loss_type, args.beta, args.label_smoothing,
            args.simpo_gamma, lengths("chosen_ids"), lengths("rejected_ids"))
        sums["loss"] += losses.sum().item()
        sums["correct"] += (chosen_rewards > rejected_rewards).sum().item()
        sums["margin"] += (chosen_rewards - rejected_rewards).sum().item()
        sums["pairs"] += len(mbs)
    policy.reshard()
    sums = sum_over_ranks(sums, device)
    n = max(sums["pairs"], 1)
    return {"eval/preference_accuracy": sums["correct"] / n, "eval/loss": sums["loss"] / n,
            "eval/margin": sums["margin"] / n}


def check_start(sums: dict, args: Args) -> None:
    """At the first step the policy equals the reference: the loss must be its known value and every implicit
    reward 0 (up to float rounding). Anything else is a bug in masking, packing, precision or the prompt boundary."""
    expected = loss_at_reference(args.loss_type, args.beta, args.label_smoothing, args.simpo_gamma)
    if expected is None or args.skip_start_check:
        return
    n = max(sums["pairs"], 1)
    loss, rewards = sums["loss"] / n, (abs(sums["reward_chosen"]) + abs(sums["reward_rejected"])) / n
    if abs(loss - expected) > 2e-3 * max(1.0, expected) or rewards > 0.05 * args.beta:
        raise ValueError(f"start-up check: at the first step the policy equals the reference, so the "
                         f"{args.loss_type} loss must be {expected:.4f} and the implicit rewards 0, but they are "
                         f"{loss:.4f} and {rewards:.3g} on average (a masking, packing, precision or prompt-boundary "
                         f"bug; --skip-start-check runs anyway)")


def main():
    args = parse_args(Args)
    given = asdict(args)  # as on the command line: they name the run (common/rundir.py)
    placement, device = init_placement(args.rollout_ranks)  # colocated, or split into trainers and rollout ranks
    install_stop_handlers()  # SIGTERM, SIGUSR1 and Ctrl-C: finish the step, save, stop (common/signals.py)
    rank, world = placement.rank, placement.world
    quiet_libraries()
    # Defaults that depend on the task: the built-in one is tiny and starts from random weights.
    builtin = args.dataset is None
    args.lr = (1e-3 if args.model is None else 5e-7) if args.lr is None else args.lr
    args.max_len = (16 if builtin else 1024) if args.max_len is None else args.max_len
    args.max_prompt_len = args.max_prompt_len or (256 if args.online else args.max_len // 2)
    args.max_response_len = (2 if builtin else 1024) if args.max_response_len is None else args.max_response_len
    args.reward_fn = args.reward_fn or ("synthetic" if builtin else "none" if args.reward_model else "gsm8k")
    args.steps = args.steps or (150 if builtin else None)
    args.sft_weight = (1.0 if builtin else 0.0) if args.sft_weight is None else args.sft_weight
    if not args.online and args.precision == "auto":
        args.precision = "bf16"  # auto's fp32 was measured with online rollouts only
    if args.online or builtin:  # rollouts: online, the pairs; the built-in task, greedy evaluation
        fill_rollout_defaults(args)  # the engine, reward processes, --precision auto
    if args.online:
        args.ref_cache = "none"  # the pairs are new every step
    check_args(args, placement.num_trainers)
    if args.online:
        load_reward_fn(args.reward_fn)  # a bad reward spec fails now, before any model is loaded
    torch.manual_seed(args.seed)

    # Data: preference pairs (offline), or prompts with reference answers (online) and held-out pairs or prompts.
    tokenizer = load_tokenizer(args.model)
    stop_ids = stop_token_ids(args.model, tokenizer)
    task_rows = eval_task_rows = eval_pairs = None  # prompts whose greedy answers a reward can check
    if args.online:
        from common.data import load_train_eval, tokenize_prompts
        task_rows, eval_task_rows = load_train_eval(args.dataset, args.prompt_key, args.answer_key,
                                                    args.dataset_config, eval_split=args.eval_split,
                                                    eval_size=args.eval_size, seed=args.seed)
        check_reward_fits(args, eval_task_rows)  # a reward that cannot score the data's own answers stops here
        formats = (args.max_prompt_len, args.chat_template, args.prompt_template, args.system_prompt)
        task_rows, _ = tokenize_prompts(task_rows, tokenizer, *formats)
        eval_task_rows, _ = tokenize_prompts(eval_task_rows, tokenizer, *formats)
        data_notes = (f"{len(task_rows)} train / {len(eval_task_rows)} eval prompts; the first prompt, as the model "
                      f"sees it: {tokenizer.decode(task_rows[0]['prompt_ids'])[:400]!r}")
    else:
        rows, eval_pairs, stats = load_pair_rows(args, tokenizer, stop_ids)
        args.steps = args.steps or max(1, len(rows) // args.pairs_per_step)
        data_notes = (f"{len(rows)} train / {len(eval_pairs)} eval pairs; " +
                      ", ".join(f"{k} {v}" for k, v in stats.items()))
        if builtin:  # the built-in task also has answers: greedy task accuracy on held-out prompts
            from common.data import load_train_eval, tokenize_prompts
            task_rows, eval_task_rows = load_train_eval(None, "prompt", "answer", eval_size=args.eval_size)
            task_rows, _ = tokenize_prompts(task_rows, tokenizer, 256, args.chat_template)
            eval_task_rows, _ = tokenize_prompts(eval_task_rows, tokenizer, 256, args.chat_template)

    # The run's directory: locked for this run, and resumed from its newest intact training state (--resume auto).
    run_dir = open_run_dir("dpo", given, asdict(args), FIXED_ON_RESUME)
    resume_path, output_dir = run_dir.resume_from, run_dir.path
    resumed = read_trainer_state(resume_path) if resume_path else {"step": 0, "extra": {}}
    start_step = resumed["step"]
    if not placement.trains:  # split placement's rollout ranks: generate and score for the trainers, to the end
        return serve_rollouts(args, placement, tokenizer, task_rows, eval_task_rows, device, output_dir, start_step)

    # Models: the policy, and a frozen reference unless its log-probs come from the cache; the reward model.
    policy = shard_model(load_model(args.model, tokenizer, args.seed), device, args.activation_checkpointing,
                         compile_layers=args.compile, precision=args.precision)
    reference = reward_model = rm_tokenizer = None
    if args.ref_cache == "none" and args.loss_type != "simpo":
        reference = shard_model(load_model(args.model, tokenizer, args.seed), device, trainable=False,
                                compile_layers=args.compile, precision=args.precision)
    if args.reward_model is not None:
        reward_model, rm_tokenizer = load_reward_model(args.reward_model)
        reward_model = shard_model(reward_model, device, trainable=False, compile_layers=args.compile,
                                   precision=args.precision)
    for model in filter(None, [policy, reference, reward_model]):  # training passes run on packed rows
        use_packed_attention(model, device)
    num_params, peak = sum(p.numel() for p in policy.parameters()), peak_flops(device)
    optimizer, scheduler = make_optimizer(policy, args.lr, args.weight_decay, args.warmup_steps, args.adam_beta2)

    logger = Logger(rank, args.steps, args.track, args.wandb_project, run_dir.name, asdict(args), output_dir,
                    run_id=resumed["extra"].get("wandb_run_id"), start_step=start_step)
    for note in [*run_dir.notes, data_notes, *health_report(device, output_dir, num_params)]:  # collective
        logger.print(note)
    timer = StageTimer(device, args.hang_timeout, output_dir)
    # Where pairs come from: the dataset, through a seeded sampler (offline); the policy, through the shared
    # rollouts (online), which also give greedy task accuracy wherever prompts have answers.
    rollouts = None
    if task_rows is not None:
        rollouts = Rollouts(args, placement, policy, tokenizer, task_rows, eval_task_rows, device, output_dir,
                            start_step, logger, timer)
    if args.online:
        data = rollouts
    else:
        from common.data import PromptSampler
        data = PromptSampler(rows, args.pairs_per_step // world, rank, world, args.seed)
        for i, row in enumerate(rows + eval_pairs):
            row["index"] = i
        ref = None
        if args.loss_type != "simpo" and reference is None:  # before the first update: the policy is the reference
            needed = rows_in_use(rows, args, args.steps) + [row["index"] for row in eval_pairs]
            with timer("reference"):
                ref = cached_reference_logps(policy, rows + eval_pairs, needed, args, rank, world, device, logger)
    install_stop_handlers()  # again: the engine may have set handlers of its own
    bad_steps = BadStepCounter(args.max_bad_steps)
    if resume_path:  # last, so that the restored RNG states are the ones the loop continues with
        more = {"reference": (reference, None, None)} if reference is not None and args.ref_update_every else None
        info = load_training_state(resume_path, policy, optimizer, scheduler, data, more)
        set_hyperparameters(optimizer, scheduler, args.lr, args.weight_decay)  # this command's, not the saved ones
        bad_steps.in_a_row = info["extra"]["bad_steps_in_a_row"]
        logger.print(f"resumed from {resume_path} at step {start_step}" + ("" if info["exact_rng"] else
                     " (another number of ranks: model, optimizer and data position are exact, random streams "
                     "re-seeded)"))
    first_eval, last_eval = resumed["extra"].get("first_eval"), resumed["extra"].get("last_eval")
    # Online: a fresh colocated run's initial greedy task accuracy; in split placement the rollout ranks get the
    # weights they start from.
    initial_task_eval = rollouts.start() if rollouts is not None else {}
    if not resume_path:
        first_eval = last_eval = {**evaluate(policy, reference, None, eval_pairs, args, rank, world, device,
                                             ref if not args.online else None, step=0, timer=timer),
                                  **initial_task_eval}
        logger.log(0, {**first_eval, **timer.pop()}, advance=False)
    timer.pop()

    stop, start_checked = False, resume_path is not None  # (online, a step whose groups all tie has no pairs)
    for step in range(start_step + 1, args.steps + 1):
        step_start = timer.start_step(step)
        metrics = {}
        # 1. Pairs: this rank's share of the step's preference pairs.
        if args.online:  # sampled from the policy, scored, the best response of each prompt against its worst
            samples, metrics = rollouts.next_batch(step)
            with timer("reward_model"):
                scores = reward_model_scores(reward_model, rm_tokenizer, tokenizer, samples,
                                             args.max_tokens_per_micro_batch, device) if reward_model else None
            for i, s in enumerate(samples):
                s["score"] = s["reward"] + (scores[i] if scores else 0.0)
            pairs, pair_sums = make_online_pairs(samples, args)
        else:
            pairs, pair_sums, samples = data.next_batch(), {}, []
        # Every rank takes about the same token work: pairs move between ranks, each whole.
        pairs, _ = share_samples_evenly(pairs, [pair_length(p) for p in pairs], world, rank)

        # 2. Reference log-probs: cached, or from the frozen reference (itself the policy of --ref-update-every ago).
        training_memory = TrainingMemoryPeak(device) if device.type == "cuda" else None
        with timer("reference"):
            if reference is not None:
                logps = reference_logps_of(reference, pairs, args, device)
            else:
                logps = [ref[p["index"]] if ref else (0.0, 0.0) for p in pairs]
            for p, (c, r) in zip(pairs, logps):
                p["ref_chosen"], p["ref_rejected"] = c, r

        # 3. Update: the preference loss (plus RPO's NLL), one optimizer step.
        with timer("update"):
            stats = train_step(policy, optimizer, pairs, args, world, device)
            if not stats["skipped"]:
                scheduler.step()
        sums = sum_over_ranks({**stats, **pair_sums, "tokens": sum(pair_length(p) for p in pairs),
                               "reward": sum(s["reward"] for s in samples),
                               "response_tokens": sum(len(s["response_ids"]) for s in samples),
                               "samples": len(samples)}, device)
        if not start_checked and sums["pairs"]:  # the first step with pairs: its loss was at policy == reference
            check_start(sums, args)
            start_checked = True
        if args.online and args.ref_update_every and step % args.ref_update_every == 0:
            with timer("reference"):  # iterative DPO: the reference moves up to the current policy
                reference.load_state_dict(policy.state_dict())

        # 4. Weight sync to the rollout engines (online; not after a stop signal: every rank saves and stops).
        stop = stop_agreed(device)
        if rollouts is not None and args.online:
            metrics.update(rollouts.publish(step, stop))
        elif rollouts is not None:
            rollouts.publish(step, stop)

        # 5. Log.
        n = max(sums["pairs"], 1)
        metrics.update({
            "loss/preference": sums["loss"] / n, "loss/sft": sums["sft"] / n,
            "rewards/chosen": sums["reward_chosen"] / n, "rewards/rejected": sums["reward_rejected"] / n,
            "rewards/margin": (sums["reward_chosen"] - sums["reward_rejected"]) / n,
            "rewards/accuracy": sums["correct"] / n, "logps/chosen": sums["logp_chosen"] / n,
            "logps/rejected": sums["logp_rejected"] / n, "policy/grad_norm": sums["grad_norm"] / world,
            "update/skipped": sums["skipped"] / world, "pairs/count": sums["pairs"],
            "policy/lr": scheduler.get_last_lr()[0]})
        if args.online:
            groups = max(sums["groups"], 1)
            metrics.update({"reward/mean": sums["reward"] / max(sums["samples"], 1),
                            "pairs/tie_frac": sums["ties"] / groups, "pairs/reward_gap": sums["reward_gap"] / n,
                            "response/length_mean": sums["response_tokens"] / max(sums["samples"], 1)})
        bad_steps.record(metrics["update/skipped"] > 0, step)  # raises on every rank after --max-bad-steps in a row
        step_seconds = time.perf_counter() - step_start
        metrics.update({"time/step": step_seconds, "perf/tokens_per_s": sums["tokens"] / step_seconds})
        if (train_mfu := mfu(num_params, sums["tokens"], timer.seconds["time/update"], peak, world)):
            metrics["perf/mfu"] = train_mfu
        if training_memory is not None:
            rollout_memory = rollouts.rollout_memory if rollouts is not None else 0
            metrics["perf/peak_memory_gb"] = max_over_ranks(max(rollout_memory, training_memory.peak()) / 1e9, device)
        if args.eval_every and step % args.eval_every == 0 or step == args.steps:
            last_eval = evaluate(policy, reference, rollouts, eval_pairs, args, rank, world, device,
                                 ref if not args.online else None, step=step, timer=timer)
            metrics.update(last_eval)
        if args.save_every and step % args.save_every == 0 or step == args.steps:
            with timer("save"):
                save_hf_checkpoint(policy, tokenizer, os.path.join(output_dir, f"hf_step_{step}"),
                                   checkpoint_dtype(args.model))
        logger.log(step, {**metrics, **timer.pop()})  # before the state: a state never exists without its row
        crash_point("after_row", step)

        # 6. Checkpoint: a resumable training state (its time is logged with the next step).
        if stop or args.save_state_every and step % args.save_state_every == 0 or step == args.steps:
            with timer("save_state"):
                more = {"reference": (reference, None, None)} if reference is not None and args.ref_update_every \
                    else None
                save_training_state(output_dir, step, policy, optimizer, scheduler, data,
                                    {"wandb_run_id": logger.run_id, "bad_steps_in_a_row": bad_steps.in_a_row,
                                     "args": asdict(args), "first_eval": first_eval, "last_eval": last_eval}, more)
                prune_checkpoints(output_dir, args.keep_checkpoints)
        crash_point("after_state", step)
        if stop:
            logger.print(f"{stop_requested() or 'a signal on another rank'}: saved the training state at step "
                         f"{step}; run the same command again to continue")
            break

    if start_step >= args.steps:
        logger.print(f"{resume_path} is already at step {start_step} of {args.steps}: nothing to do "
                     f"(--steps trains further)")
    if not stop and first_eval and last_eval and start_step <= args.steps:  # past --steps: said above
        shown = [k for k in ("eval/preference_accuracy", "eval/accuracy") if k in first_eval]
        logger.print("; ".join(f"held-out {'greedy task' if k == 'eval/accuracy' else 'preference'} accuracy: "
                               f"{first_eval[k]:.3f} before training -> {last_eval[k]:.3f} after {args.steps} steps"
                               for k in shown)
                     + f"; model saved to {os.path.join(output_dir, f'hf_step_{args.steps}')}")
    logger.close()
    if rollouts is not None:
        rollouts.close()
    finish_distributed(exit_process=placement.split)


@torch.no_grad()
def reference_logps_of(reference, pairs: list[dict], args: Args, device) -> list[tuple[float, float]]:
    """Collective: the frozen reference's summed log-probs of this rank's pairs, in packed micro-batches."""
    out = [None] * len(pairs)
    for mb in plan_equal_micro_batches([pair_length(p) for p in pairs], args.max_tokens_per_micro_batch, device):
        chosen, rejected = pair_logps(reference, [pairs[i] for i in mb])
        for i, c, r in zip(mb, chosen.tolist(), rejected.tolist()):
            out[i] = (c, r)
    reference.reshard()
    return out


def evaluate(policy, reference, rollouts, eval_pairs, args: Args, rank: int, world: int, device, ref, step: int,
             timer) -> dict[str, float]:
    """Collective: held-out preference accuracy on pairs (offline) and greedy task accuracy where prompts have
    answers (the built-in task, --online)."""
    metrics = {}
    with timer("eval"):
        if eval_pairs is not None:
            if ref is None:  # a frozen reference (or simpo: none at all)
                if reference is not None:
                    ref = reference_logps(reference, eval_pairs, args, rank, world, device)
                else:
                    ref = [(0.0, 0.0)] * len(eval_pairs)
            else:
                ref = [ref[row["index"]] for row in eval_pairs]
            metrics.update(evaluate_pairs(policy, eval_pairs, ref, args, rank, world, device))
    if rollouts is not None:
        metrics.update(rollouts.evaluate(step, due=True))
    return metrics


if __name__ == "__main__":
    run_main(main)
