"""Sandboxes that run untrusted, model-written Python code.

:class:`LocalSandbox` runs each program in a fresh process tree on this machine; :class:`SandboxFusionBackend`
(``sandbox_fusion.py``) sends it to a SandboxFusion server. Both return a :class:`SandboxResult`.

Isolation of :class:`LocalSandbox` (Linux; ``docs/tools.md`` states the threat model and the guarantees; what was
applied on this machine is reported in ``SandboxResult.isolation``):

* **uid** - the program never runs as uid 0: a root caller switches it to a fresh unprivileged uid/gid per run (the
  interpreter is made reachable for that uid inside the mount namespace when it lives in a private folder such as a
  0700 ``/root``); a non-root caller runs it as itself inside a user namespace, with no capabilities. Where neither
  works, the constructor refuses, naming the reason and the fix.
* **filesystem** - own mount namespace in which every mount is read-only (chmod, chown, utime, xattrs, links,
  renames, creation and deletion outside the working directory fail with ``EROFS``, whoever owns the file); the
  working directory is a size-limited tmpfs (total disk quota per run) that vanishes with the namespace; Landlock
  (Linux >= 5.13): read/execute only the Python installation, system libraries and a few device files.
* **lifetime** - own session / process group; own pid namespace whose init exits with the program, so the kernel
  kills every descendant, even ones that called ``setsid``; a wall-clock timeout (the program's own run time: the
  wait for a free slot has its own bound, ``queue_timeout_s``) kills the whole group. So does cancelling the call,
  wherever the cancellation lands (even while the process starts, even repeatedly): the call then raises
  ``CancelledError`` only once every process of the run is gone, its folder and cgroups removed and its slot free.
* **CPU / memory / files** - ``RLIMIT_CPU``, ``RLIMIT_AS`` (per process), ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``,
  ``RLIMIT_CORE=0``; a memory cgroup limits the whole tree when cgroups are writable (its OOM kills are counted, so a
  memory kill is told apart from a timeout and from a signal the program sent itself).
* **processes** - a pids cgroup (``pids.max``) when cgroups are writable; ``RLIMIT_NPROC`` otherwise.
* **network** - own network namespace (no interfaces but a down loopback) and Landlock's TCP bind/connect denial;
  without either (reported as ``python-guard``) a Python-level socket guard, which ctypes can bypass.
* **privileges** - ``no_new_privs``, no capabilities (empty bounding set).
* **kernel surface** - seccomp allows socket families by list: ``socketpair(AF_UNIX)`` only, and ``socket()`` of no
  family (``AF_UNIX``: pathname sockets such as a docker socket are outside Landlock's reach; IP: no network here,
  UDP included); it refuses ``io_uring``, new namespaces, ``bpf``, ``perf_event_open``, ``userfaultfd`` and keyrings.
* **output** - stdout/stderr read incrementally; past ``max_output_bytes`` the program is killed and the result
  marked ``truncated`` (memory stays bounded whatever the program prints).
"""

from __future__ import annotations

import asyncio
import atexit
import fcntl
import functools
import itertools
import json
import logging
import math
import os
import signal
import stat
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SandboxResult", "SandboxBackend", "LocalSandbox", "usable_cpus", "remove_tree", "sweep_stale"]

logger = logging.getLogger(__name__)

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
    signal: int | None = None  #: the signal that ended the program
    duration_s: float = 0.0  #: the run itself (setup, program, cleanup), without ``queued_s``
    error: str | None = None  #: sandbox / transport failure (not the program's fault)
    isolation: dict = field(default_factory=dict)  #: layers actually applied (backend-specific)
    #: why the program was stopped, when it did not end by itself: "timeout", "cpu_limit", "output_limit",
    #: "memory_limit" (OOM kill in the run's memory cgroup), "program" (a signal the sandbox did not send: the
    #: program's own ``os.kill``/``abort``/crash), "unknown" (a signal whose origin the backend cannot tell)
    killed_by: str | None = None
    oom_kills: int = 0  #: processes of the program killed for exceeding the memory limit
    disk_full: bool = False  #: the working directory's disk quota (size or file count) was reached
    queued_s: float = 0.0  #: time spent waiting for a free slot (not counted against ``timeout_s``)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exit_code == 0


