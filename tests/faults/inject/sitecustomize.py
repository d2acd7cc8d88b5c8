"""Fault injection for the fault-tolerance tests: loaded by every Python process started with
this directory on PYTHONPATH, it arms the faults named in GSPO_FAULTS (comma-separated
`name=N`, N counting from 1 within the process; GSPO_FAULT_RANK limits them to one rank).

    kill_after_optimizer_step=N   SIGKILL right after the N-th optimizer step
    kill_mid_metrics=N            write half of the N-th metrics record, then SIGKILL
    kill_before_manifest=N        SIGKILL in the N-th checkpoint save, data written, no manifest
    kill_after_publish=N          SIGKILL right after the N-th checkpoint is renamed into place
    kill_mid_rotation=N           SIGKILL in the N-th rotation, one file of the checkpoint it
                                  removes deleted
    enospc_in_save=N              the N-th checkpoint save's data files fail: "No space left"
    lr_spike_at_optimizer_step=N  the learning rate of optimizer steps N .. N+lr_spike_steps-1
                                  times lr_spike_factor (default 1000; lr_spike_steps default 1):
                                  a collapse on purpose (benchmarks/bench_sentinel.py)
    nan_batch_at_optimizer_step=N the N-th optimizer step's samples carry NaN old log-probs: a
                                  corrupted batch (a non-finite loss and gradient)
    kill_after_rollback_record=N  SIGKILL right after the N-th rollback is recorded (rollbacks.json)
    kill_mid_rollback=N           SIGKILL in the N-th rollback, after the checkpoints newer than its
                                  target were moved aside, before the metrics are rewound
    kill_in_save=N                SIGKILL in the N-th checkpoint save, right after this rank
                                  wrote its share of the model and optimizer data
    kill_mid_supersede=N          SIGKILL in the N-th superseding (a resume moving a checkpoint
                                  aside), after the move, before its SUPERSEDED.txt
    kill_mid_rewind=N             SIGKILL in the N-th metrics rewind that moves records, after
                                  they are appended to metrics.superseded.jsonl, before
                                  metrics.jsonl is rewritten
    kill_mid_export=N             SIGKILL in the N-th weight export to the rollout engine, after
                                  its first bucket (SGLang's disk export: one file written)

Each fault patches one function of the product right after its module is imported. With
GSPO_FAULT_LOG set, each fault appends its name and rank to that file when it fires.

The chaos soak's filesystem faults (tests/faults/chaos) are armed by GSPO_CHAOS_FS, a control
file the harness writes while the fault lasts: "full" makes every file opened for writing (and
every directory made) under GSPO_CHAOS_FS_ROOT fail with ENOSPC, except the per-rank logs
already open; "slow SECONDS" delays each such open, fsync and rename by SECONDS.
"""

import builtins
import errno
import importlib.abc
import importlib.util
import io
import os
import signal
import sys
import time
from pathlib import Path

_FAULTS = dict(
    item.split("=") for item in os.environ.get("GSPO_FAULTS", "").split(",") if "=" in item
)
_RANK = os.environ.get("GSPO_FAULT_RANK")


def _armed() -> bool:
    return bool(_FAULTS) and (_RANK is None or os.environ.get("RANK", "0") == _RANK)


def _die(name: str) -> None:
    _log_fired(name)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _log_fired(name: str) -> None:
    """GSPO_FAULT_LOG (when set) gets one line per fault that fires, before it acts."""
    log = os.environ.get("GSPO_FAULT_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{name}@rank{os.environ.get('RANK', '0')}\n")


def _on_call(name: str):
    """A counter: True exactly when fault `name` is armed and this is its N-th call."""
    wanted = int(_FAULTS.get(name, 0))
    calls = [0]

    def due() -> bool:
        calls[0] += 1
        return wanted > 0 and calls[0] == wanted

    return due


