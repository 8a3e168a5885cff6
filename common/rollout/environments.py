"""Environments for multi-turn rollouts (`--env path/to/env.py:make_env`, or `--tools ...` for the common case).

The protocol. An environment file defines a function that builds one environment per episode from its dataset row
({"prompt", "answer"}: the prompt as the dataset gives it, before any chat template). The environment has two
methods:

    class GuessEnv:
        def __init__(self, row):
            self.answer = int(row["answer"])

        def reset(self) -> list[dict] | None:
            # (optional) the conversation's opening messages; None or no reset: the row's prompt, formatted as the
            # script formats every prompt (--system-prompt, --prompt-template, chat template)
            return None

        def step(self, reply: str) -> tuple[list[dict], float, bool]:
            # after each assistant turn, its text: the messages to append (role "user" or "tool"), a reward, and
            # whether the episode is over. The last step's reward is the episode's (also when --max-turns or
            # --max-response-len cuts it).
            guess = int(reply.split()[0]) if reply.split() and reply.split()[0].isdigit() else -1
            if guess == self.answer:
                return [], 1.0, True
            return [{"role": "user", "content": "higher" if guess < self.answer else "lower"}], 0.0, False

    def make_env(row):
        return GuessEnv(row)

An environment may also have `tools`: a list of functions offered through the chat template (common/rollout/tools.py).
Tools are the common case: `--tools calculator,python,path/to/tools.py` builds a `ToolEnv` per episode: each
assistant turn's tool calls are parsed and run, their results appended as tool messages; a turn without a call ends
the episode, scored by --reward-fn on that turn's text.

Environments run in processes of their own (`EnvWorkers`), never in the training process: a call has a time limit
(a stuck one is killed and the episode ends, counted), and an error in the environment's code stops the run with
one line naming the sample and the turn. Each episode's environment lives in one worker; a worker killed for a stuck
call rebuilds the other episodes it held by replaying their turns (environments should be deterministic given their
row and the replies). A remote environment server is a `step` that sends the reply and returns the answer.
"""

import collections
import importlib.util
import json
import pickle
import re
import select
import struct
import sys
import time
import traceback
from pathlib import Path

from common.data.synthetic import LookupEnv
from common.rollout.reward_fns import load_reward_fn
from common.rollout.rewards import (WorkerProcess, checked_reward, read_exactly, send_bytes, send_message,
                                    worker_setup)
from common.rollout.tools import load_tools, tool_schema
from common.run import errors


SENT_BYTES = 32 << 10  # calls sent to a process and not answered, at most (below a pipe's 64 KiB)


@errors.user_error
class EnvError(RuntimeError):
    """An environment's own code failed: the message names the sample and the turn."""


