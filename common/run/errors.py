"""How every script fails: one clear line for a user's mistake, one traceback for a bug, printed once for all ranks.

A run of N ranks that fails would otherwise print N copies of the same traceback, most of them from ranks that
only noticed that another one stopped. Here the first rank to fail claims the report through torchrun's key-value
store (a counter every rank can reach, even when collectives are broken) and prints it; the others stay silent.
User errors (bad flags, paths, data, rewards: ValueError, OSError, RewardError) print as one line;
anything else is a bug and keeps its traceback. `NANORL_TRACEBACK=1` shows the traceback of user errors too.
"""

import contextlib
import os
import sys
import traceback

USER_ERRORS = (ValueError, OSError)  # and every class registered with user_error below
_store = None  # torchrun's key-value store, set once the ranks have met (common.run.distributed)
_global_rank = None  # this process's rank in the launch, set with the store (split placement renumbers RANK)
_abort_hooks = []  # cleanups that must run even when the process leaves with os._exit (reward processes)
_report_file = None  # the run directory's record of the last failure (record_reports_in)


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


def _launch_rank() -> int:
    return _global_rank if _global_rank is not None else int(os.environ.get("RANK", "0"))


def on_abort(hook) -> None:
    """Runs `hook()` before the process leaves through report_and_exit or a second stop signal."""
    _abort_hooks.append(hook)


def run_abort_hooks() -> None:
    for hook in _abort_hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - leaving anyway
            pass


def _first_to_report() -> bool:
    """True on exactly one rank: the first to fail (the store's counter), or rank 0 before the ranks have met."""
    if _store is None:
        return _launch_rank() == 0
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
    if type(error).__name__ == "OutOfMemoryError" and not os.environ.get("NANORL_TRACEBACK"):
        from common.run.planner import out_of_memory_report  # the loop's stages say theirs (common/run/logger.py)
        return f"error: {out_of_memory_report('start-up', 0, error)}"
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
    if message is not None and _first_to_report():
        message = _said_before(message)
        if "tqdm" in sys.modules:  # below this process's progress bar, not glued to it
            sys.modules["tqdm"].tqdm.write(message, file=sys.stderr)
        else:
            print(message, file=sys.stderr)
    else:
        _let_the_reporter_speak()
    run_abort_hooks()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main, args_class=None) -> None:
    """`if __name__ == "__main__": run_main(main, Args)`: main(args), the flags parsed from the command line
    (parse_args), with the failure reporting above; without args_class, main()."""
    try:
        main() if args_class is None else main(parse_args(args_class))
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - every failure is reported the same way
        report_and_exit(error)


def check_ranges(args, positive=(), at_least_one=(), non_negative=()) -> None:
    """One line for a flag outside its range (a value of None is unset: a default follows)."""
    for names, ok, what in [(positive, lambda v: v > 0, "greater than 0"), (at_least_one, lambda v: v >= 1,
                             "at least 1"), (non_negative, lambda v: v >= 0, "at least 0")]:
        for name in names:
            value = getattr(args, name)
            if value is not None and not ok(value):
                hint = " (greedy decoding has no sampling distribution to train on)" if name == "temperature" else ""
                raise ValueError(f"--{name.replace('_', '-')} must be {what}, got {value}{hint}")


def given_on_command_line(name: str) -> bool:
    """Whether a flag (a field name: activation_checkpointing) was given on the command line, as --name or --no-name:
    a default the scripts may then choose for the user (common/run/planner.py)."""
    flag = name.replace("_", "-")
    return any(arg.split("=", 1)[0] in (f"--{flag}", f"--no-{flag}", f"--{name}", f"--no-{name}")
               for arg in sys.argv[1:])


def parse_args(cls):
    """tyro.cli(cls), with a bad flag reported as one line (rank 0 only) instead of a box per rank. --help lists the
    script's own flags first, then those of the shared classes its Args extends (RunArgs, RolloutArgs)."""
    import io

    import tyro

    own = vars(cls).get("__annotations__", {})
    cls.__dataclass_fields__ = dict(sorted(cls.__dataclass_fields__.items(), key=lambda item: item[0] not in own))

    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        with flowing_help():
            return tyro.cli(cls)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            return tyro.cli(cls)
    except SystemExit:
        if _launch_rank() == 0:
            script = os.path.basename(sys.argv[0])
            print(f"error: {_one_line(captured.getvalue()).rstrip('.')}; `python {script} --help` lists every flag",
                  file=sys.stderr)
        else:
            _let_the_reporter_speak()
        sys.stderr.flush()
        os._exit(2)


@contextlib.contextmanager
def flowing_help():
    """Each flag's help as one flowing paragraph in --help. tyro reads it from the attribute docstring under the
    flag in Args (through docstring_parser), where a line break and the next line's source indentation would
    otherwise reach --help as a ragged break in mid-sentence; the docstrings hold no paragraph breaks."""
    import docstring_parser

    parse = docstring_parser.parse_from_object

    def joined(obj):
        doc = parse(obj)
        for param in doc.params:
            if param.description:
                param.description = " ".join(param.description.split())
        return doc

    docstring_parser.parse_from_object = joined
    try:
        yield
    finally:
        docstring_parser.parse_from_object = parse


def _let_the_reporter_speak() -> None:
    """A rank that does not report waits a moment before it leaves: torchrun stops the other ranks as soon as one
    has failed, which could cut the reporting rank short before it prints."""
    import time
    time.sleep(2)


def _one_line(tyro_message: str) -> str:
    """The gist of tyro's boxed error: its first paragraph, and the flag it suggests if it has one."""
    box = "\u2502\u256d\u256e\u2570\u256f\u2500|+-"
    lines = []
    for line in tyro_message.splitlines():
        line = line.strip().strip("\u2502|").strip()
        lines.append("" if not line.strip(box) else line)  # a rule or a corner line
    titles = ("Unrecognized options", "Value error", "Parsing error", "Required options", "Invalid choice",
              "Missing argument", "")
    start = next((i for i, line in enumerate(lines) if line.strip(box + " ") not in titles), len(lines))
    paragraph = []
    for line in lines[start:]:
        if not line:
            break
        paragraph.append(line)
    gist = " ".join(paragraph) or "could not parse the command line"
    if "Perhaps you meant:" in lines:
        gist = gist.removesuffix(" Perhaps you meant:")
        gist += f" (did you mean {lines[lines.index('Perhaps you meant:') + 1].split()[0]}?)"
    return gist
