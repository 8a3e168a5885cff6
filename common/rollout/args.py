"""The rollout flags every script shares (grpo.py, ppo.py, dpo.py --online): `RolloutArgs`, the defaults a
script fills in for the ones left unset, and the one-line checks of combinations that cannot work. Also the sizes
and schedules that follow from the flags alone (sequences an engine holds at once, the steps that ask for the
engine's log-probs).
"""

from dataclasses import dataclass
from typing import Literal

from common.rollout.engines import resolve_engine_kind
from common.rollout.environments import load_env_factory
from common.rollout.reward_fns import load_reward_fn
from common.rollout.tools import check_sandbox, needs_sandbox
from common.rollout.vllm_memory import check_kv_width
from common.run.cli import check_ranges, given_on_command_line
from common.train.model import model_config, pick_precision
from sharding.vllm_moe import check_moe_mapped


@dataclass
class RolloutArgs:
    """The rollout flags every script shares (grpo.py, ppo.py, dpo.py --online): each script's Args extends it."""
    answer_key: str = "answer"
    """dataset column holding the reference answer passed to the reward function"""
    reward_fn: str | None = None
    """gsm8k, math, synthetic, none or path/to/file.py:function (ppo.py and dpo.py add --reward-model's score);
    unset: synthetic for the built-in task, none with --reward-model, else gsm8k"""
    max_response_len: int | None = None
    """maximum new tokens per response (generation also stops at EOS); unset: 2 for the built-in task, else 1024"""
    reward_workers: int | None = None
    """processes per rank that run the reward (or the environments, with --env / --tools), scoring each prompt's
    responses as soon as they are generated, while the rest still generate; unset: 2 with vLLM, 1 with hf (whose
    generate returns every response at once)"""
    reward_timeout: float | None = 30.0
    """seconds one reward call may take: a slower one is stopped (its process killed and replaced), scores 0 and is
    counted (reward/timeouts); None: no limit"""
    skip_reward_check: bool = False
    """do not stop when the reward scores fewer than 90% of the held-out rows' own gold answers as correct (for
    rewards whose gold answers are not completions)"""
    system_prompt: str | None = None
    """a system message put before every prompt (without a chat template: a paragraph before it)"""
    prompt_template: str | None = None
    """a text holding {prompt}, which each prompt replaces before the chat template applies; e.g. for GSM8K:
    '{prompt}\nLet us think step by step and output the final answer after ####.'"""
    temperature: float = 1.0
    """sampling temperature (the trainer's log-probs use the same temperature; DPO's are at 1)"""
    top_p: float = 1.0
    """nucleus sampling threshold"""
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
    """after each weight sync, compare vLLM's weights with the trainer's and fail on a mismatch (colocated only: not
    with --rollout-ranks)"""
    rollout_ranks: int = 0
    """split placement: the last K ranks only generate (K / --rollout-tp replicas) and the others only train; the
    trainers stream new weights to them after each update. 0: every rank trains and generates (colocated)"""
    async_rollout: bool = False
    """with --rollout-ranks: generate the next batch while the trainers train on this one (one update behind; GRPO
    and PPO correct it with --tis-cap); with --partial-rollouts too, the rollout ranks also take each new version
    between two engine steps, without waiting for their running responses (in-flight updates)"""
    max_staleness: int = 1
    """with --async-rollout: how many updates behind the trainer the weights that generated a batch may be; with
    --partial-rollouts: how many updates behind the trainer a trained sample's first token may be (prompts are
    admitted only while that holds, so up to 1 + this many batches of prompts are in flight). With both (in-flight
    updates) one of them is the batch generated ahead, so responses continue across phases only from 2 on: 2 there
    unless given"""
    partial_rollouts: bool = False
    """a rollout ends once it holds the step's complete groups, not when its longest response ends: the responses
    still running are kept with their tokens and log-probs and continued after the next weight sync, new prompts
    admitted within --max-staleness (colocated or on --rollout-ranks; common/rollout/partial.py). GRPO and PPO
    correct for the older tokens with --tis-cap"""
    env: str | None = None
    """multi-turn episodes: path/to/env.py:make_env (an environment per episode, built from its dataset row; the
    protocol is in common/rollout/environments.py) or lookup (the built-in task with its largest number hidden behind a
    lookup call); unset: one response per prompt"""
    tools: str | None = None
    """multi-turn episodes with tools the model calls: calculator, python (sandboxed), path/to/tools.py (its public
    functions), comma-separated; a turn without a tool call is the answer, scored by --reward-fn"""
    max_turns: int = 4
    """with --env / --tools: assistant turns per episode at most (an episode cut here is truncated)"""
    max_turn_len: int | None = None
    """with --env / --tools: new tokens per assistant turn at most; unset: 1 for lookup, else what is left of
    --max-response-len (which counts every turn's and observation's tokens)"""
    env_timeout: float | None = 60.0
    """with --env / --tools: seconds one environment call (a reset, or a step with the tools it runs) may take; a
    slower one is stopped (its process killed), its episode ends with reward 0 and is counted (episode/env_timeouts)"""

    # Flags a resumed run keeps (--partial-rollouts: the responses in flight; a lower --max-staleness drops those it
    # no longer allows, common/rollout/partial.py)
    fixed_on_resume = ("answer_key", "system_prompt", "prompt_template", "partial_rollouts")


def default_response_len(args) -> int:
    """--max-response-len unset: 2 tokens for the built-in task (one number, then anything), 6 for its multi-turn
    version (lookup, the hidden number, the answer, with room for a second lookup), else 1024."""
    if args.dataset is None:
        return 6 if args.env == "lookup" else 2
    return 1024


