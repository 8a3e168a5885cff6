"""requirements.txt against the code (every third-party import is declared) and the packages only some flags need
(common/run/packages.py: a missing one is one line naming the flag and its pip command)."""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_grpo_e2e import assert_one_line_error

from common.run.packages import MissingPackage, check_packages, install_command

ROOT = Path(__file__).resolve().parents[1]

# Imported by the code but not in the CPU install, on purpose:
NOT_IN_CPU_INSTALL = {
    "torch",  # installed first, on its own line: a CPU build here (torch==2.13.0), vLLM's CUDA build on GPUs
    "vllm",  # the GPU rollout engine: `pip install vllm==0.26.0 -r requirements.txt` (requirements.txt's comment)
    "trl",  # the peer benchmark's (benchmarks of nanorl against TRL on a GPU machine), never nanorl's own code
    "verl",  # the other peer's: scripts/peer_long.py checks verl's own environment with it, on a GPU machine
}


def python_files(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py"))
            if not any(part.startswith(".") or part in ("runs", "wandb", "venv") for part in p.relative_to(root).parts)]


def imported_modules(root: Path) -> dict[str, str]:
    """{top-level module: the first file importing it} over every import of the repository, inside functions too,
    less the standard library and the repository's own modules."""
    files = python_files(root)
    own = {p.stem for p in files} | {p.relative_to(root).parts[0] for p in files}
    found = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in own and top != "__future__":
                    found.setdefault(top, str(path.relative_to(root)))
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(requirements: str) -> set[str]:
    """The distributions requirements.txt names (comment lines aside)."""
    return {normalized(re.split(r"[<>=!~\[; ]", line.strip())[0]) for line in requirements.splitlines()
            if line.strip() and not line.strip().startswith("#")}


def undeclared(root: Path, requirements: str) -> list[str]:
    """One line per third-party module the code imports whose distribution requirements.txt does not name."""
    distributions = importlib.metadata.packages_distributions()
    names = declared(requirements)
    problems = []
    for module, where in sorted(imported_modules(root).items()):
        if module in NOT_IN_CPU_INSTALL:
            continue
        provided_by = [normalized(d) for d in distributions.get(module, [])]
        if not provided_by:
            problems.append(f"{module} (imported in {where}) is not installed: add its package to requirements.txt")
        elif not set(provided_by) & names:
            problems.append(f"{module} (imported in {where}) comes from the package {provided_by[0]}, which "
                            f"requirements.txt does not name")
    return problems


def test_every_third_party_import_is_declared_in_requirements():
    assert undeclared(ROOT, (ROOT / "requirements.txt").read_text()) == []


def test_a_line_removed_from_requirements_is_named_with_the_file_that_imports_it():
    """The check above can fail: without peft's line, it names peft and the module that imports it."""
    requirements = (ROOT / "requirements.txt").read_text()
    without_peft = "\n".join(line for line in requirements.splitlines() if not line.startswith("peft"))
    problems = undeclared(ROOT, without_peft)
    assert len(problems) == 1 and problems[0].startswith("peft (imported in ") and "package peft" in problems[0]
    assert problems[0].split("imported in ")[1].split(")")[0] in ("common/train/lora.py", "tests/test_lora.py")


def test_every_declared_package_is_pinned():
    lines = [line for line in (ROOT / "requirements.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[0-9][A-Za-z0-9_.+\-]*", line) for line in lines), lines


class Flags:
    lora_rank, rollout_engine, track, dataset, eval_dataset, reward_fn = 0, "hf", False, None, None, "synthetic"


@pytest.mark.parametrize("flag, value, module, line", [
    ("lora_rank", 8, "peft", "--lora-rank needs the package peft, which is not installed here: pip install peft==0.21.2"),
    ("rollout_engine", "vllm", "vllm",
     "--rollout-engine vllm needs the package vllm, which is not installed here: pip install vllm==0.26.0"),
    ("track", True, "wandb", "--track needs the package wandb, which is not installed here: pip install wandb==0.31.0"),
    ("dataset", "d.jsonl", "datasets",
     "--dataset needs the package datasets, which is not installed here: pip install datasets==5.2.0"),
    ("reward_fn", "gsm8k", "math_verify",
     "--reward-fn gsm8k needs the package math-verify, which is not installed here: pip install math-verify==0.9.0"),
])
def test_a_flag_whose_package_is_missing_names_the_flag_and_the_pinned_pip_command(monkeypatch, flag, value, module,
                                                                                  line):
    args = Flags()
    check_packages(args)  # no flag needs anything
    setattr(args, flag, value)
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: import and find_spec both fail
    with pytest.raises(MissingPackage) as raised:
        check_packages(args)
    assert str(raised.value) == line


def test_install_commands_follow_requirements_pins():
    requirements = (ROOT / "requirements.txt").read_text()
    for name in ("peft", "datasets", "math-verify", "vllm"):
        pin = re.search(rf"^#?.*?\b({name}==\S+)", requirements, re.M).group(1)
        assert install_command(name) == f"pip install {pin}"
    assert install_command("not-a-package") == "pip install not-a-package"


@pytest.mark.parametrize("script, flags, hidden, needed_by", [
    ("grpo.py", ["--lora-rank", "8"], "peft", "--lora-rank"), ("ppo.py", ["--lora-rank", "8"], "peft", "--lora-rank"),
    ("dpo.py", ["--lora-rank", "8"], "peft", "--lora-rank"),
    ("grpo.py", ["--rollout-engine", "vllm"], "vllm", "--rollout-engine vllm")])
def test_a_script_run_without_the_package_a_flag_needs_stops_in_one_line(tmp_path, script, flags, hidden, needed_by):
    """Through torchrun, with the package hidden from the ranks (a sitecustomize sets sys.modules[name] = None; vllm
    is not installed here anyway): one line naming the flag and the pip command, and no traceback of ours."""
    (tmp_path / "sitecustomize.py").write_text(f"import sys\nsys.modules[{hidden!r}] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                             script, *flags, "--steps", "1", "--output-dir", str(tmp_path / "run")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert_one_line_error(result, f"error: {needed_by} needs the package {hidden}, which is not installed here: "
                                  f"{install_command(hidden)}")
