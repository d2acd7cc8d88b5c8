"""Runs one untrusted program in a sandbox: `python -I -S -B launcher.py` (standard library only).

Started by `gspo_megatron.sandbox.executor.Sandbox`, never imported by the trainer. Protocol:
stdin carries one request (then EOF, marshal format: the executor is trusted); the fd it names
(`status_fd`) receives one JSON
status line; the program's
stdout and stderr are the launcher's own (pipes the executor reads with a size cap).

With `namespaces` (the default where the kernel allows it) the process tree is

    launcher      unshare(mount, pid, net, ipc, uts [+ user when not root])
      init        PID 1 of the new pid namespace: builds the root, drops privileges, seccomp
        program   rlimits, an empty environment, only fds 0-2, exec of the language's command

init builds a new root on a tmpfs that hides the host: read-only bind mounts of /usr and the
interpreter's prefix, a fresh /proc, four device nodes, /code (the program and its input,
read-only) and /sandbox (a size-limited tmpfs owned by the sandbox uid: the only writable
place). It pivots into that root, detaches the host's, then becomes an unprivileged uid (no
capabilities, no_new_privs) and loads the seccomp filter before forking the program. When the
program exits, init reports and exits; the kernel then kills every process left in the pid
namespace. If the launcher dies (the executor's wall-clock kill), init gets SIGKILL
(PR_SET_PDEATHSIG) and the namespace dies with it.

Without namespaces (`"namespaces": false`) the program runs in a host directory with the same
rlimits, uid and seccomp filter; docs/SANDBOX.md says what that mode does not stop.
"""

# Only modules that load fast (no json, signal or platform: they pull in re and enum and
# would double the launcher's start-up, paid once per program run).
import _json
import _signal
import ctypes
import errno
import marshal
import os
import resource
import select
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
ST_NOATIME, ST_NODIRATIME, ST_RELATIME = 1024, 2048, 4096
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "random", "urandom")
SETUP_FAILED = 125
PR_CAPBSET_DROP, PR_SET_SECUREBITS = 24, 28
SECBITS_LOCKED_NOROOT = 0x2F  # NOROOT, NO_SETUID_FIXUP and KEEP_CAPS off, each locked

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The sandbox could not be built; the program never ran."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def mount(source, target, fstype, flags, data=None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    ret = libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(ret, f"mount {source or ''} on {target}")


