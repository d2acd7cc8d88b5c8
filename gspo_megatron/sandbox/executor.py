"""The sandbox executor: runs untrusted programs, each in its own sandboxed process tree.

    sandbox = Sandbox(SandboxConfig())           # checks the isolation layers now
    result = await sandbox.run(program, stdin)    # RunResult: status, stdout, stderr, times
    await sandbox.aclose()

Each run starts `launcher.py` (an interpreter of its own, `python -I -S`, an empty environment,
no inherited descriptors but its pipes, its own session) which builds the sandbox and runs the
program (see launcher.py for the process tree and docs/SANDBOX.md for what each layer stops).
At most `workers` runs are in flight; each holds one slot, and with root each slot runs its
programs as a uid of its own (`uid_base + 64 * pid + slot`, pid this process's), so the process
limit of one program is not shared with another's, not even with another trainer's on the same
machine, and programs cannot signal each other.

What this side enforces: the wall-clock limit (then the launcher's process group is killed,
which kills the sandbox's PID 1 and with it every process of the program) and the output
limit (stdout and stderr read with a cap; past it, the same kill). A run never raises for
what the program did: the result's `status` says what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import marshal
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from gspo_megatron.sandbox.languages import Language, get_language

logger = logging.getLogger(__name__)

LAUNCHER = Path(__file__).with_name("launcher.py")
SETUP_FAILED = 125
STDERR_CAP = 64 * 1024
STDERR_KEPT = 2000
RUN_STATUSES = (
    "ok",  # exited with code 0
    "runtime_error",  # exited with another code (an exception, sys.exit(1), ...)
    "signal",  # killed by a signal it raised itself or by the kernel (not a limit below)
    "timeout",  # ran past the wall-clock limit: killed with everything it started
    "cpu_time",  # used up its CPU-time limit (RLIMIT_CPU)
    "memory",  # ran out of its address-space limit (RLIMIT_AS): MemoryError or a crash
    "output_limit",  # wrote more than the output limit: killed
    "sandbox_error",  # the sandbox could not be built (the program never ran)
)
RunStatus = Literal[
    "ok", "runtime_error", "signal", "timeout", "cpu_time", "memory", "output_limit",
    "sandbox_error",
]  # fmt: skip
LAYERS = ("namespaces", "unprivileged", "seccomp", "rlimits")


class SandboxUnavailable(RuntimeError):
    """A requested isolation layer does not work on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    wall_s: wall-clock time from start to exit, sandbox set-up (~20 ms) included.
    cpu_s: CPU seconds of the program's main process (RLIMIT_CPU; null = ceil(wall_s)).
    memory_mb: address space of each process (RLIMIT_AS).
    processes: processes and threads of the program, all its descendants included
        (RLIMIT_NPROC, counted per sandbox uid).
    open_files: descriptors per process (RLIMIT_NOFILE).
    output_bytes: stdout; stderr is capped at 64 KiB. Past either, the run is killed.
    disk_mb: size of /sandbox (and of any one file: RLIMIT_FSIZE).
    """

    wall_s: float = 5.0
    cpu_s: int | None = None
    memory_mb: int = 512
    processes: int = 16
    open_files: int = 64
    output_bytes: int = 1 << 20
    disk_mb: int = 16

    def validate(self, key: str = "limits") -> None:
        checks = {
            "wall_s": self.wall_s > 0,
            "cpu_s": self.cpu_s is None or self.cpu_s >= 1,
            "memory_mb": self.memory_mb >= 32,
            "processes": self.processes >= 1,
            "open_files": self.open_files >= 8,
            "output_bytes": self.output_bytes >= 1,
            "disk_mb": self.disk_mb >= 1,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{key}.{name}={getattr(self, name)!r} is out of range")

    def launcher_limits(self) -> dict[str, int]:
        disk = self.disk_mb << 20
        return {
            "cpu_s": self.cpu_s or max(1, math.ceil(self.wall_s)),
            "memory_bytes": self.memory_mb << 20,
            "processes": self.processes + 1,  # the sandbox's init runs as the same uid
            "open_files": self.open_files,
            "file_bytes": disk,
            "disk_bytes": disk,
            "inodes": 4096,
        }


@dataclass
class RunResult:
    """What one run did. stdout is decoded as UTF-8 (undecodable bytes replaced); stderr is
    its last 2000 characters."""

    status: RunStatus
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: int | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0
    left_processes: int = 0
    layers: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SandboxConfig:
    """How programs are isolated (docs/SANDBOX.md).

    workers: runs at once (null = the CPUs this process may use).
    namespaces: run each program in its own mount, pid, network, IPC and UTS namespaces with
        a root that hides the host. If the kernel refuses them, building the sandbox fails
        and says so; false runs programs in a host directory (weaker: docs/SANDBOX.md).
    seccomp: load a syscall filter (needs libseccomp.so.2); false skips it.
    python: the interpreter programs run with (null = this process's own, resolved).
    uid_base: with root, slot i runs its programs as uid uid_base + 64 * pid + i, pid this
        process's id (no such user needs to exist; it owns nothing on the host; at most 64
        workers).
    ro_paths: extra host paths the program may read (bound read-only at the same place).
    """

    workers: int | None = None
    namespaces: bool = True
    seccomp: bool = True
    python: str | None = None
    uid_base: int = 2_000_000_000
    ro_paths: tuple[str, ...] = ()
    limits: SandboxLimits = field(default_factory=SandboxLimits)

    def resolved_workers(self) -> int:
        if self.workers is not None:
            if not 1 <= self.workers <= 64:
                raise ValueError(f"sandbox workers must be in 1..64, got {self.workers}")
            return self.workers
        return min(64, len(os.sched_getaffinity(0)))


class _OutputLimit(Exception):
    pass


class _StatusPipe:
    """The read end of the status pipe: JSON lines from the launcher (init's pid) and init
    (the final status), read without blocking as they come."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        os.set_blocking(fd, False)

    def messages(self) -> list[dict]:
        while self.fd >= 0:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            self.buf += chunk
        text = bytes(self.buf).decode(errors="replace")
        return [json.loads(line) for line in text.splitlines() if line]

    def init_pid(self) -> int | None:
        try:
            return next((m["init_pid"] for m in self.messages() if "init_pid" in m), None)
        except ValueError:
            return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    buf = bytearray()
    while chunk := await stream.read(1 << 16):
        if len(buf) + len(chunk) > cap:
            raise _OutputLimit
        buf += chunk
    return bytes(buf)


def _interpreter(cfg: SandboxConfig) -> tuple[str, str]:
    """(the interpreter's real path, its installation prefix)."""
    if cfg.python is None:
        return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)
    path = shutil.which(cfg.python) or cfg.python
    if not os.path.isfile(path):
        raise ValueError(f"sandbox python {cfg.python!r} is not an executable file")
    real = os.path.realpath(path)
    return real, os.path.dirname(os.path.dirname(real))


