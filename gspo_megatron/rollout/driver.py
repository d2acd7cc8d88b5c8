"""Rollout calls on every trainer rank.

An engine that generates collectively (the embedded engine: every rank holds a piece of the
model) is called on every rank. An engine that generates outside the trainer (SGLang servers,
the generator process of rollout.mode one_step_off / async) is driven by rank 0 alone, which
shares the samples, so every rank trains on the same samples and one rank decides about faults.
`submit` and `collect` split a call, so that a batch generates while the trainer trains.
While it waits, rank 0 tells the others, every `resync_poll_s`, whether stale servers (restarted,
or fenced by a failed update) are due for the weights: a weight update needs the weight source's
collectives on every rank. See docs/SGLANG.md, "Failures".
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gspo_megatron.ranks import Ranks
from gspo_megatron.rollout.base import (
    InProcessRolloutEngine,
    JobProgress,
    JobStats,
    RolloutSample,
    RolloutUnavailableError,
    SamplingParams,
    ServerRolloutEngine,
    WeightsNotLoadedError,
    WeightSource,
)

logger = logging.getLogger(__name__)


class RolloutFailedOnRankZero(RuntimeError):
    """Rank 0's rollout call failed; the other ranks stop with its message."""


@dataclass(frozen=True)
class Submitted:
    """A generate call started on rank 0 (`job`, None elsewhere), or the error that stopped it."""

    job: concurrent.futures.Future | None
    error: BaseException | None = None


