"""The long chaos soak (tests/faults/chaos/soak.py; CI runs two histories,
tests/faults/chaos/test_chaos_soak.py): histories of faults drawn from a seed, thrown at
multi-rank gspo-train runs that are restarted after every failure by the same command, each
history checked against the invariants. docs/CHECKPOINTS.md ("Chaos soak") holds the latest
result.

    python benchmarks/chaos_soak.py --seed 7 --faults 200 --out /tmp/soak
    python benchmarks/chaos_soak.py --seed 7 --history 12 --out /tmp/replay   # one history again
    python benchmarks/chaos_soak.py --seed 7 --faults 1000 --minutes 40 --out /tmp/soak

Prints the seed, each history's configuration and faults, each attempt's outcome, every
violation, and a table (faults by kind, histories, restarts, steps, violations, wall time).
Exit status 1 when any invariant was violated.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from faults.chaos.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
