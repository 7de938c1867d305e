"""Launcher of ``LocalSandbox`` (stdlib only; run as ``python -I -S _sandbox_launcher.py CONFIG_JSON``).

Process tree (``LocalSandbox`` starts the launcher in a new session, so all three share one process group):

    launcher (host namespaces): joins the sandbox cgroups, unshares net/pid/ipc/uts namespaces, forks
      -> init (pid 1 of the new pid namespace, trusted, child subreaper): forks the user process, reaps every
         child, reports the user process's wait status on the status pipe, kills every remaining descendant (on
         the program's exit or on SIGTERM from LocalSandbox) and exits; inside a pid namespace the kernel also
         kills whatever is left when init exits
           -> user process: rlimits, drops root (setuid or capabilities), no_new_privs, Landlock, then execs Python

Reports go to ``status_fd`` as JSON lines (``{"stage": "launch", "init_pid"}`` from the launcher,
``{"stage": "setup", ...}`` from the user process before exec,
``{"stage": "exit", "status": wait_status}`` from init). Nothing is written to stdout/stderr except by user code.
"""

import ctypes
import json
import os
import resource
import signal
import struct
import sys
import time

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT = 38, 24, 28, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
PR_SET_CHILD_SUBREAPER = 36
# SECBIT_NOROOT | _LOCKED | NO_SETUID_FIXUP | _LOCKED | KEEP_CAPS_LOCKED | NO_CAP_AMBIENT_RAISE | _LOCKED
SECUREBITS_LOCKDOWN = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_TRUNCATE, FS_IOCTL_DEV = 1 << 14, 1 << 15
FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _check(ret, what):
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def landlock_abi():
    ret = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return int(ret) if ret > 0 else 0


def apply_landlock(read_paths, write_paths, deny_tcp, scope):
    """Restrict this process (and what it execs/forks) to reading ``read_paths`` and writing ``write_paths``; deny
    TCP bind/connect (ABI >= 4) and scope abstract unix sockets and signals to the sandbox (ABI >= 6)."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError("Landlock is not available on this kernel")
    fs_all = (1 << 13) - 1  # ABI 1: EXECUTE .. MAKE_SYM
    if abi >= 2:
        fs_all |= 1 << 13  # REFER
    if abi >= 3:
        fs_all |= FS_TRUNCATE
    if abi >= 5:
        fs_all |= FS_IOCTL_DEV
    net = (NET_BIND_TCP | NET_CONNECT_TCP) if (deny_tcp and abi >= 4) else 0
    scoped = (SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL) if (scope and abi >= 6) else 0
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    attr = ctypes.create_string_buffer(struct.pack("=QQQ", fs_all, net, scoped)[:size], size)
    ruleset = _check(libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(size), ctypes.c_uint32(0)),
                     "landlock_create_ruleset")
    read_rights = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
    rules = [(p, read_rights) for p in read_paths] + [(p, fs_all) for p in write_paths]
    granted = []
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if not os.path.isdir(path):
                rights &= FS_FILE_RIGHTS
            rights &= fs_all
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)
            _check(libc.syscall(SYS_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                                rule, ctypes.c_uint32(0)), f"landlock_add_rule({path})")
            granted.append(path)
        finally:
            os.close(fd)
    _check(libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self")
    os.close(ruleset)
    return {"abi": abi, "tcp_denied": bool(net), "scoped": bool(scoped), "paths": granted}


# seccomp: refuse socket(AF_UNIX, ...) (Landlock does not cover connect() on pathname unix sockets, e.g. a docker
# socket) and io_uring (its socket/connect ops bypass syscall filters); refuse every syscall of a foreign ABI.
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x06
AF_UNIX, EPERM, EACCES = 1, 1, 13
_SECCOMP_ARCH = {  # machine: (AUDIT_ARCH_*, __NR_socket, __NR_io_uring_setup)
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
}


def apply_seccomp():
    """Install the filter described above; returns a description, or None where the architecture is unknown."""
    arch = _SECCOMP_ARCH.get(os.uname().machine)
    if arch is None:
        return None
    audit_arch, nr_socket, nr_io_uring_setup = arch

    def ins(code, jt, jf, k):
        return struct.pack("=HBBI", code, jt, jf, k)

    program = [
        ins(BPF_LD_W_ABS, 0, 0, 4),                               # 0: A = arch
        ins(BPF_JEQ_K, 1, 0, audit_arch),                         # 1: native ABI? -> 3
        ins(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM),          # 2: foreign ABI: refuse
        ins(BPF_LD_W_ABS, 0, 0, 0),                               # 3: A = syscall number
        ins(BPF_JGE_K, 0, 1, 0x40000000),                         # 4: x32 ABI bit set? -> 5, else 6
        ins(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM),          # 5: refuse
        ins(BPF_JEQ_K, 0, 1, nr_io_uring_setup),                  # 6: io_uring_setup? -> 7, else 8
        ins(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EPERM),          # 7: refuse
        ins(BPF_JEQ_K, 0, 3, nr_socket),                          # 8: socket? -> 9, else 12
        ins(BPF_LD_W_ABS, 0, 0, 16),                              # 9: A = low 32 bits of args[0] (domain)
        ins(BPF_JEQ_K, 0, 1, AF_UNIX),                            # 10: AF_UNIX? -> 11, else 12
        ins(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EACCES),         # 11: refuse
        ins(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),                  # 12: allow
    ]
    filters = ctypes.create_string_buffer(b"".join(program))
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(filters))
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.create_string_buffer(fprog, 16), 0, 0),
           "prctl(PR_SET_SECCOMP)")
    return "no AF_UNIX sockets, no io_uring, native ABI only"


def drop_capabilities():
    """Stay uid 0 but hold no capability, now or after exec (securebits NOROOT, empty bounding set)."""
    _check(libc.prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKDOWN, 0, 0, 0), "prctl(PR_SET_SECUREBITS)")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = ctypes.create_string_buffer(24)  # two zeroed {effective, permitted, inheritable}
    _check(libc.capset(ctypes.create_string_buffer(header, 8), data), "capset")


def count_user_tasks(uid):
    """Tasks (threads included: RLIMIT_NPROC counts them) that ``uid`` runs now."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue
        uid_line = threads = None
        for line in status.splitlines():
            if line.startswith("Uid:"):
                uid_line = line.split()[1]
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
        if uid_line == str(uid):
            total += threads or 1
    return total


