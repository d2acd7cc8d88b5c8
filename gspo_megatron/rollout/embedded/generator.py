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

A LoRA policy (`lora_scaling` set) sends its frozen base weights with the first update only and
its adapters (PEFT-named, megatron/lora_sync.py) with every one; the process merges them,
base + alpha/r * B @ A, each time it takes new weights, so the decoder runs the adapted policy
at the base's cost per token (docs/LORA.md, "Weight sync").

With `prefix_cache_tokens` (rollout.prefix_cache_tokens) the process keeps the K/V of finished
sequences between jobs (rollout/embedded/prefix_cache.py), so an episode's next turn, a job of its
own, prefills only the tokens its context adds; it drops them all as it takes new weights.
Each job's counts go to the trainer ahead of its result (`fault_metrics`: rollout/prefix_cache_*).

Jobs carry `min_version`: the process starts a job only with weights at least that new (the
staleness bound; it waits for them otherwise, while jobs whose weights are there go ahead of
it), evaluation jobs go before queued training jobs, then the oldest batch's jobs, and each
result reports how long the process waited for jobs and for weights.

Without `partial` (one_step_off, and async with rollout.pin_versions) a job is *pinned*: it is
sampled by exactly one version, the newest published when it was submitted (or its
`min_version`, if newer; or, submitted by another thread while an update writes the staging
copy, the version being written). The trainer's next weight update waits until every job pinned
to an older version has started (taken its weights), so the version it needs is still in the
staging copy: which weights sample which batch does not depend on timing, and a run is
deterministic.

A checkpoint asks for a snapshot (`snapshot`): the process answers between two tokens (with
`partial`; the job running is suspended, its rows' tokens so far recorded, and it goes on as a
continuation of that record) or between two jobs (pinned: the job running finishes first, since
a resumed run no longer has its weights), with the progress of every job it holds. A job given
`progress` continues it: finished samples are kept, partial ones go on from their tokens.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gspo_megatron.checkpoint.lora_mapping import LORA_A, LORA_B, adapted_weights, merge_adapters
from gspo_megatron.rollout.base import (
    JobProgress,
    JobStats,
    RolloutSample,
    RolloutUnavailableError,
    SamplingParams,
    WeightSource,
)
from gspo_megatron.rollout.embedded.batching import GenerationBatch, make_sequences, plan_batches
from gspo_megatron.rollout.embedded.prefix_cache import (
    PrefixCache,
    PrefixCacheCounts,
    prefix_cache_metrics,
)
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
    # take new weights between tokens (async); else each job is pinned to one version
    partial: bool
    seed: int  # for calls without SamplingParams.seed
    device: str = "cpu"
    threads: int = 1
    # a LoRA policy's alpha / rank: the process merges the adapters it is sent (None: no LoRA)
    lora_scaling: float | None = None
    # a LoRA policy's whole weights trained beside the adapters (HF names): with every update
    lora_trained: tuple[str, ...] = ()
    # context kept between jobs (rollout.prefix_cache_tokens; 0: none), dropped by new weights
    prefix_cache_tokens: int = 0


@dataclass(frozen=True)
class _Job:
    job_id: int
    prompts: list[list[int]]
    n: int
    params: SamplingParams
    min_version: int
    urgent: bool
    pinned: int | None = None  # the one version that samples it (without `partial`)
    progress: JobProgress | None = None  # what to continue (a checkpoint's, or a suspension's)
    stats: JobStats | None = None  # what it cost before a suspension


@dataclass(frozen=True)
class _Snapshot:
    """A checkpoint's request: the progress of every job the process holds."""

    snapshot_id: int


class _Suspended(Exception):
    """Raised between two tokens when a snapshot is due (partial rollouts only)."""


