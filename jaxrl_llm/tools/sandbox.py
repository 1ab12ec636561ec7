"""`run_python`: a model's Python code run in a separate, isolated, limited process.

Isolation (docs/tools.md has the measurements behind the choice), picked once per process:

- `unshare` (util-linux, on every Debian/Ubuntu): new mount, PID, network, IPC and UTS namespaces (plus a
  user namespace when the caller is not root); the program sees a read-only root holding only the system
  libraries and this interpreter, a 64 MiB tmpfs `/sandbox` as its cwd and a fresh /proc, runs without
  capabilities (as a fresh unprivileged uid when the caller is root), and dies with the namespace.
- `bwrap` (bubblewrap, `apt-get install bubblewrap`): the same view built by bubblewrap; the fallback where
  `unshare` cannot create namespaces (e.g. Ubuntu's AppArmor restriction on user namespaces).
- `none`: only the limits below and a temporary cwd; refused unless asked for by `isolation="none"` or
  `JAXRL_LLM_UNSAFE_TOOLS=1`.

Every mechanism sets the limits (address space, CPU seconds, processes, file size, open files, no core
files), a wall-clock deadline enforced both by the sandbox's init and by the caller, and caps what is kept
of stdout and stderr at `MAX_OUTPUT_BYTES` each (read as it arrives; the rest is drained and dropped).
"""

import dataclasses
import functools
import json
import math
import os
import pathlib
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

