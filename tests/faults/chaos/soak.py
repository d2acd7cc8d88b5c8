"""The chaos soak: histories drawn from a seed (tests/faults/chaos/schedule.py), each a
multi-rank gspo-train run restarted by the same command after every failure, as Slurm's requeue
would, while its faults are thrown; then the invariants (invariants.py) are checked:

    every step recorded exactly once in metrics.jsonl, and every record ever seen there still
    there or in metrics.superseded.jsonl; the final records and weights equal an uninterrupted
    run's with the same seed where generation is deterministic (embedded engine, sync); every
    checkpoint under its final name complete; no process of the job left running; no temporary
    left; every failure the user saw one clear line (no traceback, no stray output).

    python -m faults.chaos.soak --seed 1 --faults 12 --out /tmp/soak   (from tests/, or
    benchmarks/chaos_soak.py with the same arguments)

Prints the seed, one line per history and attempt, and a table; `--history K` replays history
K of a seed alone. Exit status 1 when any invariant was violated.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from faults.chaos import invariants
from faults.chaos.faults import Disk, Server, Thrower, damage_newest_checkpoint, fired, injected_env
from faults.chaos.jobs import Job, unclear_lines
from faults.chaos.schedule import History, draw_history

BASE = [
    "parallel=ep2",
    "algorithm.num_minibatches=1",
    "rollout.prompts_per_step=2",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "eval.every=4",
    "eval.heldout.problems=4",
    "logging.progress=false",
    "logging.tensorboard=false",
    "trainer.save_every=2",
    "trainer.keep_last=2",
    "trainer.peer_timeout_s=8",
    "seed=7",
]
ASYNC = ["rollout.mode=async", "rollout.queue_batches=2", "rollout.max_staleness=2"]
SGLANG = [
    "rollout=sglang",
    "rollout.sglang.weight_sync=disk",
    "+rollout.sglang.health_check_interval_s=0.2",
    "+rollout.sglang.max_retries=1",
    "+rollout.sglang.backoff_s=0.01",
    "+rollout.sglang.samples_per_request=8",
    "+rollout.sglang.recovery_timeout_s=15",
    "+rollout.sglang.liveness_timeout_s=2",
]
ATTEMPT_TIMEOUT_S = 900
EXTRA_ATTEMPTS = 4  # restarts allowed beyond one an attempt of faults (a disk still full, ...)


def overrides(history: History, run_dir: Path, server: Server | None) -> list[str]:
    out = [*BASE, f"trainer.steps={history.steps}"]
    if history.mode == "async":
        out += ASYNC
    if server is not None:
        weights = run_dir.parent / "weights"
        out += [
            *SGLANG,
            f"+rollout.sglang.urls=[{server.url}]",
            f"+rollout.sglang.disk_dir={weights}",
        ]
    return out


@dataclass
class Result:
    history: History
    attempts: int = 0
    restarts: int = 0
    thrown: list[str] = field(default_factory=list)  # "kind: what", in order
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def kinds(self) -> Counter:
        return Counter(t.split(":")[0] for t in self.thrown)


def reference_run(history: History, root: Path) -> Path:
    """The uninterrupted run with the history's configuration and seed (cached per ranks)."""
    ref = root / f"reference_{history.ranks}ranks_{history.steps}steps"
    if (ref / "run" / "checkpoints" / f"step_{history.steps:06d}").is_dir():
        return ref / "run"
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir(parents=True)
    job = Job(ref / "run", overrides(history, ref / "run", None), history.ranks, ref / "log")
    outcome = job.finish(timeout=ATTEMPT_TIMEOUT_S)
    if outcome.returncode != 0:
        raise RuntimeError(f"the reference run failed: {outcome.output[-3000:]}")
    return ref / "run"


def run_history(history: History, root: Path, report=print) -> Result:
    """Run `history` in `root` (a fresh directory) until it completes; check the invariants."""
    t0 = time.monotonic()
    root.mkdir(parents=True)
    disk = Disk(root / "disk")
    disk.root.mkdir()
    run_dir = disk.root / "run"
    server = Server(root) if history.engine == "sglang" else None
    result = Result(history)
    seen: set[str] = set()
    command = overrides(history, run_dir, server)
    try:
        limit = len(history.attempts) + EXTRA_ATTEMPTS
        for attempt in range(limit):
            faults = history.attempts[attempt] if attempt < len(history.attempts) else []
            result.attempts += 1
            done = _attempt(history, attempt, faults, command, run_dir, disk, server, root, result)
            seen |= set(invariants.complete_lines(run_dir / "metrics.jsonl"))
            if done:
                break
            result.restarts += 1
            if server is not None and attempt >= len(history.attempts):
                server.settle()  # past the faults: let the run finish
            if attempt >= len(history.attempts):
                disk.clear()
        else:
            result.violations.append(f"the run did not complete in {limit} attempts")
    finally:
        disk.clear()
        if server is not None:
            server.stop()
    result.violations += invariants.every_step_once(run_dir, history.steps)
    result.violations += invariants.nothing_lost(run_dir, seen)
    result.violations += invariants.checkpoints_complete(run_dir)
    result.violations += invariants.no_temporaries(disk.root)
    if history.deterministic:
        reference = reference_run(history, root.parent)
        result.violations += invariants.same_as_reference(run_dir, reference, history.steps)
    result.seconds = time.monotonic() - t0
    return result


