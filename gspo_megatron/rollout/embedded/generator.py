"""The embedded engine's asynchronous form: a generator process with its own copy of the policy.

`rollout.mode=one_step_off` or `async` with `rollout.engine=embedded`. Rank 0 starts one process
(spawned: no CUDA state or gloo threads are inherited) that holds the policy's Hugging
Face-named weights and generates with `TorchDecoder` (rollout/embedded/torch_decoder.py)
while the trainer trains. Like a rollout server, it takes its weights from the trainer's
`WeightSource`, so every training layout feeds it; unlike one, the weights cross in shared
memory:

  * `update_weights` streams the source's buckets (a collective on every rank) into a staging
    copy in shared memory on rank 0, under a lock, then publishes the version number;
  * the process copies the staging weights into its own at the start of every job, and, with
    `partial` (async mode), also between any two tokens when a newer version is published: the
    rows' tokens so far are fed again under the new weights and generation goes on (a partial
    rollout; `GenerationBatch`). Each response token records the version that sampled it.

Jobs carry `min_version`: the process starts a job only with weights at least that new (the
staleness bound; it waits for them otherwise), evaluation jobs go before queued training jobs,
and each result reports how long the process waited for jobs and for weights.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gspo_megatron.rollout.base import (
    JobStats,
    RolloutSample,
    RolloutUnavailableError,
    SamplingParams,
    WeightSource,
)
from gspo_megatron.rollout.embedded.batching import GenerationBatch, make_sequences, plan_batches
from gspo_megatron.rollout.embedded.sampling import sequence_seed
from gspo_megatron.rollout.embedded.torch_decoder import (
    DecoderSpec,
    TorchDecoder,
    hf_decoder_weights,
)
from gspo_megatron.spec.model_config import ModelConfig

logger = logging.getLogger(__name__)

_BUCKET_BYTES = 256 << 20
_POLL_S = 0.005  # how often a waiting process looks for new weights


class GeneratorProcessError(RolloutUnavailableError):
    """The generator process died or failed a job; the message says which and why."""


@dataclass(frozen=True)
class GeneratorSettings:
    model: ModelConfig
    spec: DecoderSpec
    max_batch_tokens: int
    max_sequence_length: int
    record_routes: bool
    route_shape: tuple[int, int]  # (layers, top-k) of recorded routes
    partial: bool  # take new weights between tokens (async); else only between jobs
    seed: int  # for calls without SamplingParams.seed
    device: str = "cpu"
    threads: int = 1


@dataclass(frozen=True)
class _Job:
    job_id: int
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    min_version: int
    urgent: bool


class GeneratorProcessEngine:
    """A `ServerRolloutEngine` whose generation runs in a process of its own, on rank 0.

    `weights` names every tensor the source streams, with its shape and dtype; `rope_table`
    holds the trainer's RoPE angles [max positions, head dim]. Every rank builds one (the
    weight source's gathers are collective); only `leader` starts the process.
    """

    generates_on_every_rank = False
    resync_poll_s = 1.0

    def __init__(
        self,
        settings: GeneratorSettings,
        weights: dict[str, tuple[tuple[int, ...], torch.dtype]],
        rope_table: torch.Tensor,
        *,
        leader: bool,
    ) -> None:
        self.settings = settings
        self.leader = leader
        self.version = -1
        self._ids = itertools.count()
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._lock_futures = threading.Lock()
        self._closed = False
        if not leader:
            return
        ctx = torch.multiprocessing.get_context("spawn")
        self._staging = {
            name: torch.zeros(shape, dtype=dtype).share_memory_()
            for name, (shape, dtype) in weights.items()
        }
        self._lock = ctx.Lock()
        self._published = ctx.Value("q", -1)
        self._jobs = ctx.Queue()
        self._results = ctx.Queue()
        self._process = ctx.Process(
            target=_generator_main,
            args=(
                settings,
                self._staging,
                rope_table.float().clone(),
                self._lock,
                self._published,
                self._jobs,
                self._results,
                os.getpid(),
            ),
            name="gspo-generator",
            daemon=True,
        )
        self._process.start()
        self._reader = threading.Thread(target=self._read_results, name="generator-results")
        self._reader.daemon = True
        self._reader.start()

    # -- ServerRolloutEngine ----------------------------------------------------------------

    def start_generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        params: SamplingParams,
        *,
        min_version: int | None = None,
        urgent: bool = False,
    ) -> concurrent.futures.Future:
        """Queue a job; its future gives the samples grouped per prompt, and then holds the
        job's `JobStats` as `job_stats`.

        The process starts it with weights of version >= `min_version` (default: the version
        published last); `urgent` jobs go before queued ones.
        """
        if not self.leader:
            raise RuntimeError("the generator process is driven by rank 0 only")
        if self._closed:
            raise GeneratorProcessError("generate() on a closed generator process")
        job = _Job(
            job_id=next(self._ids),
            prompts=[[int(t) for t in p] for p in prompts],
            n=n,
            params=params,
            min_version=self.version if min_version is None else min_version,
            urgent=urgent,
        )
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock_futures:
            self._futures[job.job_id] = future
        self._jobs.put(job)
        return future

    def generate(
        self, prompts: Sequence[Sequence[int]], n: int, params: SamplingParams
    ) -> list[list[RolloutSample]]:
        return self.start_generate(prompts, n, params).result()

    def servers_to_resync(self) -> list[str]:
        return []  # one process, fed through shared memory: nothing goes stale

    def update_weights(
        self, source: WeightSource | None, version: int, urls: Sequence[str] | None = None
    ) -> None:
        """Stream the source's weights into the shared staging copy (every rank iterates the
        buckets), then publish `version` to the process."""
        if source is None:
            raise ValueError("the generator process needs a weight source")
        if not self.leader:
            for _ in source.buckets(_BUCKET_BYTES):
                pass
            self.version = version
            return
        with self._lock:
            seen = set()
            for bucket in source.buckets(_BUCKET_BYTES):
                for name, tensor in bucket:
                    target = self._staging.get(name)
                    if target is None or target.shape != tensor.shape:
                        raise ValueError(
                            f"weight {name} {list(tensor.shape)} does not match the generator "
                            "process's copy of the policy"
                        )
                    target.copy_(tensor)
                    seen.add(name)
            missing = sorted(set(self._staging) - seen)
            if missing:
                raise ValueError(f"the weight source sent no {missing[0]} ({len(missing)} missing)")
            self._published.value = version
        self.version = version

    def fault_metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.leader:
            return
        # Jobs in flight are abandoned: the process holds nothing worth waiting for.
        self._jobs.put(None)
        self._process.join(timeout=2)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._fail_pending("the generator process was closed")
        self._reader.join(timeout=5)
        for q in (self._jobs, self._results):
            q.cancel_join_thread()  # nobody reads what is left
            q.close()

    # -- internals --------------------------------------------------------------------------

    def _read_results(self) -> None:
        while True:
            try:
                item = self._results.get(timeout=0.5)
            except queue.Empty:
                if self._closed:
                    return
                if not self._process.is_alive():
                    self._fail_pending(
                        f"the generator process exited (code {self._process.exitcode})"
                    )
                    return
                continue
            except (EOFError, OSError) as err:
                self._fail_pending(f"the generator process's result queue broke ({err})")
                return
            job_id, samples, stats, error = item
            with self._lock_futures:
                future = self._futures.pop(job_id, None)
            if future is None:
                continue
            if error is not None:
                line, trace = error
                logger.error("the generator process failed a job:\n%s", trace)
                future.set_exception(GeneratorProcessError(f"the generator process failed: {line}"))
            else:
                future.job_stats = stats
                future.set_result(samples)

    def _fail_pending(self, reason: str) -> None:
        with self._lock_futures:
            pending, self._futures = self._futures, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(GeneratorProcessError(reason))


# -- the process ------------------------------------------------------------------------------


class ProcessGenerator:
    """The `Generator` (batching.py) inside the process: its own weights, refreshed from the
    shared staging copy."""

    tracks_versions = True

    def __init__(
        self,
        settings: GeneratorSettings,
        staging,
        rope_table,
        lock,
        published,
        parent: int | None = None,
    ) -> None:
        self.settings = settings
        self.parent = parent  # the trainer's pid: generation stops when it is gone
        self.device = torch.device(settings.device)
        self.record_routes = settings.record_routes
        self.route_shape = settings.route_shape
        self.staging, self.lock, self.published = staging, lock, published
        self.rope_table = rope_table.to(self.device)
        self.own = {name: torch.empty_like(t, device=self.device) for name, t in staging.items()}
        self.weight_version = -1
        self.weights = None
        self.decoder = TorchDecoder(settings.spec, lambda: self.weights, settings.record_routes)
        self.swaps = 0

    def take_weights(self) -> bool:
        """Copy the published weights if they are newer than ours; True when they were."""
        if self.published.value <= self.weight_version:
            return False
        with self.lock:
            version = self.published.value
            for name, tensor in self.staging.items():
                self.own[name].copy_(tensor)
        self.weight_version = version
        self.weights = hf_decoder_weights(
            self.own, self.settings.model, self.settings.spec, self.rope_table
        )
        return True

    def refresh_weights(self) -> bool:
        if self.parent is not None and os.getppid() != self.parent:
            raise SystemExit(0)  # the trainer is gone (killed): so is everything generated
        if not self.settings.partial or not self.take_weights():
            return False
        self.swaps += 1
        return True

    def run(self, job: _Job) -> list[list[RolloutSample]]:
        s = self.settings
        seqs = make_sequences(
            job.prompts,
            job.n,
            job.params,
            vocab_size=s.spec.vocab_size,
            max_sequence_length=s.max_sequence_length,
        )
        seed = job.params.seed
        if seed is None:
            seed = sequence_seed(s.seed, job.job_id)
        results: dict[int, RolloutSample] = {}
        with torch.no_grad():
            for chunk in plan_batches(seqs, s.max_batch_tokens):
                batch = GenerationBatch(self, chunk, job.params, seed)
                for _ in batch.run():
                    pass
                results.update(batch.results)
        return [[results[p * job.n + j] for j in range(job.n)] for p in range(len(job.prompts))]


def _generator_main(settings, staging, rope_table, lock, published, jobs, results, parent):
    torch.set_num_threads(settings.threads)
    if settings.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(settings.device))
    generator = ProcessGenerator(settings, staging, rope_table, lock, published, parent)
    pending: list[_Job] = []
    idle_s = weights_wait_s = 0.0
    while True:
        # Take what has arrived; block (briefly) only when there is nothing to do.
        since = time.monotonic()
        try:
            while True:
                job = jobs.get(timeout=0.5) if not pending else jobs.get_nowait()
                if job is None:
                    return
                pending.append(job)
        except queue.Empty:
            pass
        if os.getppid() != parent:
            return  # the trainer is gone
        if not pending:
            idle_s += time.monotonic() - since
            continue
        # Urgent jobs first, then submission order; the next job waits for its weights
        # (the staleness bound) while newly arrived urgent ones may still overtake it.
        job = min(pending, key=lambda j: (not j.urgent, j.job_id))
        if published.value < max(job.min_version, 0):
            time.sleep(_POLL_S)
            weights_wait_s += time.monotonic() - since
            continue
        pending.remove(job)
        generator.take_weights()
        stats = JobStats(idle_s=idle_s, weights_wait_s=weights_wait_s)
        idle_s = weights_wait_s = 0.0
        generator.swaps = 0
        started = time.monotonic()
        try:
            samples = generator.run(job)
        except Exception as err:  # noqa: BLE001 - reported to the trainer with its traceback
            results.put(
                (job.job_id, None, None, (f"{type(err).__name__}: {err}", traceback.format_exc()))
            )
            continue
        stats.generate_s = time.monotonic() - started
        stats.weight_swaps = generator.swaps
        results.put((job.job_id, samples, stats, None))