class GeneratorProcessEngine:
    """A `ServerRolloutEngine` whose generation runs in a process of its own, on rank 0.

    `weights` names every tensor the source streams, with its shape and dtype (a LoRA policy's:
    the base's and the adapters', `LoRAWeightSource`); `rope_table` holds the trainer's RoPE
    angles [max positions, head dim]. Every rank builds one (the
    weight source's gathers are collective); only `leader` starts the process.
    """

    generates_on_every_rank = False
    resync_poll_s = 1.0
    # Jobs run one after the other: an episode batch (rollout/episodes.py) sends the turns that
    # become due while a job runs as one next job, not as many small ones.
    runs_one_job_at_a_time = True

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
        self._snapshot_ids = itertools.count(1)
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._snapshots: dict[int, concurrent.futures.Future] = {}
        # pinned jobs not started yet: job id -> version (a weight update waits for them)
        self._unstarted: dict[int, int] = {}
        # the version a pinned job submitted now is sampled by: the newest published, or the
        # one a weight update is writing (episode threads submit jobs while it runs)
        self._pin_version = -1
        self._changed = threading.Condition()  # guards the three dicts and _pin_version
        self._closed = False
        self._gone: str | None = None  # why the process can generate nothing more
        self._base_sent = False  # a LoRA policy's base weights went with an update
        # the process's prefix-cache counts since `fault_metrics` last took them, and what it
        # held after its last job
        self._cache_counts = PrefixCacheCounts()
        self._cache_held = 0
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
        self._snapshot_wanted = ctx.Value("q", 0)
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
                self._snapshot_wanted,
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
        progress: JobProgress | None = None,
    ) -> concurrent.futures.Future:
        """Queue a job; its future gives the samples grouped per prompt, and then holds the
        job's `JobStats` as `job_stats`.

        The process starts it with weights of version >= `min_version` (default: the version
        published last); pinned (without partial rollouts), with exactly the newest version
        published now, or `min_version` if newer. `urgent` jobs go before queued ones.
        `progress`: continue its samples (a checkpoint's record).
        """
        if not self.leader:
            raise RuntimeError("the generator process is driven by rank 0 only")
        if self._closed or self._gone:
            raise GeneratorProcessError(self._gone or "generate() on a closed generator process")
        floor = self.version if min_version is None else min_version
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._changed:  # pinned against a weight update of another thread (below)
            job = _Job(
                job_id=next(self._ids),
                prompts=[[int(t) for t in p] for p in prompts],
                n=n,
                params=params,
                min_version=floor,
                urgent=urgent,
                pinned=None if self.settings.partial else max(self._pin_version, floor),
                progress=progress,
            )
            future.job_id = job.job_id  # type: ignore[attr-defined]
            self._futures[job.job_id] = future
            if job.pinned is not None:
                self._unstarted[job.job_id] = job.pinned
        self._jobs.put(job)
        return future

    def snapshot(self, jobs: Sequence[concurrent.futures.Future]) -> list[JobProgress]:
        """The progress of `jobs` (this engine's futures), for a checkpoint: answered by the
        process between two tokens (partial rollouts: the job running goes on from the record)
        or, pinned, once the job running has finished (see the module's docstring)."""
        if not self.leader:
            raise RuntimeError("the generator process is driven by rank 0 only")
        snapshot_id = next(self._snapshot_ids)
        answer: concurrent.futures.Future = concurrent.futures.Future()
        with self._changed:
            if self._closed or self._gone:
                raise GeneratorProcessError(self._gone or "snapshot() of a closed process")
            self._snapshots[snapshot_id] = answer
        self._jobs.put(_Snapshot(snapshot_id))
        self._snapshot_wanted.value = snapshot_id  # interrupts a job between two tokens
        held = answer.result()
        out = []
        for job in jobs:
            if job.done():
                out.append(JobProgress.finished(job.result()))
            elif job.job_id in held:
                out.append(held[job.job_id])
            else:
                raise GeneratorProcessError(
                    f"the generator process does not hold job {job.job_id} it was given"
                )
        return out

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
        buckets), then publish `version` to the process. A LoRA policy's source
        (`settings.lora_scaling`; a `LoRAWeightSource`) streams its base with the first update
        and its adapters (and whole weights trained beside them) with each."""
        if source is None:
            raise ValueError("the generator process needs a weight source")
        lora = self.settings.lora_scaling is not None
        streams = [source]
        if lora:
            streams = source.updates() if self._base_sent else [source.base, *source.updates()]
        if not self.leader:
            for stream in streams:
                for _ in stream.buckets(_BUCKET_BYTES):
                    pass
            self._base_sent = lora
            self.version = version
            return
        self._wait_for_pinned_jobs(version)
        with self._lock:
            seen = set()
            for stream in streams:
                for bucket in stream.buckets(_BUCKET_BYTES):
                    for name, tensor in bucket:
                        target = self._staging.get(name)
                        if target is None or target.shape != tensor.shape:
                            raise ValueError(
                                f"weight {name} {list(tensor.shape)} does not match the "
                                "generator process's copy of the policy"
                            )
                        target.copy_(tensor)
                        seen.add(name)
            expected = set(self._staging)
            if self._base_sent:
                expected = {n for n in expected if n.endswith((LORA_A, LORA_B))}
                expected.update(self.settings.lora_trained)
            missing = sorted(expected - seen)
            if missing:
                raise ValueError(f"the weight source sent no {missing[0]} ({len(missing)} missing)")
            self._published.value = version
        self._base_sent = lora
        self.version = version

    def fault_metrics(self) -> dict[str, float]:
        """rollout/prefix_cache_* counts of the jobs finished since the last call (the context
        the process keeps between jobs; none without rollout.prefix_cache_tokens; rank 0's)."""
        if not self.settings.prefix_cache_tokens:
            return {}
        with self._changed:
            counts, self._cache_counts = self._cache_counts, PrefixCacheCounts()
            held = self._cache_held
        return prefix_cache_metrics(counts, held)

    def _wait_for_pinned_jobs(self, version: int) -> None:
        """Pinned jobs of versions older than `version` take their weights from the staging
        copy before it is overwritten; from then on, jobs are pinned to `version` (a job
        submitted by another thread while the copy is overwritten waits for it to be
        published, instead of being pinned to weights no longer there)."""
        with self._changed:
            while any(v < version for v in self._unstarted.values()):
                if self._closed:
                    return
                self._changed.wait(timeout=1.0)
            self._pin_version = version

    def close(self) -> None:
        if self._closed:
            return
        with self._changed:
            self._closed = True
            self._changed.notify_all()
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
            kind, key, *payload = item
            if kind == "cache":
                with self._changed:
                    self._cache_counts.add(payload[0])
                    self._cache_held = payload[1]
                continue
            if kind == "started":
                with self._changed:
                    self._unstarted.pop(key, None)
                    self._changed.notify_all()
                continue
            if kind == "snapshot":
                with self._changed:
                    answer = self._snapshots.pop(key, None)
                if answer is not None:
                    answer.set_result(payload[0])
                continue
            samples, stats, error = payload
            with self._changed:
                future = self._futures.pop(key, None)
                self._unstarted.pop(key, None)
                self._changed.notify_all()
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
        with self._changed:
            pending = [*self._futures.values(), *self._snapshots.values()]
            self._futures, self._snapshots, self._unstarted = {}, {}, {}
            self._gone = reason
            self._changed.notify_all()
        for future in pending:
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
        snapshot_wanted=None,
    ) -> None:
        self.settings = settings
        self.parent = parent  # the trainer's pid: generation stops when it is gone
        self.device = torch.device(settings.device)
        self.record_routes = settings.record_routes
        self.route_shape = settings.route_shape
        self.staging, self.lock, self.published = staging, lock, published
        self.rope_table = rope_table.to(self.device)
        self.own = {name: torch.empty_like(t, device=self.device) for name, t in staging.items()}
        # a LoRA policy's: its adapters' names, and the merged weights the decoder reads
        self.adapter_names = [n for n in staging if n.endswith((LORA_A, LORA_B))]
        self.updated_names = [*self.adapter_names, *settings.lora_trained]
        self.merged = {n: torch.empty_like(self.own[n]) for n in adapted_weights(self.own)}
        self.weight_version = -1
        self.weights = None
        self.decoder = TorchDecoder(settings.spec, lambda: self.weights, settings.record_routes)
        tokens = settings.prefix_cache_tokens
        self.prefix_cache = PrefixCache(tokens) if tokens else None
        self.swaps = 0
        self.sampled = 0  # tokens sampled by the job running
        # the last snapshot the trainer asked for (a shared counter) and the last one answered
        self.snapshot_wanted = snapshot_wanted
        self.snapshots_answered = 0

    def take_weights(self) -> bool:
        """Copy the published weights if they are newer than ours; True when they were."""
        if self.published.value <= self.weight_version:
            return False
        lora = self.settings.lora_scaling is not None
        # a LoRA policy's base is published once, with the first version: later, the adapters
        # and the whole weights trained beside them only
        names = self.updated_names if lora and self.weight_version >= 0 else self.staging
        with self.lock:
            version = self.published.value
            for name in names:
                self.own[name].copy_(self.staging[name])
        self.weight_version = version
        weights = self.own
        if lora:
            weights = merge_adapters(
                self.own,
                {n: self.own[n] for n in self.adapter_names},
                self.settings.lora_scaling,
                out=self.merged,
            )
        self.weights = hf_decoder_weights(
            weights, self.settings.model, self.settings.spec, self.rope_table
        )
        if self.prefix_cache is not None:
            self.prefix_cache.invalidate()  # K/V of older weights: never reused, freed now
        return True

    def take_cache_counts(self) -> tuple[PrefixCacheCounts, int] | None:
        """A job is over: the prefix cache's counts since the last job, and the tokens it
        holds (None without a cache)."""
        cache = self.prefix_cache
        if cache is None:
            return None
        cache.end_call()
        return cache.take_counts(), cache.held_tokens

    def snapshot_due(self) -> bool:
        wanted = self.snapshot_wanted
        return wanted is not None and wanted.value > self.snapshots_answered

    def refresh_weights(self) -> bool:
        if self.parent is not None and os.getppid() != self.parent:
            raise SystemExit(0)  # the trainer is gone (killed): so is everything generated
        if not self.settings.partial:
            return False  # pinned: the job keeps its version; a snapshot waits for it to end
        if self.snapshot_due():
            raise _Suspended
        if not self.take_weights():
            return False
        self.swaps += 1
        return True

    def run(self, job: _Job) -> tuple[list[list[RolloutSample]] | None, JobProgress | None]:
        """(the samples, None), or (None, the job's progress) when a snapshot suspended it."""
        s = self.settings
        done: dict[int, RolloutSample] = {}
        prefixes: dict[int, RolloutSample] = {}
        if job.progress is not None:
            pairs = zip(job.progress.samples, job.progress.done, strict=True)
            for p, (group, flags) in enumerate(pairs):
                for j, (sample, complete) in enumerate(zip(group, flags, strict=True)):
                    key = p * job.n + j
                    if complete:
                        done[key] = sample
                    elif sample.response_ids:
                        prefixes[key] = sample
        seqs = make_sequences(
            job.prompts,
            job.n,
            job.params,
            vocab_size=s.spec.vocab_size,
            max_sequence_length=s.max_sequence_length,
            prefixes=prefixes,
        )
        seed = job.params.seed
        if seed is None:
            seed = sequence_seed(s.seed, job.job_id)
        results = dict(done)
        chunks = plan_batches([q for q in seqs if q.key not in done], s.max_batch_tokens)
        batch = None
        try:
            with torch.no_grad():
                for chunk in chunks:
                    batch = GenerationBatch(self, chunk, job.params, seed)
                    for _ in batch.run():
                        pass
                    results.update(batch.results)
                    self.sampled += int(batch.sampled)
        except _Suspended:
            self.sampled += int(batch.sampled)
            results.update(batch.results)
            partial = batch.partial()
            progress = JobProgress.empty(job.prompts, job.n)
            for p in range(len(job.prompts)):
                for j in range(job.n):
                    key = p * job.n + j
                    sample = results.get(key) or partial.get(key) or prefixes.get(key)
                    if sample is not None:
                        progress.samples[p][j] = sample
                        progress.done[p][j] = key in results
            return None, progress
        return [
            [results[p * job.n + j] for j in range(job.n)] for p in range(len(job.prompts))
        ], None


