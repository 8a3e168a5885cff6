"""Before training: the reward must fit the data, scoring the data's own gold answers (given as completions) as
nearly all correct; one that does not (the GSM8K reward on MATH solutions, say) stops the run in one line naming
the built-in reward that fits."""

from common.rollout.rewards import RewardScorer
from common.run.distributed import decided_by_rank0


def check_reward_fits(args, rows: list[dict] | None, sample: int = 64) -> None:
    """Collective over the launch: the reward must score the data's own gold answers, given as completions, as
    nearly all correct (at least 90% of the first `sample` held-out rows); a reward that does not fit the data
    (the GSM8K reward on MATH solutions, say) stops the run with one line naming the built-in reward that fits.
    rows None (dpo.py's offline pairs, which have no answers): nothing to check."""
    if rows is None or args.skip_reward_check or args.reward_fn == "none":
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
