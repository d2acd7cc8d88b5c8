"""HF <-> megatron checkpoint conversion, streamed tensor by tensor.

`convert_hf_to_megatron` writes a torch_dist checkpoint that loads on any TP/PP/EP/ETP/CP/DP
layout and with either layer spec (keys: see `mapping`), plus `gspo_checkpoint.json` (so
`model.init_from=DIR`, `load_engine(..., with_optimizer=False)` and `gspo-logprobs` take it)
and the HF config and tokenizer files under `hf_files/`. `convert_megatron_to_hf` writes
safetensors shards with per-expert names, `model.safetensors.index.json`, `config.json` and
the tokenizer files. Both read and write one unit at a time (one layer's attention, one
expert), so resident memory stays near the largest single tensor, and both write into a
temporary directory that is renamed only when complete.

Value / reward models convert both ways too: an HF `*ForSequenceClassification` with one label
(`score.weight` [1, hidden]) becomes a checkpoint whose `output_layer.weight` is that head, and
a megatron checkpoint whose `output_layer.weight` is [1, hidden] (converted, or saved by
training a critic) is written back as `*ForSequenceClassification`. Which one a source holds is
read from it (HF: `architectures`; megatron: the head's stored shape), so the tools take no flag.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from gspo_megatron.checkpoint import lora_export, manifest, torch_dist
from gspo_megatron.checkpoint.hf_io import (
    HFCheckpoint,
    ShardedSafetensorsWriter,
    copy_tokenizer_files,
    dtype_name,
    hf_config_for_export,
    parse_dtype,
    read_hf_config,
    read_unit_rows,
    staged_output,
    validate_hf_tensors,
    value_head_of,
)
from gspo_megatron.checkpoint.mapping import (
    HEAD_KEY,
    ConversionError,
    ModelMapping,
    TensorMapping,
    get_mapping,
    is_value_head_shape,
)
from gspo_megatron.checkpoint.meta import (
    META_FILE,
    CheckpointError,
    is_checkpoint,
    model_config_from_meta,
    read_meta,
    write_meta,
)
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.lora import SAVED_MODULES
from gspo_megatron.spec.model_config import ModelConfig

HF_FILES_DIR = "hf_files"  # original config.json and tokenizer files inside a megatron ckpt
DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DEFAULT_READ_BYTES = 64 * 2**20


# -- memory and time accounting --------------------------------------------------------------


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory of this process over a block.

    On Linux the kernel's high-water mark is reset at entry (/proc/self/clear_refs), so the
    figure is the block's own peak; elsewhere it is the process's lifetime peak.
    """

    def __enter__(self) -> PeakRSS:
        self.before = current_rss()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        return self

    def __exit__(self, *exc) -> None:
        self.peak = (
            _vm_hwm() if self.reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# (hf_dir, megatron_dir, model config, dtype, value_head) -> (what was compared, max |diff|):
# gspo_megatron.megatron.verify.conversion_difference builds both models and compares them.
Verifier = Callable[[Path, Path, ModelConfig, torch.dtype, bool], tuple[str, float]]


@dataclass
class ConversionReport:
    direction: str
    source: str
    output: str
    dtype: str
    tensors: int
    bytes_written: int
    seconds: float
    rss_before: int
    peak_rss: int
    largest_tensor_bytes: int
    verify_max_abs_diff: float | None = None
    verified: str = "log-prob"  # what the verifier compared: log-probs, or a value model's values
    notes: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / max(self.seconds, 1e-9) / 1e9

    def summary(self) -> str:
        mib = 2**20
        above = (self.peak_rss - self.rss_before) / mib
        lines = [
            f"{self.direction}: {self.source} -> {self.output}",
            f"  {self.tensors} tensors, {self.bytes_written / 1e9:.3f} GB ({self.dtype}) in "
            f"{self.seconds:.2f} s = {self.gb_per_s:.3f} GB/s",
            f"  peak RSS {self.peak_rss / mib:.0f} MiB ({above:.0f} MiB above the "
            f"{self.rss_before / mib:.0f} MiB before converting; largest tensor "
            f"{self.largest_tensor_bytes / mib:.0f} MiB)",
        ]
        if self.verify_max_abs_diff is not None:
            lines.append(
                f"  verify: max |{self.verified} difference| = {self.verify_max_abs_diff:.3e}"
            )
        lines += [f"  {note}" for note in self.notes]
        return "\n".join(lines)


# -- HF -> megatron --------------------------------------------------------------------------


def _produce_unit(
    mapping: ModelMapping,
    ckpt: HFCheckpoint,
    entry: TensorMapping,
    dtype: torch.dtype,
    sizes: tuple[int, ...],
) -> torch.Tensor:
    unit = mapping.to_megatron(entry, [ckpt.read(n) for n in entry.hf_names])
    return unit.to(dtype).reshape(sizes)


def _produce_rows(
    ckpt: HFCheckpoint, entry: TensorMapping, dtype: torch.dtype, rows: tuple[int, int]
) -> torch.Tensor:
    return read_unit_rows(ckpt, entry, *rows).to(dtype)


def import_plan(
    mapping: ModelMapping,
    ckpt: HFCheckpoint,
    dtype: torch.dtype,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> list[torch_dist.WriteChunk]:
    """The stored chunks of the megatron checkpoint: one per unit (per layer, per expert);
    un-stacked tensors larger than `max_chunk_bytes` (embeddings) in row blocks."""
    chunks = []
    for entry in mapping.entries:
        spec = mapping.keys[entry.key]
        big = entry.numel * dtype.itemsize > max_chunk_bytes
        if not spec.stacked and entry.kind in ("copy", "vocab") and big:
            row_bytes = math.prod(entry.shape[1:]) * dtype.itemsize
            step = max(1, max_chunk_bytes // row_bytes)
            for a in range(0, entry.shape[0], step):
                rows = (a, min(a + step, entry.shape[0]))
                offsets = (a,) + (0,) * (len(entry.shape) - 1)
                sizes = (rows[1] - a, *entry.shape[1:])
                produce = partial(_produce_rows, ckpt, entry, dtype, rows)
                chunks.append(torch_dist.WriteChunk(
                    entry.key, offsets, sizes, spec.global_shape, dtype, produce
                ))  # fmt: skip
            continue
        offsets = entry.index + (0,) * len(entry.shape)
        sizes = (1,) * len(spec.stacked) + entry.shape
        produce = partial(_produce_unit, mapping, ckpt, entry, dtype, sizes)
        chunks.append(
            torch_dist.WriteChunk(entry.key, offsets, sizes, spec.global_shape, dtype, produce)
        )
    return chunks


def import_objects(mapping: ModelMapping) -> dict:
    """The ShardedObjects megatron's own save writes for this model: an empty common state and
    a `_extra_state` (None) per linear layer unit, so strict loads of the local spec succeed."""
    import itertools

    none = torch_dist.serialized_object(None)
    common = torch_dist.object_name(torch_dist.COMMON_STATE_KEY, (0,), (1,))
    objects = {common: torch_dist.serialized_object({})}
    for spec in mapping.keys.values():
        if spec.extra_state:
            for index in itertools.product(*(range(n) for n in spec.stacked)):
                objects[torch_dist.object_name(spec.extra_state_key, index, spec.stacked)] = none
    return objects


def convert_hf_to_megatron(
    hf_dir: str | Path,
    output: str | Path,
    *,
    dtype: str | None = None,
    overwrite: bool = False,
    verify: Verifier | None = None,
    make_vocab_size_divisible_by: int = 128,
    threads: int = 1,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
) -> ConversionReport:
    """HF safetensors directory -> megatron torch_dist checkpoint (layout-independent).

    A `*ForSequenceClassification` directory with one label converts as a value model.
    dtype: bf16/fp16/fp32; default: the dtype the HF tensors are stored in.
    verify: compares the two sides' outputs before the output appears (`Verifier`).
    """
    hf_dir = Path(hf_dir)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        cfg, raw_config = read_hf_config(
            hf_dir, make_vocab_size_divisible_by=make_vocab_size_divisible_by
        )
        value_head = value_head_of(raw_config, str(hf_dir / "config.json"))
        mapping = get_mapping(cfg, value_head=value_head)
        ckpt = HFCheckpoint(hf_dir)
        validate_hf_tensors(mapping, ckpt)
        target = parse_dtype(dtype) if dtype else ckpt.dtype(mapping.entries[0].hf_names[0])
        cfg = cfg.replace(params_dtype=dtype_name(target))
        chunks = import_plan(mapping, ckpt, target, max_chunk_bytes)
        report = ConversionReport(
            direction="hf->megatron",
            source=str(hf_dir),
            output=str(output),
            dtype=dtype_name(target),
            tensors=len(mapping.entries),
            bytes_written=0,
            seconds=0.0,
            rss_before=mem.before,
            peak_rss=0,
            largest_tensor_bytes=max(c.nbytes for c in chunks),
        )
        with staged_output(output, overwrite=overwrite, source=hf_dir) as tmp:
            torch_dist.write_checkpoint(tmp, chunks, import_objects(mapping), threads=threads)
            files = tmp / HF_FILES_DIR
            files.mkdir()
            (files / "config.json").write_text(json.dumps(raw_config, indent=2))
            copy_tokenizer_files([hf_dir], files)
            meta = {
                "model": cfg.to_dict(),
                # the tensors are stored whole (as a one-process save would), so any layout loads
                "layout": dataclasses.asdict(ParallelLayout()),
                "steps_done": 0,
                "with_optimizer": False,
                "extra": {
                    "converted_from": str(hf_dir.absolute()),
                    "dtype": dtype_name(target),
                    "layout_independent": True,
                    # for readers; loaders read it from the stored head's shape
                    "value_head": value_head,
                },
            }
            write_meta(tmp, meta)
            manifest.write_manifest(
                tmp, manifest.digest_files(tmp, manifest.unlisted_files(tmp, {}))
            )
            report.bytes_written = torch_dist.directory_bytes(tmp)
            report.seconds = time.perf_counter() - t0
            if verify is not None:
                report.verified, report.verify_max_abs_diff = verify(
                    hf_dir, tmp, cfg, target, value_head
                )
    report.peak_rss = mem.peak
    return report


# -- megatron -> HF --------------------------------------------------------------------------


def _read_requests(entry: TensorMapping, mapping: ModelMapping):
    spec = mapping.keys[entry.key]
    if entry.kind == "vocab":  # only the real vocabulary rows; padding is dropped
        rows = (mapping.config.vocab_size, *entry.shape[1:])
        return (entry.key, (0,) * len(rows), rows, 0)
    stacked = len(spec.stacked)
    return (entry.key, entry.index + (0,) * len(entry.shape), (1,) * stacked + entry.shape, stacked)


def stored_value_head(reader: torch_dist.TorchDistCheckpoint) -> bool:
    """Whether a megatron checkpoint holds a value model (by its `output_layer.weight`)."""
    md = reader.tensor(HEAD_KEY)
    return is_value_head_shape(None if md is None else tuple(md.size))


def check_megatron_checkpoint(reader: torch_dist.TorchDistCheckpoint, mapping: ModelMapping):
    """Every key the mapping needs is stored with a compatible global shape; data files exist."""
    for spec in mapping.keys.values():
        md = reader.tensor(spec.key)
        if md is None:
            raise ConversionError(
                f"{reader.path}: checkpoint has no tensor {spec.key} (expected global shape "
                f"{list(spec.global_shape)} for this {mapping.config.model_type} config)"
            )
        found = tuple(md.size)
        if spec.vocab_padded:
            ok = len(found) == 2 and found[1:] == spec.global_shape[1:]
            ok = ok and found[0] >= mapping.config.vocab_size
        else:
            ok = found == spec.global_shape
        if not ok:
            raise ConversionError(
                f"{reader.path}: tensor {spec.key} has global shape {list(found)}, expected "
                f"{list(spec.global_shape)} for this config"
            )
    reader.check_files()


def convert_megatron_to_hf(
    megatron_dir: str | Path,
    output: str | Path,
    *,
    dtype: str | None = None,
    tokenizer: str | Path | None = None,
    hf_config: str | Path | None = None,
    overwrite: bool = False,
    verify: Verifier | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    read_bytes: int = DEFAULT_READ_BYTES,
    lora_weights: str = "merged",
) -> ConversionReport:
    """Megatron torch_dist checkpoint (any layout it was saved on) -> HF safetensors dir.

    hf_config: a config.json describing the model, for checkpoints without gspo metadata.
    dtype: bf16/fp16/fp32; default: the dtype the checkpoint stores.
    A checkpoint whose `output_layer.weight` is [1, hidden] (a value / reward model) is
    written as `*ForSequenceClassification` with one label (`score.weight`).
    lora_weights, for a checkpoint with LoRA adapters: `merged` writes base + alpha/r · B @ A
    (the policy the run trained), `base` the frozen base weights without the adapters (what
    the PEFT adapter of `export_peft_adapter` loads onto; a weight of lora.modules_to_save is
    written as trained). Refused for a checkpoint without adapters unless `merged`.
    """
    src = Path(megatron_dir)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        base_config: dict[str, Any] | None = None
        if hf_config is not None:
            cfg, base_config = read_hf_config(hf_config)
        elif is_checkpoint(src):
            cfg = model_config_from_meta(read_meta(src)["model"])
        else:
            raise ConversionError(
                f"{src}: no {META_FILE}; pass --hf-config with the model's config.json"
            )
        lora = _lora_of(src, lora_weights)
        if base_config is None and (src / HF_FILES_DIR / "config.json").is_file():
            base_config = json.loads((src / HF_FILES_DIR / "config.json").read_text())
        problems = manifest.verify(src, required=False)
        if problems:
            raise ConversionError(f"{src}: damaged checkpoint: " + "; ".join(problems[:6]))
        reader = torch_dist.TorchDistCheckpoint(src)
        value_head = stored_value_head(reader)
        if hf_config is not None and value_head_of(base_config, str(hf_config)) != value_head:
            kind = {True: "a value model", False: "a policy"}
            raise ConversionError(
                f"{hf_config}: describes {kind[not value_head]}, but {src} holds "
                f"{kind[value_head]} (by the shape of its {HEAD_KEY})"
            )
        mapping = get_mapping(cfg, value_head=value_head)
        check_megatron_checkpoint(reader, mapping)
        adapted = (
            set(lora_export.adapted_weight_keys(lora, cfg.is_moe))
            if lora and lora_weights == "merged"
            else set()
        )
        stored = reader.tensor(mapping.entries[0].key).properties.dtype
        target = parse_dtype(dtype) if dtype else stored
        plan = [
            (name, target, shape)
            for entry in mapping.entries
            for name, shape in zip(entry.hf_names, entry.hf_shapes, strict=True)
        ]
        report = ConversionReport(
            direction="megatron->hf",
            source=str(src),
            output=str(output),
            dtype=dtype_name(target),
            tensors=len(plan),
            bytes_written=0,
            seconds=0.0,
            rss_before=mem.before,
            peak_rss=0,
            largest_tensor_bytes=max(math.prod(s) * target.itemsize for _, _, s in plan),
        )
        with staged_output(output, overwrite=overwrite, source=src) as tmp:
            writer = ShardedSafetensorsWriter(tmp, plan, max_shard_bytes)
            try:
                for bucket in _read_buckets(mapping, read_bytes, stored.itemsize):
                    units = reader.read([_read_requests(e, mapping) for e in bucket])
                    if adapted:
                        units = _merge_adapters(reader, mapping, bucket, units, adapted, lora)
                    for entry, unit in zip(bucket, units, strict=True):
                        # vocab units were read without their padding rows: already HF's
                        tensors = (
                            [unit]
                            if entry.kind == "vocab"
                            else mapping.to_hf(entry, unit.reshape(entry.shape))
                        )
                        for name, tensor in zip(entry.hf_names, tensors, strict=True):
                            writer.write(name, tensor.to(target))
                    del units
                writer.close()
            except BaseException:
                writer.abort()
                raise
            config = hf_config_for_export(cfg, base_config, target, value_head=value_head)
            if value_head and config.get("pad_token_id") is None:
                report.notes.append(
                    "config.json has no pad_token_id: transformers' sequence classification "
                    "then scores batches of one sequence only (set it to the tokenizer's)"
                )
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            sources = [Path(tokenizer)] if tokenizer else []
            sources += [src / HF_FILES_DIR, src]
            copied = copy_tokenizer_files(sources, tmp)
            if tokenizer and not copied:
                raise ConversionError(f"{tokenizer}: no tokenizer files found there")
            if not copied:
                report.notes.append("no tokenizer files found (pass --tokenizer DIR to add them)")
            report.bytes_written = torch_dist.directory_bytes(tmp)
            report.seconds = time.perf_counter() - t0
            if verify is not None:
                # a base export is the checkpoint's model with its adapters off
                adapters = {"adapters": False} if lora and lora_weights == "base" else {}
                report.verified, report.verify_max_abs_diff = verify(
                    tmp, src, cfg, target, value_head, **adapters
                )
    report.peak_rss = mem.peak
    return report


LORA_WEIGHTS = ("merged", "base")


def _lora_of(src: Path, lora_weights: str) -> dict[str, Any] | None:
    """The `lora` section of a checkpoint's metadata (None: no adapters), `lora_weights`
    checked against it."""
    if lora_weights not in LORA_WEIGHTS:
        raise ConversionError(f"--lora-weights {lora_weights!r}: one of {list(LORA_WEIGHTS)}")
    lora = read_meta(src).get("lora") if is_checkpoint(src) else None
    if not lora and lora_weights != "merged":
        raise ConversionError(f"--lora-weights {lora_weights}: {src} holds no LoRA adapters")
    return lora


def _adapter_requests(
    reader: torch_dist.TorchDistCheckpoint, mapping: ModelMapping, entry: TensorMapping
) -> list[tuple[str, tuple, tuple, int]]:
    """Read requests of the A and B adapting one megatron unit (whole, as the checkpoint stores
    them whatever the layout it was saved on)."""
    stacked = len(mapping.keys[entry.key].stacked)
    requests = []
    for key in lora_export.adapter_keys(entry.key):
        md = reader.tensor(key)
        if md is None:
            raise ConversionError(f"{reader.path}: LoRA checkpoint has no tensor {key}")
        unit = tuple(md.size)[stacked:]
        requests.append((key, entry.index + (0,) * len(unit), (1,) * stacked + unit, stacked))
    return requests


def _adapters(reader, mapping, entries: list[TensorMapping]) -> list[tuple]:
    """(A, B) of each unit of `entries`, read together."""
    requests = [r for e in entries for r in _adapter_requests(reader, mapping, e)]
    stacked = [len(mapping.keys[e.key].stacked) for e in entries]
    read = reader.read(requests)
    return [
        (
            read[2 * i].reshape(read[2 * i].shape[n:]),
            read[2 * i + 1].reshape(read[2 * i + 1].shape[n:]),
        )
        for i, n in enumerate(stacked)
    ]


def _merge_adapters(reader, mapping, bucket, units, adapted: set[str], lora) -> list:
    """`units` (megatron layout) with each adapted one's alpha/r · B @ A added."""
    targets = [e for e in bucket if e.key in adapted]
    pairs = dict(zip(map(id, targets), _adapters(reader, mapping, targets), strict=True))
    scale = lora_export.scaling(lora)
    out = []
    for entry, unit in zip(bucket, units, strict=True):
        if id(entry) in pairs:
            a, b = pairs[id(entry)]
            unit = lora_export.merged(unit.reshape(entry.shape), a, b, scale)
        out.append(unit)
    return out


def export_peft_adapter(
    megatron_dir: str | Path,
    output: str | Path,
    *,
    base_model: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> ConversionReport:
    """A LoRA checkpoint's adapters -> a Hugging Face PEFT adapter directory
    (`adapter_model.safetensors`, `adapter_config.json`; checkpoint/lora_export.py), which
    `peft.PeftModel.from_pretrained` loads onto the transformers model of the base (the run's
    `model.init_from`, or `convert_megatron_to_hf(..., lora_weights="base")`). base_model:
    what adapter_config.json names as `base_model_name_or_path`. Whole trained weights
    (lora.modules_to_save) are saved as PEFT saves its modules_to_save."""
    from safetensors.torch import save_file

    src = Path(megatron_dir)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        if not is_checkpoint(src):
            raise ConversionError(f"{src}: no {META_FILE}; not a gspo checkpoint")
        meta = read_meta(src)
        lora = meta.get("lora")
        if not lora:
            raise ConversionError(f"{src} holds no LoRA adapters: nothing to export as PEFT")
        problems = manifest.verify(src, required=False)
        if problems:
            raise ConversionError(f"{src}: damaged checkpoint: " + "; ".join(problems[:6]))
        cfg = model_config_from_meta(meta["model"])
        reader = torch_dist.TorchDistCheckpoint(src)
        mapping = get_mapping(cfg)
        check_megatron_checkpoint(reader, mapping)
        adapted = lora_export.adapted_weight_keys(lora, cfg.is_moe)
        entries = [e for e in mapping.entries if e.key in adapted]
        stored = reader.tensor(lora_export.adapter_keys(entries[0].key)[0]).properties.dtype
        target = parse_dtype(dtype) if dtype else stored
        units = (
            (entry, a, b)
            for entry, (a, b) in zip(entries, _adapters(reader, mapping, entries), strict=True)
        )
        tensors = {
            key: t.to(target).contiguous()
            for key, t in lora_export.peft_state_items(mapping, units, adapted)
        }
        saved = [SAVED_MODULES[name] for name in lora.get("modules_to_save", [])]
        for entry in mapping.entries:
            if entry.key in saved:
                unit = reader.read([_read_requests(entry, mapping)])[0]
                hf = [unit] if entry.kind == "vocab" else mapping.to_hf(entry, unit)
                for name, tensor in zip(entry.hf_names, hf, strict=True):
                    tensors[lora_export.saved_module_key(name)] = tensor.to(target).contiguous()
        report = ConversionReport(
            direction="megatron->peft",
            source=str(src),
            output=str(output),
            dtype=dtype_name(target),
            tensors=len(tensors),
            bytes_written=0,
            seconds=0.0,
            rss_before=mem.before,
            peak_rss=0,
            largest_tensor_bytes=max(t.numel() * t.element_size() for t in tensors.values()),
        )
        if base_model is None:
            report.notes.append(
                "adapter_config.json names no base model (pass --base-model: the run's "
                "model.init_from, or the directory of --lora-weights base)"
            )
        with staged_output(output, overwrite=overwrite, source=src) as tmp:
            save_file(tensors, str(tmp / lora_export.ADAPTER_FILE), metadata={"format": "pt"})
            config = lora_export.adapter_config(lora, adapted, mapping, base_model)
            lora_export.write_adapter_config(tmp, config)
            report.bytes_written = torch_dist.directory_bytes(tmp)
            report.seconds = time.perf_counter() - t0
    report.peak_rss = mem.peak
    return report


def _read_buckets(mapping: ModelMapping, read_bytes: int, itemsize: int):
    bucket: list[TensorMapping] = []
    size = 0
    for entry in mapping.entries:
        nbytes = entry.numel * itemsize
        if bucket and size + nbytes > read_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(entry)
        size += nbytes
    if bucket:
        yield bucket


def run_conversion_tool(convert, verify_tol: float, **kwargs: Any) -> int:
    """`convert(**kwargs)` for the conversion tools: its summary, and their exit status (2: bad
    input, one line; 1: verification found a log-prob (value model: value) difference above
    `verify_tol`)."""
    try:
        report = convert(**kwargs)
    except (ConversionError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report.summary())
    if report.verify_max_abs_diff is not None and report.verify_max_abs_diff > verify_tol:
        print(
            f"error: verification failed: {report.verify_max_abs_diff:.3e} > {verify_tol:g}",
            file=sys.stderr,
        )
        return 1
    return 0
