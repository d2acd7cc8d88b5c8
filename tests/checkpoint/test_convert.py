"""HF -> megatron -> HF conversion: bitwise round trips, dtypes, files, and bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint.tiny_models import build_hf_model
from safetensors.torch import load_file, save_file

from gspo_megatron.checkpoint.convert import (
    HF_FILES_DIR,
    convert_hf_to_megatron,
    convert_megatron_to_hf,
)
from gspo_megatron.checkpoint.hf_io import INDEX_FILE, HFCheckpoint
from gspo_megatron.checkpoint.mapping import ConversionError
from gspo_megatron.checkpoint.meta import read_meta

REPO = Path(__file__).resolve().parents[2]


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_round_trip_is_bitwise(models, tmp_path, kind):
    out = tmp_path / "hf"
    report = convert_megatron_to_hf(models[f"mc_{kind}"], out)
    original = hf_tensors(models[f"hf_{kind}"])
    assert_bitwise_equal(hf_tensors(out), original)
    if kind == "moe":  # per-expert names, as SGLang's qwen3_moe loader reads them
        assert "model.layers.1.mlp.experts.3.down_proj.weight" in original
    else:
        assert "lm_head.weight" not in original  # tied
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.values())
    config = json.loads((out / "config.json").read_text())
    source = json.loads((models[f"hf_{kind}"] / "config.json").read_text())
    for key in (
        "vocab_size",
        "hidden_size",
        "num_key_value_heads",
        "head_dim",
        "tie_word_embeddings",
        "rms_norm_eps",
        "model_type",
        "architectures",
    ):
        assert config[key] == source[key], key
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (models[f"hf_{kind}"] / name).read_bytes()
    assert report.tensors == len(original) and report.peak_rss > 0
    # nothing but the result is left next to it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_megatron_checkpoint_contents(models):
    from gspo_megatron.checkpoint import manifest

    mc = models["mc_moe"]
    meta = read_meta(mc)
    # a converted checkpoint carries a manifest of every file, checked when it is loaded
    assert manifest.verify(mc) == []
    assert meta["model"]["model_type"] == "qwen3_moe" and meta["with_optimizer"] is False
    assert json.loads((mc / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert (mc / HF_FILES_DIR / "config.json").is_file()
    assert (mc / HF_FILES_DIR / "tokenizer.json").is_file()


def test_exported_model_loads_in_transformers_with_identical_logits(models, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    convert_megatron_to_hf(models["mc_moe"], out, max_shard_bytes=40_000)  # several shards
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 2
    tokens = torch.randint(0, 51, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(models["hf_moe"]).eval()(input_ids=tokens)
        b = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=tokens)
    assert type(b).__name__ == type(a).__name__
    assert torch.equal(a.logits, b.logits)


def test_bf16_round_trip_and_dtype_changes(tmp_path):
    build_hf_model("moe", tmp_path / "hf", dtype=torch.bfloat16, seed=5)
    original = hf_tensors(tmp_path / "hf")
    assert original["model.norm.weight"].dtype == torch.bfloat16
    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mc")  # stored dtype kept: bf16
    assert read_meta(tmp_path / "mc")["model"]["params_dtype"] == "bfloat16"
    convert_megatron_to_hf(tmp_path / "mc", tmp_path / "back")
    assert_bitwise_equal(hf_tensors(tmp_path / "back"), original)
    # widening on the way in, narrowing on the way out: exact
    convert_hf_to_megatron(tmp_path / "hf", tmp_path / "mc32", dtype="fp32")
    convert_megatron_to_hf(tmp_path / "mc32", tmp_path / "back16", dtype="bf16")
    assert_bitwise_equal(hf_tensors(tmp_path / "back16"), original)
    convert_megatron_to_hf(tmp_path / "mc32", tmp_path / "back32")
    widened = {k: v.float() for k, v in original.items()}
    assert_bitwise_equal(hf_tensors(tmp_path / "back32"), widened)
    assert json.loads((tmp_path / "back32" / "config.json").read_text())["torch_dtype"] == (
        "float32"
    )


def test_fused_expert_tensors_on_disk_are_read(models, tmp_path):
    """transformers 5 may store experts fused ([E, 2I, H] / [E, H, I]); same result."""
    tensors = hf_tensors(models["hf_moe"])
    fused = {}
    for name, t in tensors.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if not m:
            fused[name] = t
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]
                )
                for e in range(4)
            ]
        )
        fused[f"{p}.down_proj"] = torch.stack(
            [tensors[f"{p}.{e}.down_proj.weight"] for e in range(4)]
        )
    src = tmp_path / "fused"
    src.mkdir()
    save_file(fused, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_bytes((models["hf_moe"] / "config.json").read_bytes())
    convert_hf_to_megatron(src, tmp_path / "mc")
    convert_megatron_to_hf(tmp_path / "mc", tmp_path / "back")
    assert_bitwise_equal(hf_tensors(tmp_path / "back"), tensors)


# -- bad input ---------------------------------------------------------------------------------


@pytest.fixture
def sharded_hf(models, tmp_path) -> Path:
    """The tiny MoE re-saved as several shards with an index."""
    out = tmp_path / "sharded"
    convert_megatron_to_hf(models["mc_moe"], out, max_shard_bytes=40_000)
    return out


def test_missing_shard_is_named(sharded_hf, tmp_path):
    victim = sorted(sharded_hf.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ConversionError, match=re.escape(victim.name)):
        convert_hf_to_megatron(sharded_hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_truncated_shard_is_named(sharded_hf, tmp_path):
    victim = sorted(sharded_hf.glob("model-*.safetensors"))[2]
    os.truncate(victim, victim.stat().st_size - 100)
    with pytest.raises(ConversionError, match=re.escape(victim.name) + ".*truncated"):
        convert_hf_to_megatron(sharded_hf, tmp_path / "out")


def test_wrong_shape_is_named(models, tmp_path):
    src = tmp_path / "bad"
    src.mkdir()
    tensors = hf_tensors(models["hf_moe"])
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_bytes((models["hf_moe"] / "config.json").read_bytes())
    with pytest.raises(
        ConversionError,
        match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*"
        r"\[16, 64\].*\[32, 64\]",
    ):
        convert_hf_to_megatron(src, tmp_path / "out")


def test_missing_tensor_is_named(models, tmp_path):
    src = tmp_path / "bad"
    src.mkdir()
    tensors = hf_tensors(models["hf_moe"])
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_bytes((models["hf_moe"] / "config.json").read_bytes())
    with pytest.raises(ConversionError, match=r"experts\.2\.up_proj"):
        convert_hf_to_megatron(src, tmp_path / "out")


def test_non_empty_output_is_refused_unless_overwrite(models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(ConversionError, match="not empty.*--overwrite"):
        convert_megatron_to_hf(models["mc_moe"], out)
    assert (out / "keep.txt").is_file()
    convert_megatron_to_hf(models["mc_moe"], out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / INDEX_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_output_overlapping_the_input_is_refused(models):
    with pytest.raises(ConversionError, match="must not overlap"):
        convert_megatron_to_hf(models["mc_moe"], models["mc_moe"], overwrite=True)
    with pytest.raises(ConversionError, match="must not overlap"):
        convert_hf_to_megatron(models["hf_moe"], models["hf_moe"] / "mc")
    assert (models["hf_moe"] / "config.json").is_file()


def test_failure_mid_write_leaves_nothing(models, tmp_path, monkeypatch):
    calls = {"n": 0}
    real = HFCheckpoint.read

    def failing(self, name, rows=None):
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError("disk went away")
        return real(self, name, rows)

    monkeypatch.setattr(HFCheckpoint, "read", failing)
    with pytest.raises(OSError, match="disk went away"):
        convert_hf_to_megatron(models["hf_moe"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_megatron_side_bad_input(models, tmp_path):
    import shutil

    broken = tmp_path / "mc"
    shutil.copytree(models["mc_moe"], broken)
    data = sorted(broken.glob("*.distcp"))[0]
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(ConversionError, match=re.escape(data.name) + ": truncated"):
        convert_megatron_to_hf(broken, tmp_path / "out")
    (broken / "manifest.json").unlink()  # a checkpoint from elsewhere: the reader still checks
    with pytest.raises(ConversionError, match=re.escape(data.name) + ".*truncated"):
        convert_megatron_to_hf(broken, tmp_path / "out")
    data.unlink()
    with pytest.raises(ConversionError, match=re.escape(data.name) + ".*missing"):
        convert_megatron_to_hf(broken, tmp_path / "out")
    # the architecture given does not match the stored tensors
    other = tmp_path / "other.json"
    cfg = json.loads((models["hf_moe"] / "config.json").read_text())
    other.write_text(json.dumps({**cfg, "moe_intermediate_size": 48}))
    with pytest.raises(ConversionError, match=r"linear_fc1\.weight.*\[2, 4, 64, 64\].*96"):
        convert_megatron_to_hf(models["mc_moe"], tmp_path / "out", hf_config=other)
    with pytest.raises(ConversionError, match="not a torch_dist checkpoint"):
        convert_megatron_to_hf(models["hf_moe"], tmp_path / "out", hf_config=other)


def test_any_vocab_padding_multiple_round_trips(models, tmp_path):
    """(Checkpoints saved by training on TP2xEP2: test_checkpoint_layouts.)"""
    out = tmp_path / "hf"
    convert_hf_to_megatron(models["hf_moe"], tmp_path / "mc", make_vocab_size_divisible_by=64)
    convert_megatron_to_hf(tmp_path / "mc", out)
    assert_bitwise_equal(hf_tensors(out), hf_tensors(models["hf_moe"]))


# -- the tools -----------------------------------------------------------------------------------


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_tools_convert_both_ways_with_verify(models, tmp_path):
    proc = _tool(
        "convert_hf_to_megatron.py",
        "--hf-path",
        str(models["hf_moe"]),
        "--output",
        str(tmp_path / "mc"),
        "--verify",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = float(re.search(r"log-prob difference\| = (\S+)", proc.stdout).group(1))
    assert diff <= 1e-5 and "peak RSS" in proc.stdout and "GB/s" in proc.stdout
    proc = _tool(
        "convert_megatron_to_hf.py",
        "--megatron-path",
        str(tmp_path / "mc"),
        "--output",
        str(tmp_path / "hf"),
        "--dtype",
        "bf16",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert hf_tensors(tmp_path / "hf")["model.norm.weight"].dtype == torch.bfloat16
    # bad input: exit status 2 and the reason (the tool's main() in this process)
    import runpy

    tool = runpy.run_path(str(REPO / "tools" / "convert_megatron_to_hf.py"), run_name="tool")
    args = ["--megatron-path", str(tmp_path / "mc"), "--output", str(tmp_path / "hf")]
    assert tool["main"](args) == 2


def test_memory_stays_far_below_model_size(tmp_path):
    """A 150 MB model converts both ways with peak RSS growing by a fraction of it."""
    from gspo_megatron.checkpoint.hf_io import ShardedSafetensorsWriter
    from gspo_megatron.checkpoint.mapping import get_mapping
    from gspo_megatron.spec.model_config import ModelConfig

    config = {
        "model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_experts": 32, "num_experts_per_tok": 4,
        "moe_intermediate_size": 512, "norm_topk_prob": True, "torch_dtype": "bfloat16",
    }  # fmt: skip
    mapping = get_mapping(ModelConfig.from_hf(config))
    plan = [
        (name, torch.bfloat16, shape)
        for e in mapping.entries
        for name, shape in zip(e.hf_names, e.hf_shapes, strict=True)
    ]
    src = tmp_path / "hf"
    src.mkdir()
    writer = ShardedSafetensorsWriter(src, plan, max_shard_bytes=50_000_000)
    for name, dtype, shape in plan:
        writer.write(name, torch.full(shape, 0.5, dtype=dtype))
    writer.close()
    (src / "config.json").write_text(json.dumps(config))
    size = writer.total_bytes
    assert size > 140e6
    limit = 48 * 2**20
    up = convert_hf_to_megatron(src, tmp_path / "mc", max_chunk_bytes=8 * 2**20)
    assert up.peak_rss - up.rss_before < limit, up.summary()
    down = convert_megatron_to_hf(tmp_path / "mc", tmp_path / "back", read_bytes=8 * 2**20)
    assert down.peak_rss - down.rss_before < limit, down.summary()
