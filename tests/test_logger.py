"""common/run/logger.py: every step's rows exactly once in metrics.jsonl and in W&B, whatever the run went through."""

import json

import pytest

from common.run.logger import Logger, keep_rows_through


def steps_in(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_resume_drops_the_rows_it_will_redo(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "x": s} for s in [0, 1, 2, 2, 3, 4, 5, 6]]  # step 2 has an evaluation row of its own
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "x"')  # killed mid-line
    assert keep_rows_through(str(path), 4) == rows[:6]
    assert steps_in(path) == [0, 1, 2, 2, 3, 4]
    assert keep_rows_through(str(tmp_path / "missing.jsonl"), 4) == []


class FakeRun:
    """W&B's run as a resumed run sees it: the server already has steps 0..step-1."""
    id = "run0"

    def __init__(self, step):
        self.step, self.sent = step, []

    def log(self, metrics, step):
        self.sent.append(step)


@pytest.mark.parametrize("wandb_has, sent", [(3, [3, 4, 5, 6, 7, 8]), (7, [7, 8]), (0, list(range(9)))])
def test_a_resumed_logger_sends_wandb_only_what_it_lacks(tmp_path, monkeypatch, wandb_has, sent):
    """Killed after logging step 6, resumed from the state of step 4: steps 5-6 are written to the file again (it
    drops them first) and W&B gets every step it lacks once: from the file up to step 4, then as they are redone."""
    import wandb
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(7)))
    run = FakeRun(wandb_has)
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    logger = Logger(0, 8, True, "p", "run", {}, str(tmp_path), run_id="run0", start_step=4)
    for step in range(5, 9):
        logger.log(step, {"x": float(step)})
    logger.run = None
    logger.close()
    assert steps_in(path) == list(range(9)) and run.sent == sent


LOG_THREE_STEPS = ("import sys\nsys.path.insert(0, {root!r})\nfrom common.run.logger import Logger\n"
                   "logger = Logger(0, 3, False, 'p', 'run_x', {{}}, {out!r})\n"
                   "for step in (1, 2, 3):\n    logger.log(step, {{'reward/mean': 0.5, 'time/update': 0.25}})\n"
                   "logger.close()\n")


@pytest.mark.parametrize("terminal", [False, True])
def test_a_log_file_gets_one_line_per_step_and_a_terminal_the_bar(tmp_path, terminal):
    """Redirected to a file (Slurm, `> log 2>&1`), stdout and stderr hold the step lines alone, one per line; on a
    terminal the progress bar is there too."""
    import fcntl
    import os
    import pty
    import re
    import struct
    import subprocess
    import sys
    import termios
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = LOG_THREE_STEPS.format(root=root, out=str(tmp_path))
    log = tmp_path / "log"
    if terminal:
        leader, follower = pty.openpty()
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal 100 wide
        with open(log, "w") as out:
            subprocess.run([sys.executable, "-c", code], stdout=out, stderr=follower, check=True, timeout=120)
        os.close(follower)
        bar = os.read(leader, 1 << 16).decode()
        os.close(leader)
        assert "run_x" in bar and "3/3" in bar
        text = log.read_text()
    else:
        with open(log, "w") as out:
            subprocess.run([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, check=True, timeout=120)
        text = log.read_text()
        assert "\r" not in text and "run_x" not in text
    lines = text.splitlines()
    assert len(lines) == 3 and all(re.fullmatch(r"step +\d \| reward=0\.5 \| update=0\.25s", line) for line in lines)
