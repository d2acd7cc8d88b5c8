"""What a run leaves in its directory, and how it comes back from it.

    run_config.json            the resolved configuration (a run directory holds one run)
    metrics.jsonl              one record per RL step, appended and flushed as each step ends
    metrics.superseded.jsonl   records moved aside on resume or rollback (steps after the
                               resumed one)
    run.lock                   held (flock) by the run's writer while it runs: who it is
    tensorboard/               the same metrics for TensorBoard
    eval/step_NNNNNN/          per-problem records of each evaluation (eval/superseded/: moved
                               aside like the metrics)
    checkpoints/step_NNNNNN/   engine checkpoints (gspo_megatron.megatron.checkpointing)
    checkpoints/superseded/    checkpoints moved aside: damaged ones, or newer than a resume point
    rollbacks.json             the collapse sentinel's rollbacks (gspo_megatron.stability)
    train.rankR.log            each rank's log (Hydra's job logging)
    sglang_memory.json         GPU memory the run's SGLang servers hold released (rank 0 writes
                               it; gspo_megatron/rollout/sglang/memory.py)

Every file has one writer: rank 0 of the job (`files.launcher_rank`, known before the process
group exists) for all but the per-rank logs and the checkpoints' per-rank data; whole files are
replaced atomically through temporaries unique to their writer (gspo_megatron.files).
docs/CHECKPOINTS.md ("Who writes what") lists every file.

Nothing is ever deleted but the oldest intact checkpoints beyond `trainer.keep_last`, and
leftovers of interrupted writes. Resume is all or nothing and loud: the newest checkpoint that
every rank validated is loaded; if checkpoints exist and none loads, the run stops with the list
of them and why.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gspo_megatron import files
from gspo_megatron.checkpoint import manifest
from gspo_megatron.checkpoint.meta import CheckpointError, read_meta, step_of
from gspo_megatron.config import ConfigError, RunConfig, to_dict
from gspo_megatron.notes import note

CONFIG_FILE = "run_config.json"
METRICS_FILE = "metrics.jsonl"
SUPERSEDED_METRICS_FILE = "metrics.superseded.jsonl"
CHECKPOINT_DIR = "checkpoints"
SUPERSEDED_DIR = "superseded"
ROLLBACKS_FILE = "rollbacks.json"
EVAL_DIR = "eval"
LOCK_FILE = "run.lock"
# Keys that may change when a run is resumed (length, schedule of outputs, resume mode, memory
# placement, where the rollout servers are).
_RESUMABLE_CHANGES = {
    "trainer.steps",
    "trainer.resume",
    "trainer.allow_different_config",
    "eval",
    "trainer.save_every",
    "trainer.save_every_minutes",
    "trainer.keep_last",
    "trainer.offload_during_rollout",
    "trainer.export_hf_every",
    "trainer.export_hf_on_failure",
    "logging",
    # How the run watches itself: the sentinel may be turned on for a run that degrades (its
    # state is kept either way) or off; it changes nothing until it fires.
    "stability.sentinel",
    # Where the servers are is deployment, not the experiment: a requeued job may find them on
    # other nodes.
    "rollout.sglang.urls",
    "rollout.sglang.router_url",
    "rollout.sglang.master_address",
    "rollout.sglang.master_port",
}


class RunFileError(RuntimeError):
    """A run file could not be written (the message names the file and the OS's reason)."""


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the run directory's checkpoints `step_N`, by step number."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir()]
    return sorted((step, p) for step, p in found if step is not None)


def check_run_directory(run_dir: Path, cfg: RunConfig) -> RunLock | None:
    """Refuse a directory holding a run of another config (unless allowed), or checkpoints
    when the config says not to resume; record our config.

    Every rank of a job calls this at start-up, before the process group exists; rank 0 alone
    (`files.launcher_rank`) writes: it takes the run directory's lock (returned: keep it for
    the run's life), removes what interrupted writers left, and writes run_config.json. Every
    rank reads the same files, so every rank reaches the same verdict."""
    writer = files.launcher_rank() == 0
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock.take(run_dir) if writer else None
    mine = to_dict(cfg)
    existing = checkpoint_dirs(run_dir)
    if cfg.trainer.resume == "never" and existing:
        raise ConfigError(
            f"trainer.resume=never, but {run_dir / CHECKPOINT_DIR} holds checkpoints "
            f"({existing[-1][1].name} is the newest): starting over there would mix two runs; "
            "use a new (or empty) run directory, or trainer.resume=auto to continue"
        )
    config_file = run_dir / CONFIG_FILE
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
        defaults = to_dict(RunConfig())
        for key, value in mine.items():
            if key not in saved and value == defaults.get(key):
                saved[key] = value  # a section added since that run was started, at its default
        differences = [k for k in _diff(saved, mine) if not _resumable(k)]
        if differences and not cfg.trainer.allow_different_config:
            raise ConfigError(
                f"{run_dir} holds a run with a different config ({', '.join(differences[:5])}); "
                "use a new output directory, or set trainer.allow_different_config=true"
            )
    if writer:
        remove_leftovers(run_dir, every_writer_gone=lock.held)
        try:
            files.write_atomically(config_file, json.dumps(mine, indent=2, sort_keys=True))
        except OSError as err:
            raise RunFileError(f"{config_file}: could not be written ({_reason(err)})") from err
    return lock


def remove_leftovers(run_dir: Path, *, every_writer_gone: bool) -> list[Path]:
    """Temporaries interrupted writers left (kill -9, a full disk) in the run directory, its
    evaluation records and its checkpoints (interrupted saves). With `every_writer_gone` (the
    run's lock is held) all of them; else those of writers on this host that are gone."""
    gone = not every_writer_gone
    removed = [
        *files.remove_temporaries(run_dir, only_dead_writers=gone),
        *files.remove_temporaries(run_dir / EVAL_DIR, recursive=True, only_dead_writers=gone),
        *files.remove_temporaries(run_dir / CHECKPOINT_DIR, only_dead_writers=gone),
    ]
    if removed:
        names = ", ".join(str(p.relative_to(run_dir)) for p in removed[:4])
        more = f" and {len(removed) - 4} more" if len(removed) > 4 else ""
        note(f"removed {len(removed)} leftover(s) of interrupted writes: {names}{more}")
    return removed


class RunLock:
    """An exclusive lock (flock) on <run>/run.lock, held by the run's writer from start-up to
    its exit: the kernel releases it when the process ends, kill -9 included. A second run in
    the same directory is refused naming the holder. Where the filesystem has no locks (some
    network mounts), that is said once and `held` is False."""

    def __init__(self, path: Path, handle, held: bool) -> None:
        self.path, self._handle, self.held = path, handle, held

    @classmethod
    def take(cls, run_dir: Path) -> RunLock:
        path = run_dir / LOCK_FILE
        try:
            handle = open(path, "a+")  # noqa: SIM115 - open for the life of the run
        except OSError as err:
            raise RunFileError(f"{path}: could not be opened ({_reason(err)})") from err
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "holder unknown"
            handle.close()
            raise RunDirectoryInUse(
                f"{run_dir} is in use by another run ({holder}): a run directory holds one "
                "run at a time; wait for it to end (or stop it), or give this run another "
                "hydra.run.dir"
            ) from None
        except OSError as err:
            note(
                f"warning: {path} cannot be locked ({_reason(err)}): a second run started in "
                f"{run_dir} would not be refused"
            )
            return cls(path, handle, held=False)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        # The lock's inode must stay: its text is rewritten in place, not replaced. Only a
        # refused run reads it, for its message.
        with contextlib.suppress(OSError):
            handle.seek(0)
            handle.truncate()
            handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {since}\n")
            handle.flush()
        return cls(path, handle, held=True)

    def release(self) -> None:
        self._handle.close()


class RunDirectoryInUse(RunFileError):
    """Another process holds the run directory's lock."""


def _resumable(key: str) -> bool:
    return any(key == r or key.startswith(f"{r}.") for r in _RESUMABLE_CHANGES)


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [prefix[:-1]] if a != b else []


class RunCheckpoints:
    """Checkpoints under <run>/checkpoints/step_NNNNNN. Every method is collective."""

    def __init__(self, run_dir: Path, keep_last: int) -> None:
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / CHECKPOINT_DIR
        self.keep_last = keep_last
        # Checkpoints this process wrote or validated: known intact without reading them again.
        self._intact: dict[int, Path] = {}
        self._resumed: Path | None = None

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}"

    @property
    def newest_intact(self) -> Path | None:
        return self._intact[max(self._intact)] if self._intact else None

    @property
    def resumed(self) -> Path | None:
        """The checkpoint the run resumed from."""
        return self._resumed

    def read_file(self, name: str) -> Any:
        """A file saved with `save(extra_files=...)` in the checkpoint resumed last, on this rank
        (weights_only: reading it runs no code); CheckpointError naming it if unreadable."""
        from gspo_megatron.checkpoint.mapping import ConversionError
        from gspo_megatron.checkpoint.safe_load import UnsafeCheckpointError, load_weights_only

        if self._resumed is None:
            raise CheckpointError(f"no checkpoint was resumed to read {name} from")
        path = self._resumed / name
        try:
            with open(path, "rb") as f:
                return load_weights_only(f, str(path))
        except OSError as err:
            raise CheckpointError(f"{path}: unreadable ({err.strerror or err})") from err
        except UnsafeCheckpointError:
            raise  # someone put code there: never a fallback
        except ConversionError as err:
            raise CheckpointError(str(err)) from err

    # -- save -------------------------------------------------------------------------------

    def save(
        self,
        engine,
        step: int,
        state: dict[str, Any],
        companions: dict | None = None,
        extra_files: dict[str, Any] | None = None,
    ) -> Path:
        """Write step `step`'s checkpoint (unless this process already has it intact), then
        delete the oldest intact ones beyond keep_last, never one newer than `step`.
        companions: engines trained with the policy (name -> engine), saved with it.
        extra_files: name -> rank 0's object (tensors and plain values) saved in it too."""
        from gspo_megatron.megatron import checkpointing

        target = self.path(step)
        if self._intact.get(step) == target:
            return target
        if _agree(target.exists()):
            try:
                checkpointing.validate(engine, target, companions=companions)
                self._intact[step] = target
                return target
            except CheckpointError as err:
                self._supersede([target], f"failed validation ({err}); replaced by a new save")
        if _is_rank0():
            self.dir.mkdir(parents=True, exist_ok=True)
            checkpointing.remove_incomplete(self.dir)
            self._warn_if_low_space()
        dist.barrier()
        try:
            checkpointing.save_engine(
                engine, target, extra=state, companions=companions, extra_files=extra_files
            )
        except CheckpointError as err:
            intact = self.newest_intact
            raise CheckpointError(
                f"checkpoint {target} was not written: {err}. "
                + (f"The newest intact checkpoint is {intact}." if intact else "")
            ) from None
        self._intact[step] = target
        if _is_rank0():
            self._rotate(step)
        dist.barrier()
        return target

    def _rotate(self, newest: int) -> None:
        """Delete the oldest beyond keep_last, but never the newest checkpoint saved healthy:
        the collapse sentinel's rollback target while the newer ones are suspect."""
        older = [(s, p) for s, p in checkpoint_dirs(self.run_dir) if s <= newest]
        health = {s: _health(p) for s, p in older}
        healthy = [s for s, h in health.items() if h is None or h.get("healthy", True)]
        keep = max(healthy, default=None)
        for step, path in older[: -self.keep_last]:
            if step == keep:
                continue
            # Renamed before it is deleted: a kill in between leaves a temporary (removed at
            # the next start), never a checkpoint with files missing under its name.
            doomed = files.temporary_path(path)
            os.replace(path, doomed)
            files.remove(doomed)
            self._intact.pop(step, None)

    def _warn_if_low_space(self) -> None:
        newest = self.newest_intact
        if newest is None:
            return
        try:
            size = sum(int(e["size"]) for e in manifest.read_manifest(newest).values())
            free = shutil.disk_usage(self.dir).free
        except (OSError, manifest.ManifestError):
            return
        if free < 1.1 * size:
            note(
                f"warning: {manifest.format_bytes(free)} free under {self.dir}, and the last "
                f"checkpoint took {manifest.format_bytes(size)}: the next save may fail"
            )

    # -- resume -----------------------------------------------------------------------------

    def resume(self, engine, mode: str, companions: dict | None = None) -> dict[str, Any] | None:
        """Load per trainer.resume (auto | never | a checkpoint path) into `engine` and its
        companions; returns the trainer state saved with it, or None for a fresh start. Raises
        CheckpointError when checkpoints exist and none is usable (listing each with its
        reason), or when a given path is unusable."""
        from gspo_megatron.megatron import checkpointing

        if mode == "never":
            return None
        if mode != "auto":
            meta = checkpointing.load_engine(engine, mode, companions=companions)
            self._after_resume(int(meta["extra"]["step"]), Path(mode))
            return meta["extra"]
        candidates = _broadcast(checkpoint_dirs(self.run_dir))
        failures: dict[Path, str] = {}
        for step, path in reversed(candidates):
            try:
                meta = checkpointing.validate(engine, path, companions=companions)
            except CheckpointError as err:
                failures[path] = str(err)
                note(f"checkpoint {path.name} is unusable: {err}")
                continue
            checkpointing.load_engine(engine, path, check=False, companions=companions)
            self._after_resume(step, path, failures)
            if failures:
                note(f"resumed from {path.name}, an older checkpoint than the newest")
            return meta["extra"]
        if failures:
            raise CheckpointError(
                f"{self.dir} holds {len(failures)} checkpoint(s) and none is usable: "
                + " | ".join(failures.values())
                + ". Nothing was loaded. Repair or move them away to start over here, or give "
                "an intact one with trainer.resume=PATH."
            )
        return None

    def _after_resume(self, step: int, path: Path, failures: dict[Path, str] | None = None) -> None:
        """The resumed checkpoint is intact; newer ones of this run directory are moved aside:
        damaged, or from a future this run no longer follows."""
        self._intact[step] = path
        self._resumed = path
        failures = failures or {}
        for s, newer in _broadcast(checkpoint_dirs(self.run_dir)):
            if s > step:
                reason = failures.get(newer, f"newer than step {step}, where the run resumed")
                self._supersede([newer], reason)

    # -- rollbacks (gspo_megatron.stability.rollback) ------------------------------------------

    def rollbacks(self) -> list[dict[str, Any]]:
        """The rollback history (rollbacks.json; [] when there is none), rank 0's on every rank."""
        path = self.run_dir / ROLLBACKS_FILE
        records = None
        if _is_rank0():
            try:
                records = json.loads(path.read_text()) if path.is_file() else []
            except (OSError, ValueError) as err:
                records = f"{path}: unreadable ({err}); move it away to forget the rollbacks"
        records = _broadcast(records)
        if isinstance(records, str):
            raise RunFileError(records)
        return records

    def save_rollbacks(self, records: list[dict[str, Any]]) -> None:
        """Replace the rollback history (one writer, rank 0; atomically)."""
        if _is_rank0():
            path = self.run_dir / ROLLBACKS_FILE
            try:
                files.write_atomically(path, json.dumps(records, indent=1, sort_keys=True))
            except OSError as err:
                raise RunFileError(
                    f"{path}: could not record the rollback ({err.strerror or err})"
                ) from err
        dist.barrier()

    def rollback_target(self, engine, allowed, companions: dict | None = None):
        """(step, directory name) of the newest checkpoint with `allowed(step, health)` (health:
        what the trainer recorded when saving it, None for checkpoints of earlier versions)
        that validates on every rank; None when there is none."""
        from gspo_megatron.megatron import checkpointing

        candidates = _broadcast(
            [(s, p, _health(p)) for s, p in checkpoint_dirs(self.run_dir)] if _is_rank0() else None
        )
        for step, path, health in reversed(candidates):
            if not allowed(step, health):
                continue
            try:
                checkpointing.validate(engine, path, companions=companions)
            except CheckpointError as err:
                note(f"checkpoint {path.name} cannot be rolled back to: {err}")
                continue
            self._intact[step] = path
            return step, path.name
        return None

    def roll_back(
        self,
        engine,
        step: int,
        *,
        reason: str,
        companions: dict | None = None,
        validate: bool = True,
    ) -> dict[str, Any]:
        """Load the checkpoint of `step` (validated first unless `validate` is false: it just
        was) and move the newer ones aside with `reason`; returns its trainer state."""
        from gspo_megatron.megatron import checkpointing

        path = self.path(step)
        meta = checkpointing.load_engine(engine, path, check=validate, companions=companions)
        self._intact[step] = path
        self._resumed = path  # what read_file reads from, and the export's checkpoint
        for s, newer in _broadcast(checkpoint_dirs(self.run_dir)):
            if s > step:
                self._intact.pop(s, None)
                self._supersede([newer], reason)
        return meta["extra"]

    def _supersede(self, paths: list[Path], reason: str) -> None:
        if _is_rank0():
            target_dir = self.dir / SUPERSEDED_DIR
            target_dir.mkdir(parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for path in paths:
                moved = _unused(target_dir / f"{path.name}.{stamp}")
                os.replace(path, moved)
                files.write_atomically(moved / "SUPERSEDED.txt", reason + "\n")
                note(f"moved {path.name} to {moved.relative_to(self.run_dir)}: {reason}")
        dist.barrier()


class MetricsLogger:
    """metrics.jsonl (one record per step, stable keys), TensorBoard, W&B, a progress bar."""

    def __init__(self, run_dir: Path, cfg: RunConfig, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self.bar = None
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        if cfg.logging.progress:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, desc="gspo", unit="step", dynamic_ncols=True, file=sys.stderr
            )
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if cfg.logging.wandb:
            import wandb

            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                config=to_dict(cfg),
                dir=str(run_dir),
                resume="allow",
            )

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        try:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
        except OSError as err:
            raise RunFileError(
                f"{self.path}: could not append the record of step {step} ({err.strerror or err})"
            ) from err
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix(
                reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                clip=f"{metrics.get('actor/clip_fraction', float('nan')):.3f}",
                step_s=f"{metrics.get('time/step', float('nan')):.1f}",
                refresh=True,
            )

    def write_records(self, step: int, name: str, records: Sequence[dict[str, Any]]) -> None:
        """A benchmark's per-problem records at `step`: eval/step_<N>/<name>.jsonl."""
        if not self.enabled:
            return
        from gspo_megatron.evaluation.benchmarks import write_records

        path = self.path.parent / "eval" / f"step_{step:06d}" / f"{name}.jsonl"
        try:
            write_records(path, records)
        except OSError as err:
            raise RunFileError(f"{path}: could not write the evaluation's records ({err})") from err

    def rewind(self, step: int) -> None:
        """Keep the records of steps 1..`step`; move later ones (a killed run's last steps, or
        a future the resumed run no longer follows) and unreadable lines to
        metrics.superseded.jsonl. Nothing is dropped."""
        if not self.enabled:
            return
        self._supersede_eval_records(step)
        if self.tb is not None:
            # TensorBoard hides the events of steps after `step` written before this point.
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(log_dir=self.tb.log_dir, purge_step=step + 1)
        if not self.path.is_file():
            return
        kept, moved = [], []
        for line in self.path.read_text().splitlines():
            try:
                record_step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                record_step = None
            ok = isinstance(record_step, int) and record_step <= step
            (kept if ok else moved).append(line)
        if moved:
            side = self.path.with_name(SUPERSEDED_METRICS_FILE)
            try:
                _append_lines_once(side, moved)
                files.write_atomically(self.path, "".join(line + "\n" for line in kept))
            except OSError as err:
                raise RunFileError(
                    f"{self.path}: could not move the records after step {step} aside "
                    f"({_reason(err)})"
                ) from err
            note(f"moved {len(moved)} metrics record(s) after step {step} to {side.name}")
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def _supersede_eval_records(self, step: int) -> None:
        """eval/step_N of steps after `step` to eval/superseded/step_N.<time>."""
        root = self.path.parent / EVAL_DIR
        later = (
            [p for p in root.glob("step_*") if (step_of(p) or 0) > step] if root.is_dir() else []
        )
        if not later:
            return
        side = root / SUPERSEDED_DIR
        side.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for path in later:
            os.replace(path, side / f"{path.name}.{stamp}")
        note(f"moved the evaluation records of {len(later)} step(s) after step {step} to {side}")

    def summary(self, last: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        keys = [
            "reward/mean",
            "reward/accuracy",
            "eval/pass@1",
            "actor/clip_fraction",
            "response/length_mean",
            "time/step",
        ]
        shown = ", ".join(f"{k}={last[k]:.4g}" for k in keys if k in last)
        note(f"finished: {shown}; metrics in {self.path}")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self.bar.close()


def _append_lines_once(path: Path, lines: list[str]) -> None:
    """Append `lines` to `path`, durably, but not those it already holds: a rewind killed
    after writing them (and before rewriting metrics.jsonl) moves the same records again. A
    line cut short by a kill is ended first, so it cannot swallow the next record."""
    held = path.read_bytes() if path.is_file() else b""
    already = set(held.decode(errors="replace").splitlines())
    new = [line for line in lines if line not in already]
    if not new:
        return
    with path.open("a") as f:
        if held and not held.endswith(b"\n"):
            f.write("\n")
        f.write("".join(line + "\n" for line in new))
        f.flush()
        os.fsync(f.fileno())


def _unused(path: Path) -> Path:
    """`path`, or `path.2`, `path.3`, ... : the first that does not exist."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate


def _reason(err: OSError) -> str:
    return err.strerror or errno.errorcode.get(err.errno or 0, "") or str(err)


def _health(path: Path) -> dict[str, Any] | None:
    """The health the trainer recorded in a checkpoint (None: none recorded, or unreadable)."""
    try:
        health = read_meta(path).get("extra", {}).get("health")
    except CheckpointError:
        return None
    return health if isinstance(health, dict) else None


def _plain(value: Any) -> Any:
    return float(value) if isinstance(value, int | float) else value


def _is_rank0() -> bool:
    return dist.get_rank() == 0


def _broadcast(value: Any) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _agree(flag: bool) -> bool:
    """Rank 0's view of a file-system fact, shared so every rank takes the same branch."""
    return bool(_broadcast(flag))
