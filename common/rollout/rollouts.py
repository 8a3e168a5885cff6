"""Where a script's samples come from, on the training ranks: one object whose class is the placement.

`make_rollouts` returns a `ColocatedRollouts` or a `SplitRollouts`; both hand out this rank's share of each step's
samples: per prompt, `--group-size` responses with the rollout engine's log-probs, their rewards (scored by
`--reward-workers` processes as soon as a prompt's group is complete), whether they ended at a stop token, and the
weight version that generated them.
- Colocated (default): every rank generates its share with its own engine. A vLLM engine sleeps while the
  trainer runs; before it generates (or evaluates) it wakes and takes the policy's latest weights, once per update.
  The HF engine generates with the policy itself.
- Split (`--rollout-ranks K`): the last K ranks run `serve_rollouts` (common/rollout/serve.py) and generate the
  whole batch, one step ahead with `--async-rollout`; trainer 0 receives it and every trainer keeps its slice.
  `publish` streams the new weights to them after each update they need (common/rollout/split.py has the link and
  the version schedule). The rollout ranks evaluate the versions due, and the results reach the log with a later
  batch, tagged `eval/version`.

A script's loop: `samples, metrics = rollouts.next_batch(step)`, then advantages, losses and the update (the
algorithm, in the script), then `rollouts.publish(step, stop)` and `rollouts.evaluate(step)`.
"""

import os

import torch
import torch.distributed as dist

from common.data.prompts import PromptSampler
from common.rollout.args import sequences_at_once, wants_episodes
from common.rollout.engines import make_rollout_engine
from common.rollout.episodes import MultiTurn
from common.rollout.generate import episode_metrics, evaluate, sample_batch, scored_samples
from common.rollout.partial import GroupsInFlight, append_busy, low_busy_seconds
from common.rollout.rewards import RewardScorer
from common.rollout.split import (check_shapes, close_link, generation_lag, in_flight_updates, recv_object,
                                  send_header, send_weights, staleness_metrics, stop_rollout_ranks, weight_versions)
from common.run.distributed import all_reduce_sum, max_over_ranks
from common.run.perf import memory_in_use
from common.run.signals import install_stop_handlers, request_stop
from common.train.logprobs import use_packed_attention
from common.train.model import compute_dtype, save_model_config, stop_token_ids
from sharding.vllm_sync import trainer_weights, weight_shapes


def make_rollouts(args, placement, policy, tokenizer, train_rows: list[dict], eval_rows: list[dict], device,
                  output_dir: str, start_step: int, logger, timer) -> "Rollouts":
    """The training ranks' rollouts for this placement. `args` holds the rollout flags every script shares
    (common/rollout/args.py)."""
    placed = SplitRollouts if placement.split else ColocatedRollouts
    return placed(args, placement, policy, tokenizer, train_rows, eval_rows, device, output_dir, start_step, logger,
                  timer)