def _on_calls(name: str, count: int):
    """A counter: True on calls N .. N+count-1 of fault `name` (armed with N)."""
    first = int(_FAULTS.get(name, 0))
    calls = [0]

    def due() -> bool:
        calls[0] += 1
        return first > 0 and first <= calls[0] < first + count

    return due


def _patch_engine(module) -> None:
    due = _on_call("kill_after_optimizer_step")
    spike_due = _on_calls("lr_spike_at_optimizer_step", int(_FAULTS.get("lr_spike_steps", 1)))
    spike = float(_FAULTS.get("lr_spike_factor", 1000.0))
    nan_due = _on_call("nan_batch_at_optimizer_step")
    original = module.TrainingEngine.train_step

    def train_step(self, samples, *args, **kwargs):
        if spike_due():
            # The scheduler sets every group's LR again after this optimizer step.
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * spike
        if nan_due():
            import copy

            samples = [copy.copy(s) for s in samples]
            for s in samples:
                s.old_logprobs = [float("nan")] * len(s.response_ids)
        out = original(self, samples, *args, **kwargs)
        if due():
            _die("kill_after_optimizer_step")
        return out

    module.TrainingEngine.train_step = train_step


def _patch_run_files(module) -> None:
    due_metrics = _on_call("kill_mid_metrics")
    original_write = module.MetricsLogger.write

    def write(self, step, metrics):
        if due_metrics() and self.enabled:
            with self.path.open("a") as f:
                f.write(f'{{"step": {step}, "reward/me')
            _die("kill_mid_metrics")
        return original_write(self, step, metrics)

    module.MetricsLogger.write = write
    due_rotation = _on_call("kill_mid_rotation")
    original_rotate = module.RunCheckpoints._rotate

    def rotate(self, newest):
        if not due_rotation():
            return original_rotate(self, newest)
        import shutil

        real_rmtree = shutil.rmtree

        def delete_one_file_then_die(path, *args, **kwargs):
            next(f for f in sorted(Path(path).rglob("*")) if f.is_file()).unlink()
            _die("kill_mid_rotation")

        shutil.rmtree = delete_one_file_then_die
        try:
            return original_rotate(self, newest)
        finally:
            shutil.rmtree = real_rmtree

    module.RunCheckpoints._rotate = rotate
    due_record = _on_call("kill_after_rollback_record")
    original_save_rollbacks = module.RunCheckpoints.save_rollbacks

    def save_rollbacks(self, records):
        original_save_rollbacks(self, records)
        if records and records[-1]["status"] == "started" and due_record():
            _die("kill_after_rollback_record")

    module.RunCheckpoints.save_rollbacks = save_rollbacks
    due_rollback = _on_call("kill_mid_rollback")
    original_roll_back = module.RunCheckpoints.roll_back

    def roll_back(self, *args, **kwargs):
        state = original_roll_back(self, *args, **kwargs)
        if due_rollback():
            _die("kill_mid_rollback")
        return state

    module.RunCheckpoints.roll_back = roll_back
    due_supersede = _on_call("kill_mid_supersede")
    original_replace = os.replace

    def replace(src, dst, **kwargs):
        original_replace(src, dst, **kwargs)
        if os.path.basename(os.path.dirname(dst)) == module.SUPERSEDED_DIR and due_supersede():
            _die("kill_mid_supersede")

    os.replace = replace
    due_rewind = _on_call("kill_mid_rewind")
    original_append = module._append_lines_once

    def append_then_die(path, lines):
        original_append(path, lines)
        if due_rewind():
            _die("kill_mid_rewind")

    module._append_lines_once = append_then_die