# ---------------------------------------------------------------------------------------------------------------
# Tool calls, as models write them: <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the Hermes / Qwen2.5
# format, which chat templates with tool support render; templates without it get the same format in a system
# message, common/rollout/episodes.py).

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict | str]:
    """The tool calls in an assistant turn, in order: {"name", "arguments"} each, or a string saying why a call
    could not be read (the model then gets that as the call's error)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"the tool call is not valid JSON ({e.msg}): {body[:200]}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(f"a tool call needs a \"name\": {body[:200]}")
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            calls.append(f"the arguments of {call['name']} must be a JSON object: {body[:200]}")
            continue
        calls.append({"name": call["name"], "arguments": arguments})
    return calls


class ToolEnv:
    """An episode with tools: each call in a turn runs and its result (or "Error: ...") comes back as a tool
    message; the first turn without a call is the answer, scored by the reward function."""

    def __init__(self, row: dict, tools: list, reward_fn):
        self.row, self.tools, self.reward_fn = row, tools, reward_fn
        self.by_name = {tool.__name__: tool for tool in tools}

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        calls = parse_tool_calls(reply)
        if not calls:
            reward = self.reward_fn(self.row["prompt"], reply, self.row["answer"])
            return [], checked_reward(reward, "the answer turn", self.row["prompt"], reply, self.row["answer"]), True
        return [{"role": "tool", "content": self.run(call)} for call in calls], 0.0, False

    def run(self, call: dict | str) -> str:
        if isinstance(call, str):
            return f"Error: {call}"
        tool = self.by_name.get(call["name"])
        if tool is None:
            return f"Error: no tool named {call['name']!r}; the tools are {', '.join(self.by_name)}"
        try:
            return str(tool(**call["arguments"]))
        except Exception as e:  # noqa: BLE001 - the model's mistake, for it to read
            return f"Error: {type(e).__name__}: {e}"


def is_tool_error(message: dict) -> bool:
    """A tool message that reports a failed call (how ToolEnv words them; an environment of one's own may too)."""
    return message.get("role") == "tool" and str(message.get("content", "")).startswith("Error:")


def load_env_factory(env: str | None, tools: str | None, reward_fn: str):
    """--env / --tools -> a function row -> environment. env: 'lookup' (the built-in multi-turn task) or
    path/to/file.py:function; tools: see common/tools.load_tools."""
    if (env is None) == (tools is None):
        raise ValueError("give one of --env and --tools")
    if tools is not None:
        functions, score = load_tools(tools), load_reward_fn(reward_fn)
        return lambda row: ToolEnv(row, functions, score)
    if env == "lookup":
        return LookupEnv
    path, _, name = env.rpartition(":")
    if not path or not path.endswith(".py"):
        raise ValueError(f"--env {env!r}: use lookup or path/to/env.py:function")
    if not Path(path).is_file():
        raise FileNotFoundError(f"--env {env!r}: no such file {path!r}")
    module_name = f"env_module_{Path(path).stem}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"--env file {path!r} failed to import: {type(e).__name__}: {e}") from e
    if not callable(getattr(module, name, None)):
        raise ValueError(f"--env file {path!r} has no function {name!r}")
    return getattr(module, name)


# ---------------------------------------------------------------------------------------------------------------
# Environment processes. Calls are ("reset", key, row) and ("step", key, reply), ("end", key) forgets an episode;
# answers ("ok", key, value) or ("error", key, text). Framing as the reward processes' (common/rollout/rewards.py).

def worker_main() -> None:
    """An environment process: build the factory once, then answer one call at a time until stdin closes."""
    env_spec, tools_spec, reward_spec = json.loads(sys.argv[1])
    if (out := worker_setup(int(sys.argv[2]))) is None:
        return
    try:
        factory = load_env_factory(env_spec, tools_spec, reward_spec)
    except Exception as e:  # noqa: BLE001 - reported by the rank
        return send_message(out, ("failed", None, f"{type(e).__name__}: {e}"))
    send_message(out, ("ready", None, None))
    envs = {}
    while (header := read_exactly(0, 8)) is not None:
        op, key, payload = pickle.loads(read_exactly(0, struct.unpack(">Q", header)[0]))
        try:
            if op == "end":
                envs.pop(key, None)
                continue
            if op == "reset":
                env = envs[key] = factory(payload)
                messages = env.reset() if hasattr(env, "reset") else None
                tools = [tool_schema(t) for t in getattr(env, "tools", None) or []]
                send_message(out, ("ok", key, (messages, tools)))
            else:
                messages, reward, done = envs[key].step(payload)
                reward = checked_reward(reward, "an environment step", "", payload, "")
                if done:
                    del envs[key]
                send_message(out, ("ok", key, (list(messages or []), reward, bool(done))))
        except Exception as e:  # noqa: BLE001 - reported by the rank, naming the sample and the turn
            frame = traceback.extract_tb(e.__traceback__)[-1]
            send_message(out, ("error", key, f"{type(e).__name__}: {e} ({Path(frame.filename).name}:{frame.lineno})"))


class _EnvProcess(WorkerProcess):
    """An environment process (common/rollout/rewards.py's worker process, running this module's worker_main) and its calls:
    those not sent yet, and those sent and not answered."""

    def __init__(self, specs: list):
        super().__init__(json.dumps(specs), module="common.rollout.environments")
        self.queue = collections.deque()  # calls not sent yet
        self.sent = collections.deque()  # calls sent and not answered yet: it runs them one at a time, in order
        self.sent_bytes = 0  # and `started`: when the first of `sent` started


class EnvWorkers:
    """The environments of a rank's episodes, in `workers` processes; episode `key` lives in process key % workers.

    `reset(key, row)` and `step(key, reply)` queue a call and return at once; `results(block)` returns the answers
    that have arrived, as (key, value, seconds) with value (messages, tool schemas) for a reset and (messages, reward,
    done) for a step, or None for a call that ran past `timeout_s` (its process was killed; the others of that
    process are rebuilt by replaying their turns). An error in an environment raises EnvError naming the sample.
    """

    def __init__(self, env: str | None, tools: str | None, reward_fn: str, timeout_s: float | None, workers: int = 1):
        load_env_factory(env, tools, reward_fn)  # a bad spec fails here, in the rank, with its message
        self.specs, self.timeout_s = [env, tools, reward_fn], timeout_s
        self.processes = [_EnvProcess(self.specs) for _ in range(workers)]
        self.history: dict[int, list] = {}  # key -> its calls so far: (op, payload), to replay on a new process
        self.where: dict[int, str] = {}  # key -> "sample ... of prompt ..." for error messages
        self.done = collections.deque()  # answers not handed out yet
        errors.on_abort(self.kill)

    def reset(self, key: int, row: dict, where: str) -> None:
        self.history[key], self.where[key] = [], where
        self._call(key, "reset", row)

    def step(self, key: int, reply: str) -> None:
        self._call(key, "step", reply)

    def end(self, key: int) -> None:
        """The rank ended this episode (cut by a limit): its environment is dropped."""
        self.history.pop(key, None)
        self._call(key, "end", None, answer=False)

    def pending(self) -> int:
        return sum(len(p.queue) + len(p.sent) for p in self.processes) + len(self.done)

    def results(self, block: bool) -> list[tuple[int, object, float]]:
        """The answers that have arrived; block: wait for at least one (when any call is pending)."""
        while not self.done and block and self.pending():
            self._poll(wait=True)
        self._poll(wait=False)
        answers, self.done = list(self.done), collections.deque()
        return answers

    def _call(self, key: int, op: str, payload, answer: bool = True) -> None:
        process = self.processes[key % len(self.processes)]
        if answer:
            self.history[key].append((op, payload))
        process.queue.append((key, op, payload, answer, False))
        self._start(process)

    def _start(self, process: _EnvProcess) -> None:
        """Sends queued calls without waiting for the answers of those before (the process answers them in order),
        while what is sent and unanswered stays under SENT_BYTES: the pipe then never fills, so neither side can
        block the other."""
        while process.ready and process.queue:
            key, op, payload, answer, replay = call = process.queue[0]
            data = pickle.dumps((op, key, payload))
            if process.sent and process.sent_bytes + len(data) > SENT_BYTES:
                break
            process.queue.popleft()
            send_bytes(process.process.stdin.fileno(), data)
            if answer:  # "end" gets none
                if not process.sent:
                    process.started = time.monotonic()
                process.sent.append((*call, len(data)))
                process.sent_bytes += len(data)

    def _poll(self, wait: bool) -> None:
        now = time.monotonic()
        deadlines = [p.started + self.timeout_s - now for p in self.processes if p.sent and self.timeout_s]
        timeout = 0.0 if not wait else max(0.0, min(deadlines + [1.0]))
        readable, _, _ = select.select([p.fd for p in self.processes], [], [], timeout)
        for process in [p for p in self.processes if p.fd in readable]:
            self._receive(process)
        for process in list(self.processes):
            if process.sent and self.timeout_s and time.monotonic() > process.started + self.timeout_s:
                self._replace(process)

    def _receive(self, process: _EnvProcess) -> None:
        messages = process.read()
        if messages is None:
            where = f" on {self.where.get(process.sent[0][0])}" if process.sent else ""
            raise EnvError(f"an environment process died{where} (a crash or os._exit in the environment's code?)")
        for kind, key, value in messages:
            if kind == "ready":
                process.ready = True
            elif kind == "failed":
                raise EnvError(f"the environment could not be loaded in its process: {value}")
            else:
                key, op, payload, answer, replay, size = process.sent.popleft()
                process.sent_bytes -= size
                now = time.monotonic()
                if kind == "error":
                    turn = sum(o == "step" for o, _ in self.history.get(key, []))
                    what = "reset" if op == "reset" else f"turn {turn}"
                    raise EnvError(f"the environment raised on {self.where[key]}, {what}: {value}")
                if not replay:
                    self.done.append((key, value, now - process.started))
                process.started = now  # the next call starts now
        self._start(process)

    def _replace(self, process: _EnvProcess) -> None:
        """A call ran past its time limit: its episode gets None (it ends), and the process's other episodes are
        rebuilt on a new process from their calls so far (answers discarded, except for calls not answered yet)."""
        stuck_key = process.sent[0][0]
        self.done.append((stuck_key, None, time.monotonic() - process.started))
        self.history.pop(stuck_key, None)
        waiting = [c[:5] for c in list(process.sent)[1:] if not c[4]] + list(process.queue)
        waiting = [c for c in waiting if c[0] != stuck_key]
        new = self.processes[self.processes.index(process)] = _EnvProcess(self.specs)
        process.kill()
        index = self.processes.index(new)
        for key, calls in self.history.items():
            if key % len(self.processes) == index:
                queued = sum(c[0] == key and c[3] for c in waiting)  # sent again below, answered as usual
                new.queue.extend((key, op, payload, True, True) for op, payload in calls[:len(calls) - queued])
        new.queue.extend(waiting)

    def kill(self) -> None:
        for process in self.processes:
            process.kill()

    def close(self) -> None:
        self.kill()
