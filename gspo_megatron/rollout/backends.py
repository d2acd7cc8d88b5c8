"""Rollout backends by name (`rollout.engine`): the one place that maps a backend's name to what
the rest of the code asks of it. Nothing outside this module compares a backend's name.

    ROLLOUT_BACKENDS = {"embedded": "gspo_megatron.rollout.embedded.backend:EMBEDDED", ...}

Each entry names the `RolloutBackend` that a backend's own module defines; it is imported when
the backend is first asked for (`rollout_backend`), so this module, which the configuration
reads, imports no engine. What the code asks of a backend:

  build(cfg, policy, run)   the engine (rollout/base.py: an InProcessRolloutEngine or a
                           ServerRolloutEngine) over the policy's TrainingEngine, and the weight
                           source it syncs from (None when it shares the policy's weights);
                           `run` (a RunContext): where it keeps files, how it tells the user;
                           components.build_rollout
  check_run_dir(cfg, run_dir)
                           its files in that directory, checked before the model is built (a
                           damaged one is an error then, not after minutes of loading)
  check(cfg)               config-time checks of its settings and of the combinations it cannot
                           run, a ConfigError naming the keys; config.resolve
  missing_inputs(cfg)      what the run needs from outside that the config does not give
                           (servers); config.missing_inputs, the Slurm preflight
  memory_share(rollout)    what it costs each training GPU; memory_plan, the Slurm preflight
  keeps_policy_weights     it generates with the policy's own weights, so
                           trainer.offload_during_rollout leaves them; Trainer, memory_plan
  describe(cfg)            its line in the Slurm preflight's report (None: no line)
  records_routes(cfg)      it reports the experts of every token it samples (R3, and the
                           rollout-vs-trainer route flips); route_setting: what turns that on,
                           named in config errors

docs/ARCHITECTURE.md, "Adding a rollout engine", walks a new backend through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gspo_megatron.config_fields import ConfigError
from gspo_megatron.plugins import import_attr

ROLLOUT_BACKENDS: dict[str, str] = {
    "embedded": "gspo_megatron.rollout.embedded.backend:EMBEDDED",
    "sglang": "gspo_megatron.rollout.sglang.backend:SGLANG",
}


@dataclass(frozen=True)
class RunContext:
    """What the run gives a backend's engine besides its config and the policy.

    run_dir: where it keeps what a resumed run must know (gspo-train: the run directory;
    gspo-eval: its output directory). announce(line): a line for the user (gspo-train: on rank
    0's stderr, above the progress bar, and in the log)."""

    run_dir: Path
    announce: Callable[[str], None]


@dataclass(frozen=True)
class RolloutShare:
    """What a rollout engine costs each training GPU (memory_plan.ASSUMPTIONS). The default,
    nothing: servers on GPUs of their own.

    kv_cache_tokens: an engine in the trainer's processes: the KV-cache slots of one generation
    batch (plus one layer's prefill activations), while generating. kept_kv_tokens: K/V it keeps
    between generate calls while generating (the embedded engine's prefix cache).
    server_fraction: colocated servers: the share of each GPU they hold while generating;
    server_idle_gib: what they keep while training (None: all of it); fraction_key: the
    setting that sets their share (named in the planner's advice).
    keeps_policy_weights: the engine generates with the policy's weights (they stay on the GPU
    whatever trainer.offload_during_rollout says). merges_adapters_per_batch: with LoRA on a
    model not split over ranks, the engine generates from a merged copy of every adapted
    weight (base + alpha/r * B @ A) held while a batch generates.
    """

    kv_cache_tokens: int = 0
    kept_kv_tokens: int = 0
    server_fraction: float = 0.0
    server_idle_gib: float | None = None
    fraction_key: str = ""
    keeps_policy_weights: bool = False
    merges_adapters_per_batch: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_tokens < 0 or self.kept_kv_tokens < 0:
            raise ValueError(
                f"KV-cache slots must be >= 0, got {self.kv_cache_tokens} (batch) and "
                f"{self.kept_kv_tokens} (kept)"
            )
        if not 0 <= self.server_fraction < 1:
            raise ValueError(
                f"colocated servers' share of a GPU ({self.fraction_key or 'server_fraction'}) "
                f"must be in (0, 1), got {self.server_fraction}"
            )

    def describe(self) -> str:
        parts = []
        if self.kv_cache_tokens:
            parts.append(f"a KV cache of {self.kv_cache_tokens} tokens while generating")
        if self.kept_kv_tokens:
            parts.append(f"up to {self.kept_kv_tokens} tokens' K/V kept between generate calls")
        if self.server_fraction:
            idle = "all" if self.server_idle_gib is None else f"{self.server_idle_gib:g} GiB"
            parts.append(
                f"colocated servers holding {self.server_fraction:g} of each GPU while "
                f"generating, {idle} while training"
            )
        return "; ".join(parts) or "none (servers on GPUs of their own)"


def _no_check(cfg: Any) -> None:
    """A backend with nothing of its own to check."""


def _nothing_missing(cfg: Any) -> list[str]:
    return []


def _no_line(cfg: Any) -> str | None:
    return None


def _no_files(cfg: Any, run_dir: Path) -> None:
    """A backend that keeps nothing in the run directory."""


def _routes_under_r3(cfg: Any) -> bool:
    return cfg.algorithm.routing_replay == "r3"


@dataclass(frozen=True)
class RolloutBackend:
    """What the code asks of one rollout backend (see the module's docstring)."""

    build: Callable[[Any, Any, RunContext], tuple[Any, Any]]
    memory_share: Callable[[Any], RolloutShare]
    keeps_policy_weights: bool
    check: Callable[[Any], None] = _no_check
    check_run_dir: Callable[[Any, Path], None] = _no_files
    missing_inputs: Callable[[Any], list[str]] = _nothing_missing
    describe: Callable[[Any], str | None] = _no_line
    records_routes: Callable[[Any], bool] = _routes_under_r3
    route_setting: str = "algorithm.routing_replay=r3"
    # Generates with a LoRA policy's adapters (lora.rank): the embedded engine runs the policy's
    # own model (in process) or merges the adapters it is sent (generator process); SGLang is
    # sent the merged weights (rollout.sglang.lora_sync). A backend without it is refused with
    # LoRA at config time (docs/LORA.md, "Weight sync").
    generates_with_adapters: bool = False


def rollout_backend(name: str) -> RolloutBackend:
    """The backend `rollout.engine` names; a ConfigError for a name not in ROLLOUT_BACKENDS."""
    if name not in ROLLOUT_BACKENDS:
        raise ConfigError(f"rollout.engine={name!r} is not one of {sorted(ROLLOUT_BACKENDS)}")
    backend = import_attr(ROLLOUT_BACKENDS[name], "rollout.engine")
    if not isinstance(backend, RolloutBackend):
        raise ConfigError(
            f"rollout.engine={name}: {ROLLOUT_BACKENDS[name]} is a {type(backend).__name__}, "
            "not a RolloutBackend"
        )
    return backend


def memory_share(rollout: Any) -> RolloutShare:
    """The rollout section's engine's share of each training GPU."""
    backend = rollout_backend(rollout.engine)
    return dataclasses.replace(
        backend.memory_share(rollout), keeps_policy_weights=backend.keeps_policy_weights
    )
