"""Value and reward models: HF `*ForSequenceClassification` <-> megatron conversion, the
`RewardModel` against transformers on several layouts, a critic initialised from a policy, and
the refusals.

Two launches of `value_models_worker.py`, run side by side and shared by the tests below: one
process (layout 1, converter --verify, head="init", refusals) and two processes under torchrun
(TP2, TP2+SP, PP2, DP2 for the dense model; EP2, TP2+SP for the MoE; from the HF directory and
from its megatron conversion), saving the MoE engine at TP2+SP with megatron's own
checkpointing to check its export.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from checkpoint.test_convert import assert_bitwise_equal, hf_tensors
from checkpoint.tiny_models import DENSE, MOE
from launch import finish_worker, start_worker

from gspo_megatron.checkpoint.convert import convert_hf_to_megatron, convert_megatron_to_hf
from gspo_megatron.checkpoint.hf_io import HFCheckpoint, check_hf_head, read_hf_config
from gspo_megatron.checkpoint.mapping import ConversionError, get_mapping, unexpected_hf_names
from gspo_megatron.checkpoint.meta import read_meta

WORKER = Path(__file__).resolve().parent / "value_models_worker.py"
PAD = 0
TWO_RANK_RUNS = [
    "dense:hf@tp=2",
    "dense:mc@tp=2,sp=1",
    "dense:hf@pp=2",
    "dense:mc@",  # data-parallel: each rank scores its share
    "moe:hf@ep=2",
    "moe:mc@tp=2,sp=1",
]
SAVE_AFTER = "moe:mc@tp=2,sp=1"


def _randomize(model) -> None:
    with torch.no_grad():  # larger than the default init, so every weight moves the scores
        for p in model.parameters():
            p.normal_(0.0, 0.2)


def build_value_models(root: Path) -> dict[str, Path]:
    """Tiny random Qwen3 / Qwen3-MoE sequence classifiers (one label, pad token 0), a MoE
    policy sharing the MoE classifier's transformer (its lm_head random), a two-label
    classifier, and the megatron conversions."""
    from transformers import (
        Qwen3Config,
        Qwen3ForSequenceClassification,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        Qwen3MoeForSequenceClassification,
    )

    paths = {}
    torch.manual_seed(0)
    dense = Qwen3ForSequenceClassification(Qwen3Config(**DENSE, num_labels=1, pad_token_id=PAD))
    moe_config = Qwen3MoeConfig(**MOE, num_labels=1, pad_token_id=PAD)
    moe = Qwen3MoeForSequenceClassification(moe_config)
    policy = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE, pad_token_id=PAD))
    for model in (dense, moe, policy):
        _randomize(model)
    policy.model.load_state_dict(moe.model.state_dict())
    two = Qwen3ForSequenceClassification(Qwen3Config(**DENSE, num_labels=2, pad_token_id=PAD))
    for name, model in (
        ("hf_dense_vm", dense),
        ("hf_moe_vm", moe),
        ("hf_moe_policy", policy),
        ("hf_two_labels", two),
    ):
        model.save_pretrained(root / name)
        paths[name] = root / name
    for name in ("dense_vm", "moe_vm", "moe_policy"):
        convert_hf_to_megatron(root / f"hf_{name}", root / f"mc_{name}")
        paths[f"mc_{name}"] = root / f"mc_{name}"
    return paths


def scoring_data(seed: int = 0) -> dict:
    """Prompts and responses of different lengths, no pad token inside (transformers reads
    the last non-pad token)."""
    rng = random.Random(seed)
    shapes = [(3, 4), (7, 1), (1, 9), (12, 2), (5, 15), (20, 6), (2, 2)]
    vocab = min(DENSE["vocab_size"], MOE["vocab_size"])
    seq = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731
    prompts, responses = zip(*[(seq(p), seq(r)) for p, r in shapes], strict=True)
    return {"prompts": list(prompts), "responses": list(responses)}


@torch.no_grad()
def transformers_scores(hf_dir: Path, prompts, responses) -> list[float]:
    """AutoModelForSequenceClassification on one right-padded batch with an attention mask."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    logits = model.eval()(input_ids=ids, attention_mask=mask).logits
    assert logits.shape == (len(seqs), 1)
    return logits[:, 0].tolist()


@pytest.fixture(scope="module")
def value_models(tmp_path_factory) -> dict[str, Path]:
    return build_value_models(tmp_path_factory.mktemp("value_models"))


@pytest.fixture(scope="module")
def launches(value_models, tmp_path_factory):
    """Both worker launches, side by side: ({check: result} of one process, of two, save dir)."""
    out = tmp_path_factory.mktemp("value_launch")
    data = scoring_data()
    for kind in ("dense", "moe"):
        data[f"expected_{kind}"] = transformers_scores(
            value_models[f"hf_{kind}_vm"], data["prompts"], data["responses"]
        )
    (out / "data.json").write_text(json.dumps(data))
    common = [
        "--models", json.dumps({k: str(v) for k, v in value_models.items()}),
        "--data", str(out / "data.json"),
    ]  # fmt: skip
    save_dir = out / "saved_tp2_sp"
    two = start_worker(
        WORKER,
        [*common, "--runs", ";".join(TWO_RANK_RUNS), "--save-after", SAVE_AFTER,
         "--save-dir", str(save_dir)],
        nproc=2,
    )  # fmt: skip
    one = start_worker(WORKER, [*common, "--single", "--runs", "dense:hf@;moe:mc@"])
    single = {r["check"]: r for r in finish_worker(one, timeout=300)}
    double = {r["check"]: r for r in finish_worker(two, timeout=300)}
    return single, double, save_dir


def _assert_ok(checks: dict[str, dict], names: list[str]) -> None:
    for name in names:
        assert name in checks, f"missing check {name}: {list(checks.values())}"
        assert checks[name]["ok"], checks[name]


