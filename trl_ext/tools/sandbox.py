"""Sandboxes that run untrusted, model-written Python code.

:class:`LocalSandbox` runs each program in a fresh process tree on this machine; :class:`SandboxFusionBackend`
(``sandbox_fusion.py``) sends it to a SandboxFusion server. Both return a :class:`SandboxResult`.

Isolation of :class:`LocalSandbox` (Linux; each layer is applied when the platform allows it and reported in
``SandboxResult.isolation``; ``docs/tools.md`` states the guarantees):

* **lifetime** - own session / process group; own pid namespace (when root or user namespaces are allowed) whose
  init exits with the program, so the kernel kills every descendant, even ones that called ``setsid``; a wall-clock
  timeout kills the whole group.
* **CPU / memory / files** - ``RLIMIT_CPU``, ``RLIMIT_AS`` (per process), ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE=0``; a memory cgroup limits the whole tree when cgroups are writable.
* **processes** - a pids cgroup (``pids.max``) when cgroups are writable; ``RLIMIT_NPROC`` otherwise (only
  effective for non-root uids: root ignores it, which is why root runs need the cgroup or ``sandbox_uid``).
* **network** - own network namespace (no interfaces but a down loopback); else Landlock's TCP bind/connect denial;
  else (reported as ``python-guard``) a Python-level socket guard, which ctypes can bypass.
* **filesystem** - Landlock (Linux >= 5.13): read/execute only the Python installation, system libraries and a few
  device files; read/write only the temporary working directory (removed afterwards).
* **privileges** - ``no_new_privs``; root drops every capability (or switches to ``sandbox_uid``).
* **local sockets** - seccomp refuses ``socket(AF_UNIX)`` (pathname sockets such as a docker socket are outside
  Landlock's reach) and ``io_uring``.
* **output** - stdout/stderr read incrementally; past ``max_output_bytes`` the program is killed and the result
  marked ``truncated`` (memory stays bounded whatever the program prints).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import shutil
import signal
import stat
import sys
import sysconfig
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SandboxResult", "SandboxBackend", "LocalSandbox"]

_LAUNCHER = str(Path(__file__).with_name("_sandbox_launcher.py"))

# Network guard used only when neither a network namespace nor Landlock could be applied.
_NETWORK_GUARD = """\
import socket as _s, sys as _sys, runpy as _r
def _deny(*a, **k):
    raise PermissionError("network access is disabled in this sandbox")
class _Socket(_s.socket):
    def __init__(self, family=-1, *a, **k):
        if family in (_s.AF_INET, _s.AF_INET6, -1) or family == getattr(_s, "AF_PACKET", None):
            _deny()
        super().__init__(family, *a, **k)
