"""Checkpoints that would run code when loaded are refused before anything runs; genuine ones
(megatron saves with and without the (distributed) optimizer, dense and MoE, and the HF
converter's output) pass and load."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import run_worker
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo

from gspo_megatron.checkpoint.mapping import ConversionError
from gspo_megatron.checkpoint.safe_load import (
    METADATA_FILE,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    load_weights_only,
    read_dcp_metadata,
    verify_checkpoint_safe,
)
from gspo_megatron.checkpoint.torch_dist import TorchDistCheckpoint

WORKER = Path(__file__).resolve().parent / "safe_load_worker.py"
SAVED = ("moe_adam_distributed", "dense_adam")


class RunsCode:
    """Pickles as a call of `func(arg)`: what a crafted checkpoint hides in a pickle."""

    def __init__(self, func, arg: str) -> None:
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


def payloads(marker: Path) -> dict[str, RunsCode]:
    # pickle records os.system under its defining module, posix.
    return {
        "posix.system": RunsCode(os.system, f"touch {marker}"),
        "builtins.exec": RunsCode(builtins.exec, f"open({str(marker)!r}, 'w').close()"),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """Megatron checkpoints (see safe_load_worker.py), verified and loaded there."""
    root = tmp_path_factory.mktemp("safe_load")
    results = run_worker(WORKER, ["--workdir", str(root)])
    checks = [r for r in results if "check" in r]
    assert {r["check"] for r in checks} == {f"{name}_loads_after_verify" for name in SAVED}
    assert all(r["ok"] for r in checks), checks
    for timing in (r for r in results if "timing" in r):
        print(
            f"{timing['timing']}: verify {timing['verify_s']:.4f} s, load {timing['load_s']:.4f} s"
        )
    return root


def copy_of(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / src.name))


def write_metadata(ckpt: Path, metadata) -> None:
    with open(ckpt / METADATA_FILE, "wb") as stream:
        pickle.dump(metadata, stream)


def replace_object(ckpt: Path, fqn_prefix: str, payload: bytes) -> str:
    """Point the checkpoint's first object named `fqn_prefix...` at `payload` (appended to its
    data file); returns the object's name."""
    metadata = read_dcp_metadata(ckpt)
    index = next(i for i in metadata.storage_data if i.fqn.startswith(fqn_prefix))
    info = metadata.storage_data[index]
    data_file = ckpt / info.relative_path
    offset = data_file.stat().st_size
    with open(data_file, "ab") as stream:
        stream.write(payload)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, offset, len(payload))
    write_metadata(ckpt, metadata)
    return index.fqn


def torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("name", SAVED)
def test_megatron_checkpoints_pass(saved, name):
    metadata = verify_checkpoint_safe(saved / name)
    assert metadata.state_dict_metadata
    with open(saved / name / "rng" / "rank_00000.pt", "rb") as f:
        assert load_weights_only(f, "rng")["numpy"][0] == "MT19937"


@pytest.mark.parametrize("kind", ["moe", "dense"])
def test_converted_checkpoints_pass(models, kind):
    path = models[f"mc_{kind}"]
    verify_checkpoint_safe(path)
    reader = TorchDistCheckpoint(path)
    key = "embedding.word_embeddings.weight"
    assert reader.read([(key, (0, 0), (2, 4), 0)])[0].shape == (2, 4)


@pytest.mark.parametrize("refused", ["posix.system", "builtins.exec"])
def test_metadata_that_runs_code_is_refused(saved, tmp_path, refused):
    ckpt = copy_of(saved / "dense_adam", tmp_path)
    marker = tmp_path / "ran"
    metadata = read_dcp_metadata(ckpt)
    metadata.planner_data = payloads(marker)[refused]
    write_metadata(ckpt, metadata)
    FileSystemReader(ckpt).read_metadata()  # torch's reader runs it: the attack is real
    assert marker.exists()
    marker.unlink()

    for read in (
        verify_checkpoint_safe,
        read_dcp_metadata,
        lambda path: SafeFileSystemReader(path).read_metadata(),
        TorchDistCheckpoint,
    ):
        with pytest.raises(UnsafeCheckpointError) as err:
            read(ckpt)
        assert f"{ckpt / METADATA_FILE}: refuses to load {refused} " in str(err.value)
        assert not marker.exists()
    assert isinstance(err.value, ConversionError)  # the tools' and trainer's handlers catch it


