"""Reading a checkpoint never runs code from it.

A megatron torch_dist checkpoint holds pickles in four places, and unpickling runs whatever
callable the stream names:

- `.metadata`, torch DCP's index of every stored chunk: `FileSystemReader.read_metadata()` is
  `pickle.load`;
- byte items (megatron ShardedObjects: `common_state`, every `_extra_state`): torch's
  `DefaultLoadPlanner.load_bytes` deserialises them with `torch.load(..., weights_only=False)`;
- inside an `_extra_state` item, transformer-engine's FP8 state: a uint8 tensor holding
  `pickle.dumps(state)`, which TE's `set_extra_state` reads with `pickle.loads`;
- a legacy `common.pt` (megatron reads it with torch.load's default, weights_only=True since
  torch 2.6 unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD is set).

Here:
- `read_dcp_metadata` unpickles `.metadata` with `MetadataUnpickler`, which resolves only the
  classes torch DCP and megatron write there (`METADATA_GLOBALS`, taken from real checkpoints:
  megatron saves of dense and MoE models with and without the (distributed) optimizer, on one
  and two ranks, and the HF converter's output) and refuses anything else, naming it;
- `SafeFileSystemReader` is a DCP FileSystemReader whose `read_metadata` is that: readers we
  build ourselves (`torch_dist.TorchDistCheckpoint`) use it and are airtight;
- `verify_checkpoint_safe(path)` checks what megatron's `dist_checkpointing.load` will
  deserialise: the metadata, every byte item with `torch.load(weights_only=True)` (and TE's
  pickled FP8 state inside `_extra_state` items with a restricted unpickler), and a legacy
  `common.pt`. It reads metadata and byte items only, never tensor data.

Why megatron's load is checked first rather than handed a safe reader: `dist_checkpointing.load`
reads the checkpoint through objects the caller cannot pass in. `load_common_state_dict` (which
`load` calls too) builds its own FileSystemReader and torch's DefaultLoadPlanner, and
`TorchDistLoadShardedStrategy.load` takes its reader from the module function
`_get_filesystem_reader` and builds `MCoreLoadPlanner` inline. A safe reader and planner would
need either patching those megatron globals or a copy of megatron's load orchestration (about 90
lines over private helpers that changed between releases). The check reads the same bytes
through the same DCP reader code megatron then uses, so whatever passes it runs no code when
megatron reads it again; the gap left is a file replaced between the two reads, which takes
write access to the checkpoint directory while the job runs.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from gspo_megatron.checkpoint.mapping import ConversionError

METADATA_FILE = ".metadata"
LEGACY_COMMON_FILE = "common.pt"
EXTRA_STATE_MARKER = "._extra_state"


class UnsafeCheckpointError(ConversionError):
    """A checkpoint file names code to run, or data outside its directory; nothing was loaded."""


def _by_pickled_name(*objects) -> dict[tuple[str, str], Any]:
    # pickle records a class or function as (__module__, __qualname__).
    return {(obj.__module__, obj.__qualname__): obj for obj in objects}


# Plain values a pickle can only express through a global.
_PLAIN_GLOBALS = _by_pickled_name(set, frozenset, complex, bytearray, collections.OrderedDict)

METADATA_GLOBALS = {
    **_by_pickled_name(
        # torch DCP's metadata classes (what every checkpoint's .metadata is made of)
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        MetadataIndex,
        StorageMeta,
        _MEM_FORMAT_ENCODING,
        # where each item's bytes are (FileSystemWriter, megatron's FileSystemWriterAsync)
        _StorageInfo,
        _StoragePrefix,
        # megatron keeps every rank's save plan in Metadata.all_local_plans to reuse it
        SavePlan,
        WriteItem,
        WriteItemType,
        TensorWriteData,
        BytesIOWriteData,
        torch.Size,
        # how torch pickles a torch.layout: _get_layout("torch.strided") (a dict lookup)
        torch.serialization._get_layout,
        # StorageMeta.checkpoint_id when the writer was given a Path (the converter's)
        pathlib.PosixPath,
    ),
    **_PLAIN_GLOBALS,
}

# Tensors as plain pickle writes them (TE's extra state): a storage is torch.save'd bytes that
# torch.storage._load_from_bytes reads with weights_only=False; the check reads them with True.
# Importing megatron.core rebinds that function to its own weights_only=True one, so pickles
# written in a megatron process name megatron's.
_EXTRA_STATE_GLOBALS = {
    **_by_pickled_name(torch.Size, torch._utils._rebuild_tensor_v2),
    **_PLAIN_GLOBALS,
}
_LOAD_FROM_BYTES = {
    ("torch.storage", "_load_from_bytes"),
    ("megatron.core.safe_globals", "safe_load_from_bytes"),
}
# How torch pickles dtypes (and layouts / memory formats when not via _get_layout): torch.<name>.
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


def _torch_value(module: str, name: str):
    if module != "torch":
        return None
    value = vars(torch).get(name)  # not getattr: torch's module __getattr__ imports submodules
    return value if isinstance(value, _TORCH_VALUE_TYPES) else None


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` file resolving only `METADATA_GLOBALS` and torch dtypes."""

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str):
        allowed = METADATA_GLOBALS.get((module, name)) or _torch_value(module, name)
        if allowed is None:
            raise UnsafeCheckpointError(
                f"{self._source}: refuses to load {module}.{name} (a checkpoint's metadata may "
                "hold only DCP metadata classes and plain values)"
            )
        return allowed