MAX_OUTPUT_BYTES = 65536  # kept of stdout and of stderr, each; `ToolResult.truncated` says when more came
DISK_MB = 64  # the sandbox's tmpfs /sandbox (its cwd, HOME and TMPDIR)
MAX_FILE_MB = 16  # RLIMIT_FSIZE: no single file larger
MAX_PROCESSES = 64  # RLIMIT_NPROC: processes and threads of the program's uid
MAX_OPEN_FILES = 256  # RLIMIT_NOFILE
GRACE_S = 3.0  # the caller's own deadline is the init's plus this (namespace setup and teardown)
UNSAFE_ENV = "JAXRL_LLM_UNSAFE_TOOLS"
ISOLATIONS = ("auto", "unshare", "bwrap", "none")
_INIT = str(pathlib.Path(__file__).with_name("_sandbox_init.py"))
_NAMESPACES = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--propagation", "private"]


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What a tool call gave back: the program's output (UTF-8, undecodable bytes replaced), its exit
    status (negative: killed by that signal), whether the wall-clock deadline ended it, whether output was
    cut at `MAX_OUTPUT_BYTES`, the isolation it ran under and its wall time."""
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    truncated: bool = False
    isolation: str = ""
    seconds: float = 0.0


class SandboxUnavailableError(RuntimeError):
    """No isolation mechanism works here and the caller did not opt in to running without one."""


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, isolation: str = "auto") -> ToolResult:
    """Runs `code` with this interpreter (`sys.executable -I`, the standard library and this environment's
    packages read-only) in a sandbox; `isolation` is "auto" (unshare, else bwrap, else refuse unless
    JAXRL_LLM_UNSAFE_TOOLS=1), or one mechanism by name. Never raises for what the code does; raises
    `SandboxUnavailableError` when the isolation asked for is unavailable."""
    mechanism = resolve_isolation(isolation)
    return _run(mechanism, code, timeout_s=timeout_s, memory_mb=memory_mb)


def resolve_isolation(isolation: str = "auto") -> str:
    """The mechanism `run_python(isolation=...)` uses here ("unshare", "bwrap" or "none"), probed once per
    process; raises `SandboxUnavailableError` naming what failed and how to install what is missing."""
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "none":
        return "none"
    candidates = ("unshare", "bwrap") if isolation == "auto" else (isolation,)
    problems = {name: _probe(name) for name in candidates}
    for name in candidates:
        if problems[name] is None:
            return name
    if isolation == "auto" and os.environ.get(UNSAFE_ENV) == "1":
        return "none"
    detail = "; ".join(f"{name}: {problem}" for name, problem in problems.items())
    raise SandboxUnavailableError(
        f"no sandbox for run_python ({detail}). Install util-linux (unshare) or bubblewrap "
        f"(`apt-get install bubblewrap`) where namespaces are allowed, or opt in to running model code "
        f"with only resource limits: run_python(..., isolation=\"none\") or {UNSAFE_ENV}=1")


@functools.cache
def _probe(mechanism: str) -> str | None:
    """None where `mechanism` runs a program here, else why not."""
    binary = {"unshare": "unshare", "bwrap": "bwrap"}[mechanism]
    if shutil.which(binary) is None:
        return f"`{binary}` not found" + (" (apt-get install bubblewrap)" if binary == "bwrap" else "")
    try:
        result = _run(mechanism, "print(6 * 7)", timeout_s=20.0, memory_mb=512)
    except (OSError, RuntimeError) as exc:
        return str(exc)
    if result.returncode != 0 or result.stdout != "42\n":
        return f"a test program failed (exit {result.returncode}): {result.stderr.strip()[-300:]}"
    return None


@functools.cache
def _filesystem_view() -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """(read-only binds, top-level symlinks): the system libraries and this interpreter, nothing else."""
    binds, links = {"/usr"}, []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append((top, os.readlink(top)))
        elif os.path.isdir(top):
            binds.add(top)
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                 os.path.dirname(os.path.realpath(sys.executable))):
        binds.update({os.path.abspath(path), os.path.realpath(path)})
    binds.update(f for f in ("/etc/ld.so.cache", "/etc/localtime") if os.path.exists(f))
    # A path inside another bound path is bound with it (the outer bind holds it).
    kept = sorted(p for p in binds if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in binds))
    return tuple(kept), tuple(links)


def _tmp_link(binds) -> bool:
    """Whether the program's /tmp can be a link to its working directory: not where a bound path (an interpreter
    or virtual environment installed under /tmp) needs /tmp as a directory; there /tmp holds that read-only
    bind, and $TMPDIR (the working directory) is where the program writes."""
    return not any(path == "/tmp" or path.startswith("/tmp/") for path in binds)


def _rlimits(timeout_s: float, memory_mb: int) -> dict[str, tuple[int, int]]:
    cpu = math.ceil(timeout_s) + 1
    return {"RLIMIT_AS": (memory_mb << 20, memory_mb << 20), "RLIMIT_CPU": (cpu, cpu + 1),
            "RLIMIT_FSIZE": (MAX_FILE_MB << 20, MAX_FILE_MB << 20), "RLIMIT_NPROC": (MAX_PROCESSES, MAX_PROCESSES),
            "RLIMIT_NOFILE": (MAX_OPEN_FILES, MAX_OPEN_FILES), "RLIMIT_CORE": (0, 0)}


def _program_env(home: str) -> dict[str, str]:
    # One BLAS thread: numpy's thread pool would otherwise reserve address space per core.
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@functools.cache
def _bwrap_has_size() -> bool:
    help_text = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, check=False).stdout
    return "--size" in help_text


def _command(mechanism: str, spec: dict, mountpoint: str) -> tuple[list[str], dict]:
    """The command line that starts the init under `mechanism`, and the init's spec."""
    python = sys.executable
    binds, links = _filesystem_view()
    if mechanism == "unshare":
        root = os.geteuid() == 0
        # As root: no user namespace, the program runs as a fresh uid (RLIMIT_NPROC does not bind root).
        # Otherwise: a user namespace whose root (the caller outside) holds no capability once it execs.
        uid = 1_000_000_000 + secrets.randbelow(100_000_000) if root else 0
        spec.update(mountpoint=mountpoint, ro_binds=list(binds), symlinks=dict(links), uid=uid, gid=uid,
                    drop_privileges=True, env=_program_env("/sandbox"), tmp_link=_tmp_link(binds))
        user = [] if root else ["--user", "--map-root-user"]
        return ["unshare", *user, *_NAMESPACES, "--", python, "-I", "-S", _INIT, json.dumps(spec)], spec
    if mechanism == "bwrap":
        init = "/.jaxrl_llm_sandbox_init.py"
        root = os.geteuid() == 0
        # As root: no user namespace; the init keeps root's capabilities only to chown /sandbox and switch
        # to a fresh uid. Otherwise bubblewrap's user namespace, every capability dropped.
        uid = 1_000_000_000 + secrets.randbelow(100_000_000) if root else os.getuid()
        spec.update(mountpoint=None, workdir="/sandbox", uid=uid, gid=uid if root else os.getgid(),
                    drop_privileges=True, env=_program_env("/sandbox"))
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        cmd = ["bwrap", *(namespaces + ["--cap-add", "ALL"] if root else ["--unshare-all", "--cap-drop", "ALL"]),
               "--die-with-parent", "--new-session"]
        parents = sorted({str(p) for path in binds for p in pathlib.Path(path).parents if str(p) != "/"})
        for parent in parents:  # traversable by the fresh uid (bubblewrap would copy /root's 0700)
            cmd += ["--perms", "0755", "--dir", parent]
        for path in binds:
            cmd += ["--ro-bind", path, path]
        for link, target in links:
            cmd += ["--symlink", target, link]
        cmd += ["--dev", "/dev", "--proc", "/proc"]
        cmd += (["--size", str(DISK_MB << 20)] if _bwrap_has_size() else []) + ["--tmpfs", "/sandbox"]
        cmd += ["--symlink", "sandbox", "/tmp"] if _tmp_link(binds) else []
        cmd += ["--ro-bind", _INIT, init, "--remount-ro", "/", "--chdir", "/sandbox"]
        return cmd + ["--", python, "-I", "-S", init, json.dumps(spec)], spec
    spec.update(mountpoint=None, workdir=mountpoint, uid=os.getuid(), gid=os.getgid(), drop_privileges=False,
                env=_program_env(mountpoint))
    return [python, "-I", "-S", _INIT, json.dumps(spec)], spec


