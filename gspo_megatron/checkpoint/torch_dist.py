"""Streaming access to megatron's torch_dist checkpoint format, through torch DCP's public API.

A megatron-core torch_dist checkpoint is a torch.distributed.checkpoint (DCP) directory —
`.metadata` (every tensor's global shape and stored chunks, and where each chunk's bytes are)
plus `__*_*.distcp` data files — with `metadata.json` naming the backend. Tensors are stored
under their sharded keys as chunks of any shape; a reader asks for a region and gets it from
whichever chunks overlap it, which is why one checkpoint loads on every TP/PP/EP layout.
`ShardedObject`s (megatron's `_extra_state` entries and the `common_state` dict) are byte blobs
named `<key>/shard_<offset>_<global shape>`.

Writing: `write_checkpoint` hands DCP's FileSystemWriter a plan of chunks whose data a
callback produces only when the writer reaches it (the planner's `resolve_data`), so one chunk
is in memory at a time whatever the model size.

Reading: `TorchDistCheckpoint.read` builds DCP read items for the requested regions (chunks
indexed by their stacked layer/expert offsets, so a lookup does not scan every chunk of a key)
and lets a FileSystemReader fill them: `safe_load.SafeFileSystemReader`, whose `.metadata` read
runs no code from the file (DCP's own is `pickle.load`); objects are never read. No process
group is needed either way.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from gspo_megatron.checkpoint.mapping import ConversionError, Shape
from gspo_megatron.checkpoint.safe_load import PrebuiltPlanLoader, SafeFileSystemReader

# What megatron's dist_checkpointing.save writes next to the DCP files.
MEGATRON_CONFIG_FILE = "metadata.json"
MEGATRON_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
COMMON_STATE_KEY = "common_state"


def object_name(key: str, offset: Shape, global_shape: Shape) -> str:
    """The stored name of a megatron ShardedObject (its `unique_key`)."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, global_shape))}"


def serialized_object(value) -> io.BytesIO:
    """A ShardedObject's bytes as megatron writes them: torch.save of a one-element list."""
    buffer = io.BytesIO()
    torch.save([value], buffer)
    return buffer


@dataclass
class WriteChunk:
    """One stored chunk of a tensor; `produce()` returns its data (shape `sizes`) on demand."""

    key: str
    offsets: Shape
    sizes: Shape
    global_shape: Shape
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.dtype.itemsize


class _LazySavePlanner(DefaultSavePlanner):
    """A save plan given as chunk descriptions; each chunk's data is made when it is written."""

    def __init__(self, chunks: Sequence[WriteChunk], objects: dict[str, io.BytesIO]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, tuple(c.offsets)): c for c in chunks}
        self._objects = objects
        self._items = [
            WriteItem(
                index=MetadataIndex(c.key, c.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)
                    ),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
            for c in chunks
        ]
        self._items += [
            WriteItem(index=MetadataIndex(name), type=WriteItemType.BYTE_IO) for name in objects
        ]

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict = {}
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        # DefaultSavePlanner's plan validation compares chunks pairwise (quadratic in the
        # number of experts x layers); our chunks tile each tensor by construction.
        self.global_plan, self.metadata = create_default_global_save_plan(all_plans)
        return self.global_plan, self.metadata

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return self._objects[write_item.index.fqn]
        chunk = self._chunks[(write_item.index.fqn, tuple(write_item.index.offset))]
        data = chunk.produce()
        if tuple(data.shape) != tuple(chunk.sizes) or data.dtype != chunk.dtype:
            raise ConversionError(
                f"internal: chunk {chunk.key}{list(chunk.offsets)} produced "
                f"{list(data.shape)} {data.dtype}, planned {list(chunk.sizes)} {chunk.dtype}"
            )
        return data.contiguous()


def check_tiling(chunks: Sequence[WriteChunk]) -> None:
    """Every key's chunks lie inside it and add up to its volume (they never overlap by
    construction, so equal volume means full coverage)."""
    volume: dict[str, int] = {}
    shapes: dict[str, Shape] = {}
    for c in chunks:
        shapes.setdefault(c.key, c.global_shape)
        if any(
            o < 0 or o + s > g for o, s, g in zip(c.offsets, c.sizes, c.global_shape, strict=True)
        ):
            raise ConversionError(f"internal: chunk {c.key}{list(c.offsets)} out of bounds")
        volume[c.key] = volume.get(c.key, 0) + math.prod(c.sizes)
    for key, shape in shapes.items():
        if volume[key] != math.prod(shape):
            raise ConversionError(f"internal: chunks of {key} do not cover {list(shape)}")