class SandboxBackend(ABC):
    """Runs one Python program and returns its output."""

    @abstractmethod
    async def run_code(self, code: str, *, timeout_s: float, memory_mb: int, max_output_bytes: int) -> SandboxResult:
        """Run ``code`` (Python source) with a limit on its own run time (waiting for a free slot does not count), a
        memory limit and an output cap."""

    async def aclose(self) -> None:
        """Release resources (connections, ...)."""


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota (v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``) when one is set."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            path = path.lstrip("/")
            if controllers == "":
                quota, period = Path("/sys/fs/cgroup", path, "cpu.max").read_text().split()
            elif "cpu" in controllers.split(","):
                base = Path("/sys/fs/cgroup/cpu", path)
                quota, period = (base / "cpu.cfs_quota_us").read_text(), (base / "cpu.cfs_period_us").read_text()
            else:
                continue
            if quota.strip() not in ("max", "-1"):
                n = min(n, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _world_accessible(path: str) -> bool:
    """Whether a uid with no special rights can reach (and read/execute) ``path``: every ancestor o+x."""
    return _reachable(path) is None


def _reachable(path: str, exposed: tuple[str, ...] = ()) -> str | None:
    """None when a uid with no special rights can reach and read ``path``; else the first obstacle, described.
    Folders in ``exposed`` (and what leads to them) count as reachable: they are bind-mounted into the sandbox."""
    p = Path(os.path.realpath(path))
    chain = [p, *p.parents]
    for i, part in enumerate(chain):
        if str(part) in exposed:
            chain = chain[: i + 1]  # above an exposed folder the sandbox sees recreated 0755 folders
            break
    for part in chain:
        try:
            mode = part.stat().st_mode
        except OSError as e:
            return f"{part}: {e.strerror}"
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return f"{part} (mode {stat.filemode(mode)}) cannot be traversed by other users"
    mode = p.stat().st_mode
    if not mode & stat.S_IROTH:
        return f"{p} (mode {stat.filemode(mode)}) cannot be read by other users"
    return None


def _blocker(path: str) -> str | None:
    """The topmost folder above ``path`` (realpath) that other users cannot traverse, or None."""
    for part in reversed(Path(os.path.realpath(path)).parents):
        try:
            mode = part.stat().st_mode
        except OSError:
            return None
        if not mode & stat.S_IXOTH:
            return str(part)
    return None


@functools.cache
def _probe(euid: int) -> dict:
    """What this machine allows (namespaces, a private read-only mount tree with a tmpfs, Landlock), asked once per
    process and uid from a throwaway launcher process."""
    try:
        out = subprocess.run(
            [sys.executable, "-I", "-S", _LAUNCHER, "--probe"],
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"mount": False, "mount_error": f"probe failed: {type(e).__name__}: {e}"}


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS = 0x80086601, 0x40086602
_UNDELETABLE = 0x10 | 0x20  # FS_IMMUTABLE_FL | FS_APPEND_FL
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _clear_undeletable(fd: int) -> None:
    """Clear the immutable / append-only flags of an open inode (needs CAP_LINUX_IMMUTABLE; ignored otherwise)."""
    try:
        flags = struct.unpack("=i", fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))[:4])[0]
        if flags & _UNDELETABLE:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, struct.pack("=iI", flags & ~_UNDELETABLE, 0))
    except OSError:
        pass


def _retry_undeletable(action, name: str, dir_fd: int) -> None:
    """``action()`` (an unlink or rmdir of ``name`` in ``dir_fd``); on EPERM clear the immutable/append-only flags of
    the entry and of its folder, then try once more."""
    try:
        return action()
    except PermissionError:
        pass
    _clear_undeletable(dir_fd)
    try:  # O_PATH would not do for the ioctl; O_NONBLOCK so a FIFO does not block the open
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        fd = -1
    if fd >= 0:
        _clear_undeletable(fd)
        os.close(fd)
    action()


def _empty_dir(fd: int, problems: list[str], where: str) -> list[str]:
    """Delete every non-folder entry of the open folder ``fd`` (files, symlinks, FIFOs, sockets, devices: never
    opened or followed); return the names of its subfolders."""
    try:
        if os.fstat(fd).st_mode & 0o700 != 0o700:
            os.fchmod(fd, 0o700)  # a mode-000 folder: the owner (or root) may fix it
    except OSError:
        pass
    subdirs = []
    with os.scandir(fd) as entries:
        listed = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    for name, is_dir in listed:
        if is_dir:
            subdirs.append(name)
            continue
        try:
            _retry_undeletable(lambda: os.unlink(name, dir_fd=fd), name, fd)
        except FileNotFoundError:
            pass
        except OSError as e:
            problems.append(f"{where}/{name}: {e.strerror}")
    return subdirs


