"""Reward functions: score one (prompt, completion, answer) sample with a float.

Built-in rewards check a math answer with math-verify, which compares parsed expressions
(so "0.5", "\\frac{2}{4}" and "\\frac{1}{2}" all match). `load_reward_fn` also loads any
`path/to/file.py:function_name` with the same signature. They run in common/rollout/rewards.py's processes.
"""

import importlib.util
import re
import sys
import threading
from pathlib import Path
from typing import Callable

RewardFn = Callable[[str, str, str], float]
BUILTIN_REWARDS = ("gsm8k", "math", "synthetic", "none")
# "1,234.5", "-3", "72", ".5", "1/2" (after _plain_numbers)
NUMBER = re.compile(r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:/\d+(?:\.\d+)?)?")


def _equivalent(gold: str, prediction: str, config: list) -> bool:
    # math-verify times out with signal.alarm, which raises ValueError outside the main thread,
    # so off the main thread we go without a timeout rather than fail.
    from math_verify import parse, verify  # imported here: sympy is slow to import and most rewards never need it

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    # parse returns [] on text it cannot read and verify returns False on [], so garbage scores 0.
    gold_parsed = parse(gold, extraction_config=config, parsing_timeout=timeout)
    prediction_parsed = parse(prediction, extraction_config=config, parsing_timeout=timeout)
    return verify(gold_parsed, prediction_parsed, timeout_seconds=timeout)


def _plain_numbers(text: str) -> str:
    """Numbers as NUMBER reads them: a Unicode minus or dash as "-", "1 000" (spaces, thin or no-break, between
    groups of three) as "1000", "1 / 2" as "1/2"."""
    text = text.replace("\u2212", "-").replace("\u2013", "-")
    text = re.sub(r"(?<=\d)[ \u00a0\u2009\u202f](?=\d{3}(?!\d))", "", text)
    return re.sub(r"(?<=\d)\s*/\s*(?=\d)", "/", text)


def _after_hashes(text: str) -> str:
    """What follows the last '####', a sign set apart from its number ("#### - 3") joined to it."""
    return re.sub(r"^\s*-\s+(?=[\d.])", "-", _plain_numbers(text.rsplit("####", 1)[-1]))


def _number(found: str) -> str:
    """A NUMBER match as math-verify reads it: no thousands commas, a leading 0 before a bare decimal point."""
    found = found.replace(",", "")
    return re.sub(r"^(-?)\.", r"\g<1>0.", found)


def _gsm8k_prediction(completion: str) -> str | None:
    """The first number after the last '####', else the last number in the completion."""
    if "####" in completion:
        found = NUMBER.findall(_after_hashes(completion))[:1]  # ignore whatever the model says next
    else:
        found = NUMBER.findall(_plain_numbers(completion))[-1:]
    return _number(found[0]) if found else None


def gsm8k_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final number equals the number after '####' in the reference (fractions and
    decimals compare by value: 1/2 == 0.5 == .5)."""
    gold = _after_hashes(answer).strip()
    found = NUMBER.findall(gold)[:1]
    gold = _number(found[0]) if found else gold.replace(",", "")
    prediction = _gsm8k_prediction(completion)
    if prediction is None:
        return 0.0
    from math_verify import ExprExtractionConfig, LatexExtractionConfig
    return float(_equivalent(gold, prediction, [LatexExtractionConfig(), ExprExtractionConfig()]))


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in text (braces matched), or None if there is none."""
    start, command = max((text.rfind(c + "{"), c) for c in ("\\boxed", "\\fbox"))
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(command), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len(command) + 1 : i]
    return None  # unclosed: the completion was cut off mid-answer


ANSWER_IS = re.compile(r"answer is:?\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


def final_answer(text: str) -> str | None:
    """The answer a MATH-style solution states: its last \\boxed{} (or \\fbox{}); else what follows a "# Answer"
    heading (PRM800K's format); else what follows the last "The answer is". A trailing period and the $...$ around
    it go."""
    answer = last_boxed(text)
    if answer is None and (heading := re.search(r"^#+ Answer\s*\n+\s*(.+)", text, re.MULTILINE)):
        answer = heading.group(1)
    if answer is None and (stated := ANSWER_IS.findall(text)):
        answer = stated[-1]
    if answer is None:
        return None
    answer = answer.strip().rstrip(".").strip()
    return answer[1:-1].strip() if len(answer) > 1 and answer[0] == answer[-1] == "$" else answer


def math_reward(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion's final answer (final_answer: \\boxed{}, a "# Answer" heading, "The answer is") is
    equivalent to the reference answer, a full solution (its final answer counts) or a bare answer."""
    gold = final_answer(answer)
    gold = answer.strip() if gold is None else gold
    prediction = final_answer(completion)
    if prediction is None:
        return 0.0
    # We cut the answer out ourselves: with several boxes math-verify may read them as a set.
    from math_verify import LatexExtractionConfig
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    return float(_equivalent(f"$\\boxed{{{gold}}}$", f"$\\boxed{{{prediction}}}$", config))


def no_reward(prompt: str, completion: str, answer: str) -> float:
    return 0.0


def load_reward_fn(spec: str) -> RewardFn:
    """'gsm8k' | 'math' | 'synthetic' | 'none' | 'path/to/file.py:function_name' -> reward function."""
    if spec == "gsm8k":
        return gsm8k_reward
    if spec == "math":
        return math_reward
    if spec == "none":  # every response scores 0: the reward comes from elsewhere (a reward model)
        return no_reward
    if spec == "synthetic":
        from common.data.synthetic import synthetic_reward  # imported here so other rewards need no synthetic task

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
