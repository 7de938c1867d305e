"""LocalSandbox against hostile code, and the SandboxFusion client against a local stand-in /run_code server.

Every hostile program runs with small limits; each test checks that the program was contained (limit hit, nothing
left running, working directory gone, host files unchanged) and that the calling process is unaffected (no
children, memory flat). These tests run as root in CI: the uid-0 case is exercised there, not skipped. A test skips
only when this kernel lacks the feature it checks, and says which.
"""

import ast
import asyncio
import errno
import fcntl
import json
import os
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trl_ext.tools import CodeInterpreterTool
from trl_ext.tools.sandbox import LocalSandbox, SandboxResult, _probe, remove_tree, usable_cpus
from trl_ext.tools.sandbox_fusion import SandboxFusionBackend

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalSandbox is Linux-only")

LIMITS = dict(timeout_s=5.0, memory_mb=256, max_output_bytes=64 * 1024)
MAX_PROCS = 6


ROOT = os.geteuid() == 0
SYSTEM_PYTHON = "/usr/bin/python3"


def _system_python_usable() -> bool:
    from trl_ext.tools.sandbox import _world_accessible

    return os.access(SYSTEM_PYTHON, os.X_OK) and _world_accessible(SYSTEM_PYTHON)


@pytest.fixture(scope="module")
def sandbox():
    # a small disk quota keeps the memory cgroup's limit (memory_mb + quota + 64 MiB) close to memory_mb
    return LocalSandbox(max_processes=MAX_PROCS, max_concurrency=2, max_disk_mb=16)


@pytest.fixture(scope="module")
def no_namespace_sandbox():
    """Root without namespaces: an on-disk working directory, protected by the unprivileged uid alone."""
    if not ROOT or not _system_python_usable():
        pytest.skip("needs root and a system python any uid can run (the no-namespace mode requires one)")
    return LocalSandbox(python=SYSTEM_PYTHON, max_processes=MAX_PROCS, use_namespaces=False, use_cgroups=False)


@pytest.fixture
def open_tmp():
    """A folder every uid can traverse (pytest's tmp_path sits in a 0700 folder: the sandbox uid could not even
    reach the targets there, and the tests would prove nothing)."""
    folder = Path(tempfile.mkdtemp(prefix="hf_gptoss_rl_test_"))
    os.chmod(folder, 0o755)
    yield folder
    remove_tree(str(folder))


def run(sandbox, code, **overrides) -> SandboxResult:
    return asyncio.run(sandbox.run_code(code, **{**LIMITS, **overrides}))


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _processes_mentioning(marker: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmd:
                out.append(int(entry))
    return out


def assert_contained(result: SandboxResult, workdir: str | None = None):
    """Nothing of the run survives: no child of ours, no process running from its folder, the folder is gone."""
    deadline = time.monotonic() + 3
    while _children_of(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _children_of(os.getpid()) == []
    if workdir:
        assert not os.path.exists(workdir)
        while _processes_mentioning(workdir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_mentioning(workdir) == []


def workdir_of(result: SandboxResult) -> str:
    line = result.stdout.splitlines()[0]
    assert line.startswith("CWD "), result
    return line[4:]


PRINT_CWD = "import os, sys\nprint('CWD ' + os.getcwd(), flush=True)\n"


def test_runs_code_and_reports_isolation(sandbox):
    r = run(sandbox, PRINT_CWD + "print(6 * 7)\nprint('warn', file=sys.stderr)\nsys.exit(3)")
    assert r.stdout.splitlines()[1] == "42" and r.stderr == "warn\n"
    assert r.exit_code == 3 and not r.timed_out and not r.truncated and r.error is None
    assert r.isolation["network"] in ("netns", "landlock-tcp", "python-guard")
    assert r.isolation["process_limit"] in ("pids-cgroup", "rlimit-nproc", None)
    if os.geteuid() == 0 and r.isolation["cgroups"]:
        assert r.isolation["process_limit"] == "pids-cgroup"
    assert_contained(r, workdir_of(r))


def test_numpy_and_sympy_work_inside(sandbox):
    r = run(
        sandbox,
        "import numpy as np, sympy as sp\nprint(int(np.arange(10).sum()), sp.factorint(360))",
        memory_mb=1024,
        timeout_s=20,
    )
    assert r.exit_code == 0, r.stderr
    assert r.stdout.strip() == "45 {2: 3, 3: 2, 5: 1}"


def test_infinite_loop_times_out(sandbox):
    t = time.monotonic()
    r = run(sandbox, PRINT_CWD + "while True:\n    pass", timeout_s=1.5)
    assert r.timed_out and r.exit_code is None
    assert time.monotonic() - t < 6
    assert_contained(r, workdir_of(r))


def test_sleeping_and_setsid_escapees_are_killed(sandbox):
    code = PRINT_CWD + (
        "import time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    time.sleep(60)\n"
        "print('main done', flush=True)\n"
    )
    r = run(sandbox, code)
    assert "main done" in r.stdout and r.exit_code == 0
    assert_contained(r, workdir_of(r))


def test_cancelled_run_is_killed(sandbox):
    """A caller's own timeout (asyncio.wait_for around run_code) must kill the whole tree too."""
    marker = f"MARKER-{os.getpid()}-{time.monotonic_ns()}"
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
        "time.sleep(60)"
    )

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sandbox.run_code(code, **{**LIMITS, "timeout_s": 30}), timeout=1.5)

    asyncio.run(main())
    deadline = time.monotonic() + 3
    while _processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_mentioning(marker) == []
    assert_contained(None)


def test_without_namespaces_subreaper_and_landlock_still_contain(no_namespace_sandbox):
    """Where namespaces are not used: init, a child subreaper, kills escapees; Landlock closes TCP."""
    sb = no_namespace_sandbox
    code = PRINT_CWD + (
        "import time, socket\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    time.sleep(60)\n"
        "try:\n    socket.create_connection(('127.0.0.1', 9), 1); print('CONNECTED')\n"
        "except OSError as e:\n    print(type(e).__name__)\n"
    )
    r = run(sb, code)
    assert not r.isolation["netns"] and not r.isolation["pidns"]
    if r.isolation["network"] == "landlock-tcp":
        assert "PermissionError" in r.stdout
    assert "CONNECTED" not in r.stdout and r.exit_code == 0, r
    assert_contained(r, workdir_of(r))
    hung = run(
        sb, PRINT_CWD + "if os.fork() == 0:\n    os.setsid()\n    while True: pass\nwhile True: pass", timeout_s=1
    )
    assert hung.timed_out
    assert_contained(hung, workdir_of(hung))


def test_fork_bomb_is_contained(sandbox):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # counted forks: at most max_processes tasks at once (the program itself included)
    counted = run(
        sandbox,
        PRINT_CWD
        + (
            "import time\nn = 0\n"
            "for _ in range(100):\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(5); os._exit(0)\n"
            "        n += 1\n"
            "    except OSError:\n"
            "        break\n"
            "print('forked', n, flush=True)\n"
        ),
    )
    assert counted.isolation["process_limit"] in ("pids-cgroup", "rlimit-nproc")
    forked = int(counted.stdout.split("forked")[1])
    assert 0 <= forked <= MAX_PROCS - 1, counted
    assert_contained(counted, workdir_of(counted))
    # a real fork bomb
    bomb = run(
        sandbox, PRINT_CWD + "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=2
    )
    assert bomb.timed_out
    assert_contained(bomb, workdir_of(bomb))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB


def test_threads_count_against_the_process_limit(sandbox):
    r = run(
        sandbox,
        "import threading, time\nn = 0\ntry:\n    for _ in range(50):\n"
        "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start(); n += 1\n"
        "except RuntimeError:\n    pass\nprint(n)",
    )
    assert int(r.stdout) <= MAX_PROCS - 1


def test_10gb_allocation_fails_inside(sandbox):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run(sandbox, PRINT_CWD + "x = bytearray(10 * 2**30)\nprint('allocated')")
    assert "MemoryError" in r.stderr and "allocated" not in r.stdout and r.exit_code == 1
    gradual = run(sandbox, "xs = []\nwhile True:\n    xs.append(bytearray(32 * 2**20))")
    assert "MemoryError" in gradual.stderr or gradual.signal is not None, gradual
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024
    assert_contained(r, workdir_of(r))


def test_memory_cgroup_limits_the_whole_tree(sandbox):
    """4 processes x 200 MiB each under memory_mb=256: RLIMIT_AS alone would allow it, the tree's cgroup does not."""
    code = (
        "import os, time\npids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            b = bytearray(200 * 2**20)\n"
        "            for j in range(0, len(b), 4096):\n                b[j] = 1\n"
        "            time.sleep(0.5)\n            os._exit(0)\n"
        "        except MemoryError:\n            os._exit(3)\n"
        "    pids.append(pid)\n"
        "print([os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids])"
    )
    r = run(sandbox, code, timeout_s=10)
    if r.isolation.get("memory_limit") != "cgroup+rlimit-as":
        pytest.skip("no memory cgroup here: memory is limited per process only")
    codes = ast.literal_eval(r.stdout.strip())  # e.g. [-9, -9, 0, -9]: OOM kills inside the group
    assert codes.count(0) <= 1, codes


def test_gigabytes_of_output_are_cut(sandbox):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.monotonic()
    r = run(
        sandbox,
        PRINT_CWD + "chunk = 'x' * 2**20\nfor _ in range(4096):\n    sys.stdout.write(chunk)",
        max_output_bytes=100_000,
    )
    assert r.truncated and len(r.stdout.encode()) <= 100_000 and not r.timed_out
    err = run(sandbox, "import sys\nwhile True:\n    sys.stderr.write('e' * 65536)", max_output_bytes=50_000)
    assert err.truncated and len(err.stderr) <= 50_000
    assert time.monotonic() - t < 10
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024
    assert_contained(r, workdir_of(r))


def test_network_connect_fails(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        code = (
            "import socket\nresults = []\n"
            f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80), ('8.8.8.8', 53)]:\n"
            "    try:\n        s = socket.socket()\n        s.settimeout(1)\n"
            "        s.connect(addr)\n        results.append('CONNECTED')\n"
            "    except OSError as e:\n        results.append(type(e).__name__)\n"
            "try:\n    socket.getaddrinfo('example.com', 80)\n    results.append('RESOLVED')\n"
            "except OSError as e:\n    results.append(type(e).__name__)\n"
            "print(results)"
        )
        r = run(sandbox, code)
        assert r.exit_code == 0, r.stderr
        assert "CONNECTED" not in r.stdout and "RESOLVED" not in r.stdout, r.stdout
        with pytest.raises(socket.timeout):
            server.accept()  # nothing reached our listening socket
    finally:
        server.close()


