"""The scripts' command line: their flags parsed by tyro, with a bad flag reported as one line, flowing --help, range
checks, and whether a flag was given (a default the scripts may then choose for the user).

`if __name__ == "__main__": run_main(main, Args)` parses the flags and runs main with common/run/errors.py's reporting.
"""

import contextlib
import io
import os
import sys

import docstring_parser
import tyro

from common.run import errors


def run_main(main, args_class=None) -> None:
    """`if __name__ == "__main__": run_main(main, Args)`: main(args), the flags parsed from the command line
    (parse_args), with common/run/errors.py's failure reporting; without args_class, main()."""
    try:
        main() if args_class is None else main(parse_args(args_class))
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001 - every failure is reported the same way
        errors.report_and_exit(error)


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
    a default the scripts may then choose for the user (common/run/run_plan.py)."""
    flag = name.replace("_", "-")
    return any(arg.split("=", 1)[0] in (f"--{flag}", f"--no-{flag}", f"--{name}", f"--no-{name}")
               for arg in sys.argv[1:])


def chosen_values(unset: dict, resolved: dict) -> str:
    """The start-up line that names every flag a script's resolve_defaults chose for the user: `unset` as parsed,
    `resolved` after it."""
    chosen = [f"--{name.replace('_', '-')} {value}" for name, value in resolved.items() if unset.get(name) != value]
    return "chosen for you: " + (", ".join(chosen) or "nothing (every flag as given)")


def parse_args(cls):
    """tyro.cli(cls), with a bad flag reported as one line (rank 0 only) instead of a box per rank. --help lists the
    script's own flags first, then those of the shared classes its Args extends (RunArgs, RolloutArgs)."""
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
        if errors.launch_rank() == 0:
            script = os.path.basename(sys.argv[0])
            print(f"error: {_one_line(captured.getvalue()).rstrip('.')}; `python {script} --help` lists every flag",
                  file=sys.stderr)
        else:
            errors.let_the_reporter_speak()
        sys.stderr.flush()
        os._exit(2)


@contextlib.contextmanager
def flowing_help():
    """Each flag's help as one flowing paragraph in --help. tyro reads it from the attribute docstring under the
    flag in Args (through docstring_parser), where a line break and the next line's source indentation would
    otherwise reach --help as a ragged break in mid-sentence; the docstrings hold no paragraph breaks."""
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
