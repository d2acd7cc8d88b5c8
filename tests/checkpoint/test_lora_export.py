"""A LoRA checkpoint in Hugging Face form (checkpoint/lora_export.py, checkpoint/convert.py):
the PEFT adapter that `peft` loads onto the transformers model of the base, and the merged
model, each giving the trainer's log-probs of a probe batch (float32, CPU) within 1e-5.

The checkpoints come from tests/checkpoint/lora_export_worker.py: a tiny Qwen3-MoE (attention's
fused q/k/v split into q_proj/k_proj/v_proj, every expert's adapter in PEFT's fused
`target_parameters` layout) and a tiny dense Qwen3 (gate/up split), LoRA on every target with
the output layer and the final norm trained whole (modules_to_save), after three Adam steps
from the HF model: B is far from zero, and the base model's log-probs are far from the
trainer's, so a dropped or misplaced adapter fails the comparison."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint.tiny_models import build_hf_model
from launch import run_worker
from safetensors.torch import load_file

from gspo_megatron.checkpoint.convert import (
    ConversionError,
    convert_megatron_to_hf,
    export_peft_adapter,
)
from gspo_megatron.checkpoint.lora_export import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from gspo_megatron.megatron.verify import transformers_logprobs

pytestmark = pytest.mark.slow  # ~45 s on 2 cores: three Adam steps, then transformers and peft
WORKER = Path(__file__).resolve().parent / "lora_export_worker.py"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora_export")
    build_hf_model("moe", root / "moe", seed=1)
    build_hf_model("dense", root / "dense", seed=2, tie_word_embeddings=False)
    lines = run_worker(
        WORKER,
        [
            "--hf-dir",
            str(root / "moe"),
            "--hf-dir",
            str(root / "dense"),
            "--out",
            str(root / "out"),
        ],
        timeout=600,
    )
    return {"root": root, "runs": {line["model"]: line for line in lines}}


def peft_logprobs(base_dir: Path, adapter_dir: Path, tokens: torch.Tensor):
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1), get_peft_model_state_dict(model)


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_peft_and_merged_exports_give_the_trainers_logprobs(trained, name):
    root, run = trained["root"], trained["runs"][name]
    assert run["lora_b_max"] > 1e-2 and run["saved_moved"] > 1e-2, run
    ckpt, out = root / "out" / name / "ckpt", root / "out" / name
    probe = torch.load(out / "logprobs.pt")
    tokens, trainer = probe["tokens"], probe["logprobs"]
    # the base model alone is far from the trained policy: the comparisons below can fail
    assert float((transformers_logprobs(root / name, tokens) - trainer).abs().max()) > 1e-2

    export_peft_adapter(ckpt, out / "peft", base_model=str(root / name))
    config = json.loads((out / "peft" / ADAPTER_CONFIG_FILE).read_text())
    modules = {"q_proj", "k_proj", "v_proj", "o_proj"}
    if name == "dense":
        modules |= {"gate_proj", "up_proj", "down_proj"}
    assert config["r"] == 4 and config["lora_alpha"] == 8.0, config
    assert set(config["target_modules"]) == modules, config
    assert config["target_parameters"] == (
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if name == "moe" else None
    )
    assert config["modules_to_save"] == ["lm_head", "model.norm"]
    assert config["base_model_name_or_path"] == str(root / name)
    got, state = peft_logprobs(root / name, out / "peft", tokens)
    assert float((got - trainer).abs().max()) <= TOLERANCE
    # every exported tensor is one PEFT loaded, and PEFT has no adapter tensor we did not write
    written = load_file(out / "peft" / ADAPTER_FILE)
    assert sorted(state) == sorted(written)
    for key, tensor in written.items():
        assert torch.equal(state[key], tensor), key

    convert_megatron_to_hf(ckpt, out / "merged")
    merged = transformers_logprobs(out / "merged", tokens)
    assert float((merged - trainer).abs().max()) <= TOLERANCE


def test_peft_adapter_onto_the_checkpoints_own_base(trained):
    """A run that did not start from an HF model: its base converted from the checkpoint
    (`lora_weights="base"`) is what the adapter loads onto."""
    root = trained["root"]
    ckpt, out = root / "out" / "moe" / "ckpt", root / "out" / "moe"
    probe = torch.load(out / "logprobs.pt")
    convert_megatron_to_hf(ckpt, out / "base", lora_weights="base")
    export_peft_adapter(ckpt, out / "peft_own", base_model=str(out / "base"))
    got, _ = peft_logprobs(out / "base", out / "peft_own", probe["tokens"])
    assert float((got - probe["logprobs"]).abs().max()) <= TOLERANCE


def test_exports_refused_without_adapters(trained, tmp_path):
    root = trained["root"]
    merged = root / "out" / "moe" / "merged_for_refusal"
    convert_megatron_to_hf(root / "out" / "moe" / "ckpt", merged)
    with pytest.raises(ConversionError, match="not a gspo checkpoint"):
        export_peft_adapter(merged, tmp_path / "peft")
    with pytest.raises(ConversionError, match="--lora-weights 'adapters': one of"):
        convert_megatron_to_hf(
            root / "out" / "moe" / "ckpt", tmp_path / "x", lora_weights="adapters"
        )