def test_unix_sockets_fail(sandbox, open_tmp):
    """Landlock does not cover connect() on pathname unix sockets (think /var/run/docker.sock): seccomp does."""
    path = str(open_tmp / "service.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    os.chmod(path, 0o777)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0hf_gptoss_rl_test_{os.getpid()}")
    abstract.listen(1)
    try:
        code = (
            "import socket\n"
            f"for addr in [{path!r}, {f'{chr(0)}hf_gptoss_rl_test_{os.getpid()}'!r}]:\n"
            "    try:\n        s = socket.socket(socket.AF_UNIX); s.connect(addr); print('CONNECTED')\n"
            "    except OSError as e:\n        print(type(e).__name__)\n"
            "a, b = socket.socketpair(); a.sendall(b'ok'); print(b.recv(2).decode())\n"  # pairs still work
        )
        r = run(sandbox, code)
        if r.isolation.get("seccomp") is None:
            pytest.skip(f"no seccomp filter here: {r.isolation.get('seccomp_error', 'unknown architecture')}")
        assert r.stdout.split() == ["PermissionError", "PermissionError", "ok"], r
    finally:
        server.close()
        abstract.close()


def test_socket_families_are_allowed_by_list(sandbox):
    """seccomp allows socket families by list: socketpair() of AF_UNIX and nothing else, socket() of no family (the
    sandbox has no network: not even a UDP socket; unix sockets could reach a docker socket). Every other family
    of 0-63, known to this kernel or not, is answered EACCES, the filter's own answer: the kernel alone would create
    IP sockets, answer EAFNOSUPPORT for a family it lacks and EPERM for one that needs a capability, which is what a
    list of denied families let through."""
    code = (
        "import errno, socket\nout = {}\n"
        "def attempt(name, make):\n"
        "    try:\n        make().close(); out[name] = 'CREATED'\n"
        "    except OSError as e:\n        out[name] = errno.errorcode.get(e.errno, e.errno)\n"
        "for family in range(64):\n"
        "    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW):\n"
        "        attempt(('socket', family, int(kind)), lambda: socket.socket(family, kind, 0))\n"
        "        if family != socket.AF_UNIX:\n"
        "            attempt(('socketpair', family, int(kind)), lambda: socket.socketpair(family, kind)[0])\n"
        "a, b = socket.socketpair(); a.sendall(b'ok'); out['unix_pair'] = b.recv(2).decode()\n"
        "print(out)"
    )
    r = run(sandbox, code)
    if r.isolation.get("seccomp") is None:
        pytest.skip(f"no seccomp filter here: {r.isolation.get('seccomp_error', 'unknown architecture')}")
    assert r.exit_code == 0, r
    out = ast.literal_eval(r.stdout)
    assert out.pop("unix_pair") == "ok"
    assert len(out) == 64 * 3 * 2 - 3
    allowed = {key: answer for key, answer in out.items() if answer != "EACCES"}
    assert not allowed, f"not refused by the filter: {allowed}"


