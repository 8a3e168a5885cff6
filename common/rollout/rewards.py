"""Reward processes: a reward function (common/rollout/reward_fns.py: the built-in ones, or any
`path/to/file.py:function_name`) scores each (prompt, completion, answer) sample with a float.

`RewardScorer` runs the reward function in worker processes of its own, never in the training process: groups of
responses are scored as soon as the rollout engine hands them over (so scoring hides behind the generation of the
rest), a call that overruns its time limit is really stopped (its process is killed and replaced: a thread could
only be abandoned, and some calls, a huge integer power, cannot be interrupted at all), and a stop signal never
waits behind a stuck reward. A reward that raises or returns something other than a finite number stops the run
with a message naming the sample.
"""

import collections
import math
import numbers
import os
import pickle
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time

from common.rollout.reward_fns import load_reward_fn
from common.rollout.sandbox import kill_calls_of
from common.run import errors, signals


@errors.user_error
class RewardError(RuntimeError):
    """A reward function raised or returned a bad value; the message names the sample."""


def _shorten(text: str, limit: int = 200) -> str:
    return repr(text if len(text) <= limit else text[:limit] + f"... [{len(text)} chars]")


def checked_reward(value, where: str, prompt: str, completion: str, answer: str) -> float:
    """value as a float; RewardError naming the sample if it is not a finite number (bool counts as 0/1)."""
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RewardError(f"reward function returned {value!r} on {where}, not a finite number"
                          f"{_sample(prompt, completion, answer)}")
    return float(value)


def _sample(prompt: str, completion: str, answer: str) -> str:
    return f"\n  prompt: {_shorten(prompt)}\n  completion: {_shorten(completion)}\n  answer: {_shorten(answer)}"


# ---------------------------------------------------------------------------------------------------------------
# Reward processes. Messages are pickles behind an 8-byte length, over the worker's stdin and a copy of its stdout
# (the reward function's own prints go to stderr).

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root


def send_message(fd: int, message) -> None:
    send_bytes(fd, pickle.dumps(message))