class Rollouts:
    """What the scripts' loops call, the same for both placements. Here: the data position (which checkpoints save),
    the held-out results so far, and the policy's version."""

    def __init__(self, args, placement, policy, tokenizer, train_rows: list[dict], eval_rows: list[dict], device,
                 output_dir: str, start_step: int, logger, timer):
        self.args, self.placement, self.policy, self.tokenizer = args, placement, policy, tokenizer
        self.eval_rows, self.device, self.start_step, self.logger, self.timer = eval_rows, device, start_step, logger, timer
        self.first_eval = self.last_eval = None  # held-out results before training and of the newest version
        self.rollout_memory = 0  # bytes in use on this GPU while the engine generated (colocated vLLM)
        # In split placement the rollout ranks draw the prompts; there the sampler only keeps the data position
        # that checkpoints save (batches are a function of the step, so both sides agree).
        self.sampler = PromptSampler(train_rows, args.prompts_per_step // placement.world, placement.rank,
                                     placement.world, args.seed)
        self.version = start_step  # the policy's version: updates made
        self.in_flight = None  # --partial-rollouts, colocated: this rank's groups kept across steps (partial.py)
        self.busy_path = os.path.join(output_dir, "rollout_busy.jsonl")  # rank 0's rollouts, engine step by step
        use_packed_attention(policy, device)  # training runs on packed rows

    def start(self) -> dict[str, float]:
        """Once, after a training state (if any) was loaded; a fresh colocated run returns its initial evaluation."""
        return {}

    def next_batch(self, step: int) -> tuple[list[dict], dict[str, float]]:
        """Collective: this rank's samples for `step` (prompt-major: each prompt's group_size responses in a row),
        each {"prompt_ids", "response_ids", "logprobs", "finished", "reward", "version"}, and metrics already
        summed over ranks (reward time-outs, episodes, the split side's staleness and timings)."""
        raise NotImplementedError

    def publish(self, step: int, stop: bool = False) -> dict[str, float]:
        """After the update of `step`: the policy is now version `step`, for the engine to take before it next
        generates. Returns metrics of the step's row (split: the sync and the evaluations that arrived)."""
        self.version = step
        return {}

    def evaluate(self, step: int, due: bool | None = None) -> dict[str, float]:
        """Greedy accuracy on the held-out prompts, when due (every --eval-every steps and the last); split
        placement's rollout ranks evaluate on their own (see publish)."""
        return {}

    def close(self) -> None:
        """At the end of the run, after the last save."""

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the data position and the evaluations so far."""
        return {"sampler": self.sampler.state_dict(), "first_eval": self.first_eval, "last_eval": self.last_eval}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.first_eval, self.last_eval = state["first_eval"], state["last_eval"]

    def rank_state_dict(self) -> dict | None:
        """What this rank alone holds, saved in a file of its own: the groups in flight (--partial-rollouts)."""
        return self.in_flight.rank_state_dict() if self.in_flight else None

    def load_rank_state_dict(self, state: dict | None, saved: list[dict]) -> None:
        if self.in_flight:  # (the rollout ranks of split placement hold theirs: not saved)
            self.in_flight.load_rank_state_dict(state, saved)


class ColocatedRollouts(Rollouts):
    """Every training rank generates its share with its own engine, woken for each rollout and evaluation."""

    def __init__(self, args, placement, policy, tokenizer, train_rows, eval_rows, device, output_dir, start_step,
                 logger, timer):
        super().__init__(args, placement, policy, tokenizer, train_rows, eval_rows, device, output_dir, start_step,
                         logger, timer)
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
        self.synced_version = -1  # the policy version the engine holds
        self.in_flight = GroupsInFlight(args, self.sampler.prompts_per_rank, placement.rank, start_step) \
            if args.partial_rollouts else None
        self._sleep()  # until the first rollout: loading a training state needs the memory
        install_stop_handlers()  # again: the engine may have set handlers of its own

    def start(self) -> dict[str, float]:
        return {} if self.start_step else self.evaluate(0, due=True)

    def next_batch(self, step: int) -> tuple[list[dict], dict[str, float]]:
        metrics = self._sync()
        if self.in_flight is not None:  # a phase that ends once it holds the step's groups
            with self.timer("rollout"):
                samples, phase, timeouts = self.in_flight.next_batch(self.engine, self.scorer, self.tokenizer,
                                                                     self.sampler, step, self.device)
            self._after_rollout()
            if self.placement.rank == 0:
                append_busy(self.busy_path, step, *self.in_flight.busy)
            return samples, {**metrics, **phase, "reward/timeouts": all_reduce_sum([timeouts], self.device)[0]}
        prompts = self.sampler.next_batch()
        with self.timer("rollout"):  # rewards are scored meanwhile, each group as soon as it is complete
            outputs = sample_batch(self.engine, self.scorer, self.multi_turn, self.tokenizer, prompts, self.args, step)
        if getattr(self.engine, "busy", None) and self.multi_turn is None:  # vLLM: the time its tail held the GPU
            low, seconds = low_busy_seconds(self.engine.busy, len(prompts) * self.args.group_size)
            metrics["perf/rollout_low_busy_frac"] = low / seconds if seconds else 0.0
            if self.placement.rank == 0:
                append_busy(self.busy_path, step, self.engine.busy, len(prompts) * self.args.group_size)
        self._after_rollout()
        with self.timer("reward"):  # what scoring adds after generation; a failure anywhere stops every rank
            samples, timeouts = scored_samples(prompts, outputs, self.scorer, self.multi_turn, version=step - 1)
        metrics["reward/timeouts"] = all_reduce_sum([timeouts], self.device)[0]
        return samples, {**metrics, **episode_metrics(samples, self.device)}

    def evaluate(self, step: int, due: bool | None = None) -> dict[str, float]:
        due = due if due is not None else self.args.eval_every and step % self.args.eval_every == 0 \
            or step == self.args.steps
        if not due:
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
        self.scorer.close()
        if self.multi_turn is not None:
            self.multi_turn.close()
        self.engine.close()

    def _after_rollout(self) -> None:
        if self.device.type == "cuda":
            self.rollout_memory = memory_in_use(self.device)
        self._sleep()

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


class SplitRollouts(Rollouts):
    """The trainers' side of split placement: trainer 0 receives each batch from the rollout ranks and every trainer
    keeps its slice; after an update, the new weights are streamed to them if a later batch or evaluation needs
    them."""

    def __init__(self, args, placement, policy, tokenizer, train_rows, eval_rows, device, output_dir, start_step,
                 logger, timer):
        super().__init__(args, placement, policy, tokenizer, train_rows, eval_rows, device, output_dir, start_step,
                         logger, timer)
        in_flight = in_flight_updates(args)
        logger.print(f"split placement: {placement.num_trainers} training ranks, {placement.num_rollout} rollout "
                     f"ranks" + (", in-flight weight updates" if in_flight else
                                 f", async (max staleness {args.max_staleness})" if args.async_rollout
                                 else ", synchronous"))
        self.versions_to_send = set(weight_versions(start_step, args.steps, generation_lag(args), args.eval_every,
                                                    in_flight))
        # How old a trained sample's first token may be: with --partial-rollouts its group waits up to --max-staleness
        self.max_lag = args.max_staleness if args.async_rollout or args.partial_rollouts else 0
        self.link_dtype = compute_dtype(args.precision) if args.rollout_engine == "vllm" else torch.float32
        self.arrived_evals = {}  # evaluations received from the rollout ranks, not logged yet
        self.stopping = False  # the run stops before its last step (a stop signal)

    def start(self) -> dict[str, float]:
        """The rollout ranks get the weights they start from."""
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
        self.sampler.next_batch()  # the data position only
        with self.timer("rollout_wait", waits_for_peers=True):
            batch = self._receive(step)
        samples = batch["samples"]
        metrics = {f"time/rollout_{k}": v for k, v in batch["seconds"].items()}
        metrics["reward/timeouts"] = batch["reward_timeouts"]
        metrics.update(batch["metrics"])  # --partial-rollouts: the rollout ranks' phase, over all of them
        metrics.update(episode_metrics(samples, self.device))
        self.arrived_evals.update(batch["evals"])  # reported by publish
        # How many updates old the weights that generated this batch were.
        lag = staleness_metrics([s["version"] for s in samples], step - 1, self.max_lag)
        total, count = all_reduce_sum([lag["staleness_sum"], len(samples)], self.device)
        metrics.update({"rollout/staleness_mean": total / max(count, 1),
                        "rollout/staleness_max": max_over_ranks(lag["staleness_max"], self.device)})
        return samples, metrics

    def publish(self, step: int, stop: bool = False) -> dict[str, float]:
        """Streams version `step` to the rollout ranks if a later batch or evaluation needs it (not when stopping
        before the last step: the state is saved, and close() tells the rollout ranks); returns the evaluations
        that arrived with this step's batch (the last step: the last ones)."""
        self.version = step
        self.stopping = stop and step < self.args.steps
        metrics = {}
        if not self.stopping and step in self.versions_to_send:
            metrics.update(self._push_weights(step))
        if step == self.args.steps:
            self.arrived_evals.update(self._receive(None)["evals"])
            close_link(self.placement)
        return {**metrics, **self._eval_metrics(step)}

    def close(self) -> None:
        """Stopped early: the rollout ranks stop too."""
        if self.stopping:
            stop_rollout_ranks(self.placement, self.device)

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
                "evals": messages[0]["evals"], "metrics": messages[0].get("metrics", {}),
                "seconds": {k: max(m["seconds"].get(k, 0.0) for m in messages) for k in messages[0]["seconds"]},
                "reward_timeouts": float(sum(m["reward_timeouts"] for m in messages))}

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