def test_reading_and_writing_outside_its_directory_fail(sandbox, open_tmp):
    secret = open_tmp / "secret.txt"
    secret.write_text("TOP SECRET")
    secret.chmod(0o644)
    code = PRINT_CWD + (
        "out = []\n"
        f"for path in [{str(secret)!r}, '/etc/passwd', '/etc/hostname', {os.path.abspath(__file__)!r}]:\n"
        "    try:\n        out.append(open(path).read()[:10])\n    except OSError as e:\n        out.append(type(e).__name__)\n"
        f"for path in [{str(open_tmp / 'written.txt')!r}, '/tmp/escaped.txt']:\n"
        "    try:\n        open(path, 'w').write('x'); out.append('WROTE')\n    except OSError as e:\n"
        "        out.append(type(e).__name__)\n"
        "open('inside.txt', 'w').write('ok')\nout.append(open('inside.txt').read())\n"
        "try:\n    out.append(str(len(os.listdir('/'))))\nexcept OSError as e:\n    out.append(type(e).__name__)\n"
        "print(out)"
    )
    r = run(sandbox, code)
    assert r.exit_code == 0, r.stderr
    if not r.isolation.get("landlock"):
        pytest.skip(f"Landlock unavailable here ({r.isolation.get('landlock_error')}): files are protected by uid only")
    assert "TOP SECRET" not in r.stdout and "WROTE" not in r.stdout, r.stdout
    # PermissionError from Landlock or the uid; OSError(EROFS) where the read-only mount refuses first
    assert "'ok'" in r.stdout and r.stdout.count("PermissionError") + r.stdout.count("OSError") == 7, r.stdout
    assert not (open_tmp / "written.txt").exists() and not os.path.exists("/tmp/escaped.txt")
    assert_contained(r, workdir_of(r))


WHO_AM_I = "import os\nprint([*os.getresuid(), *os.getresgid(), *os.getgroups()])\n"


def _ids(result: SandboxResult) -> list[int]:
    """Real, effective and saved uids and gids, then the supplementary groups, as the program saw them."""
    return ast.literal_eval(result.stdout.splitlines()[0])


@pytest.mark.skipif(not ROOT, reason="the uid-0 case needs a root caller (CI runs as root)")
def test_root_caller_never_runs_the_program_as_uid_0(sandbox):
    """The installation here keeps the interpreter in a 0700 folder (a pyenv under /root) or not: either way the
    program runs as an unprivileged uid/gid with no supplementary groups and no capabilities."""
    r = run(
        sandbox,
        WHO_AM_I + "out = []\nfor f in (lambda: os.setuid(0), lambda: os.nice(-5), "
        "lambda: os.chroot('.'), lambda: os.mknod('dev', 0o600 | 0o020000, os.makedev(1, 3)), "
        "lambda: open('/proc/sysrq-trigger', 'w'), lambda: os.chown('main.py', 0, 0)):\n"
        "    try:\n        f(); out.append('ALLOWED')\n    except OSError as e:\n"
        "        out.append(type(e).__name__)\nprint(out)",
    )
    assert r.exit_code == 0, r
    ids = _ids(r)
    assert 0 not in ids and len(set(ids)) == 1, r.stdout  # one fresh uid == gid, no groups
    assert "ALLOWED" not in r.stdout and r.isolation["privileges"] == f"uid {ids[0]}"
    with pytest.raises(ValueError, match="never run as uid 0"):
        LocalSandbox(sandbox_uid=0)
    with pytest.raises(ValueError, match="never run as uid 0"):
        LocalSandbox(sandbox_uid=False)


@pytest.mark.skipif(not ROOT, reason="the uid-0 case needs a root caller (CI runs as root)")
def test_launcher_refuses_uid_0_even_if_asked(monkeypatch):
    """Belt and braces: a configuration without a sandbox uid (a bug upstream) stops in the launcher."""
    sb = LocalSandbox()
    monkeypatch.setattr(sb, "_root", False)  # the parent now "forgets" the uid switch; the launcher still runs as root
    r = run(sb, "print('ran')")
    assert r.error and "refusing to run the program as uid/gid 0" in r.error and "ran" not in r.stdout


@pytest.mark.skipif(not ROOT, reason="needs a root caller")
def test_interpreter_in_a_private_folder_is_exposed_read_only():
    """A venv/pyenv under a 0700 /root: inside the sandbox's mount namespace a tmpfs hides /root, showing only the
    interpreter's folders, read-only, so the unprivileged uid can run it (imports included)."""
    sb = LocalSandbox(isolate_filesystem=False)  # without Landlock, to see exactly what the mount namespace shows
    if not sb._expose:
        pytest.skip(f"the interpreter ({sys.executable}) is already reachable by every uid here: nothing to expose")
    blocker, paths = sb._expose[0]
    visible = os.path.relpath(paths[0], blocker).split(os.sep)[0]
    r = run(
        sb,
        WHO_AM_I + f"import numpy\nprint(sorted(os.listdir({blocker!r})))\n"
        f"try:\n    open({paths[0] + '/x'!r}, 'w')\nexcept OSError as e:\n    print(e.errno)",
        memory_mb=512,
    )
    assert r.exit_code == 0, r
    assert 0 not in _ids(r)
    assert r.stdout.splitlines()[1] == str([visible]) and r.stdout.splitlines()[2] == str(errno.EROFS)