def _open_subdir(fd: int, name: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except PermissionError:  # mode 000 (a non-root owner): make it ours to read, then open
        os.chmod(name, 0o700, dir_fd=fd)  # a folder (checked without following links); nothing else runs there now
        return os.open(name, _DIR_FLAGS, dir_fd=fd)


def remove_tree(path: str) -> str | None:
    """Delete ``path`` and everything below it; return None, or a description of what could not be removed. Never
    raises.

    Unlike ``shutil.rmtree`` (recursive: ``RecursionError`` at a few thousand levels in Python 3.11) it walks
    iteratively with one open folder at a time (so depth is bounded by neither the stack, the open-file limit nor
    ``PATH_MAX``), climbs back through ``..`` checking each parent's device and inode, never follows symlinks and
    never opens FIFOs or sockets, makes mode-000 folders readable, and clears immutable / append-only flags where
    this process may (CAP_LINUX_IMMUTABLE). Meant for folders nothing else writes to any more."""
    problems: list[str] = []
    try:
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            os.unlink(path)
            return None
        stack: list[tuple[str, tuple[int, int], list[str]]] = []  # (name in parent, parent's (dev, ino), its to-do)
        try:
            pending = _empty_dir(fd, problems, path)
            while True:
                if pending:
                    name = pending.pop()
                    try:
                        child = _open_subdir(fd, name)
                    except OSError as e:
                        problems.append(f"{path}/.../{name}: {e.strerror}")
                        continue
                    st = os.fstat(fd)
                    stack.append((name, (st.st_dev, st.st_ino), pending))
                    os.close(fd)
                    fd = child
                    pending = _empty_dir(fd, problems, f"{path}/...")
                    continue
                if not stack:
                    break
                name, ids, parent_pending = stack.pop()
                parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = parent
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != ids:
                    problems.append(f"{path}: a folder moved during removal; stopped")
                    break
                try:
                    _retry_undeletable(lambda: os.rmdir(name, dir_fd=fd), name, fd)
                except OSError as e:
                    problems.append(f"{path}/.../{name}: {e.strerror}")
                pending = parent_pending
        finally:
            os.close(fd)
        os.rmdir(path)
    except Exception as e:  # noqa: BLE001 - cleanup reports, it never raises into a tool result
        problems.append(f"{path}: {type(e).__name__}: {e}")
    if not problems:
        return None
    return "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)" if len(problems) > 5 else "")


_WORKDIR_PREFIX = "hf_gptoss_rl_sandbox_"
_TIMEOUT_GRACE_S = 2.0  # SIGTERM to SIGKILL for a program that ran out of time
_STOP_GRACE_S = 0.5  # the same for a cancelled call or an output flood: init normally exits within milliseconds
_swept = False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_stale(tmpdir: str | None = None, *, min_age_s: float = 3600.0) -> list[str]:
    """Remove what sandboxes of processes that died without cleaning up (a killed trainer) left behind: working
    directories ``hf_gptoss_rl_sandbox_<pid>_*`` in the temporary folder whose ``<pid>`` no longer runs and that are
    older than ``min_age_s`` (a process of another pid namespace sharing the folder may look dead from here), and
    empty per-run cgroup folders of such pids. Never raises; returns what was removed."""
    removed = []
    tmpdir = tmpdir or tempfile.gettempdir()
    try:
        entries = os.listdir(tmpdir)
    except OSError:
        entries = []
    now = time.time()
    for name in entries:
        owner = name[len(_WORKDIR_PREFIX) :].split("_", 1)[0]
        if not (name.startswith(_WORKDIR_PREFIX) and owner.isdigit()) or _pid_alive(int(owner)):
            continue
        path = os.path.join(tmpdir, name)
        try:
            if now - os.lstat(path).st_mtime < min_age_s:
                continue
        except OSError:
            continue
        if remove_tree(path) is None:
            removed.append(path)
    return removed


class _Uncancelled:
    """Runs the steps a run must not abandon halfway (starting the launcher, stopping it, cleaning up) to their end.
    A cancellation that arrives meanwhile is recorded in ``cancelled``, for the run to act on (stop the program at
    once) and to re-raise once it is cleaned up; however often it comes, it never cuts a step short."""

    def __init__(self) -> None:
        self.cancelled = False

    async def complete(self, awaitable, default=None):
        future = asyncio.ensure_future(awaitable)
        while True:
            try:
                return await asyncio.shield(future)
            except asyncio.CancelledError:
                self.cancelled = True
                if future.cancelled():  # the step itself was cancelled (its event loop is shutting down)
                    return default
                if future.done():  # the cancellation came as the step ended
                    return future.result()


