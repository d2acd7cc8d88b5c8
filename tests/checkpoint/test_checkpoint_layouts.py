"""A converted checkpoint scores like transformers on every layout, loads with the engine's
strict loader, and matches the TE spec's key set.

Two launches, shared by the tests below: one process (layout 1, plus loader and key-set
checks), and four processes that run TP2, EP2, PP2, CP2 and TP2xEP2 one after the other (megatron's
parallel state is rebuilt between layouts), save the TP2xEP2 engine with megatron's own
checkpointing, then run gspo-logprobs' main() on the HF directory at TP2xEP2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoint.test_convert import assert_bitwise_equal, hf_tensors
from launch import run_worker

WORKER = Path(__file__).resolve().parent / "layouts_worker.py"
LAYOUTS = ["tp=2,sp=1", "ep=2", "pp=2", "cp=2", "tp=2,sp=1,ep=2"]
DENSE_LAYOUTS = ["tp=2,sp=1", "pp=2"]


def _args(models, scoring) -> list[str]:
    return [
        "--models", json.dumps({k: str(v) for k, v in models.items()}),
        "--scoring", json.dumps({k: str(v) for k, v in scoring.items()}),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def single(models, scoring) -> dict[str, dict]:
    results = run_worker(WORKER, [*_args(models, scoring), "--single"], nproc=1)
    return {r["check"]: r for r in results}


@pytest.fixture(scope="module")
def four(models, scoring, tmp_path_factory) -> tuple[dict[str, dict], Path]:
    out = tmp_path_factory.mktemp("four_ranks")
    args = [
        *_args(models, scoring),
        "--layouts", ";".join(LAYOUTS), "--dense-layouts", ";".join(DENSE_LAYOUTS),
        "--cli", "tp=2,ep=2", "--cli-output", str(out / "cli.jsonl"),
        "--save-after", "tp=2,sp=1,ep=2", "--save-dir", str(out / "saved_tp2_ep2"),
    ]  # fmt: skip
    results = run_worker(WORKER, args, nproc=4)
    return {r["check"]: r for r in results}, out


def _assert_ok(checks: dict[str, dict], names: list[str]) -> None:
    for name in names:
        assert name in checks, f"missing check {name}: {list(checks.values())}"
        assert checks[name]["ok"], checks[name]


@pytest.mark.distributed
def test_moe_single_process_matches_transformers(single):
    _assert_ok(
        single,
        [
            "moe_logprobs_single",
            "moe_logprobs_single_from_hf",
            "moe_logprobs_single_load_engine_strict",
        ],
    )


@pytest.mark.distributed
def test_key_set_is_local_and_te_spec(single):
    _assert_ok(
        single,
        [
            "keys_checkpoint_eq_local_spec",
            "keys_checkpoint_eq_te_spec",
            "te_extra_state_skipped_exactly",
            "te_style_load_weights_max_diff",
        ],
    )


@pytest.mark.distributed
def test_dense_tied_single_process_matches_transformers(single):
    _assert_ok(single, ["dense_logprobs_single"])


@pytest.mark.distributed
def test_moe_logprobs_on_tp2_ep2_pp2_cp2_tp2xep2(four):
    checks, _ = four
    _assert_ok(checks, [f"moe_logprobs_{x}" for x in LAYOUTS])


@pytest.mark.distributed
def test_dense_logprobs_on_tp2_pp2(four):
    checks, _ = four
    _assert_ok(checks, [f"dense_logprobs_{x}" for x in DENSE_LAYOUTS])


@pytest.mark.distributed
def test_checkpoint_saved_by_training_on_tp2xep2_exports_bitwise(four, models, tmp_path):
    """megatron's own save on TP2xEP2: TP/EP-split chunks, vocabulary padded for TP2."""
    from gspo_megatron.checkpoint.convert import convert_megatron_to_hf

    _, out = four
    convert_megatron_to_hf(out / "saved_tp2_ep2", tmp_path / "exported")
    assert_bitwise_equal(hf_tensors(tmp_path / "exported"), hf_tensors(models["hf_moe"]))


@pytest.mark.distributed
def test_gspo_logprobs_cli_from_hf_dir_on_tp2xep2(four, scoring):
    checks, out = four
    _assert_ok(checks, ["cli_exit_code"])
    inputs = [json.loads(x)["input_ids"] for x in scoring["in_moe"].read_text().splitlines()]
    expected = json.loads(scoring["expected_moe"].read_text())
    lines = [json.loads(x)["logprobs"] for x in (out / "cli.jsonl").read_text().splitlines()]
    # one line per input line, in order, one shorter than the input
    assert [len(x) for x in lines] == [len(x) - 1 for x in inputs]
    worst = max(
        (
            abs(a - b)
            for got, exp in zip(lines, expected, strict=True)
            for a, b in zip(got, exp, strict=True)
        ),
        default=0.0,
    )
    assert worst <= 1e-5


def test_console_script_help():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from gspo_megatron.logprobs_cli import main; main()",
            "--help",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--checkpoint" in proc.stdout


def test_gspo_logprobs_bad_input_is_named(models, tmp_path):
    from gspo_megatron.checkpoint.mapping import ConversionError
    from gspo_megatron.logprobs_cli import read_sequences

    bad = tmp_path / "in.jsonl"
    bad.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3, 99]}\n')
    with pytest.raises(ConversionError, match=r"in\.jsonl:2: token id 99"):
        read_sequences(bad, vocab_size=51)
    bad.write_text('{"input_ids": [1, 2]}\nnot json\n')
    with pytest.raises(ConversionError, match=r"in\.jsonl:2: not a JSON object"):
        read_sequences(bad)
    bad.write_text('{"ids": [1]}\n')
    with pytest.raises(ConversionError, match=r"in\.jsonl:1: needs a non-empty"):
        read_sequences(bad)
