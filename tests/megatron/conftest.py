"""Fixtures for the megatron engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import run_worker

WORKERS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def layout_reference(tmp_path_factory) -> Path:
    """One-process reference for the layout tests (weights, log-probs, losses, updates)."""
    out = tmp_path_factory.mktemp("layout_reference")
    run_worker(WORKERS / "layout_worker.py", ["--make-reference", str(out)])
    return out
