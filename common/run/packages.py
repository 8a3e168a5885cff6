"""The packages only some flags need, checked before any model is loaded.

A flag whose package is not installed (vllm on a CPU machine, peft after an install that skipped requirements.txt)
stops the run in one line naming the flag and the pip command that installs the package, pinned as
requirements.txt pins it, instead of a traceback from deep inside the run.
"""

import importlib.util
import os
import re

from common.run import errors

REQUIREMENTS = os.path.join(os.path.dirname(__file__), "..", "..", "requirements.txt")


@errors.user_error
class MissingPackage(ImportError):
    """A flag needs a package that is not installed; the message names both and the pip command."""


def flag_packages(args) -> list[tuple[str, str]]:
    """(the flag as the user wrote it, the module it needs) for every flag of `args` that needs an optional one."""
    needs = [(getattr(args, "lora_rank", 0), "--lora-rank", "peft"),
             (getattr(args, "rollout_engine", None) == "vllm", "--rollout-engine vllm", "vllm"),
             (getattr(args, "track", False), "--track", "wandb"),
             (getattr(args, "dataset", None) is not None, "--dataset", "datasets"),
             (getattr(args, "eval_dataset", None) is not None, "--eval-dataset", "datasets"),
             (getattr(args, "reward_fn", None) in ("gsm8k", "math"), f"--reward-fn {getattr(args, 'reward_fn', '')}",
              "math_verify")]
    return [(flag, module) for wanted, flag, module in needs if wanted]


def check_packages(args) -> None:
    """One line for the first flag whose package is missing (find_spec: nothing is imported here)."""
    for flag, module in flag_packages(args):
        require(module, flag)


def require(module: str, needed_by: str) -> None:
    if importlib.util.find_spec(module) is None:
        package = module.replace("_", "-")
        raise MissingPackage(f"{needed_by} needs the package {package}, which is not installed here: "
                             f"{install_command(package)}")


def install_command(package: str) -> str:
    """`pip install NAME==VERSION` as requirements.txt pins it (GPU-only packages on its commented lines)."""
    try:
        with open(REQUIREMENTS) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        for spec in re.findall(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line):
            if spec.split("==")[0].lower().replace("_", "-") == package:
                return f"pip install {spec}"
    return f"pip install {package}"
