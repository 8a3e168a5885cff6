"""Tools a model may call in a multi-turn rollout (`--tools`): plain Python functions with type hints and a docstring.

A tool is offered to the model through the tokenizer's chat template (`tools=`, the JSON-schema format of HF chat
templates, which `transformers.utils.get_json_schema` makes from the function's signature and docstring), and called
with the arguments the model wrote. What it returns, as a string, becomes the tool message the model reads next.
A tool that raises gives the model "Error: ..." instead (counted as a tool error): a wrong call is the model's
mistake to learn from, not a crash of the run.

Built in:
- `calculator`: exact arithmetic on + - * / // % ** and parentheses, parsed with `ast` (never `eval`): integers
  and fractions stay exact, huge powers are refused.
- `python`: runs model-written code in a bubblewrap sandbox (common/rollout/sandbox.py, docs/sandbox.md): it sees
  the interpreter and its standard library read-only and a fresh capped scratch, nothing of the host's files,
  network or processes; the whole call is bounded in time, memory, processes and output, and nothing outlives it.
"""

import ast
import importlib.util
import inspect
import operator
from fractions import Fraction
from pathlib import Path

from common.rollout.sandbox import INSTALL, MEMORY_MB, TIME_S, run_in_sandbox

PYTHON_TIME_S = TIME_S  # wall-clock seconds one python call may take (its CPU time too)
PYTHON_MEMORY_MB = MEMORY_MB  # all processes of one call together (a cgroup), else each (docs/sandbox.md)
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
# python, sandboxed (common/rollout/sandbox.py)

def run_sandboxed(code: str, time_s: float = PYTHON_TIME_S, memory_mb: int = PYTHON_MEMORY_MB) -> tuple[int | None, str]:
    """Runs `code` in the sandbox (common/rollout/sandbox.py). Returns (exit code, None when it ran past time_s and
    was killed; its stdout and stderr, cut to OUTPUT_CHARS with how many bytes there were in all)."""
    status, output, total = run_in_sandbox(code, time_s=time_s, memory_mb=memory_mb)
    text = output.decode(errors="replace")
    if total > len(output) or len(text) > OUTPUT_CHARS:
        text = text[:OUTPUT_CHARS] + f"\n... [{total} bytes in all, the first {OUTPUT_CHARS} characters shown]"
    return status, text


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
    """One line, before a run starts, where this machine cannot give the python tool its sandbox: no bubblewrap, or
    no user namespaces (some clusters disable them)."""
    status, output = run_sandboxed("print('ok')", time_s=30)
    if status != 0 or output.strip() != "ok":
        raise RuntimeError(f"the python tool's sandbox does not work on this machine ({output.strip()[:200]}): it "
                           f"needs bubblewrap ({INSTALL}) and unprivileged user namespaces "
                           f"(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces > 0)")


def needs_sandbox(spec: str) -> bool:
    """Whether the tools of a --tools list include python, however the list is written ("calculator, python")."""
    return python in load_tools(spec)


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