async def _reaped(proc: asyncio.subprocess.Process, timeout: float) -> bool:
    """Wait up to ``timeout`` s for the launcher to be reaped. (``Process.wait()`` also waits for its pipes to
    close, which a process that escaped the group could hold open.)"""
    deadline = time.monotonic() + timeout
    while proc.returncode is None:
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.005)
    return True


def _own_children() -> list[int]:
    """Pids of this process's children (every thread's, from /proc/self/task/*/children; else a /proc scan)."""
    try:
        pids = []
        for tid in os.listdir("/proc/self/task"):
            try:
                pids += [int(p) for p in Path(f"/proc/self/task/{tid}/children").read_text().split()]
            except FileNotFoundError:
                if os.path.exists(f"/proc/self/task/{tid}"):
                    raise  # no children files in this kernel
        return pids
    except OSError:
        me, pids = os.getpid(), []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                        pids.append(int(entry))
                except (OSError, ValueError, IndexError):
                    pass
        return pids


def _reap_strays(launcher: int) -> None:
    """Kill and reap the processes of a run's process group (led by its launcher) that became this process's
    children. Orphans go to pid 1 or the nearest child subreaper, which may be this process (a container's entry
    point): an init whose launcher died first would otherwise stay a zombie for good. A child of ours keeps its pid
    until reaped, so signalling it by pid is safe. (The launcher itself is left to asyncio's child watcher.)"""
    deadline = time.monotonic() + 1.0
    while True:
        strays = []
        for pid in _own_children():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if pid != launcher and int(fields[2]) == launcher:
                strays.append(pid)
        for pid in strays:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, os.WNOHANG)
            except (ProcessLookupError, ChildProcessError):
                pass
        if not strays or time.monotonic() > deadline:
            return
        time.sleep(0.005)


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

    def sweep_stale(self) -> list[str]:
        """rmdir the empty cgroup folders that sandboxes of dead processes left next to ours (a group that still
        holds a process is left alone)."""
        removed = []
        for folder in self.parents.values():
            for stale in Path(folder).parent.glob(_WORKDIR_PREFIX + "*"):
                owner = stale.name[len(_WORKDIR_PREFIX) :]
                if not owner.isdigit() or _pid_alive(int(owner)):
                    continue
                try:
                    for run in stale.iterdir():
                        if run.is_dir():
                            run.rmdir()
                    stale.rmdir()
                    removed.append(str(stale))
                except OSError:
                    pass
        return removed

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
    def oom_kills(folders: dict[str, str]) -> int:
        """Processes the run's memory cgroup killed for exceeding its limit (v1 ``memory.oom_control``, v2
        ``memory.events``: the ``oom_kill`` counter)."""
        for controller, name in (("memory", "memory.oom_control"), ("unified", "memory.events")):
            if controller in folders:
                try:
                    for line in Path(folders[controller], name).read_text().splitlines():
                        key, _, value = line.partition(" ")
                        if key == "oom_kill":
                            return int(value)
                except (OSError, ValueError):
                    pass
        return 0

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
        max_disk_mb: total size of everything the program may write (its working directory is a tmpfs of this size;
            it counts towards the memory cgroup's limit on top of ``memory_mb``). Reaching it is reported in
            ``SandboxResult.disk_full``.
        max_disk_files: files and folders the working directory may hold (tmpfs inodes).
        max_open_files: ``RLIMIT_NOFILE``.
        max_concurrency: programs running at once (default: :func:`usable_cpus`, the CPUs this process may use);
            further calls wait for a slot, and that wait does not count against their ``timeout_s``.
        queue_timeout_s: longest wait for a slot; past it the call returns ``SandboxResult.error`` without running.
        isolate_filesystem: apply Landlock (default True).
        require_isolation: refuse to run (``SandboxResult.error``) unless network, filesystem (Landlock), socket-family
            (seccomp), process-count isolation and the disk quota are all in place; by default the program runs with what the
            platform allows, and ``SandboxResult.isolation`` says what that was. Host-file protection and a non-root
            uid are never optional: without them the constructor raises.
        extra_readable_paths: more paths the program may read (data files, a model of a library, ...).
        sandbox_uid: when running as root, run every program as this uid/gid (> 0) instead of a fresh one per run.
        use_cgroups: create pids/memory cgroups when this process may (default True).
        use_namespaces: unshare mount, network, pid, IPC and UTS namespaces (default True). Without them there is
            no disk quota, the network is closed by Landlock (TCP only) and stray processes are killed by init as a
            child subreaper; a root caller then needs an interpreter every uid can reach, and a non-root caller is
            refused (nothing would stop chmod/utime on its own files).

    Raises:
        RuntimeError: when this machine cannot run programs without root rights over host files (the message names
            the reason and the fix).
    """

    _uids = itertools.count(2_000_000 + (os.getpid() % 1000) * 1000)

    def __init__(
        self,
        *,
        python: str | None = None,
        max_processes: int = 16,
        max_file_mb: int = 64,
        max_disk_mb: int = 128,
        max_disk_files: int = 16384,
        max_open_files: int = 256,
        max_concurrency: int | None = None,
        queue_timeout_s: float = 600.0,
        isolate_filesystem: bool = True,
        require_isolation: bool = False,
        extra_readable_paths: tuple[str, ...] | list[str] = (),
        sandbox_uid: int | None = None,
        use_cgroups: bool = True,
        use_namespaces: bool = True,
    ):
        if not sys.platform.startswith("linux"):
            raise RuntimeError("LocalSandbox needs Linux (namespaces, rlimits, Landlock); use SandboxFusionBackend")
        if max_processes < 1 or max_file_mb < 1 or max_disk_mb < 1 or max_disk_files < 16 or max_open_files < 16:
            raise ValueError(
                "max_processes, max_file_mb and max_disk_mb must be >= 1, max_disk_files and max_open_files >= 16"
            )
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not queue_timeout_s > 0:
            raise ValueError(f"queue_timeout_s must be positive, got {queue_timeout_s}")
        if sandbox_uid is not None and (
            isinstance(sandbox_uid, bool) or not isinstance(sandbox_uid, int) or sandbox_uid <= 0
        ):
            raise ValueError(
                f"sandbox_uid must be None (a fresh uid per run) or a uid > 0, got {sandbox_uid!r}: "
                "programs never run as uid 0"
            )
        if sandbox_uid is not None and os.geteuid() != 0:
            raise ValueError(
                f"sandbox_uid={sandbox_uid} needs a root caller: a non-root caller's programs run as its "
                "own uid inside a user namespace"
            )
        self.python = python or sys.executable
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"python={self.python!r} is not an executable file")
        self.max_processes = max_processes
        self.max_file_bytes = int(max_file_mb) * 2**20
        self.max_disk_bytes = int(max_disk_mb) * 2**20
        self.max_disk_files = int(max_disk_files)
        self.max_open_files = max_open_files
        self.isolate_filesystem = isolate_filesystem
        self.require_isolation = require_isolation
        self.extra_readable_paths = [str(p) for p in extra_readable_paths]
        self.max_concurrency = int(max_concurrency or usable_cpus())
        self.queue_timeout_s = float(queue_timeout_s)
        self._semaphore, self._loop = None, None
        self._cgroups = _Cgroups() if use_cgroups else None
        global _swept
        if not _swept:  # once per process: leftovers of trainers that were killed mid-run
            _swept = True
            for path in sweep_stale() + (self._cgroups.sweep_stale() if self._cgroups else []):
                logger.info("removed a sandbox leftover of a dead process: %s", path)
        self.use_namespaces = use_namespaces
        self._root = os.geteuid() == 0
        self._fixed_uid = sandbox_uid
        self._expose: list[tuple[str, list[str]]] = []
        support = _probe(os.geteuid()) if use_namespaces else {"mount_error": "use_namespaces=False"}
        self._mount = bool(support.get("mount"))
        if self._root:
            self._plan_unprivileged_uid(support)
        elif not self._mount:
            raise RuntimeError(
                f"LocalSandbox cannot protect host files here ({support.get('mount_error')}): without a mount "
                f"namespace, programs would run as uid {os.getuid()}, which owns this user's files, and Landlock "
                "cannot stop chmod, utime or xattr changes on them. Fix: allow unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1; on Ubuntu >= 23.10 also "
                "kernel.apparmor_restrict_unprivileged_userns=0), run the trainer as root, or use "
                "SandboxFusionBackend."
            )

    def _plan_unprivileged_uid(self, support: dict) -> None:
        """Root caller: the program runs as an unprivileged uid, which must reach the interpreter. With a mount
        namespace, folders that uid cannot traverse (a 0700 ``/root`` holding a pyenv or venv) are hidden behind a
        tmpfs that shows only the interpreter's folders; without one, everything must already be reachable."""
        needed = [p for p in self._runtime_dirs() + self.extra_readable_paths if os.path.exists(p)]
        targets = [self.python, *needed]
        if self._mount:
            groups: dict[str, list[str]] = {}
            for p in needed + [tempfile.gettempdir()]:
                blocker = _blocker(p)
                if blocker == "/":
                    raise RuntimeError(
                        "LocalSandbox: / cannot be traversed by other users; the sandbox uid could "
                        "not run anything. Fix: chmod o+x /"
                    )
                if blocker is not None:
                    groups.setdefault(blocker, []).append(os.path.realpath(p))
            for blocker, paths in sorted(groups.items()):
                paths = sorted(set(paths))
                top = [p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths)]
                self._expose.append((blocker, top))
            exposed = tuple(p for _, paths in self._expose for p in paths)
        else:
            exposed = ()
        problems = [(t, why) for t in targets if (why := _reachable(t, exposed)) is not None]
        if problems:
            target, why = problems[0]
            how = (
                ""
                if self._mount
                else f" There is no mount namespace to make it reachable ({support.get('mount_error')})."
            )
            raise RuntimeError(
                f"LocalSandbox will not run model code as uid 0 (it could chmod, utime or set xattrs on any root-owned "
                f"file), and the unprivileged sandbox uid cannot use {target}: {why}.{how} Fix: make it readable by "
                f"other users (chmod o+rX on it and o+x on its parent folders), pass python= an interpreter every user "
                f"can run (e.g. /usr/bin/python3 with the packages the programs need)"
                + (
                    ", or allow mount namespaces (use_namespaces=True; in a container: unshare must be permitted)."
                    if not self._mount
                    else "."
                )
            )
        if not self._mount and not os.access(tempfile.gettempdir(), os.W_OK):
            raise RuntimeError(f"LocalSandbox: the temporary folder {tempfile.gettempdir()} is not writable")

    def _runtime_dirs(self) -> list[str]:
        """The interpreter's installation (prefixes, stdlib, site-packages) of ``self.python``."""
        if os.path.realpath(self.python) == os.path.realpath(sys.executable):
            paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
            paths.update(
                v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib", "platlib")
            )
        else:
            paths = set()
        for exe in (os.path.abspath(self.python), os.path.realpath(self.python)):  # a venv, and what it links to
            paths.add(os.path.dirname(os.path.dirname(exe)))
            paths.add(os.path.dirname(exe))
        return sorted(p for p in paths if p != os.sep)  # never the whole filesystem

    def _read_paths(self) -> list[str]:
        system = [
            "/usr",
            "/lib",
            "/lib64",
            "/bin",
            "/etc/ld.so.cache",
            "/etc/localtime",
            "/etc/alternatives",
            "/sys/devices/system/cpu",
            "/dev/urandom",
            "/dev/random",
            "/dev/zero",
        ]
        return self._runtime_dirs() + system + self.extra_readable_paths

    async def run_code(
        self, code: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_bytes: int = 1 << 16
    ) -> SandboxResult:
        if not (timeout_s > 0 and memory_mb > 0 and max_output_bytes > 0):
            raise ValueError("timeout_s, memory_mb and max_output_bytes must be positive")
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # asyncio primitives belong to one loop; callers may use asyncio.run per step
            self._semaphore, self._loop = asyncio.Semaphore(self.max_concurrency), loop
        queued = time.monotonic()
        if not await self._take_slot():  # the queue has its own bound: it never eats into the program's timeout_s
            return SandboxResult(
                "",
                "",
                None,
                False,
                False,
                queued_s=time.monotonic() - queued,
                error=f"no sandbox slot became free within queue_timeout_s={self.queue_timeout_s:g} s "
                f"(max_concurrency={self.max_concurrency}); the program did not run",
            )
        queued_s = time.monotonic() - queued
        try:  # a cancellation comes out of _run as CancelledError, once the run is cleaned up
            result = await self._run(code, float(timeout_s), int(memory_mb), int(max_output_bytes))
        except OSError as e:  # no temp space, no fork, ...: the sandbox's failure, not the program's
            result = SandboxResult("", "", None, False, False, error=f"sandbox could not run the program: {e}")
        except Exception as e:  # noqa: BLE001 - a bug here must not read as the program's own error
            logger.exception("LocalSandbox failed")
            result = SandboxResult("", "", None, False, False, error=f"sandbox failure: {type(e).__name__}: {e}")
        finally:
            self._semaphore.release()
        result.queued_s = queued_s
        return result

    async def _take_slot(self) -> bool:
        """Take a slot, waiting up to ``queue_timeout_s`` (False when none came). A cancellation propagates and
        leaves no slot taken, even one that lands as the slot is handed over (``wait_for`` would return the slot
        then, swallowing the cancellation)."""
        semaphore = self._semaphore
        acquire = asyncio.ensure_future(semaphore.acquire())

        def give_back(task: asyncio.Future) -> None:
            if not task.cancelled() and task.exception() is None:
                semaphore.release()

        try:
            await asyncio.wait({acquire}, timeout=self.queue_timeout_s)
        except asyncio.CancelledError:
            acquire.cancel()
            acquire.add_done_callback(give_back)  # granted already, or before the cancellation reaches it
            raise
        if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
            return True
        acquire.cancel()
        acquire.add_done_callback(give_back)
        return False

    async def _run(self, code: str, timeout_s: float, memory_mb: int, max_output_bytes: int) -> SandboxResult:
        start = time.monotonic()
        workdir = tempfile.mkdtemp(prefix=f"{_WORKDIR_PREFIX}{os.getpid()}_")
        run_id = uuid.uuid4().hex[:12]
        cgroups: dict[str, str] = {}
        status_r = status_w = -1
        proc = None
        tasks: list[asyncio.Future] = []
        stdout, stderr = bytearray(), bytearray()
        truncated = timed_out = False
        status = None
        cleanup: tuple[int, str | None] = (0, None)
        steps = _Uncancelled()  # a caller's cancellation stops the program, then is re-raised once all is cleaned up
        try:
            main = os.path.join(workdir, "main.py")
            Path(main).write_text(code, encoding="utf-8")
            uid = gid = None
            if self._root:
                uid = gid = self._fixed_uid if self._fixed_uid is not None else next(self._uids)
                if not self._mount:  # an on-disk working directory (with a mount namespace it is a tmpfs of uid's)
                    os.chown(workdir, uid, gid)
                    os.chown(main, uid, gid)
            if self._cgroups is not None and self._cgroups.parents:
                # the tmpfs working directory's pages are charged to the group too: budget them on top of memory_mb
                disk = self.max_disk_bytes if self._mount else 0
                cgroups = self._cgroups.create(
                    run_id, max_processes=self.max_processes + 2, memory_bytes=memory_mb * 2**20 + disk + 64 * 2**20
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
                "gid": gid,
                "mount": {"size": self.max_disk_bytes, "inodes": self.max_disk_files, "expose": self._expose}
                if self._mount
                else None,
                "namespaces": self.use_namespaces,
                "landlock": self.isolate_filesystem,
                "require_isolation": self.require_isolation,
                "read_paths": self._read_paths(),
                "write_paths": ["/dev/null"],
                "guard": _NETWORK_GUARD,
            }
            # never cancelled halfway: asyncio would kill the launcher alone and leave its init and program running
            proc = await steps.complete(
                asyncio.create_subprocess_exec(
                    sys.executable,
                    "-I",
                    "-S",
                    _LAUNCHER,
                    json.dumps(config),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    start_new_session=True,
                    pass_fds=(status_w,),
                    cwd=workdir,
                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                )
            )
            os.close(status_w)
            status_w = -1
            status = _StatusPipe(status_r)
            if steps.cancelled or proc is None:  # cancelled while starting (None: by its event loop closing)
                raise asyncio.CancelledError  # the finally block stops it
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
                        # past the limit: keep reading, and discarding. asyncio reports the launcher's exit
                        # (Process.wait()) only once its pipes are closed, and a pipe left unread never is
                        overflow.set()

            readers = [
                asyncio.ensure_future(pump(proc.stdout, stdout)),
                asyncio.ensure_future(pump(proc.stderr, stderr)),
            ]
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
                # a timeout gives init a grace period to stop the tree; past the output limit it goes at once
                grace = _TIMEOUT_GRACE_S if timed_out else _STOP_GRACE_S
                await steps.complete(self._stop(proc, status, list(cgroups.values()), grace))
                for r in readers:  # a process that escaped may still hold the pipes: don't wait for it
                    r.cancel()
                finished.cancel()
                await steps.complete(asyncio.gather(finished, *readers, return_exceptions=True))
        except asyncio.CancelledError:
            steps.cancelled = True
        finally:
            if proc is not None and proc.returncode is None:  # cancelled by the caller, or an error above
                await steps.complete(self._stop(proc, status, list(cgroups.values()), _STOP_GRACE_S))
                if proc.returncode is None:  # the stop was cut short (the event loop is closing) or gave up
                    self._kill(proc, list(cgroups.values()), _init_pid(status))
            for task in tasks:
                task.cancel()
            if tasks:
                await steps.complete(asyncio.gather(*tasks, return_exceptions=True))
            transport = getattr(proc, "_transport", None)  # close the pipes now, not at garbage collection
            if transport is not None:
                transport.close()
            reports = status.read() if status is not None else []
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            # cgroup removal may wait for the kernel to release the group: keep it off the event loop
            cleanup = await steps.complete(
                asyncio.get_running_loop().run_in_executor(
                    None, self._cleanup, dict(cgroups), workdir, proc.pid if proc is not None else None
                ),
                default=(0, None),
            )
            if steps.cancelled:  # the caller gets CancelledError, whatever else happened meanwhile
                raise asyncio.CancelledError

        oom_kills, leftover = cleanup
        setup = next((r for r in reports if r.get("stage") == "setup"), {})
        failure = next((r["error"] for r in reports if r.get("stage") == "error"), None)
        exit_report = next((r for r in reports if r.get("stage") == "exit"), None)
        exit_code = sig = None
        if exit_report is not None and exit_report.get("status") is not None:
            wait_status = exit_report["status"]
            if os.WIFEXITED(wait_status):
                exit_code = os.WEXITSTATUS(wait_status)
            elif os.WIFSIGNALED(wait_status):
                sig = os.WTERMSIG(wait_status)
        if failure is not None:
            exit_code = None  # the program never ran (or the sandbox broke): no exit status of the program
        if sig == signal.SIGXCPU:
            timed_out = True
        if not timed_out and not truncated and failure is None and exit_report is None:
            failure = f"sandbox launcher exited with {proc.returncode if proc else None} without a report"
        disk = (exit_report or {}).get("disk") or {}
        # why it stopped: the sandbox's own kills are known; a SIGKILL with OOM kills counted is the memory limit;
        # any other signal came from the program itself (no one else can signal into its pid namespace)
        killed_by = None
        if timed_out:
            killed_by = "cpu_limit" if sig == signal.SIGXCPU else "timeout"
        elif truncated:
            killed_by = "output_limit"
        elif sig is not None:
            if sig == signal.SIGKILL and oom_kills:
                killed_by = "memory_limit"
            elif sig == signal.SIGKILL and "memory" not in cgroups and "unified" not in cgroups:
                killed_by = "unknown"  # no memory cgroup to ask: the host's OOM killer or the program
            else:
                killed_by = "program"
        isolation = {k: v for k, v in setup.items() if k != "stage"}
        if leftover:
            isolation["cleanup_error"] = leftover
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
            killed_by=killed_by,
            oom_kills=oom_kills,
            disk_full=bool(disk.get("full")),
        )

    @staticmethod
    def _cleanup(cgroups: dict[str, str], workdir: str, launcher: int | None = None) -> tuple[int, str | None]:
        """Reap what of the run was reparented to this process, read the OOM-kill count, remove the cgroups and the
        working directory; never raises. Returns (oom kills, what could not be removed)."""
        oom_kills = 0
        try:
            if launcher is not None:
                _reap_strays(launcher)
            if cgroups:
                oom_kills = _Cgroups.oom_kills(cgroups)
                _Cgroups.destroy(list(cgroups.values()))
        except Exception as e:  # noqa: BLE001
            logger.warning("sandbox cgroup cleanup failed: %s", e)
        leftover = remove_tree(workdir)
        if leftover:
            logger.warning("sandbox working directory not fully removed: %s", leftover)
        return oom_kills, leftover

    async def _stop(
        self, proc: asyncio.subprocess.Process, status: _StatusPipe | None, cgroups: list[str], grace_s: float
    ) -> None:
        """Stop a run: SIGTERM init (a child subreaper: it SIGKILLs every descendant, even ones that left the
        process group, then exits, which also empties its pid namespace), or the launcher while init's pid is not
        known (it passes the signal on, or exits if init does not exist yet); the launcher reaps init and exits.
        After ``grace_s`` SIGKILL init, the process group and whatever is left in the run's cgroups. Returns once the
        launcher is reaped (or after a bounded wait)."""
        if proc.returncode is None:  # an unreaped launcher keeps its pid, and its unreaped init keeps init's
            try:
                os.kill(_init_pid(status) or proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
            if await _reaped(proc, grace_s):
                return
        self._kill(proc, cgroups, _init_pid(status))
        await _reaped(proc, 5.0)

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process, cgroups: list[str], init_pid: int | None = None) -> None:
        """SIGKILL init (its pid namespace dies with it), the launcher's process group, then anything left in the
        run's cgroups."""
        if proc.returncode is None:  # once reaped, its pid (= the group id) may belong to someone else
            for kill, pid in ((os.kill, init_pid), (os.killpg, proc.pid)):
                try:
                    if pid:
                        kill(pid, signal.SIGKILL)
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


def _init_pid(status: _StatusPipe | None) -> int | None:
    """Init's pid, once the launcher has reported it."""
    return next((r["init_pid"] for r in status.read() if r.get("stage") == "launch"), None) if status else None


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
