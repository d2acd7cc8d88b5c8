"""One gspo-train job (gspo_megatron.torchrun with N ranks) as the storm and the soak drive it:
started with the same command every time (as Slurm's requeue would), its processes watched while
it runs (so those that outlive it are found, orphans included), its output kept in a file."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from launch import REPO, gspo_train_command, gspo_train_env

from gspo_megatron import files

# What a user may see from a run besides its one-line errors: notes, progress, and the lines
# torchrun's agent logs when a worker fails (its own, before gspo-torchrun's summary).
_NOTE = re.compile(r"^\[gspo-megatron\] ")
_ERROR = re.compile(r"^gspo-(train|torchrun|eval): ")
_AGENT = re.compile(r"^[IWE]\d{4} [\d:.]+ \d+ \S*torch/distributed/elastic/")


@dataclass
class Outcome:
    """How one start of a job ended."""

    returncode: int
    seconds: float
    output: str
    survivors: list[str] = field(default_factory=list)  # processes alive after it ended
    timed_out: bool = False  # killed by the harness past its timeout

    @property
    def errors(self) -> list[str]:
        return [x for x in self.output.splitlines() if _ERROR.match(x)]


class Job:
    """`gspo-train OVERRIDES` under gspo_megatron.torchrun with `nproc` ranks (a plain
    process for one), output to `log`. `faults` arms tests/faults/inject in every rank."""

    def __init__(
        self,
        run_dir: Path,
        overrides: list[str],
        nproc: int,
        log: Path,
        faults: str | None = None,
        fault_rank: int | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.log = log
        self.started = time.monotonic()
        env = {**gspo_train_env(faults, fault_rank), **(extra_env or {})}
        self._out = open(log, "w")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(
            gspo_train_command(run_dir, overrides, nproc),
            env=env,
            cwd=REPO,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self._seen: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Every process the job starts, as it appears (orphans keep their entry)."""
        try:
            root = psutil.Process(self.proc.pid)
        except psutil.Error:
            return
        while not self._done.is_set():
            try:
                found = [root, *root.children(recursive=True)]
            except psutil.Error:
                found = []
            with self._lock:
                for p in found:
                    self._seen.setdefault(p.pid, p)
            if self.proc.poll() is not None:
                return
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        """The job's processes still running (zombies are gone)."""
        with self._lock:
            seen = list(self._seen.values())
        alive = []
        for p in seen:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                continue
        return alive

    def worker(self, rank: int) -> psutil.Process | None:
        """The process of `rank` (a torchrun worker whose RANK is `rank`), if it runs."""
        for p in self.processes():
            try:
                ours = p.pid != self.proc.pid and "gspo_megatron.train" in " ".join(p.cmdline())
                if ours and p.environ().get("RANK") == str(rank):
                    return p
            except psutil.Error:
                continue
        return None

    def running(self) -> bool:
        return self.proc.poll() is None

    def finish(self, timeout: float, grace: float = 30.0) -> Outcome:
        """Wait for the launcher (killing the job past `timeout`), then up to `grace` seconds
        for every process it started; those still running then are killed and named."""
        try:
            self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
            self.proc.wait()
        seconds = time.monotonic() - self.started
        self._done.set()
        self._watcher.join()
        deadline = time.monotonic() + grace
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = []
        for p in self.processes():
            try:
                survivors.append(f"pid {p.pid}: {' '.join(p.cmdline())[:160]}")
                p.kill()
            except psutil.Error:
                continue
        self._out.close()
        output = self.log.read_text(errors="replace")
        return Outcome(self.proc.returncode, seconds, output, survivors, timed_out)

    def kill(self) -> None:
        for p in self.processes():
            try:
                p.kill()
            except psutil.Error:
                continue


def unclear_lines(output: str) -> list[str]:
    """Lines of a job's output that are neither a note, one of our one-line errors, nor
    torchrun's agent log: a traceback or a library's message reaching the user."""
    if "Traceback (most recent call last)" in output:
        start = output.index("Traceback (most recent call last)")
        return [output[start : start + 2000]]
    return [
        x
        for x in output.splitlines()
        if x.strip() and not (_NOTE.match(x) or _ERROR.match(x) or _AGENT.match(x))
    ]


def temporaries(*roots: Path) -> list[str]:
    """Temporaries (gspo_megatron.files' names) left anywhere under `roots`."""
    return [
        str(p)
        for root in roots
        if root.is_dir()
        for p in sorted(root.rglob("*"))
        if files.is_temporary(p)
    ]