def _attempt(history, attempt, faults, command, run_dir, disk, server, root, result) -> bool:
    """One start of the run with its faults; True when it completed. Violations of the
    per-attempt invariants (processes left, unclear failures, a hang) go to `result`."""
    fault_log = root / f"attempt_{attempt}.fired"
    inject, rank, env = injected_env(faults, fault_log)
    if any(f.damage_newest for f in faults):
        damaged = damage_newest_checkpoint(run_dir)
        if damaged:
            result.thrown.append(f"bad_file: flipped 4 KiB of {damaged}")
    job = Job(
        run_dir,
        command,
        history.ranks,
        root / f"attempt_{attempt}.log",
        faults=inject or "",  # the injector's directory on the path: it also arms the disk
        fault_rank=rank,
        extra_env={**env, **disk.env()},
    )
    thrower = Thrower(job, run_dir, history.steps, disk, server)
    thrower.start(faults)
    outcome = job.finish(timeout=ATTEMPT_TIMEOUT_S)
    thrower.join()
    thrown = thrower.thrown + [
        f"{f.kind}: {name}" for f in faults if f.inject for name in fired(fault_log)
    ]
    result.thrown += thrown
    where = f"attempt {attempt} ({', '.join(thrown) or 'no fault'})"
    for survivor in outcome.survivors:
        result.violations.append(f"{where}: left running: {survivor}")
    for line in unclear_lines(outcome.output)[:3]:
        result.violations.append(f"{where}: unclear output: {line[:300]}")
    if outcome.timed_out:
        result.violations.append(f"{where}: hung (ran past {ATTEMPT_TIMEOUT_S} s)")
    # A launcher the harness killed says nothing (its killer knows); its workers, which may
    # have finished by then, each print their line when they fail.
    launcher_killed = any(t.startswith("kill_launcher") for t in thrown)
    if outcome.returncode != 0 and not outcome.errors and not launcher_killed:
        result.violations.append(f"{where}: exit {outcome.returncode} without a one-line error")
    if outcome.returncode != 0 and not thrown and not _caused_by_earlier(outcome):
        result.violations.append(
            f"{where}: failed without a fault: {' | '.join(outcome.errors[:2])}"
        )
    errors = " | ".join(dict.fromkeys(outcome.errors))[:300]
    report(
        f"  attempt {attempt}: exit {outcome.returncode} in {outcome.seconds:.0f} s"
        + (f"; thrown {', '.join(thrown)}" if thrown else "")
        + (f"; says: {errors}" if errors else "")
    )
    records = invariants.complete_lines(run_dir / "metrics.jsonl")
    return outcome.returncode == 0 and len(records) >= history.steps


def _caused_by_earlier(outcome) -> bool:
    """A failure an earlier fault still explains: the disk still full, the server still down
    or hung past its recovery deadline."""
    text = " ".join(outcome.errors)
    return any(s in text for s in ("No space left on device", "SGLang server"))


def report(line: str) -> None:
    print(line, flush=True)


def soak(seed: int, faults: int, out: Path, per_history: int = 3, only: int | None = None,
         minutes: float | None = None) -> list[Result]:  # fmt: skip
    """Histories of `per_history` faults until `faults` faults were scheduled (or history
    `only` alone), stopping early after `minutes`."""
    print(f"chaos soak: seed {seed}, {faults} faults, {per_history} a history, out {out}")
    t0 = time.monotonic()
    results = []
    index = only if only is not None else 0
    scheduled = 0
    while scheduled < faults or only is not None:
        history = draw_history(seed, index, per_history)
        report(history.describe())
        result = run_history(history, out / f"h{index}", report)
        results.append(result)
        for v in result.violations:
            report(f"  VIOLATION: {v}")
        report(f"  -> {len(result.thrown)} faults thrown, {result.restarts} restarts, "
               f"{len(result.violations)} violations, {result.seconds:.0f} s")  # fmt: skip
        scheduled += sum(len(a) for a in history.attempts)
        index += 1
        if only is not None or (minutes and time.monotonic() - t0 > minutes * 60):
            break
    print(table(results, seed, time.monotonic() - t0))
    return results


def table(results: list[Result], seed: int, seconds: float) -> str:
    kinds = Counter()
    for r in results:
        kinds.update(r.kinds)
    rows = [
        "| | |",
        "|---|---|",
        f"| seed | {seed} |",
        f"| histories | {len(results)} ({_configs(results)}) |",
        f"| faults thrown | {sum(kinds.values())} |",
        *(f"| &nbsp;&nbsp;{k} | {n} |" for k, n in sorted(kinds.items())),
        f"| attempts (restarts) | {sum(r.attempts for r in results)} "
        f"({sum(r.restarts for r in results)}) |",
        f"| steps recorded | {sum(r.history.steps for r in results)} |",
        f"| compared with an uninterrupted run | {sum(r.history.deterministic for r in results)} "
        "histories |",
        f"| invariant violations | {sum(len(r.violations) for r in results)} |",
        f"| wall time | {seconds / 60:.1f} min |",
    ]
    return "\n".join(rows)


def _configs(results: list[Result]) -> str:
    c = Counter(f"{r.history.ranks}r {r.history.mode} {r.history.engine}" for r in results)
    return ", ".join(f"{n}× {k}" for k, n in sorted(c.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=12, help="faults to schedule in all")
    parser.add_argument("--per-history", type=int, default=3)
    parser.add_argument("--history", type=int, default=None, help="replay this history alone")
    parser.add_argument("--minutes", type=float, default=None, help="start no history after")
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = soak(args.seed, args.faults, args.out, args.per_history, args.history, args.minutes)
    if args.json:
        args.json.write_text(json.dumps([
            {"history": r.history.to_dict(), "attempts": r.attempts, "restarts": r.restarts,
             "thrown": r.thrown, "violations": r.violations, "seconds": r.seconds}
            for r in results
        ], indent=1))  # fmt: skip
    return 1 if any(r.violations for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
