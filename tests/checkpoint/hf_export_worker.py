"""The Hugging Face export after a checkpoint (megatron/hf_export.py), under torchrun.

    torchrun --nproc-per-node 2 tests/checkpoint/hf_export_worker.py --hf-dir M [--hf-dir M2] \
        --out O --layout ep=2 --layout pp=2 [--case corrupt] [--case enospc] [--case tokenizer] \
        [--lora]

For each model and layout: a TrainingEngine loaded from the HF model M on that layout exports
itself into
a checkpoint directory of its own (O/<layout>/step_000003, holding a manifest) with
`HFExporter.export`. Checked on rank 0: the export is verified (the exporter's own checks:
every rank's shards against its live weights, log-probs against transformers'), every rank wrote
a share, every tensor equals M's bit for bit, the manifest lists every file with its checksum,
no temporary directory is left. Cases (on the first layout): `corrupt` adds 0.5 to one element
of one tensor as it is written: the export fails, kept as hf.failed/, naming exactly that
tensor; `enospc`: rank 1's shard write fails with "No space left on device": one line naming the
step and the reason, nothing left behind, the manifest as it was; `tokenizer`: a tokenizer whose
save_pretrained raises: refused up front (check_exportable) and, at export time, one line.

`--lora`: the engine has LoRA adapters (rank 4, alpha 8, every target, the output layer and
the final norm trained whole) and takes two Adam steps first (B away from zero, the saved
modules away from M's). The export must be the merged model: verified by the exporter
(read back against the layers' effective weights, log-probs with the adapters on), bitwise
equal to what tools/convert_megatron_to_hf.py writes from the engine's checkpoint (the same
merge, `lora_mapping.merged_weight`: `merged_bitwise_equal_to_the_converted_checkpoint`), and
far from M where adapters sit (`adapters_change_the_export`: an export that dropped them fails).

Prints one JSON line per check on rank 0: {"layout", "check", "value", "ok"}.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from engine_steps import gspo_steps
from layout_text import parse_layout

from gspo_megatron.checkpoint import hf_io, manifest
from gspo_megatron.checkpoint.hf_io import HFCheckpoint, read_hf_config
from gspo_megatron.config_fields import ConfigError
from gspo_megatron.megatron import checkpointing, parallel
from gspo_megatron.megatron.hf_export import FAILED_DIR, HFExporter, check_exportable
from gspo_megatron.megatron.training_engine import TrainingEngine
from gspo_megatron.megatron.weight_loading import load_weights
from gspo_megatron.spec.lora import LoRASettings
from gspo_megatron.spec.sample import TrainSample
from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

CORRUPTED = "model.layers.1.mlp.experts.2.gate_proj.weight"
LAYOUT = ""
LORA = LoRASettings(rank=4, alpha=8.0, modules_to_save=["output_layer", "final_norm"])


def emit(check: str, value, ok: bool) -> None:
    if dist.get_rank() == 0:
        line = {"layout": LAYOUT, "check": check, "value": value, "ok": bool(ok)}
        print(json.dumps(line), flush=True)


def build(hf_dir: Path, text: str, lora: bool = False) -> TrainingEngine:
    layout = parse_layout(text, parallel.world_size_from_env())
    parallel.initialize(layout, seed=3)
    cfg = read_hf_config(hf_dir)[0]
    optimizer = OptimizerSettings(
        name="adam" if lora else "sgd", lr=2e-2 if lora else 0.0, clip_grad=0.0,
        weight_decay=0.0, distributed_optimizer=False,
    )  # fmt: skip
    engine = TrainingEngine(
        cfg, layout, EngineSettings(max_sequence_length=64), optimizer,
        lora=LORA if lora else None, lora_seed=3,
    )  # fmt: skip
    load_weights(engine.unwrapped_chunks, cfg, hf_dir)
    engine.optimizer.reload_model_params()
    if lora:
        train(engine, cfg.vocab_size)
    return engine


def train(engine: TrainingEngine, vocab: int) -> None:
    """Two Adam steps on random samples: B and the saved modules move (the same on every
    layout, whose ranks see the same batch)."""
    gen = torch.Generator().manual_seed(5)
    batch = []
    for n in (9, 23, 5, 14):
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        batch.append(TrainSample(ids[:3], ids[3:], advantage=float(n % 3) - 1.0))
    gspo_steps(engine, batch, 2)


def checkpoint_dir(out: Path, name: str) -> Path:
    """A checkpoint directory to export into: a manifest listing one file, as after a save."""
    path = out / name / "step_000003"
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
        (path / "gspo_checkpoint.json").write_text("{}")
        manifest.write_manifest(path, manifest.digest_files(path, ["gspo_checkpoint.json"]))
    dist.barrier()
    return path


def exporter(engine: TrainingEngine, hf_dir: Path, tokenizer=None) -> HFExporter:
    from transformers import AutoTokenizer

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(hf_dir)
    base = json.loads((hf_dir / "config.json").read_text())
    # small buckets: several per rank, each gathered from every layout's pieces
    return HFExporter(engine, tokenizer=tokenizer, base_config=base, bucket_bytes=40_000)


def check_export(engine: TrainingEngine, hf_dir: Path, out: Path) -> None:
    where = checkpoint_dir(out, LAYOUT)
    result = exporter(engine, hf_dir).export(3, where)
    converted = None
    if engine.lora is not None:  # the converter's merge of the same weights, to compare with
        saved = out / f"{LAYOUT}-megatron"
        checkpointing.save_engine(engine, saved, with_optimizer=False)
        if dist.get_rank() == 0:
            from gspo_megatron.checkpoint.convert import convert_megatron_to_hf

            converted = out / f"{LAYOUT}-converted"
            convert_megatron_to_hf(saved, converted)
        dist.barrier()
    emit("export_verified", result.message, result.ok)
    if dist.get_rank() != 0:
        return
    record = result.record
    emit("logprobs_vs_transformers", record["logprob_diff"]["max"],
         record["logprob_diff"]["max"] <= 1e-5)  # fmt: skip
    emit("no_suspect_tensor", record["suspect_tensors"], not record["suspect_tensors"])
    export = HFCheckpoint(result.path)
    source = HFCheckpoint(hf_dir)
    shards = sorted({info.file.name for info in export.tensors.values()})
    emit("every_rank_wrote_a_share", shards, len(shards) >= dist.get_world_size())
    names_equal = sorted(export.names) == sorted(source.names)
    differ = [n for n in source.names if not torch.equal(export.read(n), source.read(n))]
    if converted is None:
        emit("tensors_bitwise_equal_to_the_source", differ, names_equal and not differ)
    else:
        reference = HFCheckpoint(converted)
        unequal = [n for n in reference.names if not torch.equal(export.read(n), reference.read(n))]
        same_names = sorted(export.names) == sorted(reference.names)
        emit("merged_bitwise_equal_to_the_converted_checkpoint", unequal[:5],
             same_names and not unequal)  # fmt: skip
        # every adapted or trained tensor moved away from M (an adapter dropped would not)
        unmoved = [
            n for n in source.names
            if n.endswith(("proj.weight", "lm_head.weight", "model.norm.weight"))
            and n not in differ
        ]  # fmt: skip
        emit("adapters_change_the_export", unmoved[:5], names_equal and not unmoved)
    problems = manifest.verify(where)
    listed = manifest.read_manifest(where)
    files = {str(p.relative_to(where)) for p in where.rglob("*") if p.is_file()}
    unlisted = sorted(files - set(listed) - {manifest.MANIFEST_FILE})
    emit("manifest_lists_every_file", [problems, unlisted], not problems and not unlisted)
    leftovers = [p.name for p in where.iterdir() if ".tmp-" in p.name]
    emit("nothing_temporary_left", leftovers, not leftovers)
    config = json.loads((result.path / "config.json").read_text())
    tokenizer_saved = (result.path / "tokenizer.json").is_file()
    emit("config_and_tokenizer", [config["model_type"], tokenizer_saved],
         config["model_type"] == "qwen3_moe" and tokenizer_saved)  # fmt: skip


def check_corrupted(engine: TrainingEngine, hf_dir: Path, out: Path) -> None:
    where = checkpoint_dir(out, f"{LAYOUT}-corrupt")
    original = hf_io.ShardedSafetensorsWriter.write

    def corrupting_write(self, name, tensor):
        if name == CORRUPTED:
            tensor = tensor.clone()
            tensor.view(-1)[7] += 0.5
        return original(self, name, tensor)

    hf_io.ShardedSafetensorsWriter.write = corrupting_write
    try:
        result = exporter(engine, hf_dir).export(3, where)
    finally:
        hf_io.ShardedSafetensorsWriter.write = original
    emit("corrupted_export_fails", result.message, not result.ok and CORRUPTED in result.message)
    if dist.get_rank() == 0:
        suspects = result.record.get("suspect_tensors", {})
        emit("corrupted_tensor_named_alone", suspects, list(suspects) == [CORRUPTED])
        kept = result.path == where / FAILED_DIR and not (where / "hf").exists()
        emit("failed_export_kept_aside", str(result.path), kept)


def check_full_disk(engine: TrainingEngine, hf_dir: Path, out: Path) -> None:
    where = checkpoint_dir(out, f"{LAYOUT}-enospc")
    before = manifest.read_manifest(where) if dist.get_rank() == 0 else None
    original = hf_io.ShardedSafetensorsWriter.write

    def full_disk_write(self, name, tensor):
        if dist.get_rank() == dist.get_world_size() - 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.out_dir / "x"))
        return original(self, name, tensor)

    hf_io.ShardedSafetensorsWriter.write = full_disk_write
    try:
        result = exporter(engine, hf_dir).export(3, where)
    finally:
        hf_io.ShardedSafetensorsWriter.write = original
    said = "step 3" in result.message and "No space left on device" in result.message
    one_line = "\n" not in result.message
    emit("full_disk_one_line", result.message, not result.ok and said and one_line)
    if dist.get_rank() == 0:
        left = sorted(p.name for p in where.iterdir())
        same = manifest.read_manifest(where) == before
        emit("full_disk_leaves_the_checkpoint_as_it_was", left,
             left == ["gspo_checkpoint.json", "manifest.json"] and same)  # fmt: skip


class _UnsavableTokenizer:
    def save_pretrained(self, path):
        raise TypeError("this tokenizer has no files to save")


def check_tokenizer(engine: TrainingEngine, hf_dir: Path, out: Path) -> None:
    try:
        check_exportable(engine.model_config, _UnsavableTokenizer())
        refused = "not refused"
    except ConfigError as err:
        refused = str(err)
    emit("unsavable_tokenizer_refused_up_front", refused,
         "trainer.export_hf_every" in refused and "cannot be saved" in refused)  # fmt: skip
    where = checkpoint_dir(out, f"{LAYOUT}-tokenizer")
    result = exporter(engine, hf_dir, _UnsavableTokenizer()).export(3, where)
    emit("unsavable_tokenizer_at_export", result.message,
         not result.ok and "tokenizer could not be saved" in result.message)  # fmt: skip


CASES = {"corrupt": check_corrupted, "enospc": check_full_disk, "tokenizer": check_tokenizer}


def main() -> int:
    global LAYOUT
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf-dir", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layout", action="append", required=True)
    parser.add_argument("--case", action="append", default=[], choices=sorted(CASES))
    parser.add_argument("--lora", action="store_true")
    args = parser.parse_args()
    first = True
    for hf_dir in args.hf_dir:
        for text in args.layout:
            LAYOUT = f"{hf_dir.name}:{text}"
            engine = build(hf_dir, text, lora=args.lora)
            check_export(engine, hf_dir, args.out)
            for case in args.case if first else ():
                CASES[case](engine, hf_dir, args.out)
            first = False
            engine.close()
            parallel.destroy_model_parallel()  # the default group stays for the next layout
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
