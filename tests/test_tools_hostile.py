"""Hostile programs through `run_python` (issue 42, part 7), under each isolation mechanism that works
here: each returns within its limit with `timed_out` or a non-zero returncode, nothing outside the sandbox
changes, no process is left behind, and this process (standing for a training run) goes on.

Never run without isolation: `kill -9 -1` as root outside a PID namespace would end every process."""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from jaxrl_llm.tools import MAX_OUTPUT_BYTES, run_python
from jaxrl_llm.tools import sandbox
from test_tools import NAMESPACES

ROOT = pathlib.Path(__file__).resolve().parent.parent
SLACK_S = 30.0  # any call must return within this, whatever its timeout (loaded CI machines)

pytestmark = pytest.mark.skipif(not NAMESPACES, reason="this machine cannot create namespaces (unshare, bwrap)")


def _mechanisms():
    for name in ("unshare", "bwrap"):
        problem = sandbox._probe(name) if NAMESPACES else "no namespaces"
        yield pytest.param(name, marks=pytest.mark.skipif(problem is not None, reason=f"{name}: {problem}"))


@pytest.fixture(params=list(_mechanisms()))
def run(request):
    def call(code, **kwargs):
        start = time.monotonic()
        result = sandbox._run(request.param, code, timeout_s=kwargs.pop("timeout_s", 5.0),
                              memory_mb=kwargs.pop("memory_mb", 512))
        assert time.monotonic() - start < SLACK_S
        return result
    return call


