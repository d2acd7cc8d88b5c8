"""A sandbox slot: one long-lived process per executor worker that runs untrusted programs one at
a time, each in namespaces of its own (`python -I -S -B slot.py`, standard library only).

Started by `gspo_megatron.sandbox.executor.Sandbox`, never imported by the trainer. With
namespaces (the default where the kernel allows them) the process tree is

    launcher    the exec'd process: unshare(mount, pid, net, UTS [+ user when not root]), fork
      server    PID 1 of the slot's pid namespace. Builds the slot's root once (a tmpfs that hides
                the host, pivot_root), filters and warm interpreter once, then serves runs
        init    per run: PID 1 of a pid namespace of its own, in mount and IPC namespaces of its
                own: a fresh /proc, /code (the program and its input, read-only) and /sandbox (an
                empty tmpfs, the only writable place). Drops to the slot's unprivileged uid, sets
                no_new_privs and loads the seccomp filter
          program   rlimits, fds 0-2 only, then exec of the language's command or, for Python
                (prewarm), the harness in this fork of the server's already-started interpreter

Nothing a program does outlives its run: when init exits (the program ended, or the server
killed init for the wall clock, the output cap or an abort) the kernel kills every process of
the run's pid namespace before the server's wait for init returns; its mount and IPC namespaces
(/code, /sandbox, SysV and POSIX IPC objects) go with it. The next run starts from the same
read-only root in fresh namespaces and a fresh fork of the server: no file, process, IPC object
or interpreter state of an earlier program is left. The server itself sits in the slot's pid
namespace, which a program's nested namespace cannot see or signal.

Protocol on stdin/stdout: frames of a 4-byte big-endian length and a body. First the slot's
settings (marshal: the executor is trusted), answered by {"layers": [...]} or
{"setup_error": ...}; then per run a request (marshal), answered by a 4-byte header length, a
JSON header ({"killed", "status", "wall_s", "stdout", "stderr": byte counts}) and the
program's stdout and stderr. A frame header equal to ABORT kills the run in progress (between
runs it is ignored). EOF on stdin ends the slot.

Without namespaces (`"namespaces": false`, root only) runs happen in a host directory with the
same uid, rlimits and seccomp filter, and after each run the server kills every process of the
slot's uid and reaps them (it is their subreaper) before answering; docs/SANDBOX.md says what
that mode does not stop.
"""

import _signal
import contextlib
import ctypes
import errno
import fcntl
import json
import marshal
import os
import resource
import select
import sys
import time

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
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP = 1, 4, 22
PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 24, 28, 36, 38
SECCOMP_MODE_FILTER = 2
SECBITS_LOCKED_NOROOT = 0x2F  # NOROOT, NO_SETUID_FIXUP and KEEP_CAPS off, each locked
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "random", "urandom")
SETUP_FAILED = 125
ABORT = 0xFFFFFFFF
STDERR_CAP = 64 * 1024
KILL_GRACE_S = 10.0  # after a kill, the run's pipes close when its namespace is gone
HIGH_FD = 256  # where init parks the descriptors it keeps while it renumbers them

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


# --------------------------------------------------------------------------- frames


def read_exact(fd: int, n: int) -> bytes | None:
    """n bytes from fd; None at EOF before the first byte (a partial read is an error)."""
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            if buf:
                raise EOFError(f"frame cut after {len(buf)} of {n} bytes")
            return None
        buf += chunk
    return buf


def read_frame(fd: int) -> bytes | None:
    """The next frame's body (None at EOF); stale ABORT headers between runs are skipped."""
    while True:
        head = read_exact(fd, 4)
        if head is None:
            return None
        size = int.from_bytes(head, "big")
        if size != ABORT:
            return read_exact(fd, size) or b""


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_frame(fd: int, body: bytes) -> None:
    write_all(fd, len(body).to_bytes(4, "big") + body)


def to_json(value) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- the slot's root


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


