"""Tools a model may call in a multi-turn rollout (`--tools`): plain Python functions with type hints and a docstring.

A tool is offered to the model through the tokenizer's chat template (`tools=`, the JSON-schema format of HF chat
templates, which `transformers.utils.get_json_schema` makes from the function's signature and docstring), and called
with the arguments the model wrote. What it returns, as a string, becomes the tool message the model reads next.
A tool that raises gives the model "Error: ..." instead (counted as a tool error): a wrong call is the model's
mistake to learn from, not a crash of the run.

Built in:
- `calculator`: exact arithmetic on + - * / // % ** and parentheses, parsed with `ast` (never `eval`): integers
  and fractions stay exact, huge powers are refused.
- `python`: runs model-written code in a sandbox (`run_sandboxed`): a separate process in new user and network
  namespaces (no network at all), with a CPU-time limit, a wall-clock limit, a memory limit, a file-size limit, an
  empty environment and a private temporary directory as its working and home directory, removed afterwards. It can
  still read (and write) what the user running training can elsewhere on the file system: no chroot.
"""

import ast
import ctypes
import importlib.util
import inspect
import operator
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

PYTHON_TIME_S = 10.0  # wall-clock seconds one python call may take (its CPU time too)
PYTHON_MEMORY_MB = 1024  # address space of one python call
OUTPUT_CHARS = 2000  # what the model reads of a call's output, at most


# ---------------------------------------------------------------------------------------------------------------
# calculator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def _exact(node) -> Fraction:
    if isinstance(node, ast.Expression):
        return _exact(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return Fraction(str(node.value))  # "0.1" is exactly 1/10, not the float's binary value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_exact(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _exact(node.left), _exact(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > 1000 or abs(left) > 10**100:
                raise ValueError("powers take a whole exponent of at most 1000")
            right = int(right)
        return _OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic: {ast.unparse(node) if isinstance(node, ast.AST) else node!r}")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "123 * 45 + 6"
    """
    value = _exact(ast.parse(expression.strip(), mode="eval"))
    if value.denominator == 1:
        return str(value.numerator)
    decimal = float(value)
    return f"{value.numerator}/{value.denominator} = {decimal:.12g}"


# ---------------------------------------------------------------------------------------------------------------
# python, sandboxed

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def _enter_sandbox(memory_mb: int, cpu_s: int) -> None:
    """In the child, before the interpreter starts: its own process group (a time-out kills all it started), new
    user and network namespaces (only a loopback that is down: no network), and resource limits."""
    os.setsid()
    if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        os.write(2, f"sandbox: unshare failed: {os.strerror(ctypes.get_errno())}\n".encode())
        os._exit(126)
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_sandboxed(code: str, time_s: float = PYTHON_TIME_S, memory_mb: int = PYTHON_MEMORY_MB) -> tuple[int | None, str]:
    """Runs `code` with this interpreter in the sandbox the module docstring describes. Returns (exit code, or None
    when it ran past time_s and was killed; its stdout and stderr, cut to OUTPUT_CHARS)."""
    workdir = tempfile.mkdtemp(prefix="nanorl-python-")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-c", code], cwd=workdir, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            preexec_fn=lambda: _enter_sandbox(memory_mb, max(1, int(time_s) + 1)))
        try:
            output, _ = process.communicate(timeout=time_s)
            code_ = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            code_ = None
        try:  # whatever the code started in its group and left running
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = output.decode(errors="replace")
    return code_, text if len(text) <= OUTPUT_CHARS else text[:OUTPUT_CHARS] + f"\n... [{len(text)} characters]"


def python(code: str) -> str:
    """Runs a Python program and returns what it printed. Each call starts fresh: no network, no state kept.

    Args:
        code: the program; print() what you want to see
    """
    status, output = run_sandboxed(code)
    if status is None:
        raise TimeoutError(f"the program ran past {PYTHON_TIME_S:g} s and was stopped")
    if status == 126 and output.startswith("sandbox:"):
        raise RuntimeError(output.strip())
    if status != 0:
        raise RuntimeError(f"exit status {status}\n{output}")
    return output


def check_sandbox() -> None:
    """One line, before a run starts, where this machine cannot give the python tool its sandbox (no user
    namespaces: some clusters disable them)."""
    status, output = run_sandboxed("print('ok')", time_s=30)
    if status != 0 or output.strip() != "ok":
        raise RuntimeError(f"the python tool's sandbox does not work on this machine ({output.strip()[:200]}): it "
                           f"needs unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)")


# ---------------------------------------------------------------------------------------------------------------
# loading

BUILTIN_TOOLS = {"calculator": calculator, "python": python}


def load_tools(spec: str) -> list:
    """'calculator', 'python', 'path/to/tools.py' (its public functions), or several of them joined by commas ->
    the tool functions, each with type hints and a docstring (checked here: the chat template needs them)."""
    tools = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if part in BUILTIN_TOOLS:
            tools.append(BUILTIN_TOOLS[part])
            continue
        if not part.endswith(".py"):
            raise ValueError(f"--tools {part!r}: use {', '.join(BUILTIN_TOOLS)} or path/to/tools.py")
        if not Path(part).is_file():
            raise FileNotFoundError(f"--tools {part!r}: no such file")
        module_spec = importlib.util.spec_from_file_location(f"tools_{Path(part).stem}", part)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        found = [f for name, f in vars(module).items() if inspect.isfunction(f) and not name.startswith("_")
                 and f.__module__ == module.__name__]
        if not found:
            raise ValueError(f"--tools {part!r} defines no public function")
        tools.extend(found)
    if not tools:
        raise ValueError("--tools names no tool")
    for tool in tools:
        tool_schema(tool)
    return tools


def tool_schema(tool) -> dict:
    """The JSON schema a chat template renders (transformers' get_json_schema: it needs type hints and a docstring
    with an Args section); one line naming the function where it cannot be made."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(tool)
    except Exception as e:  # noqa: BLE001 - transformers raises several types, all meaning the same
        raise ValueError(f"tool {tool.__name__}: {e} (a tool needs type hints and a docstring with an Args: "
                         f"section describing each argument)") from None
