"""The golden-number regression test (tests/golden/golden_run.py says how to regenerate)."""

from __future__ import annotations

import json

import pytest
from golden.golden_run import GOLDEN_FILE, PER_STEP, run_golden

# The loss is a mean of per-token terms of order 1 in float32 that cancel to ~1e-4: it holds
# to float32's eps times their size (~1e-7), and CPUs whose kernels sum in another order (AVX2,
# AVX-512) differ in the last bits (seen: 7.5e-9). The other numbers hold to rel 1e-6.
ABS_TOLERANCE = {"actor/loss": 1e-7}


def test_tiny_moe_gspo_run_reproduces_the_stored_numbers(tmp_path):
    stored = json.loads(GOLDEN_FILE.read_text())
    numbers = run_golden(tmp_path / "run")
    assert len(numbers["steps"]) == len(stored["steps"]) == 5
    for step, (got, want) in enumerate(zip(numbers["steps"], stored["steps"], strict=True), 1):
        for key in PER_STEP:
            tolerance = ABS_TOLERANCE.get(key, 1e-9)
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=tolerance), (step, key)
    for key, want in stored["weights"].items():
        assert numbers["weights"][key] == pytest.approx(want, rel=1e-6), key
