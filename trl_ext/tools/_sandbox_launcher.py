"""Launcher of ``LocalSandbox`` (stdlib only; run as ``python -I -S _sandbox_launcher.py CONFIG_JSON``, or with
``--probe`` to print what this machine allows as one JSON line).

Process tree (``LocalSandbox`` starts the launcher in a new session, so all three share one process group):

    launcher (host namespaces): joins the sandbox cgroups, unshares mount/net/pid/ipc/uts namespaces (plus a user
      namespace when not root), builds the program's view of the filesystem (every mount read-only, a size-limited
      tmpfs as the working directory, the interpreter made reachable for the sandbox uid), forks
      -> init (pid 1 of the new pid namespace, trusted, child subreaper): forks the user process, reaps every
         child, reports the user process's wait status and the working directory's usage on the status pipe, kills
         every remaining descendant (on the program's exit or on SIGTERM from LocalSandbox) and exits; inside a pid
         namespace the kernel also kills whatever is left when init exits
           -> user process: rlimits, switches to the sandbox uid (never runs as uid 0), no_new_privs, Landlock,
              seccomp, then execs Python

The mount namespace dies with its last process, and its tmpfs with it: nothing the program wrote reaches the host
disk. To stop a run, ``LocalSandbox`` sends SIGTERM to init, or to the launcher while init's pid is not known yet: the
launcher passes it on to init, or exits when init does not exist yet (SIGTERM is blocked across the fork, so init
never goes unnoticed). Either way the launcher reaps init before it exits, so no process of the run is orphaned
(short of a SIGKILL, the fallback when init does not exit in time). Reports go to ``status_fd`` as JSON lines (``{"stage": "launch", "init_pid"}`` from the launcher,
``{"stage": "setup", ...}`` from the user process before exec, ``{"stage": "exit", "status": wait_status, "disk"}``
from init, ``{"stage": "error", "error"}`` when the sandbox could not be built: the program then never runs).
Nothing is written to stdout/stderr except by user code.
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


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _mount(source, target, fstype, flags, data=None):
    enc = lambda v: None if v is None else v.encode()  # noqa: E731
    _check(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount({source} -> {target})")


def _readonly_tree(path):
    """Make every mount at and below ``path`` read-only (mount_setattr, Linux >= 5.12). A read-only mount refuses
    chmod, chown, utime, xattr, link, rename, create and delete whoever the caller is: Landlock has no right for
    metadata, and a program owning a file could otherwise change it."""
    attr = struct.pack("=QQQQ", MOUNT_ATTR_RDONLY, 0, 0, 0)
    _check(
        libc.syscall(
            SYS_MOUNT_SETATTR,
            ctypes.c_int(AT_FDCWD),
            path.encode(),
            ctypes.c_uint(AT_RECURSIVE),
            ctypes.create_string_buffer(attr, 32),
            ctypes.c_size_t(32),
        ),
        f"mount_setattr({path}, RDONLY)",
    )


def _expose(blocker, paths):
    """Make ``paths`` (below ``blocker``, a folder the sandbox uid cannot traverse, e.g. a 0700 ``/root`` holding a
    pyenv interpreter) reachable: a small tmpfs hides ``blocker``'s contents, the folders leading to each path are
    recreated in it (mode 0755) and each path is bind-mounted back. Only these paths appear; the rest of
    ``blocker`` is invisible to the program. (Mount-namespace-private; read-only with the rest of the tree.)"""
    fds = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in paths]  # before the tmpfs hides them
    try:
        _mount("tmpfs", blocker, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
        for path, fd in zip(paths, fds):
            parent = os.path.dirname(path)
            os.makedirs(parent, mode=0o755, exist_ok=True)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    finally:
        for fd in fds:
            os.close(fd)


DEVICES = ("null", "zero", "random", "urandom")


def _minimal_dev():
    """Replace /dev by a tmpfs holding only null, zero, random and urandom, bind-mounted from the host: GPUs,
    /dev/shm, /dev/fuse, ptys and every other device node are out of reach even where Landlock is missing (a
    read-only mount does not stop writes to a device)."""
    fds = {}
    for name in DEVICES:
        try:
            fds[name] = os.open(f"/dev/{name}", os.O_PATH | os.O_CLOEXEC)
        except OSError:
            pass
    try:
        _mount("tmpfs", "/dev", "tmpfs", MS_NOSUID, "size=64k,nr_inodes=64,mode=0755")
        for name, fd in fds.items():
            os.close(os.open(f"/dev/{name}", os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o666))
            _mount(f"/proc/self/fd/{fd}", f"/dev/{name}", None, MS_BIND)
    finally:
        for fd in fds.values():
            os.close(fd)


def mount_own_proc(report):
    """In init (pid 1 of the new pid namespace): a procfs of that namespace over /proc, so even without Landlock the
    program sees only its own processes, not the host's command lines. Not fatal: Landlock hides /proc anyway, and
    some containers forbid a second procfs."""
    try:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
        report["proc"] = "own pid namespace"
    except OSError as e:
        report["proc"] = f"host's (could not mount a new one: {e})"


def build_filesystem(cfg, code):
    """In the fresh mount namespace: stop propagation to the host, expose the interpreter where needed, keep only a
    few devices, make every mount read-only, then mount the size-limited, writable tmpfs working directory holding
    ``main.py``."""
    mnt = cfg["mount"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates back to the host
    for blocker, paths in mnt.get("expose", []):
        _expose(blocker, paths)
    _minimal_dev()
    _readonly_tree("/")
    uid = cfg["uid"] if cfg["uid"] is not None else os.getuid()
    gid = cfg["gid"] if cfg["gid"] is not None else os.getgid()
    _mount(
        "tmpfs",
        cfg["workdir"],
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={mnt['size']},nr_inodes={mnt['inodes']},mode=0700,uid={uid},gid={gid}",
    )
    main = os.path.join(cfg["workdir"], "main.py")
    fd = os.open(main, os.O_CREAT | os.O_WRONLY | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, code)
        os.fchown(fd, uid, gid)
    finally:
        os.close(fd)


def landlock_abi():
    ret = libc.syscall(
        SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION)
    )
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
    ruleset = _check(
        libc.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(size), ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )
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
            _check(
                libc.syscall(
                    SYS_LANDLOCK_ADD_RULE,
                    ctypes.c_int(ruleset),
                    ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                    rule,
                    ctypes.c_uint32(0),
                ),
                f"landlock_add_rule({path})",
            )
            granted.append(path)
        finally:
            os.close(fd)
    _check(
        libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self"
    )
    os.close(ruleset)
    return {"abi": abi, "tcp_denied": bool(net), "scoped": bool(scoped), "paths": granted}


# seccomp: socket families by allow-list, every other family refused with EACCES (told apart from the kernel's
# EAFNOSUPPORT / EPERM). socket() is refused for every family: AF_UNIX because Landlock does not cover connect() on
# pathname unix sockets (e.g. a docker socket), and the IP families because this sandbox has no network (its own
# network namespace, or Landlock's TCP denial, which leaves UDP open); a sandbox with network access would allow
# AF_INET and AF_INET6 here. socketpair() is allowed for AF_UNIX only (nothing outside to reach; asyncio and
# multiprocessing use unix pairs). Refuse io_uring (its socket/connect ops bypass syscall filters); refuse new namespaces
# (clone/unshare with CLONE_NEW*, setns: an unprivileged user namespace would hand the program CAP_SYS_ADMIN over fresh
# namespaces, the entry point of many kernel exploits), bpf, perf_event_open, userfaultfd and the kernel keyring (kernel
# attack surface a Python program does not need; Docker's default profile refuses them too); clone3 answers ENOSYS (its
# flags sit in memory a filter cannot read; glibc then falls back to clone, whose flags are checked); refuse every
# syscall of a foreign ABI.
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JSET_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
AF_UNIX = 1
EPERM, EACCES, ENOSYS = 1, 13, 38
_SOCKET_ALLOWED: tuple[int, ...] = ()  # families socket() may create (see above)
_SOCKETPAIR_ALLOWED = (AF_UNIX,)
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
_SECCOMP_ARCH = {  # machine: AUDIT_ARCH_*, then syscall numbers
    "x86_64": dict(
        arch=0xC000003E,
        socket=41,
        socketpair=53,
        clone=56,
        clone3=435,
        unshare=272,
        setns=308,
        bpf=321,
        perf_event_open=298,
        userfaultfd=323,
        keyctl=250,
        add_key=248,
        request_key=249,
        io_uring_setup=425,
        io_uring_enter=426,
        io_uring_register=427,
    ),
    "aarch64": dict(
        arch=0xC00000B7,
        socket=198,
        socketpair=199,
        clone=220,
        clone3=435,
        unshare=97,
        setns=268,
        bpf=280,
        perf_event_open=241,
        userfaultfd=282,
        keyctl=219,
        add_key=217,
        request_key=218,
        io_uring_setup=425,
        io_uring_enter=426,
        io_uring_register=427,
    ),
}
_SECCOMP_DENIED = (
    "unshare",
    "setns",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "keyctl",
    "add_key",
    "request_key",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
)


def apply_seccomp():
    """Install the filter described above; returns a description, or None where the architecture is unknown."""
    nr = _SECCOMP_ARCH.get(os.uname().machine)
    if nr is None:
        return None

    def ins(code, jt, jf, k):
        return struct.pack("=HBBI", code, jt, jf, k)

    deny = SECCOMP_RET_ERRNO | EPERM
    program = [
        ins(BPF_LD_W_ABS, 0, 0, 4),  # A = arch
        ins(BPF_JEQ_K, 1, 0, nr["arch"]),  # native ABI? skip the refusal
        ins(BPF_RET_K, 0, 0, deny),  # foreign ABI: refuse
        ins(BPF_LD_W_ABS, 0, 0, 0),  # A = syscall number
        ins(BPF_JGE_K, 0, 1, 0x40000000),  # x32 ABI bit set?
        ins(BPF_RET_K, 0, 0, deny),  #   refuse
        ins(BPF_JEQ_K, 0, 1, nr["clone3"]),  # clone3?
        ins(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | ENOSYS),  #   "not implemented": glibc falls back to clone
    ]
    for name in _SECCOMP_DENIED:
        program += [ins(BPF_JEQ_K, 0, 1, nr[name]), ins(BPF_RET_K, 0, 0, deny)]
    for name, families in (("socket", _SOCKET_ALLOWED), ("socketpair", _SOCKETPAIR_ALLOWED)):
        checks = [ins(BPF_LD_W_ABS, 0, 0, 16)]  # A = low 32 bits of args[0] (domain)
        for i, family in enumerate(families):
            checks.append(ins(BPF_JEQ_K, len(families) - i, 0, family))  # listed family? to the allow
        checks += [ins(BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | EACCES), ins(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW)]
        program += [ins(BPF_JEQ_K, 0, len(checks), nr[name])] + checks  # this syscall? else past its checks
    program += [
        ins(BPF_JEQ_K, 0, 4, nr["clone"]),  # clone? else allow
        ins(BPF_LD_W_ABS, 0, 0, 16),  #   A = low 32 bits of args[0] (flags)
        ins(BPF_JSET_K, 0, 1, CLONE_NEW_ANY),  #   any CLONE_NEW* flag?
        ins(BPF_RET_K, 0, 0, deny),  #     refuse
        ins(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),  #     plain fork / thread: allow
        ins(BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),  # everything else: allow
    ]
    filters = ctypes.create_string_buffer(b"".join(program))
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(filters))
    _check(
        libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.create_string_buffer(fprog, 16), 0, 0),
        "prctl(PR_SET_SECCOMP)",
    )
    return (
        "no socket() of any family and socketpair() of AF_UNIX only, no io_uring, new namespaces, bpf, perf events,"
        " userfaultfd or keyrings; native ABI only"
    )


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
        uid, gid = cfg.get("uid"), cfg.get("gid")
        is_root = os.geteuid() == 0
        # RLIMIT_NPROC counts the tasks of the real uid: in a fresh user namespace only the ones inside it (init and
        # the program); otherwise every task of this user (counted by the launcher before it forked, + init)
        nproc = limits["nproc"] + (1 if report.get("userns") else report.get("tasks_before", 0) + 1)
        setrl(resource.RLIMIT_NPROC, (nproc, nproc))
        report["nproc_limit"] = nproc
        if is_root:
            # uid 0 keeps owning root's files (chmod, utime and xattrs need no capability then): never run it as root
            if uid is None or uid == 0 or gid is None or gid == 0:
                raise OSError("refusing to run the program as uid/gid 0: no unprivileged sandbox uid was configured")
            for cap in range(64):
                if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                    break  # EINVAL past the last capability
            libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)  # clears the permitted and effective capabilities too
            report["privileges"] = f"uid {uid}"
        elif report.get("userns"):
            drop_capabilities()  # the ones the fresh user namespace granted
            report["privileges"] = f"uid {os.getuid()} (unprivileged, in a user namespace, no capabilities)"
        else:
            report["privileges"] = f"uid {os.getuid()} (unprivileged)"
        if 0 in os.getresuid() or 0 in os.getresgid():  # belt and braces: nothing below runs as root
            raise OSError(f"refusing to run the program with uids {os.getresuid()} / gids {os.getresgid()}")
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        report["landlock"] = None
        if cfg["landlock"]:
            try:
                report["landlock"] = apply_landlock(
                    cfg["read_paths"], [cfg["workdir"]] + cfg["write_paths"], deny_tcp=True, scope=True
                )
            except OSError as e:
                report["landlock_error"] = str(e)
        try:
            report["seccomp"] = apply_seccomp()
        except OSError as e:
            report["seccomp"] = None
            report["seccomp_error"] = str(e)
        cgroups = report.get("cgroups") or []
        report["process_limit"] = "pids-cgroup" if ("pids" in cgroups or "unified" in cgroups) else "rlimit-nproc"
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
            missing = [
                name
                for name, ok in (
                    ("network", report["network"] != "python-guard"),
                    ("filesystem", report["landlock"] is not None),
                    ("socket family", report.get("seccomp") is not None),
                    ("process limit", report["process_limit"] is not None),
                    ("disk quota", report.get("disk_quota") is not None),
                )
                if not ok
            ]
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


def _fatal(status_fd, message):
    """The sandbox could not be built as configured: report it and exit; the program never runs."""
    try:
        os.write(status_fd, (json.dumps({"stage": "error", "error": message}) + "\n").encode())
    except OSError:
        pass
    os._exit(126)


def enter_namespaces(want_mount, report):
    """Unshare mount (when asked), network, pid, IPC and UTS namespaces; without root, inside a fresh user namespace
    mapping only our own uid/gid (files keep their owner). Returns whether the mount namespace was created."""
    flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (CLONE_NEWNS if want_mount else 0)
    report["netns"] = report["pidns"] = report["userns"] = False
    if libc.unshare(flags) == 0:
        report["netns"] = report["pidns"] = True
        return want_mount
    if os.geteuid() == 0:
        report["namespace_error"] = os.strerror(ctypes.get_errno())
        return False
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(flags | CLONE_NEWUSER) != 0:
        report["namespace_error"] = os.strerror(ctypes.get_errno())
        return False
    report["netns"] = report["pidns"] = report["userns"] = True
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1")
        _write("/proc/self/gid_map", f"{gid} {gid} 1")
    except OSError as e:
        report["namespace_error"] = f"uid/gid map: {e}"
        return False
    return want_mount


def probe():
    """Print (one JSON line) what this machine allows: the namespaces, a tmpfs and read-only remounts in a private
    mount namespace, and the Landlock ABI. The trial runs in a child process; nothing of it outlives the child."""
    import tempfile

    out = {"euid": os.geteuid(), "landlock_abi": landlock_abi(), "mount": False}
    target = tempfile.mkdtemp(prefix="hf_gptoss_rl_probe_")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child = {}
        try:
            report = {}
            if enter_namespaces(True, report):
                try:
                    _mount(None, "/", None, MS_REC | MS_PRIVATE)
                    _readonly_tree("/")
                    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=16,mode=0700")
                    child["mount"] = True
                except OSError as e:
                    child["mount_error"] = str(e)
            else:
                child["mount_error"] = f"cannot create a mount namespace: {report.get('namespace_error')}"
            child.update({k: report[k] for k in ("netns", "userns") if k in report})
        except BaseException as e:  # noqa: BLE001
            child["mount_error"] = f"{type(e).__name__}: {e}"
        os.write(w, json.dumps(child).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    os.rmdir(target)
    try:
        out.update(json.loads(data))
    except ValueError:
        out["mount_error"] = "the probe process died"
    print(json.dumps(out), flush=True)


def main():
    if sys.argv[1:] == ["--probe"]:
        return probe()
    signal.signal(signal.SIGTERM, _on_stop_request)
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
    want_mount = bool(cfg.get("mount"))
    code = None
    if want_mount:  # read the program before the tmpfs covers the folder it was written to
        with open(os.path.join(cfg["workdir"], "main.py"), "rb") as f:
            code = f.read()
    report["mntns"] = report["netns"] = report["pidns"] = report["userns"] = False
    if cfg.get("namespaces", True):
        report["mntns"] = enter_namespaces(want_mount, report)
    if want_mount:
        if not report["mntns"]:
            _fatal(status_fd, f"could not create the sandbox's mount namespace: {report.get('namespace_error')}")
        try:
            build_filesystem(cfg, code)
        except OSError as e:
            _fatal(status_fd, f"could not build the sandbox's filesystem: {e}")
        report["filesystem"] = "read-only mounts, tmpfs workdir"
        report["disk_quota"] = cfg["mount"]["size"]
    global _init_pid
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # a stop request waits until init's pid is known
    init_pid = os.fork()
    if init_pid:  # launcher: tell the parent who init is (it signals init to stop a run), wait, mirror its exit
        _init_pid = init_pid
        os.write(status_fd, (json.dumps({"stage": "launch", "init_pid": init_pid}) + "\n").encode())
        os.close(status_fd)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _, status = os.waitpid(init_pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 125)
    run_init(cfg, status_fd, report)


_init_pid = None


def _on_stop_request(signum, frame):
    """SIGTERM to the launcher: pass it on to init, which stops the program and exits (the launcher then reaps it
    and exits too); before init exists nothing of the run is running yet, so just exit."""
    if _init_pid is None:
        os._exit(128 + signal.SIGTERM)
    os.kill(_init_pid, signal.SIGTERM)


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second request must not break into the shutdown
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
    if report.get("mntns") and report.get("pidns"):
        mount_own_proc(report)
    signal.signal(signal.SIGTERM, _raise_stop)  # still blocked (since the launcher's fork) until inside the try
    user_pid = os.fork()
    if user_pid == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # exec keeps the mask: don't pass it on
        user_process(cfg, status_fd, report)
    user_status = None
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a stop request that came meanwhile lands here
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
    disk = None
    if report.get("disk_quota"):
        try:  # the tmpfs is only visible in this mount namespace: measure it before it goes
            st = os.statvfs(cfg["workdir"])
            disk = {
                "used": (st.f_blocks - st.f_bfree) * st.f_frsize,
                "size": st.f_blocks * st.f_frsize,
                "files_left": st.f_ffree,
                "full": st.f_bavail * st.f_frsize < 65536 or st.f_favail == 0,
            }
        except OSError:
            pass
    os.write(status_fd, (json.dumps({"stage": "exit", "status": user_status, "disk": disk}) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main()