def build_slot_root(ro_paths: list[str]) -> None:
    """A private tmpfs root holding only what programs may see, pivoted into and read-only:
    the read-only binds, four device nodes, this pid namespace's /proc (each run mounts its own
    over it; this one is what lets a user namespace mount those) and the empty mount points
    /code and /sandbox that each run fills in namespaces of its own."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    root = "/tmp"  # any directory serves as the mount point; the host's /tmp is not touched
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={1 << 20},mode=0755")
    for path in ro_paths:
        bind_readonly(path, root)
    os.makedirs(root + "/dev", mode=0o755)
    for name in DEVICES:
        node = f"{root}/dev/{name}"
        open(node, "a").close()
        mount(f"/dev/{name}", node, None, MS_BIND)
    for name, mode in (("proc", 0o555), ("code", 0o755), ("sandbox", 0o755), (".old", 0o700)):
        os.makedirs(f"{root}/{name}", mode=mode)
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.symlink("/sandbox", root + "/tmp")
    nr = PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise SetupError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    os.chdir(root)
    _check(libc.syscall(nr, b".", b".old"), "pivot_root")
    os.chdir("/")
    _check(libc.umount2(b"/.old", MNT_DETACH), "umount the host's root")
    os.rmdir("/.old")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def fill_run_root(req: dict, uid: int, gid: int) -> None:
    """In the run's own mount namespace: its pid namespace's /proc, the program's files in a
    read-only /code, an empty /sandbox owned by the program's uid."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    size = sum(len(v.encode()) for v in req["files"].values()) + len(req["stdin"].encode())
    mount("tmpfs", "/code", "tmpfs", MS_NOSUID | MS_NODEV, f"size={size + 65536},mode=0755")
    write_files("/code", req)
    mount(None, "/code", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    limits = req["limits"]
    tmpfs = (
        f"size={limits['disk_bytes']},nr_inodes={limits['inodes']},mode=0700,uid={uid},gid={gid}"  # noqa: E501
    )
    mount("tmpfs", "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)


def write_files(code_dir: str, req: dict) -> None:
    for name, text in [*req["files"].items(), ("input", req["stdin"])]:
        fd = os.open(f"{code_dir}/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    os.chmod(code_dir, 0o555)


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
    """SIGKILL when the parent dies (set after the last credential change, which clears it);
    the lifeline pipe (whose write end only the parent holds) tells whether it already died."""
    _check(libc.prctl(PR_SET_PDEATHSIG, _signal.SIGKILL, 0, 0, 0), "parent-death signal")
    poller = select.poll()
    poller.register(lifeline, select.POLLIN)
    if poller.poll(0):  # EOF: the parent is gone
        os._exit(SETUP_FAILED)


# --------------------------------------------------------------------------- seccomp

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 4, 7
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


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def load_seccomp_library(name: str):
    """libseccomp (`name`: libseccomp.so.2, Debian's libseccomp2), or None when it is not
    installed."""
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(ArgCmp)
    ]  # fmt: skip
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def seccomp_filter(lib, allow_unix_sockets: bool) -> bytes:
    """The BPF program (built once per slot, loaded by each run's init): the syscalls above
    fail with EPERM, sockets of any family but AF_UNIX (or all) with EACCES, clone with a
    namespace flag with EPERM, and clone3 with ENOSYS (its flags sit in memory a filter cannot
    read; the C library then falls back to clone)."""
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
        fd = os.memfd_create("seccomp-bpf")
        try:
            ret = lib.seccomp_export_bpf(ctx, fd)
            if ret != 0:
                raise SetupError(f"seccomp_export_bpf: {os.strerror(-ret)}")
            size = os.lseek(fd, 0, os.SEEK_END)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def load_seccomp(program: bytes) -> None:
    """Install the filter on this process (inherited by everything it forks)."""
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = SockFprog(len(program) // 8, ctypes.addressof(buf))
    ret = libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)
    _check(ret, "seccomp")


# --------------------------------------------------------------------------- one run


def keep_only_fds(fds: list[int]) -> None:
    """Make fds[i] descriptor i and close every other: nothing of the slot's (its pipes to
    the executor above all) reaches the program."""
    parked = [fcntl.fcntl(fd, fcntl.F_DUPFD, HIGH_FD + i) for i, fd in enumerate(fds)]
    for i, fd in enumerate(parked):
        os.dup2(fd, i)
    os.closerange(len(fds), 1 << 20)


def exec_program(slot, req: dict, code_dir: str, work_dir: str) -> None:
    """In the program's process: limits, fds, environment, then exec or the warm harness
    (never returns)."""
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
        fd = os.open(code_dir + "/input", os.O_RDONLY)
        os.dup2(fd, 0)
        os.closerange(3, 1 << 20)  # the status pipe and the lifeline
        os.chdir(work_dir)
        if req["in_process"]:
            _signal.signal(_signal.SIGINT, _signal.default_int_handler)
            os.environ.clear()
            os.environ.update(req["env"])
            os._exit(slot.harness["run_in_this_process"](code_dir))
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
    server kills them)."""
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


def run_init(slot, req: dict, out_w: int, err_w: int, status_w: int, code_dir: str) -> None:
    """The run's init (PID 1 of its pid namespace; without namespaces, the program's parent):
    builds the run's view, drops privileges, forks the program, reports its status (fd 3)."""
    try:
        null = os.open("/dev/null", os.O_RDONLY)
        keep_only_fds([null, out_w, err_w, status_w, slot.lifeline])
    except OSError as exc:
        os.write(status_w, to_json({"setup_error": f"descriptors: {exc}"}) + b"\n")
        os._exit(SETUP_FAILED)
    layers = ["rlimits"]
    try:
        uid, gid = slot.uid, slot.gid
        if slot.namespaces:
            _check(libc.unshare(CLONE_NEWNS | CLONE_NEWIPC), "unshare")
            fill_run_root(req, *((uid, gid) if uid is not None else (0, 0)))
            layers.append("namespaces")
            work_dir = "/sandbox"
        else:
            work_dir = os.path.dirname(code_dir) + "/sandbox"
        drop_privileges(uid, gid)
        layers.append("unprivileged")
        die_with(4)
        if slot.seccomp_filter is not None:
            load_seccomp(slot.seccomp_filter)
            layers.append("seccomp")
    except (SetupError, OSError) as exc:
        report({"setup_error": str(exc)})
        os._exit(SETUP_FAILED)
    child = os.fork()
    if child == 0:
        exec_program(slot, req, code_dir, work_dir)
    report({"layers": layers, **supervise(child, slot.namespaces)})
    os._exit(0)


