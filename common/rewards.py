"""Reward functions: score one (prompt, completion, answer) sample with a float.

Built-in rewards check a math answer with math-verify, which compares parsed expressions
(so "0.5", "\\frac{2}{4}" and "\\frac{1}{2}" all match). `load_reward_fn` also loads any
`path/to/file.py:function_name` with the same signature, and `compute_rewards` scores a batch,
failing loudly on the first sample whose reward raises or is not a finite number. `RewardScorer` scores groups
of responses in background processes as the rollout engine hands them over, so that scoring the groups that
finished early hides behind the generation of the rest.
"""

import concurrent.futures
import importlib.util
import math
import multiprocessing
import numbers
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from common.resume import call_with_timeout

RewardFn = Callable[[str, str, str], float]
BUILTIN_REWARDS = ("gsm8k", "math", "synthetic")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # "1,234.5", "-3", "72"


class RewardError(RuntimeError):
    """A reward function raised or returned a bad value; the message names the sample."""


def _equivalent(gold: str, prediction: str, config: list) -> bool:
    # math-verify times out with signal.alarm, which raises ValueError outside the main thread,
    # so off the main thread we go without a timeout rather than fail.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    # parse returns [] on text it cannot read and verify returns False on [], so garbage scores 0.
    gold_parsed = parse(gold, extraction_config=config, parsing_timeout=timeout)
    prediction_parsed = parse(prediction, extraction_config=config, parsing_timeout=timeout)
    return verify(gold_parsed, prediction_parsed, timeout_seconds=timeout)


def _gsm8k_prediction(completion: str) -> str | None:
    """The first number after the last '####', else the last number in the completion."""
    if "####" in completion:
        found = NUMBER.findall(completion.rsplit("####", 1)[1])[:1]  # ignore whatever the model says next
    else:
        found = NUMBER.findall(completion)[-1:]
    return found[0].replace(",", "") if found else None


def gsm8k_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final number equals the number after '####' in the reference."""
    gold = answer.rsplit("####", 1)[-1].replace(",", "").strip()
    prediction = _gsm8k_prediction(completion)
    if prediction is None:
        return 0.0
    config = [LatexExtractionConfig(), ExprExtractionConfig()]
    return float(_equivalent(gold, prediction, config))


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} in text (braces matched), or None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None  # unclosed: the completion was cut off mid-answer


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's last \\boxed{} is equivalent to the reference answer.

    The reference is either a full solution (its last \\boxed{} is the answer) or a bare answer.
    """
    gold = last_boxed(answer)
    gold = answer if gold is None else gold
    prediction = last_boxed(completion)
    if prediction is None:
        return 0.0
    # We cut the boxed content out ourselves: with several boxes math-verify may read them as a set.
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    return float(_equivalent(f"$\\boxed{{{gold}}}$", f"$\\boxed{{{prediction}}}$", config))


