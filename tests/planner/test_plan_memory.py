"""The memory planner: exact parameter counts against megatron's own model, the arithmetic of
the estimate, and layouts that do not fit being refused (tools/plan_memory.py and the preflight)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from launch import REPO, run_worker

from gspo_megatron.memory_plan import (
    PlanError,
    PlanSettings,
    in_flight_chunks,
    lora_adapted_weight_params,
    model_params,
    plan,
    stage_params,
    training_state_gib,
)
from gspo_megatron.rollout.backends import RolloutShare
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import LoRASettings
from gspo_megatron.spec.model_config import PRESET_DIR, load_preset

WORKER = Path(__file__).resolve().parent / "count_worker.py"
PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))

# (preset, world size, layout): every preset on one GPU, and sharded layouts that exercise each
# term (TP vocabulary padding, PP first/last stage, VPP chunks, EP/ETP experts, tied embeddings
# with PP, CP), including the example layouts of slurm/examples.
LAYOUTS = [(name, 1, {}) for name in PRESETS] + [
    ("tiny_moe", 8, dict(tp=2, pp=2, ep=2, etp=2, sequence_parallel=True)),
    ("tiny_dense", 4, dict(tp=2, pp=2)),
    ("qwen3_0_6b", 8, dict(tp=2, pp=2, vpp=7, cp=2)),
    ("moe_1b", 16, dict(tp=2, pp=2, vpp=2, ep=4, sequence_parallel=True)),
    ("qwen3_30b_a3b", 16, dict(tp=2, pp=2, ep=8, sequence_parallel=True)),
    ("qwen3_30b_a3b", 32, dict(tp=2, pp=2, ep=16, sequence_parallel=True)),
    ("qwen3_235b_a22b", 128, dict(tp=4, pp=2, ep=64, sequence_parallel=True)),
    ("qwen3_235b_a22b", 64, dict(tp=4, pp=2, ep=32, sequence_parallel=True)),
]


def _ranks(world: int, layout: dict) -> list[int]:
    """First and last rank of every pipeline stage (megatron orders ranks tp-cp-ep-dp-pp)."""
    pp = layout.get("pp", 1)
    per_stage = world // pp
    return sorted({r for s in range(pp) for r in (s * per_stage, (s + 1) * per_stage - 1)})


# LoRA adapters (rank 8, every target) on an MoE and a dense model, sharded every way they can be.
LORA_LAYOUTS = [
    ("tiny_moe", 1, {}),
    ("tiny_moe", 8, dict(tp=2, pp=2, ep=2, etp=2, sequence_parallel=True)),
    ("tiny_dense", 4, dict(tp=2, pp=2)),
    ("qwen3_30b_a3b", 16, dict(tp=2, pp=2, ep=8, sequence_parallel=True)),
]


@pytest.fixture(scope="module")
def megatron_counts() -> list[dict]:
    cases = [
        {"preset": p, "world": w, "layout": lay, "ranks": _ranks(w, lay)} for p, w, lay in LAYOUTS
    ] + [
        {"preset": p, "world": w, "layout": lay, "ranks": _ranks(w, lay), "lora_rank": 8}
        for p, w, lay in LORA_LAYOUTS
    ]
    return run_worker(WORKER, [json.dumps(cases)], timeout=600)


def test_lora_adapter_counts_equal_megatrons(megatron_counts):
    rows = [r for r in megatron_counts if r["lora_rank"]]
    assert len(rows) == sum(len(_ranks(w, lay)) for _, w, lay in LORA_LAYOUTS)
    for row in rows:
        model = load_preset(row["preset"])
        layout = ParallelLayout(world_size=row["world"], **row["layout"])
        mine = stage_params(model, layout, row["pp_rank"], LoRASettings(rank=8))
        where = f"{row['preset']} {layout.describe()} rank {row['rank']}"
        assert (mine.dense, mine.expert) == (row["dense"], row["expert"]), where
        assert (mine.adapter_dense, mine.adapter_expert) == (
            row["adapter_dense"],
            row["adapter_expert"],
        ), where
        assert row["adapter_dense"] > 0 and (row["adapter_expert"] > 0) == model.is_moe, where
        if layout.world_size == 1:  # what the torch decoder merges per batch (one rank)
            adapted = lora_adapted_weight_params(model, LoRASettings(rank=8))
            assert adapted * model.num_hidden_layers == row["adapted_weights"], where


def test_lora_counts_the_merged_copy_only_where_the_torch_decoder_merges():
    """Sync mode on a model not split over ranks generates from a merged copy of every adapted
    weight; the generator process (one_step_off / async) and split models hold none."""
    model, lora = load_preset("qwen3_0_6b"), LoRASettings(rank=16)
    copy = lora_adapted_weight_params(model, lora) * model.num_hidden_layers * 2 / 2**30
    assert copy > 0.5  # every linear of the 0.6B model, bfloat16
    share = RolloutShare(kv_cache_tokens=4096, merges_adapters_per_batch=True)
    common = dict(micro_batch_tokens=4096, rollout=share)

    def generating(world: int, lora_settings=lora, **layout) -> float:
        return (
            _plan("qwen3_0_6b", world, lora=lora_settings, **common, **layout)
            .stages[0]
            .rollout_generating
        )

    assert generating(1) - generating(1, None) == pytest.approx(copy)
    assert generating(8) - generating(8, None) == pytest.approx(copy)  # data parallel: unsplit
    assert generating(2, tp=2) == pytest.approx(generating(2, None, tp=2))
    share = RolloutShare(kv_cache_tokens=4096)  # the generator process's engine
    assert _plan("qwen3_0_6b", 1, lora=lora, micro_batch_tokens=4096, rollout=share).stages[
        0
    ].rollout_generating == pytest.approx(generating(1, None))


def test_lora_trains_and_keeps_state_for_the_adapters_only():
    """Gradients and optimizer state of the adapters, weights of both; no reference copy (the
    KL reference is the base model with the adapters off)."""
    common = dict(micro_batch_tokens=4096, tp=2, sequence_parallel=True, ep=8)
    full = _plan("qwen3_30b_a3b", 64, **common).stages[0]
    lora = _plan("qwen3_30b_a3b", 64, lora=LoRASettings(rank=16), **common).stages[0]
    dense, expert = lora.params.adapter_dense, lora.params.adapter_expert
    layout = ParallelLayout(world_size=64, tp=2, sequence_parallel=True, ep=8)
    assert lora.grads * 2**30 == pytest.approx(4 * (dense + expert))
    expected = 12 * (dense / (layout.dp * layout.cp) + expert / layout.edp)
    assert lora.optimizer * 2**30 == pytest.approx(expected)
    assert lora.weights > full.weights and lora.grads < full.grads / 20
    assert lora.optimizer < full.optimizer / 20


def test_lora_modules_to_save_train_on_their_stages():
    """Whole weights trained beside the adapters (lora.modules_to_save) have gradients and
    optimizer state on the stage that holds them: the embedding on the first, the final norm
    and the output layer (vocabulary rows of this TP rank) on the last."""
    model = load_preset("qwen3_30b_a3b")
    layout = ParallelLayout(world_size=16, tp=2, sequence_parallel=True, pp=2, ep=4)
    plain = LoRASettings(rank=16)
    saved = LoRASettings(rank=16, modules_to_save=["embedding", "final_norm", "output_layer"])
    rows = model.padded_vocab_size(2) // 2 * model.hidden_size
    first, last = (stage_params(model, layout, stage, saved) for stage in (0, 1))
    assert first.trained[0] - stage_params(model, layout, 0, plain).trained[0] == rows
    assert last.trained[0] - stage_params(model, layout, 1, plain).trained[0] == (
        rows + model.hidden_size
    )
    assert first.total == stage_params(model, layout, 0, plain).total  # counted once


def test_parameter_counts_equal_megatrons_for_every_preset(megatron_counts):
    megatron_counts = [r for r in megatron_counts if not r["lora_rank"]]
    assert {r["preset"] for r in megatron_counts} == set(PRESETS)
    assert len(megatron_counts) == sum(len(_ranks(w, lay)) for _, w, lay in LAYOUTS)
    for row in megatron_counts:
        model = load_preset(row["preset"])
        layout = ParallelLayout(world_size=row["world"], **row["layout"])
        mine = stage_params(model, layout, row["pp_rank"])
        where = f"{row['preset']} {layout.describe()} rank {row['rank']}"
        assert (mine.dense, mine.expert) == (row["dense"], row["expert"]), where
        if row["world"] == 1:
            assert model_params(model) == row["dense"] + row["expert"], where


def test_released_models_have_their_published_sizes():
    # Qwen3-30B-A3B: 30.5B total; Qwen3-235B-A22B: 235B (vocabulary 151936 needs no padding).
    assert model_params(load_preset("qwen3_30b_a3b")) == 30_532_122_624
    assert model_params(load_preset("qwen3_235b_a22b")) == 235_093_634_560


def _plan(preset: str, world: int, gpu_gib: float = 79.6, **kwargs) -> object:
    layout_keys = {"tp", "pp", "vpp", "cp", "ep", "etp", "sequence_parallel"}
    layout = ParallelLayout(
        world_size=world, **{k: v for k, v in kwargs.items() if k in layout_keys}
    )
    settings = PlanSettings(
        gpu_memory_gib=gpu_gib, **{k: v for k, v in kwargs.items() if k not in layout_keys}
    )
    return plan(load_preset(preset), layout, settings)


def test_optimizer_state_is_sharded_over_data_parallel_ranks():
    common = dict(micro_batch_tokens=4096, tp=2, sequence_parallel=True, ep=8)
    on = _plan("qwen3_30b_a3b", 64, distributed_optimizer=True, **common)
    off = _plan("qwen3_30b_a3b", 64, distributed_optimizer=False, **common)
    a, b = on.stages[0], off.stages[0]
    assert a.weights == b.weights and a.grads == b.grads
    # bf16 weights: 12 bytes per parameter (fp32 master + Adam moments), / dp*cp or / edp.
    layout = on.layout
    expected = 12 * (a.params.dense / (layout.dp * layout.cp) + a.params.expert / layout.edp)
    assert a.optimizer * 2**30 == pytest.approx(expected)
    assert b.optimizer * 2**30 == pytest.approx(12 * a.params.total)
    assert a.grads * 2**30 == pytest.approx(4 * a.params.total)  # fp32 gradient buffer


def test_fp32_weights_have_no_master_copy():
    p = _plan("tiny_moe", 1, micro_batch_tokens=64)
    r = p.stages[0]
    assert r.optimizer * 2**30 == pytest.approx(8 * r.params.total)
    assert r.weights * 2**30 == pytest.approx(4 * r.params.total)


def test_recompute_and_pipeline_in_flight_counts():
    full = _plan("moe_1b", 8, micro_batch_tokens=8192, pp=4, ep=2)
    rc = _plan("moe_1b", 8, micro_batch_tokens=8192, pp=4, ep=2, recompute=True)
    assert [r.in_flight for r in full.stages] == [4, 3, 2, 1]  # 1F1B warm-up + 1
    for a, b in zip(full.stages, rc.stages, strict=True):
        assert b.activations < a.activations
        assert (a.activations_full, a.activations_recompute) == (
            b.activations_full,
            b.activations_recompute,
        )
    # Interleaved: megatron's warm-up 2*(pp-stage-1) + (vpp-1)*pp, plus one.
    layout = ParallelLayout(world_size=8, pp=4, vpp=2, ep=2)
    assert [in_flight_chunks(layout, s, 100) for s in range(4)] == [11, 9, 7, 5]
    assert in_flight_chunks(layout, 0, 2) == 4  # capped by micro-batches x chunks
    few = _plan("moe_1b", 8, micro_batch_tokens=8192, pp=4, ep=2, microbatches=2)
    assert [r.in_flight for r in few.stages] == [2, 2, 2, 1]


def test_rollout_shares():
    embedded = _plan(
        "moe_1b",
        1,
        micro_batch_tokens=4096,
        rollout=RolloutShare(kv_cache_tokens=65536, keeps_policy_weights=True),
    )
    r = embedded.stages[0]
    assert r.rollout_generating > 0 and r.rollout_training == 0
    sglang = _plan(
        "moe_1b",
        1,
        gpu_gib=80,
        micro_batch_tokens=4096,
        rollout=RolloutShare(server_fraction=0.5, server_idle_gib=2.0),
    )
    r = sglang.stages[0]
    assert r.rollout_generating == 40 and r.rollout_training == 2.0
    no_offload = _plan(
        "moe_1b",
        1,
        gpu_gib=80,
        micro_batch_tokens=4096,
        rollout=RolloutShare(server_fraction=0.5),
    )
    assert no_offload.stages[0].rollout_training == 40
    assert 0 < sglang.max_server_fraction < 1
    with pytest.raises(ValueError, match="mem_fraction_static"):
        RolloutShare(
            server_fraction=1.0, fraction_key="rollout.sglang.launch[i].mem_fraction_static"
        )


@pytest.mark.parametrize("rollout", ["embedded", "sglang"])
def test_offload_during_rollout_frees_the_chosen_state_while_generating(rollout):
    share = (
        RolloutShare(kv_cache_tokens=65536, keeps_policy_weights=True)
        if rollout == "embedded"
        else RolloutShare(server_fraction=0.5)
    )
    common = dict(micro_batch_tokens=8192, tp=2, pp=2, sequence_parallel=True, ep=8)
    plans = {
        option: _plan(
            "qwen3_30b_a3b", 16, rollout=share, reference_model=True,
            offload_during_rollout=option, **common,
        )
        for option in ("none", "optimizer", "all")
    }  # fmt: skip
    for stage in range(2):
        none, opt, everything = (plans[o].stages[stage] for o in ("none", "optimizer", "all"))
        assert none.offloaded == 0 and opt.offloaded == pytest.approx(none.optimizer)
        # The embedded engine generates with the policy's weights: they stay.
        weights = 0 if rollout == "embedded" else none.weights
        expected = none.optimizer + none.grads + none.reference + weights
        assert everything.offloaded == pytest.approx(expected)
        for r in (opt, everything):
            assert r.generation_peak == pytest.approx(none.generation_peak - r.offloaded)
            assert r.training_peak == none.training_peak  # back before training
    fractions = [plans[o].max_server_fraction for o in ("none", "optimizer", "all")]
    assert fractions == sorted(fractions) and fractions[0] < fractions[2]
    with pytest.raises(PlanError, match="offload during rollout"):
        PlanSettings(micro_batch_tokens=1, offload_during_rollout="weights")


def test_ppo_critic_counts_a_second_trained_model():
    common = dict(micro_batch_tokens=8192, tp=2, pp=2, sequence_parallel=True, ep=8)
    alone = _plan("qwen3_30b_a3b", 16, **common)
    ppo = _plan("qwen3_30b_a3b", 16, critic_model=True, **common)
    offloaded = _plan(
        "qwen3_30b_a3b", 16, critic_model=True, offload_during_rollout="optimizer", **common
    )
    for a, b, c in zip(alone.stages, ppo.stages, offloaded.stages, strict=True):
        assert b.critic == pytest.approx(a.weights + a.grads + a.optimizer)
        assert b.static == pytest.approx(a.static + b.critic)
        assert b.activations == a.activations  # it trains after the policy
        assert c.offloaded == pytest.approx(2 * a.optimizer)
    assert ppo.worst.peak > alone.worst.peak
    assert "critic" in ppo.table()
    from gspo_megatron.config import compose, resolve
    from gspo_megatron.memory_plan import settings_from_config

    cfg, model, layout = resolve(compose(["algorithm=ppo", "algorithm.kl_reward_coef=0.1"]))
    settings = settings_from_config(cfg, model, layout, gpu_memory_gib=80)
    assert settings.critic_model and settings.reference_model
    assert settings.critic_layout == layout


def test_a_critic_on_its_own_layout_is_counted_on_that_layout():
    """Policy pp2 over 16 ranks; the critic on one pipeline stage: every rank holds a whole
    critic's layers (its ep8 and data-parallel share of them), whichever policy stage it is in."""
    model = load_preset("qwen3_30b_a3b")
    common = dict(micro_batch_tokens=8192, tp=2, pp=2, sequence_parallel=True, ep=8)
    critic_layout = ParallelLayout(world_size=16, tp=2, sequence_parallel=True, ep=8)
    ppo = _plan("qwen3_30b_a3b", 16, critic_model=True, critic_layout=critic_layout, **common)
    critic_settings = PlanSettings(micro_batch_tokens=8192)
    whole = sum(training_state_gib(model, critic_layout, 0, critic_settings))
    for stage in ppo.stages:
        assert stage.critic == pytest.approx(whole)
    same = _plan("qwen3_30b_a3b", 16, critic_model=True, **common)
    assert all(a.critic < b.critic for a, b in zip(same.stages, ppo.stages, strict=True))
    # critic pp4 under policy pp2: policy stage 0 holds critic stages 0 and 1; the larger counts
    deep = ParallelLayout(world_size=16, tp=2, pp=4, sequence_parallel=True, ep=4)
    split = _plan("qwen3_30b_a3b", 16, critic_model=True, critic_layout=deep, **common)
    for stage, (first, second) in zip(split.stages, [(0, 1), (2, 3)], strict=True):
        expected = max(
            sum(training_state_gib(model, deep, s, critic_settings)) for s in (first, second)
        )
        assert stage.critic == pytest.approx(expected)
    from gspo_megatron.config import compose, resolve
    from gspo_megatron.memory_plan import settings_from_config

    overrides = ["algorithm=ppo", "parallel.tp=2", "parallel.sequence_parallel=true",
                 "critic.parallel.tp=1", "critic.parallel.sequence_parallel=false"]  # fmt: skip
    cfg, model, layout = resolve(compose(overrides), world_size=2)
    settings = settings_from_config(cfg, model, layout, gpu_memory_gib=80)
    assert settings.critic_layout == ParallelLayout(world_size=2)


