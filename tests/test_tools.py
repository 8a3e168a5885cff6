"""common/rollout/tools.py: the calculator is exact and never evaluates code; the python tool's sandbox really isolates (no
network, limits, an empty environment, a scratch of its own gone with the call; tests/test_sandbox.py attacks it);
tool files load with their schemas."""

import os
import socket

import pytest

from common.rollout.tools import calculator, check_sandbox, load_tools, python, run_sandboxed, tool_schema


def test_calculator_is_exact():
    assert calculator("123 * 45 + 6") == "5541"
    assert calculator("(2 + 3) * -4") == "-20"
    assert calculator("1/3 + 0.1") == "13/30 = 0.433333333333"  # 1/3 + 1/10, exactly
    assert calculator("2 ** 100") == str(2 ** 100)
    assert calculator("17 // 5") == "3" and calculator("17 % 5") == "2"


@pytest.mark.parametrize("expression", ["__import__('os').system('true')", "x + 1", "len('ab')", "[1, 2]",
                                        "2 ** 100000", "1 if 1 else 2"])
def test_calculator_refuses_what_is_not_arithmetic(expression):
    with pytest.raises((ValueError, SyntaxError)):
        calculator(expression)


def test_calculator_division_by_zero_is_an_error():
    with pytest.raises(ZeroDivisionError):
        calculator("1 / 0")


def test_python_runs_code_and_returns_its_output():
    assert python("print(sum(range(10)))") == "45\n"
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        python("1 / 0")


def test_the_sandbox_has_no_network():
    # Any address: the sandbox's network namespace has no interface up, not even loopback.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    status, output = run_sandboxed(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=5)")
    server.close()
    assert status == 1 and ("Network is unreachable" in output or "Connection refused" in output), output
    status, output = run_sandboxed("import socket; socket.create_connection(('8.8.8.8', 53), timeout=5)")
    assert status == 1 and "Network is unreachable" in output, output


def test_the_sandbox_limits_memory_and_time():
    status, output = run_sandboxed("x = bytearray(2 << 30)", memory_mb=256)
    assert status == 1 and "MemoryError" in output, output
    status, _ = run_sandboxed("while True: pass", time_s=1)  # never ends by itself: always stopped
    assert status is None


def test_the_sandbox_starts_empty_and_leaves_nothing(monkeypatch):
    monkeypatch.setenv("NANORL_TEST_SECRET", "do-not-leak")
    name = f"made_here_{os.getpid()}.txt"
    status, output = run_sandboxed(
        f"import os, sys; open('{name}', 'w').write('x'); print(os.getcwd()); print(dict(os.environ)); "
        "print(os.environ['HOME'] == os.getcwd())")
    workdir, environment, home_is_cwd = output.splitlines()
    assert status == 0 and home_is_cwd == "True"
    assert "do-not-leak" not in environment and "NANORL" not in environment
    assert workdir == "/tmp" and not os.path.exists(f"/tmp/{name}")  # its own /tmp, gone with the call


def test_output_is_cut_for_the_model():
    status, output = run_sandboxed("print('x' * 10000)")
    assert status == 0 and len(output) < 2100 and output.endswith("[10001 bytes in all, the first 2000 characters shown]")


def test_check_sandbox_passes_here():
    check_sandbox()


def test_tools_load_from_a_file_with_their_schemas(tmp_path):
    (tmp_path / "tools.py").write_text(
        'def lookup(key: str) -> str:\n    """Looks a key up.\n\n    Args:\n        key: what to look up\n    """\n'
        '    return key.upper()\n\n\ndef _helper():\n    pass\n')
    tools = load_tools(f"calculator,{tmp_path / 'tools.py'}")
    assert [t.__name__ for t in tools] == ["calculator", "lookup"]
    schema = tool_schema(tools[1])["function"]
    assert schema["name"] == "lookup" and schema["parameters"]["properties"]["key"]["description"] == "what to look up"


def test_a_tool_without_docstring_is_one_line(tmp_path):
    (tmp_path / "tools.py").write_text("def lookup(key: str) -> str:\n    return key\n")
    with pytest.raises(ValueError, match="tool lookup: .*docstring"):
        load_tools(str(tmp_path / "tools.py"))
    with pytest.raises(ValueError, match="--tools 'nothing'"):
        load_tools("nothing")
