"""Fixtures of the fake-engine trainer tests (test_trainer_options.py, test_async_modes.py)."""

from __future__ import annotations

import pytest
import torch
from trainer.fakes import ConfigComposer

from gspo_megatron.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def one_thread():
    """Tensors here are tiny: a second intra-op thread only adds hand-offs (10 ms a matmul on a
    busy 2-core machine instead of 10 us)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("char")


@pytest.fixture(scope="module")
def composer():
    return ConfigComposer()