@pytest.mark.skipif(not ROOT, reason="needs a root caller")
def test_refuses_when_the_uid_cannot_reach_the_interpreter(monkeypatch):
    """Without a mount namespace a private interpreter cannot be exposed: refuse, naming the reason and the fix."""
    from trl_ext.tools.sandbox import _reachable

    if _reachable(sys.executable) is None:
        pytest.skip(f"{sys.executable} is reachable by every uid here: nothing to refuse")
    with pytest.raises(RuntimeError, match=r"(?s)will not run model code as uid 0.*cannot be traversed.*Fix: "):
        LocalSandbox(use_namespaces=False)
    monkeypatch.setattr("trl_ext.tools.sandbox._probe", lambda euid: {"mount": False, "mount_error": "EPERM"})
    with pytest.raises(RuntimeError, match=r"(?s)no mount namespace.*EPERM.*allow mount namespaces"):
        LocalSandbox()


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK), reason="needs root and a system python"
)
def test_unprivileged_uid_mode_with_rlimit_nproc():
    """Root with an interpreter any uid can run: switch to a fresh uid, where RLIMIT_NPROC alone stops a fork bomb."""
    from trl_ext.tools.sandbox import _world_accessible

    if not _world_accessible("/usr/bin/python3"):
        pytest.skip("/usr/bin/python3 is not reachable by an unprivileged uid")
    sb = LocalSandbox(python="/usr/bin/python3", max_processes=MAX_PROCS, use_cgroups=False)
    r = run(
        sb,
        PRINT_CWD + "print('UID', os.getuid(), flush=True)\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        pass",
        timeout_s=2,
    )
    assert r.timed_out and r.isolation["privileges"].startswith("uid ") and "UID 0" not in r.stdout
    assert_contained(r, workdir_of(r))


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become an unprivileged user"
)
@pytest.mark.parametrize("namespaces", [True, False])
def test_unprivileged_caller(tmp_path, namespaces):
    """The sandbox started by an unprivileged user: inside a user namespace it runs (no cgroups, RLIMIT_NPROC counted
    in the namespace, network namespace, read-only mounts, no capabilities); without namespaces nothing would stop
    the program from changing the caller's own files, so the constructor refuses."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("needs a system python reachable by an unprivileged uid")
    sandbox_py = str(Path(__file__).resolve().parents[1] / "trl_ext" / "tools" / "sandbox.py")
    script = (
        "import asyncio, importlib.util, sys, json\n"
        f"spec = importlib.util.spec_from_file_location('sandbox_mod', {sandbox_py!r})\n"
        "mod = sys.modules['sandbox_mod'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        f"sb = mod.LocalSandbox(max_processes={MAX_PROCS}, use_namespaces={namespaces})\n"
        "code = ('import os, socket\\nn = 0\\nfor _ in range(60):\\n    try:\\n        pid = os.fork()\\n'\n"
        "        '        if pid == 0:\\n            import time; time.sleep(3); os._exit(0)\\n        n += 1\\n'\n"
        "        '    except OSError:\\n        break\\ntry:\\n    socket.create_connection((\"1.1.1.1\", 80), 1)\\n'\n"
        "        '    net = \"CONNECTED\"\\nexcept Exception as e:\\n    net = type(e).__name__\\nprint(n, net)')\n"
        "r = asyncio.run(sb.run_code(code, timeout_s=5, memory_mb=256, max_output_bytes=10000))\n"
        "print(json.dumps({'stdout': r.stdout, 'stderr': r.stderr[-500:], 'iso': r.isolation, 'err': r.error}))\n"
    )
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/tmp",
        env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"},
    )
    if not namespaces:
        # the program would run as the caller's uid, owning the caller's files: refused, with the fixes named
        assert out.returncode != 0 and "cannot protect host files" in out.stderr, out.stderr[-2000:]
        assert "unprivileged user namespaces" in out.stderr and "SandboxFusionBackend" in out.stderr
        return
    if "cannot protect host files" in out.stderr:
        pytest.skip(f"unprivileged user namespaces are not allowed on this kernel: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["err"] is None, report
    forked, net = report["stdout"].split()
    assert int(forked) <= MAX_PROCS, report
    assert net != "CONNECTED", report
    assert not report["iso"].get("cgroups") and report["iso"]["process_limit"] == "rlimit-nproc"
    assert report["iso"]["pidns"] and report["iso"]["userns"] and report["iso"]["mntns"]
    assert "no capabilities" in report["iso"]["privileges"]


def test_concurrent_runs(sandbox):
    async def main():
        return await asyncio.gather(*[sandbox.run_code(f"print({i} ** 2)", **LIMITS) for i in range(6)])

    results = asyncio.run(main())
    assert [r.stdout.strip() for r in results] == [str(i**2) for i in range(6)]
    assert_contained(results[0])


def test_reusable_across_event_loops(sandbox):
    """Trainers may call asyncio.run once per step: the same sandbox must work in each new loop."""
    for _ in range(2):

        async def main():
            return await asyncio.gather(*[sandbox.run_code("print('ok')", **LIMITS) for _ in range(3)])

        assert [r.stdout for r in asyncio.run(main())] == ["ok\n"] * 3


def test_require_isolation_refuses_to_run_unisolated():
    r = run(LocalSandbox(isolate_filesystem=False, require_isolation=True), "print('ran')")
    assert r.error and "filesystem" in r.error and "ran" not in r.stdout and r.exit_code is None
    if ROOT and _system_python_usable():  # no mount namespace, so no disk quota
        unquoted = run(LocalSandbox(python=SYSTEM_PYTHON, use_namespaces=False, require_isolation=True), "print('ran')")
        assert unquoted.error and "disk quota" in unquoted.error and "ran" not in unquoted.stdout
    strict = run(LocalSandbox(require_isolation=True), "print('ran')")
    if strict.error is None:
        assert strict.stdout == "ran\n" and strict.isolation["landlock"] and strict.isolation["process_limit"]


def test_sandbox_failure_is_reported_not_raised(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "missing"))
    r = run(LocalSandbox(), "print(1)")
    assert r.error and "could not run" in r.error and r.exit_code is None


def test_bad_limits_rejected(sandbox):
    with pytest.raises(ValueError):
        run(sandbox, "print(1)", timeout_s=0)
    with pytest.raises(ValueError):
        LocalSandbox(max_processes=0)


# ---------------------------------------------------------------------------------------------------------------------
# Host files: nothing outside the working directory can be changed, not even a file the sandbox uid owns
# ---------------------------------------------------------------------------------------------------------------------

OWNED_UID = 2_999_999  # a fixed sandbox uid, so the test can hand it a host file


def _host_state(path: Path) -> tuple:
    st = os.lstat(path)
    try:
        xattrs = sorted(os.listxattr(path, follow_symlinks=False))
    except OSError:
        xattrs = None
    # (not atime: reading the file here for the comparison updates it)
    return (
        st.st_mode,
        st.st_uid,
        st.st_gid,
        st.st_mtime_ns,
        st.st_ctime_ns,
        st.st_nlink,
        xattrs,
        sorted(os.listdir(path)) if stat.S_ISDIR(st.st_mode) else path.read_bytes(),
    )


TAMPER = """
import os, sys
target, folder = sys.argv[1], sys.argv[2]
attempts = {
    "chmod": lambda: os.chmod(target, 0o777),
    "chmod_dir": lambda: os.chmod(folder, 0o777),
    "chown": lambda: os.chown(target, os.getuid(), os.getgid()),
    "chgrp": lambda: os.chown(target, -1, os.getgid()),
    "utime": lambda: os.utime(target, (0, 0)),
    "utime_now": lambda: os.utime(target),
    "setxattr": lambda: os.setxattr(target, "user.tampered", b"1"),
    "removexattr": lambda: os.removexattr(target, "user.keep"),
    "truncate": lambda: os.truncate(target, 0),
    "write": lambda: open(target, "a").write("x"),
    "link_out": lambda: os.link(target, os.path.join(folder, "hardlink")),
    "link_in": lambda: os.link(target, "hardlink_in_workdir"),
    "symlink": lambda: os.symlink("/etc", os.path.join(folder, "symlink")),
    "rename": lambda: os.rename(target, os.path.join(folder, "renamed")),
    "rename_in": lambda: os.rename(target, "moved_into_workdir"),
    "create": lambda: open(os.path.join(folder, "created"), "x"),
    "mkdir": lambda: os.mkdir(os.path.join(folder, "newdir")),
    "mkfifo": lambda: os.mkfifo(os.path.join(folder, "fifo")),
    "unlink": lambda: os.unlink(target),
    "rmdir": lambda: os.rmdir(os.path.join(folder, "sub")),
    "create_tmp": lambda: open("/tmp/hf_gptoss_rl_escaped", "x"),
}
allowed = []
for name, attempt in attempts.items():
    try:
        attempt()
        allowed.append(name)
    except OSError:
        pass