def _generator_main(
    settings, staging, rope_table, lock, published, jobs, results, parent, snapshot_wanted
):
    torch.set_num_threads(settings.threads)
    if settings.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(settings.device))
    generator = ProcessGenerator(
        settings, staging, rope_table, lock, published, parent, snapshot_wanted
    )
    pending: list[_Job] = []
    idle_s = weights_wait_s = 0.0
    while True:
        # Take what has arrived; block (briefly) only when there is nothing to do, or when a
        # snapshot is due (its request follows the jobs submitted before it).
        since = time.monotonic()
        try:
            while True:
                block = not pending or generator.snapshot_due()
                item = jobs.get(timeout=0.5) if block else jobs.get_nowait()
                if item is None:
                    return
                if isinstance(item, _Snapshot):
                    held = {j.job_id: _progress_of(j) for j in pending}
                    results.put(("snapshot", item.snapshot_id, held))
                    generator.snapshots_answered = item.snapshot_id
                    continue
                pending.append(item)
        except queue.Empty:
            pass
        if os.getppid() != parent:
            return  # the trainer is gone
        if not pending or generator.snapshot_due():
            idle_s += time.monotonic() - since
            continue
        job = _next_job(pending, published.value)
        if job is None:  # every job waits for newer weights (the staleness bound)
            time.sleep(_POLL_S)
            weights_wait_s += time.monotonic() - since
            continue
        pending.remove(job)
        generator.take_weights()
        if job.pinned is not None and generator.weight_version != job.pinned:
            _report_failure(
                results,
                job,
                RuntimeError(
                    f"job {job.job_id} is pinned to weight version {job.pinned}, but version "
                    f"{generator.weight_version} was published before it started"
                ),
            )
            continue
        results.put(("started", job.job_id, generator.weight_version))
        stats = job.stats or JobStats()
        stats.idle_s += idle_s
        stats.weights_wait_s += weights_wait_s
        idle_s = weights_wait_s = 0.0
        generator.swaps = generator.sampled = 0
        started = time.monotonic()
        try:
            samples, progress = generator.run(job)
        except Exception as err:  # noqa: BLE001 - reported to the trainer with its traceback
            _report_failure(results, job, err)
            continue
        stats.generate_s += time.monotonic() - started
        stats.weight_swaps += generator.swaps
        stats.sampled_tokens += generator.sampled
        cache = generator.take_cache_counts()
        if cache is not None:
            results.put(("cache", job.job_id, *cache))
        if progress is not None:
            # Suspended for a snapshot: it goes on from what the snapshot records (it keeps
            # its place: its id and min_version).
            pending.insert(0, dataclasses.replace(job, progress=progress, stats=stats))
            continue
        results.put(("result", job.job_id, samples, stats, None))


def _next_job(pending: Sequence[_Job], published: int) -> _Job | None:
    """The job to run next among those whose weights are published (a job waits for
    `min_version`, a pinned one for its version): urgent ones (evaluation) first, then the
    oldest batch's (lowest `min_version`: the one the trainer needs first), then submission
    order. A job still waiting for newer weights holds up none that can start: the turns of a
    batch of episodes submitted after it (rollout/episodes.py) go on meanwhile."""
    ready = [j for j in pending if published >= max(j.min_version, j.pinned or 0, 0)]
    return min(ready, key=lambda j: (not j.urgent, j.min_version, j.job_id), default=None)


def _progress_of(job: _Job) -> JobProgress:
    return job.progress or JobProgress.empty(job.prompts, job.n)


def _report_failure(results, job: _Job, err: BaseException) -> None:
    line = f"{type(err).__name__}: {err}"
    raised = sys.exc_info()[1] is err  # else a check's error, never raised: no traceback
    results.put(
        ("result", job.job_id, None, None, (line, traceback.format_exc() if raised else line))
    )
