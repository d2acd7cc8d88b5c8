"""A run directory is resumed only by a run of the same experiment: deployment (where the rollout
servers are) and the output schedule may change, the experiment may not."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.config import ConfigError, compose, resolve
from gspo_megatron.run_files import CONFIG_FILE, check_run_directory

SGLANG = ["rollout=sglang", "+rollout.sglang.urls=[http://node7:30000]"]


def run_config(*overrides: str):
    cfg, _, _ = resolve(compose([*SGLANG, *overrides]), 1)
    return cfg


def test_moved_servers_and_output_schedule_do_not_block_a_resume(tmp_path):
    check_run_directory(tmp_path, run_config())
    moved = run_config(
        "rollout.sglang.urls=[http://node3:30000,http://node4:30000]",
        "+rollout.sglang.master_address=node3",
        "trainer.steps=1000",
        "trainer.save_every=10",
        "trainer.offload_during_rollout=all",
    )
    check_run_directory(tmp_path, moved)


def test_another_experiment_is_refused_naming_the_keys(tmp_path):
    check_run_directory(tmp_path, run_config())
    with pytest.raises(ConfigError, match=r"different config \(.*algorithm\.loss\)"):
        check_run_directory(tmp_path, run_config("algorithm=grpo"))


def test_a_run_from_before_a_section_existed_resumes_at_its_defaults(tmp_path):
    """A run directory started before a section was added (its run_config.json lacks `lora`)
    resumes when the section is at its defaults, and is refused when it is not."""
    check_run_directory(tmp_path, resolve(compose([]), 1)[0])
    saved = json.loads((tmp_path / CONFIG_FILE).read_text())
    del saved["lora"]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(saved))
    check_run_directory(tmp_path, resolve(compose([]), 1)[0])
    (tmp_path / CONFIG_FILE).write_text(json.dumps(saved))
    with pytest.raises(ConfigError, match=r"different config \(lora\)"):
        check_run_directory(tmp_path, resolve(compose(["lora.rank=8"]), 1)[0])


def test_the_sentinel_may_be_switched_on_a_resume_the_budget_not(tmp_path):
    check_run_directory(tmp_path, run_config())
    check_run_directory(tmp_path, run_config("stability.sentinel.enabled=false"))
    with pytest.raises(ConfigError, match="stability.mismatch_budget.k3_kl"):
        check_run_directory(tmp_path, run_config("stability.mismatch_budget.k3_kl=0.1"))
