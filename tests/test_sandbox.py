"""The python tool's sandbox, attacked as a hostile model would (issue 55): one test per way out, each run against
the real sandbox (bubblewrap), as root and as an unprivileged user. Every test here failed on the sandbox before
bubblewrap (the attack worked); the comment over each says what it tries.

No sleeps as synchronization: the code in the sandbox waits on pipes between its own processes, and the test looks
for what is left by a marker in the processes' command lines."""

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from pathlib import Path

import pytest

from common.rollout.sandbox import kill_calls_of
from common.rollout.tools import run_sandboxed

ROOT = Path(__file__).resolve().parents[1]
AS_ROOT = os.geteuid() == 0


def processes_with(marker: str) -> list[int]:
    """Pids of this machine's live processes whose command line holds `marker` (the code of a call does)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            pass
    return [p for p in pids if p != os.getpid()]


@pytest.fixture
def marker():
    """A string to put in a call's code; whatever still runs with it at the end is killed (the old sandbox left
    processes behind)."""
    mark = f"nanorl_mark_{uuid.uuid4().hex}"
    yield mark
    for pid in processes_with(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def attempt(action: str) -> str:
    """Code that runs `action` and prints DONE, or the error that stopped it."""
    return f"try:\n    {action}\n    print('DONE')\nexcept BaseException as e:\n    print('REFUSED', repr(e))\n"


# ---------------------------------------------------------------------------------------------------------------
# 1-3: the file system: what the run owns can be neither read nor written

@pytest.fixture
def run_files(tmp_path):
    """A fake home with credentials, a run directory, a site-packages and a reward file, as training has them."""
    home, run = tmp_path / "home", tmp_path / "run"
    secrets = {home / ".netrc": "machine api.wandb.ai password SECRET_NETRC",
               home / ".config/wandb/settings": "[default]\napi_key = SECRET_WANDB",
               home / ".cache/huggingface/token": "hf_SECRET_HF",
               run / "metrics.jsonl": '{"step": 1, "SECRET_METRICS": 1}\n',
               run / "step_10/model.pt": "SECRET_CHECKPOINT"}
    for path, text in secrets.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "site-packages").mkdir()
    return home, run, secrets


def test_code_cannot_read_credentials_or_the_run(run_files):
    home, run, secrets = run_files
    paths = list(secrets) + ([Path("/etc/shadow")] if AS_ROOT else [])
    code = "".join(attempt(f"print(open({str(p)!r}).read())") for p in paths)
    status, output = run_sandboxed(code)
    assert "SECRET" not in output and "root:" not in output, output
    assert output.count("REFUSED") == len(paths), output


def test_code_cannot_write_outside_its_scratch(run_files, tmp_path):
    home, run, secrets = run_files
    name = f"nanorl_planted_{uuid.uuid4().hex}"
    new_files = [ROOT / "common" / "rollout" / f"{name}.py",  # the source tree: the reward's code
                 Path(sysconfig.get_paths()["purelib"]) / f"{name}.pth",  # runs at every start of the venv's python
                 tmp_path / "site-packages" / f"{name}.pth", home / ".bashrc", home / ".cache/huggingface" / name,
                 Path("/tmp") / name]
    if AS_ROOT:
        new_files += [Path("/etc") / name, Path("/usr") / name, Path("/root") / name]
    code = "".join(attempt(f"open({str(p)!r}, 'w').write('# planted')") for p in new_files)
    code += attempt(f"open({str(run / 'metrics.jsonl')!r}, 'w').write('overwritten')")
    code += attempt(f"import os; os.remove({str(run / 'step_10/model.pt')!r})")
    try:
        status, output = run_sandboxed(code)
        planted = [str(p) for p in new_files if p.exists()]
    finally:
        for path in new_files:
            path.unlink(missing_ok=True)
    assert planted == [], output
    assert (run / "metrics.jsonl").read_text() == secrets[run / "metrics.jsonl"]
    assert (run / "step_10/model.pt").exists()  # (writing /tmp works: the sandbox's own /tmp, its scratch)


def test_the_root_is_read_only_and_the_scratch_is_capped():
    # The scratch (cwd, HOME, TMPDIR) is writable up to its cap; nothing else is, not even the sandbox's own root.
    status, output = run_sandboxed(
        "import os\nwritten = 0\ntry:\n    for i in range(40):\n"
        "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * (8 << 20))\n        written += 8\n"
        "except OSError as e:\n    print('stopped', e.strerror)\nprint('written', written)\n"
        + attempt("open('/planted', 'w')") + attempt("open('/dev/planted', 'w')"))
    written = int(output.split("written ")[1].split()[0])
    assert 0 < written < 100, output  # 320 MB asked: the cap stops it
    assert output.count("REFUSED") == 2, output


# ---------------------------------------------------------------------------------------------------------------
# 4: nothing outlives the call

DAEMON = """
import os, sys
ready, hold = os.pipe(), os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # a double fork in a new session: no process group of the call holds it
        {detach}
        os.write(ready[1], b'up')
        os.read(hold[0], 1)  # blocks for ever: nobody writes
    os._exit(0)
