"""torchrun for gspo-train, where SIGTERM and SIGINT mean "checkpoint and stop", exit 0.

    python -m gspo_megatron.torchrun --nproc-per-node 2 -m gspo_megatron.train parallel=ep2 ...

Takes torchrun's arguments unchanged. Plain torchrun answers SIGTERM (or Ctrl-C) by signalling
its workers, killing them 30 s later, and exiting 1 with a traceback, even when every worker
checkpointed in time and exited 0; its workers run in their own sessions, so a terminal's Ctrl-C
reaches torchrun alone. Here the first SIGTERM/SIGINT is passed to every worker, torchrun keeps
waiting for them without a deadline (a large model's checkpoint can take minutes), and the exit
status is theirs: 0 after a checkpoint. A second signal kills the workers at once.

On Slurm, slurm/*.sbatch use `python -m gspo_megatron.slurm torchrun`, where slurmstepd signals
every process of the step itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence

# torchrun installs its own handlers only for these; SIGTERM and SIGINT stay ours.
_TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"
# The launcher's pid, for its workers (their parent): see die_with_launcher.
LAUNCHER_PID = "GSPO_LAUNCHER_PID"


def die_with_launcher() -> None:
    """In a torchrun worker (gspo-train, gspo-eval): be killed with the launcher. The job's
    store dies with it, which the peer watchdog notices once training runs; a worker still
    starting (joining the process group, building the model) would wait for the store for
    minutes, and a run started again in its directory would find it there."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    from gspo_megatron.isolation.worker import die_with_parent

    launcher = os.environ.get(LAUNCHER_PID)
    die_with_parent(int(launcher) if launcher else None)


def forward_stop_signals() -> None:
    """Install handlers that pass the first SIGTERM/SIGINT to every descendant process and
    SIGKILL them on the second."""
    import psutil

    received: list[int] = []

    def forward(signum, frame) -> None:
        received.append(signum)
        second = len(received) > 1
        name = signal.Signals(signum).name
        if second:
            print(f"gspo-torchrun: second {name}: killing the workers", file=sys.stderr)
        else:
            print(
                f"gspo-torchrun: {name}: the workers checkpoint after their current step "
                "(send it again to kill them now)",
                file=sys.stderr,
            )
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(signal.SIGKILL if second else signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    os.environ["PET_SIGNALS_TO_HANDLE"] = _TORCHRUN_SIGNALS
    os.environ[LAUNCHER_PID] = str(os.getpid())  # torchrun's agent runs in this process
    # torchrun's own default (one thread per worker), set here so it does not print a banner.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    forward_stop_signals()
    try:
        torchrun_main(list(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as err:
        exits = {rank: f.exitcode for rank, f in err.failures.items()}
        print(
            f"gspo-torchrun: {len(exits)} worker(s) failed ({describe_exits(exits)}); "
            "see their messages above",
            file=sys.stderr,
        )
        return 1
    return 0


def describe_exits(exits: dict[int, int]) -> str:
    """The ranks by how each ended, e.g. "rank 3: killed (SIGKILL); ranks 0, 1, 2: SIGTERM"
    (torchrun sends SIGTERM to the others once one fails)."""
    by_code: dict[int, list[int]] = {}
    for rank, code in sorted(exits.items()):
        by_code.setdefault(code, []).append(rank)
    parts = []
    for code, ranks in sorted(by_code.items(), key=lambda item: item[1][0]):
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
            how = f"killed ({name})" if name == "SIGKILL" else f"{name}"
        else:
            how = f"exit {code}"
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {how}")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
