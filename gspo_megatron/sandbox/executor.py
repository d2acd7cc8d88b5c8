"""The sandbox executor: runs untrusted programs in sandbox slots, one long-lived slot process per
worker.

    sandbox = Sandbox(SandboxConfig())           # starts a slot and checks the layers now
    result = await sandbox.run(program, stdin)    # RunResult: status, stdout, stderr, times
    sandbox.close()

A slot (slot.py: `python -I -S -B`, an empty environment, no inherited descriptors but its
pipes, its own session) builds a root that hides the host once, then runs each program in pid,
mount and IPC namespaces of its own under the slot's uid, seccomp filter and rlimits (the
process tree and what each layer stops: slot.py and docs/SANDBOX.md). Python programs run in a
fork of the slot's warm interpreter (`prewarm`) or by exec of a fresh one. With root each slot
runs its programs as a uid of its own (`uid_base + 64 * pid + slot`, pid this process's), so
the process limit of one program is not shared with another's, not even with another
trainer's on the same machine, and programs cannot signal each other.

The slot enforces the wall clock and the output caps (it kills the run's init, and with it
every process of the run). This side runs each slot's requests on a thread of its own and
keeps a watchdog: a slot that dies or stops answering is killed with everything it started
and rebuilt for the next run, and the run it held gets status `slot_lost`. A run never raises
for what the program did: the result's `status` says what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import marshal
import math
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from gspo_megatron.sandbox.languages import HARNESS, LANGUAGES, Language, get_language

logger = logging.getLogger(__name__)

SLOT = Path(__file__).with_name("slot.py")
SECCOMP_LIBRARY = "libseccomp.so.2"  # Debian/Ubuntu package libseccomp2
SETUP_FAILED = 125
ABORT = 0xFFFFFFFF
STDERR_KEPT = 2000
STARTUP_TIMEOUT_S = 60.0
WATCHDOG_GRACE_S = 30.0  # past the wall clock: the slot's own kill grace (10 s) and slack
RUN_STATUSES = (
    "ok",  # exited with code 0
    "runtime_error",  # exited with another code (an exception, sys.exit(1), ...)
    "signal",  # killed by a signal it raised itself or by the kernel (not a limit below)
    "timeout",  # ran past the wall-clock limit: killed with everything it started
    "cpu_time",  # used up its CPU-time limit (RLIMIT_CPU)
    "memory",  # ran out of its address-space limit (RLIMIT_AS): MemoryError or a crash
    "output_limit",  # wrote more than the output limit: killed
    "slot_lost",  # the slot running it died or stopped answering: rebuilt for the next run
    "sandbox_error",  # the sandbox could not be built (the program never ran)
)
RunStatus = Literal[
    "ok", "runtime_error", "signal", "timeout", "cpu_time", "memory", "output_limit",
    "slot_lost", "sandbox_error",
]  # fmt: skip
LAYERS = ("namespaces", "unprivileged", "seccomp", "rlimits")


class SandboxUnavailable(RuntimeError):
    """A requested isolation layer does not work on this machine."""


class _SlotLost(Exception):
    """The slot died or stopped answering during a run."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use.

    wall_s: wall-clock time from the run's start (its namespaces' set-up, ~2 ms) to its exit.
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

    def run_limits(self) -> dict[str, int]:
        """The limits as the slot applies them."""
        disk = self.disk_mb << 20
        return {
            "cpu_s": self.cpu_s or max(1, math.ceil(self.wall_s)),
            "memory_bytes": self.memory_mb << 20,
            "processes": self.processes + 1,  # the run's init runs as the same uid
            "open_files": self.open_files,
            "file_bytes": disk,
            "disk_bytes": disk,
            "inodes": 4096,
            "output_bytes": self.output_bytes,
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

    workers: runs at once, one slot process each (null = the CPUs this process may use).
    namespaces: run each program in its own mount, pid, network, IPC and UTS namespaces with
        a root that hides the host. If the kernel refuses them, building the sandbox fails
        and says so; false runs programs in a host directory (weaker: docs/SANDBOX.md).
    seccomp: load a syscall filter (needs libseccomp.so.2); false skips it.
    prewarm: Python programs run in a fork of the slot's interpreter, which has the harness
        and the modules LiveCodeBench's prelude imports loaded (~1 ms to start); false execs a
        fresh `python -I -S` per program (~10-20 ms; benchmarks/bench_sandbox.py measures both).
    python: the interpreter the slots and programs run with (null = this process's own).
    uid_base: with root, slot i runs its programs as uid uid_base + 64 * pid + i, pid this
        process's id (no such user needs to exist; it owns nothing on the host; at most 64
        workers).
    ro_paths: extra host paths programs may read (bound read-only at the same place).
    """

    workers: int | None = None
    namespaces: bool = True
    seccomp: bool = True
    prewarm: bool = True
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


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise _SlotLost("stopped answering")
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            raise _SlotLost("exited")
        buf += chunk
    return bytes(buf)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _uid_pids(uid: int) -> list[int]:
    """Processes of `uid` (zombies included)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                line = next((x for x in f if x.startswith("Uid:")), "")
        except OSError:
            continue
        if line.split()[1:2] == [str(uid)]:
            pids.append(int(name))
    return pids


class _Slot:
    """One slot process, driven from one executor thread at a time."""

    def __init__(self, sandbox: Sandbox, index: int) -> None:
        self.sandbox = sandbox
        self.index = index
        self.uid = sandbox.first_uid + index if sandbox.root else None
        self.proc: subprocess.Popen | None = None
        self.write_lock = threading.Lock()
        self.layers: list[str] = []
        self.starts = 0

    def ensure_started(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self.kill()
            self.start()

    def start(self) -> None:
        """Start the slot process and wait for its root, filter and warm interpreter."""
        sandbox = self.sandbox
        self.proc = subprocess.Popen(
            [sandbox.python, "-I", "-S", "-B", str(SLOT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            env={},
            cwd="/",
            start_new_session=True,
        )
        self.starts += 1
        settings = {
            "namespaces": sandbox.config.namespaces,
            "seccomp": SECCOMP_LIBRARY if sandbox.config.seccomp else None,
            "uid": self.uid,
            "gid": self.uid,
            "ro_paths": list(sandbox.ro_paths),
            "prewarm": HARNESS.read_text(encoding="utf-8") if sandbox.config.prewarm else None,
        }
        try:
            answer = json.loads(self.exchange(marshal.dumps(settings), STARTUP_TIMEOUT_S))
        except _SlotLost as exc:
            why = f"the slot {exc}: {self._stderr()}"
            self.kill()
            raise SandboxUnavailable(why) from None
        if "setup_error" in answer:
            self.kill()
            raise SandboxUnavailable(answer["setup_error"])
        self.layers = answer["layers"]

    def exchange(self, body: bytes, timeout_s: float, job: _Job | None = None) -> bytes:
        """Send a frame and wait for the answer's frame. With a job: unless it was cancelled,
        and so that cancelling it from now on aborts the run."""
        assert self.proc is not None and self.proc.stdin is not None
        with job.lock if job is not None else contextlib.nullcontext():
            if job is not None and job.cancelled:
                raise _Cancelled
            with self.write_lock:
                try:
                    _write_all(self.proc.stdin.fileno(), len(body).to_bytes(4, "big") + body)
                except OSError:
                    raise _SlotLost("exited") from None
            if job is not None:
                job.slot = self
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        size = int.from_bytes(_read_exact(fd, 4, deadline), "big")
        return _read_exact(fd, size, deadline)

    def abort(self) -> None:
        """Kill the run in progress (its caller is gone); the slot stays."""
        with self.write_lock, contextlib.suppress(OSError, AttributeError, ValueError):
            _write_all(self.proc.stdin.fileno(), ABORT.to_bytes(4, "big"))

    def _stderr(self) -> str:
        """What the slot wrote to stderr (it writes only when it fails)."""
        if self.proc is None or self.proc.stderr is None:
            return ""
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)
        try:
            return (os.read(fd, 1 << 16) or b"").decode(errors="replace").strip()[-1000:]
        except (BlockingIOError, OSError):
            return ""

    def kill(self) -> None:
        """SIGKILL the slot's process group (its server, and with it every run's namespace)
        and wait until no process of the slot's uid is left."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        self.proc = None
        if self.uid is not None:
            deadline = time.monotonic() + 10.0
            while _uid_pids(self.uid) and time.monotonic() < deadline:
                time.sleep(0.01)
            if left := _uid_pids(self.uid):
                logger.error("sandbox slot %d: processes %s of uid %d outlived it",
                             self.index, left, self.uid)  # fmt: skip

    def close(self) -> None:
        """Let the slot exit on EOF (it finishes nothing: no run is in flight), then kill."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.kill()


class _Cancelled(Exception):
    pass


@dataclass
class _Job:
    """One run's request. `slot` is set while its request is in a slot; `lock` orders a
    cancel against that, so an abort never reaches a slot that has moved on to another run."""

    request: bytes
    wall_s: float
    limits: SandboxLimits
    cancelled: bool = False
    slot: _Slot | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.slot is not None:
                self.slot.abort()

    def release(self) -> None:
        with self.lock:
            self.slot = None


class Sandbox:
    """Runs programs under `config` (see the module docstring). Construction starts a slot,
    probes the requested layers with a trivial program and raises `SandboxUnavailable` naming
    the one that does not work. `close()` (or `aclose()`) stops the slots."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.config.limits.validate()
        self.workers = self.config.resolved_workers()
        self.python, prefix = _interpreter(self.config)
        self.root = os.geteuid() == 0
        self.first_uid = self.config.uid_base + 64 * os.getpid()
        if self.first_uid + 64 > 2**32 - 2:
            raise ValueError(f"sandbox uid_base={self.config.uid_base} leaves no room for uids")
        if not self.config.namespaces and not self.root:
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
        languages = tuple(p for lang in LANGUAGES.values() for p in lang.ro_paths)
        self.ro_paths = tuple(dict.fromkeys((*system, prefix, *languages, *self.config.ro_paths)))
        self._slots = [_Slot(self, i) for i in range(self.workers)]
        self._idle: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for slot in self._slots:
            self._idle.put(slot)
        # One thread per slot: a job never waits for a slot, and the threads (the parents of
        # the slot processes) live as long as the sandbox.
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox-slot")
        self._closed = False
        try:
            self.layers = self._probe()
        except BaseException:
            self.close()
            raise
        logger.info("sandbox: %s, %d workers", ", ".join(self.layers), self.workers)

    def _probe(self) -> list[str]:
        """Run `print(1)` once and return the layers the slot reports."""
        job = self._job("print(1)", "", get_language("python"), {"mode": "script"},
                        SandboxLimits(wall_s=30))  # fmt: skip
        result = self._pool.submit(self._run_job, job).result()
        if result.status != "ok" or result.stdout.strip() != "1":
            why = result.error or f"{result.status}: {result.stderr.strip()[-500:]}"
            hint = (
                "the kernel may refuse unprivileged namespaces (sysctl "
                "user.max_user_namespaces, kernel.unprivileged_userns_clone, or a container's "
                "seccomp profile): allow them, or set namespaces=false (weaker isolation, "
                "docs/SANDBOX.md)"
                if self.config.namespaces
                else ""
            )
            if self.config.seccomp and "libseccomp" in why:
                hint = (
                    "install libseccomp2 (Debian/Ubuntu: apt-get install libseccomp2) or set "
                    "seccomp=false"
                )
            raise SandboxUnavailable(f"the sandbox does not work here: {why}; {hint}".rstrip("; "))
        wanted = {"namespaces": self.config.namespaces, "seccomp": self.config.seccomp}
        missing = [name for name, on in wanted.items() if on and name not in result.layers]
        if missing:
            raise SandboxUnavailable(f"sandbox layers requested but not active: {missing}")
        return result.layers

    # ------------------------------------------------------------------ running

    async def run(
        self,
        program: str,
        stdin: str = "",
        *,
        language: str | Language = "python",
        spec: dict | None = None,
        limits: SandboxLimits | None = None,
    ) -> RunResult:
        """Run `program` with `stdin` as its input, once a slot is free. Cancelling the call
        kills the run."""
        lang = get_language(language) if isinstance(language, str) else language
        job = self._job(program, stdin, lang, spec or {"mode": "script"}, limits)
        future = self._pool.submit(self._run_job, job)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            job.cancel()
            raise

    def run_blocking(self, program: str, stdin: str = "", **kwargs) -> RunResult:
        """`run` for callers without an event loop (benchmarks, tools)."""
        lang = kwargs.pop("language", "python")
        lang = get_language(lang) if isinstance(lang, str) else lang
        job = self._job(program, stdin, lang, kwargs.pop("spec", None) or {"mode": "script"},
                        kwargs.pop("limits", None))  # fmt: skip
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
        return self._pool.submit(self._run_job, job).result()

    def _job(self, program, stdin, lang: Language, spec: dict, limits) -> _Job:
        if self._closed:
            raise RuntimeError("the sandbox is closed")
        if spec["mode"] not in lang.modes:
            raise ValueError(f"language {lang.name} cannot run mode {spec['mode']!r}")
        missing = [p for p in lang.ro_paths if p not in self.ro_paths]
        if missing:
            raise ValueError(
                f"language {lang.name} needs {missing}, which the slots do not show: register "
                "it in gspo_megatron.sandbox.LANGUAGES before building the sandbox, or add the "
                "paths to SandboxConfig.ro_paths"
            )
        limits = limits or self.config.limits
        limits.validate()
        env = {"PATH": "/usr/bin:/bin", "HOME": "/sandbox", "TMPDIR": "/sandbox"}
        env["LANG"] = "C.UTF-8"
        request = {
            "files": lang.files(program, spec),
            "stdin": stdin,
            "argv": [a.replace("{python}", self.python) for a in lang.argv],
            "env": env,
            "limits": limits.run_limits(),
            "wall_s": float(limits.wall_s),
            "in_process": self.config.prewarm and lang.prewarm,
        }
        return _Job(marshal.dumps(request), float(limits.wall_s), limits)

    def _run_job(self, job: _Job) -> RunResult:
        """On a pool thread: take a slot (there is always one: a thread per slot), run, give
        it back."""
        slot = self._idle.get_nowait()
        try:
            if job.cancelled:
                return RunResult("sandbox_error", error="cancelled before it ran")
            try:
                slot.ensure_started()
            except SandboxUnavailable as exc:
                return RunResult("sandbox_error", error=str(exc))
            try:
                body = slot.exchange(job.request, job.wall_s + WATCHDOG_GRACE_S, job)
            except _Cancelled:
                return RunResult("sandbox_error", error="cancelled before it ran")
            except _SlotLost as exc:
                why = f"sandbox slot {slot.index} {exc} during the run: {slot._stderr()}"
                logger.warning("%s; rebuilding it", why.rstrip(": "))
                slot.kill()
                return RunResult("slot_lost", error=why.rstrip(": "))
            finally:
                job.release()
            return self._result(body, job.limits)
        finally:
            self._idle.put(slot)

    def _result(self, body: bytes, limits: SandboxLimits) -> RunResult:
        size = int.from_bytes(body[:4], "big")
        header = json.loads(body[4 : 4 + size])
        out_end = 4 + size + header["stdout"]
        stdout = body[4 + size : out_end].decode("utf-8", errors="replace")
        stderr = body[out_end:].decode("utf-8", errors="replace")[-STDERR_KEPT:]
        base = dict(stdout=stdout, stderr=stderr, wall_s=header["wall_s"])
        killed, status = header["killed"], header["status"]
        if killed in ("timeout", "output_limit"):
            return RunResult(killed, **base, layers=list(self.layers))
        if killed is not None:
            return RunResult("sandbox_error", **base, error=f"the run was {killed}")
        if status is None or "setup_error" in status:
            why = (status or {}).get("setup_error") or (
                f"the run's init exited without a status: {stderr[-300:]!r}"
            )
            return RunResult("sandbox_error", **base, error=why)
        code, sig = status.get("exit_code"), status.get("signal")
        cpu_limit = limits.run_limits()["cpu_s"]
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

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Stop the slots (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for slot in self._slots:
            slot.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
