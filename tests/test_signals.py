"""Stop signals (common/run/signals.py): a signal on one rank stops every rank after the same step, a second one exits
at once after stopping child processes, a rank whose launcher died leaves, and test crash points fire exactly."""

import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import launcher
from gloo import finish_gloo, free_port, init_gloo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def agreement_worker(rank: int, world: int, port: int, out: str):
    from common.run.signals import install_stop_handlers, stop_agreed, stop_requested
    init_gloo(rank, world, port)
    install_stop_handlers(announce=False)
    before = stop_agreed(torch.device("cpu"))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches only one rank
    dist.barrier()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"before": before, "after": stop_agreed(torch.device("cpu")), "received": stop_requested()}, f)
    finish_gloo()


def test_a_signal_on_one_rank_stops_every_rank(tmp_path):
    launcher.spawn(agreement_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["before"] for r in results] == [False, False]
    assert [r["after"] for r in results] == [True, True]  # the rank without the signal stops too
    assert [r["received"] for r in results] == [None, "SIGINT"]


def run_python(code: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def test_second_signal_exits_at_once_after_stopping_children(tmp_path):
    """The first Ctrl-C only asks for a stop (the loop would finish its step); the second leaves now, with exit
    code 128 + SIGINT, after the abort hooks (which stop reward processes)."""
    marker = tmp_path / "hook_ran"
    proc = run_python(
        "import os, signal, time\n"
        "from common.run import errors\n"
        "from common.run.signals import install_stop_handlers, stop_requested\n"
        f"errors.on_abort(lambda: open({str(marker)!r}, 'w').close())\n"
        "install_stop_handlers()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('after the first:', stop_requested(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
        "print('not reached', flush=True)\n")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "after the first: SIGINT" in out and "not reached" not in out
    assert "Ctrl-C twice stops at once" in err and "stopping at once, without saving" in err
    assert marker.exists()


def test_a_repeated_stop_signal_is_one_request():
    """Slurm signals every process of a job and torchrun passes SIGTERM on again; a user may scancel twice, and the
    time limit's USR1 may follow: all one request to finish the step and save, never an exit without saving."""
    proc = run_python(
        "import os, signal\n"
        "from common.run.signals import install_stop_handlers, stop_requested\n"
        "install_stop_handlers()\n"
        "for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):\n"
        "    os.kill(os.getpid(), sig)\n"
        "print('still running after five:', stop_requested(), flush=True)\n")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "still running after five: SIGTERM" in out and "stopping at once" not in err


def test_a_rank_whose_launcher_died_leaves(tmp_path):
    """torchrun killed with SIGKILL cannot pass anything on: its ranks notice their parent is gone and exit."""
    child_code = ("import time\nfrom common.run.signals import install_stop_handlers\ninstall_stop_handlers()\n"
                  "print('ready', flush=True)\ntime.sleep(60)\n")
    parent = run_python(
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child_code!r}], stdout=subprocess.PIPE, text=True)\n"
        "child.stdout.readline()\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n")
    child_pid = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.time() + 15
    while os.path.exists(f"/proc/{child_pid}") and time.time() < deadline:
        with open(f"/proc/{child_pid}/stat") as f:  # an exited orphan is reaped by init; a zombie counts as gone
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.2)
    else:
        assert not os.path.exists(f"/proc/{child_pid}"), "the rank outlived its launcher"


def test_crash_point_kills_only_at_its_step():
    code = ("from common.run.signals import crash_point\n"
            "for step in range(1, 5):\n    crash_point('after_row', step)\n    print(step, flush=True)\n")
    env = {**os.environ, "PYTHONPATH": ROOT, "NANORL_TEST_CRASH": "after_row:3"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGKILL and result.stdout.split() == ["1", "2"]