_s.socket = _Socket
_s.create_connection = _deny
_s.getaddrinfo = _deny
_sys.argv = [%(path)r]
_r.run_path(%(path)r, run_name="__main__")
"""


@dataclass
class SandboxResult:
    """What a sandboxed run produced."""

    stdout: str
    stderr: str
    exit_code: int | None  #: exit status; None when killed by a signal or the sandbox failed
    timed_out: bool  #: the wall-clock (or CPU) limit ended the run
    truncated: bool  #: output exceeded ``max_output_bytes`` (the program was stopped there)
    signal: int | None = None  #: the signal that killed the program (``SIGKILL``: memory cgroup, ``SIGXCPU``: CPU)
    duration_s: float = 0.0
    error: str | None = None  #: sandbox / transport failure (not the program's fault)
    isolation: dict = field(default_factory=dict)  #: layers actually applied (backend-specific)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exit_code == 0


class SandboxBackend(ABC):
    """Runs one Python program and returns its output."""

    @abstractmethod
    async def run_code(self, code: str, *, timeout_s: float, memory_mb: int, max_output_bytes: int) -> SandboxResult:
        """Run ``code`` (Python source) with a wall-clock limit, a memory limit and an output cap."""

    async def aclose(self) -> None:
        """Release resources (connections, ...)."""


def _world_accessible(path: str) -> bool:
    """Whether a uid with no special rights can reach (and read/execute) ``path``: every ancestor o+x."""
    p = Path(os.path.realpath(path))
    for part in [p, *p.parents]:
        try:
            mode = part.stat().st_mode
        except OSError:
            return False
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
    return bool(p.stat().st_mode & stat.S_IROTH)


class _Cgroups:
    """Per-run pids (+ memory) cgroups under this process's own cgroup (v1 hierarchies or a delegated v2 tree)."""

    def __init__(self) -> None:
        self.parents: dict[str, str] = {}  # controller -> folder holding the per-run groups
        self.v2 = False
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return
        own = {}
        for line in lines:
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                own[c] = path
        name = f"hf_gptoss_rl_sandbox_{os.getpid()}"
        for controller in ("pids", "memory"):
            base = Path("/sys/fs/cgroup") / controller
            if controller in own and (base / "cgroup.procs").exists():
                self._try_parent(controller, base / own[controller].lstrip("/") / name)
        if not self.parents and "" in own and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            # cgroup v2: usable only where the pids controller is already delegated to our subtree
            mine = Path("/sys/fs/cgroup") / own[""].lstrip("/")
            try:
                enabled = (mine / "cgroup.subtree_control").read_text().split()
            except OSError:
                enabled = []
            if "pids" in enabled:
                self.v2 = True
                self._try_parent("unified", mine / name)

    def _try_parent(self, controller: str, folder: Path) -> None:
        try:
            folder.mkdir(exist_ok=True)
            probe = folder / "probe"
            probe.mkdir(exist_ok=True)
            probe.rmdir()
            self.parents[controller] = str(folder)
        except OSError:
            return
        if len(self.parents) == 1:
            atexit.register(self.remove_parents)

    def remove_parents(self) -> None:
        """Remove this process's cgroup folders (at exit; runs still in flight keep theirs)."""
        for folder in self.parents.values():
            try:
                os.rmdir(folder)
            except OSError:
                pass

    def create(self, run: str, *, max_processes: int, memory_bytes: int) -> dict[str, str]:
        """Make the run's groups with their limits; returns {controller: folder} (empty when cgroups are unusable)."""
        made = {}
        for controller, parent in self.parents.items():
            folder = os.path.join(parent, run)
            try:
                os.mkdir(folder)
                made[controller] = folder
                if controller in ("pids", "unified"):
                    Path(folder, "pids.max").write_text(str(max_processes))
                if controller == "memory":
                    Path(folder, "memory.limit_in_bytes").write_text(str(memory_bytes))
                    try:
                        Path(folder, "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                    except OSError:
                        pass
                if controller == "unified":
                    try:
                        Path(folder, "memory.max").write_text(str(memory_bytes))
                        Path(folder, "memory.swap.max").write_text("0")
                    except OSError:
                        pass
            except OSError:
                continue
        return made

    @staticmethod
    def destroy(folders: list[str]) -> None:
        """Kill whatever is still in the groups, then remove them."""
        for folder in folders:
            for _ in range(200):
                try:
                    pids = [int(p) for p in Path(folder, "cgroup.procs").read_text().split()]
                except OSError:
                    break
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.005)
            for _ in range(100):
                try:
                    os.rmdir(folder)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)


