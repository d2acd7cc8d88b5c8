"""The start-up storm: a job of N ranks (oversubscribed on the machine's cores, tiny model)
started again and again against one run directory, fresh each time or the same existing one.
Every start must succeed, or fail with one clear line for a real reason; none may leave a
temporary or a process behind.

    fresh:    start k in a new directory `fresh_k` (trainer.steps=1): every rank finds no
              run there, rank 0 creates it
    existing: every start in `existing`, start k with trainer.steps=k: it resumes the run the
              previous start left at step k-1, trains one step and checkpoints

The fast test (tests/faults/test_startup_storm.py) runs a few starts; benchmarks/startup_storm.py
the full storm.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from faults.chaos.jobs import Job, temporaries, unclear_lines
from launch import TINY_RUN

TINY = [
    "parallel=ep2",
    "algorithm.num_minibatches=1",  # 8 responses a step: one minibatch of one per rank at 8
    *TINY_RUN,
]


@dataclass
class Start:
    kind: str
    index: int
    returncode: int
    seconds: float
    problems: list[str]  # empty when the start is as it must be


def start_once(root: Path, kind: str, index: int, nproc: int, timeout: float = 600) -> Start:
    root.mkdir(parents=True, exist_ok=True)
    run_dir = root / (f"fresh_{index}" if kind == "fresh" else "existing")
    steps = 1 if kind == "fresh" else index + 1
    log = root / f"{kind}_{index}.log"
    job = Job(run_dir, [*TINY, f"trainer.steps={steps}"], nproc, log)
    outcome = job.finish(timeout=timeout)
    problems = [f"ran past {timeout:.0f} s"] if outcome.timed_out else []
    if outcome.returncode != 0:
        if not outcome.errors:
            problems.append(f"exit {outcome.returncode} without a one-line error")
        problems += [f"unclear output: {x}" for x in unclear_lines(outcome.output)[:5]]
        problems.append(f"failed (exit {outcome.returncode}): {' | '.join(outcome.errors[:3])}")
    problems += [f"left running: {p}" for p in outcome.survivors]
    problems += [f"left behind: {p}" for p in temporaries(run_dir)]
    return Start(kind, index, outcome.returncode, outcome.seconds, problems)


def storm(root: Path, nproc: int, starts: int, kinds=("fresh", "existing"), report=print):
    """`starts` starts of each kind, one after another; each Start as it ends to `report`."""
    results = []
    for kind in kinds:
        for index in range(starts):
            result = start_once(root, kind, index, nproc)
            report(result)
            results.append(result)
    return results
