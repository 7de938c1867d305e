"""LocalSandbox against hostile code, and the SandboxFusion client against a local /run_code server.

Every hostile program runs with small limits; each test checks that the program was contained (limit hit, nothing
left running, working directory gone) and that the calling process is unaffected (no children, memory flat).
"""

import ast
import asyncio
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trl_ext.tools.sandbox import LocalSandbox, SandboxResult
from trl_ext.tools.sandbox_fusion import SandboxFusionBackend

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalSandbox is Linux-only")

LIMITS = dict(timeout_s=5.0, memory_mb=256, max_output_bytes=64 * 1024)
MAX_PROCS = 6


@pytest.fixture(scope="module")
def sandbox():
    return LocalSandbox(max_processes=MAX_PROCS, max_concurrency=2)


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
    r = run(sandbox, "import numpy as np, sympy as sp\nprint(int(np.arange(10).sum()), sp.factorint(360))",
            memory_mb=1024, timeout_s=20)
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
    code = ("import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
            "time.sleep(60)")

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(sandbox.run_code(code, **{**LIMITS, "timeout_s": 30}), timeout=1.5)

    asyncio.run(main())
    deadline = time.monotonic() + 3
    while _processes_mentioning(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_mentioning(marker) == []
    assert_contained(None)


def test_without_namespaces_subreaper_and_landlock_still_contain():
    """Where namespaces are not allowed: init, a child subreaper, kills escapees; Landlock closes TCP."""
    sb = LocalSandbox(max_processes=MAX_PROCS, use_namespaces=False, use_cgroups=False)
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
    hung = run(sb, PRINT_CWD + "if os.fork() == 0:\n    os.setsid()\n    while True: pass\nwhile True: pass", timeout_s=1)
    assert hung.timed_out
    assert_contained(hung, workdir_of(hung))


def test_fork_bomb_is_contained(sandbox):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # counted forks: at most max_processes tasks at once (the program itself included)
    counted = run(sandbox, PRINT_CWD + (
        "import time\nn = 0\n"
        "for _ in range(100):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n"
        "        n += 1\n"
        "    except OSError:\n"
        "        break\n"
        "print('forked', n, flush=True)\n"
    ))
    if counted.isolation["process_limit"] is None:
        pytest.skip("root without cgroups or a uid switch: no process limit here, so no real fork bomb either")
    forked = int(counted.stdout.split("forked")[1])
    assert 0 <= forked <= MAX_PROCS - 1, counted
    assert_contained(counted, workdir_of(counted))
    # a real fork bomb
    bomb = run(sandbox, PRINT_CWD + "while True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=2)
    assert bomb.timed_out
    assert_contained(bomb, workdir_of(bomb))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 1024  # KiB


def test_threads_count_against_the_process_limit(sandbox):
    r = run(sandbox, "import threading, time\nn = 0\ntry:\n    for _ in range(50):\n"
                     "        threading.Thread(target=time.sleep, args=(2,), daemon=True).start(); n += 1\n"
                     "except RuntimeError:\n    pass\nprint(n)")
    if r.isolation["process_limit"] is not None:
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
    r = run(sandbox, PRINT_CWD + "chunk = 'x' * 2**20\nfor _ in range(4096):\n    sys.stdout.write(chunk)",
            max_output_bytes=100_000)
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
            "    s = socket.socket()\n    s.settimeout(1)\n"
            "    try:\n        s.connect(addr)\n        results.append('CONNECTED')\n"
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


def test_unix_sockets_fail(sandbox, tmp_path):
    """Landlock does not cover connect() on pathname unix sockets (think /var/run/docker.sock): seccomp does."""
    path = str(tmp_path / "service.sock")
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


def test_reading_and_writing_outside_its_directory_fail(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    secret.chmod(0o644)
    code = PRINT_CWD + (
        "out = []\n"
        f"for path in [{str(secret)!r}, '/etc/passwd', '/etc/hostname', {os.path.abspath(__file__)!r}]:\n"
        "    try:\n        out.append(open(path).read()[:10])\n    except OSError as e:\n        out.append(type(e).__name__)\n"
        f"for path in [{str(tmp_path / 'written.txt')!r}, '/tmp/escaped.txt']:\n"
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
    assert "'ok'" in r.stdout and r.stdout.count("PermissionError") == 7, r.stdout
    assert not (tmp_path / "written.txt").exists() and not os.path.exists("/tmp/escaped.txt")
    assert_contained(r, workdir_of(r))


@pytest.mark.skipif(os.geteuid() != 0, reason="privilege dropping only applies to root")
def test_root_runs_without_capabilities(sandbox):
    r = run(sandbox, "import os\nout = []\nfor f in (lambda: os.setuid(1), lambda: os.nice(-5), "
                     "lambda: os.chroot('.'), lambda: os.mknod('dev', 0o600 | 0o020000, os.makedev(1, 3)), "
                     "lambda: open('/proc/sysrq-trigger', 'w')):\n"
                     "    try:\n        f(); out.append('ALLOWED')\n    except OSError as e:\n"
                     "        out.append(type(e).__name__)\nprint(out)")
    assert r.exit_code == 0, r.stderr
    assert "ALLOWED" not in r.stdout, r.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK), reason="needs root and a system python")
def test_unprivileged_uid_mode_with_rlimit_nproc():
    """Root with an interpreter any uid can run: switch to a fresh uid, where RLIMIT_NPROC alone stops a fork bomb."""
    from trl_ext.tools.sandbox import _world_accessible

    if not _world_accessible("/usr/bin/python3"):
        pytest.skip("/usr/bin/python3 is not reachable by an unprivileged uid")
    sb = LocalSandbox(python="/usr/bin/python3", max_processes=MAX_PROCS, use_cgroups=False)
    r = run(sb, PRINT_CWD + "print('UID', os.getuid(), flush=True)\nwhile True:\n    try:\n        os.fork()\n"
                            "    except OSError:\n        pass", timeout_s=2)
    assert r.timed_out and r.isolation["privileges"].startswith("uid ") and "UID 0" not in r.stdout
    assert_contained(r, workdir_of(r))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to become an unprivileged user")
@pytest.mark.parametrize("namespaces", [True, False])
def test_unprivileged_caller(tmp_path, namespaces):
    """The sandbox started by an unprivileged user (as in CI): no cgroups; RLIMIT_NPROC counted in a user namespace
    or (without namespaces) relative to the user's tasks; network closed by the namespace or Landlock."""
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
        capture_output=True, text=True, timeout=60, cwd="/tmp", env={"PATH": "/usr/bin:/bin", "TMPDIR": "/tmp"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["err"] is None, report
    forked, net = report["stdout"].split()
    # without a user namespace the count is relative to the user's other tasks (our watcher thread may exit: +1)
    assert int(forked) <= MAX_PROCS - (1 if namespaces else 0), report
    assert net != "CONNECTED", report
    assert not report["iso"].get("cgroups") and report["iso"]["process_limit"] == "rlimit-nproc"
    assert report["iso"]["pidns"] == namespaces or not namespaces


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
# SandboxFusion client against a local stdlib server (loopback only)
# ---------------------------------------------------------------------------------------------------------------------


class _FusionHandler(BaseHTTPRequestHandler):
    """SandboxFusion's /run_code, running trusted test snippets with a plain subprocess; faults are scripted."""

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
        try:
            proc = subprocess.run([sys.executable, "-c", body["code"]], capture_output=True, text=True,
                                  timeout=body["run_timeout"])
            run_result = {"status": "Finished", "execution_time": 0.01, "return_code": proc.returncode,
                          "stdout": proc.stdout, "stderr": proc.stderr}
        except subprocess.TimeoutExpired as e:
            run_result = {"status": "TimeLimitExceeded", "execution_time": body["run_timeout"], "return_code": None,
                          "stdout": (e.stdout or b"").decode(), "stderr": (e.stderr or b"").decode()}
        ok = run_result["status"] == "Finished" and run_result["return_code"] == 0
        self._send(200, {"status": "Success" if ok else "Failed", "message": "", "compile_result": None,
                         "run_result": run_result, "executor_pod_name": None, "files": {}})

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
    assert body == {"code": body["code"], "language": "python", "run_timeout": 5.0, "compile_timeout": 5.0,
                    "memory_limit_MB": 256, "stdin": "", "files": {}, "fetch_files": []}


def test_fusion_reusable_across_event_loops(fusion_server):
    backend = _fusion(fusion_server)
    for i in range(2):
        assert asyncio.run(backend.run_code(f"print({i})", **LIMITS)).stdout == f"{i}\n"


def test_fusion_timeout_and_truncation(fusion_server):
    r = _run_fusion(_fusion(fusion_server), "import time\ntime.sleep(5)", timeout_s=0.5)
    assert r.timed_out and r.error is None
    r = _run_fusion(_fusion(fusion_server), "print('x' * 5000)", max_output_bytes=1000)
    assert r.truncated and len(r.stdout) == 1000


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
