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
    kill_mid_weight_update=N      SIGKILL in the N-th weight update of the generator process,
                                  its staging copy half written (lock held)
    kill_mid_export=N             SIGKILL in the N-th Hugging Face export, its shards written
    generator_token_delay_ms=N    the generator process takes N ms more per token (a pace, not
                                  a fault: generation outlasts a step, so partial rollouts are
                                  in flight whenever the trainer checkpoints or dies)

Each fault patches one function of the product right after its module is imported (in every
process started with this directory on PYTHONPATH, the generator process included).
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


def _patch_engine(module) -> None:
    due = _on_call("kill_after_optimizer_step")
    original = module.TrainingEngine.train_step

    def train_step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
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


def _patch_generator(module) -> None:
    due_update = _on_call("kill_mid_weight_update")
    original_update = module.GeneratorProcessEngine.update_weights

    def update_weights(self, source, version, urls=None):
        if not (due_update() and self.leader):
            return original_update(self, source, version, urls)

        class HalfThenDie:
            def buckets(self, bucket_bytes):
                for i, bucket in enumerate(source.buckets(1)):  # one tensor at a time
                    if i == 3:
                        _die()
                    yield bucket

        return original_update(self, HalfThenDie(), version, urls)

    module.GeneratorProcessEngine.update_weights = update_weights
    delay = int(_FAULTS.get("generator_token_delay_ms", 0)) / 1000
    if delay:
        import time

        original_refresh = module.ProcessGenerator.refresh_weights

        def refresh_weights(self):
            time.sleep(delay)
            return original_refresh(self)

        module.ProcessGenerator.refresh_weights = refresh_weights


def _patch_export(module) -> None:
    due = _on_call("kill_mid_export")
    original = module.HFExporter._write_config_and_tokenizer

    def write_config_and_tokenizer(self, tmp):
        if due():
            _die()
        return original(self, tmp)

    module.HFExporter._write_config_and_tokenizer = write_config_and_tokenizer


_PATCHES = {
    "gspo_megatron.megatron.training_engine": _patch_engine,
    "gspo_megatron.run_files": _patch_run_files,
    "gspo_megatron.megatron.checkpointing": _patch_checkpointing,
    "gspo_megatron.rollout.embedded.generator": _patch_generator,
    "gspo_megatron.megatron.hf_export": _patch_export,
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
