"""The start-up storm at full size (tests/faults/chaos/storm.py; CI runs a short one,
tests/faults/test_startup_storm.py): gspo-train jobs of N ranks, oversubscribed on the machine's
cores with a tiny model, started one after another against one run directory: `--starts` times
in a fresh directory each, and `--starts` times in one existing directory (each start resuming
the run the previous one left and training one step). Every start must succeed and leave no
temporary file and no process.

    python benchmarks/startup_storm.py                          # 4 and 8 ranks, 20 + 20 starts
    python benchmarks/startup_storm.py --ranks 4 --starts 5 --out /tmp/storm

Prints each start as it ends, then a table per rank count and kind: starts, failures, starts
with something left behind, and the seconds a start took (mean, max). Exit status 1 when any
start failed or left something behind.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from faults.chaos.storm import storm  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--starts", type=int, default=20, help="starts of each kind")
    parser.add_argument("--out", type=Path, default=None, help="a directory for the runs")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="startup_storm_"))
    t0 = time.monotonic()
    rows = []
    for nproc in args.ranks:

        def report(s, nproc=nproc):
            state = "ok" if not s.problems else "; ".join(s.problems)
            print(f"{nproc} ranks, {s.kind} {s.index}: exit {s.returncode}, {s.seconds:.1f} s, "
                  f"{state}", flush=True)  # fmt: skip

        results = storm(out / f"{nproc}ranks", nproc, args.starts, report=report)
        for kind in ("fresh", "existing"):
            mine = [s for s in results if s.kind == kind]
            seconds = [s.seconds for s in mine]
            rows.append((
                nproc, kind, len(mine), sum(s.returncode != 0 for s in mine),
                sum(any(p.startswith("left") for p in s.problems) for s in mine),
                statistics.mean(seconds), max(seconds),
            ))  # fmt: skip
    print(f"\nstart-up storm in {out}: {(time.monotonic() - t0) / 60:.1f} min")
    print("| ranks | run directory | starts | failed | left something | s a start (mean, max) |")
    print("|---|---|---|---|---|---|")
    for nproc, kind, n, failed, left, mean, longest in rows:
        print(f"| {nproc} | {kind} | {n} | {failed} | {left} | {mean:.1f}, {longest:.1f} |")
    return 1 if any(r[3] or r[4] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
