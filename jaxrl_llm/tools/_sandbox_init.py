"""The sandbox's first process: run by `jaxrl_llm.tools.sandbox` as `python -I -S _sandbox_init.py SPEC` inside
fresh namespaces (or with none), standard library only.

It reads the program from stdin, builds the filesystem view where asked (a read-only tmpfs root holding
read-only binds of the interpreter and the system libraries, a size-limited tmpfs `/sandbox`, a fresh
/proc; `pivot_root`, the old root detached), then forks the program in a session of its own with the
limits set and privileges dropped, and stays as its reaper. It ends when the program does, when the
wall-clock deadline passes, or when the caller closes its status pipe; in a PID namespace its exit
kills every process left. One line on the status pipe says how it ended: `exit N`, `timeout` or
`error MESSAGE`.
"""

import ctypes
import json
import os
import platform
import resource
import select
import sys
import time

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_STRICTATIME = 1 << 18, 1 << 24
MNT_DETACH = 2
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 38, 47
PIVOT_ROOT_SYSCALL = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}
SIGKILL = 9

_libc = ctypes.CDLL(None, use_errno=True)


def _prctl(*args):
    return _libc.prctl(*(ctypes.c_ulong(a) for a in args))


def _call(name, *args):
    if getattr(_libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}{tuple(a.decode() if isinstance(a, bytes) else a for a in args)}: "
                             f"{os.strerror(errno)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _call("mount", enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def _inherited_flags(path):
    # Flags a bind inside a user namespace may not drop (the kernel locks them): keep the source's own.
    st = os.statvfs(path).f_flag
    flags = MS_NOSUID | MS_NODEV | (st & MS_NOEXEC)
    flags |= (MS_NOATIME if st & os.ST_NOATIME else 0) | (MS_NODIRATIME if st & os.ST_NODIRATIME else 0)
    if not st & (os.ST_RELATIME | os.ST_NOATIME):
        flags |= MS_STRICTATIME
    return flags


def _bind(source, target, *, read_only):
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    try:
        _mount(source, target, None, MS_BIND)
    except OSError:  # a mount with locked submounts (user namespace) binds only recursively
        _mount(source, target, None, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _inherited_flags(source))


def build_root(spec):
    """The filesystem the program sees, then `pivot_root` into it with the old root detached."""
    root = spec["mountpoint"]
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mount("jaxrl-sandbox-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path in spec["ro_binds"]:
        _bind(path, root + path, read_only=True)
    for link, target in spec["symlinks"].items():
        os.symlink(target, root + link)
    os.makedirs(root + "/dev")
    for name in ("null", "zero", "random", "urandom"):
        _bind("/dev/" + name, f"{root}/dev/{name}", read_only=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/sandbox")
    _mount("jaxrl-sandbox", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={spec['disk_mb']}m,nr_inodes=4096,mode=700,uid={spec['uid']},gid={spec['gid']}")
    if spec["tmp_link"]:  # else /tmp holds a read-only bind (an interpreter installed under /tmp)
        os.symlink("sandbox", root + "/tmp")
    os.chdir(root)
    number = PIVOT_ROOT_SYSCALL.get(platform.machine())
    if number is not None:
        _call("syscall", ctypes.c_long(number), b".", b".")
        _call("umount2", b".", MNT_DETACH)
    else:  # an architecture whose syscall number we do not know: chroot (no capability is left to leave it)
        os.chroot(".")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _drop_privileges(uid, gid):
    for cap in range(64):  # empty bounding set: an exec as uid 0 gains no capability (EINVAL past the last)
        _prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    _prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    if os.getuid() != uid:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _exec_program(spec, status_fd):
    os.setsid()  # kill(0, ...) and kill(-pgid) from the program reach only its own descendants
    os.close(status_fd)
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, (soft, hard) in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if spec["drop_privileges"]:
        _drop_privileges(spec["uid"], spec["gid"])
    os.execve(spec["python"], [spec["python"], "-I", "main.py"], spec["env"])


def main():
    spec = json.loads(sys.argv[1])
    status_fd = spec["status_fd"]
    code = sys.stdin.buffer.read()
    try:
        if spec["mountpoint"]:
            build_root(spec)
            os.chdir("/sandbox")
        else:
            os.chdir(spec["workdir"])
        with open("main.py", "wb") as f:
            f.write(code)
        if spec["drop_privileges"] and os.getuid() != spec["uid"]:
            os.chown(".", spec["uid"], spec["gid"])
            os.chown("main.py", spec["uid"], spec["gid"])
        pid = os.fork()
    except BaseException as exc:  # noqa: BLE001 - any setup failure is reported, never half-run
        os.write(status_fd, f"error {type(exc).__name__}: {exc}\n".encode())
        return 1
    if pid == 0:
        try:
            _exec_program(spec, status_fd)
        except BaseException as exc:  # noqa: BLE001
            os.write(2, f"sandbox: could not start python: {exc}\n".encode())
        os._exit(127)
    return _reap(pid, spec["timeout_s"], status_fd)


def _reap(pid, timeout_s, status_fd):
    """Wait for the program, reaping orphans (this is the PID namespace's init); end at the deadline
    or when the caller goes away (its read end of the status pipe closes: POLLERR on ours)."""
    deadline = time.monotonic() + timeout_s
    poller = select.poll()
    poller.register(status_fd, select.POLLERR)
    try:
        pidfd = os.pidfd_open(pid)
        poller.register(pidfd, select.POLLIN)
        tick = 0.5
    except (AttributeError, OSError):
        tick = 0.01
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            os.write(status_fd, b"timeout\n")
            _kill_session(pid)
            return 124
        events = poller.poll(min(remaining, tick) * 1000)
        while True:
            try:
                reaped, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if reaped == 0:
                break
            if reaped == pid:
                os.write(status_fd, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                _kill_session(pid)
                return 0
        if any(fd == status_fd for fd, _ in events):
            _kill_session(pid)
            return 1


def _kill_session(pid):
    # Inside a PID namespace our exit kills everything; without one this is the only cleanup.
    try:
        os.killpg(pid, SIGKILL)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