def _processes_with(marker: str) -> list[int]:
    """Pids on this machine whose command line holds `marker` (read from /proc, no psutil)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = pathlib.Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline and int(entry) != os.getpid():
                found.append(int(entry))
    return found


def _bad_end(result):
    return result.timed_out or result.returncode != 0


def test_infinite_loop(run):
    result = run("while True:\n    pass", timeout_s=1.0)
    assert result.timed_out and result.returncode != 0


def test_fork_bomb(run):
    marker = f"forkbomb-{uuid.uuid4().hex}"
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    code = f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {bomb!r}, {marker!r}])"
    result = run(code, timeout_s=1.0)
    assert _bad_end(result)
    assert _processes_with(marker) == []
    assert subprocess.run(["true"]).returncode == 0  # this machine can still start processes


def test_memory_bomb(run):
    result = run("chunks = []\nwhile True:\n    chunks.append(bytearray(64 << 20))", memory_mb=256)
    assert result.returncode == 1 and "MemoryError" in result.stderr and not result.timed_out


def test_disk_fill(run):
    # Many files until the sandbox's tmpfs is full, then one file past RLIMIT_FSIZE (Python ignores SIGXFSZ,
    # so the write fails with EFBIG).
    code = ("import os\ntry:\n    for i in range(1000):\n        with open(f'f{i}', 'wb') as f:\n"
            "            f.write(b'x' * (4 << 20))\nexcept OSError as e:\n    print('full', e.errno, flush=True)\n"
            "for i in range(1000):\n    os.remove(f'f{i}') if os.path.exists(f'f{i}') else None\n"
            "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n        f.flush()\n")
    result = run(code)
    assert _bad_end(result)
    assert result.stdout == "full 28\n"  # ENOSPC at the 64 MiB tmpfs
    assert result.returncode == 1 and result.stderr.endswith("OSError: [Errno 27] File too large\n")


def test_huge_output(run):
    result = run("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", timeout_s=1.0)
    assert result.timed_out and result.truncated and result.stdout == "y" * MAX_OUTPUT_BYTES


def test_binary_output(run):
    result = run("import sys\nsys.stdout.buffer.write(bytes(range(256)) * 2)\nsys.stderr.buffer.write(b'\\xff\\xfe')\n"
                 "sys.exit(5)")
    assert result.returncode == 5 and isinstance(result.stdout, str)
    assert result.stdout == (bytes(range(256)) * 2).decode("utf-8", "replace") and result.stderr == "\ufffd\ufffd"


def test_network_connection(run):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    port = server.getsockname()[1]
    code = ("import socket, sys\nfailed = 0\nfor address in [('127.0.0.1', %d), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
            "    try:\n        socket.create_connection(address, timeout=2).close()\n"
            "    except OSError as e:\n        failed += 1\n        print(type(e).__name__)\n"
            "sys.exit(10 + failed)" % port)
    try:
        result = run(code)
        with pytest.raises(BlockingIOError):  # nothing reached this process's server
            server.accept()
    finally:
        server.close()
    assert result.returncode == 13 and not result.timed_out, result.stdout + result.stderr


def test_reading_files_outside(run, tmp_path):
    checkpoint = tmp_path / "checkpoint_000100" / "params.msgpack"
    checkpoint.parent.mkdir()
    checkpoint.write_text("SECRET-WEIGHTS")
    targets = [str(checkpoint), "/etc/shadow", str(ROOT / "pyproject.toml"), f"/proc/{os.getpid()}/environ",
               "/proc/1/root/etc/shadow"]
    code = ("import sys\nfound = []\nfor path in %r:\n    try:\n        found.append(open(path).read()[:20])\n"
            "    except OSError as e:\n        print(type(e).__name__, path)\nprint(found)\nsys.exit(len(found) == 0 and 7)"
            % (targets,))
    result = run(code)
    assert result.returncode == 7, result.stdout + result.stderr
    assert "SECRET" not in result.stdout and "[]" in result.stdout


def test_environment_is_not_inherited(run, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_value")
    result = run("import os\nprint(sorted(os.environ))")
    assert "HF_TOKEN" not in result.stdout and "hf_secret" not in result.stdout


def test_writing_outside(run, tmp_path):
    targets = [tmp_path / "escape.txt", ROOT / "escape.txt", pathlib.Path(sys.prefix) / "escape.txt",
               pathlib.Path("/usr/escape.txt"), pathlib.Path("/escape.txt")]
    code = ("import sys\nwritten = 0\nfor path in %r:\n    try:\n        open(path, 'w').write('x')\n        written += 1\n"
            "    except OSError as e:\n        print(type(e).__name__)\nsys.exit(20 + written)" % ([str(t) for t in targets],))
    result = run(code)
    assert result.returncode == 20, result.stdout + result.stderr
    assert not any(t.exists() for t in targets)


def test_signalling_the_parent_and_everyone(run):
    # A process of ours outside the sandbox stands for the rest of the machine; it must survive.
    sentinel = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        first = run(f"import os, signal, time\nfor pid in (os.getppid(), {os.getpid()}, {sentinel.pid}, 1):\n"
                    f"    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(e)\n"
                    f"time.sleep(0.2)\nos.killpg(0, signal.SIGKILL)")
        second = run("import subprocess\nsubprocess.run(['kill', '-9', '-1'])\nimport time\ntime.sleep(0.5)")
        assert _bad_end(first) and _bad_end(second)
        assert sentinel.poll() is None
    finally:
        sentinel.kill()
        sentinel.wait()


def test_daemon_does_not_outlive_the_call(run):
    marker = f"daemon-{uuid.uuid4().hex}"
    code = ("import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        os.execv('/bin/sh', ['/bin/sh', '-c', 'sleep 30; echo woke', %r])\n    os._exit(0)\n"
            "print('detached')\nsys.exit(9)" % marker)
    result = run(code)
    assert result.returncode == 9 and result.stdout == "detached\n"
    assert _processes_with(marker) == []
    time.sleep(0.5)
    assert _processes_with(marker) == []


def test_no_capabilities_and_no_new_privileges(run):
    result = run("status = open('/proc/self/status').read()\nprint([l for l in status.splitlines() "
                 "if l.startswith(('CapEff', 'CapPrm', 'NoNewPrivs'))])\nimport sys\nsys.exit(4)")
    assert result.stdout == "['CapPrm:\\t0000000000000000', 'CapEff:\\t0000000000000000', 'NoNewPrivs:\\t1']\n"


def test_processes_are_limited(run):
    # Forks that stay alive until the limit: RLIMIT_NPROC binds because the program never runs as root.
    code = ("import os, sys, time\nn = 0\nwhile n < 1000:\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    n += 1\nprint(n)\nsys.exit(6)")
    result = run(code)
    assert result.returncode == 6 and 0 < int(result.stdout) < sandbox.MAX_PROCESSES