@pytest.mark.distributed
def test_reward_model_matches_transformers_on_one_process(launches):
    single, _, _ = launches
    _assert_ok(single, ["dense:hf@", "moe:mc@", "longest_scores", "empty_batch"])


@pytest.mark.distributed
def test_reward_model_matches_transformers_on_tp_sp_pp_dp_ep(launches):
    _, double, _ = launches
    _assert_ok(double, TWO_RANK_RUNS + [f"{run}_same_on_every_rank" for run in TWO_RANK_RUNS])


@pytest.mark.distributed
def test_critic_initialised_from_policy_keeps_a_zero_head(launches):
    single, _, _ = launches
    _assert_ok(
        single,
        [
            f"init_from_{source}_policy_{what}"
            for source in ("hf", "mc")
            for what in ("head_stays_zero", "body")
        ],
    )


@pytest.mark.distributed
def test_converter_verify_compares_values(launches):
    single, _, _ = launches
    _assert_ok(single, ["convert_verify_values", "convert_verify_says_value"])


@pytest.mark.distributed
def test_refusals_are_one_line_naming_file_and_tensor(launches, value_models):
    single, _, _ = launches
    expected = {
        "refuse_hf_policy_as_reward_model": [
            str(value_models["hf_moe_policy"]), "score.weight", "lm_head.weight", "head='init'",
        ],
        "refuse_mc_policy_as_reward_model": [
            str(value_models["mc_moe_policy"]), "output_layer.weight of global shape [128, 64]",
            "head='init'",
        ],
        "refuse_hf_value_model_as_policy": [str(value_models["hf_dense_vm"]), "score.weight"],
        "refuse_mc_value_model_as_policy": [
            str(value_models["mc_dense_vm"]), "output_layer.weight", "[1, 64]",
        ],
        "refuse_init_for_policy": ["ValueError", "head='init'"],
        "refuse_chunks_without_value_head": ["ValueError", "without a value head"],
        "refuse_empty_response": ["ValueError", "sequence 0: empty response"],
        "refuse_too_long": ["ValueError", "sequence 0", "(66)", "engine.max_sequence_length=65"],
    }  # fmt: skip
    for check, words in expected.items():
        assert check in single, f"missing check {check}"
        message = single[check]["error"]
        assert "\n" not in message, message
        for word in words:
            assert word in message, (check, word, message)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_round_trip_is_bitwise_and_loads_in_transformers(value_models, tmp_path, kind):
    from transformers import AutoModelForSequenceClassification

    original = value_models[f"hf_{kind}_vm"]
    meta = read_meta(value_models[f"mc_{kind}_vm"])
    assert meta["extra"]["value_head"] is True
    out = tmp_path / "hf"
    convert_megatron_to_hf(value_models[f"mc_{kind}_vm"], out)
    assert_bitwise_equal(hf_tensors(out), hf_tensors(original))
    config = json.loads((out / "config.json").read_text())
    source = json.loads((original / "config.json").read_text())
    for key in ("architectures", "model_type", "pad_token_id", "tie_word_embeddings"):
        assert config[key] == source[key], key
    assert config["num_labels"] == 1
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert type(model).__name__ == source["architectures"][0]
    assert model.config.num_labels == 1


@pytest.mark.distributed
def test_checkpoint_saved_on_tp2_sp_exports_bitwise(launches, value_models, tmp_path):
    _, _, save_dir = launches
    out = tmp_path / "hf"
    report = convert_megatron_to_hf(save_dir, out)
    assert_bitwise_equal(hf_tensors(out), hf_tensors(value_models["hf_moe_vm"]))
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForSequenceClassification"]
    assert config["num_labels"] == 1
    # saved by training: no HF config to take pad_token_id from
    assert any("pad_token_id" in note for note in report.notes)


def test_two_labels_are_refused(value_models, tmp_path):
    config_file = value_models["hf_two_labels"] / "config.json"
    for call in (
        lambda: read_hf_config(value_models["hf_two_labels"]),
        lambda: convert_hf_to_megatron(value_models["hf_two_labels"], tmp_path / "mc"),
    ):
        with pytest.raises(ConversionError) as err:
            call()
        message = str(err.value)
        assert message.startswith(
            f"{config_file}: Qwen3ForSequenceClassification with num_labels=2"
        )
        assert "\n" not in message
    assert not (tmp_path / "mc").exists()


def test_hf_head_checks_without_megatron(value_models):
    cfg, _ = read_hf_config(value_models["hf_moe_vm"])
    value, policy = get_mapping(cfg, value_head=True), get_mapping(cfg)
    policy_ckpt = HFCheckpoint(value_models["hf_moe_policy"])
    with pytest.raises(ConversionError, match=r"model.safetensors: no tensor score.weight"):
        check_hf_head(value, policy_ckpt)
    check_hf_head(value, policy_ckpt, head="init")  # the transformer only: accepted
    with pytest.raises(ConversionError, match=r"holds score.weight: a value / reward model"):
        check_hf_head(policy, HFCheckpoint(value_models["hf_moe_vm"]))
    # the value mapping: the head is [1, hidden] score.weight, never lm_head, never tied
    assert value.hf_names[-1] == "score.weight" and "lm_head.weight" not in value.hf_names
    assert value.keys["output_layer.weight"].global_shape == (1, cfg.hidden_size)
    tied = get_mapping(cfg.replace(tie_word_embeddings=True), value_head=True)
    assert tied.hf_names[-1] == "score.weight"
    assert unexpected_hf_names(tied, ["lm_head.weight"]) == ["lm_head.weight"]
    assert unexpected_hf_names(tied, ["lm_head.weight", "score.weight"], ignore_heads=True) == []
