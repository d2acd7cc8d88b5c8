"""ParallelLayout checks, without any process group."""

from __future__ import annotations

import pytest

from gspo_megatron.spec.layout import LayoutError, ParallelLayout

MODEL = dict(num_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts=4)


def test_derived_sizes():
    layout = ParallelLayout(tp=2, pp=2, cp=2, ep=4, etp=1, sequence_parallel=True, world_size=16)
    assert layout.dp == 2
    assert layout.edp == 2
    assert layout.sequence_multiple == 4


@pytest.mark.parametrize(
    ("kwargs", "model", "fragment"),
    [
        (dict(tp=3, world_size=3), {}, "parallel.tp=3 must divide the model's 4 attention heads"),
        (dict(tp=4, world_size=4, sequence_parallel=True), {}, "2 key/value heads"),
        (dict(pp=3, world_size=3), {}, "parallel.pp*vpp = 3*1 = 3 must divide the model's 4"),
        (dict(ep=3, world_size=3), {}, "parallel.ep=3 must divide the model's 4 experts"),
        (dict(tp=2, world_size=2), {}, "needs parallel.sequence_parallel=true"),
        (dict(ep=2, world_size=2), {"num_experts": None}, "needs a Mixture-of-Experts model"),
    ],
)
def test_model_checks_name_the_setting(kwargs, model, fragment):
    layout = ParallelLayout(**kwargs)
    with pytest.raises(LayoutError, match=fragment.replace("*", r"\*")):
        layout.check_model(**(MODEL | model))


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(tp=2, pp=2, world_size=6), "world size 6 is not divisible by parallel.tp\\*pp\\*cp"),
        (dict(ep=4, world_size=2), "parallel.etp\\*ep\\*pp"),
        (dict(vpp=2, world_size=1), "parallel.vpp > 1 needs parallel.pp > 1"),
        (dict(sequence_parallel=True, world_size=1), "sequence_parallel needs parallel.tp > 1"),
        (dict(tp=0), "parallel.tp must be a positive integer"),
    ],
)
def test_inconsistent_sizes_are_refused(kwargs, fragment):
    with pytest.raises(LayoutError, match=fragment):
        ParallelLayout(**kwargs)


def test_sequence_length_vs_cp():
    with pytest.raises(LayoutError, match="multiple of 4"):
        ParallelLayout(cp=2, world_size=2).check_sequence_length(30)
    ParallelLayout(cp=2, world_size=2).check_sequence_length(32)
