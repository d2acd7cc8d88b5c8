"""The golden-number regression test (tests/golden/golden_run.py says how to regenerate)."""

from __future__ import annotations

import json

import pytest
from golden.golden_run import GOLDEN_FILE, PER_STEP, run_golden


def test_tiny_moe_gspo_run_reproduces_the_stored_numbers(tmp_path):
    stored = json.loads(GOLDEN_FILE.read_text())
    numbers = run_golden(tmp_path / "run")
    assert len(numbers["steps"]) == len(stored["steps"]) == 5
    for step, (got, want) in enumerate(zip(numbers["steps"], stored["steps"], strict=True), 1):
        for key in PER_STEP:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (step, key)
    for key, want in stored["weights"].items():
        assert numbers["weights"][key] == pytest.approx(want, rel=1e-6), key
