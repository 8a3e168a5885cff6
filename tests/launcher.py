"""Fast launches of a script's ranks for tests: one process imports the scripts once, then forks a fresh process
per rank for every run, with the environment torchrun would give it.

A rank of a tiny CPU run spends most of its life importing torch and transformers (about 6 s, on each of two
ranks sharing two cores); forked from a process that already did, it starts at once. What runs is the script's
own main() under a gloo world, exactly as under torchrun; only torchrun's agent is missing, so the tests of what
torchrun itself does (passing signals on, dying) launch through torchrun.

spawn() does the same for a test's own function on N ranks, in place of torch.multiprocessing.spawn (which starts
a fresh interpreter per rank, and imports torch and the test module again in each).
"""

import atexit
import importlib.util
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_server, _lock = None, threading.Lock()


def _send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack(">Q", len(data)) + data)
    stream.flush()


def _recv(stream):
    header = stream.read(8)
    return None if len(header) < 8 else pickle.loads(stream.read(struct.unpack(">Q", header)[0]))


def _ask(request: dict) -> tuple[dict, str, str]:
    """Sends one request to the server (started on first use); returns its reply and the ranks' stdout, stderr."""
    global _server
    with _lock:
        if _server is None or _server.poll() is not None:
            _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
            atexit.register(_server.kill)
        with tempfile.TemporaryDirectory() as logs:
            _send(_server.stdin, {**request, "logs": logs})
            reply = _recv(_server.stdout)
            out, err = (open(os.path.join(logs, name), errors="replace").read()
                        if os.path.exists(os.path.join(logs, name)) else "" for name in ("out", "err"))
    if reply is None:
        raise RuntimeError(f"the launcher's server died (exit code {_server.wait()})")
    return reply, out, err


def run(script: str, args: list[str], cwd, nproc: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Like subprocess.run of `torchrun --nproc_per_node nproc script args` (returncode 0 if every rank exited 0)."""
    reply, out, err = _ask({"script": os.path.join(ROOT, script), "args": [str(a) for a in args], "cwd": str(cwd),
                            "nproc": nproc, "env": env, "timeout": timeout, "grace": 30})
    command = ["forked", script, *map(str, args)]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(command, timeout, out, err)
    return subprocess.CompletedProcess(command, reply["returncode"], out, err)


def spawn(fn, args: tuple = (), nprocs: int = 1, timeout: float = 300) -> None:
    """Like torch.multiprocessing.spawn(fn, args, nprocs, join=True): runs fn(rank, *args) on nprocs processes and
    raises if any of them fails, after stopping the others, or if they are not done within `timeout` seconds (ranks
    stuck in a collective would otherwise wait for gloo's 30 minutes). fn must be a module-level function of a test
    module (it travels by name, as with spawn); the ranks get this process's environment and working directory."""
    reply, out, err = _ask({"function": pickle.dumps((fn, tuple(args))), "cwd": os.getcwd(), "nproc": nprocs,
                            "env": dict(os.environ), "timeout": timeout, "grace": 0})
    name = f"{fn.__module__}.{fn.__qualname__}"
    if reply.get("error"):
        raise RuntimeError(f"the launcher could not load {name}:\n{reply['error']}")
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(["forked", name], timeout, out, err)
    if reply["returncode"] != 0:
        raise RuntimeError(f"{name} failed (exit codes of its {nprocs} ranks: {reply['codes']}):\n{out}\n{err}")


# ---------------------------------------------------------------------------------------------------------------
# The server: started once per test session, it never computes anything itself (a fork after torch has run
# parallel work could inherit a broken thread pool), it only imports and forks.

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _enter_rank(request: dict, env: dict) -> None:
    """In the forked child: a process group of its own (as torchrun gives its workers a session), the request's
    working directory and environment, and its output into the run's logs."""
    os.setpgid(0, 0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the server's requests
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
    for fd, name in ((1, "out"), (2, "err")):
        log = os.open(os.path.join(request["logs"], name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, fd)


def _leave_rank(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _script_rank(module, request: dict, rank: int, port: int) -> None:
    """In the forked child: become rank `rank` of a torchrun world and run the script's main()."""
    nproc = str(request["nproc"])
    _enter_rank(request, {**request["env"], "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": nproc,
                          "LOCAL_WORLD_SIZE": nproc, "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "forked",
                          "TORCHELASTIC_USE_AGENT_STORE": "True"})
    sys.argv = [request["script"], *request["args"]]
    from common.run.cli import run_main
    code = 0
    try:
        run_main(module.main, module.Args)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    _leave_rank(code)


def _function_rank(fn, args: tuple, request: dict, rank: int) -> None:
    """In the forked child: fn(rank, *args), as torch.multiprocessing.spawn calls it (fn sets up its own world)."""
    _enter_rank(request, request["env"])
    code = 0
    try:
        fn(rank, *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    _leave_rank(code)


def _wait(pids: list[int], timeout: float, grace: float) -> dict:
    """Waits for every rank; once one failed, the others get `grace` seconds to leave, then are stopped (torchrun
    waits a while, torch.multiprocessing.spawn not at all). Returns the exit codes and whether time ran out."""
    deadline, failed_at = time.monotonic() + timeout, None
    codes = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and failed_at is None:
                    failed_at = time.monotonic()
        now = time.monotonic()
        if now > deadline or failed_at is not None and now >= failed_at + grace:
            for pid in pids:
                if pid not in codes:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:  # not yet in its own group, or already gone
                        os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    codes = [codes[pid] for pid in pids]
    return {"returncode": next((1 if c < 0 else c for c in codes if c != 0), 0), "codes": codes,
            "timed_out": time.monotonic() > deadline}


def _fork_ranks(nproc: int, become_rank) -> list[int]:
    pids = []
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            become_rank(rank)  # never returns
        pids.append(pid)
    return pids


def _serve() -> None:
    import torch.distributed as dist  # imported once here, for every rank of every run
    # And what every rank of a tiny run imports on first use: the built-in Llama model (most of transformers'
    # modelling code, and scipy with it) and tyro's parser, about 1 s a rank otherwise.
    import transformers.models.llama.modeling_llama  # noqa: F401
    import tyro  # noqa: F401
    modules = {}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (request := _recv(stdin)) is not None:
        if "function" in request:
            try:  # imports the function's test module here, once for every later run of its functions
                fn, args = pickle.loads(request["function"])
            except Exception:
                _send(stdout, {"error": traceback.format_exc()})
                continue
            pids = _fork_ranks(request["nproc"], lambda rank: _function_rank(fn, args, request, rank))
            _send(stdout, _wait(pids, request["timeout"], request["grace"]))
            continue
        script = request["script"]
        if script not in modules:
            spec = importlib.util.spec_from_file_location(f"launched_{len(modules)}", script)
            modules[script] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[script])
        port = _free_port()
        # The ranks' key-value store lives here, as torchrun's agent hosts it: it outlives any one rank.
        store = dist.TCPStore("127.0.0.1", port, request["nproc"], is_master=True, wait_for_workers=False)
        pids = _fork_ranks(request["nproc"], lambda rank: _script_rank(modules[script], request, rank, port))
        reply = _wait(pids, request["timeout"], request["grace"])
        del store
        _send(stdout, reply)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)  # the scripts' own imports; this folder (sys.path[0]) holds the test modules
    _serve()
