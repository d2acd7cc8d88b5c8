"""Fault injection for the fault-tolerance tests: loaded by every Python process started with
this directory on PYTHONPATH, it arms the faults named in GSPO_FAULTS (comma-separated
`name=N`, N counting from 1 within the process; GSPO_FAULT_RANK limits them to one rank).

    kill_after_optimizer_step=N   SIGKILL right after the N-th optimizer step
    kill_mid_metrics=N            write half of the N-th metrics record, then SIGKILL
    kill_before_manifest=N        SIGKILL in the N-th checkpoint save, data written, no manifest
    kill_after_publish=N          SIGKILL right after the N-th checkpoint is renamed into place
    kill_mid_rotation=N           delete one file of the checkpoint the N-th rotation removes,
                                  then SIGKILL
    enospc_in_save=N              the N-th checkpoint save's data files fail: "No space left"
    lr_spike_at_optimizer_step=N  the learning rate of optimizer steps N .. N+lr_spike_steps-1
                                  times lr_spike_factor (default 1000; lr_spike_steps default 1):
                                  a collapse on purpose (benchmarks/bench_sentinel.py)
    nan_batch_at_optimizer_step=N the N-th optimizer step's samples carry NaN old log-probs: a
                                  corrupted batch (a non-finite loss and gradient)
    kill_after_rollback_record=N  SIGKILL right after the N-th rollback is recorded (rollbacks.json)
    kill_mid_rollback=N           SIGKILL in the N-th rollback, after the checkpoints newer than its
                                  target were moved aside, before the metrics are rewound

Each fault patches one function of the product right after its module is imported.
"""

import errno
import importlib.abc
import importlib.util
import os
import signal
import sys

_FAULTS = dict(
    item.split("=") for item in os.environ.get("GSPO_FAULTS", "").split(",") if "=" in item
)
_RANK = os.environ.get("GSPO_FAULT_RANK")


def _armed() -> bool:
    return bool(_FAULTS) and (_RANK is None or os.environ.get("RANK", "0") == _RANK)


def _die() -> None:
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


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
            _die()
        return out

    module.TrainingEngine.train_step = train_step


def _patch_run_files(module) -> None:
    due_metrics = _on_call("kill_mid_metrics")
    original_write = module.MetricsLogger.write

    def write(self, step, metrics):
        if due_metrics() and self.enabled:
            with self.path.open("a") as f:
                f.write(f'{{"step": {step}, "reward/me')
            _die()
        return original_write(self, step, metrics)

    module.MetricsLogger.write = write
    due_rotation = _on_call("kill_mid_rotation")
    original_rotate = module.RunCheckpoints._rotate

    def rotate(self, newest):
        if due_rotation():
            older = [p for s, p in module.checkpoint_dirs(self.run_dir) if s <= newest]
            if len(older) > self.keep_last:
                victim = older[0]
                next(f for f in sorted(victim.rglob("*")) if f.is_file()).unlink()
                _die()
        return original_rotate(self, newest)

    module.RunCheckpoints._rotate = rotate
    due_record = _on_call("kill_after_rollback_record")
    original_save_rollbacks = module.RunCheckpoints.save_rollbacks

    def save_rollbacks(self, records):
        original_save_rollbacks(self, records)
        if records and records[-1]["status"] == "started" and due_record():
            _die()

    module.RunCheckpoints.save_rollbacks = save_rollbacks
    due_rollback = _on_call("kill_mid_rollback")
    original_roll_back = module.RunCheckpoints.roll_back

    def roll_back(self, *args, **kwargs):
        state = original_roll_back(self, *args, **kwargs)
        if due_rollback():
            _die()
        return state

    module.RunCheckpoints.roll_back = roll_back


def _patch_checkpointing(module) -> None:
    due_manifest = _on_call("kill_before_manifest")
    original_manifest = module.manifest.write_manifest

    def write_manifest(root, entries):
        if due_manifest():
            _die()
        return original_manifest(root, entries)

    module.manifest.write_manifest = write_manifest
    due_publish = _on_call("kill_after_publish")
    original_publish = module._publish

    def publish(tmp, final):
        original_publish(tmp, final)
        if due_publish():
            _die()

    module._publish = publish
    due_enospc = _on_call("enospc_in_save")
    original_save = module.dist_checkpointing.save

    def save(*args, **kwargs):
        if not due_enospc():
            return original_save(*args, **kwargs)
        import builtins

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

    module.dist_checkpointing.save = save


_PATCHES = {
    "gspo_megatron.megatron.training_engine": _patch_engine,
    "gspo_megatron.run_files": _patch_run_files,
    "gspo_megatron.megatron.checkpointing": _patch_checkpointing,
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


if _armed():
    sys.meta_path.insert(0, _PatchAfterImport())
