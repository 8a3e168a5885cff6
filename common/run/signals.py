"""Stopping a run on purpose: SIGTERM (Slurm preemption, torchrun), SIGUSR1 (time limit) and Ctrl-C all mean
"finish this step, save, exit", on every rank of either placement; a rank whose launcher died leaves at once.

The handler only records the signal: saving needs collectives, which cannot run inside a handler at an arbitrary
point of the step, so the loop asks `stop_agreed` once per step, on every rank, and all ranks stop after the same
step. Work that could hold the step up for good (a stuck reward) polls `stop_requested` and gives up on it after a
few seconds (rewards.RewardScorer), so the step still completes and is saved.
One request, however it arrives: Slurm signals every process of a job and torchrun passes the signal on again, so a
rank often gets SIGTERM twice, and a user may `scancel` twice. Only a deliberate act stops at once without saving:
Ctrl-C a second time (SIGINT, which no scheduler sends by itself), or SIGKILL. That exit stops the child processes
first (errors.on_abort).
"""

import os
import signal
import sys
import threading
import time

from common.run import errors

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
_received: str | None = None  # name of the first stop signal
_interrupts = 0  # SIGINTs received: the second one stops at once
_installed = False
_announce = True  # rank 0 says what the first signal does


def _handle(signum, frame) -> None:
    global _received, _interrupts
    name = signal.Signals(signum).name
    _interrupts += signum == signal.SIGINT
    if _interrupts >= 2:  # Ctrl-C twice: leave now, without saving
        _write(f"{name} again: stopping at once, without saving (the last saved state remains)")
        errors.run_abort_hooks()
        os._exit(128 + signum)
    if _received is not None:  # the same request again (Slurm and torchrun both pass SIGTERM on): already stopping
        return
    _received = name
    if errors.launch_rank() == 0 and _announce:
        _write(f"{name}: finishing this step, then saving and stopping (Ctrl-C twice stops at once, without saving)")


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
    from common.run.distributed import max_over_ranks  # imported here: distributed.py loads torch, which the reward
    # processes (common/rollout/rewards.py) that import this module do without
    return max_over_ranks(int(_received is not None), device) > 0


def request_stop(name: str) -> None:
    """Records a stop request that reached another process (a rollout rank's signal, passed on with its batch)."""
    global _received
    _received = _received or name


def reset() -> None:
    """Forget a received signal (tests)."""
    global _received, _interrupts
    _received, _interrupts = None, 0


def crash_point(name: str, step: int) -> None:
    """Tests only: NANORL_TEST_CRASH=name:step kills this process (SIGKILL, as a node failure would) when it gets
    here at that step, so a test can stop a run between two writes deterministically. Options after the step, each
    after a colon: rank=R (only the launch's rank R), once (only before torchrun's first restart), raise (raise an
    error instead: a bug that repeats at the same step), oom (raise a CUDA out-of-memory error instead), hang (wait for ever instead: a rank stuck outside the
    collective the others wait in), until=PATH (wait instead until PATH exists, after creating PATH.reached: a
    hand-shake with a test that acts on the run while it waits there)."""
    point = os.environ.get("NANORL_TEST_CRASH", "").split(":")
    if point[:2] != [name, str(step)]:
        return
    options = point[2:]
    if not _for_this_rank(options):
        return
    if "once" in options and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    if "raise" in options:
        raise RuntimeError(f"test crash point {name} at step {step}")
    if "oom" in options:  # as a CUDA allocation that fails
        import torch
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (test crash point {name} at "
                                     f"step {step})")
    while "hang" in options:
        time.sleep(1)
    if until := next((o.removeprefix("until=") for o in options if o.startswith("until=")), None):
        open(until + ".reached", "w").close()
        while not os.path.exists(until):
            time.sleep(0.1)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def signal_point(name: str, step: int) -> None:
    """Tests only: NANORL_TEST_SIGNAL=name:step sends SIGTERM, when this process gets to `name` at that step, to
    every process of the launch (as Slurm signals every process of a job); options after the step, each after a
    colon: self (to this process alone), rank=R (only the launch's rank R acts). A stop signal at a chosen moment,
    deterministically."""
    point = os.environ.get("NANORL_TEST_SIGNAL", "").split(":")
    if point[:2] != [name, str(step)] or not _for_this_rank(point[2:]):
        return
    from common.run import distributed  # imported here, as in stop_agreed
    pids = [os.getpid()] if "self" in point[2:] else \
        [int(distributed.kv_store.get(f"nanorl/pid/{r}")) for r in range(distributed.launch_world)]
    for pid in pids:
        os.kill(pid, signal.SIGTERM)


def _for_this_rank(options: list[str]) -> bool:
    from common.run import distributed  # imported here, as in stop_agreed
    wanted = [o.removeprefix("rank=") for o in options if o.startswith("rank=")]
    return not wanted or str(distributed.launch_rank) in wanted