def test_a_reward_model_is_counted_as_resident_weights(tmp_path):
    """A learned reward model: its own architecture's weights on the policy's layout, kept on
    the GPU while generating (it scores there), read from reward.model_path's config."""
    common = dict(micro_batch_tokens=8192, tp=2, pp=2, sequence_parallel=True, ep=8)
    scorer = load_preset("qwen3_30b_a3b", num_hidden_layers=24)
    alone = _plan("qwen3_30b_a3b", 16, offload_during_rollout="all", **common)
    scored = _plan("qwen3_30b_a3b", 16, offload_during_rollout="all", reward_model=scorer, **common)
    layout = ParallelLayout(
        world_size=16, **{k: common[k] for k in common if k != "micro_batch_tokens"}
    )
    for stage, (a, b) in enumerate(zip(alone.stages, scored.stages, strict=True)):
        weights = training_state_gib(scorer, layout, stage, PlanSettings(micro_batch_tokens=1))[0]
        assert b.reward_model == pytest.approx(weights) and 0 < weights < b.weights
        assert b.static == pytest.approx(a.static + weights)
        assert b.offloaded == a.offloaded  # resident through generation
        assert b.generation_peak == pytest.approx(a.generation_peak + weights)
    assert " rm " in scored.table()
    from launch import hf_policy

    from gspo_megatron.config import compose, resolve
    from gspo_megatron.memory_plan import settings_from_config

    rm = hf_policy(tmp_path / "rm", reward_model=True, num_hidden_layers=2)
    cfg, model, layout = resolve(compose(["algorithm=ppo", f"reward.model_path={rm}"]))
    settings = settings_from_config(cfg, model, layout, gpu_memory_gib=80)
    assert settings.reward_model.num_hidden_layers == 2
    assert settings.reward_model.params_dtype == model.params_dtype


