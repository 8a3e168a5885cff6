"""Generation, rewards and held-out evaluation, on whichever ranks generate (colocated trainers or split
placement's rollout ranks): one batch of responses or episodes, scored as each prompt's group completes."""

from common.rollout.args import wants_rollout_logprobs
from common.rollout.engines import NonFiniteLogits
from common.rollout.episodes import MultiTurn, episode_sample
from common.rollout.rewards import RewardScorer
from common.run.distributed import all_reduce_sum, raise_on_all_ranks


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
    seed, logprobs = args.seed * 1_000_003 + step, wants_rollout_logprobs(args, step)  # the step's sampling
    try:
        if multi_turn is not None:
            return multi_turn.sample(engine, prompts, seed, logprobs)
        return generate_and_score(engine, scorer, tokenizer, prompts, n=args.group_size,
                                  max_tokens=args.max_response_len, temperature=args.temperature, top_p=args.top_p,
                                  seed=seed, logprobs=logprobs)
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
