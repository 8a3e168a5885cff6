"""Fast launches of a script's ranks for tests: one process imports the scripts once, then forks a fresh process
per rank for every run, with the environment torchrun would give it.

A rank of a tiny CPU run spends most of its life importing torch and transformers (about 6 s, on each of two
ranks sharing two cores); forked from a process that already did, it starts at once. What runs is the script's
own main() under a gloo world, exactly as under torchrun; only torchrun's agent is missing, so the tests of what
torchrun itself does (passing signals on, dying) launch through torchrun.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_server, _lock = None, threading.Lock()


def _send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack(">Q", len(data)) + data)
    stream.flush()


def _recv(stream):
    header = stream.read(8)
    return None if len(header) < 8 else pickle.loads(stream.read(struct.unpack(">Q", header)[0]))


def run(script: str, args: list[str], cwd, nproc: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """Like subprocess.run of `torchrun --nproc_per_node nproc script args` (returncode 0 if every rank exited 0)."""
    global _server
    with _lock:
        if _server is None or _server.poll() is not None:
            _server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
            atexit.register(_server.kill)
        with tempfile.TemporaryDirectory() as logs:
            _send(_server.stdin, {"script": os.path.join(ROOT, script), "args": [str(a) for a in args],
                                  "cwd": str(cwd), "nproc": nproc, "env": env, "timeout": timeout, "logs": logs})
            reply = _recv(_server.stdout)
            out, err = (open(os.path.join(logs, name), errors="replace").read() for name in ("out", "err"))
    command = ["forked", script, *map(str, args)]
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(command, timeout, out, err)
    return subprocess.CompletedProcess(command, reply["returncode"], out, err)


# ---------------------------------------------------------------------------------------------------------------
# The server: started once per test session, it never computes anything itself (a fork after torch has run
# parallel work could inherit a broken thread pool), it only imports and forks.

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(module, request: dict, rank: int, port: int) -> None:
    """In the forked child: become rank `rank` and run the script's main()."""
    os.setpgid(0, 0)  # a process group of its own, as torchrun gives its workers a session
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # not the server's requests
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(request["nproc"]),
                      LOCAL_WORLD_SIZE=str(request["nproc"]), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="forked", TORCHELASTIC_USE_AGENT_STORE="True")
    for fd, name in ((1, "out"), (2, "err")):
        log = os.open(os.path.join(request["logs"], name), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, fd)
    sys.argv = [request["script"], *request["args"]]
    from common.errors import run_main
    code = 0
    try:
        run_main(module.main)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve() -> None:
    import torch.distributed as dist  # imported once here, for every rank of every run
    modules = {}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while (request := _recv(stdin)) is not None:
        script = request["script"]
        if script not in modules:
            spec = importlib.util.spec_from_file_location(f"launched_{len(modules)}", script)
            modules[script] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(modules[script])
        port, pids = _free_port(), []
        # The ranks' key-value store lives here, as torchrun's agent hosts it: it outlives any one rank.
        store = dist.TCPStore("127.0.0.1", port, request["nproc"], is_master=True, wait_for_workers=False)
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(modules[script], request, rank, port)
            pids.append(pid)
        deadline, failed_at = time.monotonic() + request["timeout"], None
        statuses = {}
        while len(statuses) < len(pids):
            for pid in pids:
                if pid in statuses:
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = os.waitstatus_to_exitcode(status)
                    if statuses[pid] != 0 and failed_at is None:
                        failed_at = time.monotonic()
            now = time.monotonic()
            # Like torchrun: once one rank failed, the others get a while to leave, then are stopped.
            if now > deadline or failed_at is not None and now > failed_at + 30:
                for pid in pids:
                    if pid not in statuses:
                        os.killpg(pid, signal.SIGKILL)
            time.sleep(0.02)
        del store
        codes = list(statuses.values())
        _send(stdout, {"returncode": next((1 if c < 0 else c for c in codes if c != 0), 0),
                       "timed_out": time.monotonic() > deadline})


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    _serve()
