"""Export the trainer's weights as Hugging Face tensors, gathered bucket by bucket.

`MegatronWeightSource` is the `WeightSource` the rollout engines consume. Every rank walks its
model chunks' `sharded_state_dict()` — the layout-independent description dist_checkpointing
uses, which places each local piece (a TP slice, this EP rank's experts, this pipeline stage's
layers) inside its global tensor — and keeps the pieces it is the main replica of. A gather
bucket is a run of mapping units (one layer's QKV, one expert's fc1, ...) whose HF bytes stay
within the bucket size. For each, the ranks holding pieces send them (one flat byte buffer per
rank, point to point) to the sender rank, which assembles the units and turns them into HF
names and layouts with the shared mapping (`gspo_megatron.checkpoint.mapping`). Every yielded
list stays within the bucket size unless it is a single larger tensor; a unit larger than the
bucket (a big layer's QKV) is gathered whole and handed out in parts. So no rank holds more
than about one bucket (or one unit) of gathered weights.

Names follow the HF checkpoint on disk: per-expert `mlp.experts.{e}.gate_proj.weight` etc., the
names SGLang's qwen3_moe loader expects. Vocabulary padding rows are dropped.

Each bucket is gathered to one rank: the sender, or for a rank-parallel export (the HF export
after a checkpoint, megatron/hf_export.py) the bucket's owner in `owners`, so every rank writes
its own share. `plan` tells every rank, before any transfer, which tensors each bucket yields.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gspo_megatron.checkpoint.mapping import ModelMapping, Shape, TensorMapping, get_mapping
from gspo_megatron.device import accelerator
from gspo_megatron.megatron.weight_loading import sharded_pieces
from gspo_megatron.spec.model_config import ModelConfig


@dataclass(frozen=True)
class _Piece:
    """A region of one mapping unit held by one rank."""

    rank: int
    unit: int  # index into mapping.entries
    offsets: Shape
    sizes: Shape
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * self.dtype.itemsize


def export_shape(entry: TensorMapping, vocab_size: int) -> Shape:
    """The unit's shape as exported (vocabulary padding removed)."""
    if entry.kind == "vocab":
        return (vocab_size, *entry.shape[1:])
    return entry.shape


