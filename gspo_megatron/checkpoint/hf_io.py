"""Hugging Face checkpoint directories: config, safetensors shards (streamed), tokenizer files.

Safetensors files are read with positioned reads into fresh buffers rather than memory maps, so
a conversion's resident memory is the tensors it holds, not the pages of every file it touched.
Each file's header is checked against the file's length when opened, which turns a truncated
download into an error naming the file. Writing is streamed too: shard headers are planned from
names, shapes and dtypes before any data exists, then tensors are appended as they are made.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gspo_megatron.checkpoint.mapping import (
    LM_HEAD_HF_NAME,
    VALUE_HEAD_HF_NAME,
    ConversionError,
    ModelMapping,
    Shape,
    sequence_classification_architecture,
    unexpected_hf_names,
)
from gspo_megatron.files import staged

if TYPE_CHECKING:
    from gspo_megatron.spec.model_config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files copied along with the weights (tokenizer, generation defaults, chat template).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_ALIASES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def parse_dtype(name: str) -> torch.dtype:
    """bf16 / fp16 / fp32 (or the torch names) -> torch dtype."""
    canonical = DTYPE_ALIASES.get(str(name).lower())
    if canonical is None:
        raise ConversionError(f"--dtype must be one of bf16, fp16, fp32, got {name!r}")
    return FLOAT_DTYPES[canonical]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- config ----------------------------------------------------------------------------------


def _normalized_hf_config(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The config as transformers reads it (its defaults filled in), checked for fields that
    would change the math but that our megatron model cannot express."""
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise ConversionError(
            f"{source}: quantized checkpoints are not supported (quantization_config "
            f"quant_method={method!r}); convert the unquantized release"
        )
    model_type = raw.get("model_type")
    try:
        from transformers import AutoConfig

        full = AutoConfig.for_model(**raw).to_dict()
    except (ImportError, ValueError, KeyError, TypeError):
        full = dict(raw)  # unknown model types are reported by ModelConfig.from_hf
    full.update({k: v for k, v in raw.items() if k not in full})
    full["model_type"] = model_type
    if "num_experts" not in full and "num_local_experts" in full:
        full["num_experts"] = full["num_local_experts"]  # transformers 5 attribute name
    rope = full.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConversionError(f"{source}: rope_parameters={rope} is not supported (plain RoPE)")
    theta = rope.get("rope_theta", full.get("rope_theta"))
    if theta is not None and float(theta) != int(float(theta)):
        raise ConversionError(
            f"{source}: rope_theta={theta} is not an integer; megatron's rotary_base is an int"
        )
    layer_types = full.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ConversionError(
            f"{source}: layer_types={sorted(set(layer_types))} is not supported (full attention "
            "in every layer only)"
        )
    if float(full.get("attention_dropout") or 0.0) != 0.0:
        raise ConversionError(
            f"{source}: attention_dropout={full['attention_dropout']} is not supported (0 only)"
        )
    return full


def value_head_of(raw: dict[str, Any], source: str) -> bool:
    """Whether an HF config describes a value / reward model: `architectures` names a
    `*ForSequenceClassification` (transformers' GenericForSequenceClassification: the decoder
    plus `score.weight` [num_labels, hidden], no bias). Only one label is supported; others are
    refused naming the config file."""
    archs = raw.get("architectures") or []
    classifier = [a for a in archs if str(a).endswith("ForSequenceClassification")]
    if not classifier:
        return False
    # transformers: num_labels is len(id2label) when given, else `num_labels`, else 2
    id2label = raw.get("id2label")
    num_labels = len(id2label) if id2label else raw.get("num_labels", 2)
    if num_labels != 1:
        raise ConversionError(
            f"{source}: {classifier[0]} with num_labels={num_labels}; value and reward models "
            "must have one label (score.weight of shape [1, hidden_size])"
        )
    return True