print("ALLOWED", allowed)
"""


def _as_uid(uid: int, action) -> bool:
    """Whether ``action()`` succeeds in a child process running as ``uid`` (outside any sandbox)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            action()
            os._exit(0)
        except BaseException:
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _tamper_targets(tmp_path: Path, owner: int | None) -> tuple[Path, Path]:
    folder = tmp_path / "host"
    folder.mkdir()
    (folder / "sub").mkdir()
    target = folder / "data.txt"
    target.write_text("precious")
    os.setxattr(target, "user.keep", b"1")
    os.chmod(target, 0o644)
    os.chmod(folder, 0o755)
    if owner is not None:  # the program's own uid owns them: only the read-only mount can refuse now
        for p in (folder, folder / "sub", target):
            os.chown(p, owner, owner)
    return folder, target


def _tamper(sb: LocalSandbox, folder: Path, target: Path) -> SandboxResult:
    code = f"import sys\nsys.argv = ['x', {str(target)!r}, {str(folder)!r}]\n" + TAMPER
    before = {p: _host_state(p) for p in (folder, target, folder / "sub")}
    r = run(sb, code)
    assert r.exit_code == 0, r
    assert r.stdout.strip() == "ALLOWED []", r.stdout
    assert {p: _host_state(p) for p in (folder, target, folder / "sub")} == before
    assert not os.path.exists("/tmp/hf_gptoss_rl_escaped")
    return r


@pytest.mark.skipif(not ROOT, reason="handing a host file to the sandbox uid needs root (CI runs as root)")
@pytest.mark.parametrize("landlock", [True, False], ids=["landlock", "mounts-only"])
def test_host_metadata_cannot_be_changed_even_when_owned(open_tmp, landlock):
    """chmod, chown, utime, xattrs, links, renames, creation and deletion outside the working directory all fail,
    even on files the program's own uid owns and with Landlock off: the mount namespace is read-only."""
    folder, target = _tamper_targets(open_tmp, OWNED_UID)
    # control: outside the sandbox, that uid can change them
    assert _as_uid(OWNED_UID, lambda: (os.chmod(target, 0o600), os.utime(target, (0, 0))))
    os.chmod(target, 0o644)
    os.utime(target)
    sb = LocalSandbox(sandbox_uid=OWNED_UID, isolate_filesystem=landlock, max_processes=MAX_PROCS)
    r = _tamper(sb, folder, target)
    assert r.isolation["mntns"] and r.isolation["privileges"] == f"uid {OWNED_UID}"


@pytest.mark.skipif(not ROOT, reason="root-owned host files are the uid-0 case (CI runs as root)")
def test_root_owned_host_files_cannot_be_changed(sandbox, open_tmp):
    """The reported defect: a root-owned file's mode, times and xattrs changed by the program. Not any more."""
    folder, target = _tamper_targets(open_tmp, None)
    _tamper(sandbox, folder, target)


def test_host_files_without_namespaces(no_namespace_sandbox, open_tmp):
    """Root without namespaces: the fresh uid owns nothing on the host, so the uid alone refuses every change."""
    folder, target = _tamper_targets(open_tmp, None)
    _tamper(no_namespace_sandbox, folder, target)


def test_only_a_few_devices_and_its_own_processes_are_visible():
    """Even with Landlock off: /dev holds only null, zero, random and urandom (no GPU, /dev/shm, fuse or ptys; a
    read-only mount alone would not stop writes to a device), and /proc shows the sandbox's pid namespace only."""
    sb = LocalSandbox(isolate_filesystem=False, max_processes=MAX_PROCS)
    r = run(
        sb,
        "import os\nprint(sorted(os.listdir('/dev')))\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "open('/dev/null', 'w').write('x')\nprint(len(open('/dev/urandom', 'rb').read(8)))",
    )
    assert r.exit_code == 0 and r.isolation["proc"] == "own pid namespace", r
    devices, pids, random_bytes = r.stdout.splitlines()
    assert devices == str(["null", "random", "urandom", "zero"]) and random_bytes == "8"
    assert ast.literal_eval(pids) == [1, 2]  # init and the program: no host process


# ---------------------------------------------------------------------------------------------------------------------
# Cleanup: never raises into the result, never leaves a working directory behind
# ---------------------------------------------------------------------------------------------------------------------

HOSTILE_TREE = (
    PRINT_CWD
    + """
import fcntl, socket, struct
base = os.getcwd()
os.mkdir("deep"); os.chdir("deep")
for _ in range(1200):          # deeper than shutil.rmtree's recursion (3.11) and, 6000 characters, than PATH_MAX
    os.mkdir("dddd"); os.chdir("dddd")
open("bottom.txt", "w").write("x")
os.chdir(base)
os.makedirs("locked/inner"); open("locked/inner/f", "w").write("x")
os.chmod("locked/inner", 0); os.chmod("locked", 0)
os.mkfifo("fifo")
try:
    s = socket.socket(socket.AF_UNIX); s.bind("sock")
except OSError as e:
    print("no unix socket:", e.errno)
try:                           # +i needs CAP_LINUX_IMMUTABLE, which the program does not have
    fd = os.open("bottom2.txt", os.O_CREAT | os.O_RDONLY)
    fcntl.ioctl(fd, 0x40086602, struct.pack("=iI", 0x10, 0)); print("IMMUTABLE SET")
except OSError as e:
    print("immutable refused:", e.errno)
os.symlink("/etc/passwd", "link")
print("built", flush=True)
"""
)


def test_hostile_trees_are_cleaned_up(sandbox):
    r = run(sandbox, HOSTILE_TREE, timeout_s=20)
    assert r.exit_code == 0 and "built" in r.stdout and r.error is None, r
    assert "IMMUTABLE SET" not in r.stdout and "cleanup_error" not in r.isolation
    assert_contained(r, workdir_of(r))
    assert os.path.exists("/etc/passwd")


def test_hostile_trees_are_cleaned_up_on_disk(no_namespace_sandbox, fast_tmp, monkeypatch):
    """Without a mount namespace the tree is in an ordinary folder: the iterative remover deletes it."""
    monkeypatch.setattr(tempfile, "tempdir", str(fast_tmp))
    os.chmod(fast_tmp, 0o755)
    r = run(no_namespace_sandbox, HOSTILE_TREE, timeout_s=20)
    assert r.exit_code == 0 and "built" in r.stdout and r.error is None, r
    assert "cleanup_error" not in r.isolation, r.isolation
    assert_contained(r, workdir_of(r))