def user_process(cfg, status_fd, report):
    """Runs in the forked user process: apply the limits, then exec Python on the user's program."""
    try:
        limits = cfg["rlimits"]
        setrl = resource.setrlimit
        setrl(resource.RLIMIT_CORE, (0, 0))
        setrl(resource.RLIMIT_CPU, (limits["cpu"], limits["cpu"] + 1))
        setrl(resource.RLIMIT_AS, (limits["as"], limits["as"]))
        setrl(resource.RLIMIT_FSIZE, (limits["fsize"], limits["fsize"]))
        setrl(resource.RLIMIT_NOFILE, (limits["nofile"], limits["nofile"]))
        uid = cfg.get("uid")
        is_root = os.geteuid() == 0
        # RLIMIT_NPROC counts the tasks of the real uid: in a fresh user namespace only the ones inside it (init and
        # the program); otherwise every task of this user (counted by the launcher before it forked, + init)
        nproc = limits["nproc"] + (1 if report.get("userns") else report.get("tasks_before", 0) + 1)
        setrl(resource.RLIMIT_NPROC, (nproc, nproc))
        report["nproc_limit"] = nproc
        if is_root and uid is not None:
            os.chown(cfg["workdir"], uid, uid)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            report["privileges"] = f"uid {uid}"
        elif is_root:
            drop_capabilities()
            report["privileges"] = "uid 0, no capabilities"
        else:
            report["privileges"] = f"uid {os.getuid()} (unprivileged)"
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        report["landlock"] = None
        if cfg["landlock"]:
            try:
                report["landlock"] = apply_landlock(cfg["read_paths"], [cfg["workdir"]] + cfg["write_paths"],
                                                    deny_tcp=True, scope=True)
            except OSError as e:
                report["landlock_error"] = str(e)
        try:
            report["seccomp"] = apply_seccomp()
        except OSError as e:
            report["seccomp"] = None
            report["seccomp_error"] = str(e)
        cgroups = report.get("cgroups") or []
        if "pids" in cgroups or "unified" in cgroups:
            report["process_limit"] = "pids-cgroup"
        elif not is_root or uid is not None:
            report["process_limit"] = "rlimit-nproc"
        else:
            report["process_limit"] = None  # root ignores RLIMIT_NPROC: only the pid namespace and timeouts bound it
        report["memory_limit"] = "cgroup+rlimit-as" if ("memory" in cgroups or "unified" in cgroups) else "rlimit-as"
        argv = list(cfg["argv"])
        network_isolated = report.get("netns") or (report.get("landlock") or {}).get("tcp_denied")
        if not network_isolated:
            # last resort: a Python-level guard (bypassable through ctypes; reported as such)
            argv = argv[:-1] + ["-c", cfg["guard"] % {"path": argv[-1]}]
            report["network"] = "python-guard"
        else:
            report["network"] = "netns" if report.get("netns") else "landlock-tcp"
        if cfg.get("require_isolation"):
            missing = [name for name, ok in (("network", report["network"] != "python-guard"),
                                             ("filesystem", report["landlock"] is not None),
                                             ("unix socket", report.get("seccomp") is not None),
                                             ("process limit", report["process_limit"] is not None)) if not ok]
            if missing:
                raise OSError(f"require_isolation: no {', '.join(missing)} isolation in place")
        os.write(status_fd, (json.dumps({"stage": "setup", **report}) + "\n").encode())
        os.close(status_fd)
        os.chdir(cfg["workdir"])
        os.execve(cfg["python"], argv, cfg["env"])
    except BaseException as e:  # noqa: BLE001 - report and exit, never run user code half-isolated
        try:
            os.write(status_fd, (json.dumps({"stage": "error", "error": f"{type(e).__name__}: {e}"}) + "\n").encode())
        except OSError:
            pass
        os._exit(126)


