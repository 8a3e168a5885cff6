"""Partial rollouts (--partial-rollouts): a rollout phase ends once it holds the step's groups, not when its longest
response ends.

Each rank keeps the groups it has started (`GroupsInFlight`). A phase (one per step, after the weight sync):
1. admits new prompts, a batch of --prompts-per-step / ranks at a time, while every group in flight can still be
   trained within --max-staleness updates of its admission (AReaL's rule: a group admitted at step a must be
   trained by step a + max_staleness, its deadline; a step trains one batch, so at most 1 + max_staleness batches
   are in flight, and none that the run's last step would not train). The bound is kept at admission: finished
   work is never thrown away for being old;
2. generates every unfinished response (a new one from its prompt, a cut one from its prompt and its tokens so far,
   re-prefilled under the new weights: the engine's prefix cache was emptied with its sleep), and ends as soon as
   it holds a batch of complete groups such that every later step can still train the groups due by then (no more
   than k batches due within the next k steps: a young group that finished first must not leave two old ones due
   at once); the responses still running are cut and kept, with their tokens, the engine's log-probs and the
   weight version of every token;
3. trains the oldest complete groups. A group's rewards are scored when its last response ends.

A group enters training only when all of its members are finished. Its members may span weight versions: every
token keeps its own version and its own engine log-prob, so the importance weight of each token (--tis-cap and
--off-policy-correction in the scripts) is taken against the policy that actually sampled it, and the group's
advantages weigh its members alike, as in a synchronous step. With --max-staleness 0 a phase admits exactly one
batch and must finish it: a synchronous step, from the same prompts.
"""

import json
from dataclasses import dataclass, field

from common.rollout.completion import Completion, Request
from common.rollout.generate import collect_rewards
from common.rollout.vllm_engine import request_seed
from common.run.distributed import all_reduce_sum, max_over_ranks

LOW_BUSY = 0.1  # a phase's time with fewer than this share of its requests still running counts as mostly idle


@dataclass
class Response:
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's, token by token
    versions: list[list[int]] = field(default_factory=list)  # [[weight version, tokens it generated], ...] in order
    finished: bool = False  # ended at a stop token
    done: bool = False  # ended: a stop token or the length limit


@dataclass
class Group:
    key: int  # admission order on this rank
    row: dict  # the prompt
    admitted: int  # the first step that trains with the weights that admitted it (synchronously: the step whose phase
    # admitted it; with in-flight updates that version + 1): trained by admitted + max_staleness at the latest
    responses: list[Response]
    rewards: list[float] | None = None

    @property
    def complete(self) -> bool:
        return all(r.done for r in self.responses)


def append_busy(path: str, step: int, busy: list[tuple[float, int]], requests: int, points: int = 200) -> None:
    """Adds one rollout's trace to path (rollout_busy.jsonl in the run directory; scripts/plot_busy.py draws it):
    [seconds, requests still running] after each engine step, at most `points` of them, evenly spaced."""
    every = max(1, -(-len(busy) // points))
    kept = busy[::every] + ([busy[-1]] if busy and (len(busy) - 1) % every else [])
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "requests": requests, "busy": [[round(t, 4), n] for t, n in kept]}) + "\n")


def low_busy_seconds(busy: list[tuple[float, int]], requests: int) -> tuple[float, float]:
    """(seconds with fewer than LOW_BUSY of the `requests` still running, seconds in all) of a generation whose
    engine steps ended at busy[i][0] seconds with busy[i][1] requests still running."""
    ends = [0.0] + [t for t, _ in busy]
    low = sum(t1 - t0 for t0, t1, (_, n) in zip(ends, ends[1:], busy) if n < LOW_BUSY * requests)
    return low, ends[-1]


