"""Where a script's samples come from, whatever the placement: one object on the training ranks, one function on
the rollout ranks.

`Rollouts` (training ranks) hands out this rank's share of each step's samples: per prompt, `--group-size`
responses with the rollout engine's log-probs, their rewards (scored by `--reward-workers` processes as soon as a
prompt's group is complete), whether they ended at a stop token, and the weight version that generated them.
- Colocated (default): every rank generates its share with its own engine. A vLLM engine sleeps while the
  trainer runs; before it generates (or evaluates) it wakes and takes the policy's latest weights, once per update.
  The HF engine generates with the policy itself.
- Split (`--rollout-ranks K`): the last K ranks run `serve_rollouts` and generate the whole batch, one step ahead
  with `--async-rollout`; trainer 0 receives it and every trainer keeps its slice. `publish` streams the new
  weights to them after each update they need (common/rollout/split.py has the link and the version schedule).
Held-out greedy evaluation goes through it too: colocated, `evaluate` runs it on the spot; split, the rollout ranks
evaluate the versions due and the results reach the log with a later batch, tagged `eval/version`.

A script's loop: `samples, metrics = rollouts.next_batch(step)`, then advantages, losses and the update (the
algorithm, in the script), then `rollouts.publish(step, stop)` and `rollouts.evaluate(step)`.
"""

import collections
import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from common.data.prompts import PromptSampler, load_train_eval, tokenize_prompts
from common.rollout.engines import NonFiniteLogits, make_rollout_engine, resolve_engine_kind
from common.rollout.environments import load_env_factory
from common.rollout.episodes import MultiTurn, episode_sample
from common.rollout.rewards import RewardScorer, load_reward_fn
from common.rollout.split import (STOP, behaviour_version, check_shapes, close_link, eval_versions, load_into_module,
                          recv_header, recv_object, recv_weights, send_header, send_object, send_weights,
                          staleness_metrics, stop_rollout_ranks, weight_versions)
from common.rollout.tools import check_sandbox, needs_sandbox
from common.rollout.vllm_engine import check_kv_width
from common.run.distributed import (all_reduce_sum, decided_by_rank0, finish_distributed, max_over_ranks,
                                raise_on_all_ranks)
from common.run.errors import check_ranges
from common.run.logger import StageTimer
from common.run.perf import memory_in_use
from common.run.signals import install_stop_handlers, request_stop, stop_agreed, stop_requested
from common.train.logprobs import model_token_mask, use_packed_attention
from common.train.model import (compute_dtype, decoder_layers, load_model, meta_model, model_config,
                                pick_precision, save_model_config, stop_token_ids)
