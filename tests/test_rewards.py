import math
import os
import subprocess
import sys
import threading
import time

import pytest

from common.rollout.reward_fns import gsm8k_reward, last_boxed, load_reward_fn, math_reward
from common.rollout.rewards import RewardError, RewardScorer, checked_reward

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
MATH_SOLUTION = "Half of the marbles are red, so the answer is $\\boxed{\\frac{1}{2}}$."


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("She sold 24 in May, 48 + 24 = 72, so the answer is #### 72", GSM8K_ANSWER, 1.0),
        ("She sold 24 in May, so the answer is #### 71", GSM8K_ANSWER, 0.0),
        ("48 + 24 = 72 clips in total.", GSM8K_ANSWER, 1.0),  # no '####': last number
        ("72 clips? No: 48 + 24 = 73.", GSM8K_ANSWER, 0.0),  # the last number counts, not the first
        ("#### 72\n\nQuestion: Tom has 5 apples.", GSM8K_ANSWER, 1.0),  # text after the answer is ignored
        ("#### 72.0", GSM8K_ANSWER, 1.0),
        ("I am not sure how to solve this.", GSM8K_ANSWER, 0.0),
        ("The total is #### 1234", "So 1000 + 234 = <<1000+234=1234>>1234.\n#### 1,234", 1.0),
        ("The total is $1,234.", "#### 1234", 1.0),
        ("The total is #### 1,235", "#### 1,234", 0.0),
        ("The change is #### -3", "#### -3", 1.0),
        ("#### 72", "72", 1.0),  # a bare reference answer
    ],
)
def test_gsm8k_reward(completion, answer, expected):
    assert gsm8k_reward("How many clips did Natalia sell?", completion, answer) == expected


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("So the probability is \\boxed{0.5}.", MATH_SOLUTION, 1.0),
        ("So the probability is \\boxed{\\frac{2}{4}}.", MATH_SOLUTION, 1.0),
        ("So the probability is $\\boxed{\\frac{1}{2}}$.", MATH_SOLUTION, 1.0),
        ("So the probability is \\boxed{\\frac{1}{3}}.", MATH_SOLUTION, 0.0),
        ("So the probability is one half.", MATH_SOLUTION, 0.0),
        ("First \\boxed{3}, then correcting myself: \\boxed{\\frac{1}{2}}.", MATH_SOLUTION, 1.0),
        ("First \\boxed{\\frac{1}{2}}, then correcting myself: \\boxed{3}.", MATH_SOLUTION, 0.0),
        ("So the probability is \\boxed{\\frac{1}{2", MATH_SOLUTION, 0.0),  # cut off mid-answer
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # a bare reference answer
        ("\\boxed{x^2 + 2x + 1}", "(x+1)^2", 1.0),
        ("\\boxed{x^2 + 1}", "(x+1)^2", 0.0),
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward("What fraction of the marbles are red?", completion, answer) == expected


def test_last_boxed_matches_nested_braces():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{\\sqrt{2}}} c") == "\\frac{1}{\\sqrt{2}}"
    assert last_boxed("no box here") is None


@pytest.mark.parametrize("garbage", ["", "}}}{{\\frac{", "\\boxed{\\frac{", "\\boxed{}}}", "#### ", "\\boxed{\\left(}"])
def test_garbage_scores_zero(garbage):
    assert gsm8k_reward("q", garbage, GSM8K_ANSWER) == 0.0
    assert math_reward("q", garbage, MATH_SOLUTION) == 0.0
    assert math_reward("q", "\\boxed{1}", garbage) == 0.0


def test_rewards_work_off_the_main_thread():
    # math-verify's signal-based timeout raises outside the main thread unless we turn it off there
    results = {}
    thread = threading.Thread(
        target=lambda: results.update(
            gsm8k=gsm8k_reward("q", "#### 72", GSM8K_ANSWER), math=math_reward("q", "\\boxed{0.5}", MATH_SOLUTION)
        )
    )
    thread.start()
    thread.join()
    assert results == {"gsm8k": 1.0, "math": 1.0}


def test_load_builtin_rewards():
    assert load_reward_fn("gsm8k") is gsm8k_reward
    assert load_reward_fn("math") is math_reward