class _ExtraStateUnpickler(pickle.Unpickler):
    """Checks transformer-engine's pickled FP8 state: plain values and tensors only."""

    def __init__(self, file, source: str) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str):
        if (module, name) in _LOAD_FROM_BYTES:
            return self._load_storage
        allowed = _EXTRA_STATE_GLOBALS.get((module, name)) or _torch_value(module, name)
        if allowed is None:
            raise UnsafeCheckpointError(
                f"{self._source}: refuses to load {module}.{name} (a module's extra state may "
                "hold only tensors and plain values)"
            )
        return allowed

    def _load_storage(self, data: bytes):
        return load_weights_only(io.BytesIO(data), self._source)


def read_dcp_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of the checkpoint directory `path`, read without running code.

    Raises UnsafeCheckpointError for anything but metadata classes and plain values, or a data
    file outside the directory; ConversionError when the file is missing or unreadable.
    """
    return _read_metadata_file(Path(path) / METADATA_FILE)


def _read_metadata_file(file: Path) -> Metadata:
    if not file.is_file():
        raise ConversionError(
            f"{file.parent}: not a torch_dist checkpoint (no {file.name} file); a megatron "
            "checkpoint directory holds .metadata, metadata.json and __*_*.distcp files"
        )
    with open(file, "rb") as stream:
        try:
            metadata = MetadataUnpickler(stream, str(file)).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - any unpickling failure means a bad file
            raise ConversionError(
                f"{file}: unreadable checkpoint metadata ({type(err).__name__}: {err})"
            ) from err
    _check_metadata(metadata, file)
    return metadata


def _check_metadata(metadata, file: Path) -> None:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ConversionError(f"{file}: not DCP checkpoint metadata ({type(metadata).__name__})")
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not all(
        isinstance(info, _StorageInfo) for info in storage.values()
    ):
        raise ConversionError(f"{file}: not DCP checkpoint metadata (bad storage_data)")
    for info in storage.values():
        # DCP joins this to the directory: a path would read any file into the model.
        name = info.relative_path
        if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
            raise UnsafeCheckpointError(
                f"{file}: names data file {name!r} outside the checkpoint directory (a "
                "checkpoint's data files are plain names inside it)"
            )


class SafeFileSystemReader(FileSystemReader):
    """torch DCP's FileSystemReader, with `.metadata` read by MetadataUnpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = _read_metadata_file(Path(self._get_metadata_path(kwargs.get("rank"))))
        # What FileSystemReader.read_metadata adds after unpickling.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def _refused_globals(stream, err: pickle.UnpicklingError) -> str:
    # torch's message names one global, builtins without their module; its static scan of a
    # zip-format file names all of them in full.
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
    except Exception:  # noqa: BLE001 - legacy (non-zip) format: the message will do
        names = []
    if not names:
        found = _REFUSED_GLOBAL.search(str(err))
        names = [found.group(1) if found else "a pickle torch's weights-only loader rejects"]
    return ", ".join(sorted(names))


def load_weights_only(stream, source: str):
    """torch.load(weights_only=True) of a seekable stream, with a refusal raised as
    UnsafeCheckpointError naming the globals refused, and any other failure as ConversionError."""
    start = stream.tell()
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        stream.seek(start)
        raise UnsafeCheckpointError(
            f"{source}: refuses to load {_refused_globals(stream, err)} (checkpoint objects may "
            "hold only tensors and plain values)"
        ) from None
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - a corrupt file of any kind
        raise ConversionError(f"{source}: unreadable ({type(err).__name__}: {err})") from err


def _check_extra_state(value, source: str) -> None:
    """TE >= 2 stores FP8 state as a uint8 tensor of pickle bytes; TE < 2 as a BytesIO."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        for item in value:
            _check_extra_state(item, source)
    elif isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.numel():
        _ExtraStateUnpickler(io.BytesIO(value.numpy().tobytes()), source).load()
    elif isinstance(value, io.BytesIO):
        load_weights_only(io.BytesIO(value.getvalue()), source)


class PrebuiltPlanLoader(LoadPlanner):
    """A DCP load planner for plans its caller builds and hands to the storage reader directly:
    the planning steps pass through; subclasses say what to do with the bytes and tensors."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError("the caller builds the plan")

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan


class _ByteItemChecker(PrebuiltPlanLoader):
    """Deserialises each byte item DCP hands it the safe way and keeps nothing."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.storage_index.fqn
        source = f"{self._path}: object {fqn}"
        loaded = load_weights_only(value, source)
        if EXTRA_STATE_MARKER in fqn:
            _check_extra_state(loaded, source)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        raise ConversionError(f"internal: tensor read while checking {self._path}")

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def verify_checkpoint_safe(path: str | Path) -> Metadata:
    """Check that megatron's `dist_checkpointing.load` of `path` runs no code from it; returns
    the checkpoint's DCP metadata.

    Reads `.metadata` (restricted unpickler), every byte item (weights_only=True; TE's pickled
    extra state with a restricted unpickler) and a legacy `common.pt`; no tensor data. Not
    collective: call it on every rank that reads the checkpoint, before megatron does.
    Raises UnsafeCheckpointError naming the file, item and refused global; ConversionError
    for a missing or corrupt file.
    """
    path = Path(path)
    reader = SafeFileSystemReader(path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    items = [
        ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=index,
            dest_offsets=torch.Size((0,)),
            storage_index=index,
            storage_offsets=torch.Size((0,)),
            lengths=torch.Size((0,)),
        )
        for index in metadata.storage_data
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
    ]
    try:
        if items:
            reader.read_data(LoadPlan(items), _ByteItemChecker(path)).wait()
    except OSError as err:
        raise ConversionError(f"{path}: unreadable checkpoint data ({err})") from err
    legacy = path / LEGACY_COMMON_FILE
    if legacy.is_file():
        with open(legacy, "rb") as stream:
            load_weights_only(stream, str(legacy))
    return metadata