def _run(mechanism: str, code: str, *, timeout_s: float, memory_mb: int) -> ToolResult:
    start = time.monotonic()
    status_r, status_w = os.pipe()
    workdir = tempfile.mkdtemp(prefix="jaxrl_llm_sandbox_")
    spec = {"status_fd": status_w, "timeout_s": float(timeout_s), "rlimits": _rlimits(timeout_s, memory_mb),
            "python": sys.executable, "disk_mb": DISK_MB}
    cmd, spec = _command(mechanism, spec, workdir)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_w,), start_new_session=True, cwd=workdir,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"})
    except OSError:
        os.close(status_r)
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        os.close(status_w)
    try:
        streams, status, truncated, late = _communicate(proc, code.encode("utf-8", "replace"), status_r,
                                                        start + timeout_s + GRACE_S)
    finally:
        if proc.poll() is None:  # not reaped yet, so its process group cannot be another's
            _kill_group(proc)
        proc.wait()
        os.close(status_r)
        shutil.rmtree(workdir, ignore_errors=True)
    stdout, stderr = (s.decode("utf-8", "replace") for s in streams)
    line = status.decode("utf-8", "replace").strip()
    if line.startswith("error "):
        raise RuntimeError(f"sandbox ({mechanism}) could not start the program: {line[6:]}")
    timed_out = late or line == "timeout"
    if line.startswith("exit "):
        returncode = int(line.split()[1])
    else:  # killed before the init could say (the deadline, or the program killed its own init)
        returncode = -signal.SIGKILL if timed_out else (proc.returncode or -signal.SIGKILL)
    return ToolResult(stdout, stderr, returncode, timed_out, truncated, mechanism, time.monotonic() - start)


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _communicate(proc, code: bytes, status_r: int, deadline: float):
    """Feeds `code` to the init's stdin and reads stdout, stderr and the status pipe as they come, keeping
    at most MAX_OUTPUT_BYTES of each stream; at `deadline` kills the process group and stops."""
    selector = selectors.DefaultSelector()
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    buffers = {out: bytearray(), err: bytearray(), status_r: bytearray()}
    for fd in buffers:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    stdin = proc.stdin.fileno()
    os.set_blocking(stdin, False)
    pending = memoryview(code)
    selector.register(stdin, selectors.EVENT_WRITE)
    truncated = late = init_gone = False
    while selector.get_map():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = not init_gone
            _kill_group(proc)
            break
        for key, _ in selector.select(remaining):
            fd = key.fd
            if fd == stdin:
                try:
                    pending = pending[os.write(fd, pending[:65536]):]
                except BlockingIOError:
                    pass
                except BrokenPipeError:  # the init ended before reading it all (a setup error says why)
                    pending = pending[:0]
                if not pending:
                    selector.unregister(fd)
                    proc.stdin.close()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                selector.unregister(fd)
                if fd == status_r:  # the init is gone; a daemon that escaped it (isolation "none") may hold
                    deadline, init_gone = min(deadline, time.monotonic() + 0.5), True  # the pipes: stop soon
                continue
            buffer = buffers[fd]
            room = MAX_OUTPUT_BYTES - len(buffer) if fd != status_r else len(chunk)
            if len(chunk) > room:
                truncated = True
            buffer += chunk[:max(room, 0)]
    selector.close()
    if not proc.stdin.closed:
        proc.stdin.close()
    return (bytes(buffers[out]), bytes(buffers[err])), bytes(buffers[status_r]), truncated, late
