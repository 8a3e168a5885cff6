import collections

from common.data.synthetic import NUMBERS_PER_PROMPT, make_synthetic_rows, synthetic_reward
from common.train.tiny_model import NUM_VALUES


def prompt_numbers(prompt):
    return [int(word) for word in prompt.split()[1:-1]]


def test_splits_are_disjoint_deterministic_and_cover_every_triple():
    train, test = make_synthetic_rows("train"), make_synthetic_rows("test")
    assert make_synthetic_rows("train") == train and make_synthetic_rows("test") == test
    assert make_synthetic_rows("test", seed=1) != test
    train_prompts, test_prompts = {row["prompt"] for row in train}, {row["prompt"] for row in test}
    assert len(train_prompts) == len(train) and len(test_prompts) == len(test)
    assert len(train_prompts | test_prompts) == NUM_VALUES**NUMBERS_PER_PROMPT  # every ordered triple, each in one split
    # No test prompt is a reordering of a training prompt.
    number_sets = lambda rows: {tuple(sorted(prompt_numbers(row["prompt"]))) for row in rows}
    assert not number_sets(train) & number_sets(test)


def test_answers_are_the_largest_number_and_chance_is_low():
    test = make_synthetic_rows("test")
    for row in make_synthetic_rows("train")[:100] + test:
        assert row["answer"] == str(max(prompt_numbers(row["prompt"])))
    most_common_answer_count = collections.Counter(row["answer"] for row in test).most_common(1)[0][1]
    assert most_common_answer_count / len(test) < 0.2  # always guessing one number stays below 0.2


def test_reward_reads_the_first_number():
    assert synthetic_reward("max 7 13 2 =", "13", "13") == 1.0
    assert synthetic_reward("max 7 13 2 =", "= 13 7", "13") == 1.0  # words before the first number are ignored
    assert synthetic_reward("max 7 13 2 =", "7 13", "13") == 0.0  # only the first number counts
    assert synthetic_reward("max 7 13 2 =", "130", "13") == 0.0
    assert synthetic_reward("max 7 13 2 =", "max = =", "13") == 0.0
    assert synthetic_reward("max 7 13 2 =", "", "13") == 0.0
