"""The tools a policy calls: `run_python` on ordinary programs (output, errors, the deadline, truncation,
the interpreter and packages it sees) and `calculator` against hand-computed values.
tests/test_tools_hostile.py runs the hostile programs."""

import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from jaxrl_llm.tools import (MAX_OUTPUT_BYTES, SandboxUnavailableError, ToolResult, calculator, resolve_isolation,
                             run_python)
from jaxrl_llm.tools import sandbox


def namespaces_possible() -> bool:
    """Whether this machine lets a process create namespaces at all (unshare as root or in a user
    namespace, or bubblewrap): where it does, run_python's isolation must work."""
    probes = [["unshare", "--mount", "--net", "--pid", "--fork", "true"],
              ["unshare", "--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "true"],
              ["bwrap", "--unshare-all", "--ro-bind", "/", "/", "true"]]
    return any(shutil.which(p[0]) and subprocess.run(p, capture_output=True, timeout=30).returncode == 0
               for p in probes)


NAMESPACES = namespaces_possible()
# Ordinary programs run under the real sandbox where there is one, else with limits only (what they
# check does not depend on isolation); the hostile ones never run without isolation.
ISOLATION = "auto" if NAMESPACES else "none"


def test_isolation_is_available_where_namespaces_are():
    if not NAMESPACES:
        pytest.skip("this machine cannot create namespaces (no unshare or bwrap that works)")
    assert resolve_isolation("auto") in ("unshare", "bwrap")


def test_stdout_stderr_and_exit_status():
    result = run_python("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)\nsys.exit(3)", isolation=ISOLATION)
    assert (result.stdout, result.stderr, result.returncode, result.timed_out, result.truncated) == \
        ("42\n", "warn\n", 3, False, False)
    assert isinstance(result, ToolResult) and result.isolation in ("unshare", "bwrap", "none")


def test_raising_program_returns_one_with_the_traceback():
    result = run_python("x = 1\nraise ValueError('bad value')\n", isolation=ISOLATION)
    assert result.returncode == 1 and not result.timed_out
    assert result.stderr.startswith("Traceback") and result.stderr.endswith("ValueError: bad value\n")
    assert 'line 2' in result.stderr


def test_killed_by_a_signal_is_a_negative_returncode():
    result = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", isolation=ISOLATION)
    assert result.returncode == -15 and not result.timed_out


def test_timeout_kills_and_says_so():
    start = time.monotonic()
    result = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout_s=1.0,
                        isolation=ISOLATION)
    assert result.timed_out and result.returncode != 0 and result.stdout == "started\n"
    assert time.monotonic() - start < 30  # wide slack for loaded CI machines


def test_output_is_truncated_at_the_limit():
    result = run_python(f"print('a' * {3 * MAX_OUTPUT_BYTES}, end='')\nprint('b' * 10, end='', file=__import__('sys').stderr)",
                        isolation=ISOLATION)
    assert result.truncated and result.returncode == 0
    assert result.stdout == "a" * MAX_OUTPUT_BYTES and result.stderr == "b" * 10


def test_the_interpreter_is_ours_with_numpy_and_sympy():
    result = run_python("import sys, numpy, sympy\nprint(sys.flags.isolated, sys.version_info[:2] == (%d, %d))\n"
                        "print(int(numpy.arange(10).sum()), sympy.factorint(360))" % sys.version_info[:2],
                        isolation=ISOLATION)
    assert result.stdout == "1 True\n45 {2: 3, 3: 2, 5: 1}\n", result.stderr


def test_cwd_is_private_writable_and_gone_afterwards():
    first = run_python("import os\nopen('note.txt', 'w').write('hi')\nprint(sorted(os.listdir('.')))",
                       isolation=ISOLATION)
    assert first.stdout == "['main.py', 'note.txt']\n", first.stderr
    second = run_python("import os\nprint(sorted(os.listdir('.')))", isolation=ISOLATION)
    assert second.stdout == "['main.py']\n"