def main():
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    report = {}
    report["cgroups"] = []
    for controller, procs in cfg["cgroup_procs"].items():
        try:
            _write(procs, str(os.getpid()))
            report["cgroups"].append(controller)
        except OSError as e:
            report.setdefault("cgroup_errors", []).append(f"{procs}: {e}")
    if os.geteuid() != 0:
        report["tasks_before"] = count_user_tasks(os.getuid())
    ns_flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    report["netns"] = report["pidns"] = False
    if not cfg.get("namespaces", True):
        pass
    elif libc.unshare(ns_flags) == 0:
        report["netns"] = report["pidns"] = True
        report["userns"] = False
    elif os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(ns_flags | CLONE_NEWUSER) == 0:
            report["netns"] = report["pidns"] = report["userns"] = True
            try:  # map our own ids so files keep their owner
                _write("/proc/self/setgroups", "deny")
                _write("/proc/self/uid_map", f"{uid} {uid} 1")
                _write("/proc/self/gid_map", f"{gid} {gid} 1")
            except OSError:
                pass
    init_pid = os.fork()
    if init_pid:  # launcher: tell the parent who init is (it signals init to stop a run), wait, mirror its exit
        os.write(status_fd, (json.dumps({"stage": "launch", "init_pid": init_pid}) + "\n").encode())
        os.close(status_fd)
        _, status = os.waitpid(init_pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 125)
    run_init(cfg, status_fd, report)


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop()


def _children():
    """Pids of this process's children (/proc/self/task/*/children, else a /proc scan)."""
    try:
        pids = []
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        return pids
    except OSError:
        me, pids = os.getpid(), []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                            pids.append(int(entry))
                except (OSError, ValueError, IndexError):
                    pass
        return pids


def _kill_descendants():
    """SIGKILL every descendant: as a child subreaper, orphans (even ones that called setsid) become our children,
    so killing children round after round reaches the whole tree (the process limit bounds a racing fork bomb)."""
    for _ in range(1000):
        children = _children()
        if not children:
            break
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(deadline=time.monotonic() + 1.0, expected=len(children))
    _reap(deadline=time.monotonic(), expected=0)


def _reap(deadline, expected):
    """Reap zombies without blocking forever: until ``expected`` were reaped or ``deadline`` passed."""
    reaped = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            reaped += 1
            continue
        if reaped >= expected or time.monotonic() > deadline:
            return
        time.sleep(0.001)


def run_init(cfg, status_fd, report):
    """Init: start the user process, reap children, report its status; on exit or SIGTERM kill all descendants
    (inside a pid namespace the kernel would do it when init exits; without one, the subreaper loop does)."""
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    signal.signal(signal.SIGTERM, _raise_stop)
    user_pid = os.fork()
    if user_pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        user_process(cfg, status_fd, report)
    user_status = None
    try:
        while True:  # reap every child until the program itself exits
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid == user_pid:
                user_status = status
                break
    except _Stop:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if not report.get("pidns"):
        # inside a pid namespace the kernel kills everything when init exits (and /proc shows host pids there)
        _kill_descendants()
    os.write(status_fd, (json.dumps({"stage": "exit", "status": user_status}) + "\n").encode())
    os._exit(0)

if __name__ == "__main__":
    main()