def test_load_reward_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def length_reward(prompt, completion, answer):\n    return len(completion) / 10\n")
    reward_fn = load_reward_fn(f"{path}:length_reward")
    assert reward_fn("p", "12345", "a") == 0.5


@pytest.mark.parametrize(
    "source, function, error, words",
    [
        (None, "f", FileNotFoundError, ["not found"]),
        ("import not_a_real_module\n", "f", ValueError, ["failed to import", "ModuleNotFoundError"]),
        ("def score(p, c, a):\n    return 1.0\nclass Grader:\n    pass\n", "f", ValueError, ["no 'f'", "score", "Grader"]),
        ("THRESHOLD = 0.5\n", "THRESHOLD", ValueError, ["float", "not a function"]),
    ],
)
def test_load_reward_errors(tmp_path, source, function, error, words):
    path = tmp_path / "reward.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(error) as info:
        load_reward_fn(f"{path}:{function}")
    assert str(path) in str(info.value)
    for word in words:
        assert word in str(info.value)


def test_load_reward_import_error_is_chained(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("1 / 0\n")
    with pytest.raises(ValueError, match="failed to import") as info:
        load_reward_fn(f"{path}:f")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_load_reward_lists_only_functions_the_file_defines(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("from math import sqrt\ndef score(p, c, a):\n    return 1.0\n")
    with pytest.raises(ValueError) as info:
        load_reward_fn(f"{path}:f")
    assert "score" in str(info.value) and "sqrt" not in str(info.value)


def test_load_unknown_reward_name_lists_known_ones():
    with pytest.raises(ValueError) as info:
        load_reward_fn("gsm9k")
    for word in ["gsm9k", "gsm8k", "math", "synthetic", "file.py:function_name"]:
        assert word in str(info.value)


@pytest.mark.parametrize("value, expected", [(True, 1.0), (0, 0.0), (0.25, 0.25)])
def test_checked_reward_converts_to_float(value, expected):
    reward = checked_reward(value, "sample 0", "p", "c", "a")
    assert reward == expected and type(reward) is float


@pytest.mark.parametrize("bad", [math.nan, math.inf, None, "1.0", [1.0]])
def test_checked_reward_rejects_non_finite_or_non_number(bad):
    with pytest.raises(RewardError) as info:
        checked_reward(bad, "sample 1 of group 0", "pb", "b", "y")
    assert "sample 1" in str(info.value) and repr(bad) in str(info.value) and "'pb'" in str(info.value)


# A reward file for the scorer tests: 1.0 for "yes"; "slow" sleeps (timeouts); "stuck" loops for good inside one C
# call (no thread or signal handler can interrupt it); "raise", "nan" and "die" fail.
SCORER_REWARD = """import itertools, os, time
def reward(prompt, completion, answer):
    if completion == "slow":
        time.sleep(5)
    if completion == "stuck":
        return float(sum(itertools.repeat(1)))
    if completion == "raise":
        raise KeyError("no such field")
    if completion == "nan":
        return float("nan")
    if completion == "die":
        os._exit(3)
    if completion == "print":
        print("a reward that prints")
    return float(completion == answer) + 0.5 * float(prompt == "bonus")
"""


@pytest.fixture
def scorer_reward(tmp_path):
    (tmp_path / "scorer_reward.py").write_text(SCORER_REWARD)
    return f"{tmp_path / 'scorer_reward.py'}:reward"


def alive(pid: int) -> bool:
    """A zombie has exited; it only waits for a reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("workers", [1, 2])
def test_scorer_orders_groups_by_key_and_counts_timeouts(scorer_reward, workers):
    """Groups arrive in the order they finish; collect returns them by key, with the values worked out by hand:
    'yes' == answer scores 1, the 'bonus' prompt adds 0.5, a call over the time limit scores 0 and is counted."""
    scorer = RewardScorer(scorer_reward, timeout_s=1.0, workers=workers)
    try:
        scorer.submit(2, ["bonus", "bonus"], ["yes", "print"], ["yes", "yes"])
        scorer.submit(0, ["p"], ["slow"], ["yes"])
        scorer.submit(1, ["p", "p", "p"], ["no", "yes", "slow"], ["yes", "yes", "yes"])
        assert scorer.collect() == ([[0.0], [0.0, 1.0, 0.0], [1.5, 0.5]], 2)
        assert scorer.collect() == ([], 0)  # collected groups are gone
        scorer.submit(0, ["p"], ["yes"], ["yes"])  # keys start again after a collect
        with pytest.raises(ValueError, match="group 0 was submitted twice"):
            scorer.submit(0, ["p"], ["yes"], ["yes"])
        assert scorer.collect() == ([[1.0]], 0)
    finally:
        scorer.close()


def test_a_timed_out_call_is_stopped_and_its_process_replaced(scorer_reward):
    """The stuck call runs inside one C function: only killing its process stops it. It scores 0, the process is
    gone right after the time limit, and a fresh one scores the next calls."""
    scorer = RewardScorer(scorer_reward, timeout_s=1.0, workers=1)
    try:
        scorer.submit(0, ["p"], ["yes"], ["yes"])
        assert scorer.collect() == ([[1.0]], 0)
        first = scorer.workers[0].process.pid
        start = time.monotonic()
        scorer.submit(0, ["p", "p"], ["stuck", "yes"], ["yes", "yes"])
        assert scorer.collect() == ([[0.0, 1.0]], 1)
        assert time.monotonic() - start < 30
        assert not alive(first) and scorer.workers[0].process.pid != first
    finally:
        scorer.close()


@pytest.mark.parametrize("completion, words", [("raise", ["sample 1 of group 0", "KeyError", "'p0'"]),
                                               ("nan", ["sample 1 of group 0", "nan", "not a finite number"])])
def test_scorer_raises_the_first_failing_groups_error(scorer_reward, completion, words):
    scorer = RewardScorer(scorer_reward, workers=1)
    try:
        scorer.submit(0, ["p0", "p0"], ["yes", completion], ["yes", "yes"])
        with pytest.raises(RewardError) as info:
            scorer.collect()
        assert all(word in str(info.value) for word in words), str(info.value)
        scorer.submit(0, ["p"], ["yes"], ["yes"])  # a failed collect leaves nothing behind
        assert scorer.collect() == ([[1.0]], 0)
    finally:
        scorer.close()


def test_scorer_reports_a_reward_process_that_died(scorer_reward):
    scorer = RewardScorer(scorer_reward, workers=1)
    try:
        scorer.submit(0, ["p"], ["die"], ["yes"])
        with pytest.raises(RewardError, match="reward process died while scoring sample 0 of group 0"):
            scorer.collect()
    finally:
        scorer.close()


def test_scorer_rejects_a_bad_spec_before_starting_processes(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py"):
        RewardScorer(f"{tmp_path / 'nope.py'}:reward", workers=2)


def test_a_stop_signal_does_not_wait_for_a_stuck_reward(scorer_reward):
    """After SIGTERM or Ctrl-C, a call still running stop_grace_s later is stopped and scores 0 like a time-out
    (counted), the calls queued behind it run as usual, and each later call gets the same grace from its start:
    the step completes and can be saved."""
    from common.run import signals

    scorer = RewardScorer(scorer_reward, timeout_s=None, workers=1, stop_grace_s=2.0)
    try:
        scorer.submit(0, ["p", "p"], ["stuck", "yes"], ["yes", "yes"])  # the second waits behind the stuck one
        signals._received = "SIGTERM"
        outcome = []
        waiter = threading.Thread(target=lambda: outcome.append(scorer.collect()), daemon=True)  # never hangs
        waiter.start()
        waiter.join(timeout=20)
        assert outcome == [([[0.0, 1.0]], 1)]
        stuck = [w.process.pid for w in scorer.workers]
        scorer.submit(1, ["p", "p"], ["yes", "stuck"], ["yes", "yes"])  # later calls: the same grace each
        assert scorer.collect() == ([[1.0, 0.0]], 1)
    finally:
        signals.reset()
        scorer.close()
    assert not any(alive(pid) for pid in stuck)
    scorer = RewardScorer(scorer_reward, timeout_s=None, workers=1, stop_grace_s=2.0)
    try:  # without a stop, the same calls score as they should
        scorer.submit(0, ["p"], ["yes"], ["yes"])
        assert scorer.collect() == ([[1.0]], 0)
    finally:
        scorer.close()


def test_reward_processes_exit_with_their_rank(scorer_reward):
    """A rank killed without closing its scorer (here os._exit, like SIGKILL) leaves no reward process behind, even
    one stuck in a C call; SIGTERM, which Slurm sends to every process of a job, does not stop them while their
    rank lives."""
    script = (f"import os, signal, sys, time\nsys.path.insert(0, {os.getcwd()!r})\n"
              "from common.rollout.rewards import RewardScorer\n"
              f"scorer = RewardScorer({scorer_reward!r}, workers=2)\n"
              "for key in range(2):\n    scorer.submit(key, ['p'], ['yes'], ['yes'])\n"
              "scorer.collect()\npids = [w.process.pid for w in scorer.workers]\n"
              "for pid in pids:\n    os.kill(pid, signal.SIGTERM)\n"
              "scorer.submit(0, ['p'], ['yes'], ['yes'])\nassert scorer.collect() == ([[1.0]], 0)\n"
              "scorer.submit(1, ['p'], ['stuck'], ['yes'])\ntime.sleep(0.5)\n"
              "print(*pids, flush=True)\nos._exit(0)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    pids = [int(pid) for pid in result.stdout.split()]
    assert len(pids) == 2
    deadline = time.time() + 10
    while any(alive(pid) for pid in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)


# Answers that scored wrongly before (each with the right value): GSM8K-style numbers written other ways, and
# MATH-style final answers not in \boxed{}.
@pytest.mark.parametrize("completion, answer, expected", [
    ("#### 1/2", "#### 1/2", 1.0),  # a fraction, read as one number
    ("#### 0.5", "#### 1/2", 1.0),
    ("#### .5", "#### 0.5", 1.0),  # no leading zero
    ("#### \u22123", "#### -3", 1.0),  # a Unicode minus
    ("#### - 3", "#### -3", 1.0),  # the sign set apart
    ("#### 1 000", "#### 1000", 1.0),  # a space between groups of three
    ("#### 2/3", "#### 1/2", 0.0),
    ("It is 5 - 3", "#### 3", 1.0),  # a minus between numbers stays one: the last number is 3
])
def test_gsm8k_numbers_written_other_ways(completion, answer, expected):
    assert gsm8k_reward("q", completion, answer) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("The sum is 72.\n\n# Answer\n\n72", "72", 1.0),  # PRM800K's format
    ("So the answer is 72.", "72", 1.0),  # stated, not boxed
    ("The answer is $\\frac{1}{2}$.", "\\frac12", 1.0),
    ("\\boxed{72.}", "72", 1.0),  # a period inside the box
    ("\\fbox{72}", "72", 1.0),
    ("So the answer is 71.", "72", 0.0),
    ("\\boxed{7}, no: \\fbox{72}", "72", 1.0),  # the last one counts
])
def test_math_final_answers_not_in_boxed(completion, answer, expected):
    assert math_reward("q", completion, answer) == expected


def test_a_reward_that_does_not_fit_the_data_stops_the_run():
    """The data's own gold answers, scored as completions: GSM8K rows fail the math reward (no \\boxed{}) and the
    one line names the reward that fits; the built-in task's rows pass its synthetic reward."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from common.rollout.reward_check import check_reward_fits
    from common.run import distributed
    distributed.use_store(dist.HashStore(), 0)
    try:
        rows = [{"prompt": f"q{i}", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(10)]
        args = SimpleNamespace(reward_fn="math", reward_timeout=30.0, skip_reward_check=False)
        with pytest.raises(ValueError, match=r"--reward-fn math scores 0 of 10 held-out gold answers as correct.*"
                                             r"--reward-fn gsm8k scores 10"):
            check_reward_fits(args, rows)
        check_reward_fits(SimpleNamespace(**{**vars(args), "skip_reward_check": True}), rows)
        check_reward_fits(SimpleNamespace(**{**vars(args), "reward_fn": "gsm8k"}), rows)
    finally:
        distributed.use_store(None, 0)