def test_an_interpreter_installed_under_tmp_runs_in_the_sandbox(monkeypatch):
    """A virtual environment under /tmp (a clone checked out there) is bound read-only at its path, so the
    program's /tmp is that directory, not a link to its working directory: the sandbox still starts, the bound
    files read, and the program writes to $TMPDIR (its working directory) as everywhere."""
    if not NAMESPACES:
        pytest.skip("this machine cannot create namespaces (no unshare or bwrap that works)")
    venv = pathlib.Path(tempfile.mkdtemp(prefix="jaxrl_llm_venv", dir="/tmp"))
    venv.chmod(0o755)  # readable by the program's fresh uid, as `python -m venv` leaves a venv
    (venv / "marker.txt").write_text("bound")
    (venv / "marker.txt").chmod(0o644)
    binds, links = sandbox._filesystem_view()
    monkeypatch.setattr(sandbox, "_filesystem_view", lambda: ((*binds, str(venv)), links))
    program = (f"import os, tempfile\nprint(open({str(venv / 'marker.txt')!r}).read())\n"
               "with tempfile.NamedTemporaryFile(dir=None) as f:\n    print(os.path.dirname(f.name))\n"
               "print(os.path.islink('/tmp'))")
    result = run_python(program, isolation=resolve_isolation("auto"))
    assert (result.returncode, result.stdout) == (0, "bound\n/sandbox\nFalse\n"), result.stderr
    monkeypatch.undo()
    shutil.rmtree(venv)
    if sandbox._tmp_link(binds):  # this interpreter is not itself under /tmp: there /tmp links to the cwd
        ordinary = run_python("import os\nprint(os.readlink('/tmp'))", isolation=resolve_isolation("auto"))
        assert ordinary.stdout == "sandbox\n", ordinary.stderr


def test_memory_limit_gives_memory_error():
    result = run_python("x = bytearray(300 << 20)", memory_mb=256, isolation=ISOLATION)
    assert result.returncode == 1 and result.stderr.rstrip().endswith("MemoryError")


def test_refuses_without_isolation_unless_opted_in(monkeypatch):
    monkeypatch.setattr(sandbox, "_probe", lambda name: f"`{name}` not found")
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
        run_python("print(1)")
    with pytest.raises(ValueError, match="isolation must be one of"):
        run_python("print(1)", isolation="docker")
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    assert resolve_isolation() == "none"
    result = run_python("print(1)")
    assert (result.stdout, result.isolation) == ("1\n", "none")


@pytest.mark.parametrize("expression, expected", [
    ("12345 * 6789", "83810205"),  # 12345 * 6789 = 83,810,205
    ("987654321 * 123456789", "121932631112635269"),
    ("2 ** 100", "1267650600228229401496703205376"),
    ("(17 + 25) * 3 - 100 / 8", "113.5"),  # 126 - 12.5
    ("0.1 + 0.2", "0.3"),  # exact decimals, not 0.30000000000000004
    ("-7 // 2", "-4"),
    ("-7 % 3", "2"),
    ("2 ^ 10", "1024"),  # ^ is power, as people write it
    ("6 × 7 ÷ 4", "10.5"),
    ("1 / 3 + 1 / 6", "0.5"),
    ("22 / 7", "22/7 ≈ 3.142857142857143"),
    ("2 ** -2", "0.25"),
    ("4 ** 0.5", "2.0"),  # a fractional power is a float
    ("-(3 - 10)", "7"),
])
def test_calculator_values(expression, expected):
    result = calculator(expression)
    assert (result.stdout, result.stderr, result.returncode) == (expected, "", 0)


@pytest.mark.parametrize("expression, error", [
    ("1 / 0", "division by zero"),
    ("7 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 +", "not an arithmetic expression"),
    ("", "empty expression"),
    ("__import__('os').system('true')", "only numbers and"),
    ("x + 1", "only numbers and"),
    ("'a' * 3", "only numbers are allowed"),
    ("9 ** 9 ** 9", "result too large"),
    ("1e999999999", "result too large"),
    ("(-8) ** (1 / 3)", "not a real number"),
    ("1" * 3000, "longer than"),
    ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
    (None, "expected a string"),
])
def test_calculator_errors_never_raise(expression, error):
    result = calculator(expression)
    assert result.returncode == 1 and result.stdout == "" and error in result.stderr
    assert result.stderr.startswith("error: ")