@pytest.mark.parametrize("item", ["common_state", "decoder.layers.mlp.linear_fc1._extra_state"])
def test_object_that_runs_code_is_refused(saved, tmp_path, item):
    ckpt = copy_of(saved / "dense_adam", tmp_path)
    marker = tmp_path / "ran"
    fqn = replace_object(ckpt, item, torch_saved([payloads(marker)["posix.system"]]))
    # megatron's load_common_state_dict reads objects like this (DCP's default planner)
    torch.distributed.checkpoint.load(
        {fqn: io.BytesIO()}, storage_reader=FileSystemReader(ckpt), no_dist=True
    )
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafeCheckpointError, match=f"object {fqn}: refuses to load posix.system"):
        verify_checkpoint_safe(ckpt)
    assert not marker.exists()


def test_transformer_engine_extra_state_is_checked(saved, tmp_path):
    """TE >= 2 keeps FP8 state as a uint8 tensor of pickle bytes and `pickle.loads` it."""
    marker = tmp_path / "ran"

    def as_te_state(pickled: bytes) -> bytes:
        return torch_saved([torch.frombuffer(bytearray(pickled), dtype=torch.uint8)])

    fp8_state = {"forward": {"scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 1}}}
    # In a megatron process tensors pickle through megatron's storage loader (protocol 3:
    # GLOBAL opcodes, no frames, so the name can be swapped in place).
    in_megatron = pickle.dumps(fp8_state, protocol=3).replace(
        b"ctorch.storage\n_load_from_bytes\n",
        b"cmegatron.core.safe_globals\nsafe_load_from_bytes\n",
    )
    assert b"safe_load_from_bytes" in in_megatron
    # What TE writes without FP8, with FP8, and with FP8 in a megatron process.
    for i, pickled in enumerate((pickle.dumps(None), pickle.dumps(fp8_state), in_megatron)):
        ckpt = copy_of(saved / "dense_adam", tmp_path / str(i))
        replace_object(ckpt, "decoder.layers.mlp.linear_fc1._extra_state", as_te_state(pickled))
        verify_checkpoint_safe(ckpt)

    ckpt = copy_of(saved / "dense_adam", tmp_path / "crafted")
    crafted = as_te_state(pickle.dumps(payloads(marker)))
    fqn = replace_object(ckpt, "decoder.layers.mlp.linear_fc1._extra_state", crafted)
    with pytest.raises(UnsafeCheckpointError, match=f"object {fqn}: refuses to load posix.system"):
        verify_checkpoint_safe(ckpt)
    assert not marker.exists()


def test_legacy_common_pt_that_runs_code_is_refused(saved, tmp_path):
    ckpt = copy_of(saved / "dense_adam", tmp_path)
    marker = tmp_path / "ran"
    (ckpt / "common.pt").write_bytes(torch_saved({"args": payloads(marker)["builtins.exec"]}))
    with pytest.raises(UnsafeCheckpointError, match="common.pt: refuses to load builtins.exec"):
        verify_checkpoint_safe(ckpt)
    assert not marker.exists()


def test_rng_state_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "ran"
    file = tmp_path / "rank_00000.pt"
    file.write_bytes(torch_saved({"python": payloads(marker)["posix.system"]}))
    with (
        pytest.raises(UnsafeCheckpointError, match="refuses to load posix.system"),
        open(file, "rb") as f,
    ):
        load_weights_only(f, str(file))
    assert not marker.exists()


def test_data_file_outside_the_directory_is_refused(saved, tmp_path):
    ckpt = copy_of(saved / "dense_adam", tmp_path)
    metadata = read_dcp_metadata(ckpt)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo("../../home/user/.ssh/id_rsa", 0, 16)
    write_metadata(ckpt, metadata)
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        verify_checkpoint_safe(ckpt)


def test_unreadable_metadata_is_a_conversion_error(saved, tmp_path):
    ckpt = copy_of(saved / "dense_adam", tmp_path)
    (ckpt / METADATA_FILE).write_bytes((ckpt / METADATA_FILE).read_bytes()[:100])
    with pytest.raises(ConversionError, match="unreadable checkpoint metadata") as err:
        verify_checkpoint_safe(ckpt)
    assert not isinstance(err.value, UnsafeCheckpointError)
    (ckpt / METADATA_FILE).unlink()
    with pytest.raises(ConversionError, match="not a torch_dist checkpoint"):
        TorchDistCheckpoint(ckpt)


def test_module_does_not_import_megatron():
    """The checks run in tools and tests that never start megatron-core (seconds to import)."""
    code = (
        "import sys, gspo_megatron.checkpoint.safe_load, gspo_megatron.checkpoint.torch_dist; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'transformer_engine'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