@pytest.fixture
def fast_tmp(tmp_path):
    """A folder on a tmpfs when there is one: on CI's ext4 (mounted with discard) each rmdir costs ~4 ms, which
    would make a 3000-level tree a 13 s test of the disk rather than of the remover."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        folder = tempfile.mkdtemp(dir="/dev/shm", prefix="hf_gptoss_rl_test_")
        yield Path(folder)
        remove_tree(folder)
    else:
        yield tmp_path


def test_remove_tree_handles_what_rmtree_does_not(fast_tmp):
    tmp_path = fast_tmp
    root = tmp_path / "victim"
    keep = tmp_path / "keep.txt"
    keep.write_text("must survive")
    fd = os.open(tmp_path, os.O_RDONLY)
    os.mkdir(root)
    cur = os.open(root, os.O_RDONLY)
    for _ in range(3000):  # deeper than PATH_MAX and than shutil.rmtree's recursion in Python 3.11
        os.mkdir("d", dir_fd=cur)
        nxt = os.open("d", os.O_RDONLY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.close(cur)
    os.close(fd)
    (root / "locked" / "inner").mkdir(parents=True)
    (root / "locked" / "inner" / "f").write_text("x")
    os.chmod(root / "locked" / "inner", 0)
    os.chmod(root / "locked", 0)
    os.mkfifo(root / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(root / "sock"))
    os.symlink(keep, root / "link_to_keep")
    os.symlink(tmp_path, root / "link_to_parent")
    immutable = root / "immutable.txt"
    immutable.write_text("x")
    flagged = False
    if ROOT:
        try:
            with open(immutable) as f:
                fcntl.ioctl(f.fileno(), 0x40086602, struct.pack("=iI", 0x10, 0))  # FS_IOC_SETFLAGS immutable
            appendonly = root / "appendonly"
            appendonly.mkdir()
            (appendonly / "f").write_text("x")
            dfd = os.open(appendonly, os.O_RDONLY)
            fcntl.ioctl(dfd, 0x40086602, struct.pack("=iI", 0x20, 0))  # append-only folder
            os.close(dfd)
            flagged = True
        except OSError as e:
            print(f"immutable flags unsupported on {tmp_path}: {e}")
    try:
        t = time.monotonic()
        assert remove_tree(str(root)) is None
        assert time.monotonic() - t < 10
    finally:
        sock.close()
    assert not root.exists() and keep.read_text() == "must survive" and tmp_path.exists()
    if ROOT:
        assert flagged, "this filesystem should support immutable flags (ext4, tmpfs)"
    assert remove_tree(str(root)) is None  # already gone: nothing to do, no error
    assert remove_tree(str(tmp_path / "no" / "such")) is None


def test_leftovers_of_dead_processes_are_swept(fast_tmp):
    """A trainer killed mid-run leaves its working directories behind: the next process's first LocalSandbox removes
    those of dead pids (old enough), never those of live ones."""
    from trl_ext.tools.sandbox import sweep_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = fast_tmp / f"hf_gptoss_rl_sandbox_{dead.pid}_abc"
    (stale / "deep" / "er").mkdir(parents=True)
    (stale / "main.py").write_text("print(1)")
    live = fast_tmp / f"hf_gptoss_rl_sandbox_{os.getpid()}_abc"
    live.mkdir()
    young = fast_tmp / f"hf_gptoss_rl_sandbox_{dead.pid}_young"
    young.mkdir()
    old = time.time() - 7200
    os.utime(stale, (old, old))
    os.utime(live, (old, old))
    assert sweep_stale(str(fast_tmp)) == [str(stale)]
    assert not stale.exists() and live.exists() and young.exists()


def test_cleanup_failure_is_reported_not_raised(sandbox, monkeypatch):
    """Whatever goes wrong while removing the working directory stays out of the tool result."""
    import trl_ext.tools.sandbox as mod

    real_rmdir = os.rmdir
    leftover = []

    def failing_rmdir(path, *args, **kwargs):
        if isinstance(path, str) and os.path.basename(path).startswith("hf_gptoss_rl_sandbox_"):
            leftover.append(path)
            raise RecursionError("maximum recursion depth exceeded")
        return real_rmdir(path, *args, **kwargs)

    monkeypatch.setattr(mod.os, "rmdir", failing_rmdir)
    r = run(sandbox, "print('fine')")
    monkeypatch.undo()
    assert r.stdout == "fine\n" and r.exit_code == 0 and r.error is None
    assert "RecursionError" in r.isolation["cleanup_error"] and "RecursionError" not in r.stdout + r.stderr
    for path in leftover:
        remove_tree(path)


# ---------------------------------------------------------------------------------------------------------------------
# Disk quota, kernel surface, results the model can act on
# ---------------------------------------------------------------------------------------------------------------------


def test_disk_quota_is_enforced_and_reported():
    sb = LocalSandbox(max_processes=MAX_PROCS, max_disk_mb=8, max_file_mb=4, max_disk_files=64)
    r = run(
        sb,
        PRINT_CWD + "n = 0\ntry:\n    for i in range(100):\n"
        "        open(f'f{i}', 'wb').write(b'x' * 3 * 2**20); n += 1\n"
        "except OSError as e:\n    print('stopped', n, e.errno)",
    )
    assert r.disk_full and r.isolation["disk_quota"] == 8 * 2**20
    assert f"stopped 2 {errno.ENOSPC}" in r.stdout, r.stdout  # 3 files of 3 MiB do not fit in 8 MiB
    text = CodeInterpreterTool(sb).format_result(r)
    assert "[disk quota of 8 MiB for the working directory exceeded (size or number of files)]" in text
    files = run(
        sb,
        "import os\ntry:\n    for i in range(1000):\n        os.mkdir(f'd{i}')\n"
        "except OSError as e:\n    print('stopped', e.errno)",
    )
    assert files.disk_full and f"stopped {errno.ENOSPC}" in files.stdout
    fine = run(sb, "open('small', 'w').write('x')")
    assert not fine.disk_full and fine.exit_code == 0
    assert_contained(r, workdir_of(r))


def test_new_namespaces_and_kernel_interfaces_are_refused(sandbox):
    """seccomp: no user/mount/net namespaces (nor unshare at all), no bpf, no io_uring, no keyrings; threads and
    subprocesses still work (clone3 answers ENOSYS, glibc falls back to clone)."""
    code = (
        "import ctypes, os, subprocess, sys, threading\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "out = {}\n"
        "for name, nr, args in [('unshare_user', 272, (0x10000000,)), ('unshare_files', 272, (0x400,)),"
        " ('clone_newuser', 56, (0x10000000 | 17, 0, 0, 0, 0)), ('bpf', 321, (0, 0, 0)), ('io_uring', 425, (8, 0)),"
        " ('keyctl', 250, (0, 0)), ('userfaultfd', 323, (0,)), ('perf_event_open', 298, (0, 0, -1, -1, 0))]:\n"
        "    ret = libc.syscall(nr, *args)\n"
        "    out[name] = 'ALLOWED' if ret >= 0 else ctypes.get_errno()\n"
        "t = threading.Thread(target=lambda: None); t.start(); t.join()\n"
        "out['subprocess'] = subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True,\n"
        "                                   text=True).stdout\n"
        "print(out)"
    )
    if os.uname().machine != "x86_64":
        pytest.skip("the syscall numbers in this test are x86_64's")
    r = run(sandbox, code)
    assert r.exit_code == 0, r
    out = ast.literal_eval(r.stdout)
    assert out.pop("subprocess") == "7\n"
    assert all(v == errno.EPERM for v in out.values()), out


def test_exit_status_is_reported(sandbox):
    r = run(sandbox, "import sys\nsys.exit(3)")
    assert r.exit_code == 3 and r.killed_by is None
    tool = CodeInterpreterTool(sandbox)
    assert tool.format_result(r) == "[exit status 3]"
    assert tool.format_result(run(sandbox, "x = 1")) == "[no output]"
    crash = tool.format_result(run(sandbox, "1 / 0"))
    assert "ZeroDivisionError" in crash and crash.endswith("[exit status 1]")


def test_memory_kill_is_told_apart(sandbox):
    """The memory cgroup's OOM kills are counted: the model reads "memory limit", not "timed out" nor a bare signal
    (self-kill and timeout: test_contract_exit_status_timeout_and_self_kill)."""
    tool = CodeInterpreterTool(sandbox, memory_mb=256, timeout_s=10)
    # three processes fill the run's memory cgroup (256 MiB + 16 MiB quota + 64 MiB): the OOM killer acts in it
    hog = run(
        sandbox,
        (
            "import os, time\n"
            "for _ in range(3):\n"
            "    if os.fork() == 0:\n"
            "        b = bytearray(200 * 2**20)\n"
            "        for j in range(0, len(b), 4096):\n            b[j] = 1\n"
            "        time.sleep(1); os._exit(0)\n"
            "b = bytearray(200 * 2**20)\n"
            "for j in range(0, len(b), 4096):\n    b[j] = 1\n"
            "for _ in range(3):\n    os.wait()\n"
            "print('survived')"
        ),
        timeout_s=10,
    )
    if hog.isolation.get("memory_limit") != "cgroup+rlimit-as":
        pytest.skip("no memory cgroup here: memory is limited per process only (RLIMIT_AS -> MemoryError)")
    assert hog.oom_kills >= 1 and not hog.timed_out, hog
    text = tool.format_result(hog)
    assert "memory limit of 256 MiB exceeded" in text and "timed out" not in text and "by the program" not in text
    if hog.signal == signal.SIGKILL:
        assert hog.killed_by == "memory_limit"


def test_concurrency_default_follows_the_machine(monkeypatch):
    assert LocalSandbox().max_concurrency == usable_cpus() <= (os.cpu_count() or 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert usable_cpus() == 1 and LocalSandbox().max_concurrency == 1
    assert LocalSandbox(max_concurrency=64).max_concurrency == 64
    with pytest.raises(ValueError, match="max_concurrency"):
        LocalSandbox(max_concurrency=0)
    with pytest.raises(ValueError, match="queue_timeout_s"):
        LocalSandbox(queue_timeout_s=0)


def test_this_machine_supports_the_security_layers():
    """CI runs on this machine kind as root: the layers the security tests rely on must be there, or the skip
    reasons above would hide them. Fails loudly instead of skipping."""
    support = _probe(os.geteuid())
    if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip(f"not a Linux x86_64/aarch64 host ({sys.platform}, {os.uname().machine})")
    assert support["mount"], support
    assert support["landlock_abi"] >= 4, support  # TCP rules need ABI 4
    r = run(LocalSandbox(require_isolation=True), "print(1)")
    assert r.error is None and r.isolation["seccomp"] and r.isolation["netns"] and r.isolation["pidns"], r
    assert r.isolation["mntns"] and r.isolation["disk_quota"] and r.isolation["proc"] == "own pid namespace", r
    if ROOT:  # a root caller can create cgroups here: the memory-kill and process-limit tests depend on them
        assert r.isolation["memory_limit"] == "cgroup+rlimit-as" and r.isolation["process_limit"] == "pids-cgroup", r


# ---------------------------------------------------------------------------------------------------------------------
# SandboxFusion client against a local stdlib server (loopback only)
# ---------------------------------------------------------------------------------------------------------------------


class _FusionHandler(BaseHTTPRequestHandler):
    """A stand-in for SandboxFusion's /run_code (loopback only): programs run in a LocalSandbox, so the hostile
    programs of this file stay contained here too; results use SandboxFusion's schema (a signal as a negative
    ``return_code``, ``TimeLimitExceeded``); faults are scripted."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server.requests.append((self.path, body))
        fault = server.faults.pop(0) if server.faults else None
        if self.path != "/run_code":
            return self._send(404, {"detail": "Not Found"})
        if fault == "500":
            return self._send(503, {"detail": "overloaded"})
        if fault == "sandbox_error":
            return self._send(200, {"status": "SandboxError", "message": "pod crashed", "run_result": None})
        if fault == "400":
            return self._send(400, {"detail": "bad request"})
        if fault == "garbage":
            data = b"<html>oops"
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        sb = LocalSandbox(max_processes=MAX_PROCS, max_disk_mb=16)
        r = asyncio.run(
            sb.run_code(
                body["code"], timeout_s=body["run_timeout"], memory_mb=body["memory_limit_MB"], max_output_bytes=1 << 20
            )
        )
        if r.error:
            return self._send(200, {"status": "SandboxError", "message": r.error, "run_result": None})
        run_result = {
            "status": "TimeLimitExceeded" if r.timed_out else "Finished",
            "execution_time": r.duration_s,
            "return_code": None if r.timed_out else (-r.signal if r.signal else r.exit_code),
            "stdout": r.stdout,
            "stderr": r.stderr,
        }
        ok = run_result["status"] == "Finished" and run_result["return_code"] == 0
        self._send(
            200,
            {
                "status": "Success" if ok else "Failed",
                "message": "",
                "compile_result": None,
                "run_result": run_result,
                "executor_pod_name": None,
                "files": {},
            },
        )

    def _send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fusion_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FusionHandler)
    server.requests, server.faults = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _fusion(server, **kwargs):
    return SandboxFusionBackend(f"http://127.0.0.1:{server.server_address[1]}", backoff_s=0.01, **kwargs)


