"""Throwing a history's faults at a running job: signals to its processes and to the SGLang
stand-in, the filesystem's state (tests/faults/inject reads it from a control file), and the
damage a resume must move aside. Injected faults are armed through the attempt's environment
(`injected_env`) and report themselves in a log when they fire."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
from faults.chaos.jobs import Job
from faults.chaos.schedule import Fault
from launch import REPO

_RESUMED = re.compile(r"\[gspo-megatron\] (?:resumed at step (\d+)|starting from step 0)")


class Disk:
    """The run's filesystem as the processes under GSPO_CHAOS_FS see it: normal, full, or slow,
    for a while (a timer puts it back)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.control = root.parent / f"{root.name}.fs_state"
        self._timer: threading.Timer | None = None

    def env(self) -> dict[str, str]:
        return {"GSPO_CHAOS_FS": str(self.control), "GSPO_CHAOS_FS_ROOT": str(self.root)}

    def set(self, state: str, seconds: float) -> None:
        self.clear()
        self.control.write_text(state)
        self._timer = threading.Timer(seconds, self.clear)
        self._timer.daemon = True
        self._timer.start()

    def clear(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.control.unlink(missing_ok=True)


class Server:
    """The SGLang stand-in of a history, started by the harness (as an attached server), killed
    or hung by faults; a killed one is started again on its port after a while, as a
    supervisor would."""

    def __init__(self, directory: Path) -> None:
        sys.path.insert(0, str(REPO / "tests" / "rollout"))
        import sglang_test_server

        self._module = sglang_test_server
        self.state_file = directory / "server_state.json"
        self.server = self._start(port=0)
        self.port = self.server.port
        self.url = self.server.url
        self._pending: list[threading.Timer] = []
        self.restarts = 0

    def _start(self, port: int):
        return self._module.start_fake_server(
            routed_experts=False,
            vocab_size=48,
            port=port,
            extra_args=["--state-file", str(self.state_file)],
        )

    def kill(self, seconds: float) -> None:
        self.server.proc.kill()
        self.server.proc.wait()
        self._later(seconds, self._restart)

    def hang(self, seconds: float) -> None:
        self.server.proc.send_signal(signal.SIGSTOP)
        self._later(seconds, lambda: self.server.proc.send_signal(signal.SIGCONT))

    def _restart(self) -> None:
        for _ in range(20):
            try:
                self.server = self._start(port=self.port)
                self.restarts += 1
                return
            except RuntimeError:  # the port not yet free
                time.sleep(0.5)

    def _later(self, seconds: float, action) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        timer.start()
        self._pending.append(timer)

    def settle(self) -> None:
        """Whatever is pending happens now: a hung server continues, a killed one is back."""
        for timer in self._pending:
            if timer.is_alive():
                timer.cancel()
                timer.function()
        self._pending.clear()
        if self.server.proc.poll() is None:
            self.server.proc.send_signal(signal.SIGCONT)
        else:
            self._restart()

    def stop(self) -> None:
        self.settle()
        self.server.proc.send_signal(signal.SIGCONT)
        self.server.stop()


def injected_env(faults: list[Fault], fault_log: Path) -> tuple[str | None, int | None, dict]:
    """(GSPO_FAULTS, GSPO_FAULT_RANK, extra environment) of an attempt's injected faults."""
    injected = [f for f in faults if f.inject]
    if not injected:
        return None, None, {}
    # one injected fault an attempt (the schedule draws at most one: the others are external)
    fault = injected[0]
    return fault.inject, fault.rank, {"GSPO_FAULT_LOG": str(fault_log)}


def damage_newest_checkpoint(run_dir: Path) -> str | None:
    """Flip 4 KiB in the middle of the newest checkpoint's first data file (same size): only its
    checksum can tell; a resume must move it aside."""
    newest = sorted((run_dir / "checkpoints").glob("step_*"))
    newest = [p for p in newest if "tmp" not in p.name]
    if not newest:
        return None
    data = sorted(newest[-1].glob("__*.distcp"))[0]
    raw = bytearray(data.read_bytes())
    middle = len(raw) // 2
    raw[middle : middle + 4096] = bytes(b ^ 0xFF for b in raw[middle : middle + 4096])
    data.write_bytes(bytes(raw))
    return str(data.relative_to(run_dir))


class Thrower:
    """Throws one attempt's external faults at `job` when their triggers come; `thrown` lists
    what was done."""

    def __init__(self, job: Job, run_dir: Path, steps: int, disk: Disk, server: Server | None):
        self.job, self.run_dir, self.steps = job, run_dir, steps
        self.disk, self.server = disk, server
        self.thrown: list[str] = []
        self._thread: threading.Thread | None = None

    def start(self, faults: list[Fault]) -> None:
        """Throw the external faults one after another, in the order of their triggers (a
        stop lasts before the next is thrown), so that the kill ending an attempt comes last."""
        due = sorted((f for f in faults if not f.inject), key=lambda f: (f.at_records, f.delay_s))
        self._thread = threading.Thread(target=self._throw_all, args=(due,), daemon=True)
        self._thread.start()

    def _throw_all(self, faults: list[Fault]) -> None:
        for fault in faults:
            self._throw_when_due(fault)

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _records(self) -> int:
        try:
            return (self.run_dir / "metrics.jsonl").read_text().count("\n")
        except OSError:
            return 0

    def _resumed_at(self) -> int | None:
        match = _RESUMED.search(self.job.log.read_text(errors="replace"))
        if match is None:
            return None
        return int(match.group(1) or 0)

    def _wait(self, fault: Fault) -> bool:
        """Until the fault's trigger; False when the job ended first."""
        while self.job.running():
            if fault.at_records == 0:
                if self.job.worker(fault.rank) is not None:
                    break
            else:
                resumed = self._resumed_at()
                if resumed is not None:
                    target = resumed + min(fault.at_records, max(self.steps - resumed - 1, 0))
                    if self._records() >= target:
                        break
            time.sleep(0.1)
        else:
            return False
        time.sleep(fault.delay_s)
        return self.job.running()

    def _throw_when_due(self, fault: Fault) -> None:
        if not self._wait(fault):
            return
        try:
            done = self._throw(fault)
        except psutil.Error:  # the process ended meanwhile: what was done still counts
            done = "its target ended while it was thrown"
        if done:
            self.thrown.append(f"{fault.kind}: {done}")

    def _throw(self, fault: Fault) -> str | None:
        kind = fault.kind
        if kind in ("kill_rank", "stop_rank"):
            worker = self.job.worker(fault.rank)
            if worker is None:
                return None
            if kind == "kill_rank":
                worker.kill()
                return f"rank {fault.rank} (pid {worker.pid}) killed at {self._records()} records"
            worker.suspend()
            time.sleep(fault.seconds)
            worker.resume()
            return f"rank {fault.rank} stopped for {fault.seconds} s"
        if kind == "kill_launcher":
            try:
                os.kill(self.job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
            return f"launcher killed at {self._records()} records"
        if kind == "disk_full":
            self.disk.set("full", fault.seconds)
            return f"disk full for {fault.seconds} s"
        if kind == "slow_fs":
            self.disk.set(f"slow {fault.slow_s}", fault.seconds)
            return f"{fault.slow_s} s an operation for {fault.seconds} s"
        if kind == "server_kill" and self.server is not None:
            self.server.kill(fault.seconds)
            return f"server killed, back after {fault.seconds} s"
        if kind == "server_hang" and self.server is not None:
            self.server.hang(fault.seconds)
            return f"server stopped for {fault.seconds} s"
        return None


def fired(fault_log: Path) -> list[str]:
    """Injected faults that fired (tests/faults/inject logs each before it acts)."""
    try:
        return fault_log.read_text().split()
    except OSError:
        return []