class LocalSandbox(SandboxBackend):
    """Run Python code in an isolated process tree on this machine (see the module docstring and ``docs/tools.md``).

    Args:
        python: interpreter for the programs (default: this one, so the programs see the same site-packages,
            e.g. numpy and sympy for ReTool).
        max_processes: processes/threads the program may run at once (pids cgroup or ``RLIMIT_NPROC``).
        max_file_mb: largest file the program may write (``RLIMIT_FSIZE``).
        max_open_files: ``RLIMIT_NOFILE``.
        max_concurrency: programs running at once (default: the CPU count); further calls wait.
        isolate_filesystem: apply Landlock (default True).
        require_isolation: refuse to run (``SandboxResult.error``) unless network, filesystem (Landlock) and
            process-count isolation are all in place; by default the program runs with what the platform allows, and
            ``SandboxResult.isolation`` says what that was.
        extra_readable_paths: more paths the program may read (data files, a model of a library, ...).
        sandbox_uid: when running as root, switch to this uid (None: pick one when the interpreter is reachable by
            an unprivileged uid; ``False``: stay uid 0 with every capability dropped).
        use_cgroups: create pids/memory cgroups when this process may (default True).
        use_namespaces: unshare network, pid, IPC and UTS namespaces when this process may (default True). Without
            them the network is closed by Landlock (TCP) and stray processes are killed by init as a child
            subreaper.
    """

    _uids = itertools.count(2_000_000 + (os.getpid() % 1000) * 1000)

    def __init__(
        self,
        *,
        python: str | None = None,
        max_processes: int = 16,
        max_file_mb: int = 64,
        max_open_files: int = 256,
        max_concurrency: int | None = None,
        isolate_filesystem: bool = True,
        require_isolation: bool = False,
        extra_readable_paths: tuple[str, ...] | list[str] = (),
        sandbox_uid: int | bool | None = None,
        use_cgroups: bool = True,
        use_namespaces: bool = True,
    ):
        if not sys.platform.startswith("linux"):
            raise RuntimeError("LocalSandbox needs Linux (namespaces, rlimits, Landlock); use SandboxFusionBackend")
        if max_processes < 1:
            raise ValueError("max_processes must be >= 1")
        self.python = python or sys.executable
        self.max_processes = max_processes
        self.max_file_bytes = int(max_file_mb) * 2**20
        self.max_open_files = max_open_files
        self.isolate_filesystem = isolate_filesystem
        self.require_isolation = require_isolation
        self.extra_readable_paths = [str(p) for p in extra_readable_paths]
        self.max_concurrency = max_concurrency or os.cpu_count() or 1
        self._semaphore, self._loop = None, None
        self._cgroups = _Cgroups() if use_cgroups else None
        self.use_namespaces = use_namespaces
        if sandbox_uid is None:
            sandbox_uid = os.geteuid() == 0 and _world_accessible(self.python) and all(
                _world_accessible(p) for p in self._runtime_dirs() if os.path.isdir(p)
            )
        self._switch_uid = bool(sandbox_uid) and os.geteuid() == 0
        self._fixed_uid = sandbox_uid if isinstance(sandbox_uid, int) and not isinstance(sandbox_uid, bool) else None

    def _runtime_dirs(self) -> list[str]:
        """The interpreter's installation (prefixes, stdlib, site-packages) of ``self.python``."""
        if os.path.realpath(self.python) == os.path.realpath(sys.executable):
            paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
            paths.update(v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib"))
        else:
            paths = set()
        for exe in (os.path.abspath(self.python), os.path.realpath(self.python)):  # a venv, and what it links to
            paths.add(os.path.dirname(os.path.dirname(exe)))
            paths.add(os.path.dirname(exe))
        return sorted(p for p in paths if p != os.sep)  # never the whole filesystem

    def _read_paths(self) -> list[str]:
        system = ["/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache", "/etc/localtime", "/etc/alternatives",
                  "/sys/devices/system/cpu", "/dev/urandom", "/dev/random", "/dev/zero"]
        return self._runtime_dirs() + system + self.extra_readable_paths

    async def run_code(
        self, code: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_bytes: int = 1 << 16
    ) -> SandboxResult:
        if timeout_s <= 0 or memory_mb <= 0 or max_output_bytes <= 0:
            raise ValueError("timeout_s, memory_mb and max_output_bytes must be positive")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # asyncio primitives belong to one loop; callers may use asyncio.run per step
            self._semaphore, self._loop = asyncio.Semaphore(self.max_concurrency), loop
        async with self._semaphore:
            try:
                return await self._run(code, float(timeout_s), int(memory_mb), int(max_output_bytes))
            except OSError as e:  # no temp space, no fork, ...: the sandbox's failure, not the program's
                return SandboxResult("", "", None, False, False, error=f"sandbox could not run the program: {e}")

    async def _run(self, code: str, timeout_s: float, memory_mb: int, max_output_bytes: int) -> SandboxResult:
        start = time.monotonic()
        workdir = tempfile.mkdtemp(prefix="hf_gptoss_rl_sandbox_")
        run_id = uuid.uuid4().hex[:12]
        cgroups: dict[str, str] = {}
        status_r = status_w = -1
        proc = None
        tasks: list[asyncio.Future] = []
        stdout, stderr = bytearray(), bytearray()
        truncated = timed_out = False
        status = None
        try:
            main = os.path.join(workdir, "main.py")
            Path(main).write_text(code, encoding="utf-8")
            uid = None
            if self._switch_uid:
                uid = self._fixed_uid if self._fixed_uid is not None else next(self._uids)
                os.chown(workdir, uid, uid)
                os.chown(main, uid, uid)
            if self._cgroups is not None and self._cgroups.parents:
                cgroups = self._cgroups.create(
                    run_id, max_processes=self.max_processes + 2, memory_bytes=memory_mb * 2**20 + 64 * 2**20
                )
            status_r, status_w = os.pipe()
            config = {
                "python": self.python,
                # -E -s: ignore PYTHON* variables and the user site (like -I, but the script's folder stays importable)
                "argv": [self.python, "-E", "-s", "-B", "-u", "-X", "utf8", main],
                "env": {
                    "PATH": "/usr/local/bin:/usr/bin:/bin",
                    "HOME": workdir,
                    "TMPDIR": workdir,
                    "LANG": "C.UTF-8",
                    "OMP_NUM_THREADS": "1",
                    "OPENBLAS_NUM_THREADS": "1",
                    "MKL_NUM_THREADS": "1",
                    "NUMEXPR_NUM_THREADS": "1",
                    "MPLBACKEND": "Agg",
                },
                "workdir": workdir,
                "status_fd": status_w,
                "cgroup_procs": {c: os.path.join(folder, "cgroup.procs") for c, folder in cgroups.items()},
                "rlimits": {
                    "cpu": max(1, int(timeout_s + 0.999)),
                    "as": memory_mb * 2**20,
                    "nproc": self.max_processes,
                    "fsize": self.max_file_bytes,
                    "nofile": self.max_open_files,
                },
                "uid": uid,
                "namespaces": self.use_namespaces,
                "landlock": self.isolate_filesystem,
                "require_isolation": self.require_isolation,
                "read_paths": self._read_paths(),
                "write_paths": ["/dev/null"],
                "guard": _NETWORK_GUARD,
            }
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", _LAUNCHER, json.dumps(config),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                start_new_session=True,
                pass_fds=(status_w,),
                cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            )
            os.close(status_w)
            status_w = -1
            status = _StatusPipe(status_r)
            budget = [max_output_bytes]
            overflow = asyncio.Event()

            async def pump(stream: asyncio.StreamReader, sink: bytearray) -> None:
                while True:
                    chunk = await stream.read(1 << 16)
                    if not chunk:
                        return
                    take = min(len(chunk), budget[0])
                    sink += chunk[:take]
                    budget[0] -= take
                    if take < len(chunk):
                        overflow.set()
                        return

            readers = [asyncio.ensure_future(pump(proc.stdout, stdout)), asyncio.ensure_future(pump(proc.stderr, stderr))]
            finished = asyncio.ensure_future(asyncio.gather(*readers, proc.wait()))
            overflowed = asyncio.ensure_future(overflow.wait())
            tasks += [*readers, finished, overflowed]
            done, _ = await asyncio.wait({finished, overflowed}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if overflowed in done:
                truncated = True
            elif finished not in done:
                timed_out = True
            overflowed.cancel()
            if finished not in done:
                await self._stop(proc, status, list(cgroups.values()))
                for r in readers:  # a process that escaped may still hold the pipes: don't wait for it
                    r.cancel()
                finished.cancel()
                await asyncio.gather(finished, *readers, return_exceptions=True)
        finally:
            if proc is not None and proc.returncode is None:  # cancelled by the caller, or an error above
                await asyncio.shield(self._stop(proc, status, list(cgroups.values())))
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            transport = getattr(proc, "_transport", None)  # close the pipes now, not at garbage collection
            if transport is not None:
                transport.close()
            reports = status.read() if status is not None else []
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            # cgroup removal may wait for the kernel to release the group: keep it off the event loop
            # (shielded: a caller's cancellation must not skip it)
            await asyncio.shield(
                asyncio.get_running_loop().run_in_executor(None, self._cleanup, list(cgroups.values()), workdir)
            )

        setup = next((r for r in reports if r.get("stage") == "setup"), {})
        failure = next((r["error"] for r in reports if r.get("stage") == "error"), None)
        exit_report = next((r for r in reports if r.get("stage") == "exit"), None)
        exit_code = sig = None
        if exit_report is not None and exit_report.get("status") is not None:
            status = exit_report["status"]
            if os.WIFEXITED(status):
                exit_code = os.WEXITSTATUS(status)
            elif os.WIFSIGNALED(status):
                sig = os.WTERMSIG(status)
        if failure is not None:
            exit_code = None  # the program never ran (or the sandbox broke): no exit status of the program
        if sig == signal.SIGXCPU:
            timed_out = True
        if not timed_out and not truncated and failure is None and exit_report is None:
            failure = f"sandbox launcher exited with {proc.returncode if proc else None} without a report"
        isolation = {k: v for k, v in setup.items() if k != "stage"}
        return SandboxResult(
            stdout=stdout.decode("utf-8", errors="replace"),
            stderr=stderr.decode("utf-8", errors="replace"),
            exit_code=exit_code,
            timed_out=timed_out,
            truncated=truncated,
            signal=sig,
            duration_s=time.monotonic() - start,
            error=failure,
            isolation=isolation,
        )

    @staticmethod
    def _cleanup(cgroups: list[str], workdir: str) -> None:
        if cgroups:
            _Cgroups.destroy(cgroups)
        shutil.rmtree(workdir, ignore_errors=True)

    async def _stop(self, proc: asyncio.subprocess.Process, status: "_StatusPipe | None", cgroups: list[str]) -> None:
        """Stop a run: SIGTERM init (a child subreaper: it SIGKILLs every descendant, even ones that left the
        process group, then exits, which also empties its pid namespace); after a grace period SIGKILL the process
        group (launcher, init) and whatever is left in the run's cgroups."""
        init_pid = next((r["init_pid"] for r in status.read() if r.get("stage") == "launch"), None) if status else None
        if init_pid and proc.returncode is None:  # init is unreaped while the launcher runs: its pid is still ours
            try:
                os.kill(init_pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=2.0)
            except asyncio.TimeoutError:
                pass
        self._kill(proc, cgroups)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout=5.0)
        except asyncio.TimeoutError:
            pass

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process, cgroups: list[str]) -> None:
        """SIGKILL the launcher's process group, then anything left in the run's cgroups."""
        if proc.returncode is None:  # once reaped, its pid (= the group id) may belong to someone else
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for folder in cgroups:
            try:
                for pid in Path(folder, "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            except OSError:
                pass


class _StatusPipe:
    """JSON lines from the launcher, init and the program's setup, read without blocking (a writer that escaped
    cannot stall us); accumulates across reads."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""
        self.reports: list[dict] = []
        os.set_blocking(fd, False)

    def read(self) -> list[dict]:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            except OSError:
                break
            if not chunk:
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                self.reports.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return self.reports
