"""The built-in task: name the largest of three numbers, small enough that GRPO learns it from random weights on a CPU.

A prompt reads "max 7 13 2 =" and its answer is "13". The tokenizer (the built-in tiny model's,
common/train/tiny_model.py) is word-level with one token per number 0..NUM_VALUES-1, so every answer is a single token
and a random policy already hits it about once in NUM_VALUES tries (always answering the same number scores about
0.1): the reward is dense enough for GRPO to start from a randomly initialised model, with no pretraining.
Reward rule: 1.0 when the first number in the completion equals the answer, else 0.0. Whatever follows that number
is ignored, so the model need not learn to stop before it can be rewarded.
The test split holds number triples that never appear in training in any order, so held-out accuracy measures a
learned comparison, not recall of training prompts.

The multi-turn version (`--env lookup`, `LookupEnv`): the largest of the three numbers is hidden ("max 7 ? 2 ="). A
turn that is not a number (the word "lookup", say: one token) is a lookup call and gets the hidden number back; a
turn that is a number ends the episode, scored as above. Without the lookup a model can only guess (about 1 in 30).
"""

import itertools
import random
import re

from common.train.tiny_model import NUM_VALUES  # numbers 0..NUM_VALUES-1, each one token of the tiny model's

NUMBERS_PER_PROMPT = 3
TEST_FRACTION = 0.1  # of the distinct number sets; all orderings of a set land in the same split


def make_synthetic_rows(split: str, seed: int = 0) -> list[dict]:
    """Rows {"prompt", "answer"} of one split, in a shuffled order; the same seed always gives the same rows."""
    assert split in ("train", "test"), split
    number_sets = list(itertools.combinations_with_replacement(range(NUM_VALUES), NUMBERS_PER_PROMPT))
    rng = random.Random(seed)
    rng.shuffle(number_sets)
    num_test_sets = int(len(number_sets) * TEST_FRACTION)
    chosen_sets = number_sets[:num_test_sets] if split == "test" else number_sets[num_test_sets:]
    triples = sorted({order for numbers in chosen_sets for order in itertools.permutations(numbers)})
    rng.shuffle(triples)
    return [{"prompt": "max " + " ".join(map(str, triple)) + " =", "answer": str(max(triple))} for triple in triples]


def synthetic_reward(prompt: str, completion: str, answer: str) -> float:
    # The prompt is unused; it is in the signature that every reward function shares.
    first_number = re.search(r"-?\d+", completion)
    return float(first_number is not None and first_number.group() == answer)


def make_synthetic_pairs(split: str, seed: int = 0) -> list[dict]:
    """Preference pairs of the built-in task: {"prompt", "chosen": the right answer, "rejected": a wrong number,
    "answer"}, one per row of the split, the wrong number drawn with `seed`."""
    rng = random.Random(seed + 1)
    pairs = []
    for row in make_synthetic_rows(split, seed):
        wrong = rng.choice([n for n in range(NUM_VALUES) if str(n) != row["answer"]])
        pairs.append({"prompt": row["prompt"], "chosen": row["answer"], "rejected": str(wrong),
                      "answer": row["answer"]})
    return pairs


class LookupEnv:
    """The built-in multi-turn task (--env lookup; the protocol: common/rollout/environments.py): "max 7 ? 2 =", where the
    hidden number is always the largest, so the answer is what a lookup returns. A turn that is not a number (the
    word "lookup", say) is the lookup call and gets the hidden number back; a turn that is a number is the answer,
    scored as the single-turn task is."""

    def __init__(self, row: dict):
        numbers = row["prompt"].split()[1:-1]
        hidden = max(range(len(numbers)), key=lambda i: int(numbers[i]))
        self.value, self.answer = numbers[hidden], row["answer"]
        self.prompt = " ".join(["max"] + ["?" if i == hidden else n for i, n in enumerate(numbers)] + ["="])

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        if not re.match(r"\s*-?\d", reply):  # not an answer: a lookup
            return [{"role": "tool", "content": self.value}], 0.0, False
        return [], synthetic_reward(self.prompt, reply, self.answer), True
