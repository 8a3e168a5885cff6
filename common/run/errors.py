"""How every script fails: one clear line for a user's mistake, one traceback for a bug, printed once for all ranks.

A run of N ranks that fails would otherwise print N copies of the same traceback, most of them from ranks that
only noticed that another one stopped. Here the first rank to fail claims the report through torchrun's key-value
store (a counter every rank can reach, even when collectives are broken) and prints it; the others stay silent.
User errors (bad flags, paths, data, rewards: ValueError, OSError, RewardError) print as one line;
anything else is a bug and keeps its traceback. `NANORL_TRACEBACK=1` shows the traceback of user errors too.
"""

import os
import sys
import traceback

USER_ERRORS = (ValueError, OSError)  # and every class registered with user_error below
_store = None  # torchrun's key-value store, set once the ranks have met (common.run.distributed)
_global_rank = None  # this process's rank in the launch, set with the store (split placement renumbers RANK)
_abort_hooks = []  # cleanups that must run even when the process leaves with os._exit (reward processes)
_report_file = None  # the run directory's record of the last failure (record_reports_in)
_describe_out_of_memory = None  # the planner's line for a GPU out of memory (on_out_of_memory)


class PeerFailed(RuntimeError):
    """Raised on every rank but the one that failed (common.run.distributed.raise_on_all_ranks); that one reports."""


def user_error(cls: type) -> type:
    """Class decorator: errors of this class are the user's to fix, reported as one line."""
    global USER_ERRORS
    USER_ERRORS = (*USER_ERRORS, cls)
    return cls


def use_store(store, global_rank: int | None = None) -> None:
    global _store, _global_rank
    _store, _global_rank = store, global_rank


def launch_rank() -> int:
    return _global_rank if _global_rank is not None else int(os.environ.get("RANK", "0"))


def on_out_of_memory(describe_error) -> None:
    """`describe_error(error)` says in one line what an out-of-memory error at start-up means. The capacity planner
    registers it (common/run/run_plan.py), so that this module, which every other relies on, imports none of them."""
    global _describe_out_of_memory
    _describe_out_of_memory = describe_error


def on_abort(hook) -> None:
    """Runs `hook()` before the process leaves through report_and_exit or a second stop signal."""
    _abort_hooks.append(hook)


def run_abort_hooks() -> None:
    for hook in _abort_hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass


def first_to_report() -> bool:
    """True on exactly one rank: the first to fail (the store's counter), or rank 0 before the ranks have met."""
    if _store is None:
        return launch_rank() == 0
    try:
        return _store.add("nanorl/failures", 1) == 1
    except Exception:  # noqa: BLE001 - the store is gone (torchrun died): say it here rather than nowhere
        return True


def describe(error: BaseException) -> str | None:
    """The report for `error`: one line, a traceback, or None (nothing to add: another rank reports)."""
    if isinstance(error, PeerFailed):
        return None
    if isinstance(error, KeyboardInterrupt):
        return "interrupted (Ctrl-C) before training started"
    out_of_memory = type(error).__name__ == "OutOfMemoryError" and _describe_out_of_memory is not None
    if out_of_memory and not os.environ.get("NANORL_TRACEBACK"):
        return f"error: {_describe_out_of_memory(error)}"  # the loop's stages say theirs (common/run/logger.py)
    user = isinstance(error, USER_ERRORS)
    if (user or _is_lost_peer(error)) and not os.environ.get("NANORL_TRACEBACK"):
        text = " ".join(str(error).split("\n")[0].split()) or type(error).__name__
        if _is_lost_peer(error):
            return f"error: another rank stopped unexpectedly (killed, or out of memory?): {text[:300]}"
        return f"error: {text}"
    return "".join(traceback.format_exception(error)).rstrip()


def _is_lost_peer(error: BaseException) -> bool:
    """A collective failed because a peer process is gone (gloo/NCCL errors name the closed connection)."""
    text = str(error)
    return type(error).__name__ in ("DistBackendError", "DistNetworkError") or "Connection closed by peer" in text \
        or "Connection reset by peer" in text


def record_reports_in(run_dir: str) -> None:
    """Where the last failure's report is kept, so that torchrun's restarts of a run that fails the same way again
    say so in a line instead of repeating it (--max-restarts N would otherwise print it N + 1 times)."""
    global _report_file
    _report_file = os.path.join(run_dir, ".last_failure")


def _said_before(message: str) -> str:
    """The line to print for `message` in restart k of the launch: itself, or that it is the same as before."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if _report_file is None:
        return message
    record = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}\n{message}"  # this launch's: not an earlier job's
    try:
        with open(_report_file) as f:
            same = restart > 0 and f.read() == record
        if same:
            return f"error: failed again with the same error as before torchrun's restart {restart} (shown above)"
    except OSError:
        pass
    try:
        with open(_report_file, "w") as f:
            f.write(record)
    except OSError:
        pass
    return message


def report_and_exit(error: BaseException, code: int = 1) -> None:
    """Prints `error`'s report if this rank is the first to fail, stops child processes, and leaves at once
    (os._exit: a normal exit could wait forever on a peer that is gone, in a collective or a C++ thread)."""
    message = describe(error)
    if message is not None and first_to_report():
        message = _said_before(message)
        if "tqdm" in sys.modules:  # below this process's progress bar, not glued to it
            sys.modules["tqdm"].tqdm.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)
    else:
        let_the_reporter_speak()
    run_abort_hooks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def let_the_reporter_speak() -> None:
    """A rank that does not report waits a moment before it leaves: torchrun stops the other ranks as soon as one
    has failed, which could cut the reporting rank short before it prints."""
    import time
    time.sleep(2)
