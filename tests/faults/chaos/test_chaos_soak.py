"""The CI chaos soak (tests/faults/chaos/soak.py): two seeded histories of three faults each,
every failure restarted by the same command, then every invariant checked. Seed 2's history 7
(2 ranks, sync, the embedded engine: records and weights compared with an uninterrupted run): a
rank killed between two checkpoints, then the newest checkpoint damaged and the resume that
moves it aside killed halfway, under a slow filesystem. Seed 1's history 23 (2 ranks, async, the
SGLang stand-in): the server killed (back after a while) and hung, then the launcher killed. The
long soak is
benchmarks/chaos_soak.py (docs/CHECKPOINTS.md, "Chaos soak")."""

from __future__ import annotations

import pytest
from faults.chaos.soak import soak

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("seed", "history"), [(2, 7), (1, 23)])
def test_a_seeded_history_of_faults_violates_no_invariant(tmp_path, seed, history):
    (result,) = soak(seed=seed, faults=3, out=tmp_path, only=history)
    assert not result.violations, "\n".join(result.violations)
    assert len(result.thrown) >= 3, result.thrown  # the faults did land
    assert result.restarts >= 1
