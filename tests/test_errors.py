"""common/run/errors.py: what a failure prints, and that one rank prints it."""

import pytest
import torch.distributed as dist

from common.rollout.rewards import RewardError
from common.run import cli, errors


def test_user_errors_are_one_line_bugs_keep_their_traceback(monkeypatch):
    monkeypatch.delenv("NANORL_TRACEBACK", raising=False)
    assert errors.describe(ValueError("--lr must be greater than 0\nmore")) == "error: --lr must be greater than 0"
    assert errors.describe(FileNotFoundError("dataset file not found: x.jsonl")) == \
        "error: dataset file not found: x.jsonl"
    assert errors.describe(RewardError("reward function raised on sample 0")).startswith("error: reward function")
    assert errors.describe(errors.PeerFailed("rank 1 failed: ...")) is None  # rank 1 says it
    try:
        {}["missing"]
    except KeyError as bug:
        report = errors.describe(bug)
    assert report.startswith("Traceback (most recent call last)") and "KeyError: 'missing'" in report
    monkeypatch.setenv("NANORL_TRACEBACK", "1")
    try:
        raise ValueError("bad")
    except ValueError as user_error:
        assert errors.describe(user_error).startswith("Traceback")


def test_the_first_rank_to_fail_reports():
    errors.use_store(dist.HashStore())
    try:
        assert [errors.first_to_report() for _ in range(3)] == [True, False, False]
    finally:
        errors.use_store(None)


@pytest.mark.parametrize("argv, expected", [
    (["--lrr", "3"], "Unrecognized options: --lrr, 3 (did you mean --lr?)"),
    (["--lr", "abc"], "Error parsing --lr: no type matching {None}|FLOAT could be instantiated from ['abc']."),
    (["--rollout-engine", "foo"], "invalid choice 'foo' for argument '--rollout-engine'. Expected one of ('auto', "
                                  "'vllm', 'hf')."),
    (["--steps"], "Missing value for argument '--steps'. Expected 1 values."),
])
def test_tyro_boxes_become_one_line(argv, expected):
    import contextlib
    import io

    import tyro

    import grpo

    box = io.StringIO()
    with contextlib.redirect_stderr(box), contextlib.redirect_stdout(box), pytest.raises(SystemExit):
        tyro.cli(grpo.Args, args=argv)
    assert cli._one_line(box.getvalue()) == expected


def test_help_flows_each_flags_docstring_into_one_paragraph(monkeypatch, capsys):
    """A flag's help whose docstring spans source lines reads as one paragraph in --help, not broken where the
    source line ended (tyro keeps a line break followed by the source's indentation)."""
    from dataclasses import dataclass

    @dataclass
    class Flags:
        budget: int = 1
        """a short first line
        that goes on here"""

    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr("sys.argv", ["script.py", "--help"])
    with pytest.raises(SystemExit):
        cli.parse_args(Flags)
    lines = [" ".join(line.strip("│ ").split()) for line in capsys.readouterr().out.splitlines()]
    assert any("a short first line that goes on here" in line for line in lines), lines


def test_a_failure_repeated_by_torchruns_restart_is_one_line(tmp_path, monkeypatch):
    """errors._said_before, without torchrun: the same failure in restart 1 of the same launch is one line;
    in a new launch (another TORCHELASTIC_RUN_ID) over the same run directory it is shown in full again."""
    monkeypatch.setattr(errors, "_report_file", None)
    errors.record_reports_in(str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert errors._said_before("Traceback ... boom") == "Traceback ... boom"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert errors._said_before("Traceback ... boom") == \
        "error: failed again with the same error as before torchrun's restart 1 (shown above)"
    assert errors._said_before("Traceback ... other") == "Traceback ... other"  # a different failure: in full
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-b")  # a later job on the same directory
    assert errors._said_before("Traceback ... other") == "Traceback ... other"