def to_json(value) -> str:
    """JSON of the status's values (str, int, float, None, lists of them)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return _json.encode_basestring_ascii(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(to_json(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{to_json(str(k))}:{to_json(v)}" for k, v in value.items())
        return "{" + ",".join(items) + "}"
    return repr(value)


def report(fd: int, status: dict) -> None:
    try:  # noqa: SIM105 - contextlib would cost start-up time
        os.write(fd, (to_json(status) + "\n").encode())
    except OSError:
        pass


# --------------------------------------------------------------------------- the new root


def _locked_flags(path: str) -> int:
    """The atime/nosuid/nodev/noexec flags of the mount holding `path`: a remount inside a
    user namespace must keep them (the kernel locks them)."""
    f = os.statvfs(path).f_flag
    out = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC)
    out |= MS_NOATIME if f & ST_NOATIME else 0
    out |= MS_NODIRATIME if f & ST_NODIRATIME else 0
    out |= MS_RELATIME if f & ST_RELATIME else 0
    return out


def bind_readonly(host_path: str, root: str) -> None:
    """Bind `host_path` at the same place under `root`, read-only (symlinks are recreated)."""
    target = root + host_path
    if os.path.islink(host_path):
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(host_path), target)
        return
    if not os.path.exists(host_path):
        return
    if os.path.isdir(host_path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        open(target, "a").close()
    mount(host_path, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(host_path)
    mount(None, target, None, flags)


def build_root(req: dict, uid: int, gid: int) -> None:
    """Make a private tmpfs root holding only what the program may see, and pivot into it."""
    limits = req["limits"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    root = "/tmp"  # any directory serves as the mount point; the host's /tmp is not touched
    size = 1 << 20
    size += sum(len(v.encode()) for v in req["files"].values()) + len(req["stdin"].encode())
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0755")
    for path in req["ro_paths"]:
        bind_readonly(path, root)
    os.makedirs(root + "/dev", mode=0o755)
    for name in DEVICES:
        node = f"{root}/dev/{name}"
        open(node, "a").close()
        mount(f"/dev/{name}", node, None, MS_BIND)
    os.makedirs(root + "/proc", mode=0o555)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(root + "/sandbox", mode=0o700)
    tmpfs = (
        f"size={limits['disk_bytes']},nr_inodes={limits['inodes']},mode=0700,uid={uid},gid={gid}"
    )
    mount("tmpfs", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    os.symlink("/sandbox", root + "/tmp")
    os.makedirs(root + "/code", mode=0o755)
    for name, text in req["files"].items():
        _write_readonly(f"{root}/code/{name}", text)
    _write_readonly(f"{root}/code/input", req["stdin"])
    os.chmod(root + "/code", 0o555)
    os.makedirs(root + "/.old", mode=0o700)
    nr = PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    os.chdir(root)
    _check(libc.syscall(nr, b".", b".old"), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount the host's root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _write_readonly(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


# --------------------------------------------------------------------------- identity


def map_user_namespace(outer_uid: int, outer_gid: int) -> None:
    """Inside a fresh user namespace (not root outside): uid/gid 0 map to our own ids."""
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"0 {outer_uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"0 {outer_gid} 1")


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


def drop_privileges(uid: int | None, gid: int | None) -> None:
    """Become `uid`/`gid` (root outside: an unused uid per executor slot) with no
    supplementary groups, which clears every capability. uid None: we are uid 0 of our own
    user namespace (not root outside), and give up its capabilities for good instead: empty
    bounding set, securebits that never grant root capabilities on exec, empty capability
    sets."""
    if uid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    else:
        for cap in range(64):
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last capability
        _check(libc.prctl(PR_SET_SECUREBITS, SECBITS_LOCKED_NOROOT, 0, 0, 0), "securebits")
        empty = (CapData * 2)()
        _check(libc.capset(ctypes.byref(CapHeader(0x20080522, 0)), empty), "capset")
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no ptrace of init by the program
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def die_with(lifeline: int) -> None:
    """SIGKILL when the launcher dies (set after the last credential change, which clears it);
    the lifeline pipe tells whether it already died before the call."""
    _check(libc.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0), "parent-death signal")
    poller = select.poll()
    poller.register(lifeline, select.POLLIN)
    if poller.poll(0):  # EOF: the launcher is gone
        os._exit(SETUP_FAILED)


# --------------------------------------------------------------------------- seccomp

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 4, 7
AF_UNIX = 1
# Syscalls a test program never needs and sandbox escapes use: tracing and reading other
# processes, mounts and namespaces (an unprivileged user namespace would give the program
# capabilities again), kernel keyrings, BPF, perf, io_uring, modules, clocks, reboot.
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen", "fsmount",
    "fsconfig", "move_mount", "open_tree", "mount_setattr", "open_by_handle_at",
    "name_to_handle_at", "keyctl", "add_key", "request_key", "bpf", "perf_event_open",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "kexec_load",
    "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon",
    "swapoff", "acct", "quotactl", "syslog", "settimeofday", "clock_settime", "clock_adjtime",
    "adjtimex", "iopl", "ioperm", "lookup_dcookie", "vhangup", "personality",
)  # fmt: skip
NAMESPACE_FLAGS = (
    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET,
    0x02000000, 0x00000080,  # CLONE_NEWCGROUP, CLONE_NEWTIME
)  # fmt: skip


class ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def load_seccomp_library():
    """libseccomp (Debian: libseccomp2), or None when it is not installed."""
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(ArgCmp)
    ]  # fmt: skip
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def install_seccomp(lib, allow_unix_sockets: bool) -> None:
    """Deny the syscalls above with EPERM, sockets of any family but AF_UNIX (or all) with
    EACCES, clone with a namespace flag with EPERM, and clone3 with ENOSYS (its flags sit in
    memory a filter cannot read; the C library then falls back to clone)."""
    errno_action = lambda e: 0x00050000 | e  # noqa: E731 - SCMP_ACT_ERRNO
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise SetupError("seccomp_init failed")

    def rule(action: int, name: str, *cmps: ArgCmp) -> None:
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:  # not a syscall on this architecture
            return
        array = (ArgCmp * len(cmps))(*cmps) if cmps else None
        ret = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
        if ret != 0:
            raise SetupError(f"seccomp rule for {name}: {os.strerror(-ret)}")

    try:
        for name in DENIED_SYSCALLS:
            rule(errno_action(errno.EPERM), name)
        for flag in NAMESPACE_FLAGS:
            rule(errno_action(errno.EPERM), "clone", ArgCmp(0, SCMP_CMP_MASKED_EQ, flag, flag))
        rule(errno_action(errno.ENOSYS), "clone3")
        if allow_unix_sockets:
            for family in range(2, 64):  # every family but AF_UNIX (1)
                rule(errno_action(errno.EACCES), "socket", ArgCmp(0, SCMP_CMP_EQ, family, 0))
        else:
            rule(errno_action(errno.EACCES), "socket")
        rule(errno_action(errno.EACCES), "socketpair")
        ret = lib.seccomp_load(ctx)
        if ret != 0:
            raise SetupError(f"seccomp_load: {os.strerror(-ret)}")
    finally:
        lib.seccomp_release(ctx)


# --------------------------------------------------------------------------- the program


def exec_program(req: dict, stdin_path: str, workdir: str) -> None:
    """In the program's process: limits, fds, environment, then exec (never returns)."""
    try:
        os.setsid()  # its own session: no controlling terminal, its own process group
        lim = req["limits"]
        rlimits = {
            resource.RLIMIT_CPU: (lim["cpu_s"], lim["cpu_s"] + 1),
            resource.RLIMIT_AS: (lim["memory_bytes"],) * 2,
            resource.RLIMIT_NPROC: (lim["processes"],) * 2,
            resource.RLIMIT_NOFILE: (lim["open_files"],) * 2,
            resource.RLIMIT_FSIZE: (lim["file_bytes"],) * 2,
            resource.RLIMIT_CORE: (0, 0),
            resource.RLIMIT_MEMLOCK: (0, 0),
            resource.RLIMIT_MSGQUEUE: (0, 0),
        }
        for which, value in rlimits.items():
            resource.setrlimit(which, value)
        fd = os.open(stdin_path, os.O_RDONLY)
        os.dup2(fd, 0)
        os.closerange(3, lim["open_files"] + 1024)
        os.chdir(workdir)
        os.execve(req["argv"][0], req["argv"], req["env"])
    except BaseException as exc:
        os.write(2, f"sandbox: cannot start the program: {exc!r}\n".encode())
    os._exit(SETUP_FAILED)


