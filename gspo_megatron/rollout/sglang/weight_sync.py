"""Moving policy weights into SGLang servers: the three modes and their wire formats.

- `tensor` (colocated: trainer and server share the GPUs): each bucket is flattened into one
  uint8 tensor plus metadata, serialized with torch's ForkingPickler (CUDA tensors travel as IPC
  handles, not bytes), base64-encoded, and POSTed to /update_weights_from_tensor with
  `load_format="flattened_bucket"`, one payload per server TP rank. Each payload is serialized
  separately: SGLang notes that a shared payload breaks the producer's CUDA-IPC refcounting.
  Metadata entries are `types.SimpleNamespace` (attribute access is all SGLang's loader does, and
  SimpleNamespace is on its SafeUnpickler allow-list), so the trainer needs no sglang install.
- `distributed` (disaggregated: separate GPUs/nodes): once, /init_weights_update_group makes every
  server TP rank join a torch.distributed group with the trainer's sender as rank 0; then per
  bucket, /update_weights_from_distributed announces names/dtypes/shapes
  (`load_format="flattened_bucket"`: one broadcast of the bucket as a flat uint8 tensor) while the
  sender broadcasts it. Tensors are ordered by decreasing element size so every offset is aligned
  (SGLang's receive side checks it).
- `disk`: the sender writes the buckets as HF safetensors shards (+ index and the base model's
  config files) to a fresh directory and POSTs /update_weights_from_disk with its path.

SGLang 0.5.23 refuses /update_weights_from_tensor and /update_weights_from_distributed outside a
/begin_weight_update ... /end_weight_update session. /update_weights_from_disk is not part of that
protocol (its loader restores, loads and post-processes the weights itself; the scheduler does
not check for a session), so disk updates are sent without begin/end, which would post-process
in-place-quantized weights twice.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import shutil
import types
from collections.abc import Iterator, Sequence
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch

from gspo_megatron import files

logger = logging.getLogger(__name__)

# Files copied from the base model directory next to the new weights in disk mode.
_DISK_META_SUFFIXES = (".json", ".model", ".txt", ".tiktoken", ".jinja")
_WEIGHT_INDEX = "model.safetensors.index.json"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (SGLang resolves it with getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def order_for_alignment(
    named: Sequence[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """Tensors by decreasing element size (stable), so every byte offset in the flat bucket is a
    multiple of its tensor's element size."""
    return sorted(named, key=lambda nt: -nt[1].element_size())


def flatten_bucket(
    named: Sequence[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """(flat uint8 tensor, metadata) in SGLang's FlattenedTensorBucket layout, same device."""
    if not named:
        raise ValueError("cannot flatten an empty weight bucket")
    parts: list[torch.Tensor] = []
    metadata: list[types.SimpleNamespace] = []
    offset = 0
    for name, tensor in named:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(tensor.shape),
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + flat.numel(),
                numel=flat.numel(),
            )
        )
        parts.append(flat)
        offset += flat.numel()
    return torch.cat(parts), metadata


def serialize_flattened_bucket(flat: torch.Tensor, metadata: list[types.SimpleNamespace]) -> str:
    """One base64 ForkingPickler payload, as SGLang's MultiprocessingSerializer(output_str=True)
    writes it."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def tensor_update_body(
    named: Sequence[tuple[str, torch.Tensor]], tp_size: int, weight_version: str
) -> tuple[dict, torch.Tensor]:
    """The /update_weights_from_tensor body for one bucket and one server, and the flat tensor
    (keep it alive until the server answers: the payload only points at its memory)."""
    flat, metadata = flatten_bucket(named)
    body = {
        "serialized_named_tensors": [
            serialize_flattened_bucket(flat, metadata) for _ in range(tp_size)
        ],
        "load_format": "flattened_bucket",
        "flush_cache": True,
        "weight_version": weight_version,
    }
    return body, flat


def distributed_update_body(
    named: Sequence[tuple[str, torch.Tensor]], group_name: str, weight_version: str
) -> dict:
    """The /update_weights_from_distributed body for one (already aligned) bucket."""
    return {
        "names": [n for n, _ in named],
        "dtypes": [dtype_name(t.dtype) for _, t in named],
        "shapes": [list(t.shape) for _, t in named],
        "group_name": group_name,
        "load_format": "flattened_bucket",
        "flush_cache": True,
        "weight_version": weight_version,
    }


def init_weights_update_group_body(
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    group_name: str,
    backend: str,
) -> dict:
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "group_name": group_name,
        "backend": backend,
    }


def init_custom_process_group(
    *,
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta,
) -> torch.distributed.ProcessGroup:
    """A process group outside the trainer's default group, built exactly as SGLang's server side
    builds its end (sglang.srt.utils.common.init_custom_process_group): TCP rendezvous, a
    PrefixStore named after the group, identity rank map. Needs no default group."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class DiskWriter:
    """Writes HF safetensors checkpoints for /update_weights_from_disk under `root`, one fresh
    directory per version (written under a temporary name, then renamed), removing the
    previous one once the servers loaded the new one. The trainer's leader is its one writer;
    exports that a killed writer of this host left half written are removed when it starts."""

    def __init__(self, root: str | Path, base_model_path: str | Path | None) -> None:
        self.root = Path(root)
        self.base_model_path = Path(base_model_path) if base_model_path else None
        self._previous: Path | None = None
        for left in files.remove_temporaries(self.root, only_dead_writers=True):
            logger.info("removed %s, an export its writer did not finish", left)

    def write(self, buckets: Iterator[list[tuple[str, torch.Tensor]]], version: int) -> Path:
        from safetensors.torch import save_file

        final = self.root / f"weights_v{version}"
        self.root.mkdir(parents=True, exist_ok=True)
        with files.staged(final) as tmp:
            tmp.mkdir()
            weight_map: dict[str, str] = {}
            total = 0
            for i, bucket in enumerate(buckets):
                fname = f"model-{i + 1:05d}.safetensors"
                tensors = {n: t.detach().contiguous().cpu() for n, t in bucket}
                for n, t in tensors.items():
                    if n in weight_map:
                        raise ValueError(f"weight source yielded {n!r} twice")
                    weight_map[n] = fname
                    total += t.numel() * t.element_size()
                save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            if not weight_map:
                raise ValueError("weight source yielded no tensors")
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / _WEIGHT_INDEX).write_text(json.dumps(index, indent=1))
            if self.base_model_path is not None:
                for f in self.base_model_path.iterdir():
                    if f.is_file() and f.suffix in _DISK_META_SUFFIXES and f.name != _WEIGHT_INDEX:
                        shutil.copy2(f, tmp / f.name)
        return final

    def committed(self, path: Path) -> None:
        """The servers loaded `path`: drop the directory before it."""
        if self._previous is not None and self._previous != path:
            shutil.rmtree(self._previous, ignore_errors=True)
        self._previous = path