def read_hf_config(path: str | Path, **overrides: Any) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, the raw config.json dict) of an HF model directory (or its config file).

    A `*ForSequenceClassification` config (a value / reward model, `value_head_of(raw)`) gives
    the ModelConfig of its decoder; one with more than one label is refused here.
    """
    from gspo_megatron.spec.model_config import ModelConfig

    config_file = Path(path) if Path(path).is_file() else Path(path) / "config.json"
    if not config_file.is_file():
        raise ConversionError(f"{config_file}: no config.json in the HF checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise ConversionError(f"{config_file}: not valid JSON ({err})") from err
    value_head_of(raw, str(config_file))
    full = _normalized_hf_config(raw, str(config_file))
    try:
        return ModelConfig.from_hf(full, **overrides), raw
    except (ValueError, KeyError) as err:
        raise ConversionError(f"{config_file}: {err}") from err


def hf_config_for_export(
    cfg: ModelConfig,
    base: dict[str, Any] | None,
    dtype: torch.dtype,
    *,
    value_head: bool = False,
):
    """config.json for an exported model: the original file's fields (token ids, etc.) with
    every field our config defines taken from `cfg`. A value model is written as transformers'
    `*ForSequenceClassification` with one label."""
    out = dict(base or {})
    ours = cfg.to_hf()
    if value_head:
        ours["architectures"] = [sequence_classification_architecture(cfg)]
        ours.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    if "rope_parameters" in out:
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out.update(ours)
    out["torch_dtype"] = dtype_name(dtype)
    if "dtype" in out or "transformers_version" in out:
        out["dtype"] = dtype_name(dtype)
    if "num_local_experts" in out and cfg.is_moe:
        out["num_local_experts"] = cfg.num_experts
    return out


# -- reading safetensors ---------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: Shape
    start: int  # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(file: Path) -> dict[str, TensorInfo]:
    """Tensor infos of one safetensors file, checked against the file's length."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConversionError(f"{file}: truncated safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, 100 * 2**20):
                raise ConversionError(
                    f"{file}: truncated or not a safetensors file (header of {header_len} bytes "
                    f"in a {size}-byte file)"
                )
            header = json.loads(f.read(header_len))
    except FileNotFoundError:
        raise ConversionError(f"{file}: safetensors file is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConversionError(f"{file}: corrupt safetensors header ({err})") from err
    base = 8 + header_len
    infos = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(spec.get("dtype"))
        if dtype is None:
            raise ConversionError(
                f"{file}: tensor {name} has unsupported dtype {spec.get('dtype')}"
            )
        shape = tuple(spec["shape"])
        begin, end = spec["data_offsets"]
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ConversionError(f"{file}: tensor {name} has inconsistent offsets in the header")
        if base + end > size:
            raise ConversionError(
                f"{file}: truncated safetensors file ({size} bytes; tensor {name} ends at byte "
                f"{base + end})"
            )
        infos[name] = TensorInfo(file, dtype, shape, base + begin, end - begin)
    return infos


def _pread_into(fd: int, buffer: np.ndarray, offset: int, file: Path) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise ConversionError(f"{file}: unexpected end of file at byte {offset + done}")
        done += n


def read_tensor(info: TensorInfo, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """A tensor (or rows [a, b) of it) read from disk into a fresh CPU tensor."""
    shape, start, nbytes = info.shape, info.start, info.nbytes
    if rows is not None:
        a, b = rows
        row_bytes = math.prod(shape[1:]) * info.dtype.itemsize
        start, nbytes, shape = start + a * row_bytes, (b - a) * row_bytes, (b - a, *shape[1:])
    out = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        fd = os.open(info.file, os.O_RDONLY)
        try:
            _pread_into(fd, out.numpy(), start, info.file)
        finally:
            os.close(fd)
    return out.view(info.dtype).reshape(shape)


_FUSED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class HFCheckpoint:
    """The tensors of an HF model directory (sharded with an index, or one file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_file = self.path / INDEX_FILE
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as err:
                raise ConversionError(
                    f"{index_file}: not a valid safetensors index ({err})"
                ) from err
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE_FILE).is_file():
            weight_map, files = None, [SINGLE_FILE]
        else:
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            if not found:
                raise ConversionError(
                    f"{self.path}: no safetensors weights ({INDEX_FILE} or {SINGLE_FILE}); "
                    "PyTorch .bin checkpoints are not supported"
                )
            weight_map, files = None, found
        self.tensors: dict[str, TensorInfo] = {}
        for name in files:
            self.tensors.update(read_safetensors_header(self.path / name))
        if weight_map is not None:
            for name, file in weight_map.items():
                info = self.tensors.get(name)
                if info is None or info.file.name != file:
                    raise ConversionError(
                        f"{self.path / file}: tensor {name} listed in {INDEX_FILE} is not in "
                        "that file"
                    )

    @property
    def names(self) -> list[str]:
        return list(self.tensors)

    @property
    def weights_file(self) -> Path:
        """The file that lists the weights (the index, else the one safetensors file)."""
        if (self.path / INDEX_FILE).is_file():
            return self.path / INDEX_FILE
        files = sorted({info.file for info in self.tensors.values()})
        return files[0] if len(files) == 1 else self.path

    def has(self, name: str) -> bool:
        return name in self.tensors or self._fused(name) is not None

    def shape(self, name: str) -> Shape:
        fused = self._fused(name) if name not in self.tensors else None
        if fused is not None:
            return fused[1]
        return self.tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        fused = self._fused(name) if name not in self.tensors else None
        return fused[0].dtype if fused is not None else self.tensors[name].dtype

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        info = self.tensors.get(name)
        if info is not None:
            return read_tensor(info, rows)
        fused = self._fused(name)
        if fused is None:
            raise ConversionError(f"{self.path}: no tensor {name} in the checkpoint")
        info, shape, byte_offset = fused
        part = TensorInfo(
            info.file,
            info.dtype,
            shape,
            info.start + byte_offset,
            math.prod(shape) * info.dtype.itemsize,
        )
        return read_tensor(part, rows)

    def _fused(self, name: str):
        """transformers 5 can store experts fused per layer (`experts.gate_up_proj` [E, 2I, H],
        `experts.down_proj` [E, H, I]); give per-expert names a view into them."""
        match = _FUSED_EXPERT.match(name)
        if not match:
            return None
        prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
        fused = self.tensors.get(f"{prefix}.{'down_proj' if which == 'down' else 'gate_up_proj'}")
        if fused is None or len(fused.shape) != 3 or expert >= fused.shape[0]:
            return None
        per_expert = math.prod(fused.shape[1:]) * fused.dtype.itemsize
        if which == "down":
            return fused, tuple(fused.shape[1:]), expert * per_expert
        rows = fused.shape[1] // 2
        shape = (rows, fused.shape[2])
        half = math.prod(shape) * fused.dtype.itemsize
        return fused, shape, expert * per_expert + (half if which == "up" else 0)

    def fused_names(self) -> set[str]:
        return {
            n for n in self.tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        }


def check_hf_head(mapping: ModelMapping, ckpt: HFCheckpoint, *, head: str = "load") -> None:
    """A value model's checkpoint has `score.weight` and a policy's has none, unless `head` is
    "init" (a value model initialised from any checkpoint's transformer); one line naming the
    file and the tensor otherwise."""
    if head == "init":
        return
    has_score = ckpt.has(VALUE_HEAD_HF_NAME)
    if mapping.value_head and not has_score:
        what = (
            f"it holds {LM_HEAD_HF_NAME}: a policy (*ForCausalLM) checkpoint"
            if ckpt.has(LM_HEAD_HF_NAME)
            else "a (tied) policy checkpoint, or weights without a head"
        )
        raise ConversionError(
            f"{ckpt.weights_file}: no tensor {VALUE_HEAD_HF_NAME}, the head of a value / reward "
            f"model (*ForSequenceClassification); {what}. To initialise a value model from a "
            "policy, load it with head='init' (the head starts at zero)"
        )
    if not mapping.value_head and has_score:
        raise ConversionError(
            f"{ckpt.weights_file}: holds {VALUE_HEAD_HF_NAME}: a value / reward model "
            "(*ForSequenceClassification), not a policy; load it as a value model"
        )


def validate_hf_tensors(mapping: ModelMapping, ckpt: HFCheckpoint, *, head: str = "load") -> None:
    """Every tensor the mapping needs is there with its shape and a float dtype, and nothing
    else is (errors name the tensor and its file).

    head="init" (value models): only the transformer's tensors are needed, and a checkpoint's
    `lm_head.weight` or `score.weight` is ignored.
    """
    check_hf_head(mapping, ckpt, head=head)
    needed = mapping.body_hf_names if head == "init" else mapping.hf_names
    missing = [n for n in needed if not ckpt.has(n)]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConversionError(
            f"{ckpt.path}: tensors missing from the checkpoint: {missing[:5]}{more} (a missing "
            "shard file, or a config that does not match the weights)"
        )
    for name in needed:
        shape, expected = ckpt.shape(name), mapping.hf_shape(name)
        if tuple(shape) != expected:
            where = ckpt.tensors[name].file if name in ckpt.tensors else ckpt.path
            raise ConversionError(
                f"{where}: tensor {name} has shape {list(shape)}, expected {list(expected)} "
                f"from config.json"
            )
        if not ckpt.dtype(name).is_floating_point:
            raise ConversionError(f"{ckpt.path}: tensor {name} has dtype {ckpt.dtype(name)}")
    covered = set(mapping.hf_names) | ckpt.fused_names()
    extra = unexpected_hf_names(
        mapping, [n for n in ckpt.names if n not in covered], ignore_heads=head == "init"
    )
    if extra:
        raise ConversionError(
            f"{ckpt.path}: tensors this {mapping.config.model_type} mapping has no place for: "
            f"{extra[:5]}{' ...' if len(extra) > 5 else ''} (another architecture?)"
        )


def read_unit_rows(ckpt: HFCheckpoint, entry, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a one-tensor unit (`copy` / `vocab`) read from disk; rows past the
    HF vocabulary (megatron's padding) are zeros."""
    stored = ckpt.shape(entry.hf_names[0])[0]
    data = ckpt.read(entry.hf_names[0], rows=(min(start, stored), min(stop, stored)))
    if stop > stored:
        data = torch.cat([data, data.new_zeros(stop - max(start, stored), *data.shape[1:])])
    return data


# -- writing safetensors ---------------------------------------------------------------------


def _header_bytes(entries: Sequence[tuple[str, torch.dtype, Shape]]) -> bytes:
    """A safetensors header for tensors laid out back to back in this order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class ShardedSafetensorsWriter:
    """Writes tensors, in a fixed planned order, into HF safetensors shards + index.

    The plan (names, dtypes, shapes) fixes every shard's header up front, so each tensor is
    written as soon as it exists and nothing is held back.
    """

    def __init__(
        self,
        out_dir: str | Path,
        plan: Sequence[tuple[str, torch.dtype, Shape]],
        max_shard_bytes: int,
    ) -> None:
        self.out_dir = Path(out_dir)
        shards: list[list[tuple[str, torch.dtype, Shape]]] = [[]]
        size = 0
        for entry in plan:
            nbytes = math.prod(entry[2]) * entry[1].itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(entry)
            size += nbytes
        count = len(shards)
        self._shards = [
            (f"model-{i + 1:05d}-of-{count:05d}.safetensors", entries)
            for i, entries in enumerate(shards)
        ]
        self._order = [
            (name, dtype, shape) for _, entries in self._shards for name, dtype, shape in entries
        ]
        self._next = 0
        self._shard = -1
        self._file = None
        self._left_in_shard = 0
        self.total_bytes = sum(math.prod(s) * d.itemsize for _, d, s in plan)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self._order[self._next] if self._next < len(self._order) else None
        if expected is None or expected[0] != name:
            raise ConversionError(f"internal: wrote {name}, planned {expected and expected[0]}")
        _, dtype, shape = expected
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ConversionError(
                f"internal: {name} is {list(tensor.shape)} {tensor.dtype}, planned {list(shape)} "
                f"{dtype}"
            )
        if self._left_in_shard == 0:
            self._open_next()
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.write(memoryview(data))
        self._next += 1
        self._left_in_shard -= 1

    def _open_next(self) -> None:
        self._close_file()
        self._shard += 1
        file_name, entries = self._shards[self._shard]
        header = _header_bytes(entries)
        self._file = open(self.out_dir / file_name, "wb")  # noqa: SIM115 - closed in _close_file
        self._file.write(header)
        self._left_in_shard = len(entries)

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Finish the last shard and write the index; every planned tensor must be written."""
        if self._next != len(self._order):
            missing = self._order[self._next][0]
            raise ConversionError(f"internal: shards closed before {missing} was written")
        self._close_file()
        weight_map = {
            name: file_name for file_name, entries in self._shards for name, _, _ in entries
        }
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# -- directories -----------------------------------------------------------------------------


def copy_tokenizer_files(sources: Sequence[Path], dest: Path) -> list[str]:
    """Copy the tokenizer files of the first source directory that has any."""
    for src in sources:
        if src is None or not Path(src).is_dir():
            continue
        found = [name for name in TOKENIZER_FILES if (Path(src) / name).is_file()]
        if found:
            dest.mkdir(parents=True, exist_ok=True)
            for name in found:
                shutil.copy2(Path(src) / name, dest / name)
            return found
    return []


@contextmanager
def staged_output(
    path: str | Path, *, overwrite: bool, source: str | Path | None = None
) -> Iterator[Path]:
    """A fresh temporary directory next to `path`, renamed to `path` when the block succeeds.

    A non-empty `path` is refused unless `overwrite`, and so is a `path` that is, holds or lies
    inside `source`; on failure the temporary directory is removed, so `path` is either absent,
    untouched, or complete.
    """
    final = Path(path).absolute()
    if source is not None:
        src = Path(source).resolve()
        out = final.resolve()
        if out == src or src in out.parents or out in src.parents:
            raise ConversionError(f"{final}: the output must not overlap the input {src}")
    if final.exists() and not final.is_dir():
        raise ConversionError(f"{final}: output path exists and is not a directory")
    if final.is_dir() and any(final.iterdir()) and not overwrite:
        raise ConversionError(
            f"{final}: output directory is not empty; pass --overwrite to replace it"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    with staged(final) as tmp:
        tmp.mkdir()
        yield tmp