def test_worst_rank_is_reported():
    p = _plan(
        "qwen3_30b_a3b", 16, micro_batch_tokens=18432, tp=2, pp=2, ep=8, sequence_parallel=True
    )
    assert p.worst.peak == max(r.peak for r in p.stages)
    assert p.stages[0].ranks == (0, 7) and p.stages[1].ranks == (8, 15)
    assert "worst rank: stage" in p.table()


def test_a_known_too_small_layout_is_rejected():
    # Qwen3-235B-A22B on 4 nodes x 8 H100-80GB: ~7B expert parameters per GPU with their
    # gradients and unsharded optimizer state (edp = 1) cannot fit.
    p = _plan(
        "qwen3_235b_a22b",
        32,
        micro_batch_tokens=18432,
        tp=4,
        pp=2,
        ep=16,
        sequence_parallel=True,
        recompute=True,
    )
    assert not p.fits
    assert p.worst.static > 79.6
    assert "parallel.ep" in p.advice()
    # ... and on 16 nodes it fits.
    p = _plan(
        "qwen3_235b_a22b",
        128,
        micro_batch_tokens=18432,
        tp=4,
        pp=2,
        ep=64,
        sequence_parallel=True,
        recompute=True,
    )
    assert p.fits


def test_layouts_that_do_not_divide_the_model_are_refused():
    with pytest.raises(PlanError, match="94 layers"):
        _plan(
            "qwen3_235b_a22b",
            128,
            micro_batch_tokens=1024,
            tp=4,
            pp=8,
            ep=16,
            sequence_parallel=True,
        )


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "plan_memory_tool", REPO / "tools" / "plan_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tool_reports_fit_and_refuses_a_too_small_layout(capsys):
    tool = _load_tool()

    def _tool(*args: str) -> subprocess.CompletedProcess:
        code = tool.main(list(args))
        out = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)

    big = [
        "model=qwen3_235b_a22b",
        "parallel.tp=4",
        "parallel.pp=2",
        "parallel.sequence_parallel=true",
        "engine.max_sequence_length=9216",
        "engine.max_tokens_per_microbatch=18432",
        "engine.recompute_activations=true",
    ]
    proc = _tool("--nodes", "4", "parallel.ep=16", *big)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DOES NOT FIT" in proc.stdout and "worst rank: stage" in proc.stdout
    proc = _tool("--nodes", "16", "--json", "parallel.ep=64", *big)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert out["fits"] and out["model_params"] == 235_093_634_560
    assert len(out["stages"]) == 2 and out["worst_stage"] in (0, 1)
    proc = _tool("--nodes", "2", "+experiment=gspo_qwen3_30b_a3b", "data.task=add")
    assert "trainer.offload_during_rollout, worst rank while generating:" in proc.stdout
    frees = [line for line in proc.stdout.splitlines() if " frees " in line]
    assert [line.split()[0] for line in frees] == ["none", "optimizer", "all"]
    assert "(this run)" in frees[0]
    proc = _tool("--assumptions", "--nodes", "1", "--gpus-per-node", "2", "parallel=ep2")
    assert proc.returncode == 0 and "Assumptions" in proc.stdout
    proc = _tool("--nodes", "1", "--gpus-per-node", "3", "parallel=ep2")
    assert proc.returncode == 2 and "not divisible" in proc.stderr
