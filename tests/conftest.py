"""Runs that several tests read, made once per session."""

import pytest


@pytest.fixture(scope="session")
def builtin_sync_run(tmp_path_factory):
    """The README's first command: 2 ranks, colocated, synchronous, 200 steps on the built-in task, evaluated every
    25. Returns the finished process and its output directory."""
    from test_grpo_e2e import torchrun
    tmp = tmp_path_factory.mktemp("builtin_sync")
    return torchrun(["--output-dir", str(tmp / "run")], tmp, timeout=600), tmp / "run"
