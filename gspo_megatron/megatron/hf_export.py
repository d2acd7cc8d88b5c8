"""The policy as a verified Hugging Face model, written after a checkpoint (export_hf_every).

`HFExporter.export(step, checkpoint)` (collective) writes `checkpoints/step_N/hf/`: safetensors
shards with per-expert names, `model.safetensors.index.json`, `config.json` and the run's
tokenizer files, loadable by transformers, SGLang or vLLM as they are.

- **Rank-parallel, no second copy.** The weights come from `MegatronWeightSource`'s bucketed
  gather (the same that feeds the rollout servers), each bucket gathered to the rank that writes
  it: the buckets are split over the ranks in contiguous runs of about equal bytes, and each
  rank streams its run into shards of its own (`hf_io.ShardedSafetensorsWriter`, numbered
  globally). No rank holds more than one bucket of gathered weights.
- **Atomic.** Everything is written to `hf.tmp-…` inside the checkpoint (a name unique to
  rank 0, `files.temporary_path`, shared by all), checked, then renamed; its files are then
  added to the checkpoint's manifest (size, SHA-256). A kill leaves a `hf.tmp-*` directory (or a
  renamed one the manifest does not list): not an export; the resumed run removes it and
  exports that step again.
- **A LoRA policy** (`engine.lora`) is exported merged, base + alpha/r * B @ A with the
  modules_to_save's trained weights (`lora_sync.LoRAWeightSource`, the merged weights SGLang
  receives; what tools/convert_megatron_to_hf.py writes by default from a LoRA checkpoint):
  a model transformers, SGLang or vLLM load without peft.
- **Verified.** (1) Every rank reads back, through the HF loader's own path
  (`weight_loading.hf_regions`), the regions of the export that its model shards hold and
  compares them with its live weights cast to the export's dtype (a LoRA policy's: the weights
  its layers apply, `effective_weight()`, via `lora_sync.EffectiveWeights`): any difference
  names the HF tensor. (2) The trainer's log-probs (a LoRA policy's with its adapters on) of a
  fixed probe batch (random tokens, `PROBE`) equal those of transformers' model loaded from the
  export (float32, on rank 0) within `TOLERANCE` for the trainer's dtype. A failed check keeps
  the export as `hf.failed/` with its record (`gspo_export.json`: the differences and the
  suspect tensors); the caller decides whether the run goes on (trainer.export_hf_on_failure).
- **Nothing lost on failure.** A full disk (checked before writing, and any write error), a
  tokenizer that cannot be saved, transformers failing on the export: one line naming the step
  and the reason; the temporary directory is removed and the checkpoint is as it was.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint import manifest
from gspo_megatron.checkpoint.hf_io import (
    HFCheckpoint,
    ShardedSafetensorsWriter,
    dtype_name,
    hf_config_for_export,
    shard_file_name,
    split_shards,
    write_index,
)
from gspo_megatron.config_fields import ConfigError
from gspo_megatron.files import TEMPORARY_MARK, fsync_dir, temporary_path
from gspo_megatron.megatron.lora_sync import EffectiveWeights, LoRAWeightSource
from gspo_megatron.megatron.verify import engine_logprobs, random_sequences, transformers_logprobs
from gspo_megatron.megatron.weight_export import MegatronWeightSource
from gspo_megatron.megatron.weight_loading import hf_regions

EXPORT_DIR = "hf"
FAILED_DIR = "hf.failed"
RECORD_FILE = "gspo_export.json"
PROBE = {"sequences": 4, "tokens": 64, "seed": 0}  # random token ids, every expert routed to
# Log-prob tolerance (max, mean |trainer - transformers|) by the trainer's dtype; transformers
# computes in float32 on the exported weights. float32: the conversion tests measure <= 1e-6;
# bf16: docs/ENGINE.md's limits for the same comparison.
TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (0.1, 0.02),
    torch.float16: (0.1, 0.02),
}
BUCKET_BYTES = 256 << 20
MAX_SHARD_BYTES = 5 * 10**9
_ROOM = 1.05  # free space wanted beyond the export's bytes (config, tokenizer, slack)


@dataclass
class ExportResult:
    step: int
    ok: bool
    message: str  # one line for the user
    path: Path | None = (
        None  # hf/ (verified) or hf.failed/ (kept for inspection); None: not written
    )
    record: dict[str, Any] = field(default_factory=dict)


class HFExporter:
    """Exports a TrainingEngine's policy (see the module's docstring). Every rank builds one.

    tokenizer: saved with the weights (`save_pretrained`). base_config: the original
    config.json's fields (token ids, generation settings; from model.init_from), or None.
    """

    def __init__(
        self,
        engine,
        *,
        tokenizer,
        base_config: dict[str, Any] | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        max_shard_bytes: int = MAX_SHARD_BYTES,
    ) -> None:
        self.engine = engine
        self.model_config = engine.model_config
        self.dtype = engine.config.params_dtype
        self.lora = getattr(engine, "lora", None)
        if self.lora is not None:  # the merged model (module docstring)
            self.source = LoRAWeightSource.from_engine(engine, dtype=self.dtype)
            self.pieces = self.source.base  # the base weights' pieces, read back merged
        else:
            self.source = MegatronWeightSource.from_engine(engine, dtype=self.dtype)
            self.pieces = self.source
        self.tokenizer = tokenizer
        self.base_config = base_config
        self.max_shard_bytes = max_shard_bytes
        shapes = self.source.hf_shapes().values()
        self.total_bytes = sum(math.prod(s) for s in shapes) * self.dtype.itemsize
        # at least one bucket per rank, so that every rank writes a share
        world = dist.get_world_size()
        self.bucket_bytes = max(1, min(bucket_bytes, -(-self.total_bytes // world)))

    # -- the export ---------------------------------------------------------------------------

    def export(self, step: int, checkpoint: Path) -> ExportResult:
        """Write, verify and publish step `step`'s export in `checkpoint` (collective)."""
        started = time.perf_counter()
        checkpoint = Path(checkpoint)
        rank = dist.get_rank()
        problem = _broadcast(self._room_problem(checkpoint) if rank == 0 else None)
        if problem:
            return _not_written(step, problem)
        tmp = _broadcast(temporary_path(checkpoint / EXPORT_DIR))  # one name, rank 0's
        timings: dict[str, float] = {}
        try:
            problem = _on_rank0(lambda: tmp.mkdir())
            digests, problem = self._write(tmp) if problem is None else ({}, problem)
            problem = _first(_all_gather(problem)) or _broadcast(
                self._write_config_and_tokenizer(tmp) if rank == 0 else None
            )
            if problem:
                return _not_written(step, problem)
            timings["write_s"] = time.perf_counter() - started
            suspects = self._compare(tmp)
            timings["compare_s"] = time.perf_counter() - started - timings["write_s"]
            probe = self._probe(tmp)
            timings["probe_s"] = time.perf_counter() - started - sum(timings.values())
            return self._publish(step, checkpoint, tmp, digests, suspects, probe, timings)
        finally:
            if rank == 0 and tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            dist.barrier()

    def _room_problem(self, checkpoint: Path) -> str | None:
        try:
            free = shutil.disk_usage(checkpoint).free
        except OSError as err:
            return f"{checkpoint}: {err.strerror or err}"
        if free < _ROOM * self.total_bytes:
            return (
                f"it needs {manifest.format_bytes(self.total_bytes)} and "
                f"{manifest.format_bytes(free)} is free under {checkpoint.parent}"
            )
        return None

    def _assignment(self) -> tuple[list[int], list[list[tuple[str, torch.dtype, tuple]]]]:
        """The rank each bucket is gathered to (contiguous runs of about equal bytes), and each
        rank's tensors in the order it receives them."""
        plan = self.source.plan(self.bucket_bytes)
        world = dist.get_world_size()
        sizes = [sum(math.prod(s) * d.itemsize for _, s, d in b) for b in plan]
        total, done, owners = sum(sizes), 0, []
        for size in sizes:
            owners.append(min(world - 1, done * world // max(total, 1)))
            done += size
        per_rank: list[list[tuple[str, torch.dtype, tuple]]] = [[] for _ in range(world)]
        for owner, bucket in zip(owners, plan, strict=True):
            per_rank[owner] += [(name, dtype, shape) for name, shape, dtype in bucket]
        return owners, per_rank

    def _write(self, tmp: Path) -> tuple[dict[str, dict], str | None]:
        """This rank's shards (collective: every rank iterates every bucket, even after a failed
        write, so that no rank waits for it); (their digests, this rank's problem)."""
        rank = dist.get_rank()
        owners, per_rank = self._assignment()
        shards = [split_shards(tensors, self.max_shard_bytes) for tensors in per_rank]
        counts = [len(s) for s in shards]
        writer = ShardedSafetensorsWriter(
            tmp, per_rank[rank], self.max_shard_bytes, first=sum(counts[:rank]), total=sum(counts)
        )
        self._shards = [
            (shard_file_name(sum(counts[:r]) + i, sum(counts)), entries)
            for r, rank_shards in enumerate(shards)
            for i, entries in enumerate(rank_shards)
        ]
        problem = None
        for bucket in self.source.buckets(self.bucket_bytes, owners):
            if problem is not None:
                continue
            try:
                for name, tensor in bucket:
                    writer.write(name, tensor.cpu())
            except Exception as err:  # noqa: BLE001 - reported on every rank, none left waiting
                writer.abort()
                problem = _describe(err, tmp)
        if problem is not None:
            return {}, problem
        try:
            writer.close(index=False)
            return manifest.digest_files(tmp, writer.files), None
        except Exception as err:  # noqa: BLE001 - reported on every rank
            return {}, _describe(err, tmp)

    def _write_config_and_tokenizer(self, tmp: Path) -> str | None:
        """Rank 0: the index, config.json and the tokenizer's files."""
        try:
            write_index(tmp, self._shards)
            config = hf_config_for_export(self.model_config, self.base_config, self.dtype)
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        except Exception as err:  # noqa: BLE001 - reported on every rank
            return _describe(err, tmp)
        try:
            self.tokenizer.save_pretrained(str(tmp))
        except Exception as err:  # noqa: BLE001 - any tokenizer's failure, named
            return f"the tokenizer could not be saved ({type(err).__name__}: {err})"
        return None

    # -- verification --------------------------------------------------------------------------

    def _compare(self, tmp: Path) -> dict[str, float]:
        """HF tensor name -> max |exported - trainer| over the regions this rank holds, for every
        tensor that differs (of every rank, gathered)."""
        found: dict[str, float] = {}
        applied = EffectiveWeights(self.engine.unwrapped_chunks) if self.lora else None
        try:
            ckpt = HFCheckpoint(tmp)
            vocab = self.model_config.vocab_size
            with torch.no_grad():
                for entry, offsets, sh, region in hf_regions(
                    self.pieces.chunks, self.pieces.mapping, ckpt, main_replica_only=True
                ):
                    live = sh.data.detach() if applied is None else applied.of(sh.data.detach())
                    # on the host, where the export's regions are read (one piece at a time)
                    live = live.reshape(region.shape).to(region.device, self.dtype)
                    if entry.kind == "vocab":  # padding rows are not exported
                        rows = max(0, min(region.shape[0], vocab - offsets[0]))
                        live, region = live[:rows], region[:rows]
                    if region.numel() == 0:
                        continue
                    differs = ~torch.eq(live, region) & ~(live.isnan() & region.isnan())
                    for row in differs.reshape(differs.shape[0], -1).any(1).nonzero().flatten():
                        name = self.pieces.mapping.hf_name_of_row(entry, offsets[0] + int(row))
                        diff = float((live[row].float() - region[row].float()).abs().max())
                        found[name] = max(found.get(name, 0.0), diff)
        except Exception as err:  # noqa: BLE001 - an unreadable export: nothing can be trusted
            found[f"<unreadable: {_describe(err, tmp)}>"] = float("inf")
        merged: dict[str, float] = {}
        for part in _all_gather(found):
            for name, diff in part.items():
                merged[name] = max(merged.get(name, 0.0), diff)
        return merged

    def _probe(self, tmp: Path) -> dict[str, Any]:
        """The probe's log-prob differences, trainer vs transformers (rank 0's, shared)."""
        tokens = random_sequences(
            self.model_config.vocab_size, PROBE["sequences"], self._probe_length(), PROBE["seed"]
        )
        trainer = engine_logprobs(self.engine, tokens.tolist())  # collective
        out: dict[str, Any] | None = None
        if dist.get_rank() == 0:
            from transformers.utils import logging as hf_logging

            bars = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # one line per export is what the user reads
            try:
                reference = transformers_logprobs(tmp, tokens)
                diff = (reference - torch.tensor(trainer, dtype=torch.float32)).abs()
                out = {"max": float(diff.max()), "mean": float(diff.mean())}
            except Exception as err:  # noqa: BLE001 - the export did not load or run
                out = {"error": f"transformers could not run the export ({type(err).__name__}: "
                       f"{str(err).splitlines()[0] if str(err) else ''})"}  # fmt: skip
            finally:
                if bars:
                    hf_logging.enable_progress_bar()
        return _broadcast(out)

    def _lora_record(self) -> dict[str, Any] | None:
        if self.lora is None:
            return None
        lora = self.lora
        return {
            "rank": lora.rank,
            "alpha": lora.alpha,
            "targets": list(lora.targets),
            "modules_to_save": list(lora.modules_to_save),
        }

    def _probe_length(self) -> int:
        return min(PROBE["tokens"], self.engine.settings.max_sequence_length)

    # -- publishing ----------------------------------------------------------------------------

    def _publish(self, step, checkpoint, tmp, digests, suspects, probe, timings) -> ExportResult:
        limit_max, limit_mean = TOLERANCE.get(self.dtype, TOLERANCE[torch.bfloat16])
        reasons = []
        if "error" in probe:
            reasons.append(probe["error"])
        elif probe["max"] > limit_max or probe["mean"] > limit_mean:
            reasons.append(
                f"log-probs differ from transformers' by max {probe['max']:.3e}, mean "
                f"{probe['mean']:.3e} (tolerance {limit_max:g}, {limit_mean:g})"
            )
        if suspects:
            reasons.append(f"{len(suspects)} exported tensors differ from the trainer's")
        ok = not reasons
        final = checkpoint / (EXPORT_DIR if ok else FAILED_DIR)
        record = {
            "step": step,
            "verified": ok,
            "problems": reasons,
            "dtype": dtype_name(self.dtype),
            # a LoRA policy's export is the merged model: the adapters it holds
            "lora_merged": self._lora_record(),
            "bytes": self.total_bytes,
            "probe": {**PROBE, "tokens": self._probe_length()},
            "logprob_diff": {k: v for k, v in probe.items() if k != "error"},
            "tolerance": {"max": limit_max, "mean": limit_mean},
            "suspect_tensors": dict(sorted(suspects.items(), key=lambda kv: -kv[1])),
            "seconds": {k: round(v, 3) for k, v in timings.items()},
        }
        shard_digests = {}
        for part in _all_gather(digests):
            shard_digests.update(part)
        problem = None
        if dist.get_rank() == 0:
            problem = _on_rank0_now(
                lambda: _rename_and_list(checkpoint, tmp, final, record, shard_digests)
            )
        problem = _broadcast(problem)
        if problem:
            return _not_written(step, problem)
        took = sum(timings.values())
        if ok:
            message = (
                f"step {step}: Hugging Face export verified in {took:.2f} s: {final} "
                f"({manifest.format_bytes(self.total_bytes)}; log-probs within "
                f"{probe['max']:.1e} of transformers')"
            )
        else:
            named = ", ".join(
                f"{n} ({d:.3g})" for n, d in list(record["suspect_tensors"].items())[:5]
            )
            more = len(suspects) - 5
            message = (
                f"step {step}: Hugging Face export FAILED verification ({'; '.join(reasons)})"
                + (f"; suspect tensors: {named}" + (f" and {more} more" if more > 0 else ""))
                * bool(named)
                + f"; kept in {final} for inspection; the checkpoint itself is intact"
            )
        return ExportResult(step, ok, message, final, record)

    # -- resume ----------------------------------------------------------------------------------

    def present(self, checkpoint: Path) -> bool:
        """Whether `checkpoint` holds an export of itself (verified or failed) whose files are
        all there, as its manifest lists them. Collective (rank 0 looks)."""
        found = None
        if dist.get_rank() == 0:
            found = _export_listed(Path(checkpoint))
        return bool(_broadcast(found))

    def clear_leftovers(self, checkpoint: Path) -> list[str]:
        """Remove what an interrupted export left in `checkpoint` (rank 0; returns the names)."""
        removed = []
        if dist.get_rank() == 0:
            listed = _export_listed(Path(checkpoint))
            for child in Path(checkpoint).iterdir():
                partial = child.name.startswith(f"{EXPORT_DIR}{TEMPORARY_MARK}")
                unlisted = child.name in (EXPORT_DIR, FAILED_DIR) and not listed
                if child.is_dir() and (partial or unlisted):
                    shutil.rmtree(child, ignore_errors=True)
                    removed.append(child.name)
        dist.barrier()
        return removed


def check_exportable(model_config, tokenizer) -> None:
    """trainer.export_hf_every's refusals that are known before training: a model with no HF
    mapping, a tokenizer that cannot be saved. ConfigError naming the key and the reason."""
    from gspo_megatron.checkpoint.mapping import ConversionError, get_mapping

    try:
        get_mapping(model_config)
    except ConversionError as err:
        raise ConfigError(f"trainer.export_hf_every: the model cannot be exported ({err})") from err
    with tempfile.TemporaryDirectory() as scratch:
        try:
            tokenizer.save_pretrained(scratch)
        except Exception as err:  # noqa: BLE001 - any tokenizer's failure, named
            raise ConfigError(
                f"trainer.export_hf_every: the tokenizer (model.tokenizer) cannot be saved with "
                f"the export ({type(err).__name__}: {err}); set trainer.export_hf_every=0 or use "
                "a tokenizer transformers can save"
            ) from err


# -- helpers ------------------------------------------------------------------------------------


def _rename_and_list(
    checkpoint: Path, tmp: Path, final: Path, record: dict, shard_digests: dict
) -> None:
    """Rank 0: the record, the rename into place (replacing an earlier export of this step),
    then the manifest's entries for every file."""
    (tmp / RECORD_FILE).write_text(json.dumps(record, indent=1))
    rest = manifest.unlisted_files(tmp, shard_digests)  # rank 0's: index, config, tokenizer
    digests = {**shard_digests, **manifest.digest_files(tmp, rest)}
    for old in (EXPORT_DIR, FAILED_DIR):
        if (checkpoint / old).exists():
            shutil.rmtree(checkpoint / old)
    os.replace(tmp, final)
    fsync_dir(checkpoint)
    manifest.add_entries(
        checkpoint,
        {f"{final.name}/{name}": d for name, d in digests.items()},
        drop=manifest.DERIVED_DIRS,
    )


def _export_listed(checkpoint: Path) -> bool:
    try:
        entries = manifest.read_manifest(checkpoint)
    except manifest.ManifestError:
        return False
    mine = {k: v for k, v in entries.items() if k.startswith(manifest.DERIVED_DIRS)}
    has_record = any(k.endswith(f"/{RECORD_FILE}") for k in mine)
    return has_record and not manifest.check_sizes(checkpoint, mine)


def _not_written(step: int, reason: str) -> ExportResult:
    return ExportResult(
        step,
        False,
        f"step {step}: Hugging Face export not written: {reason}; the checkpoint itself is intact",
    )


def _describe(err: BaseException, where: Path) -> str:
    if isinstance(err, OSError) and err.errno:
        name = err.filename or where
        return f"{name}: {os.strerror(err.errno)} [errno {err.errno}]"
    return f"{type(err).__name__}: {err}"


def _on_rank0(fn) -> str | None:
    problem = _on_rank0_now(fn) if dist.get_rank() == 0 else None
    return _broadcast(problem)


def _on_rank0_now(fn) -> str | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported on every rank, none left waiting
        return _describe(err, Path("."))
    return None


def _first(values: list) -> Any:
    return next((v for v in values if v), None)


def _all_gather(value: Any) -> list:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
