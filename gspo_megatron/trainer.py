"""The RL loop (docs/ARCHITECTURE.md §3): generate -> score -> advantages -> old log-probs ->
train -> sync weights -> log, evaluate, checkpoint. Every rank runs this loop; collectives happen
inside the training and rollout engines, and rank 0 scores, logs and writes files. The phases'
work is elsewhere: rollouts, rewards and dynamic sampling in collector.py, the step's inputs in
step_inputs.py, benchmarks in evaluation/benchmarks.py, the mismatch budget, the collapse
sentinel and rollbacks in stability/; the Trainer orders them, checkpoints, resumes, rolls back
and stops on signals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Sequence

from gspo_megatron.collector import RolloutBatch, RolloutCollector, derive_seed
from gspo_megatron.config import RunConfig
from gspo_megatron.evaluation.benchmarks import Benchmark, run_benchmark
from gspo_megatron.metrics_schedule import CostlyMetrics, CostlyMetricsSchedule
from gspo_megatron.notes import note
from gspo_megatron.optimizer_steps import run_optimizer_steps
from gspo_megatron.ranks import Ranks
from gspo_megatron.rollout.backends import rollout_backend
from gspo_megatron.rollout.base import RolloutEngine, RolloutUnavailableError, WeightSource
from gspo_megatron.run_health import RunHealth
from gspo_megatron.spec.loss import LossSettings
from gspo_megatron.stability import (
    BudgetAction,
    Firing,
    RollbackRecord,
    Rollbacks,
    StabilityError,
    StabilityMonitor,
)
from gspo_megatron.step_inputs import StepInputs, StepInputSettings


class Trainer:
    """Owns the loop. Everything it talks to comes in as an object, so the loop runs the same
    with megatron engines and real processes (components.build_trainer) or with fakes:

    engine / reference: `train_step`, `forward`, `layout.dp`, `model_config`, `current_lr()`,
        `set_lr_scale()`, `close()`, and `offload` / `reload` with
        trainer.offload_during_rollout (gspo_megatron.megatron.training_engine.TrainingEngine).
    critic: PPO's value model with algorithm.advantage=gae (`forward` -> values,
        `train_value_step`, `close`, `offload` / `reload`); saved with the policy.
    rollout, weight_source: the rollout engine (rollout/base.py) and what it syncs weights
        from; with scorer, tokenizer, train_data and reward_model (a learned reward model,
        `score(prompts, responses)` on every rank) they make the `collector` (collector.py).
    benchmarks: what `evaluate` runs (evaluation/benchmarks.py: build_benchmarks).
    ranks: this rank, rank 0's objects and votes (gspo_megatron.ranks).
    log: metrics sink (run_files.MetricsLogger: write, write_records, rewind, summary, close).
    checkpoints: checkpoint store (run_files.RunCheckpoints: save, resume, read_file; for
        rollbacks rollbacks, save_rollbacks, rollback_target, roll_back).
    watchdog: start/stop around the loop (peers.PeerWatchdog).
    exporter: with trainer.export_hf_every, what writes a checkpoint's Hugging Face export
        (megatron/hf_export.py, HFExporter: export, present, clear_leftovers).
    """

    def __init__(
        self,
        cfg: RunConfig,
        *,
        engine,
        rollout: RolloutEngine,
        scorer,
        tokenizer,
        train_data,
        benchmarks: Sequence[Benchmark],
        ranks: Ranks,
        log,
        checkpoints,
        watchdog,
        weight_source: WeightSource | None = None,
        reference=None,
        critic=None,
        reward_model=None,
        exporter=None,
    ) -> None:
        self.cfg = cfg
        self.exporter = exporter
        self.engine, self.reference, self.critic = engine, reference, critic
        self.collector = RolloutCollector.for_run(
            cfg,
            rollout,
            weight_source=weight_source,
            ranks=ranks,
            tokenizer=tokenizer,
            train_data=train_data,
            scorer=scorer,
            reward_model=reward_model,
        )
        self.inputs = StepInputs(
            StepInputSettings.from_config(cfg), engine, reference=reference, critic=critic
        )
        self.loss = LossSettings(
            cfg.algorithm.loss,
            cfg.algorithm.loss_hparams(cfg.rollout.max_new_tokens),
            kl_coef=cfg.algorithm.kl_coef,
            kl_estimator=cfg.algorithm.kl_estimator,
            entropy_coef=cfg.algorithm.entropy_coef,
            max_new_tokens=cfg.rollout.max_new_tokens,
        )
        self.scorer, self.reward_model = scorer, reward_model
        self.benchmarks = list(benchmarks)
        self.ranks, self.log, self.files, self.watchdog = ranks, log, checkpoints, watchdog
        self.health = RunHealth(cfg)
        self.costly_metrics = CostlyMetricsSchedule(cfg)
        self.stability = StabilityMonitor(cfg)
        self.rollbacks = Rollbacks(cfg.stability.sentinel, checkpoints, log)
        self._rolled_back: RollbackRecord | None = None  # marked in the next step's record
        self.step = 0
        self.stop_requested = False
        self._stop_signal: str | None = None  # the signal that asked for it, not yet logged
        self._last_save = time.monotonic()
        self._replaced_handlers: dict[int, object] = {}

    # -- the loop ---------------------------------------------------------------------------

    def train(self) -> dict[str, float]:
        # Put back by close(), not here: a run that fails must still be holding SIGTERM while it
        # prints its error, since torchrun signals the other ranks as soon as one rank exits.
        self._replaced_handlers = self._install_signal_handlers()
        self.resume()
        self.watchdog.start()
        try:
            last = self._loop()
            self.save()
        finally:
            self.watchdog.stop()
        self.log.summary(last)
        return last

    def _loop(self) -> dict[str, float]:
        last: dict[str, float] = {}
        while self.step < self.cfg.trainer.steps and not self.stop_requested:
            started, cpu_started = time.perf_counter(), time.process_time()
            timings: dict[str, float] = {}
            costly = self.costly_metrics.at(self.step + 1)
            batch = self.generate(timings)
            with _timed(timings, "old_logprobs"):
                if batch.groups:
                    self.inputs.add_samples(batch, costly)
            with _timed(timings, "train"):
                train_metrics = self.train_step(batch, costly)
            with _timed(timings, "sync_weights"):
                self.sync_weights()
            self.step += 1
            timings["step"] = time.perf_counter() - started
            timings["step_cpu"] = time.process_time() - cpu_started
            last = self.step_metrics(batch, train_metrics, timings)
            every = self.cfg.eval.every
            if (every and self.step % every == 0) or self.step == self.cfg.trainer.steps:
                try:
                    last.update(self.evaluate())
                except RolloutUnavailableError:
                    self.log.write(self.step, last)  # the step trained: keep its record
                    self.save()
                    raise
            watch = self.stability.observe(self.step, last)
            last.update(watch.metrics | self._rollback_metrics())
            self.log.write(self.step, last)
            verdict = self.health.check(last)
            save_now, self.stop_requested, collapse = self._agree(watch.firing is not None)
            if verdict is not None:
                if verdict.checkpoint_first:
                    self.save()
                raise verdict.error
            if collapse:
                self.roll_back(watch.firing)
                continue
            if watch.budget is not None:
                self.apply_budget(watch.budget)
            if save_now:
                self.save()
        return last

    # -- phases ------------------------------------------------------------------------------

    def generate(self, timings: dict[str, float]) -> RolloutBatch:
        """The step's scored rollouts with their group advantages. With
        trainer.offload_during_rollout the training state leaves the GPU meanwhile (after the
        weight sync: a server engine has the weights before the trainer's copy leaves)."""
        offloaded = self._offloaded_engines()
        moved: dict[str, float] = {}
        if offloaded:
            with _timed(timings, "offload"):
                moved["offload_bytes"] = sum(
                    engine.offload(what, keep_weights=keep).get("offload_bytes", 0.0)
                    for engine, what, keep in offloaded
                )
        sampler_at_start = self.collector.sampler_state()
        try:
            with _timed(timings, "generate"):
                batch = self.collector.collect(self.step)
                if batch.groups:
                    self.inputs.add_advantages(batch)
        except RolloutUnavailableError:
            # The step never happened: checkpoint the state before it (none is needed before
            # the first step: a new start is the same run), then stop.
            self.collector.rewind(sampler_at_start)
            if self.step > 0:
                self.save()
            raise
        if offloaded:
            with _timed(timings, "reload"):
                moved["reload_bytes"] = sum(
                    engine.reload().get("reload_bytes", 0.0) for engine, _, _ in offloaded
                )
            batch.stats.update({f"perf/{k}": v for k, v in moved.items()})
        return batch

    def _offloaded_engines(self) -> list[tuple[object, str, bool]]:
        """(engine, what, keep its weights) per engine that trainer.offload_during_rollout moves."""
        what = self.cfg.trainer.offload_during_rollout
        if what == "none":
            return []
        keep = rollout_backend(self.cfg.rollout.engine).keeps_policy_weights
        engines = [(self.engine, what, keep)]
        if self.critic is not None:
            engines.append((self.critic, what, False))
        if what == "all" and self.reference is not None:
            engines.append((self.reference, "all", False))
        return engines

    def train_step(self, batch: RolloutBatch, costly: CostlyMetrics) -> dict[str, float]:
        """algorithm.num_minibatches optimizer steps over the shuffled batch (optimizer_steps.py);
        the critic's first, and only the critic's during critic.warmup_steps; `costly`: the
        metrics beyond the loss this step computes (logging.costly_metrics_every)."""
        alg, critic = self.cfg.algorithm, self.cfg.critic
        self.engine.set_lr_scale(self.rollbacks.lr_scale(self.step + 1))
        if "actor/entropy" in batch.stats:  # measured by the old-policy forward (step_inputs)
            costly = dataclasses.replace(costly, entropy=False)
        return run_optimizer_steps(
            batch.samples,
            self.engine,
            self.loss,
            num_minibatches=alg.num_minibatches,
            shuffle_seed=derive_seed(self.cfg.seed, self.step, 101, self.rollbacks.timeline),
            replay_routes=alg.routing_replay != "off",
            critic=self.critic,
            value_clip=critic.value_clip or None,
            critic_only=self.step < critic.warmup_steps,
            metrics=costly,
        )

    def sync_weights(self) -> None:
        self.collector.update_weights(self.step + 1)

    def evaluate(self) -> dict[str, float]:
        """Every benchmark of the eval section with the current weights
        (evaluation/benchmarks.py): eval/<metric> of the held-out prompts, eval/<name>/<metric>
        of a named benchmark; each problem's responses to eval/step_<N>/<name>.jsonl."""
        out: dict[str, float] = {}
        for bench in self.benchmarks:
            result = run_benchmark(bench, self.collector, self.ranks)
            prefix = "eval/" if bench.name == "heldout" else f"eval/{bench.name}/"
            out.update({prefix + k: v for k, v in result.metrics.items()})
            if self.cfg.eval.save_responses:
                self.log.write_records(self.step, bench.name, result.records)
        # what the rollout engine counted while evaluating belongs to the evaluation, not to the
        # next step's record (which a run resumed before that step would not have)
        out.update({f"eval/{k}": v for k, v in self.collector.fault_metrics().items()})
        return out

    def step_metrics(
        self, batch: RolloutBatch, train: dict[str, float], timings: dict[str, float]
    ) -> dict[str, float]:
        train_tokens = float(sum(s.length for s in batch.samples))
        metrics: dict[str, float] = {
            "perf/rollout_tokens_per_s": batch.stats["response/tokens"]
            / max(timings["generate"], 1e-9),
            "perf/train_tokens_per_s": train_tokens / max(timings["train"], 1e-9),
        }
        if batch.groups and self.critic is None:  # GAE's: advantage/token_abs_mean
            metrics["advantage/abs_mean"] = float(batch.advantages.abs().mean())
        metrics.update({k if "/" in k else f"actor/{k}": v for k, v in train.items()})
        metrics.update({f"time/{k}": v for k, v in timings.items()})
        metrics.update(batch.stats)
        metrics.update(self.collector.fault_metrics())
        return metrics

    # -- checkpoints and signals ---------------------------------------------------------------

    def _companions(self) -> dict[str, object]:
        """Engines checkpointed and resumed with the policy."""
        return {"critic": self.critic} if self.critic is not None else {}

    def save(self) -> None:
        """A checkpoint of this step, with the trainer's state: the data position, the stability
        monitor's state and the run's health when saved (the rollback target's test), how many
        rollbacks the run had then, and the batches generated ahead as far as they got."""
        in_flight, content = self.collector.in_flight()
        state = {
            "step": self.step,
            "sampler": self.collector.sampler_state(),
            "stability": self.stability.state_dict(),
            "health": self.stability.health(),
            "rollbacks": len(self.rollbacks.history),
        }
        extra_files = {}
        if in_flight is not None:
            state["in_flight"] = in_flight
            extra_files[in_flight["file"]] = content
        path = self.files.save(
            self.engine, self.step, state, companions=self._companions(), extra_files=extra_files
        )
        self._last_save = time.monotonic()
        self._export_if_due(path)

    def _export_if_due(self, path) -> None:
        """The checkpoint's Hugging Face export, at trainer.export_hf_every's steps and the last
        one, unless it has one (what an interrupted export left is removed first); a failure
        stops the run only when asked to."""
        every = self.cfg.trainer.export_hf_every
        last = self.step == self.cfg.trainer.steps
        if self.exporter is None or not every or (self.step % every and not last):
            return
        self.exporter.clear_leftovers(path)
        if self.exporter.present(path):
            return
        result = self.exporter.export(self.step, path)
        note(result.message)
        if not result.ok and self.cfg.trainer.export_hf_on_failure == "stop":
            raise ExportFailedError(
                f"{result.message} (trainer.export_hf_on_failure=stop: the run stops here)"
            )

    def resume(self) -> None:
        """Per trainer.resume; a rollback a killed run left half done is completed first."""
        self.rollbacks.load()
        interrupted = self.rollbacks.interrupted()
        if interrupted is not None and self.cfg.trainer.resume == "auto":
            note(f"completing rollback {interrupted.index} ({interrupted.summary()})")
            state = self.rollbacks.finish(
                interrupted, self.engine, self._companions(), validate=True
            )
            self._restore(state, interrupted)
            note(f"resumed at step {self.step}, rolled back")
            return
        if interrupted is not None:
            self.rollbacks.abandon(interrupted, f"trainer.resume={self.cfg.trainer.resume}")
        state = self.files.resume(
            self.engine, self.cfg.trainer.resume, companions=self._companions()
        )
        if state is None:
            # Records of an earlier attempt that left no checkpoint are moved aside, not repeated.
            self.log.rewind(0)
            self.collector.timeline = self.rollbacks.timeline
            note("starting from step 0")
            # Servers start with their launch weights, not necessarily the trainer's.
            self.collector.update_weights(0)
            return
        self._restore(state, self.rollbacks.pending_for(state))
        note(f"resumed at step {self.step}")

    def _restore(self, state: dict, rollback: RollbackRecord | None) -> None:
        """The trainer's side of a loaded checkpoint (resume or rollback). `rollback`: the
        rollback to this checkpoint whose remedy applies from here (its data position when it
        skips the window)."""
        self.step = int(state["step"])
        skip_to = rollback.sampler if rollback is not None else None
        self.collector.rewind(skip_to or state["sampler"])
        self.collector.timeline = self.rollbacks.timeline
        self.stability.load_state_dict(state.get("stability", {}))
        self.apply_budget_state()
        self.health = RunHealth(self.cfg)
        self._rolled_back = rollback
        self.log.rewind(self.step)
        self.collector.update_weights(self.step)
        if rollback is None:
            # After a rollback the run takes another timeline (other seeds, perhaps other data):
            # the batches that were in flight at the checkpoint are not its batches.
            self.collector.restore_in_flight(state.get("in_flight"), self.files.read_file)
        if self.exporter is not None:  # an export a kill interrupted is done now
            self._export_if_due(self.files.resumed)

    # -- stability ----------------------------------------------------------------------------

    def roll_back(self, firing: Firing | None) -> None:
        """The collapse sentinel fired: back to the newest healthy checkpoint saved before its
        signals, with the remedy (stability/rollback.py); the loop goes on from there."""
        firing = self.ranks.broadcast(firing)  # rank 0's, on every rank
        if firing is None:
            raise RuntimeError("the ranks' collapse sentinels disagree: rank 0 saw no firing")
        record = self.rollbacks.start(
            firing, self.engine, self._companions(), self.collector.sampler_state()
        )
        state = self.rollbacks.finish(record, self.engine, self._companions(), validate=False)
        self._restore(state, record)

    def apply_budget(self, action: BudgetAction) -> None:
        """The mismatch budget's remedy (its line is already out)."""
        if action.remedy == "stop":
            self.save()
            raise StabilityError(
                f"{action.message}. A checkpoint of step {self.step} was written "
                "(stability.mismatch_budget.remedy=stop)"
            )
        self.apply_budget_state()

    def apply_budget_state(self) -> None:
        """What the mismatch budget has changed so far (MIS on, the staleness bound), as its
        state says: after a remedy, and after a checkpoint is loaded."""
        budget = self.stability.budget
        remedy = self.cfg.stability.mismatch_budget.remedy
        if remedy == "mis":
            self.inputs.use_mismatch("mis" if budget.mis_on else self.cfg.algorithm.mismatch)
        if remedy == "lower_staleness":
            self.collector.set_max_staleness(budget.max_staleness)

    def _rollback_metrics(self) -> dict[str, float]:
        """stability/rollbacks once there were any, and in the first record after a rollback
        stability/rolled_back_from: the step it fired at (metrics.jsonl says where each
        rollback happened)."""
        out = {}
        if self.rollbacks.history:
            out["stability/rollbacks"] = float(len(self.rollbacks.history))
        if self._rolled_back is not None:
            out["stability/rolled_back_from"] = float(self._rolled_back.fired_at)
            self._rolled_back = None
        return out

    def _install_signal_handlers(self) -> dict[int, object]:
        """SIGTERM and SIGINT ask for a checkpoint and a stop after this step; returns the
        handlers they replace.

        The handler may run in the middle of a write to the run's log (torchrun's SIGTERM
        reaches a failing rank while it logs its traceback), and logging is not reentrant: it
        only sets the flag and tells the terminal with one raw write; the log gets the note when
        the loop acts on it."""
        rank = self.ranks.rank

        def request_stop(signum, frame):
            self.stop_requested = True
            self._stop_signal = signal.Signals(signum).name
            if rank == 0:
                message = (
                    f"[gspo-megatron] signal {self._stop_signal}: checkpointing after this step"
                )
                os.write(2, (message + "\n").encode())

        return {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}

    def _agree(self, collapse: bool) -> tuple[bool, bool, bool]:
        """(save now, stop now, roll back now), the same on every rank: one all-reduce of each
        rank's view.

        A signal reaches some ranks before others, and only wall-clock time decides the
        timed saves, so ranks vote; any rank's yes wins. `collapse`: this rank's collapse
        sentinel fired (every rank's sees the same metrics; the vote makes it one decision).
        """
        if self._stop_signal is not None:
            logging.getLogger("gspo_megatron").info(
                "signal %s: checkpointing after this step", self._stop_signal
            )
            self._stop_signal = None
        t = self.cfg.trainer
        by_steps = t.save_every > 0 and self.step % t.save_every == 0
        by_steps |= t.export_hf_every > 0 and self.step % t.export_hf_every == 0
        by_time = (
            t.save_every_minutes > 0
            and time.monotonic() - self._last_save >= 60 * t.save_every_minutes
        )
        save, stop, collapse = self.ranks.any(
            [by_steps or by_time or self.stop_requested, self.stop_requested, collapse]
        )
        return save and not stop, stop, collapse

    def close(self) -> None:
        # The handlers hold this trainer (and so the model and its process groups): a process
        # that runs several trainings one after another must not keep them all.
        for signum, handler in self._replaced_handlers.items():
            signal.signal(signum, handler)
        self._replaced_handlers = {}
        self.log.close()
        self.scorer.close()
        for bench in self.benchmarks:
            bench.close()
        self.collector.close()
        for part in (self.reward_model, self.engine, self.reference, self.critic):
            if part is not None:
                part.close()


class ExportFailedError(RuntimeError):
    """A checkpoint's Hugging Face export failed and trainer.export_hf_on_failure=stop."""


# -- helpers ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _timed(sink: dict[str, float], key: str):
    """Adds the block's wall-clock seconds to sink[key] (when the block ends, or raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        sink[key] = sink.get(key, 0.0) + time.perf_counter() - start