def send_bytes(fd: int, data: bytes) -> None:
    """One message already pickled, behind its length."""
    data = struct.pack(">Q", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def read_exactly(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def worker_setup(parent: int) -> int | None:
    """In a worker process (rewards, environments): its own copy of stdout for the messages (prints go to stderr),
    signals left to the rank, and death with the rank. Returns that copy, or None when the rank is gone already."""
    out = os.dup(1)
    os.dup2(2, 1)  # print() in a reward function must not mix with the messages
    # Ctrl-C and Slurm's SIGTERM reach every process of the job: the rank decides what happens, and kills this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:  # Linux: die with the rank even while stuck in C code (a thread could not run to notice)
        import ctypes
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    return out if os.getppid() == parent else None


def worker_main() -> None:
    """A reward process: load the reward function once, then answer one call at a time until stdin closes."""
    spec, parent = sys.argv[1], int(sys.argv[2])
    if (out := worker_setup(parent)) is None:
        return
    try:
        reward_fn = load_reward_fn(spec)
    except Exception as e:  # noqa: BLE001 - reported by the rank
        return send_message(out, ("failed", f"{type(e).__name__}: {e}"))
    send_message(out, ("ready", None))
    while (header := read_exactly(0, 8)) is not None:
        prompt, completion, answer = pickle.loads(read_exactly(0, struct.unpack(">Q", header)[0]))
        try:
            value = reward_fn(prompt, completion, answer)
            send_message(out, ("ok", value if isinstance(value, numbers.Real) else _OtherValue(value)))
        except Exception as e:  # noqa: BLE001 - reported by the rank, naming the sample
            send_message(out, ("error", f"{type(e).__name__}: {e}"))


class _OtherValue:
    """What the rank receives for a returned value of another type: its repr, for the error message."""

    def __init__(self, value):
        self.text = repr(value)

    def __repr__(self):
        return self.text


# Variables a process that handles model output must not hold: credentials by name, and W&B's and the clouds' own.
CREDENTIAL = re.compile(r"TOKEN|KEY|SECRET|PASSW|CREDENTIAL|COOKIE|^(WANDB|AWS|AZURE|GOOGLE|GCP|GCLOUD|CLOUDSDK)_"
                        r"|^(NETRC|SSH_AUTH_SOCK)$", re.IGNORECASE)


def without_credentials(environment) -> dict:
    """The environment for reward and environment processes: all but credentials (what they need stays: PATH,
    PYTHONPATH, HF_HOME, the CUDA and thread settings)."""
    return {k: v for k, v in environment.items() if not CREDENTIAL.search(k)}


class WorkerProcess:
    """One reward process and the call it is working on (common/rollout/environments.py's processes are these too, running
    `module`'s worker_main)."""

    def __init__(self, spec: str, module: str = "common.rollout.rewards"):
        env = {**without_credentials(os.environ),
               "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from {module} import worker_main; worker_main()", spec, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.fd, self.buffer = self.process.stdout.fileno(), b""
        self.ready, self.call, self.started = False, None, 0.0

    def start(self, call: tuple) -> None:
        self.call, self.started = call, time.monotonic()
        send_message(self.process.stdin.fileno(), call[3:])

    def read(self) -> list | None:
        """The complete messages that have arrived (call when select says fd is readable); None: the process ended."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        messages = []
        while len(self.buffer) >= 8 and len(self.buffer) >= 8 + (size := struct.unpack(">Q", self.buffer[:8])[0]):
            messages.append(pickle.loads(self.buffer[8:8 + size]))
            self.buffer = self.buffer[8 + size:]
        return messages

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        kill_calls_of(self.process.pid)  # the python tool's calls it had running (common/rollout/sandbox.py)
        for f in (self.process.stdin, self.process.stdout):
            try:
                f.close()
            except OSError:
                pass


class RewardScorer:
    """Scores groups of responses (one prompt's samples each) against their prompt and answer, in `workers`
    processes of its own.

    `submit(key, prompts, completions, answers)` queues a group as soon as it is generated, and returns at once: a
    thread of this process hands the calls to idle workers, one at a time, and collects the results. `collect()`
    waits for every group queued since the last collect and returns their rewards ordered by key, with the number
    of calls that ran past `timeout_s` (they score 0: their process is killed and replaced), or, once a stop signal
    has come, past `stop_grace_s` (the same: the step completes and is saved). A reward that raises,
    returns a non-number or kills its process makes collect raise RewardError naming the sample.
    """

    def __init__(self, spec: str, timeout_s: float | None = None, workers: int = 1, stop_grace_s: float = 5.0):
        load_reward_fn(spec)  # a bad spec fails here, in the rank, with its message
        if workers < 1:
            raise ValueError(f"--reward-workers must be at least 1, got {workers}")
        self.spec, self.timeout_s = spec, timeout_s
        self.workers = [WorkerProcess(spec) for _ in range(workers)]
        self.lock = threading.Condition()
        self.queue = collections.deque()  # calls not started: (round, key, index, prompt, completion, answer)
        self.round = 0  # one per collect: a call still under way from a failed round must not land in the next
        self.groups: dict[int, list] = {}  # key -> rewards of its samples (None: not scored yet)
        self.unscored = self.timeouts = 0
        self.error: Exception | None = None
        self.closed = False
        self.stop_grace_s, self.stopped_at = stop_grace_s, None  # when a stop signal was seen
        self.wake_read, self.wake_write = os.pipe()  # submit and close wake the thread from its select
        errors.on_abort(self.kill)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def submit(self, key: int, prompts: list[str], completions: list[str], answers: list[str]) -> None:
        if not len(prompts) == len(completions) == len(answers):
            raise ValueError(f"got {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers")
        with self.lock:
            if key in self.groups:
                raise ValueError(f"group {key} was submitted twice")
            self.groups[key] = [None] * len(prompts)
            self.queue.extend((self.round, key, i, p, c, a)
                              for i, (p, c, a) in enumerate(zip(prompts, completions, answers)))
            self.unscored += len(prompts)
        os.write(self.wake_write, b"x")

    def collect(self) -> tuple[list[list[float]], int]:
        """(rewards of each group by key, reward calls that timed out). After a stop signal, a call still running
        stop_grace_s later (or that long after its start) is stopped and scores 0 as if it had timed out, so that a
        stuck reward cannot hold up the step's save."""
        with self.lock:
            while self.unscored and self.error is None:
                self.lock.wait(0.1)
            if self.error is not None:  # the step is lost: forget its calls (those under way are ignored later)
                error, self.error = self.error, None
                self.groups, self.unscored, self.timeouts = {}, 0, 0
                self.queue.clear()
                self.round += 1
                raise error
            groups, self.groups = self.groups, {}
            timeouts, self.timeouts = self.timeouts, 0
            self.round += 1
        return [groups[key] for key in sorted(groups)], timeouts

    def _serve(self) -> None:
        """The thread: start queued calls on idle workers, read results, stop calls that overrun."""
        try:
            while not self.closed:
                if signals.stop_requested() and self.stopped_at is None:
                    self.stopped_at = time.monotonic()
                with self.lock:
                    for worker in self.workers:
                        if worker.ready and worker.call is None and self.queue:
                            worker.start(self.queue.popleft())
                now = time.monotonic()
                wait = min([1.0] + [max(0.0, self._deadline(w.started) - now) for w in self.workers if w.call])
                readable, _, _ = select.select([self.wake_read] + [w.fd for w in self.workers], [], [], wait)
                if self.wake_read in readable:
                    os.read(self.wake_read, 1 << 16)
                for worker in [w for w in self.workers if w.fd in readable]:
                    self._receive(worker)
                for worker in self.workers:
                    if worker.call and time.monotonic() > self._deadline(worker.started):
                        self._replace(worker)
        except Exception as e:  # noqa: BLE001 - handed to collect
            with self.lock:
                self.error = self.error or e
                self.lock.notify_all()

    def _deadline(self, started: float) -> float:
        """When a running call is stopped: at its time limit, and once a stop signal has come, stop_grace_s after the
        signal or after the call's own start, whichever is later (calls still queued run as usual)."""
        limit = math.inf if self.timeout_s is None else started + self.timeout_s
        if self.stopped_at is not None:
            limit = min(limit, max(started, self.stopped_at) + self.stop_grace_s)
        return limit

    def _receive(self, worker: WorkerProcess) -> None:
        messages = worker.read()
        with self.lock:
            if messages is None:  # the process ended
                what = f"while scoring sample {worker.call[2]} of group {worker.call[1]}{_sample(*worker.call[3:])}" \
                    if worker.call else "while loading the reward"
                self.error = self.error or RewardError(
                    f"a reward process died {what} (a crash or os._exit in the reward function?)")
                worker.call = None
                self.workers.remove(worker)
                worker.kill()
            for kind, value in messages or []:
                if kind == "ready":
                    worker.ready = True
                elif kind == "failed":
                    self.error = self.error or RewardError(f"the reward could not be loaded in its process: {value}")
                else:
                    round_, key, index, prompt, completion, answer = worker.call
                    worker.call = None
                    if round_ != self.round:
                        continue
                    where = f"sample {index} of group {key}"
                    try:
                        if kind == "error":
                            raise RewardError(f"reward function raised on {where}: {value}"
                                              f"{_sample(prompt, completion, answer)}")
                        self._record(key, index, checked_reward(value, where, prompt, completion, answer))
                    except RewardError as e:
                        self.error = self.error or e
            self.lock.notify_all()

    def _record(self, key: int, index: int, reward: float) -> None:
        self.groups[key][index] = reward
        self.unscored -= 1

    def _replace(self, worker: WorkerProcess) -> None:
        """A call ran past its deadline: it scores 0, and its process (maybe stuck for good) makes way for a new one."""
        with self.lock:
            round_, key, index = worker.call[:3]
            if round_ == self.round:
                self._record(key, index, 0.0)
                self.timeouts += 1
            self.workers[self.workers.index(worker)] = WorkerProcess(self.spec)
            self.lock.notify_all()
        worker.kill()

    def kill(self) -> None:
        """Stops every reward process at once (also those stuck in a call)."""
        self.closed = True
        for worker in list(self.workers):
            worker.kill()

    def close(self) -> None:
        """Stops the thread and the reward processes; call before leaving (os._exit skips the usual clean-up)."""
        if self.closed:
            return
        self.closed = True
        os.write(self.wake_write, b"x")
        self.thread.join()
        self.kill()
        os.close(self.wake_read)
        os.close(self.wake_write)