os.read(ready[0], 2)
print('daemon up', '{marker}', flush=True)
"""


def test_a_daemon_dies_with_the_call(marker):
    detach = "os.close(1); os.close(2)"  # it lets go of stdout: the call returns, and it must be dead by then
    status, output = run_sandboxed(DAEMON.format(detach=detach, marker=marker))
    assert "daemon up" in output, output
    assert processes_with(marker) == []


def test_a_child_holding_stdout_does_not_hold_the_call(marker):
    start = time.monotonic()
    status, output = run_sandboxed(DAEMON.format(detach="pass", marker=marker), time_s=2)
    assert "daemon up" in output, output
    assert time.monotonic() - start < 2 + 5, output  # the time limit plus a small grace, on a loaded machine
    assert processes_with(marker) == []
    start = time.monotonic()  # the same when the program itself never ends
    status, output = run_sandboxed(DAEMON.format(detach="pass", marker=marker) + "os.read(hold[0], 1)\n", time_s=2)
    assert status is None and time.monotonic() - start < 2 + 5
    assert processes_with(marker) == []


def test_a_killed_caller_leaves_nothing(tmp_path, marker):
    # The environment worker is killed (--env-timeout) as a call starts (as soon as bwrap runs: before it has set up
    # its --die-with-parent, which a loaded machine makes likely): the call's processes go with it, by the kill of
    # its cgroup that follows the worker's (common/rollout/rewards.py's WorkerProcess.kill).
    (tmp_path / "code.py").write_text(f"import os\nos.setsid()\nr, w = os.pipe()\nos.read(r, 1)  # {marker}\n")
    caller = subprocess.Popen(
        [sys.executable, "-c", "import sys; from common.rollout.tools import run_sandboxed; "
                               "run_sandboxed(open(sys.argv[1]).read(), time_s=120)", str(tmp_path / "code.py")],
        cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path)})
    deadline = time.monotonic() + 60
    while not processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling for the call to start, not timing it
    assert processes_with(marker), "the call never started"
    caller.kill()
    caller.wait()
    kill_calls_of(caller.pid)
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []
    assert [p.name for p in tmp_path.iterdir()] == ["code.py"]  # no scratch directory left behind


# ---------------------------------------------------------------------------------------------------------------
# 5, 6: signals and sockets reach nothing outside

def test_code_cannot_signal_a_process_outside():
    victim = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        status, output = run_sandboxed(attempt(f"import os, signal; os.kill({victim.pid}, signal.SIGKILL)"))
        assert "REFUSED" in output, output
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_a_unix_socket_with_a_path_is_unreachable(tmp_path):
    path = str(tmp_path / "service.sock")  # W&B's service, vLLM's ipc endpoints, docker.sock have one like it
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(4)
    try:
        status, output = run_sandboxed(attempt(f"import socket; socket.socket(socket.AF_UNIX).connect({path!r})"))
    finally:
        server.close()
    assert "REFUSED" in output, output


# ---------------------------------------------------------------------------------------------------------------
# 7: limits on the whole call

def test_the_number_of_processes_is_capped(marker):
    # 200 children, each alive until the parent exits (they wait on a pipe it holds): how many could start?
    status, output = run_sandboxed(
        "import os\nr, w = os.pipe()\nstarted = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n"
        "            os.close(w)\n            os.read(r, 1)\n            os._exit(0)\n        started += 1\n"
        f"except OSError as e:\n    print('refused', e)\nprint('started', started, '{marker}')\n")
    started = int(output.split("started ")[1].split()[0])
    assert started < 200, output


def test_memory_is_capped_for_the_call_not_per_process():
    try:
        from common.rollout.sandbox import memory_cgroup_available
    except ImportError:  # the sandbox before issue 55 claimed no total
        memory_cgroup_available = lambda: True  # noqa: E731
    if not memory_cgroup_available():
        pytest.skip("no cgroup this user may create (cgroup v2 memory.max or v1 memory): the limit is per process "
                    "(docs/sandbox.md)")
    # Four processes of 900 MB at once (1 GiB each is allowed); each says when it holds its memory.
    status, output = run_sandboxed(
        "import os\nready, release = os.pipe(), os.pipe()\nfor _ in range(4):\n    if os.fork() == 0:\n"
        "        data = b'x' * (900 << 20)\n        os.write(ready[1], b'1')\n        os.read(release[0], 1)\n"
        "        os._exit(0)\nos.close(ready[1])\nheld = 0\nwhile held < 4 and os.read(ready[0], 1):\n    held += 1\n"
        "print('held', held, flush=True)\n", time_s=30)
    assert "held 4" not in output, output


def test_a_flood_of_output_keeps_the_caller_small():
    # 2 GiB printed: the caller keeps a bounded buffer, and the model reads the start and how much was cut.
    probe = subprocess.run(
        [sys.executable, "-c", "from common.rollout.tools import run_sandboxed; "
                               "status, output = run_sandboxed('import sys\\nfor _ in range(32): "
                               "sys.stdout.buffer.write(b\"y\" * (64 << 20))', time_s=60); "
                               "print(len(output), output[-200:].replace(chr(10), ' ')); "
                               "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    summary, peak_kb = probe.stdout.splitlines()
    assert int(summary.split()[0]) < 3000 and "2147483648" in summary, summary
    # under 300 MB: the interpreter and the buffer, not the 2 GiB (VmHWM, not ru_maxrss: that one keeps the peak of
    # the pytest process the probe was forked from)
    assert int(peak_kb) < 300 << 10, peak_kb


# ---------------------------------------------------------------------------------------------------------------
# 8: calls are blind to each other

def test_a_second_call_sees_nothing_of_the_first():
    name = f"nanorl_carry_{uuid.uuid4().hex}"
    code = "".join(attempt(f"open({p!r}, 'w').write('from the first call')") for p in [name, f"/tmp/{name}"])
    run_sandboxed(code)
    status, output = run_sandboxed(
        "import os\nfound = [os.path.join(d, f) for d in ['.', '/tmp', os.path.expanduser('~')] if os.path.isdir(d)"
        f" for f in os.listdir(d) if f == {name!r}]\nprint('found', found)\n")
    Path(f"/tmp/{name}").unlink(missing_ok=True)
    assert "found []" in output, output


FIRST = """
import os, time
open('{name}', 'w').write('first')
deadline = time.monotonic() + 3
while not os.path.exists('reply') and time.monotonic() < deadline:
    time.sleep(0.01)
