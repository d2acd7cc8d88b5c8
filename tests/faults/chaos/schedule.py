"""Seeded fault schedules: a soak's seed draws its histories, each a run configuration (2 or 4
ranks; sync or async rollouts; the embedded engine or the SGLang stand-in) and the faults thrown
at each of its attempts. The same seed draws the same schedule; where a fault lands within a
step still depends on the machine's timing, so a replay repeats the schedule, not every byte.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

# kind: what the harness does (tests/faults/chaos/faults.py throws the external ones; the
# injected ones are tests/faults/inject faults armed in the attempt's processes).
KINDS = (
    "kill_rank",  # SIGKILL of one worker
    "kill_launcher",  # SIGKILL of gspo_megatron.torchrun; its workers must leave by themselves
    "stop_rank",  # SIGSTOP of one worker for a while, then SIGCONT
    "server_kill",  # SIGKILL of the SGLang stand-in; it is back (same port) after a while
    "server_hang",  # SIGSTOP of the stand-in for a while
    "disk_full",  # every new write under the run's disk fails (ENOSPC) for a while
    "slow_fs",  # every write, fsync and rename there is delayed for a while
    "crash_in_save",  # SIGKILL (or a full disk) at a point of a checkpoint save
    "crash_in_rollback",  # SIGKILL while a resume moves records or a checkpoint aside
    "crash_in_export",  # SIGKILL while the weights are exported to the rollout engine
)
# The injected faults behind crash_in_save, and the rank each must be armed on (None: any).
SAVE_CRASHES = {
    "kill_in_save": None,
    "kill_before_manifest": 0,
    "kill_after_publish": 0,
    "kill_mid_rotation": 0,
    "enospc_in_save": None,
}
NONFATAL = ("stop_rank", "slow_fs", "server_hang")
# Kinds a run may survive (a short stop or hang, a server back in time, a full disk while
# nothing is written): an attempt of these alone ends with a kill after them, so that the
# history goes on.
SURVIVABLE = (*NONFATAL, "server_kill", "disk_full")


@dataclass(frozen=True)
class Fault:
    kind: str
    at_records: int  # thrown once metrics.jsonl holds this many records (0: in start-up)
    delay_s: float  # ... and this long after that
    rank: int = 0  # the worker it hits (its own kinds)
    seconds: float = 0.0  # how long it lasts (stop, hang, full, slow; a server's absence)
    inject: str | None = None  # GSPO_FAULTS for the injected kinds
    damage_newest: bool = False  # flip bytes of the newest checkpoint before the attempt
    slow_s: float = 0.0  # slow_fs: delay per operation


@dataclass(frozen=True)
class History:
    index: int
    seed: int
    ranks: int
    mode: str  # rollout.mode: sync | async
    engine: str  # embedded | sglang
    steps: int
    attempts: list[list[Fault]] = field(default_factory=list)  # the last attempt has none

    @property
    def deterministic(self) -> bool:
        """Whether an uninterrupted run with the same seed must give the same records and
        weights: the embedded engine generating in step with training."""
        return self.engine == "embedded" and self.mode == "sync"

    def describe(self) -> str:
        faults = " | ".join(
            "+".join(f.kind + (f"({f.inject})" if f.inject else "") for f in a) or "-"
            for a in self.attempts
        )
        return (
            f"history {self.index}: {self.ranks} ranks, {self.mode}, {self.engine}, "
            f"{self.steps} steps; faults {faults}"
        )

    def to_dict(self) -> dict:
        return asdict(self)


STEPS = {2: 8, 4: 6}


def draw_history(seed: int, index: int, faults: int) -> History:
    """History `index` of the soak seeded `seed`, with `faults` faults (one or two an
    attempt)."""
    rng = random.Random(f"{seed}/{index}")
    ranks = rng.choice((2, 4))
    mode = rng.choice(("sync", "async"))
    engine = rng.choice(("embedded", "sglang"))
    steps = STEPS[ranks]
    kinds = [k for k in KINDS if _applies(k, engine, mode)]
    companions = [k for k in NONFATAL if _applies(k, engine, mode)]
    attempts: list[list[Fault]] = []
    left = faults
    while left > 0:
        attempt = [_draw(rng, rng.choice(kinds), ranks, steps)]
        if attempt[0].kind == "crash_in_rollback":
            # A resume rolls back only after a run stopped between two checkpoints: a kill
            # after an odd number of steps (two checkpoints at least, when it starts afresh).
            odd = rng.choice([n for n in range(5, steps, 2)])
            attempts.append([Fault("kill_rank", odd, 0.0, rank=rng.randrange(ranks))])
            left -= 1
        # Faults in combination: a stop, a slow filesystem or a hung server on top, now and
        # then two.
        while len(attempt) < left and rng.random() < 0.4:
            attempt.append(_draw(rng, rng.choice(companions), ranks, steps))
        if all(f.kind in SURVIVABLE for f in attempt):
            later = max(f.at_records for f in attempt) + rng.randrange(1, 3)
            kill = rng.choice(("kill_rank", "kill_launcher"))
            attempt.append(Fault(kill, later, 0.0, rank=rng.randrange(ranks)))
        attempts.append(attempt)
        left -= len(attempt)
    return History(index, seed, ranks, mode, engine, steps, attempts)


def _applies(kind: str, engine: str, mode: str) -> bool:
    if kind.startswith("server_"):
        return engine == "sglang"
    if kind == "crash_in_export":  # the embedded engine in sync mode shares the weights
        return engine == "sglang" or mode == "async"
    return True


def _draw(rng: random.Random, kind: str, ranks: int, steps: int) -> Fault:
    at = rng.randrange(0, steps)
    delay = round(rng.uniform(0.0, 2.0), 2)
    rank = rng.randrange(ranks)
    if kind in ("kill_rank", "kill_launcher"):
        return Fault(kind, at, delay, rank=rank)
    if kind in ("stop_rank", "server_hang", "server_kill", "disk_full"):
        return Fault(kind, at, delay, rank=rank, seconds=round(rng.uniform(1.0, 16.0), 1))
    if kind == "slow_fs":
        slow = round(rng.uniform(0.01, 0.2), 3)
        return Fault(kind, at, delay, seconds=round(rng.uniform(3.0, 15.0), 1), slow_s=slow)
    if kind == "crash_in_save":
        name = rng.choice(sorted(SAVE_CRASHES))
        on = SAVE_CRASHES[name] if SAVE_CRASHES[name] is not None else rank
        return Fault(kind, 0, 0.0, rank=on, inject=f"{name}={rng.choice((1, 2))}")
    if kind == "crash_in_rollback":
        if rng.random() < 0.5:  # a resume that moves a damaged newest checkpoint aside
            return Fault(kind, 0, 0.0, inject="kill_mid_supersede=1", damage_newest=True)
        return Fault(kind, 0, 0.0, inject="kill_mid_rewind=1")
    if kind == "crash_in_export":
        return Fault(kind, 0, 0.0, rank=0, inject=f"kill_mid_export={rng.randrange(1, 4)}")
    raise ValueError(kind)
