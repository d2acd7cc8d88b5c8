"""Rollout backends come from one registry (gspo_megatron/rollout/backends.py): a backend
registered from the tests (its module: trainer/fakes.py; its entry: one line) is checked at
config time, planned, described by the Slurm preflight, built and trained with, and nothing
outside the registry compares a backend's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from trainer.fakes import FakeGeneratorProcess, build_fake_run

import gspo_megatron
from gspo_megatron.config import ConfigError
from gspo_megatron.memory_plan import settings_from_config
from gspo_megatron.rollout.backends import ROLLOUT_BACKENDS, RolloutBackend, rollout_backend

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fake_server(monkeypatch):
    """The one registry entry a new backend needs."""
    monkeypatch.setitem(ROLLOUT_BACKENDS, "fake_server", "trainer.fakes:FAKE_SERVER_BACKEND")


def test_a_backend_registered_from_the_tests_trains(composer, tokenizer, fake_server, tmp_path):
    cfg, model, layout = composer.resolve(
        "rollout.engine=fake_server", "trainer.offload_during_rollout=all", "trainer.steps=2"
    )
    run = build_fake_run(cfg, model, layout, tokenizer, rollout_from_backend=True, run_dir=tmp_path)
    run.train()
    assert isinstance(run.rollout, FakeGeneratorProcess)  # a server engine, driven from rank 0
    assert len(run.journal.calls("generate")) == 2 and len(run.log.records) == 2
    # It does not generate with the policy's weights: offloading moves them too.
    assert {c.keep_weights for c in run.journal.calls("offload") if c.what} == {False}
    assert all(m["reward/mean"] == m["reward/mean"] for _, m in run.log.records)
    # The planner and the Slurm preflight ask the backend.
    settings = settings_from_config(cfg, model, layout, gpu_memory_gib=80.0)
    assert settings.rollout.server_fraction == 0.25
    assert not settings.rollout.keeps_policy_weights
    from gspo_megatron import slurm

    report = slurm.preflight(
        ["rollout.engine=fake_server"], nodes=1, gpus_per_node=1, gpu_memory_gib=None
    )
    assert report.ok and "rollout: fake servers" in report.text(), report.text()


def test_the_backend_checks_its_combinations_at_config_time(composer, fake_server):
    with pytest.raises(ConfigError, match="rollout.top_p / rollout.top_k with rollout.engine"):
        composer.resolve("rollout.engine=fake_server", "rollout.top_p=0.9")


def test_an_unknown_backend_is_refused_naming_the_choices(composer):
    with pytest.raises(ConfigError, match=r"rollout.engine='vllm' is not one of \['embedded'"):
        composer.resolve("rollout.engine=vllm")


def test_every_registered_backend_is_a_rollout_backend():
    for name in ROLLOUT_BACKENDS:
        assert isinstance(rollout_backend(name), RolloutBackend)


def test_no_module_outside_the_registry_compares_a_backend_name():
    """A backend's name appears in no comparison (==, !=, in) outside rollout/backends.py."""
    package = Path(gspo_megatron.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).as_posix() == "rollout/backends.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            literals = [
                c.value
                for o in operands
                for c in ast.walk(o)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
            # `<cfg>.rollout.engine` compared with anything
            named = [
                o
                for o in operands
                if isinstance(o, ast.Attribute)
                and o.attr == "engine"
                and isinstance(o.value, ast.Attribute)
                and o.value.attr == "rollout"
            ]
            if named or set(literals) & set(ROLLOUT_BACKENDS):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not found, found


def test_the_embedded_engine_keeps_context_only_for_episodes(composer):
    """Kept K/V serve a multi-turn episode's next turn; a single-turn run keeps none (its
    prompts never start with a finished sequence), the budget set or not."""
    from gspo_megatron.rollout.embedded.backend import kept_context_tokens

    single, _, _ = composer.resolve("rollout.prefix_cache_tokens=512")
    episodes, _, _ = composer.resolve(
        "rollout.prefix_cache_tokens=512",
        "env.name=envs.scripted_envs:TwoObservations",
        "env.max_turns=4",
        "env.max_tokens=24",
    )
    assert kept_context_tokens(single) == 0
    assert kept_context_tokens(episodes) == 512