def _run_fusion(backend, code, **limits):
    async def main():
        try:
            return await backend.run_code(code, **{**LIMITS, **limits})
        finally:
            await backend.aclose()

    return asyncio.run(main())


def test_fusion_request_and_result(fusion_server):
    r = _run_fusion(_fusion(fusion_server), "import sys\nprint(6 * 7)\nprint('w', file=sys.stderr)\nsys.exit(2)")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.error) == ("42\n", "w\n", 2, False, None)
    path, body = fusion_server.requests[0]
    assert path == "/run_code"
    assert body == {
        "code": body["code"],
        "language": "python",
        "run_timeout": 5.0,
        "compile_timeout": 5.0,
        "memory_limit_MB": 256,
        "stdin": "",
        "files": {},
        "fetch_files": [],
    }
    with pytest.raises(ValueError, match="http"):
        SandboxFusionBackend("127.0.0.1:8080")
    with pytest.raises(ValueError, match="max_concurrency"):
        SandboxFusionBackend("http://127.0.0.1:1", max_concurrency=0)


def test_fusion_reusable_across_event_loops(fusion_server):
    backend = _fusion(fusion_server)
    for i in range(2):
        assert asyncio.run(backend.run_code(f"print({i})", **LIMITS)).stdout == f"{i}\n"


