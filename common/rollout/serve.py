"""Split placement's rollout ranks (--rollout-ranks K): their whole run is `serve_rollouts`, a loop that takes the
trainers' weights, generates and scores a batch, and sends it to trainer 0 (common/rollout/split.py has the link and
the weight-version schedule; common/rollout/rollouts.py the trainers' side)."""

import collections
import os
import time

import torch

from common.data.prompts import PromptSampler
from common.rollout.args import sequences_at_once, wants_episodes
from common.rollout.engines import make_rollout_engine
from common.rollout.episodes import MultiTurn
from common.rollout.generate import evaluate, sample_batch, scored_samples
from common.rollout.partial import GroupsInFlight, append_busy
from common.rollout.rewards import RewardScorer
from common.rollout.split import (STOP, behaviour_version, close_link, eval_versions, generation_lag, in_flight_updates,
                                  load_into_module, next_header, recv_header, recv_weights, send_object, weight_versions)
from common.run.distributed import finish_distributed
from common.run.logger import StageTimer
from common.run.signals import install_stop_handlers, stop_agreed, stop_requested
from common.train.model import compute_dtype, decoder_layers, load_model, meta_model, save_model_config, stop_token_ids
from common.train.moe import install_router_hooks
from sharding.vllm_sync import weight_shapes

LOOK_EVERY_S = 0.005  # in-flight updates: how often a generating rollout rank asks the store for a new version


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
    in_flight, staleness = in_flight_updates(args), generation_lag(args)
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
        dtype, load = engine.dtype, engine.vllm_model.load_weights

        def loaded():  # cached prompt KV was computed with the old weights (no request runs here: it cannot fail)
            if not engine.llm.reset_prefix_cache():
                raise RuntimeError("vLLM kept its prefix cache after a weight update (a request was still running)")
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
    # --partial-rollouts: groups kept across steps here (responses in flight when the run stopped are not saved: a
    # resumed run admits its prompts from the data position of its step again)
    groups = GroupsInFlight(args, sampler.prompts_per_rank, placement.rank, start_step) \
        if args.partial_rollouts else None
    versions = weight_versions(start_step, args.steps, staleness, args.eval_every, in_flight)
    to_evaluate = set(eval_versions(start_step, args.steps, args.eval_every))
    held, evals, timer, pending = None, {}, StageTimer(device, args.hang_timeout, output_dir), collections.deque()
    stopped = False  # the trainers' STOP came while generating (in-flight)
    pending.append(send_object(placement.samples_link, shapes, 0))  # trainer 0 checks them against its own

    def receive_through(version: int, evaluating: bool = True) -> bool:
        """Receives every scheduled version up to `version`, evaluating those due. False: STOP came instead."""
        nonlocal held
        if stopped:
            return False
        while versions and versions[0] <= version:
            with timer("weights_wait", waits_for_peers=True):  # the trainers' step, or their STOP
                received = recv_header(placement, device)
            if received == STOP:
                return False
            assert received == versions.pop(0), f"weight version {received} arrived out of schedule"
            with timer("sync"):
                recv_weights(placement, shapes, dtype, args.sync_bucket_mb, device, load)
                loaded()
            held = received
            if held in to_evaluate and evaluating:
                with timer("eval"):
                    evals[held] = evaluate(engine, eval_rows, scorer, multi_turn, tokenizer, args, placement.rank,
                                           placement.world, device)
        return True

    class InFlightWeights:
        """GroupsInFlight.next_batch's view of the versions the trainers send while a phase generates."""
        looked, seen = 0.0, False  # when the store was last asked (at most every LOOK_EVERY_S), what it said

        @property
        def version(self) -> int:
            return held

        @property
        def stopped(self) -> bool:
            return stopped

        def waiting(self) -> bool:
            """Trainer 0 is sending a version (not one to evaluate: that waits for the phase's end) or STOP."""
            if self.seen or stopped or time.monotonic() - self.looked < LOOK_EVERY_S:
                return self.seen
            self.looked = time.monotonic()
            header = next_header(placement)
            self.seen = header is not None and (header == STOP or header not in to_evaluate)
            return self.seen

        def load(self) -> int:
            nonlocal stopped
            stopped, self.looked, self.seen = not receive_through(versions[0]), 0.0, False
            return held

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
        phase = {}
        if groups is not None:  # a phase that ends once it holds the step's groups
            with timer("generate"):
                samples, phase, reward_timeouts = groups.next_batch(engine, scorer, tokenizer, sampler, step, device,
                                                                    InFlightWeights() if in_flight else None)
            if placement.rank == 0 and not stopped:
                append_busy(os.path.join(output_dir, "rollout_busy.jsonl"), step, *groups.busy)
        else:
            prompts = sampler.next_batch()
            with timer("generate"):
                outputs = sample_batch(engine, scorer, multi_turn, tokenizer, prompts, args, step)
            with timer("reward"):  # what scoring adds after generation
                samples, reward_timeouts = scored_samples(prompts, outputs, scorer, multi_turn, version=held)
        if in_flight and step - 1 in to_evaluate:  # evaluated before its batch is sent, as synchronously (the
            stopped = not receive_through(step - 1)  # trainers need the batch only once they have made that version)
        if stopped:  # the trainers stopped (and saved) while this batch generated: they drop it
            send({"step": step, "samples": [], "reward_timeouts": 0})
            finished = False
            break
        stop = stop_agreed(device)  # collective over the rollout ranks: a signal here makes this batch the last
        send({"step": step, "samples": samples, "reward_timeouts": reward_timeouts, "metrics": phase,
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
