"""A short start-up storm (tests/faults/chaos/storm.py): gspo-train with 4 ranks on 2 cores,
started twice in fresh run directories and three times in one existing directory, each start
resuming the last. Every start succeeds and leaves no temporary and no process. The full storm
(20 starts of each kind at 4 and 8 ranks) is benchmarks/startup_storm.py."""

from __future__ import annotations

import pytest
from faults.chaos.storm import start_once

pytestmark = pytest.mark.distributed


def test_four_ranks_start_again_and_again_in_one_run_directory(tmp_path):
    starts = [start_once(tmp_path, "fresh", i, nproc=4) for i in range(2)]
    starts += [start_once(tmp_path, "existing", i, nproc=4) for i in range(3)]
    problems = [f"{s.kind} {s.index}: {p}" for s in starts for p in s.problems]
    assert not problems, "\n".join(problems)
    log = (tmp_path / "existing" / "metrics.jsonl").read_text().splitlines()
    assert len(log) == 3  # one step per start, each recorded once