def supervise(child: int, namespaces: bool) -> dict:
    """Wait for the program (reaping any orphan it left); its status and resource use."""
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == child:
            break
    return {
        "exit_code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_kb": usage.ru_maxrss,
        "left_processes": count_left_processes(namespaces),
    }


def count_left_processes(namespaces: bool) -> int:
    """Processes the program left running (zombies aside): every other process of our pid
    namespace (they die with us), or without namespaces every other process of our uid (the
    executor kills them)."""
    me, uid, left = str(os.getpid()), str(os.getuid()), 0
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if fields.get("State", "").strip().startswith("Z"):
            continue
        left += namespaces or fields.get("Uid", "").split()[:2][-1:] == [uid]
    return left


def run_init(req: dict, lifeline: int, seccomp) -> None:
    """PID 1 of the new namespaces (or, without them, the process that forks the program)."""
    status_fd = req["status_fd"]
    layers = ["rlimits"]
    try:
        uid, gid = req["uid"], req["gid"]
        if req["namespaces"]:
            build_root(req, *((uid, gid) if uid is not None else (0, 0)))
            layers.append("namespaces")
            stdin_path, workdir = "/code/input", "/sandbox"
        else:
            stdin_path, workdir = req["workdir"] + "/code/input", req["workdir"] + "/sandbox"
        drop_privileges(uid, gid)
        layers.append("unprivileged")
        die_with(lifeline)
        if seccomp is not None:
            install_seccomp(seccomp, allow_unix_sockets=req["namespaces"])
            layers.append("seccomp")
    except (SetupError, OSError) as exc:
        report(status_fd, {"setup_error": str(exc)})
        os._exit(SETUP_FAILED)
    child = os.fork()
    if child == 0:
        exec_program(req, stdin_path, workdir)
    report(status_fd, {"layers": layers, **supervise(child, req["namespaces"])})
    os._exit(0)


def main() -> None:
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # the executor's to handle
    try:
        req = marshal.loads(sys.stdin.buffer.read())
    except (ValueError, EOFError, TypeError) as exc:
        os.write(2, f"sandbox launcher: bad request: {exc}\n".encode())
        sys.exit(SETUP_FAILED)
    status_fd = req["status_fd"]
    seccomp = None
    if req["seccomp"]:
        seccomp = load_seccomp_library()
        if seccomp is None:
            report(status_fd, {"setup_error": "libseccomp.so.2 is not installed"})
            sys.exit(SETUP_FAILED)
    outer_uid, outer_gid = os.getuid(), os.getgid()
    if req["namespaces"]:
        flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        if outer_uid != 0:
            flags |= CLONE_NEWUSER
        try:
            _check(libc.unshare(flags), "unshare")
            if outer_uid != 0:
                map_user_namespace(outer_uid, outer_gid)
        except (SetupError, OSError) as exc:
            report(status_fd, {"setup_error": str(exc)})
            sys.exit(SETUP_FAILED)
    lifeline_r, lifeline_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(lifeline_w)
        run_init(req, lifeline_r, seccomp)
    os.close(lifeline_r)
    report(status_fd, {"init_pid": pid})  # the executor waits for it after a kill
    os.close(status_fd)  # only init reports from here on
    _, status = os.waitpid(pid, 0)
    sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else SETUP_FAILED)


if __name__ == "__main__":
    main()
