"""Engine checkpoints with megatron dist_checkpointing: save on one layout, load on another,
all or nothing.

A checkpoint directory holds one torch_dist checkpoint (model and, for training checkpoints,
optimizer), per-rank RNG states (`rng/rank_NNNNN.pt`, tensors and plain values only, loaded with
`weights_only=True`), `gspo_checkpoint.json` (gspo_megatron.checkpoint.meta) and
`manifest.json` (size and SHA-256 of every other file, gspo_megatron.checkpoint.manifest). It is
written under a temporary name; the manifest is the last file, then the directory is renamed, so
a directory with the final name is complete unless its files were damaged since. Engines trained
alongside the policy (PPO's critic) are saved as companions: a subdirectory each (`critic/`)
with its own torch_dist checkpoint and metadata, covered by the one manifest, so the policy and
its critic are published, validated and loaded together.

Loading validates first (`validate`: metadata, architecture, layout, manifest sizes and
checksums, split over the ranks), and every rank agrees on the verdict before any state is
applied; then model, optimizer, the optimizer step count (which the LR schedule is a function of:
the scheduler is set, never added to) and RNG load together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gc
import os
import queue
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.optimizer import distrib_optimizer

from gspo_megatron import files
from gspo_megatron.checkpoint import manifest
from gspo_megatron.checkpoint.meta import (
    META_FILE,
    RESUMABLE_FORMATS,
    CheckpointError,
    architecture_difference,
    is_checkpoint,
    lora_difference,
    read_meta,
    write_meta,
)
from gspo_megatron.checkpoint.safe_load import (
    UnsafeCheckpointError,
    load_weights_only,
    read_dcp_metadata,
    verify_checkpoint_safe,
)
from gspo_megatron.spec.model_config import ModelConfig

__all__ = [
    "META_FILE",
    "CheckpointError",
    "is_checkpoint",
    "load_engine",
    "load_model_weights",
    "read_meta",
    "save_engine",
    "validate",
]

# megatron 0.19.2's default distributed-optimizer format ("fully_sharded_model_space") builds
# flattened_range shards that its own validator rejects; this one reshards across layouts.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
RNG_DIR = "rng"
_MAX_LISTED_PROBLEMS = 6


def model_sharded_state_dict(chunks) -> dict:
    """Sharded state dicts of all model chunks; the sharded keys carry global layer numbers,
    so a checkpoint loads whatever the pipeline split."""
    return {f"chunk{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def check_architecture(path: str | Path, model: ModelConfig) -> None:
    """Refuse a checkpoint of another architecture, naming the field that differs."""
    difference = architecture_difference(read_meta(path)["model"], model)
    if difference:
        raise CheckpointError(f"{path}: {difference}")


# -- save ------------------------------------------------------------------------------------


def save_engine(
    engine,
    path: str | Path,
    *,
    extra: dict[str, Any] | None = None,
    with_optimizer: bool = True,
    companions: Mapping[str, Any] | None = None,
    extra_files: Mapping[str, Any] | None = None,
) -> Path:
    """Save model (+ optimizer) and RNG state, then the metadata and the manifest. Collective.

    companions: name -> engine trained with this one (e.g. "critic"), each saved to
    `path/name` with its own optimizer. extra_files: name -> object (tensors and plain values) that
    rank 0 saves under `path/name` with torch.save, in the manifest like the rest (the other
    ranks' values are ignored). A failure on any rank raises CheckpointError on every rank,
    naming the file and the reason (for storage errors, the OS's, e.g. "No space left on
    device"); the partial directory is removed.
    """
    final = Path(path)
    if final.exists():
        raise CheckpointError(f"{final}: checkpoint directory already exists")
    companions = dict(companions or {})
    rank = dist.get_rank()
    tmp = final.parent / _broadcast(files.temporary_path(final).name)  # rank 0 names it
    try:
        _on_rank0("create the directory", lambda: tmp.mkdir(parents=True), tmp)
        _use_thread_results_queue()
        for name, saved in (("", engine), *companions.items()):
            where = tmp / name
            if name:
                _on_rank0(f"create the {name} directory", where.mkdir, where)
            with saved.own_layout():
                saved.reload()  # a checkpoint holds the state itself, offloaded or not
                state = _engine_state(saved, with_optimizer)
                _on_every_rank(
                    f"write the {name or 'model'}'s weights and optimizer",
                    lambda state=state, where=where: dist_checkpointing.save(
                        state, str(where), async_sharded_save=False
                    ),
                    tmp,
                )
        rng_name = f"{RNG_DIR}/rank_{rank:05d}.pt"

        def write_rng_and_meta() -> None:
            (tmp / RNG_DIR).mkdir(exist_ok=True)
            _save_durably(_rng_state(), tmp / rng_name)
            if rank == 0:
                write_meta(tmp, _engine_meta(engine, with_optimizer, extra or {}))
                for name, saved in companions.items():
                    write_meta(tmp / name, _engine_meta(saved, with_optimizer, {}))
                for name, obj in (extra_files or {}).items():
                    (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                    _save_durably(obj, tmp / name)

        _on_every_rank("write the RNG state and metadata", write_rng_and_meta, tmp)
        digests = _on_every_rank(
            "checksum the files", lambda: manifest.digest_files(tmp, _written_by(rank, tmp)), tmp
        )

        def write_manifest() -> None:
            entries = {name: d for part in digests for name, d in part.items()}
            entries.update(manifest.digest_files(tmp, manifest.unlisted_files(tmp, entries)))
            manifest.write_manifest(tmp, entries)

        _on_rank0("write the manifest", write_manifest, tmp)
        _on_rank0("rename the checkpoint into place", lambda: _publish(tmp, final), tmp)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _engine_state(engine, with_optimizer: bool) -> dict[str, Any]:
    state = {"model": model_sharded_state_dict(engine.unwrapped_chunks)}
    if with_optimizer:
        state["optimizer"] = optimizer_sharded_state_dict(engine, state["model"])
    return state


def optimizer_sharded_state_dict(engine, model_sd: dict, *, is_loading: bool = False) -> dict:
    """The optimizer's sharded state dict in _OPTIMIZER_METADATA's format, for a save or a load.

    megatron ends building that format with a full gc.collect(), for training loops that turn
    the collector off; with it on, as in gspo-train, the collection frees nothing the collector
    would not, and costs ~0.2 s of CPU per save and per load (torch and megatron fill the heap):
    it is skipped then."""
    with _no_forced_collection():
        return engine.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_OPTIMIZER_METADATA
        )


class _CollectorRuns:
    """`gc` as distrib_optimizer sees it while the collector is on: collect() does nothing."""

    @staticmethod
    def collect(generation: int = 2) -> int:
        return 0


@contextlib.contextmanager
def _no_forced_collection():
    if not gc.isenabled():
        yield
        return
    distrib_optimizer.gc = _CollectorRuns
    try:
        yield
    finally:
        distrib_optimizer.gc = gc


def _engine_meta(engine, with_optimizer: bool, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": engine.model_config.to_dict(),
        "value_head": engine.value_head,
        "lora": _lora_meta(engine),
        "layout": dataclasses.asdict(engine.layout),
        "world_size": dist.get_world_size(),
        "steps_done": engine.steps_done,
        "with_optimizer": with_optimizer,
        "extra": extra,
    }


def _lora_meta(engine) -> dict[str, Any] | None:
    """The engine's `lora` section (None: no adapters), as the metadata records it."""
    return dataclasses.asdict(engine.lora) if getattr(engine, "lora", None) else None


def _written_by(rank: int, root: Path) -> list[str]:
    """The files this rank wrote (still in its page cache): its DCP data files and RNG state;
    rank 0 also the shared ones (.metadata, common state, metadata files); companions' too."""
    rng_file = f"{RNG_DIR}/rank_{rank:05d}.pt"

    def mine(path: Path, name: str) -> bool:
        if path.name.startswith("__") or name.startswith(f"{RNG_DIR}/"):
            return path.name.startswith(f"__{rank}_") or name == rng_file
        return rank == 0

    files = [p for p in root.rglob("*") if p.is_file()]
    return [str(p.relative_to(root)) for p in files if mine(p, str(p.relative_to(root)))]


def _publish(tmp: Path, final: Path) -> None:
    os.replace(tmp, final)
    files.fsync_dir(final.parent)


def _save_durably(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _on_every_rank(what: str, fn: Callable[[], Any], where: Path | None = None) -> list[Any]:
    """Run `fn` on every rank; if it fails anywhere, raise the same CheckpointError everywhere
    (no rank is left waiting in a collective). Returns every rank's result."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    result, problem = None, None
    try:
        result = fn()
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - reported on every rank
        problem = _describe_failure(err, where)
    outcomes: list = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, (result, problem))
    problems = [f"rank {r}: {p}" for r, (_, p) in enumerate(outcomes) if p]
    if problems:
        raise CheckpointError(f"could not {what}: " + _join(problems))
    return [r for r, _ in outcomes]


def _on_rank0(what: str, fn: Callable[[], Any], where: Path) -> None:
    problem = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - reported on every rank below
            problem = _describe_failure(err, where)
    problem = _broadcast(problem)
    if problem:
        raise CheckpointError(f"could not {what}: rank 0: {problem}")


def _describe_failure(err: BaseException, where: Path | None) -> str:
    """One line: the OS error behind `err` (file and strerror) when there is one.

    megatron's writer threads wrap storage errors in generic ones ("Worker failure"); when no
    OSError is in the chain but the disk is (nearly) full, that is the reason.
    """
    seen: set[int] = set()
    node: BaseException | None = err
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        if isinstance(node, OSError) and node.errno:
            name = f"{node.filename}: " if node.filename else ""
            return f"{name}{os.strerror(node.errno)} [errno {node.errno}]"
        node = node.__cause__ or node.__context__
    if where is not None:
        try:
            free = shutil.disk_usage(where if where.exists() else where.parent).free
        except OSError:
            free = None
        if free is not None and free < 64 << 20:
            files = [p for p in where.rglob("*") if p.is_file()] if where.exists() else []
            newest = max(files, key=lambda p: p.stat().st_mtime, default=None)
            writing = f"{newest}: " if newest else f"{where}: "
            return (
                f"{writing}{os.strerror(errno.ENOSPC)} ({manifest.format_bytes(free)} free under "
                f"{where.parent}; the writer reported: {_last_line(err)})"
            )
    return _last_line(err)


def _last_line(err: BaseException) -> str:
    """The gist of an error whose text may hold a whole traceback (torch's CheckpointException)."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _use_thread_results_queue() -> None:
    # megatron's torch_dist writer threads report through a queue that megatron creates as a
    # `spawn` multiprocessing Manager (~10 s, a server process that outlives a killed trainer).
    # Synchronous saves write from threads of this process, so a plain thread-safe queue serves.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


# -- validate and load -------------------------------------------------------------------------


def validate(
    engine,
    path: str | Path,
    *,
    with_optimizer: bool = True,
    require_manifest: bool = True,
    companions: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Check a checkpoint completely before anything is loaded from it. Collective.

    Metadata, format, architecture and layout (of the engine and of each companion in its
    subdirectory); the manifest: every file present with its size (rank 0) and its SHA-256 (the
    files split over all ranks). Raises the same CheckpointError on every rank, listing the
    problems, or returns the metadata.
    """
    path = Path(path)
    problems: list[str] = []
    meta: dict[str, Any] = {}
    for name, checked in (("", engine), *(companions or {}).items()):
        where = path / name
        if name and not (where / META_FILE).is_file():
            problems.append(
                f"holds no {name} ({name}/), which this run trains: it was written by a run "
                f"without one; start from its policy weights with model.init_from={path}"
            )
            continue
        try:
            found = read_meta(where)
            problems += _compatibility_problems(where, found, checked, with_optimizer)
            meta = meta or found
        except CheckpointError as err:
            problems.append(str(err))
    if not problems:
        problems += _file_problems(path, require_manifest)
    _raise_if_any(path, problems)
    _refuse_if_unsafe(path)
    return meta


def _file_problems(path: Path, require_manifest: bool) -> list[str]:
    """This rank's share of the manifest checks (sizes on rank 0, checksums split by rank), of
    what loading reads (not an HF export: manifest.DERIVED_DIRS)."""
    skip = manifest.DERIVED_DIRS
    if not dist.is_initialized():
        return manifest.verify(path, required=require_manifest, skip=skip)
    return manifest.verify(
        path,
        required=require_manifest,
        rank=dist.get_rank(),
        world=dist.get_world_size(),
        skip=skip,
    )


def _refuse_if_unsafe(path: Path) -> None:
    """Raise UnsafeCheckpointError on every rank if any rank found something in the checkpoint
    that would run code when deserialised (gspo_megatron.checkpoint.safe_load). Not a damaged
    checkpoint to fall back from: someone put code in it."""
    problem = None
    try:
        verify_checkpoint_safe(path)
    except UnsafeCheckpointError as err:
        problem = str(err)
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problem)
        problem = next((p for p in gathered if p), None)
    if problem:
        raise UnsafeCheckpointError(problem)


def _raise_if_any(path: Path, problems: list[str]) -> None:
    """Raise the same CheckpointError on every rank if any rank found a problem."""
    if dist.is_initialized():
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, problems)
        problems = list(dict.fromkeys(p for part in gathered for p in part))
    if problems:
        raise CheckpointError(f"{path}: " + _join(problems))


def _compatibility_problems(path: Path, meta: dict, engine, with_optimizer: bool) -> list[str]:
    problems = []
    difference = architecture_difference(meta["model"], engine.model_config)
    if difference:
        problems.append(difference)
    saved_value_head = meta.get("value_head", False)
    if saved_value_head != engine.value_head:
        kinds = {True: "a value model", False: "a policy"}
        problems.append(
            f"{path} holds {kinds[saved_value_head]}, loaded into {kinds[engine.value_head]}"
        )
    if lora := lora_difference(meta.get("lora"), _lora_meta(engine)):
        problems.append(f"{path}: {lora}")
    if not with_optimizer:
        return problems
    version = meta.get("format_version")
    if version not in RESUMABLE_FORMATS:
        problems.append(
            f"checkpoint format {version} cannot be resumed (this version resumes formats "
            f"{list(RESUMABLE_FORMATS)}); start from its weights with model.init_from={path}"
        )
    if not meta.get("with_optimizer", False):
        problems.append(f"holds model weights only; load it with model.init_from={path}")
    saved_ep = meta.get("layout", {}).get("ep", 1)
    if saved_ep != engine.layout.ep:
        # megatron's optimizer state does not reshard between expert-parallel sizes.
        problems.append(
            f"optimizer state saved with parallel.ep={saved_ep} cannot be resumed with "
            f"parallel.ep={engine.layout.ep}; use the same ep, or start from the weights only "
            "(model.init_from)"
        )
    return problems


def load_engine(
    engine,
    path: str | Path,
    *,
    with_optimizer: bool = True,
    restore_rng: bool = True,
    check: bool = True,
    companions: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint saved on any layout into `engine` (and each companion from its
    subdirectory); returns the metadata. Collective.

    With `check` (default) the checkpoint is validated first (`validate`), so either all of it
    loads or none of it does. The optimizer step count, which the LR schedule is a function of,
    is set (never added to); the schedule's shape comes from the engine's own settings.
    """
    path = Path(path)
    companions = dict(companions or {})
    meta = (
        validate(
            engine,
            path,
            with_optimizer=with_optimizer,
            require_manifest=with_optimizer,
            companions=companions,
        )
        if check
        else read_meta(path)
    )
    for name, loaded_into in (("", engine), *companions.items()):
        _load_state(loaded_into, path / name, with_optimizer)
    if restore_rng:
        rng_file = path / RNG_DIR / f"rank_{dist.get_rank():05d}.pt"
        if meta.get("world_size") == dist.get_world_size() and rng_file.is_file():
            with open(rng_file, "rb") as f:
                _set_rng_state(load_weights_only(f, str(rng_file)))
    return meta


def _load_state(engine, path: Path, with_optimizer: bool) -> None:
    with engine.own_layout():
        _load_own_layout_state(engine, path, with_optimizer)


def _load_own_layout_state(engine, path: Path, with_optimizer: bool) -> None:
    model_sd = model_sharded_state_dict(engine.unwrapped_chunks)
    state = {"model": model_sd}
    if with_optimizer:
        _ensure_optimizer_state(engine)
        state["optimizer"] = optimizer_sharded_state_dict(engine, model_sd, is_loading=True)
    loaded = _read(state, path)
    for i, chunk in enumerate(engine.unwrapped_chunks):
        chunk.load_state_dict(loaded["model"][f"chunk{i}"], strict=False)
    if with_optimizer:
        engine.optimizer.load_state_dict(loaded["optimizer"])
        _untie_adam_step(engine.optimizer)
        set_optimizer_steps(engine, int(read_meta(path)["steps_done"]))
    else:
        # Keep the optimizer's master copies in step with the loaded weights.
        engine.optimizer.reload_model_params()


def set_optimizer_steps(engine, steps: int) -> None:
    """Put the engine at optimizer step `steps`: the LR is the schedule's value there.

    megatron's `OptimizerParamScheduler.load_state_dict` adds the saved count to the current
    one and keeps the saved decay length; setting the count and recomputing from the engine's
    own settings gives the LR a run configured this way from the start has at that step.
    """
    engine.steps_done = steps
    engine.scheduler.num_steps = steps
    engine.step_schedule(0)


def _read(state: dict, path: Path) -> dict:
    """dist_checkpointing.load, with unreadable files reported as a CheckpointError.

    torch's CheckpointException derives from BaseException; it carries every rank's failure.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return dist_checkpointing.load(state, str(path))
    except CheckpointException as err:
        failures = getattr(err, "failures", {}) or {}
        first = next(iter(failures.values()), err)
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({type(first).__name__}: {first})"
        ) from None


def _rng_state() -> dict[str, Any]:
    """Every generator's state as tensors and plain values (loadable with weights_only=True)."""
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "tracker": {k: v.cpu() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(dict(state["tracker"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _join(problems: list[str]) -> str:
    shown = "; ".join(problems[:_MAX_LISTED_PROBLEMS])
    more = len(problems) - _MAX_LISTED_PROBLEMS
    return shown + (f" (and {more} more)" if more > 0 else "")


def remove_scratch(path: str | Path) -> None:
    """Delete a scratch checkpoint directory, if there is one. Collective: rank 0 removes it
    between two barriers, so no rank still reads it and none writes it again too early."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


def remove_incomplete(parent: str | Path) -> list[Path]:
    """Delete leftovers of interrupted saves (temporary directories) under `parent`."""
    return files.remove_temporaries(parent)


def load_reference_weights(chunks, path: str | Path) -> list[dict[str, torch.Tensor]]:
    """The checkpoint's weights sharded like `chunks` (one dict per chunk), model untouched."""
    # dist_checkpointing loads into the given tensors in place: give it fresh ones.
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def detach(item):
        if isinstance(item, ShardedTensor):
            item.data = torch.empty_like(item.data)
        return item

    sharded = dict_list_map_inplace(detach, model_sharded_state_dict(chunks))
    _refuse_if_unsafe(Path(path))
    loaded = dist_checkpointing.load({"model": sharded}, str(path))
    return [loaded["model"][f"chunk{i}"] for i in range(len(chunks))]


def _ensure_optimizer_state(engine) -> None:
    # A never-stepped megatron optimizer has no Adam state to load into (an assert on the
    # distributed optimizer, KeyError 'step' on the plain one). A step with zero gradients and
    # zero learning rate creates the state and changes no weight.
    inner = [getattr(o, "optimizer", None) for o in _sub_optimizers(engine.optimizer)]
    if all(opt is not None and len(opt.state) for opt in inner):
        return
    groups = engine.optimizer.param_groups
    saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in groups]
    for g in groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    for m in engine.model:
        m.zero_grad_buffer()
    engine.optimizer.zero_grad()
    engine.optimizer.step()
    for g, (lr, wd) in zip(groups, saved, strict=True):
        g["lr"] = lr
        g["weight_decay"] = wd


def _untie_adam_step(optimizer) -> None:
    # On the distributed optimizer's fallback path (no apex/TE), the loaded state can hand every
    # parameter the same `step` tensor; torch's foreach Adam then increments it once per
    # parameter and resumed runs drift. Give each parameter its own copy.
    for opt in _sub_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        seen: set[int] = set()
        for state in inner.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(state["step"]))


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


# -- model weights for either layer spec (added for gspo_megatron.checkpoint) ------------------

EXTRA_STATE_SUFFIX = "._extra_state"


def checkpoint_entry_names(path: str | Path) -> set[str]:
    """Names stored in a torch_dist checkpoint: tensor keys and ShardedObject unique keys."""
    if not (Path(path) / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a torch_dist checkpoint (no .metadata file)")
    return set(read_dcp_metadata(path).state_dict_metadata)


def drop_missing_extra_state(sharded_state_dict: dict, stored: set[str], path: str | Path = ""):
    """The sharded state dict without the `_extra_state` objects the checkpoint lacks.

    transformer-engine modules keep FP8 metadata in `_extra_state` (norms included); the local
    spec and checkpoints converted from Hugging Face have none for some modules, and a module
    keeps its default when none is loaded. Any other entry the checkpoint lacks raises
    CheckpointError naming it. Returns (filtered dict, skipped unique keys).
    """
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    skipped: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            out = {}
            for key, value in node.items():
                kept = walk(value)
                if kept is not _DROP:
                    out[key] = kept
            return out
        if isinstance(node, list):
            return [x for x in (walk(v) for v in node) if x is not _DROP]
        if isinstance(node, ShardedObject):
            if node.unique_key in stored:
                return node
            if node.key.endswith(EXTRA_STATE_SUFFIX):
                skipped.append(node.unique_key)
                return _DROP
            raise CheckpointError(f"{path}: checkpoint has no object {node.unique_key}")
        if isinstance(node, ShardedTensor | ShardedTensorFactory) and node.key not in stored:
            raise CheckpointError(f"{path}: checkpoint has no tensor {node.key}")
        return node

    return walk(sharded_state_dict), skipped


_DROP = object()


def load_model_weights(chunks, path: str | Path, model_config: ModelConfig | None = None):
    """Model weights from a checkpoint of any layout into `chunks`, for either layer spec.

    Like load_engine(..., with_optimizer=False) for the model, but it also accepts checkpoints
    converted from Hugging Face or written with the other layer spec: `_extra_state` objects the
    checkpoint lacks are skipped (see drop_missing_extra_state); a missing weight raises. When
    the chunks belong to a TrainingEngine, call `engine.optimizer.reload_model_params()` after.
    Returns the checkpoint's gspo metadata ({} for a plain megatron checkpoint). Collective.
    """
    path = Path(path)
    meta = read_meta(path) if is_checkpoint(path) else {}
    if meta and model_config is not None:
        check_architecture(path, model_config)
    sharded_model = model_sharded_state_dict(chunks)
    has_adapters = any(key.endswith(".lora_a") for part in sharded_model.values() for key in part)
    if meta.get("lora") and not has_adapters:
        raise CheckpointError(
            f"{path} holds LoRA adapters (lora.rank={meta['lora']['rank']}): loading its base "
            "weights alone would drop them; evaluating or starting from a LoRA checkpoint is "
            "not built yet: convert it with tools/convert_megatron_to_hf.py (merged) and start "
            "from that (docs/LORA.md)"
        )
    # Converted and training checkpoints carry a manifest; a plain megatron one may not.
    _raise_if_any(path, _file_problems(path, require_manifest=False))
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path}: not a torch_dist checkpoint (no .metadata file)")
    _refuse_if_unsafe(path)
    stored = set(read_dcp_metadata(path).state_dict_metadata)
    sharded, _ = drop_missing_extra_state(sharded_model, stored, path)
    loaded = dist_checkpointing.load({"model": sharded}, str(path))
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"][f"chunk{i}"], strict=False)
    return meta