class MegatronWeightSource:
    """HF-named policy weights from megatron model chunks on any layout.

    chunks: this rank's unwrapped model chunks (`engine.unwrapped_chunks`).
    dtype: cast exported tensors to this dtype (default: keep each parameter's dtype).
    sender: the global rank that receives the buckets (it alone sees tensors; the others
    iterate the same buckets, yielding empty lists, because the gathering is collective).
    mapping: what to export (default: the model's weights, `get_mapping`; a LoRA policy's
    adapters have their own, checkpoint/lora_mapping.py, over chunks that show only them).
    """

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        model_config: ModelConfig,
        *,
        dtype: torch.dtype | None = None,
        sender: int = 0,
        mapping: ModelMapping | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.mapping: ModelMapping = mapping or get_mapping(model_config)
        self.dtype = dtype
        self.sender = sender
        self._pieces: list[_Piece] | None = None

    @classmethod
    def from_engine(cls, engine, *, dtype: torch.dtype | None = None) -> MegatronWeightSource:
        """The weights of a TrainingEngine (its unwrapped chunks and model config)."""
        return cls(engine.unwrapped_chunks, engine.model_config, dtype=dtype)

    def is_sender(self) -> bool:
        return dist.get_rank() == self.sender

    def hf_shapes(self) -> dict[str, Shape]:
        """Every tensor `buckets` yields, by HF name, with its exported shape."""
        vocab = self.mapping.config.vocab_size
        return {
            name: shape
            for entry in self.mapping.entries
            for name, shape in zip(entry.hf_names, _export_hf_shapes(entry, vocab), strict=True)
        }

    # -- plan ---------------------------------------------------------------------------------

    def _local(self) -> list[tuple[_Piece, torch.Tensor]]:
        """This rank's main-replica pieces, clipped to the exported shape, with their data."""
        rank = dist.get_rank()
        units = {id(e): i for i, e in enumerate(self.mapping.entries)}
        vocab = self.mapping.config.vocab_size
        out = []
        for entry, offsets, sh in sharded_pieces(self.chunks, self.mapping, main_replica_only=True):
            data = sh.data.detach()
            shape = export_shape(entry, vocab)
            sizes = list(sh.local_shape)
            for dim, limit in enumerate(shape):  # drop vocabulary padding rows
                sizes[dim] = max(0, min(offsets[dim] + sizes[dim], limit) - offsets[dim])
            if min(sizes, default=1) == 0:
                continue
            data = data.reshape(sh.local_shape)
            for dim, size in enumerate(sizes):
                data = data.narrow(dim, 0, size)
            piece = _Piece(rank, units[id(entry)], tuple(offsets), tuple(sizes), data.dtype)
            out.append((piece, data))
        return out

    def _plan(self, local: list[tuple[_Piece, torch.Tensor]]) -> list[_Piece]:
        if self._pieces is None:
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, [p for p, _ in local])
            pieces = [p for part in gathered for p in part]
            self._check_coverage(pieces)
            self._pieces = pieces
        return self._pieces

    def _check_coverage(self, pieces: list[_Piece]) -> None:
        volume = [0] * len(self.mapping.entries)
        for p in pieces:
            volume[p.unit] += math.prod(p.sizes)
        vocab = self.mapping.config.vocab_size
        for entry, got in zip(self.mapping.entries, volume, strict=True):
            want = math.prod(export_shape(entry, vocab))
            if got != want:
                raise RuntimeError(
                    f"weight export: the ranks' main-replica pieces of {entry.key}"
                    f"{list(entry.index)} cover {got} of {want} elements"
                )

    def _bucket_units(self, bucket_bytes: int, pieces: list[_Piece]) -> list[list[int]]:
        itemsize = {}
        for p in pieces:
            itemsize[p.unit] = (self.dtype or p.dtype).itemsize
        vocab = self.mapping.config.vocab_size
        buckets: list[list[int]] = [[]]
        size = 0
        for i, entry in enumerate(self.mapping.entries):
            nbytes = math.prod(export_shape(entry, vocab)) * itemsize[i]
            if buckets[-1] and size + nbytes > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += nbytes
        return buckets

    def plan(self, bucket_bytes: int) -> list[list[tuple[str, Shape, torch.dtype]]]:
        """The (HF name, shape, dtype) of every tensor each gather bucket yields, in order: the
        same on every rank. Collective the first time (the ranks share what they hold)."""
        with torch.no_grad():
            pieces = self._plan(self._local())
        dtype = {p.unit: self.dtype or p.dtype for p in pieces}
        vocab = self.mapping.config.vocab_size
        return [
            [
                (name, shape, dtype[u])
                for u in units
                for name, shape in zip(
                    self.mapping.entries[u].hf_names,
                    _export_hf_shapes(self.mapping.entries[u], vocab),
                    strict=True,
                )
            ]
            for units in self._bucket_units(bucket_bytes, pieces)
        ]

    # -- transfer ------------------------------------------------------------------------------

    def buckets(
        self, bucket_bytes: int, owners: Sequence[int] | None = None
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Lists of (HF name, tensor), at most ~bucket_bytes each, on the rank each bucket is
        gathered to (the sender, or `owners[b]` for bucket b of `plan`); empty lists elsewhere.

        Collective: every rank must iterate all buckets.
        """
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        with torch.no_grad():
            local = self._local()
            pieces = self._plan(local)
            mine = {(p.unit, p.offsets): data for p, data in local}
            rank = dist.get_rank()
            for tag, units in enumerate(self._bucket_units(bucket_bytes, pieces)):
                owner = self.sender if owners is None else owners[tag]
                in_bucket = set(units)
                bucket_pieces = [p for p in pieces if p.unit in in_bucket]
                splits = self._split(units, pieces, bucket_bytes)
                if rank == owner:
                    named = self._receive(units, bucket_pieces, mine, tag, owner)
                    for start, end in splits:
                        yield named[start:end]
                    del named
                else:
                    self._send([p for p in bucket_pieces if p.rank == rank], mine, tag, owner)
                    for _ in splits:
                        yield []

    def _split(self, units: list[int], pieces: list[_Piece], bucket_bytes: int):
        """[start, end) runs of a gathered bucket's HF tensors within `bucket_bytes` (a unit
        larger than the bucket, e.g. one layer's QKV, is gathered whole but handed out in
        parts); the same on every rank."""
        dtype = {p.unit: self.dtype or p.dtype for p in pieces}
        sizes = [
            math.prod(shape) * dtype[u].itemsize
            for u in units
            for shape in _export_hf_shapes(self.mapping.entries[u], self.mapping.config.vocab_size)
        ]
        runs, start, size = [], 0, 0
        for i, nbytes in enumerate(sizes):
            if i > start and size + nbytes > bucket_bytes:
                runs.append((start, i))
                start, size = i, 0
            size += nbytes
        runs.append((start, len(sizes)))
        return runs

    def _send(self, pieces: list[_Piece], mine: dict, tag: int, owner: int) -> None:
        if not pieces:
            return
        flat = torch.cat([_bytes(mine[(p.unit, p.offsets)]) for p in pieces])
        dist.send(flat, dst=owner, tag=tag)

    def _receive(self, units, pieces, mine, tag, owner) -> list[tuple[str, torch.Tensor]]:
        device = accelerator()  # the point-to-point transfers run on the default (NCCL) group
        vocab = self.mapping.config.vocab_size
        dtypes = {p.unit: p.dtype for p in pieces}
        full = {
            u: torch.empty(
                export_shape(self.mapping.entries[u], vocab), dtype=dtypes[u], device=device
            )
            for u in units
        }
        by_rank: dict[int, list[_Piece]] = {}
        for p in pieces:
            by_rank.setdefault(p.rank, []).append(p)
        requests, buffers = [], {}
        for src, src_pieces in sorted(by_rank.items()):
            if src == owner:
                continue
            buffers[src] = torch.empty(
                sum(p.nbytes for p in src_pieces), dtype=torch.uint8, device=device
            )
            requests.append(dist.irecv(buffers[src], src=src, tag=tag))
        for p in by_rank.get(owner, []):
            _region(full[p.unit], p).copy_(mine[(p.unit, p.offsets)])
        for req in requests:
            req.wait()
        for src, buffer in buffers.items():
            offset = 0
            for p in by_rank[src]:
                raw = buffer[offset : offset + p.nbytes]
                _region(full[p.unit], p).copy_(raw.view(p.dtype).reshape(p.sizes))
                offset += p.nbytes
        out = []
        for u in units:
            entry = self.mapping.entries[u]
            tensors = [full[u]] if entry.kind == "vocab" else self.mapping.to_hf(entry, full[u])
            for name, tensor in zip(entry.hf_names, tensors, strict=True):
                tensor = tensor.contiguous()
                if self.dtype is not None:
                    tensor = tensor.to(self.dtype)
                out.append((name, tensor))
        return out


def _export_hf_shapes(entry: TensorMapping, vocab_size: int) -> list[Shape]:
    if entry.kind == "vocab":
        return [(vocab_size, *entry.hf_shapes[0][1:])]
    return list(entry.hf_shapes)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _region(full: torch.Tensor, piece: _Piece) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(piece.offsets, piece.sizes, strict=True)):
        full = full.narrow(dim, start, size)
    return full