def _world_executable(path: str) -> bool:
    """Whether any user can run `path`: every directory above it searchable by others."""
    real = Path(path).resolve()
    dirs_ok = all(d.stat().st_mode & 0o001 for d in real.parents)
    return dirs_ok and real.stat().st_mode & 0o005 == 0o005


class Sandbox:
    """Runs programs under `config` (see the module docstring). Construction probes the
    requested layers with a trivial program and raises `SandboxUnavailable` naming the one
    that does not work."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.config.limits.validate()
        self.workers = self.config.resolved_workers()
        self.python, prefix = _interpreter(self.config)
        self._root = os.geteuid() == 0
        self.first_uid = self.config.uid_base + 64 * os.getpid()
        if self.first_uid + 64 > 2**32 - 2:
            raise ValueError(f"sandbox uid_base={self.config.uid_base} leaves no room for uids")
        if not self.config.namespaces and not self._root:
            raise SandboxUnavailable(
                "without namespaces the sandbox runs programs as uids of their own, which "
                "needs root; run as root or keep namespaces on"
            )
        if not self.config.namespaces and not _world_executable(self.python):
            raise SandboxUnavailable(
                f"without namespaces programs run as an unprivileged uid on the host's files, "
                f"which cannot reach {self.python} (a directory on its path is not readable by "
                "every user): set python=/usr/bin/python3 or another interpreter anyone can run"
            )
        system = ("/usr", "/bin", "/lib", "/lib64", "/sbin")
        self.ro_paths = tuple(dict.fromkeys((*system, prefix, *self.config.ro_paths)))
        self._slots: asyncio.Queue[int] | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._reaping: set[asyncio.Task] = set()
        self.layers = self._probe()
        logger.info("sandbox: %s, %d workers", ", ".join(self.layers), self.workers)

    # ------------------------------------------------------------------ probing

    def _probe(self) -> list[str]:
        """Run `print(1)` once, synchronously, and return the layers the launcher reports."""
        probe = lambda: asyncio.run(self.run("print(1)", limits=SandboxLimits(wall_s=30)))  # noqa: E731
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # no loop in this thread: run one here
            result = probe()
        else:  # built from a running loop (a service's start-up): probe beside it
            with ThreadPoolExecutor(1) as pool:
                result = pool.submit(probe).result()
        finally:
            self._slots = self._slots_loop = None
        if result.status != "ok" or result.stdout.strip() != "1":
            why = result.error or f"{result.status}: {result.stderr.strip()[-500:]}"
            hint = {
                True: "the kernel may refuse unprivileged namespaces (sysctl "
                "user.max_user_namespaces, kernel.unprivileged_userns_clone, or a container's "
                "seccomp profile): allow them, or set namespaces=false (weaker isolation, "
                "docs/SANDBOX.md)",
                False: "",
            }[self.config.namespaces]
            if self.config.seccomp and "libseccomp" in why:
                hint = "install libseccomp2 (Debian/Ubuntu: apt-get install libseccomp2) or set seccomp=false"  # noqa: E501
            raise SandboxUnavailable(f"the sandbox does not work here: {why}; {hint}".rstrip("; "))
        wanted = {"namespaces": self.config.namespaces, "seccomp": self.config.seccomp}
        missing = [name for name, on in wanted.items() if on and name not in result.layers]
        if missing:
            raise SandboxUnavailable(f"sandbox layers requested but not active: {missing}")
        return result.layers

    # ------------------------------------------------------------------ running

    def _slot_queue(self) -> asyncio.Queue[int]:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots = asyncio.Queue()
            for slot in range(self.workers):
                self._slots.put_nowait(slot)
            self._slots_loop = loop
        return self._slots

    async def run(
        self,
        program: str,
        stdin: str = "",
        *,
        language: str | Language = "python",
        spec: dict | None = None,
        limits: SandboxLimits | None = None,
    ) -> RunResult:
        """Run `program` with `stdin` as its input; waits for a free slot first."""
        lang = get_language(language) if isinstance(language, str) else language
        spec = spec or {"mode": "script"}
        if spec["mode"] not in lang.modes:
            raise ValueError(f"language {lang.name} cannot run mode {spec['mode']!r}")
        limits = limits or self.config.limits
        slots = self._slot_queue()
        slot = await slots.get()
        try:
            return await self._run_in_slot(slot, lang, program, stdin, spec, limits)
        finally:
            slots.put_nowait(slot)

    def _request(self, slot, lang, program, stdin, spec, limits, status_fd, workdir) -> bytes:
        uid = self.first_uid + slot if self._root else None
        argv = [a.replace("{python}", self.python) for a in lang.argv]
        env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox"}
        env["LANG"] = "C.UTF-8"
        req = {
            "status_fd": status_fd,
            "namespaces": self.config.namespaces,
            "seccomp": self.config.seccomp,
            "uid": uid,
            "gid": uid,
            "ro_paths": list(self.ro_paths + lang.ro_paths),
            "files": lang.files(program, spec),
            "stdin": stdin,
            "argv": argv,
            "env": env,
            "limits": limits.launcher_limits(),
            "workdir": workdir,
        }
        if not self.config.namespaces:  # a host directory stands in for /code and /sandbox
            env["HOME"] = env["TMPDIR"] = f"{workdir}/sandbox"
            req["argv"] = [a.replace("/code/", f"{workdir}/code/") for a in argv]
        return marshal.dumps(req)

    async def _run_in_slot(self, slot, lang, program, stdin, spec, limits) -> RunResult:
        workdir = None
        if not self.config.namespaces:
            workdir = self._host_workdir(slot, lang, program, stdin, spec)
        status_r, status_w = os.pipe()
        start = time.perf_counter()
        try:
            request = self._request(slot, lang, program, stdin, spec, limits, status_w, workdir)
            proc = await asyncio.create_subprocess_exec(
                self.python, "-I", "-S", "-B", str(LAUNCHER),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(status_w,),
                env={},
                cwd="/",
                start_new_session=True,
            )  # fmt: skip
        except BaseException:
            os.close(status_r)
            os.close(status_w)
            self._remove_workdir(workdir)
            raise
        os.close(status_w)
        status_pipe = _StatusPipe(status_r)
        killed: RunStatus | None = None
        out = err = b""
        try:
            try:
                out, err = await asyncio.wait_for(
                    self._communicate(proc, request, limits), limits.wall_s
                )
            except TimeoutError:
                killed = "timeout"
            except _OutputLimit:
                killed = "output_limit"
            if killed:
                await self._kill(proc, slot, status_pipe)
        except BaseException:  # cancelled by the caller: nothing may outlive the run
            self._kill_now(proc, status_pipe)
            self._reap_later(proc, slot, status_pipe)
            self._remove_workdir(workdir)
            raise
        wall = time.perf_counter() - start
        status = self._read_status(status_pipe)
        if not self.config.namespaces and status and status.get("left_processes"):
            await self._sweep_uid(slot)
        self._remove_workdir(workdir)
        return self._result(killed, status, out, err, wall, limits, proc.returncode)

    async def _communicate(self, proc, request: bytes, limits: SandboxLimits) -> tuple:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        out_task = asyncio.ensure_future(_read_capped(proc.stdout, limits.output_bytes))
        err_task = asyncio.ensure_future(_read_capped(proc.stderr, STDERR_CAP))
        try:
            with contextlib.suppress(ConnectionError):
                proc.stdin.write(request)
                await proc.stdin.drain()
                proc.stdin.close()
            out, err = await asyncio.gather(out_task, err_task)
            await proc.wait()
        finally:
            for task in (out_task, err_task):
                task.cancel()
        return out, err

    @staticmethod
    def _kill_now(proc, status_pipe: _StatusPipe) -> None:
        """SIGKILL the sandbox's init (its exit kills every process of its namespace), which
        the launcher then reaps and exits; before init exists, the launcher's process group."""
        init_pid = status_pipe.init_pid()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if init_pid is not None:
                os.kill(init_pid, signal.SIGKILL)
            else:
                os.killpg(proc.pid, signal.SIGKILL)

    async def _kill(self, proc, slot: int, status_pipe: _StatusPipe) -> None:
        self._kill_now(proc, status_pipe)
        try:
            await asyncio.wait_for(proc.wait(), 10.0)
        except TimeoutError:  # the launcher did not exit: the whole group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        if not self.config.namespaces:
            await self._sweep_uid(slot)

    def _reap_later(self, proc, slot: int, status_pipe: _StatusPipe) -> None:
        async def reap() -> None:
            await proc.wait()
            status_pipe.close()
            if not self.config.namespaces:
                await self._sweep_uid(slot)

        task = asyncio.get_running_loop().create_task(reap())
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _sweep_uid(self, slot: int) -> None:
        """Without namespaces nothing kills a program's detached processes for us: kill every
        process of the slot's uid, as that uid (kill(-1) reaches exactly those), twice to
        catch forks made meanwhile."""
        uid = self.first_uid + slot
        code = f"import os\nos.setresuid({uid},{uid},{uid})\nfor _ in range(2):\n"
        code += "    try: os.kill(-1, 9)\n    except ProcessLookupError: pass\n"
        proc = await asyncio.create_subprocess_exec(
            self.python, "-I", "-S", "-c", code, env={}, cwd="/"
        )
        await proc.wait()

    @staticmethod
    def _read_status(status_pipe: _StatusPipe) -> dict | None:
        """init's final status (None when it never came), closing the pipe."""
        try:
            messages = status_pipe.messages()
        except ValueError as exc:
            return {"setup_error": f"unreadable status: {exc}"}
        finally:
            status_pipe.close()
        final = [m for m in messages if "init_pid" not in m]
        return final[-1] if final else None

    def _result(self, killed, status, out, err, wall, limits, returncode) -> RunResult:
        stdout = out.decode("utf-8", errors="replace")
        stderr = err.decode("utf-8", errors="replace")[-STDERR_KEPT:]
        base = dict(stdout=stdout, stderr=stderr, wall_s=wall)
        if killed:
            return RunResult(killed, **base, layers=list(self.layers))
        if status is None or "setup_error" in status:
            why = (status or {}).get("setup_error") or (
                f"the launcher exited with code {returncode} without a status: {stderr[-300:]!r}"
            )
            return RunResult("sandbox_error", **base, error=why)
        code, sig = status.get("exit_code"), status.get("signal")
        cpu_limit = limits.launcher_limits()["cpu_s"]
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and status["cpu_s"] >= cpu_limit):
            kind: RunStatus = "cpu_time"
        elif "MemoryError" in stderr or "Cannot allocate memory" in stderr:
            kind = "memory"
        elif sig is not None:
            kind = "signal"
        elif code == 0:
            kind = "ok"
        elif code == SETUP_FAILED and stderr.startswith("sandbox: cannot start"):
            return RunResult("sandbox_error", **base, exit_code=code, error=stderr.strip())
        else:
            kind = "runtime_error"
        return RunResult(
            kind,
            **base,
            exit_code=code,
            signal=sig,
            cpu_s=float(status.get("cpu_s", 0.0)),
            left_processes=int(status.get("left_processes", 0)),
            layers=list(status.get("layers", [])),
        )

    # ------------------------------------------------------------------ without namespaces

    def _host_workdir(self, slot, lang, program, stdin, spec) -> str:
        """A host directory for a run without namespaces: code/ (read-only, root's) and
        sandbox/ (the program's uid's, mode 0700)."""
        uid = self.first_uid + slot
        root = tempfile.mkdtemp(prefix="gspo-sandbox-")
        os.chmod(root, 0o711)
        code = os.path.join(root, "code")
        os.mkdir(code, 0o755)
        for name, text in {**lang.files(program, spec), "input": stdin}.items():
            path = os.path.join(code, name)
            Path(path).write_text(text, encoding="utf-8")
            os.chmod(path, 0o444)
        os.chmod(code, 0o555)
        work = os.path.join(root, "sandbox")
        os.mkdir(work, 0o700)
        os.chown(work, uid, uid)
        return root

    @staticmethod
    def _remove_workdir(workdir: str | None) -> None:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

    async def aclose(self) -> None:
        """Wait for the processes of cancelled runs to be reaped."""
        if self._reaping:
            await asyncio.wait(list(self._reaping), timeout=5.0)