def fill_rollout_defaults(args) -> None:
    """The rollout flags left unset: the engine (vLLM where CUDA and vllm are), 2 reward processes per rank with
    vLLM and 1 with HF generate (which returns every response at once), TIS capped at 2 with async or partial rollouts,
    --max-staleness 2 with both, one token per turn for --env lookup, and --precision auto (common/train/model.py's
    pick_precision)."""
    args.rollout_engine = resolve_engine_kind(args.rollout_engine)
    if args.env == "lookup" and args.max_turn_len is None:
        args.max_turn_len = 1
    args.precision = pick_precision(args.precision, args.model)
    if args.reward_workers is None:
        args.reward_workers = 2 if args.rollout_engine == "vllm" else 1
    if (args.async_rollout or args.partial_rollouts) and getattr(args, "tis_cap", 0) is None:  # scripts whose
        args.tis_cap = 2.0  # loss uses importance ratios
    if args.async_rollout and args.partial_rollouts and not given_on_command_line("max_staleness"):
        args.max_staleness = 2  # in-flight updates: 1 would leave no response to continue in a later phase


def check_rollout_args(args, num_trainers: int) -> None:
    """One line for rollout flags that cannot work together (before any model is loaded)."""
    check_ranges(args, positive=["temperature", "top_p", "reward_timeout", "rollout_gpu_memory", "env_timeout"],
                 at_least_one=["prompts_per_step", "max_response_len", "max_prompt_len", "reward_workers",
                               "rollout_tp", "max_staleness", "max_turns", "max_turn_len"],
                 non_negative=["rollout_ranks"])
    if args.top_p > 1:
        raise ValueError(f"--top-p must be at most 1, got {args.top_p}")
    if args.rollout_sleep_level not in (None, 0, 1, 2):
        raise ValueError(f"--rollout-sleep-level must be 0, 1 or 2, got {args.rollout_sleep_level}")
    if args.prompts_per_step % num_trainers:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must be divisible by the {num_trainers} "
                         f"training ranks")
    generating = args.rollout_ranks or num_trainers
    if generating % args.rollout_tp:
        raise ValueError(f"--rollout-tp {args.rollout_tp} must divide the number of generating ranks ({generating})")
    if args.rollout_ranks and args.prompts_per_step % args.rollout_ranks:
        raise ValueError(f"--prompts-per-step {args.prompts_per_step} must be divisible by --rollout-ranks "
                         f"{args.rollout_ranks}")
    if args.async_rollout and not args.rollout_ranks:
        raise ValueError("--async-rollout needs --rollout-ranks K: ranks that generate while the others train")
    if args.partial_rollouts and not hasattr(args, "tis_cap"):
        raise ValueError("--partial-rollouts trains responses sampled by older weights, which needs a loss with "
                         "importance weights: grpo.py or ppo.py")
    if args.partial_rollouts:
        not_yet = [flag for flag, on in [("--env / --tools", wants_episodes(args)),
                                         ("--rollout-tp above 1", args.rollout_tp > 1),
                                         ("--routing-replay", getattr(args, "routing_replay", False))] if on]
        if not_yet:
            raise ValueError(f"--partial-rollouts works colocated or with --rollout-ranks, one rollout replica per "
                             f"rank, single-turn: not yet with {', '.join(not_yet)}")
    if args.check_weight_sync and args.rollout_ranks:
        raise ValueError("--check-weight-sync compares a colocated engine's weights with the trainer's on the same "
                         "rank; with --rollout-ranks no rank holds both (check a colocated run of the same model)")
    if args.rollout_engine == "vllm" and args.model is not None:  # a MoE family vLLM's experts cannot take, or
        config = model_config(args.model)  # keys too narrow for vLLM's cache write at this --rollout-tp
        check_moe_mapped(config, args.model)
        check_kv_width(config, args.rollout_tp)
    if args.reward_fn is not None:  # (resolve_defaults sets it) a bad reward spec fails now, before any model loads
        load_reward_fn(args.reward_fn)
    if wants_episodes(args):  # a bad --env / --tools too, and a machine where the python tool has no sandbox
        load_env_factory(args.env, args.tools, args.reward_fn)
        if args.tools and needs_sandbox(args.tools):
            check_sandbox()




def sequences_at_once(args, world: int, num_eval: int) -> int:
    """The most sequences one vLLM replica holds at once (what its KV cache is sized for by default): its ranks'
    prompts of a step times --group-size (with --partial-rollouts: of 1 + --max-staleness steps), or their share of
    the held-out prompts (one greedy response each)."""
    steps = 1 + args.max_staleness if getattr(args, "partial_rollouts", False) else 1
    return args.rollout_tp * max(args.prompts_per_step // world * args.group_size * steps, -(-num_eval // world))


def wants_episodes(args) -> bool:
    """Multi-turn episodes (--env or --tools) instead of one response per prompt."""
    return args.env is not None or args.tools is not None



def wants_rollout_logprobs(args, step: int) -> bool:
    """Whether step's rollout asks the engine for the sampled tokens' log-probs: every step with --tis-cap (the
    loss needs them), else every --logprob-diff-every steps from the first, for the rollout/logprob_diff metric
    (scripts without that flag never do). They are not free: vLLM's per-token bookkeeping of them is about a quarter
    of a small model's rollout time."""
    every = getattr(args, "logprob_diff_every", 0)  # (--partial-rollouts sets --tis-cap)
    return getattr(args, "tis_cap", None) is not None or (every > 0 and (step - 1) % every == 0)
