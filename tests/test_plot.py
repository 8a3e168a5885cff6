"""scripts/plot.py: every run's curve in every panel it has the metric for, from a run directory or its file."""

import json
import subprocess
import sys

import pytest

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "scripts"))
import plot  # noqa: E402


def test_curves_from_metrics_files(tmp_path):
    run = tmp_path / "run_a"
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.1}, {"step": 1, "reward/mean": 0.2, "time/step": 1.0},
            {"step": 2, "reward/mean": 0.4, "eval/accuracy": 0.5, "eval/version": 1}]  # split: an older version
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    curves = plot.read_curves(str(run), ["reward/mean", "eval/accuracy", "response/length_mean"])
    assert curves == {"reward/mean": [(1, 0.2), (2, 0.4)], "eval/accuracy": [(0, 0.1), (1, 0.5)],
                      "response/length_mean": []}
    out = tmp_path / "curves.png"
    result = subprocess.run([sys.executable, plot.__file__, str(run), str(run / "metrics.jsonl"), "--names", "a", "b",
                             "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        plot.read_curves(str(tmp_path / "missing"), ["reward/mean"])
