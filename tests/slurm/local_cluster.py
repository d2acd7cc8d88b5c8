"""A one-node Slurm cluster on localhost for tests (docs/ARCHITECTURE.md §5), installed with apt
if missing.

Debian's slurmctld, slurmd, slurm-client and munge (Slurm 22.05) run as root without systemd:
munged as the munge user, then slurmctld, then `slurmd -N localhost`. The cluster gets its own
slurm.conf, ports, state and log files in a fresh directory; commands reach it through
`SLURM_CONF` (see `LocalSlurm.env`), so nothing under /etc/slurm is touched. The node offers two
CPUs and two GPU "generic resources" without devices, so scripts that ask for
`--gpus-per-node` are accepted (nothing checks that a GPU exists; the ranks use gloo on CPU).

    python tests/slurm/local_cluster.py install   # apt-get the packages (root), for .ci/run
    python tests/slurm/local_cluster.py start DIR # start a cluster; prints `export SLURM_CONF=`
    python tests/slurm/local_cluster.py stop DIR
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged")
MUNGE_RUN = Path("/run/munge")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says why."""


def _which(name: str) -> str | None:
    return shutil.which(name) or next(
        (str(p) for d in ("/usr/sbin", "/usr/bin", "/sbin") if (p := Path(d) / name).is_file()),
        None,
    )


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if _which(b) is None]


def install(timeout: float = 600) -> None:
    """apt-get install the packages when a binary is missing (root, or passwordless sudo)."""
    if not missing_binaries():
        return
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(
            f"Slurm is not installed ({missing_binaries()}) and apt-get is not available"
        )
    sudo: list[str] = []
    if os.geteuid() != 0:
        if (
            shutil.which("sudo") is None
            or subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode
        ):
            raise SlurmUnavailable("installing Slurm needs root (or passwordless sudo)")
        sudo = ["sudo", "-n"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = [*sudo, "apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode:  # stale package lists: refresh once
        subprocess.run(
            [*sudo, "apt-get", "update", "-q"], capture_output=True, env=env, timeout=timeout
        )
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode or missing_binaries():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise SlurmUnavailable(f"apt-get install {' '.join(PACKAGES)} failed: {' | '.join(tail)}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SLURM_CONF = """\
# One-node test cluster (tests/slurm/local_cluster.py); docs/ARCHITECTURE.md §5.
ClusterName=gspo-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
# Finished jobs stay visible to scontrol (no accounting database here).
MinJobAge=3600
KillWait=30
GresTypes=gpu
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:{gpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    """Start/stop a private one-node cluster whose files live in `directory`."""

    def __init__(self, directory: str | Path, cpus: int = 2, gpus: int = 2) -> None:
        self.dir = Path(directory).resolve()
        self.cpus, self.gpus = cpus, gpus
        self.conf = self.dir / "slurm.conf"
        self.started_munged = False

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm commands that talk to this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self, timeout: float = 60) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("starting slurmd needs root")
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(f"Slurm binaries missing: {missing}")
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(
            SLURM_CONF.format(
                dir=self.dir,
                ctld_port=_free_port(),
                slurmd_port=_free_port(),
                cpus=self.cpus,
                gpus=self.gpus,
            )
        )
        self._write_gres_conf()
        self._start_munged()
        self._run(["slurmctld", "-f", str(self.conf), "-i"])
        self._run(["slurmd", "-f", str(self.conf), "-N", "localhost"])
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env
            ).stdout.strip()
            if out in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise SlurmUnavailable(
            f"the node never became idle (sinfo: {out!r}); logs: {self.log_tail()}"
        )

    def stop(self) -> None:
        for name in ("slurmd", "slurmctld"):
            _kill_pidfile(self.dir / f"{name}.pid")
        if self.started_munged:
            _kill_pidfile(MUNGE_RUN / "munged.pid")

    def log_tail(self, lines: int = 20) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.dir / name
            if path.is_file():
                out.append(f"--- {name}\n" + "\n".join(path.read_text().splitlines()[-lines:]))
        return "\n".join(out)

    def _write_gres_conf(self) -> None:
        # slurmd counts GPUs by their device files: stand-ins with /dev/null's numbers (a
        # regular file also works, with an error line per file in slurmd.log).
        for i in range(self.gpus):
            device = self.dir / f"gpu{i}"
            if not device.exists():
                try:
                    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
                except OSError:
                    device.touch()
        files = f"{self.dir}/gpu[0-{self.gpus - 1}]" if self.gpus > 1 else f"{self.dir}/gpu0"
        (self.dir / "gres.conf").write_text(f"NodeName=localhost Name=gpu File={files}\n")

    def _run(self, cmd: list[str]) -> None:
        proc = subprocess.run(
            [_which(cmd[0]) or cmd[0], *cmd[1:]],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
        )
        if proc.returncode:
            raise SlurmUnavailable(
                f"{' '.join(cmd)} failed ({proc.returncode}): "
                f"{proc.stderr.strip()} {self.log_tail()}"
            )

    def _start_munged(self) -> None:
        if _munge_works():
            return
        MUNGE_RUN.mkdir(parents=True, exist_ok=True)
        shutil.chown(MUNGE_RUN, "munge", "munge")
        MUNGE_RUN.chmod(0o755)
        key = Path("/etc/munge/munge.key")
        if not key.is_file():
            subprocess.run(
                [_which("mungekey") or "mungekey", "--create"], check=True, capture_output=True
            )
            shutil.chown(key, "munge", "munge")
        proc = subprocess.run(
            ["runuser", "-u", "munge", "--", _which("munged") or "munged"],
            capture_output=True,
            text=True,
        )
        if proc.returncode or not _munge_works():
            raise SlurmUnavailable(f"munged did not start: {proc.stderr.strip()}")
        self.started_munged = True


def _munge_works() -> bool:
    munge, unmunge = _which("munge"), _which("unmunge")
    if not munge or not unmunge:
        return False
    cred = subprocess.run([munge, "-n"], capture_output=True)
    if cred.returncode:
        return False
    return subprocess.run([unmunge], input=cred.stdout, capture_output=True).returncode == 0


def _kill_pidfile(path: Path, timeout: float = 10) -> None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return
    try:
        os.kill(pid, 15)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, 9)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("install", "start", "stop"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        if argv[0] == "install":
            install()
            print("slurm: installed")
        elif argv[0] == "start":
            cluster = LocalSlurm(argv[1])
            cluster.start()
            print(f"export SLURM_CONF={cluster.conf}")
        else:
            LocalSlurm(argv[1]).stop()
    except SlurmUnavailable as err:
        print(f"slurm: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