def report(status: dict) -> None:
    """init's status line on fd 3 (the server reads it; a vanished server is no error)."""
    with contextlib.suppress(OSError):
        os.write(3, to_json(status) + b"\n")


class Slot:
    """The server's state: its settings, filter, warm harness, and the runs it serves."""

    def __init__(self, cfg: dict, seccomp_lib) -> None:
        self.namespaces = cfg["namespaces"]
        self.uid, self.gid = cfg["uid"], cfg["gid"]
        # init's lifeline: we hold the write end for as long as we live
        self.lifeline, self._lifeline_w = os.pipe()
        self.closing = False
        self.runs = 0
        if self.namespaces:
            build_slot_root(cfg["ro_paths"])
            self.pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
        else:
            _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "subreaper")
        self.seccomp_filter = None
        if seccomp_lib is not None:
            self.seccomp_filter = seccomp_filter(seccomp_lib, allow_unix_sockets=self.namespaces)
        self.harness = None
        if cfg["prewarm"] is not None:  # the Python harness, and what it imports, loaded once
            self.harness = {"__name__": "gspo_sandbox_harness"}
            exec(compile(cfg["prewarm"], "/code/harness.py", "exec"), self.harness)
            for name in self.harness["PRELOAD"]:
                __import__(name)

    def layers(self) -> list[str]:
        """The isolation layers each run gets, in the order init reports them."""
        layers = ["rlimits", "namespaces", "unprivileged", "seccomp"]
        return [
            name
            for name in layers
            if (name != "namespaces" or self.namespaces)
            and (name != "seccomp" or self.seccomp_filter is not None)
        ]

    # ------------------------------------------------------------------ a run

    def run(self, req: dict) -> bytes:
        """Run one program; the response frame's body."""
        try:
            code_dir = "/code" if self.namespaces else self._host_workdir(req)
        except (SetupError, OSError) as exc:
            return self._response(None, 0.0, [b"", b"", to_json({"setup_error": str(exc)})])
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        start = time.perf_counter()
        try:
            init = self._fork_init(req, out_w, err_w, status_w, code_dir)
        except (SetupError, OSError) as exc:
            init = None
            os.write(status_w, to_json({"setup_error": f"starting the run: {exc}"}))
        for fd in (out_w, err_w, status_w):
            os.close(fd)
        killed, outputs = self._watch(init, req, start, {out_r: 0, err_r: 1, status_r: 2})
        if init is not None:
            os.waitpid(init, 0)  # with namespaces: returns once every process of the run is gone
        wall = time.perf_counter() - start
        if not self.namespaces:
            self._sweep()
            self._remove_workdir(code_dir)
        self.runs += 1
        return self._response(killed, wall, outputs)

    @staticmethod
    def _response(killed: str | None, wall: float, outputs) -> bytes:
        """The answer: the header (the kill, the wall time, init's last status line, the
        output sizes), then stdout and stderr."""
        lines = [line for line in bytes(outputs[2]).splitlines() if line.strip()]
        try:
            status = json.loads(lines[-1]) if lines else None
        except ValueError:
            status = {"setup_error": f"unreadable status {lines[-1][:200]!r}"}
        header = to_json(
            {
                "killed": killed,
                "wall_s": wall,
                "status": status,
                "stdout": len(outputs[0]),
                "stderr": len(outputs[1]),
            }
        )
        return len(header).to_bytes(4, "big") + header + bytes(outputs[0]) + bytes(outputs[1])

    def _fork_init(self, req, out_w, err_w, status_w, code_dir) -> int:
        if self.namespaces:
            _check(libc.unshare(CLONE_NEWPID), "unshare(pid)")  # for init alone
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    run_init(self, req, out_w, err_w, status_w, code_dir)
                finally:
                    os._exit(SETUP_FAILED)
            return pid
        finally:
            if self.namespaces:  # our next child goes back to our own pid namespace
                _check(libc.setns(self.pid_ns, CLONE_NEWPID), "setns(pid)")

    def _watch(self, init: int | None, req: dict, start: float, fds: dict[int, int]):
        """Read the run's stdout, stderr and status until they close; kill init at the wall
        clock, past an output cap, on an abort frame or when stdin closes. (killed, outputs)."""
        caps = (req["limits"]["output_bytes"], STDERR_CAP, 1 << 16)
        outputs = [bytearray(), bytearray(), bytearray()]
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.register(0, select.POLLIN)
        deadline = start + req["wall_s"]
        killed = None

        def kill(why: str) -> None:
            nonlocal killed, deadline
            if killed is None:
                killed = self._kill(init, why)
                deadline = time.perf_counter() + KILL_GRACE_S

        while fds:
            left = deadline - time.perf_counter()
            if left <= 0:
                if killed is not None:
                    break  # the kill did not close the pipes in KILL_GRACE_S: give up on them
                kill("timeout")
                continue
            for fd, _ in poller.poll(max(1, int(left * 1000) + 1)):
                if fd == 0:
                    why = self._executor_message()
                    if why == "closing":
                        poller.unregister(0)
                    kill(why)
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    poller.unregister(fd)
                    os.close(fd)
                    del fds[fd]
                    continue
                which = fds[fd]
                if len(outputs[which]) + len(chunk) > caps[which]:
                    if which != 2:
                        kill("output_limit")
                    continue
                if killed != "output_limit":
                    outputs[which] += chunk
        for fd in fds:
            os.close(fd)
        return killed, outputs

    def _executor_message(self) -> str:
        """Something arrived from the executor during a run: an abort, or EOF."""
        head = read_exact(0, 4)
        if head is None:
            self.closing = True
            return "closing"
        if int.from_bytes(head, "big") != ABORT:
            raise EOFError("the executor sent a request during a run")
        return "aborted"

    def _kill(self, init: int | None, why: str) -> str:
        """SIGKILL init (our unreaped child, so its pid is ours): with namespaces the kernel
        then kills every process of the run; without them the sweep does."""
        if init is not None:
            os.kill(init, _signal.SIGKILL)
        if not self.namespaces:
            self._sweep()
        return why

    # ------------------------------------------------------------------ without namespaces

    def _host_workdir(self, req: dict) -> str:
        """code/ (read-only, root's) and sandbox/ (the slot uid's, mode 0700) in a directory
        of /tmp that only this run uses; returns code/. The program's command, HOME and TMPDIR
        are rewritten to them."""
        for attempt in range(100):
            root = f"/tmp/gspo-sandbox-{os.getpid()}-{self.runs}-{attempt}"
            try:
                os.mkdir(root, 0o711)
                break
            except FileExistsError:
                continue
        else:
            raise SetupError("no free work directory name in /tmp")
        os.mkdir(root + "/code", 0o755)
        write_files(root + "/code", req)
        os.mkdir(root + "/sandbox", 0o700)
        os.chown(root + "/sandbox", self.uid, self.gid)
        req["argv"] = [a.replace("/code/", root + "/code/") for a in req["argv"]]
        req["env"] = {**req["env"], "HOME": root + "/sandbox", "TMPDIR": root + "/sandbox"}
        return root + "/code"

    @staticmethod
    def _remove_workdir(code_dir: str) -> None:
        import shutil  # only without namespaces

        shutil.rmtree(os.path.dirname(code_dir), ignore_errors=True)

    def _sweep(self) -> None:
        """Kill every process of the slot's uid and reap them (we are their subreaper) until
        none is left, not even a zombie: the next run starts with none of them counted against
        its process limit, and nothing a program started outlives its run."""
        deadline = time.perf_counter() + KILL_GRACE_S
        while True:
            self._reap()
            if not self._uid_pids() or time.perf_counter() > deadline:
                return
            killer = os.fork()
            if killer == 0:  # as the uid, kill(-1) reaches exactly its processes
                try:
                    os.setresuid(self.uid, self.uid, self.uid)
                    os.kill(-1, _signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(killer, 0)
            time.sleep(0.001)

    @staticmethod
    def _reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def _uid_pids(self) -> list[str]:
        """Processes of the slot's uid, zombies included (they count against its limit)."""
        uid, pids = str(self.uid), []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/status") as f:
                    line = next((x for x in f if x.startswith("Uid:")), "")
            except OSError:
                continue
            if line.split()[1:2] == [uid]:
                pids.append(name)
        return pids


def serve(cfg: dict, seccomp_lib, lifeline: int) -> None:
    """The server: build the slot, then answer runs until stdin closes."""
    try:
        die_with(lifeline)  # the launcher's death (the executor's kill) takes the slot down
        slot = Slot(cfg, seccomp_lib)
        write_frame(1, to_json({"layers": slot.layers()}))
    except (SetupError, OSError) as exc:
        write_frame(1, to_json({"setup_error": str(exc)}))
        os._exit(SETUP_FAILED)
    try:
        while not slot.closing:
            body = read_frame(0)
            if body is None:
                break
            write_frame(1, slot.run(marshal.loads(body)))
    except OSError:  # the executor is gone
        pass
    os._exit(0)


def main() -> None:
    _signal.signal(_signal.SIGINT, _signal.SIG_IGN)  # the executor's to handle
    try:
        cfg = marshal.loads(read_frame(0) or b"")
    except (ValueError, EOFError, TypeError) as exc:
        os.write(2, f"sandbox slot: bad settings: {exc}\n".encode())
        sys.exit(SETUP_FAILED)
    seccomp_lib = None
    try:
        if cfg["seccomp"]:
            seccomp_lib = load_seccomp_library(cfg["seccomp"])
            if seccomp_lib is None:
                raise SetupError(f"{cfg['seccomp']} is not installed")
        if cfg["namespaces"]:
            outer_uid, outer_gid = os.getuid(), os.getgid()
            flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWUTS
            flags |= CLONE_NEWUSER if outer_uid != 0 else 0
            _check(libc.unshare(flags), "unshare")
            if outer_uid != 0:
                map_user_namespace(outer_uid, outer_gid)
    except (SetupError, OSError) as exc:
        write_frame(1, to_json({"setup_error": str(exc)}))
        sys.exit(SETUP_FAILED)
    lifeline_r, lifeline_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(lifeline_w)
        serve(cfg, seccomp_lib, lifeline_r)
    os.close(lifeline_r)
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)  # only the server reads requests and writes answers
    os.dup2(null, 1)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else SETUP_FAILED)


if __name__ == "__main__":
    main()