class RolloutDriver:
    """A rollout engine of either kind (rollout/base.py), called on every rank."""

    def __init__(
        self,
        engine: InProcessRolloutEngine | ServerRolloutEngine,
        ranks: Ranks,
        source: WeightSource | None,
    ) -> None:
        self.engine = engine
        self.ranks = ranks
        self.source = source
        self.version = 0
        self._collective = engine.generates_on_every_rank

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        min_version: int | None = None,
        urgent: bool = False,
    ) -> list[list[RolloutSample]]:
        """`n` samples per prompt on every rank; `min_version` and `urgent` are a server
        engine's (`ServerRolloutEngine.start_generate`: an in-process engine generates with
        the current weights, at once)."""
        if self._collective:
            return self.engine.generate(prompts, n, params)
        return self.collect(self.submit(prompts, n, params, min_version=min_version, urgent=urgent))

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        min_version: int | None = None,
        urgent: bool = False,
        progress: JobProgress | None = None,
    ) -> Submitted:
        """Start a generate job of a server engine on rank 0 (every rank calls this);
        `collect` waits for it. `progress` (rank 0's; a checkpoint's): continue those samples;
        a job whose samples are all complete is not sent to the engine."""
        # Stale servers that answer get the weights first, so they take part from the start.
        due = self.ranks.broadcast(
            self.engine.servers_to_resync() if self.ranks.rank == 0 else None
        )
        error = self._resync(due) if due else None
        job = None
        if self.ranks.rank == 0 and error is None:
            try:
                if progress is not None and progress.complete:
                    job = concurrent.futures.Future()
                    job.job_stats = JobStats()  # type: ignore[attr-defined]
                    job.set_result(progress.samples)
                else:
                    job = self.engine.start_generate(
                        prompts, n, params, min_version=min_version, urgent=urgent,
                        progress=progress,
                    )  # fmt: skip
            except Exception as e:  # noqa: BLE001 - shared with the other ranks by collect
                error = e
        return Submitted(job, error)

    def snapshot(self, submitted: Sequence[Submitted]) -> list[JobProgress] | None:
        """The progress of submitted calls (rank 0's; None on the others), for a checkpoint.
        Collective: a failure on rank 0 raises on every rank."""
        progress, message = None, None
        if self.ranks.rank == 0:
            try:
                failed = next((s.error for s in submitted if s.error is not None), None)
                if failed is not None:
                    raise failed
                # a job done keeps its result (one restored complete never ran at all)
                done = [s.job.done() for s in submitted]
                running = [s.job for s, d in zip(submitted, done, strict=True) if not d]
                asked = iter(self.engine.snapshot(running) if running else [])
                progress = [
                    JobProgress.finished(s.job.result()) if d else next(asked)
                    for s, d in zip(submitted, done, strict=True)
                ]
            except Exception as e:  # noqa: BLE001 - shared with the other ranks
                message = f"{type(e).__name__}: {e}"
        message = self.ranks.broadcast(message)
        if message is not None:
            raise RolloutFailedOnRankZero(
                f"rank 0 could not record the rollouts in flight for a checkpoint: {message}"
            )
        return progress

    def collect(self, submitted: Submitted) -> list[list[RolloutSample]]:
        """The samples of a submitted call, on every rank."""
        job, error = submitted.job, submitted.error
        self._error: BaseException | None = None
        while True:
            event = self._next_event(job, error) if self.ranks.rank == 0 else None
            kind, payload = self.ranks.broadcast(event)
            if kind == "done":
                return payload
            if kind == "failed":
                self._raise(*payload)
            if kind == "resync":
                error = self._resync(payload)

    def _next_event(
        self, job: concurrent.futures.Future | None, error: BaseException | None
    ) -> tuple[str, Any]:
        if error is None and job is not None:
            try:
                return "done", job.result(timeout=self.engine.resync_poll_s)
            except concurrent.futures.TimeoutError:
                pass
            except Exception as e:  # noqa: BLE001 - shared with the other ranks
                error = e
        if error is not None:
            if job is not None and not job.done():
                job.cancel()
            self._error = error
            return "failed", (isinstance(error, RolloutUnavailableError), str(error))
        due = self.engine.servers_to_resync()
        return ("resync", due) if due else ("wait", None)

    def _raise(self, unavailable: bool, message: str):
        if self._error is not None:  # rank 0: the error itself, with its traceback
            raise self._error
        if unavailable:
            raise RolloutUnavailableError(message)
        raise RolloutFailedOnRankZero(f"rank 0's rollout failed: {message}")

    def _resync(self, urls: list[str]) -> BaseException | None:
        """A full weight update of `urls` on every rank, while rank 0's generation goes on."""
        try:
            self.engine.update_weights(self.source, self.version, urls=urls)
        except WeightsNotLoadedError as e:
            logger.warning("re-sync of %s failed (retried later): %s", ", ".join(urls), e)
        except Exception as e:  # noqa: BLE001 - rank 0 reports it at its next event
            if self.ranks.rank != 0:  # rank 0's own error reaches the log when it is raised
                logger.exception("re-sync of %s failed on this rank", ", ".join(urls))
            return e
        return None

    def update_weights(self, version: int) -> None:
        """The policy's weights to the engine as `version`, on every rank. Servers that fail are
        fenced and re-synced before they generate; anything else stops every rank."""
        self.version = version
        if self._collective:
            self.engine.update_weights(self.source, version)
            return
        message = None
        try:
            self.engine.update_weights(self.source, version)
        except WeightsNotLoadedError as e:
            logger.warning("%s (re-synced before they generate)", e)
        except Exception as e:
            message = str(e)
            if self.ranks.rank == 0:
                self.ranks.broadcast(message)
            raise
        message = self.ranks.broadcast(message)
        if message is not None:
            raise RolloutFailedOnRankZero(f"rank 0's weight update failed: {message}")

    def fault_metrics(self) -> dict[str, float]:
        """The engine's counts since the last call, as rollout/* metrics: a server engine's
        faults (rank 0's), an in-process engine's (the context the embedded engine kept)."""
        if self._collective:
            return self.engine.metrics()
        return self.engine.fault_metrics()

    def release_kept_context(self) -> None:
        """The step's rollouts are over: an in-process engine frees what it kept between calls
        before the trainer needs the memory."""
        if self._collective:
            self.engine.release_kept_context()