from common.train.moe import install_router_hooks
from sharding.vllm_moe import check_moe_mapped
from sharding.vllm_sync import trainer_weights, weight_shapes


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
    and PPO correct it with --tis-cap)"""
    max_staleness: int = 1
    """with --async-rollout: how many updates behind the trainer the weights that generated a batch may be"""
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


def default_response_len(args) -> int:
    """--max-response-len unset: 2 tokens for the built-in task (one number, then anything), 6 for its multi-turn
    version (lookup, the hidden number, the answer, with room for a second lookup), else 1024."""
    if args.dataset is None:
        return 6 if args.env == "lookup" else 2
    return 1024


def fill_rollout_defaults(args) -> None:
    """The rollout flags left unset: the engine (vLLM where CUDA and vllm are), 2 reward processes per rank with
    vLLM and 1 with HF generate (which returns every response at once), TIS capped at 2 with async rollouts, one
    token per turn for --env lookup, and --precision auto (common/train/model.py's pick_precision)."""
    args.rollout_engine = resolve_engine_kind(args.rollout_engine)
    if args.env == "lookup" and args.max_turn_len is None:
        args.max_turn_len = 1
    args.precision = pick_precision(args.precision, args.model)
    if args.reward_workers is None:
        args.reward_workers = 2 if args.rollout_engine == "vllm" else 1
    if args.async_rollout and getattr(args, "tis_cap", 0) is None:  # scripts whose loss uses importance ratios
        args.tis_cap = 2.0


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


def load_prompts(args, tokenizer) -> tuple[list[dict], list[dict], list[str]]:
    """Collective. (train rows, held-out rows, notes to print): the prompts of --dataset with the answers the
    reward checks, tokenized as the model will see them; a reward that cannot score the data's own answers stops
    the run here, in one line."""
    train_rows, eval_rows = load_train_eval(args.dataset, args.prompt_key, args.answer_key, args.dataset_config,
                                            eval_split=args.eval_split, eval_size=args.eval_size, seed=args.seed,
                                            eval_dataset=args.eval_dataset,
                                            eval_dataset_config=args.eval_dataset_config,
                                            eval_dataset_split=args.eval_dataset_split)
    check_reward_fits(args, eval_rows)
    formats = (args.max_prompt_len, args.chat_template, args.prompt_template, args.system_prompt)
    train_rows, dropped = tokenize_prompts(train_rows, tokenizer, *formats)
    eval_rows, eval_dropped = tokenize_prompts(eval_rows, tokenizer, *formats)
    return train_rows, eval_rows, [
        f"{len(train_rows)} train / {len(eval_rows)} eval prompts; dropped {dropped} / {eval_dropped} longer than "
        f"--max-prompt-len {args.max_prompt_len}",
        f"the first prompt, as the model sees it: {tokenizer.decode(train_rows[0]['prompt_ids'])[:400]!r}"]


def check_reward_fits(args, rows: list[dict], sample: int = 64) -> None:
    """Collective over the launch: the reward must score the data's own gold answers, given as completions, as
    nearly all correct (at least 90% of the first `sample` held-out rows); a reward that does not fit the data
    (the GSM8K reward on MATH solutions, say) stops the run with one line naming the built-in reward that fits."""
    if args.skip_reward_check or args.reward_fn == "none":
        return

    def decide():
        rows_ = rows[:sample]
        if (scored := gold_answers_scored(args.reward_fn, rows_, args.reward_timeout)) >= 0.9 * len(rows_):
            return None
        others = {}
        for spec in ("gsm8k", "math", "synthetic"):
            if spec != args.reward_fn:
                try:
                    others[spec] = gold_answers_scored(spec, rows_, args.reward_timeout)
                except Exception:  # noqa: BLE001 - a reward that cannot even read the data does not fit it
                    others[spec] = 0
        best = max(others, key=others.get)
        hint = (f"; --reward-fn {best} scores {others[best]}" if others[best] >= 0.9 * len(rows_) else
                "; no built-in reward does either")
        raise ValueError(f"--reward-fn {args.reward_fn} scores {scored} of {len(rows_)} held-out gold answers as "
                         f"correct, where a reward that fits the data scores nearly all{hint} (--skip-reward-check: "
                         f"for rewards whose gold answers are not completions)")

    decided_by_rank0("reward_check", decide)


def gold_answers_scored(spec: str, rows: list[dict], timeout_s: float | None) -> int:
    """How many rows' answers the reward `spec` scores above 0 when given them as the completion."""
    scorer = RewardScorer(spec, timeout_s, workers=1)
    try:
        scorer.submit(0, [r["prompt"] for r in rows], [r["answer"] for r in rows], [r["answer"] for r in rows])
        return sum(reward > 0 for reward in scorer.collect()[0][0])
    finally:
        scorer.close()


def sequences_at_once(args, world: int, num_eval: int) -> int:
    """The most sequences one vLLM replica holds at once (what its KV cache is sized for by default): its ranks'
    prompts of a step times --group-size, or their share of the held-out prompts (one greedy response each)."""
    return args.rollout_tp * max(args.prompts_per_step // world * args.group_size, -(-num_eval // world))


class Rollouts:
    """On every training rank. `args` holds the rollout flags every script shares (see grpo.Args)."""

    def __init__(self, args, placement, policy, tokenizer, train_rows: list[dict], eval_rows: list[dict], device,
                 output_dir: str, start_step: int, logger, timer):
        self.args, self.placement, self.policy, self.tokenizer = args, placement, policy, tokenizer
        self.eval_rows, self.device, self.start_step, self.logger, self.timer = eval_rows, device, start_step, logger, timer
        self.first_eval = self.last_eval = None  # held-out results before training and of the newest version
        self.rollout_memory = 0  # bytes in use on this GPU while the engine generated (colocated vLLM)
        # In split placement the rollout ranks draw the prompts; here the sampler only keeps the data position
        # that checkpoints save (batches are a function of the step, so both sides agree).
        self.sampler = PromptSampler(train_rows, args.prompts_per_step // placement.world, placement.rank,
                                     placement.world, args.seed)
        self.engine = self.scorer = self.multi_turn = None
        if placement.split:
            logger.print(f"split placement: {placement.num_trainers} training ranks, {placement.num_rollout} rollout "
                         f"ranks" + (f", async (max staleness {args.max_staleness})"
                                     if args.async_rollout else ", synchronous"))
            self.staleness = args.max_staleness if args.async_rollout else 0
            self.versions_to_send = set(weight_versions(start_step, args.steps, self.staleness, args.eval_every))
            self.link_dtype = compute_dtype(args.precision) if args.rollout_engine == "vllm" else torch.float32
        else:
            self.staleness = 0
            self.scorer = RewardScorer(args.reward_fn, args.reward_timeout, args.reward_workers)
            self.multi_turn = MultiTurn(args, tokenizer) if wants_episodes(args) else None
            model_dir = os.path.join(output_dir, "model_config")  # architecture only: vLLM starts with dummy weights
            if placement.rank == 0:
                save_model_config(args.model, tokenizer, model_dir)
            dist.barrier()
            lora = None  # --lora-sync adapter: the adapters through vLLM's LoRA layers, each rank's directory its own
            if args.lora_rank and args.lora_sync == "adapter":
                lora = {"rank": args.lora_rank, "targets": sorted(policy.peft_config["default"].target_modules),
                        "dir": os.path.join(output_dir, "vllm_adapters", f"rank{placement.rank}")}
            self.engine = make_rollout_engine(
                args.rollout_engine, policy, model_dir, tokenizer, stop_token_ids(args.model, tokenizer),
                placement.rank, args.rollout_tp, args.rollout_gpu_memory, args.max_prompt_len + args.max_response_len,
                args.seed, args.rollout_eager, args.sync_bucket_mb, args.rollout_sleep_level,
                compute_dtype(args.precision), sequences_at_once(args, placement.world, len(eval_rows)), lora,
                record_routes=getattr(args, "routing_replay", False))
            if getattr(self.engine, "llm", None) is not None:
                memory = f"{self.engine.kv_cache_gib:.1f} GiB of KV cache" if self.engine.kv_cache_gib else \
                    f"{args.rollout_gpu_memory:.0%} of the GPU"
                logger.print(f"vLLM: {memory}, sleep level {self.engine.sleep_level}")
            self._sleep()  # until the first rollout: loading a training state needs the memory
            install_stop_handlers()  # again: the engine may have set handlers of its own
        use_packed_attention(policy, device)  # training runs on packed rows
        self.arrived_evals = {}  # split: evaluations received from the rollout ranks, not logged yet
        self.synced_version = -1  # the policy version the colocated engine holds
        self.version = start_step  # the policy's version: updates made
        self.stopping = False  # the run stops before its last step (a stop signal)

    @staticmethod
    def serve(args, placement, tokenizer, train_rows: list[dict], eval_rows: list[dict], device, output_dir: str,
              start_step: int) -> None:
        """Split placement's rollout ranks, instead of training: generate and score for the trainers, to the end."""
        serve_rollouts(args, placement, tokenizer, train_rows, eval_rows, device, output_dir, start_step)

    # -----------------------------------------------------------------------------------------------------------
    # What the loop calls.

    def start(self) -> dict[str, float]:
        """Once, after a training state (if any) was loaded: a fresh colocated run evaluates its initial weights
        (returned, for the log's step 0); in split placement the rollout ranks get the weights they start from."""
        if not self.placement.split:
            return {} if self.start_step else self.evaluate(0, due=True)
        if self.start_step < self.args.steps:
            # The rollout ranks start their engines meanwhile, however long that takes (not watched for hangs): every
            # trainer waits here, not in the first sync's collectives.
            with self.timer("rollout_start", waits_for_peers=True):
                if self.placement.on_link:
                    shapes = weight_shapes(self.policy)
                    for r in range(self.placement.num_rollout):
                        check_shapes(shapes, recv_object(self.placement.samples_link, 1 + r), r)
                dist.barrier()
            self._push_weights(self.start_step)
        return {}

    def next_batch(self, step: int) -> tuple[list[dict], dict[str, float]]:
        """Collective: this rank's samples for `step` (prompt-major: each prompt's group_size responses in a row),
        each {"prompt_ids", "response_ids", "logprobs", "finished", "reward", "version"}, and metrics already
        summed over ranks (reward time-outs, staleness, the split side's timings)."""
        if self.placement.split:
            return self._receive_batch(step)
        metrics = self._sync()
        prompts = self.sampler.next_batch()
        with self.timer("rollout"):  # rewards are scored meanwhile, each group as soon as it is complete
            outputs = sample_batch(self.engine, self.scorer, self.multi_turn, self.tokenizer, prompts, self.args, step)
        if self.device.type == "cuda":
            self.rollout_memory = memory_in_use(self.device)
        self._sleep()
        with self.timer("reward"):  # what scoring adds after generation; a failure anywhere stops every rank
            samples, timeouts = scored_samples(prompts, outputs, self.scorer, self.multi_turn, version=step - 1)
        metrics["reward/timeouts"] = all_reduce_sum([timeouts], self.device)[0]
        return samples, {**metrics, **episode_metrics(samples, self.device)}

    def publish(self, step: int, stop: bool = False) -> dict[str, float]:
        """After the update of `step`: the policy is now version `step`. Colocated, the engine takes it before it
        next generates or evaluates; split, it is streamed to the rollout ranks if a later batch or evaluation
        needs it (not when stopping before the last step: the state is saved, and close() tells the rollout ranks),
        and the evaluations that arrived with this step's batch (the last step: the last ones) are returned for the
        step's row."""
        self.version = step
        self.stopping = stop and step < self.args.steps
        metrics = {}
        if self.placement.split and not self.stopping and step in self.versions_to_send:
            metrics.update(self._push_weights(step))
        if self.placement.split and step == self.args.steps:
            self.arrived_evals.update(self._receive(None)["evals"])
            close_link(self.placement)
        return {**metrics, **self._eval_metrics(step)}

    def evaluate(self, step: int, due: bool | None = None) -> dict[str, float]:
        """Colocated: greedy accuracy on the held-out prompts, when due (every --eval-every steps and the last).
        Split: nothing here, the rollout ranks evaluate (see next_batch)."""
        due = due if due is not None else self.args.eval_every and step % self.args.eval_every == 0 \
            or step == self.args.steps
        if self.placement.split or not due:
            return {}
        self._sync()  # its metrics are the rollout's: the step already logs its own sync
        with self.timer("eval"):
            result = evaluate(self.engine, self.eval_rows, self.scorer, self.multi_turn, self.tokenizer, self.args,
                              self.placement.rank, self.placement.world, self.device)
        self._sleep()
        self.first_eval = self.first_eval or result
        self.last_eval = result
        return result

    def close(self) -> None:
        """At the end of the run, after the last save. Split placement, stopped early: the rollout ranks stop too."""
        if self.placement.split and self.stopping:
            stop_rollout_ranks(self.placement, self.device)
        if self.scorer is not None:
            self.scorer.close()
        if self.multi_turn is not None:
            self.multi_turn.close()
        if self.engine is not None:
            self.engine.close()

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the data position and the evaluations so far."""
        return {"sampler": self.sampler.state_dict(), "first_eval": self.first_eval, "last_eval": self.last_eval}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.first_eval, self.last_eval = state["first_eval"], state["last_eval"]

    # -----------------------------------------------------------------------------------------------------------
    # Colocated.

    def _sleep(self) -> None:
        """Frees the engine's memory for training. A vLLM engine at sleep level 2 drops its weights, so the next
        rollout or evaluation loads the policy again, even one it held before (after an evaluation)."""
        with self.timer("sleep"):  # vLLM: KV cache unmapped; weights kept (level 0), parked in CPU memory (1) or dropped
            self.engine.sleep()
        if getattr(self.engine, "sleep_level", 1) == 2:
            self.synced_version = -1

    def _sync(self) -> dict[str, float]:
        """Brings the engine to the policy's version (once per version, unless it dropped its weights since)."""
        if self.synced_version == self.version:
            return {}
        with self.timer("sync"):
            metrics = self.engine.update_weights(self.policy)
        if self.args.check_weight_sync:
            with self.timer("check_sync"):
                self.engine.check_weights(self.policy)
        self.synced_version = self.version
        return metrics

    # -----------------------------------------------------------------------------------------------------------
    # Split placement, trainer side.

    def _push_weights(self, version: int) -> dict[str, float]:
        send_header(self.placement, version, self.device)
        with self.timer("sync"):  # includes waiting for the rollout ranks to take it (when they are still generating)
            num_bytes = send_weights(self.placement, trainer_weights(self.policy, None, self.link_dtype),
                                     self.link_dtype, self.args.sync_bucket_mb, self.device)
        return {"sync/gb": num_bytes / 1e9} if self.placement.on_link else {}

    def _receive(self, step: int | None) -> dict:
        """Trainer 0 takes one message from every rollout rank; every trainer keeps its slice of the samples.
        step None: the last message, with the evaluations of the last versions."""
        placement = self.placement
        box = [[recv_object(placement.samples_link, 1 + r) for r in range(placement.num_rollout)]
               if placement.on_link else None]
        dist.broadcast_object_list(box, src=0)
        messages = box[0]
        assert all(m["step"] == step for m in messages), f"expected step {step}, got {[m['step'] for m in messages]}"
        if any(m.get("stop") for m in messages):  # this batch is the rollout ranks' last: train it, save and stop
            request_stop(next(m["stop"] for m in messages if m.get("stop")))
        samples = [s for m in messages for s in m["samples"]]
        per_rank = len(samples) // placement.world
        return {"samples": samples[placement.rank * per_rank:(placement.rank + 1) * per_rank],
                "evals": messages[0]["evals"],
                "seconds": {k: max(m["seconds"].get(k, 0.0) for m in messages) for k in messages[0]["seconds"]},
                "reward_timeouts": float(sum(m["reward_timeouts"] for m in messages))}

    def _receive_batch(self, step: int) -> tuple[list[dict], dict[str, float]]:
        self.sampler.next_batch()  # the data position only
        with self.timer("rollout_wait", waits_for_peers=True):
            batch = self._receive(step)
        samples = batch["samples"]
        metrics = {f"time/rollout_{k}": v for k, v in batch["seconds"].items()}
        metrics["reward/timeouts"] = batch["reward_timeouts"]
        metrics.update(episode_metrics(samples, self.device))
        self.arrived_evals.update(batch["evals"])  # reported by publish
        # How many updates old the weights that generated this batch were.
        lag = staleness_metrics([s["version"] for s in samples], step - 1, self.staleness)
        total, count = all_reduce_sum([lag["staleness_sum"], len(samples)], self.device)
        metrics.update({"rollout/staleness_mean": total / max(count, 1),
                        "rollout/staleness_max": max_over_ranks(lag["staleness_max"], self.device)})
        return samples, metrics

    def _eval_metrics(self, step: int) -> dict[str, float]:
        """The evaluations that arrived from the rollout ranks during this step, with their versions: the newest for
        the step's row, any earlier one logged in a row of its own."""
        evals = sorted(self.arrived_evals.items())
        self.arrived_evals = {}
        for version, result in evals[:-1]:
            self.logger.log(step, {**result, "eval/version": version}, advance=False)
        for version, result in evals:
            self.first_eval = result if version == 0 else self.first_eval
            self.last_eval = result
        return {**evals[-1][1], "eval/version": evals[-1][0]} if evals else {}


def wants_episodes(args) -> bool:
    """Multi-turn episodes (--env or --tools) instead of one response per prompt."""
    return args.env is not None or args.tools is not None


def episode_metrics(samples: list[dict], device) -> dict[str, float]:
    """Collective: per episode, over every rank's samples (multi-turn only): turns, tool calls, tool errors,
    seconds spent in the environment, and how many environment calls ran past --env-timeout."""
    if "turns" not in (samples[0] if samples else {}):
        return {}
    names = ["turns", "tool_calls", "tool_errors", "env_seconds", "env_timeout"]
    *sums, count = all_reduce_sum([sum(float(s[n]) for s in samples) for n in names] + [len(samples)], device)
    metrics = {f"episode/{n}_mean": total / max(count, 1) for n, total in zip(names[:3], sums)}
    metrics.update({"episode/env_timeouts": sums[4], "time/env_per_episode": sums[3] / max(count, 1)})
    return metrics


def wants_rollout_logprobs(args, step: int) -> bool:
    """Whether step's rollout asks the engine for the sampled tokens' log-probs: every step with --tis-cap (the
    loss needs them), else every --logprob-diff-every steps from the first, for the rollout/logprob_diff metric
    (scripts without that flag never do). They are not free: vLLM's per-token bookkeeping of them is about a quarter
    of a small model's rollout time."""
    every = getattr(args, "logprob_diff_every", 0)
    return getattr(args, "tis_cap", None) is not None or (every > 0 and (step - 1) % every == 0)


def mismatch_metrics(samples: list[dict], cap: float) -> dict:
    """How far the rollout engine's log-probs ("logprobs") are from the trainer's ("old_logprobs"), summed over one
    rank's samples that carry them (not every step asks for them: wants_rollout_logprobs): the absolute difference
    and the token count (rollout/logprob_diff), and the truncated importance weights min(p_old / p_behaviour, cap)
    that correct for the engine's numerical mismatch and older weights: the weight sum, how many tokens were
    capped, and the largest uncapped ratio. Observation tokens of episodes are not the model's: left out."""
    measured = [s for s in samples if s["logprobs"] is not None]
    if not measured:
        return {"lp_diff": 0.0, "lp_tokens": 0, "tis_weight_sum": 0.0, "tis_capped": 0.0, "tis_ratio_max": 0.0}
    generated = torch.cat([torch.as_tensor(model_token_mask(s), dtype=torch.bool) for s in measured])
    diff = (torch.cat([s["old_logprobs"] for s in measured]) - torch.cat(
        [torch.as_tensor(s["logprobs"], dtype=torch.float32) for s in measured]))[generated]  # the model's tokens
    ratio = diff.exp()
    return {"lp_diff": diff.abs().sum().item(), "lp_tokens": diff.numel(),
            "tis_weight_sum": ratio.clamp(max=cap).sum().item(), "tis_capped": (ratio > cap).sum().item(),
            "tis_ratio_max": ratio.max().item()}


def rollout_mismatch_metrics(samples: list[dict], tis_cap: float | None, device) -> dict[str, float]:
    """Collective: mismatch_metrics over every rank's samples, as logged: rollout/logprob_diff (where measured) and,
    with a TIS cap, the mean truncated importance weight, the share of capped tokens and the largest ratio."""
    mismatch = mismatch_metrics(samples, tis_cap or 1.0)
    sums = all_reduce_sum([mismatch["lp_diff"], mismatch["lp_tokens"], mismatch["tis_weight_sum"],
                           mismatch["tis_capped"]], device)
    diff, tokens, weight, capped = sums
    metrics = {"rollout/logprob_diff": diff / tokens} if tokens else {}
    if tis_cap is not None and tokens:
        metrics.update({"tis/weight_mean": weight / tokens, "tis/capped_frac": capped / tokens,
                        "tis/ratio_max": max_over_ranks(mismatch["tis_ratio_max"], device)})
    return metrics


# ---------------------------------------------------------------------------------------------------------------
# Generation, rewards and evaluation, on whichever ranks generate.

def generate_and_score(engine, scorer: RewardScorer, tokenizer, rows: list[dict], **sampling) -> list[list]:
    """engine.generate on the rows' prompts; each prompt's group goes to the scorer as soon as it is complete, so
    its scoring overlaps the generation of the others (collect_rewards gets the results)."""
    def score(i: int, completions: list) -> None:
        texts = [tokenizer.decode(c.response_ids, skip_special_tokens=True) for c in completions]
        scorer.submit(i, [rows[i]["prompt"]] * len(texts), texts, [rows[i]["answer"]] * len(texts))

    return engine.generate([r["prompt_ids"] for r in rows], on_finish=score, **sampling)


def sample_batch(engine, scorer: RewardScorer, multi_turn: MultiTurn | None, tokenizer, prompts: list[dict], args,
                 step: int) -> list[list]:
    """generate_and_score for the batch of `step`: --group-size responses per prompt, sampled (with --env /
    --tools: --group-size episodes per prompt, common/rollout/episodes.py)."""
    try:
        if multi_turn is not None:
            return multi_turn.sample(engine, prompts, args.seed * 1_000_003 + step, wants_rollout_logprobs(args, step))
        return generate_and_score(engine, scorer, tokenizer, prompts, n=args.group_size,
                                  max_tokens=args.max_response_len, temperature=args.temperature, top_p=args.top_p,
                                  seed=args.seed * 1_000_003 + step, logprobs=wants_rollout_logprobs(args, step))
    except NonFiniteLogits as e:
        cause = "the initial weights are broken" if step == 1 else \
            f"the updates so far broke them: a learning rate too high (--lr {args.lr:g}) is the likely cause"
        raise NonFiniteLogits(f"step {step}: {e}; {cause}") from None


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


def scored_samples(prompts: list[dict], outputs, scorer: RewardScorer, multi_turn: MultiTurn | None,
                   version: int) -> tuple[list[dict], int]:
    """Collective (rewards): one dict per response, prompt-major, with its reward and the weight version that
    generated it; and the number of reward calls that timed out. Episodes come scored by their environments."""
    if multi_turn is not None:
        return [episode_sample(episode, version) for group in outputs for episode in group], 0
    rewards, timeouts = collect_rewards(scorer)
    samples = [dict(prompt_ids=p["prompt_ids"], response_ids=c.response_ids, logprobs=c.logprobs, finished=c.finished,
                    reward=r, version=version, **({} if c.routes is None else {"routes": c.routes}))
               for p, group, group_rewards in zip(prompts, outputs, rewards) for c, r in zip(group, group_rewards)]
    return samples, timeouts


def evaluate(engine, eval_rows, scorer, multi_turn, tokenizer, args, rank: int, world: int, device) -> dict[str, float]:
    """Greedy pass@1 and mean reward on the held-out prompts (or episodes), split evenly over ranks."""
    per_rank = -(-len(eval_rows) // world)
    mine = eval_rows[rank * per_rank:(rank + 1) * per_rank]
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine = mine + [eval_rows[0]] * (per_rank - len(mine))  # every rank generates the same number of prompts
    if multi_turn is not None:
        rewards = multi_turn.greedy_rewards(engine, mine)
    else:
        generate_and_score(engine, scorer, tokenizer, mine, n=1, max_tokens=args.max_response_len, temperature=1.0,
                           top_p=1.0, seed=0, greedy=True, logprobs=False)
        rewards = [group[0] for group in collect_rewards(scorer)[0]]
    total, reward_sum, correct = all_reduce_sum(
        [sum(weights), sum(w * r for w, r in zip(weights, rewards)), sum(w * (r > 0) for w, r in zip(weights, rewards))],
        device)
    return {"eval/accuracy": correct / total, "eval/reward": reward_sum / total}


# ---------------------------------------------------------------------------------------------------------------
# Split placement, rollout side.

def serve_rollouts(args, placement, tokenizer, train_rows: list[dict], eval_rows: list[dict], device, output_dir: str,
                   start_step: int) -> None:
    """On a rollout rank (--rollout-ranks), for the whole run: receive weights, generate, score, send; repeat.

    The trainers send the versions of `weight_versions`, and this side receives each one just before the first
    batch that needs it (so with --async-rollout it generates with weights up to --max-staleness updates old),
    evaluates the versions due for evaluation, and sends each batch to trainer 0 without waiting for it to arrive:
    up to max(1, staleness) batches may be on their way while this side waits for the next version.
    The last message carries the evaluations of the last versions; the trainers save after it. A stop signal (here
    or on the trainers) ends the run early without losing an update (common/rollout/split.py). Ends the process.
    """
    staleness = args.max_staleness if args.async_rollout else 0
    if start_step >= args.steps:  # resumed at the end: the trainers have nothing to send either
        return finish_distributed(exit_process=True)
    scorer = RewardScorer(args.reward_fn, args.reward_timeout, args.reward_workers)
    multi_turn = MultiTurn(args, tokenizer) if wants_episodes(args) else None
    model_dir = save_model_config(args.model, tokenizer, os.path.join(output_dir, f"model_config_rollout{placement.rank}"))
    stop_ids = stop_token_ids(args.model, tokenizer)
    if args.rollout_engine == "vllm":
        engine = make_rollout_engine("vllm", None, model_dir, tokenizer, stop_ids, placement.rank, args.rollout_tp,
                                     args.rollout_gpu_memory, args.max_prompt_len + args.max_response_len, args.seed,
                                     args.rollout_eager, args.sync_bucket_mb, dtype=compute_dtype(args.precision),
                                     max_sequences=sequences_at_once(args, placement.world, len(eval_rows)),
                                     record_routes=getattr(args, "routing_replay", False))
        shapes = weight_shapes(meta_model(model_dir))
        dtype, load, loaded = engine.dtype, engine.vllm_model.load_weights, engine.llm.reset_prefix_cache
    else:
        # The HF engine's own model (not sharded: every rollout rank reads it), overwritten by the first version received
        model = load_model(args.model, tokenizer, args.seed, every_rank=True).to(device)
        install_router_hooks(model, decoder_layers(model))  # MoE: --routing-replay records the routes (else a no-op)
        engine = make_rollout_engine("hf", model, model_dir, tokenizer, stop_ids, placement.rank, args.rollout_tp,
                                     0.0, 0, args.seed, False, 0, record_routes=getattr(args, "routing_replay", False))
        shapes, dtype, load, loaded = weight_shapes(model), torch.float32, load_into_module(model), lambda: None
    install_stop_handlers()  # after the engine, which may set handlers of its own
    sampler = PromptSampler(train_rows, args.prompts_per_step // placement.world, placement.rank, placement.world,
                            args.seed)
    for _ in range(start_step):  # the trainers' data position: batches are a function of the step
        sampler.next_batch()
    versions = weight_versions(start_step, args.steps, staleness, args.eval_every)
    to_evaluate = set(eval_versions(start_step, args.steps, args.eval_every))
    held, evals, timer, pending = None, {}, StageTimer(device, args.hang_timeout, output_dir), collections.deque()
    pending.append(send_object(placement.samples_link, shapes, 0))  # trainer 0 checks them against its own

    def receive_through(version: int, evaluating: bool = True) -> bool:
        """Receives every scheduled version up to `version`, evaluating those due. False: STOP came instead."""
        nonlocal held
        while versions and versions[0] <= version:
            with timer("weights_wait", waits_for_peers=True):  # the trainers' step, or their STOP
                received = recv_header(placement, device)
            if received == STOP:
                return False
            assert received == versions.pop(0), f"weight version {received} arrived out of schedule"
            with timer("sync"):
                recv_weights(placement, shapes, dtype, args.sync_bucket_mb, device, load)
                loaded()  # vLLM: cached prompt KV was computed with the old weights
            held = received
            if held in to_evaluate and evaluating:
                with timer("eval"):
                    evals[held] = evaluate(engine, eval_rows, scorer, multi_turn, tokenizer, args, placement.rank,
                                           placement.world, device)
        return True

    def send(message: dict) -> None:
        # A send completes once trainer 0 receives it, and trainer 0 takes batch k only after it has sent the
        # version that batch k + staleness is generated with: so up to `staleness` batches stay in flight.
        while len(pending) >= max(1, staleness):
            pending.popleft().wait()
        message.update(evals=dict(evals), seconds={k.removeprefix("time/"): v for k, v in timer.pop().items()})
        evals.clear()
        pending.append(send_object(placement.samples_link, message, 0))

    finished = True  # False: the run stopped early, and the trainers said STOP
    for step in range(start_step + 1, args.steps + 1):
        timer.start_step(step)
        if not receive_through(behaviour_version(step, start_step, staleness)):
            finished = False
            break
        prompts = sampler.next_batch()
        with timer("generate"):
            outputs = sample_batch(engine, scorer, multi_turn, tokenizer, prompts, args, step)
        with timer("reward"):  # what scoring adds after generation
            samples, reward_timeouts = scored_samples(prompts, outputs, scorer, multi_turn, version=held)
        stop = stop_agreed(device)  # collective over the rollout ranks: a signal here makes this batch the last
        send({"step": step, "samples": samples, "reward_timeouts": reward_timeouts,
              "stop": stop and (stop_requested() or "a stop signal on another rollout rank")})
        if stop and step < args.steps:  # the trainers train it, save, stop and say STOP
            finished = receive_through(args.steps, evaluating=False)
            break
    if finished:  # the last versions (evaluation only), unless the trainers stopped in the meantime
        finished = receive_through(args.steps)
    if finished:
        send({"step": None, "samples": [], "reward_timeouts": 0})
    else:  # the trainers take every message up to this one
        send({"step": "stopped", "samples": [], "reward_timeouts": 0})
    while pending:
        pending.popleft().wait()
    close_link(placement)
    scorer.close()
    if multi_turn is not None:
        multi_turn.close()
    finish_distributed(exit_process=True)