def test_fusion_retries_5xx_and_sandbox_errors(fusion_server):
    fusion_server.faults[:] = ["500", "sandbox_error", "garbage"]
    r = _run_fusion(_fusion(fusion_server, max_retries=3), "print('ok')")
    assert r.stdout == "ok\n" and r.error is None and len(fusion_server.requests) == 4


def test_fusion_gives_up_and_reports(fusion_server):
    fusion_server.faults[:] = ["500"] * 10
    r = _run_fusion(_fusion(fusion_server, max_retries=2), "print('ok')")
    assert r.error and "503" in r.error and "3 attempts" in r.error and len(fusion_server.requests) == 3
    fusion_server.faults[:] = ["400"]
    r = _run_fusion(_fusion(fusion_server, max_retries=2), "print('ok')")
    assert r.error.startswith("HTTP 400") and len(fusion_server.requests) == 4  # 4xx is not retried


def test_fusion_connection_refused_then_recovered():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens on `port` now
    backend = SandboxFusionBackend(f"http://127.0.0.1:{port}/", max_retries=1, backoff_s=0.01)
    r = _run_fusion(backend, "print(1)")
    assert r.error and "ConnectError" in r.error

    holder = {}

    def start_later():  # the port only starts listening after the first attempts were refused
        time.sleep(0.3)
        server = ThreadingHTTPServer(("127.0.0.1", port), _FusionHandler)
        server.requests, server.faults = [], []
        holder["server"] = server
        server.serve_forever()

    starter = threading.Thread(target=start_later, daemon=True)
    starter.start()
    try:
        backend = SandboxFusionBackend(f"http://127.0.0.1:{port}", max_retries=6, backoff_s=0.1)
        r = _run_fusion(backend, "print(1)")
        assert r.stdout == "1\n" and r.error is None
        assert len(holder["server"].requests) == 1
    finally:
        if "server" in holder:
            holder["server"].shutdown()
            holder["server"].server_close()
        starter.join(timeout=5)


# ---------------------------------------------------------------------------------------------------------------------
# One contract, both backends: the same programs through LocalSandbox and through the SandboxFusion client
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(params=["local", "fusion"])
def backend_factory(request):
    """``make(**kwargs)`` -> a backend; for "fusion" the client of a stand-in server on 127.0.0.1."""
    if request.param == "local":
        yield lambda **kw: LocalSandbox(max_processes=MAX_PROCS, max_disk_mb=16, **kw)
        return
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FusionHandler)
    server.requests, server.faults = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield lambda **kw: SandboxFusionBackend(f"http://127.0.0.1:{server.server_address[1]}", backoff_s=0.01, **kw)
    server.shutdown()
    server.server_close()


def _once(backend, code, **limits):
    return _run_fusion(backend, code, **limits)  # runs, then aclose()s the backend (a no-op for LocalSandbox)


def test_contract_exit_status_timeout_and_self_kill(backend_factory):
    backend = backend_factory()
    tool = CodeInterpreterTool(backend, timeout_s=1, memory_mb=256)
    r = _once(backend, "import sys\nprint('x')\nsys.exit(3)")
    assert (r.exit_code, r.signal, r.killed_by, r.error) == (3, None, None, None)
    assert tool.format_result(r) == "x\n[exit status 3]"
    r = _once(backend, "import time\ntime.sleep(30)", timeout_s=1)
    assert r.timed_out and r.killed_by == "timeout" and r.exit_code is None
    assert tool.format_result(r, timeout_s=1) == "[execution timed out after 1 s]"
    r = _once(backend, "import os, signal\nprint('bye', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)")
    assert r.signal == signal.SIGKILL and r.exit_code is None and not r.timed_out
    local = isinstance(backend, LocalSandbox)
    assert r.killed_by == ("program" if local else "unknown")  # SandboxFusion does not say who sent it
    text = tool.format_result(r)
    assert text.startswith("bye\n[process terminated by SIGKILL") and "timed out" not in text
    assert ("raised by the program itself" in text) == local


def test_contract_output_cap(backend_factory):
    r = _once(backend_factory(), "print('x' * 50000)", max_output_bytes=1000)
    assert r.truncated and r.stdout == "x" * 1000 and r.error is None


def test_contract_queue_is_not_run_time(backend_factory):
    backend = backend_factory(max_concurrency=1)

    async def main():
        try:
            return await asyncio.gather(
                *[
                    backend.run_code(
                        "import time\ntime.sleep(0.5)\nprint('ran')", timeout_s=1.5, memory_mb=256, max_output_bytes=100
                    )
                    for _ in range(4)
                ]
            )
        finally:
            await backend.aclose()

    results = asyncio.run(main())
    assert [r.stdout for r in results] == ["ran\n"] * 4 and not any(r.timed_out for r in results), results
    assert max(r.queued_s for r in results) > 1.5  # the last one waited longer than its own timeout


def test_contract_queue_bound(backend_factory):
    backend = backend_factory(max_concurrency=1, queue_timeout_s=0.3)

    async def main():
        try:
            return await asyncio.gather(
                backend.run_code("import time\ntime.sleep(1.2)", timeout_s=5, memory_mb=256, max_output_bytes=100),
                backend.run_code("print('ran')", timeout_s=5, memory_mb=256, max_output_bytes=100),
            )
        finally:
            await backend.aclose()

    first, second = asyncio.run(main())
    assert first.error is None and first.exit_code == 0
    assert second.error and "queue_timeout_s=0.3" in second.error and second.stdout == ""


@pytest.mark.skipif(not ROOT, reason="root-owned host files are the uid-0 case (CI runs as root)")
def test_contract_host_files(backend_factory, open_tmp):
    folder, target = _tamper_targets(open_tmp, None)
    code = f"import sys\nsys.argv = ['x', {str(target)!r}, {str(folder)!r}]\n" + TAMPER
    before = {p: _host_state(p) for p in (folder, target)}
    r = _once(backend_factory(), code)
    assert r.exit_code == 0 and r.stdout.strip() == "ALLOWED []", r
    assert {p: _host_state(p) for p in (folder, target)} == before
