"""common/rollout/environments.py: tool calls parsed as models write them, ToolEnv's turns, and the environment processes:
answers in order, a stuck call killed and counted while the other episodes of its process carry on, an error in
the environment's code named by sample and turn."""

import pytest

from common.data.synthetic import LookupEnv, make_synthetic_rows
from common.rollout.environments import EnvError, EnvWorkers, ToolEnv, load_env_factory, parse_tool_calls
from common.rollout.tools import calculator

COUNTER_ENV = '''
import os, time

class Counter:
    """Counts the replies; "hang" never returns, "boom" raises, "die" kills the process; "stop" ends the episode
    with the count as its reward."""
    def __init__(self, row):
        self.count = 0

    def step(self, reply):
        if reply == "hang":
            time.sleep(10**6)
        if reply == "boom":
            raise KeyError("boom")
        if reply == "die":
            os._exit(3)
        self.count += 1
        if reply == "stop":
            return [], float(self.count), True
        return [{"role": "user", "content": str(self.count)}], 0.0, False

def make_env(row):
    return Counter(row)
'''


def test_tool_calls_are_parsed_as_models_write_them():
    text = ('Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call><tool_call>[1]</tool_call>')
    calls = parse_tool_calls(text)
    assert calls[0] == {"name": "calculator", "arguments": {"expression": "2*3"}}
    assert calls[1] == {"name": "calculator", "arguments": {"expression": "1+1"}}  # arguments as a JSON string
    assert calls[2].startswith("the tool call is not valid JSON") and calls[3].startswith("a tool call needs")
    assert parse_tool_calls("The answer is 6.") == []


def test_tool_env_runs_calls_and_scores_the_answer():
    env = ToolEnv({"prompt": "What is 12 * 34?", "answer": "408"}, [calculator],
                  lambda prompt, completion, answer: float(answer in completion))
    messages, reward, done = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}'
                                      '</tool_call><tool_call>{"name": "search", "arguments": {}}</tool_call>'
                                      '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}'
                                      '</tool_call>')
    assert [m["content"] for m in messages] == ["408", "Error: no tool named 'search'; the tools are calculator",
                                                "Error: ZeroDivisionError: Fraction(1, 0)"]
    assert all(m["role"] == "tool" for m in messages) and (reward, done) == (0.0, False)
    assert env.step("It is 408.") == ([], 1.0, True)
    assert env.step("It is 407.") == ([], 0.0, True)


def test_lookup_env_hides_a_number_and_reveals_it():
    rows = make_synthetic_rows("test")
    for row in rows[:50]:
        env = LookupEnv(row)
        (opening,) = env.reset()
        shown, numbers = opening["content"].split()[1:-1], row["prompt"].split()[1:-1]
        hidden = shown.index("?")
        assert [n for i, n in enumerate(numbers) if i != hidden] == [n for n in shown if n != "?"]
        assert numbers[hidden] == row["answer"]  # the largest: without the lookup, only a guess can be right
        for call in ("lookup", "max", "", "?"):  # a turn that is not a number asks for it
            assert env.step(call) == ([{"role": "tool", "content": numbers[hidden]}], 0.0, False)
        assert env.step(row["answer"]) == ([], 1.0, True)
        assert env.step(str((int(row["answer"]) + 1) % 30)) == ([], 0.0, True)


def test_a_bad_env_spec_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="give one of --env and --tools"):
        load_env_factory("lookup", "calculator", "synthetic")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_env_factory(str(tmp_path / "missing.py:make_env"), None, "synthetic")
    (tmp_path / "env.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="has no function 'make_env'"):
        load_env_factory(f"{tmp_path / 'env.py'}:make_env", None, "synthetic")


def answers(workers: EnvWorkers, count: int) -> dict:
    """The next `count` answers, by episode key, in the order each episode got them."""
    got, received = {}, 0
    while received < count:
        for key, value, _ in workers.results(block=True):
            got.setdefault(key, []).append(value)
            received += 1
    return got


def test_workers_answer_in_order_and_keep_each_episode_state(tmp_path):
    (tmp_path / "env.py").write_text(COUNTER_ENV)
    workers = EnvWorkers(f"{tmp_path / 'env.py'}:make_env", None, "synthetic", timeout_s=None, workers=2)
    try:
        for key in range(4):
            workers.reset(key, {"prompt": "p", "answer": "a"}, where=f"sample {key}")
        assert all(v == [(None, [])] for v in answers(workers, 4).values())
        for _ in range(2):
            for key in range(4):
                workers.step(key, "go")
        got = answers(workers, 8)
        assert got == {key: [([{"role": "user", "content": "1"}], 0.0, False),
                             ([{"role": "user", "content": "2"}], 0.0, False)] for key in range(4)}
        workers.step(0, "stop")
        assert answers(workers, 1) == {0: [([], 3.0, True)]}
    finally:
        workers.close()


def test_a_stuck_call_is_killed_and_the_other_episodes_carry_on(tmp_path):
    """Keys 0 and 2 share a process: 0 hangs, so the process is killed; 2's environment is rebuilt on the new
    process by replaying its replies, and its count goes on from where it was."""
    (tmp_path / "env.py").write_text(COUNTER_ENV)
    workers = EnvWorkers(f"{tmp_path / 'env.py'}:make_env", None, "synthetic", timeout_s=1.0, workers=2)
    try:
        for key in range(3):
            workers.reset(key, {"prompt": "p", "answer": "a"}, where=f"sample {key}")
        answers(workers, 3)
        for key in range(3):
            workers.step(key, "go")
        answers(workers, 3)
        workers.step(0, "hang")
        workers.step(2, "go")  # queued behind the stuck call, on the same process
        workers.step(1, "go")
        got = answers(workers, 3)
        assert got[0] == [None]
        assert got[2] == [([{"role": "user", "content": "2"}], 0.0, False)]
        assert got[1] == [([{"role": "user", "content": "2"}], 0.0, False)]
        workers.step(2, "stop")
        assert answers(workers, 1) == {2: [([], 3.0, True)]}
    finally:
        workers.close()


@pytest.mark.parametrize("reply, expected", [
    ("boom", r"the environment raised on sample 1 \(p\), turn 2: KeyError: 'boom' \(env.py:\d+\)"),
    ("die", r"an environment process died on sample 1 \(p\)")])
def test_an_error_in_the_environment_names_the_sample_and_turn(tmp_path, reply, expected):
    (tmp_path / "env.py").write_text(COUNTER_ENV)
    workers = EnvWorkers(f"{tmp_path / 'env.py'}:make_env", None, "synthetic", timeout_s=None, workers=1)
    try:
        workers.reset(1, {"prompt": "p", "answer": "a"}, where="sample 1 (p)")
        workers.step(1, "go")
        answers(workers, 2)
        workers.step(1, reply)
        with pytest.raises(EnvError, match=expected):
            answers(workers, 1)
    finally:
        workers.close()