def write_checkpoint(
    path: str | Path,
    chunks: Sequence[WriteChunk],
    objects: dict[str, io.BytesIO],
    *,
    threads: int = 1,
) -> None:
    """Write a megatron torch_dist checkpoint into the (empty) directory `path`."""
    check_tiling(chunks)
    path = Path(path)
    writer = FileSystemWriter(
        path, single_file_per_rank=True, thread_count=threads, sync_files=True
    )
    planner = _LazySavePlanner(chunks, objects)
    try:
        torch.distributed.checkpoint.save(
            state_dict={}, storage_writer=writer, planner=planner, no_dist=True
        )
    except CheckpointException as err:  # DCP wraps what our producers raised: unwrap it
        original = next(iter(err.failures.values()))[0]
        raise original from None
    (path / MEGATRON_CONFIG_FILE).write_text(json.dumps(MEGATRON_CONFIG))


class _RegionLoadPlanner(PrebuiltPlanLoader):
    """Copies read chunks into caller-provided destination tensors (TorchDistCheckpoint.read)."""

    def __init__(self, destinations: dict[tuple[str, Shape], torch.Tensor]) -> None:
        self._dest = destinations

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise ConversionError(f"internal: unexpected object read {read_item.storage_index.fqn}")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._dest[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(
            zip(read_item.dest_offsets, read_item.lengths, strict=True)
        ):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


class TorchDistCheckpoint:
    """Read regions of the tensors of a torch_dist checkpoint directory (metadata read once)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # Raises ConversionError for a missing or unreadable file, UnsafeCheckpointError
        # (a ConversionError) for metadata that names code to run.
        self._reader = SafeFileSystemReader(self.path)
        self.metadata = self._reader.read_metadata()
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self._chunk_index: dict[str, tuple[int, dict[Shape, list[ChunkStorageMetadata]]]] = {}

    def tensor(self, key: str) -> TensorStorageMetadata | None:
        md = self.metadata.state_dict_metadata.get(key)
        return md if isinstance(md, TensorStorageMetadata) else None

    def check_files(self) -> None:
        """Every data file the metadata names exists and is long enough (else name it)."""
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            end = info.offset + info.length
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
        for name, end in sorted(needed.items()):
            file = self.path / name
            if not file.is_file():
                raise ConversionError(f"{file}: checkpoint data file is missing")
            size = file.stat().st_size
            if size < end:
                raise ConversionError(
                    f"{file}: checkpoint data file is truncated ({size} bytes, the metadata "
                    f"needs {end})"
                )

    def _chunks_for(self, key: str, offsets: Shape, stacked: int) -> list[ChunkStorageMetadata]:
        md = self.metadata.state_dict_metadata[key]
        if key not in self._chunk_index:
            # Index chunks by their offsets along the stacked axes when each chunk spans one
            # position there (megatron writes per-layer / per-expert chunks).
            if stacked and all(all(s == 1 for s in c.sizes[:stacked]) for c in md.chunks):
                index: dict[Shape, list[ChunkStorageMetadata]] = {}
                for c in md.chunks:
                    index.setdefault(tuple(c.offsets[:stacked]), []).append(c)
                self._chunk_index[key] = (stacked, index)
            else:
                self._chunk_index[key] = (0, {(): list(md.chunks)})
        depth, index = self._chunk_index[key]
        return index.get(tuple(offsets[:depth]), [])

    def read(self, requests: Sequence[tuple[str, Shape, Shape, int]]) -> list[torch.Tensor]:
        """Regions (key, offsets, sizes, stacked_axes) as tensors in the stored dtype.

        Raises ConversionError when part of a region is not stored (e.g. vocabulary rows
        beyond the checkpoint's).
        """
        destinations: dict[tuple[str, Shape], torch.Tensor] = {}
        items: list[ReadItem] = []
        out = []
        for key, offsets, sizes, stacked in requests:
            md = self.tensor(key)
            if md is None:
                raise ConversionError(f"{self.path}: checkpoint has no tensor {key}")
            dest = torch.empty(sizes, dtype=md.properties.dtype)
            destinations[(key, tuple(offsets))] = dest
            out.append(dest)
            covered = 0
            for chunk in self._chunks_for(key, offsets, stacked):
                item = _overlap(key, offsets, sizes, chunk)
                if item is not None:
                    items.append(item)
                    covered += math.prod(item.lengths)
            if covered != math.prod(sizes):
                raise ConversionError(
                    f"{self.path}: tensor {key} region {list(offsets)}+{list(sizes)} is not "
                    f"fully stored (stored shape {list(md.size)})"
                )
        if items:
            self._reader.read_data(LoadPlan(items), _RegionLoadPlanner(destinations)).wait()
        return out


def _overlap(key: str, offsets: Shape, sizes: Shape, chunk: ChunkStorageMetadata):
    dest_offsets, storage_offsets, lengths = [], [], []
    for o, s, co, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True):
        lo, hi = max(o, co), min(o + s, co + cs)
        if hi <= lo:
            return None
        dest_offsets.append(lo - o)
        storage_offsets.append(lo - co)
        lengths.append(hi - lo)
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(key, torch.Size(offsets)),
        dest_offsets=torch.Size(dest_offsets),
        storage_index=MetadataIndex(key, chunk.offsets),
        storage_offsets=torch.Size(storage_offsets),
        lengths=torch.Size(lengths),
    )


def directory_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