def _patch_checkpointing(module) -> None:
    due_manifest = _on_call("kill_before_manifest")
    original_manifest = module.manifest.write_manifest

    def write_manifest(root, entries):
        if due_manifest():
            _die("kill_before_manifest")
        return original_manifest(root, entries)

    module.manifest.write_manifest = write_manifest
    due_publish = _on_call("kill_after_publish")
    original_publish = module._publish

    def publish(tmp, final):
        original_publish(tmp, final)
        if due_publish():
            _die("kill_after_publish")

    module._publish = publish
    due_enospc = _on_call("enospc_in_save")
    original_save = module.dist_checkpointing.save

    def save(*args, **kwargs):
        if not due_enospc():
            return original_save(*args, **kwargs)
        _log_fired("enospc_in_save")
        real_open = builtins.open

        def full_disk_open(file, mode="r", *a, **k):
            if str(file).endswith(".distcp") and "w" in mode:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(file))
            return real_open(file, mode, *a, **k)

        builtins.open = full_disk_open
        try:
            return original_save(*args, **kwargs)
        finally:
            builtins.open = real_open

    due_in_save = _on_call("kill_in_save")

    def save_then_die(*args, **kwargs):
        out = save(*args, **kwargs)
        if due_in_save():
            _die("kill_in_save")
        return out

    module.dist_checkpointing.save = save_then_die


def _patch_weight_export(module) -> None:
    due = _on_call("kill_mid_export")
    original = module.MegatronWeightSource.buckets

    def buckets(self, bucket_bytes):
        dying = due()
        for i, bucket in enumerate(original(self, bucket_bytes)):
            if dying and i == 1:
                _die("kill_mid_export")
            yield bucket
        if dying:  # one bucket in all: die once it has been consumed
            _die("kill_mid_export")

    module.MegatronWeightSource.buckets = buckets


_PATCHES = {
    "gspo_megatron.megatron.training_engine": _patch_engine,
    "gspo_megatron.run_files": _patch_run_files,
    "gspo_megatron.megatron.checkpointing": _patch_checkpointing,
    "gspo_megatron.megatron.weight_export": _patch_weight_export,
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        original = spec.loader.exec_module

        def exec_module(module):
            original(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _arm_filesystem_faults(control: str, root: str) -> None:
    """Writes under `root` fail with ENOSPC, or are slow, while the harness says so."""
    real_open, real_os_open = builtins.open, os.open
    real_mkdir, real_fsync, real_replace, real_rename = os.mkdir, os.fsync, os.replace, os.rename
    root = os.path.realpath(root)
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

    def state() -> list[str]:
        try:
            with real_open(control) as f:
                return f.read().split()
        except OSError:
            return []

    def fault(path, *, may_fail: bool = True) -> None:
        try:
            if not os.path.realpath(os.fspath(path)).startswith(root):
                return
        except TypeError:  # a file descriptor
            return
        now = state()
        if now[:1] == ["slow"]:
            time.sleep(float(now[1]))
        elif now[:1] == ["full"] and may_fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))

    def chaos_open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            fault(file, may_fail=not str(file).endswith(".log"))
        return real_open(file, mode, *args, **kwargs)

    def chaos_os_open(path, flags, *args, **kwargs):
        if flags & writing:
            fault(path)
        return real_os_open(path, flags, *args, **kwargs)

    def chaos_mkdir(path, *args, **kwargs):
        fault(path)
        return real_mkdir(path, *args, **kwargs)

    def chaos_fsync(fd):
        if state()[:1] == ["slow"]:
            time.sleep(float(state()[1]))
        return real_fsync(fd)

    def chaos_replace(src, dst, **kwargs):
        fault(dst, may_fail=False)
        return real_replace(src, dst, **kwargs)

    def chaos_rename(src, dst, **kwargs):
        fault(dst, may_fail=False)
        return real_rename(src, dst, **kwargs)

    builtins.open = io.open = chaos_open
    os.open, os.mkdir, os.fsync = chaos_os_open, chaos_mkdir, chaos_fsync
    os.replace, os.rename = chaos_replace, chaos_rename


if _armed():
    sys.meta_path.insert(0, _PatchAfterImport())
if os.environ.get("GSPO_CHAOS_FS"):
    _arm_filesystem_faults(os.environ["GSPO_CHAOS_FS"], os.environ["GSPO_CHAOS_FS_ROOT"])