class GroupsInFlight:
    """One rank's groups across phases, and the phase that advances them (see the module's docstring)."""

    def __init__(self, args, prompts_per_rank: int, rank: int, start_step: int = 0):
        self.args, self.prompts_per_rank, self.rank, self.start_step = args, prompts_per_rank, rank, start_step
        self.groups: list[Group] = []  # in admission order, which is deadline order
        self.next_key = 0
        self.dropped = 0  # responses saved in flight that a resume could not continue
        self.busy = ([], 0)  # the last phase's [(seconds, requests running)] and its requests

    def deadline(self, group: Group) -> int:
        return group.admitted + self.args.max_staleness

    def admit(self, sampler, step: int, version: int, device) -> None:
        """Collective (every rank draws the same batches: the sampler's position is global): new batches while every
        group in flight can be trained by the deadline of one admitted now under weights `version` (version + 1 +
        --max-staleness: synchronously step + max_staleness, so 1 + max_staleness batches), and no more than the
        steps left to the run will train."""
        first = version + 1  # the first step that trains with this version's weights
        room = min(first + self.args.max_staleness - step + 1, self.args.steps - step + 1) * self.prompts_per_rank
        while max_over_ranks(len(self.groups), device) + self.prompts_per_rank <= room:
            for row in sampler.next_batch():
                self.groups.append(Group(self.next_key, row, first, [Response() for _ in range(self.args.group_size)]))
                self.next_key += 1

    def batch(self) -> list[Group]:
        """This step's groups: the oldest complete ones."""
        return [g for g in self.groups if g.complete][:self.prompts_per_rank]

    def trainable(self, deadlines: list[int], step: int) -> bool:
        """Whether groups of these deadlines (ascending), left after the batch of `step`, can each be trained by its
        deadline, one batch a step: the i-th (0-based) needs (deadline - step) batches to hold at least i + 1."""
        return all(i + 1 <= (d - step) * self.prompts_per_rank for i, d in enumerate(deadlines))

    def phase_over(self, step: int) -> bool:
        batch = {g.key for g in self.batch()}
        return len(batch) == self.prompts_per_rank and \
            self.trainable([self.deadline(g) for g in self.groups if g.key not in batch], step)

    def next_batch(self, engine, scorer, tokenizer, sampler, step: int, device,
                   weights=None) -> tuple[list[dict], dict, int]:
        """Collective (admission, rewards, metrics): one phase; this rank's batch of samples for `step`, prompt-major,
        the phase's metrics, and this rank's reward calls that timed out. The engine holds version step - 1, or with
        `weights` (in-flight updates, split placement: an `InFlightWeights` of common/rollout/serve.py) the version
        weights.version, and loads each newer one the trainers announce between engine steps: the running responses
        are cut there and continued under the new weights (re-prefilled: no KV of older weights mixes in)."""
        args = self.args
        version = step - 1 if weights is None else weights.version
        self.admit(sampler, step, version, device)
        by_key, scored, busy, loads = {g.key: g for g in self.groups}, [], [], 0

        def add(key, completion: Completion, done: bool) -> None:
            group, response = by_key[key[0]], by_key[key[0]].responses[key[1]]
            response.response_ids += completion.response_ids
            response.logprobs += completion.logprobs  # asked for below
            if completion.response_ids and response.versions and response.versions[-1][0] == version:
                response.versions[-1][1] += len(completion.response_ids)
            elif completion.response_ids:
                response.versions.append([version, len(completion.response_ids)])
            response.finished, response.done = completion.finished, done
            if done and group.complete:  # scored while the others generate
                texts = [tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in group.responses]
                scorer.submit(group.key, [group.row["prompt"]] * len(texts), texts, [group.row["answer"]] * len(texts))
                scored.append(group.key)

        requests = self.requests()
        counted, continued = len(requests), sum(r.position > 0 for r in requests)
        while True:
            # Every rank calls it, even with nothing to generate: the HF engine's FSDP forward passes are collective.
            started = busy[-1][0] if busy else 0.0
            cut, part_busy = engine.generate_until(
                requests, args.temperature, args.top_p, on_finish=lambda key, c: add(key, c, done=True),
                stop=lambda: self.phase_over(step) or (weights is not None and weights.waiting()), logprobs=True)
            for key, completion in cut.items():
                add(key, completion, done=False)
            busy += [(started + t, n) for t, n in part_busy]
            if weights is None or not max_over_ranks(float(weights.waiting()), device):
                break  # (in-flight: no rank cut its generation for new weights, so every rank's phase is over)
            version, loads = weights.load(), loads + 1  # every rank, one version (the trainers broadcast it)
            if weights.stopped:  # the trainers stopped (their state saved): they take no batch, so none is made
                return [], {}, 0
            requests = [] if self.phase_over(step) else self.requests()
        rewards, timeouts = collect_rewards(scorer)  # every rank: by key, as scored
        for key, group_rewards in zip(sorted(scored), rewards):
            by_key[key].rewards = group_rewards
        batch = self.batch()  # the oldest complete groups; the phase ended once the rest can wait (or all ended)
        assert self.phase_over(step), "the groups in flight cannot all be trained in time (a bookkeeping bug)"
        self.groups = [g for g in self.groups if g.key not in {b.key for b in batch}]
        samples = [dict(prompt_ids=g.row["prompt_ids"], response_ids=r.response_ids, logprobs=r.logprobs,
                        finished=r.finished, reward=reward, version=r.versions[0][0] if r.versions else version,
                        versions=r.versions)
                   for g in batch for r, reward in zip(g.responses, g.rewards)]
        self.busy = (busy, counted)  # the phase's trace, for rollout_busy.jsonl
        metrics = self.metrics(samples, step - 1, counted, continued, busy, device)
        if weights is not None:
            metrics["rollout/weight_loads"] = loads
        return samples, metrics, timeouts

    def requests(self) -> list[Request]:
        """A request for every unfinished response: a new one from its prompt, a cut one from its prompt and its
        tokens so far, with what is left of its budget."""
        args = self.args
        return [Request((g.key, i), g.row["prompt_ids"] + r.response_ids, args.max_response_len - len(r.response_ids),
                        seed=request_seed(args.seed, self.rank, f"{g.key}/{i}"), position=len(r.response_ids))
                for g in self.groups for i, r in enumerate(g.responses) if not r.done]

    def metrics(self, samples: list[dict], trainer_version: int, requests: int, continued: int, busy, device) -> dict:
        """Collective: how old the trained samples and tokens are (updates behind the trainer; a sample's age is its
        first token's), the share of responses whose tokens span weight versions, of this phase's requests that
        continued a response, and of its time spent with fewer than LOW_BUSY of its requests running."""
        s = self.args.max_staleness
        sample_ages = [trainer_version - x["version"] for x in samples]
        if max(sample_ages, default=0) > s or min(sample_ages, default=0) < 0:
            raise RuntimeError(f"samples {sorted(set(sample_ages))} updates old reached the trainer: the admission "
                               f"rule keeps them within --max-staleness {s} (a bookkeeping bug)")
        token_ages = [0.0] * (s + 1)
        for x in samples:
            for v, n in x["versions"]:
                token_ages[trainer_version - v] += n
        sums = all_reduce_sum([len(samples), sum(sample_ages), sum(len(x["versions"]) > 1 for x in samples),
                               requests, continued, len(self.groups), *low_busy_seconds(busy, requests), *token_ages],
                              device)
        count, age_sum, spanning, requested, continued_sum, in_flight, low_sum, seconds, *tokens = sums
        trained = max(sum(tokens), 1)
        return {"rollout/sample_age_mean": age_sum / max(count, 1),
                "rollout/sample_age_max": max_over_ranks(max(sample_ages, default=0), device),
                "rollout/token_age_mean": sum(age * n for age, n in enumerate(tokens)) / trained,
                **{f"rollout/token_age_{age}_frac": n / trained for age, n in enumerate(tokens)},
                "rollout/continued_frac": spanning / max(count, 1),
                "rollout/requests_continued_frac": continued_sum / max(requested, 1),
                "perf/rollout_low_busy_frac": low_sum / seconds if seconds else 0.0,  # a timing: no two runs share it
                "rollout/groups_in_flight": in_flight}

    def rank_state_dict(self) -> dict:
        """This rank's groups, their responses so far included (a file per rank in the training state)."""
        return {"groups": [dict(key=g.key, row=g.row, admitted=g.admitted, rewards=g.rewards,
                                responses=[vars(r) for r in g.responses]) for g in self.groups],
                "next_key": self.next_key}

    def load_rank_state_dict(self, state: dict | None, saved: list[dict]) -> None:
        """state: this rank's saved groups; None when the run resumed on another number of ranks, whose prompts are
        shared out differently: then the responses every rank kept (`saved`) are dropped and counted in `dropped`
        (their prompts are not admitted again). So are the groups a --max-staleness lower than the saved run's no
        longer allows to be trained."""
        if state is None:
            self.dropped = sum(len(g["responses"]) for s in saved for g in s["groups"])
            return
        groups = [Group(g["key"], g["row"], g["admitted"], [Response(**r) for r in g["responses"]], g["rewards"])
                  for g in state["groups"]]
        for g in groups:  # oldest first: kept while every kept group can still be trained by its deadline
            if self.deadline(g) > self.start_step and \
                    self.trainable([self.deadline(k) for k in self.groups + [g]], self.start_step):
                self.groups.append(g)
            else:
                self.dropped += len(g.responses)
        self.next_key = state["next_key"]
