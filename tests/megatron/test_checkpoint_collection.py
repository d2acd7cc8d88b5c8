"""A checkpoint's optimizer state is built without megatron's forced full garbage collection
while the collector runs (gspo_megatron/megatron/checkpointing.py: optimizer_sharded_state_dict),
and with it when the collector is off: counted gc.collect calls."""

from __future__ import annotations

import gc
import inspect

import pytest

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from megatron.core.optimizer import distrib_optimizer

from gspo_megatron.megatron import checkpointing


class _Engine:
    """An engine whose optimizer builds its state as megatron's fully reshardable format does:
    ending with distrib_optimizer's gc.collect()."""

    def __init__(self) -> None:
        self.optimizer = self

    def sharded_state_dict(self, model_sd, is_loading=False, metadata=None):
        distrib_optimizer.gc.collect()
        return {"model": model_sd, "is_loading": is_loading, "metadata": metadata}


def test_megatron_collects_in_the_format_we_save():
    source = inspect.getsource(distrib_optimizer.DistributedOptimizer.sharded_state_dict)
    branch = source[source.index("sharding_type == 'fully_reshardable'") :]
    assert "gc.collect()" in branch[: branch.index("elif ")]
    assert checkpointing._OPTIMIZER_METADATA == {"distrib_optim_sharding_type": "fully_reshardable"}


@pytest.mark.parametrize("is_loading", [False, True])
@pytest.mark.parametrize("collector_on", [True, False])
def test_forced_collection_only_with_the_collector_off(monkeypatch, collector_on, is_loading):
    calls = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    was_on = gc.isenabled()
    if not collector_on:
        gc.disable()
    try:
        state = checkpointing.optimizer_sharded_state_dict(
            _Engine(), {"w": 1}, is_loading=is_loading
        )
    finally:
        if was_on:
            gc.enable()
    assert len(calls) == (0 if collector_on else 1)
    assert state == {
        "model": {"w": 1},
        "is_loading": is_loading,
        "metadata": checkpointing._OPTIMIZER_METADATA,
    }
    assert distrib_optimizer.gc is gc  # put back
