"""The CI chaos soak (tests/faults/chaos/soak.py): two histories of a fixed seed, each thrown
three faults and restarted after every failure, then checked against every invariant. Seed 1's
history 5 (2 ranks, sync, embedded engine: its records and weights are compared with an
uninterrupted run) holds a full disk at start-up, a rank stopped past the peer timeout, and a
kill in the middle of a checkpoint rotation; history 6 (2 ranks, async, the SGLang stand-in) a
kill while a resume moves records aside, under a slow filesystem twice. The long soak is
benchmarks/chaos_soak.py."""

from __future__ import annotations

import pytest
from faults.chaos.soak import soak

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("history", [5, 6])
def test_a_seeded_history_of_faults_violates_no_invariant(tmp_path, history):
    (result,) = soak(seed=1, faults=3, out=tmp_path, only=history)
    assert not result.violations, "\n".join(result.violations)
    assert len(result.thrown) >= 2, result.thrown  # the faults did land
    assert result.restarts >= 1