def load_reward_fn(spec: str) -> RewardFn:
    """'gsm8k' | 'math' | 'synthetic' | 'path/to/file.py:function_name' -> reward function."""
    if spec == "gsm8k":
        return gsm8k_reward
    if spec == "math":
        return math_reward
    if spec == "synthetic":
        from common.synthetic import synthetic_reward  # imported here so other rewards need no synthetic task

        return synthetic_reward
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}: use one of {', '.join(BUILTIN_REWARDS)} or path/to/file.py:function_name")
    path, name = spec.rsplit(":", 1)
    if not Path(path).is_file():
        raise FileNotFoundError(f"reward file {path!r} not found (from reward spec {spec!r})")
    module_name = f"reward_module_{Path(path).stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # so dataclasses and pickling inside the file work
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise ValueError(f"reward file {path!r} failed to import: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        defined = [n for n, v in vars(module).items() if callable(v) and getattr(v, "__module__", None) == module_name]
        raise ValueError(f"reward file {path!r} has no {name!r}; functions defined there: {defined}")
    reward_fn = getattr(module, name)
    if not callable(reward_fn):
        raise ValueError(f"{spec!r} is a {type(reward_fn).__name__}, not a function")
    return reward_fn


def _shorten(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + f"... [{len(text)} chars]")


def compute_rewards(reward_fn: RewardFn, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """reward_fn(prompt, completion, answer) for each sample, as floats; RewardError on the first bad one."""
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(f"got {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers")
    rewards = []
    for i, (prompt, completion, answer) in enumerate(zip(prompts, completions, answers)):
        sample = f"\n  prompt: {_shorten(prompt)}\n  completion: {_shorten(completion)}\n  answer: {_shorten(answer)}"
        try:
            reward = reward_fn(prompt, completion, answer)
        except Exception as e:
            raise RewardError(f"reward function raised on sample {i}: {type(e).__name__}: {e}{sample}") from e
        # bool is a numbers.Real, so True/False count as 1/0
        if not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise RewardError(f"reward function returned {reward!r} on sample {i}, not a finite number{sample}")
        rewards.append(float(reward))
    return rewards


def score_group(reward_fn: RewardFn, timeout_s: float | None, prompts: list[str], completions: list[str],
                answers: list[str]) -> tuple[list[float], int]:
    """compute_rewards with each call limited to timeout_s seconds (a slower call scores 0): (rewards, timeouts)."""
    timeouts = 0

    def bounded(prompt, completion, answer):
        nonlocal timeouts
        value, timed_out = call_with_timeout(reward_fn, (prompt, completion, answer), timeout_s)
        timeouts += timed_out
        return 0.0 if timed_out else value

    return compute_rewards(bounded, prompts, completions, answers), timeouts


# In a scoring process: the reward function and time limit, set once by _start_worker.
_worker_reward: tuple[RewardFn, float | None] | None = None


def _start_worker(spec: str, timeout_s: float | None, parent: int) -> None:
    global _worker_reward
    _worker_reward = (load_reward_fn(spec), timeout_s)
    # Ctrl-C and Slurm's SIGTERM reach every process of the job: the rank decides what happens (finish the step,
    # save, close the scorer), so its scorer must not die under it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def exit_with_parent():  # a rank that dies without closing its scorer (SIGKILL, os._exit) leaves no orphans
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()


def _score_in_worker(prompts: list[str], completions: list[str], answers: list[str]) -> tuple[list[float], int]:
    return score_group(*_worker_reward, prompts, completions, answers)


class RewardScorer:
    """Scores groups of responses (one prompt's samples each) against their prompt and answer.

    `submit(key, ...)` queues a group as soon as it is generated; `collect()` returns the rewards of every group
    queued since the last collect, ordered by key. With workers > 0 the groups are scored right away in that many
    processes (started fresh, so they share no lock or CUDA state with this one, and math-verify can use its
    signal-based timeouts there), while this process goes on generating; with 0 they are scored in this process
    by collect, after generation.
    """

    def __init__(self, spec: str, timeout_s: float | None = None, workers: int = 0):
        self.reward_fn, self.timeout_s = load_reward_fn(spec), timeout_s  # a bad spec fails here, with its message
        self.pool = None
        if workers > 0:
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                initargs=(spec, timeout_s, os.getpid()))
        self.pending: dict[int, object] = {}  # key -> future (workers) or the group's arguments (in process)

    def submit(self, key: int, prompts: list[str], completions: list[str], answers: list[str]) -> None:
        if key in self.pending:
            raise ValueError(f"group {key} was submitted twice")
        args = (prompts, completions, answers)
        self.pending[key] = self.pool.submit(_score_in_worker, *args) if self.pool else args

    def collect(self) -> tuple[list[list[float]], int]:
        """(rewards of each group by key, reward calls that timed out); raises the first failing group's error."""
        pending, self.pending = self.pending, {}
        rewards, timeouts = [], 0
        for key in sorted(pending):
            if self.pool:
                try:
                    group_rewards, group_timeouts = pending[key].result()
                except concurrent.futures.process.BrokenProcessPool as e:
                    raise RewardError(f"a reward process died while scoring group {key} (a crash or os._exit "
                                      f"in the reward function?): {e}") from e
            else:
                group_rewards, group_timeouts = score_group(self.reward_fn, self.timeout_s, *pending[key])
            rewards.append(group_rewards)
            timeouts += group_timeouts
        return rewards, timeouts

    def close(self) -> None:
        """Stops the scoring processes; call before os._exit, which skips the interpreter's own shutdown."""
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