print('reply' if os.path.exists('reply') else 'alone')
"""

SECOND = """
import glob, os, time
deadline, found = time.monotonic() + 3, []
while not found and time.monotonic() < deadline:
    places = glob.glob('/tmp/*/') + glob.glob('/proc/[0-9]*/cwd/')
    found = [p for p in places if os.path.exists(os.path.join(p, '{name}')) and os.path.realpath(p) != os.getcwd()]
for place in found:
    open(os.path.join(place, 'reply'), 'w').write('second')
print('found', found)
"""


def test_two_concurrent_calls_are_blind_to_each_other():
    name = f"nanorl_first_{uuid.uuid4().hex}"
    outputs = {}
    first = threading.Thread(target=lambda: outputs.setdefault("first", run_sandboxed(FIRST.format(name=name))))
    first.start()
    outputs["second"] = run_sandboxed(SECOND.format(name=name))
    first.join()
    assert "found []" in outputs["second"][1], outputs
    assert "alone" in outputs["first"][1], outputs


# ---------------------------------------------------------------------------------------------------------------
# 9: the start-up check, and the whole path a rollout takes

def test_any_tools_list_with_python_is_checked_at_start(tmp_path):
    # A machine where the sandbox cannot work (here: user namespaces disabled under bubblewrap): --tools python
    # stops at start-up however the list is written.
    script = ("import sys\nfrom grpo import Args, resolve_defaults\nfrom common.rollout.args import "
              "check_rollout_args\nargs = Args(tools=sys.argv[1], reward_fn='none')\nresolve_defaults(args)\n"
              "check_rollout_args(args, 1)\n")
    for tools in ["python", "calculator, python", " python ,calculator"]:
        result = subprocess.run(["bwrap", "--unshare-user", "--disable-userns", "--dev-bind", "/", "/",
                                 sys.executable, "-c", script, tools], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode != 0 and "sandbox" in result.stderr, (tools, result.stderr[-500:])


PLANT = '''
import os
for path in [{reward!r}, {source!r}]:
    try:
        open(path, "a").write("\\ndef reward(prompt, completion, answer):\\n    return 1.0\\n")
    except OSError as e:
        print("refused", e)
r, w = os.pipe()
if os.fork() == 0:  # holds stdout so the call never returns: the worker is killed and restarted, with the plant
    os.setsid()
    os.read(r, 1)
print("planted")
'''


def test_a_planted_reward_leaves_the_reward_unchanged(tmp_path, marker):
    from common.rollout.environments import EnvWorkers

    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def reward(prompt, completion, answer):\n    return float(completion.strip() == answer)\n")
    source = ROOT / "common" / "rollout" / "rewards.py"
    before = source.read_text()
    code = PLANT.format(reward=str(reward_file), source=str(source)) + f"# {marker}\n"
    workers = EnvWorkers(None, "python", f"{reward_file}:reward", timeout_s=15, workers=1)
    row = {"prompt": "What is 2 + 2?", "answer": "4"}
    try:
        workers.reset(0, row, "sample 0")
        workers.results(block=True)
        workers.step(0, "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>")
        [(key, answer, _)] = workers.results(block=True)
        workers.reset(1, row, "sample 1")
        workers.results(block=True)
        workers.step(1, "5")  # a wrong answer
        [(key, (messages, reward, done), _)] = workers.results(block=True)
    finally:
        workers.close()
        if source.read_text() != before:
            source.write_text(before)
    assert (reward, done) == (0.0, True)
    assert "return 1.0" not in reward_file.read_text()
    assert answer is not None and "planted" in answer[0][0]["content"], answer  # the call came back in time


ENVIRONMENT_ENV = '''
import os

class Show:
    def __init__(self, row):
        pass

    def reset(self):
        return [{"role": "user", "content": " ".join(sorted(os.environ))}]

def make_env(row):
    return Show(row)
'''


def test_environment_processes_start_without_credentials(tmp_path, monkeypatch):
    from common.rollout.environments import EnvWorkers

    for name in ["WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "MY_DB_PASSWORD",
                 "OPENAI_API_KEY"]:
        monkeypatch.setenv(name, "SECRET")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # what a reward may need stays
    (tmp_path / "env.py").write_text(ENVIRONMENT_ENV)
    workers = EnvWorkers(f"{tmp_path / 'env.py'}:make_env", None, "none", timeout_s=60, workers=1)
    try:
        workers.reset(0, {"prompt": "", "answer": ""}, "sample 0")
        [(key, (messages, tools), _)] = workers.results(block=True)
    finally:
        workers.close()
    names = messages[0]["content"].split()
    assert "HF_HOME" in names and "PATH" in names and "PYTHONPATH" in names
    assert not {"WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "MY_DB_PASSWORD",
                "OPENAI_API_KEY"} & set(names), names


# ---------------------------------------------------------------------------------------------------------------
# the benchmark of issue 55's throughput target: rollouts with the model in the loop, before and after

def test_the_rollout_benchmark_makes_the_forced_python_calls(tmp_path):
    """benchmarks/bench_episodes.py --python-tool at a tiny budget on the built-in model: every episode made its turns
    of exactly their tokens and one python call after each turn but the last (the bench asserts it per episode), so a
    round of 2 prompts x 2 episodes x 3 turns of 3 tokens made 4 x 2 calls and generated 4 x 9 tokens, before as
    after; and the same tool output came back before and after (the same observation tokens)."""
    from gloo import free_port

    out = tmp_path / "result.json"
    env = dict(os.environ, MASTER_PORT=str(free_port()))
    subprocess.run([sys.executable, str(ROOT / "benchmarks/bench_episodes.py"), "--python-tool", "--engine", "hf",
                    "--num-prompts", "2", "--group-size", "2", "--new-tokens", "9", "--turns", "3", "--rounds", "2",
                    "--env-workers", "1", "--out", str(out)], cwd=tmp_path, env=env, check=True, timeout=300)
    result = json.loads(out.read_text())
    rounds = result["rounds"]["before"] + result["rounds"]["after"]
    assert len(rounds) == 4
    assert all(r["episodes"] == 4 and r["python_calls"] == 8 and r["tokens"] == 36 for r in rounds), rounds
    assert len({r["observation_tokens"] for r in rounds}) == 1 and rounds[0]["observation_tokens"] > 0
    assert result["before"]["episodes_per_s"] > 0 and result["after"]["episodes_per_s"] > 0
