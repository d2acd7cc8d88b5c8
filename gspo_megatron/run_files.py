"""What a run leaves in its directory: resolved config, metrics.jsonl, TensorBoard events,
checkpoints (newest k kept), and how a run resumes from them."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gspo_megatron.config import ConfigError, RunConfig, to_dict

CONFIG_FILE = "run_config.json"
METRICS_FILE = "metrics.jsonl"
# Keys that may change when a run is resumed (length, schedule of outputs, resume mode).
_RESUMABLE_CHANGES = {
    "trainer.steps",
    "trainer.resume",
    "trainer.allow_different_config",
    "trainer.eval_every",
    "trainer.save_every",
    "trainer.keep_last",
    "logging",
}


def check_run_directory(run_dir: Path, cfg: RunConfig) -> None:
    """Refuse a directory holding a run of another config (unless allowed); record ours."""
    run_dir.mkdir(parents=True, exist_ok=True)
    mine = to_dict(cfg)
    config_file = run_dir / CONFIG_FILE
    if config_file.is_file():
        saved = json.loads(config_file.read_text())
        differences = [k for k in _diff(saved, mine) if not _resumable(k)]
        if differences and not cfg.trainer.allow_different_config:
            raise ConfigError(
                f"{run_dir} holds a run with a different config ({', '.join(differences[:5])}); "
                "use a new output directory, or set trainer.allow_different_config=true"
            )
    if not dist.is_initialized() or dist.get_rank() == 0:
        config_file.write_text(json.dumps(mine, indent=2, sort_keys=True))


def _resumable(key: str) -> bool:
    return key in _RESUMABLE_CHANGES or key.split(".")[0] in _RESUMABLE_CHANGES


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in _diff(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [prefix[:-1]] if a != b else []


class RunCheckpoints:
    """Checkpoints under <run>/checkpoints/step_NNNNNN, written atomically by the engine."""

    def __init__(self, run_dir: Path, cfg: RunConfig, keep_last: int) -> None:
        self.dir = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last
        self.cfg = cfg

    def path(self, step: int) -> Path:
        return self.dir / f"step_{step:06d}"

    def save(self, engine, step: int, state: dict[str, Any]) -> Path:
        from gspo_megatron.megatron import checkpointing

        target = self.path(step)
        if target.exists():
            return target
        if dist.get_rank() == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            checkpointing.remove_incomplete(self.dir)
        dist.barrier()
        checkpointing.save_engine(engine, target, extra=state)
        if dist.get_rank() == 0:
            for old in self.complete()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return target

    def complete(self) -> list[Path]:
        from gspo_megatron.megatron.checkpointing import is_checkpoint

        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("step_*") if p.is_dir() and is_checkpoint(p))

    def resume(self, engine, mode: str) -> dict[str, Any] | None:
        """Load per trainer.resume (auto | never | path); returns the saved trainer state."""
        from gspo_megatron.megatron import checkpointing

        if mode == "never":
            return None
        if mode != "auto":
            return checkpointing.load_engine(engine, mode)["extra"]
        for candidate in reversed(self.complete()):
            try:
                return checkpointing.load_engine(engine, candidate)["extra"]
            except Exception as err:  # noqa: BLE001 - any unreadable checkpoint: try an older one
                _note(
                    f"checkpoint {candidate} is unusable ({type(err).__name__}: {err}); "
                    "trying the previous one"
                )
        return None


class MetricsLogger:
    """metrics.jsonl (one record per step, stable keys), TensorBoard, W&B, a progress bar."""

    def __init__(self, run_dir: Path, cfg: RunConfig, total_steps: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self.lines_written = 0
        self.bar = None
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        self.lines_written = _count_lines(self.path)
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
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.lines_written += 1
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

    def truncate(self, lines: int) -> None:
        """Drop records written after the checkpoint being resumed (a killed run's last steps)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = self.path.read_text().splitlines()[:lines]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.lines_written = len(kept)
        if self.bar is not None:
            self.bar.n = lines
            self.bar.refresh()

    def note(self, message: str) -> None:
        if self.enabled:
            _note(message)

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
        _note(f"finished: {shown}; metrics in {self.path}")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.bar is not None:
            self.bar.close()


def _count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _plain(value: Any) -> Any:
    return float(value) if isinstance(value, int | float) else value


def _note(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"[gspo-megatron] {message}", file=sys.stderr)
