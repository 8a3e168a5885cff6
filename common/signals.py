"""Stopping a run on purpose: SIGTERM (Slurm preemption, torchrun), SIGUSR1 (time limit) and Ctrl-C all mean
"finish this step, save, exit"; a second one means "exit now"; a rank whose launcher died leaves too.

The handler only records the signal: saving needs collectives, which cannot run inside a handler at an arbitrary
point of the step, so the loop asks `stop_agreed` once per step, on every rank, and all ranks stop after the same
step. Work that may never finish (a stuck reward) polls `stop_requested` while it waits and gives up
(errors.StopRequested): that step is abandoned and the last saved state is the one to resume from.
Nothing here can be interrupted by the first signal alone, so a second signal (or a parent gone) ends the process
at once, after stopping its child processes (errors.on_abort).
"""

import os
import signal
import sys
import threading
import time

from common import errors

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_received: str | None = None  # name of the first stop signal
_installed = False
_announce = True  # rank 0 says what the first signal does


def _handle(signum, frame) -> None:
    global _received
    name = signal.Signals(signum).name
    if _received is not None:  # the second one: leave now, without saving
        _write(f"{name} again: stopping at once, without saving (the last saved state remains)")
        errors.run_abort_hooks()
        os._exit(128 + signum)
    _received = name
    if errors._launch_rank() == 0 and _announce:
        again = "Ctrl-C" if signum == signal.SIGINT else "the signal"
        _write(f"{name}: finishing this step, then saving and stopping ({again} again stops at once)")


def _write(message: str) -> None:
    try:
        os.write(sys.stderr.fileno(), (message + "\n").encode())
    except OSError:
        pass


def install_stop_handlers(announce: bool = True) -> None:
    """SIGTERM, SIGINT and SIGUSR1 now mean "stop after this step and save"; and leave if the parent dies
    (torchrun killed: its ranks would otherwise live on as orphans, waiting for each other)."""
    global _installed, _announce
    _announce = announce
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handle)
    if not _installed:
        _installed = True
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def exit_on_stop_signals() -> None:
    """For ranks that hold no state to save (split placement's rollout ranks): a stop signal ends them at once,
    after their child processes; and they leave if the parent dies."""
    global _installed

    def leave(signum, frame):
        errors.run_abort_hooks()
        os._exit(128 + signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, leave)
    if not _installed:
        _installed = True
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1)
    _write("the launching process is gone: stopping at once")
    errors.run_abort_hooks()
    os._exit(1)


def stop_requested() -> str | None:
    """The name of the stop signal this rank received, or None."""
    return _received


def stop_agreed(device) -> bool:
    """Collective: True on every rank if any rank received a stop signal, so all ranks stop after the same step."""
    from common.distributed import max_over_ranks
    return max_over_ranks(int(_received is not None), device) > 0


def reset() -> None:
    """Forget a received signal (tests)."""
    global _received
    _received = None


def crash_point(name: str, step: int) -> None:
    """Tests only: NANORL_TEST_CRASH=name:step kills this process (SIGKILL, as a node failure would) when it gets
    here at that step, so a test can stop a run between two writes deterministically."""
    if os.environ.get("NANORL_TEST_CRASH") == f"{name}:{step}":
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
