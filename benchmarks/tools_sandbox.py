"""Per-call cost and what each isolation mechanism of `run_python` blocks (the table in docs/tools.md).

    .venv/bin/python benchmarks/tools_sandbox.py [--calls 50]

For each mechanism that works here: milliseconds per call of `print(1)` (after one warm-up call), against a
bare `python -I -c 'print(1)'` subprocess; then probes that are safe to run even without isolation: a
connection to a socket this process listens on, reading /etc/shadow and a file in this process's cwd,
writing beside that file, how many processes the program sees, how many it can fork, and whether a
double-forked daemon is still alive after the call.
"""

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

from jaxrl_llm.tools import sandbox

PROBE = """
import os, socket, time
def attempt(f):
    try:
        f()
        return "no"
    except OSError:
        return "yes"
print("network blocked:", attempt(lambda: socket.create_connection(("127.0.0.1", {port}), timeout=2).close()))
print("/etc/shadow hidden:", attempt(lambda: open("/etc/shadow").read()))
print("caller's files hidden:", attempt(lambda: open({secret!r}).read()))
print("writes outside blocked:", attempt(lambda: open({escape!r}, "w").write("x")))
print("processes seen:", sum(p.isdigit() for p in os.listdir("/proc")))
n = 0
while n < 1000:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(3)
        os._exit(0)
    n += 1
print("forks allowed:", n if n < 1000 else ">= 1000")
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sh", ["/bin/sh", "-c", "sleep 5; echo woke", {marker!r}])
    os._exit(0)
"""


def per_call_ms(run, calls: int) -> float:
    run()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - start) / calls * 1000


def pids_with(marker: str) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in pathlib.Path(f"/proc/{entry}/cmdline").read_bytes() and int(entry) != os.getpid():
                found.append(int(entry))
        except OSError:
            pass
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    bare = per_call_ms(lambda: subprocess.run([sys.executable, "-I", "-c", "print(1)"], capture_output=True),
                       args.calls)
    print(f"bare subprocess `python -I -c 'print(1)'`: {bare:.1f} ms per call")
    print(f"uid {os.geteuid()}, {os.cpu_count()} cpus, kernel {os.uname().release}")
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        secret = pathlib.Path(tmp, "checkpoint.msgpack")
        secret.write_text("weights")
        escape = pathlib.Path(tmp, "escaped.txt")
        for mechanism in ("unshare", "bwrap", "none"):
            problem = sandbox._probe(mechanism) if mechanism != "none" else None
            if problem is not None:
                print(f"| `{mechanism}` | unavailable: {problem} |")
                continue
            ms = per_call_ms(lambda: sandbox._run(mechanism, "print(1)", timeout_s=5, memory_mb=512), args.calls)
            marker = f"bench-daemon-{uuid.uuid4().hex}"
            code = PROBE.format(port=server.getsockname()[1], secret=str(secret), escape=str(escape), marker=marker)
            result = sandbox._run(mechanism, code, timeout_s=10, memory_mb=512)
            time.sleep(0.5)
            survivors = pids_with(marker)
            escaped = escape.exists()
            escape.unlink(missing_ok=True)
            lines = [line.split(": ", 1)[1] for line in result.stdout.splitlines() if ": " in line]
            print(f"| `{mechanism}` | {ms:.0f} | " + " | ".join(lines) + f" | {'no' if survivors else 'yes'} |"
                  + (" (a file was written outside)" if escaped else ""))
            for pid in survivors:  # the daemon this probe started (isolation "none" lets it live)
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
