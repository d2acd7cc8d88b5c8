"""Agentic episodes: turn-synchronous vs each episode at its own pace, side by side.

    python benchmarks/bench_agentic.py              # 32 episodes, 1-6 turns, medians 20/100/300 ms
    python benchmarks/bench_agentic.py --episodes 64 --median-latency-s 0.05 --repeats 5
    python benchmarks/bench_agentic.py --skip-single --batches 8 --stream-mode one_step_off

The same work both ways, on the embedded engine (tiny_moe, one torch thread): every episode has
a number of model turns drawn from 1..6 and, after each turn but the last, a tool call whose
latency is drawn from a heavy tail (log-normal: most calls fast, a few up to 20x the median), an
observation of a few token ids, and turns of exactly `--new-tokens` tokens (`FixedTurns`), all
fixed per episode by the seed, so both ways generate the same tokens in the same number of
turns.

- turn-synchronous: every turn generates for all live episodes in one batch, then calls every
  episode's tool and waits for the slowest before the next turn (the loop this project ran
  before episodes went at their own pace);
- per-episode: gspo_megatron.rollout.episodes.EpisodeRunner (rank 0 shares the answers that
  have arrived; one batch of the episodes due a turn; answers arriving during a batch join the
  next).

Rounds alternate the two orders, so drift of the shared machine hits both alike; the table
reports, for each median tool latency, medians of episodes per second and their ratio (goal
>= 1.5x on 2 cores), and beside it the ceiling: the ratio if generation took no time, which no
engine with a per-turn cost independent of the batch can beat. The turn-synchronous loop waits,
per turn, for the slowest tool call of the episodes still live; per episode, the batch is over
when the episode whose tool calls sum longest is: ceiling = (sum over turns of the slowest
call) / (the longest episode's calls summed), from the drawn latencies (1.47x for the default
32 episodes: the goal is out of reach of this workload at any latency where generation is
cheap next to the tools). Then the engine's share of the wall time (generate calls and their
seconds, each way: where the time goes), and the prefill tokens: what an engine that
re-prefills each turn's whole context processes, next to the new tokens of each turn (the
prompt, or the last turn and observation), which is all an engine that keeps each episode's KV
cache between turns has to prefill.

A stream of batches (`--batches B`, default 4; 0 skips it), as a run under rollout.mode=async
(or `--stream-mode one_step_off`) makes them: B batches of the same kind of episodes (each
batch its own labels, so its own turns and latencies), on the generator process (the product's
builder, rollout/embedded/backend.py), a weight update after each batch (no training: the
trainer's side costs nothing here).

- turn-synchronous: the loop above, batch after batch;
- streamed: the product's path, RolloutPipeline.take for each step (EpisodeRunner.submit: each
  batch of episodes in a thread of its own, every turn a job of the process under its batch's
  min_version), so the batches the staleness bound allows run beside the one the trainer
  waits for (no batch barrier). The batches the pipeline has submitted ahead of the last one
  taken are then waited for, untimed, and not counted: the streamed figure is conservative
  for a short stream.

Beside the ratio, the free-generation ratio from the drawn latencies, computed as the
single batch's ceiling: turn-synchronous, the sum over batches of each one's sum over turns of
the slowest call; streamed, batch s starts when the trainer comes for batch s - w (w =
min(depth, max_staleness), the pipeline's rule) and ends when its longest episode has made its
calls, and not before batch s - 1. Unlike the single batch's, it is no ceiling: streamed
batches hide one another's generation behind their tool calls, which the turn-synchronous loop
pays in full, so at short latencies the measured ratio can be above it; at long latencies it is
the limit.

Measured 2026-12-04 02:38-02:50 UTC, shared 2-core machine, load average 3.1 rising to 11.8
(`python benchmarks/bench_agentic.py`, defaults): stream of 4 batches under async, streamed /
turn-synchronous 3.31x at 20 ms, 4.08x at 100 ms, 3.79x at 300 ms (free-generation ratio
3.70x); one_step_off before the batch barrier was removed 1.66x / 1.97x at 20 / 100 ms, after
3.48x / 3.72x (docs/ENVIRONMENTS.md, "A stream of batches"). That default run took 12 minutes
on the loaded machine, 7 of them the stream's (300 ms dominates: `--median-latency-s 0.02 0.1`
for a quicker look).

Equal work, checked: the same episodes (prompts, turns and tool latencies fixed by each
episode's label), the same number of model turns (asserted) and the same context lengths at
every turn (the prefill counts, asserted equal), so the same number of generated tokens. The
token ids differ (the two loops seed their batches differently), their count does not. In
the stream, the same model turns (asserted).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rollout import build_embedded  # noqa: E402

from gspo_megatron.envs import Environment, StepResult  # noqa: E402


class Tool(Environment):
    """Turns and tool latencies fixed by the episode's label: a heavy-tailed latency per call."""

    median_latency_s = 0.02  # set from --median-latency-s
    observation = [5, 6, 7, 8, 9, 10]

    def reset(self, prompt, label=None):
        self.turns, self.latencies = self.draw(label)
        self.done = 0

    @classmethod
    def draw(cls, label) -> tuple[int, list[float]]:
        """(model turns, the latency of each tool call) of the episode labelled `label`."""
        rng = random.Random(label)
        turns = rng.randint(1, 6)
        median = cls.median_latency_s
        latencies = [
            min(median * rng.lognormvariate(0.0, 1.5), 20 * median) for _ in range(turns - 1)
        ]
        return turns, latencies

    def step(self, turn):
        self.done += 1
        if self.done == self.turns:
            return StepResult(done=True)
        time.sleep(self.latencies[self.done - 1])
        return StepResult(observation=self.observation, tool_calls=1)


class FixedTurns:
    """The engine, with every turn ending after exactly `max_new_tokens` tokens as if the model
    had ended it there (finish reason "stop": a random model rarely samples its end token)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.calls = 0
        self.seconds = 0.0  # in generate

    def generate(self, prompts, n, params):
        started = time.perf_counter()
        groups = self.engine.generate(prompts, n, params)
        self.calls += 1
        self.seconds += time.perf_counter() - started
        for s in (s for g in groups for s in g):
            s.finish_reason = "stop"
        return groups


def turn_synchronous(runner, engine, prompts, params):
    """The turn-by-turn loop: one batch per turn over the live episodes, then every tool call
    of the turn, waited for together. Returns the trajectories and the prefill counts."""
    calls = runner.calls
    envs = [env for env, _ in (o.value for o in calls.run([(None, "reset", (p.prompt, p.label))
                                                           for p in prompts]))]  # fmt: skip
    contexts = [list(p.prompt_ids) for p in prompts]
    live = list(range(len(prompts)))
    whole = new = 0
    last = [len(c) for c in contexts]
    while live:
        batch = [contexts[i] for i in live]
        whole += sum(len(c) for c in batch)
        new += sum(len(contexts[i]) - (0 if len(contexts[i]) == last[i] else last[i])
                   for i in live)  # fmt: skip
        for i, (sample,) in zip(live, engine.generate(batch, 1, params), strict=True):
            contexts[i] = contexts[i] + sample.response_ids
            last[i] = len(contexts[i]) - len(sample.response_ids)
        outcomes = calls.run([(envs[i], "step", ("",)) for i in live])
        going = []
        for i, outcome in zip(live, outcomes, strict=True):
            envs[i], result = outcome.value
            if not result.done:
                last[i] = len(contexts[i]) - len(sample.response_ids)
                contexts[i] = contexts[i] + list(result.observation)
                going.append(i)
        live = going
    return contexts, whole, new


def ceiling(prompts) -> float:
    """The per-episode / turn-synchronous ratio if generation took no time: the sum over turns
    of the slowest tool call of the episodes still live, over the longest episode's calls."""
    latencies = [Tool.draw(p.label)[1] for p in prompts]
    slowest = sum(max((c[k] for c in latencies if len(c) > k), default=0.0) for k in range(6))
    return slowest / max(sum(c) for c in latencies)


def prefill_counts(groups) -> tuple[int, int]:
    """(whole contexts, new tokens) prefilled over an episode batch's turns."""
    whole = new = 0
    for s in (s for g in groups for s in g):
        starts = [0] + [j for j in range(1, len(s.loss_mask)) if s.loss_mask[j] and not
                        s.loss_mask[j - 1]]  # fmt: skip
        previous = 0
        for start in starts:
            context = len(s.prompt_ids) + start
            whole += context
            new += context - previous
            previous = context
    return whole, new


class FixedJobs:
    """`FixedTurns` for an engine outside the trainer (the generator process): every job's
    turns end with finish reason "stop"; everything else is the engine's."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def start_generate(self, prompts, n, params, **kwargs):
        inner = self.engine.start_generate(prompts, n, params, **kwargs)
        outer: concurrent.futures.Future = concurrent.futures.Future()

        def done(f) -> None:
            try:
                groups = f.result()
            except BaseException as e:  # noqa: BLE001 - the caller's future fails with it
                outer.set_exception(e)
                return
            for s in (s for g in groups for s in g):
                s.finish_reason = "stop"
            outer.job_stats = getattr(f, "job_stats", None)  # type: ignore[attr-defined]
            outer.set_result(groups)

        inner.add_done_callback(done)
        return outer

    def generate(self, prompts, n, params):
        return self.start_generate(prompts, n, params).result()


def stream_ceiling(batches, window: int) -> float:
    """The streamed / turn-synchronous ratio over a stream of batches if generation (and
    training) took no time. Turn-synchronous, batch by batch: each batch's sum over turns of
    the slowest call. Streamed: batch s starts when the trainer comes for batch s - window
    (window = min(depth, max_staleness): the pipeline's rule) and ends when its longest episode
    has made its calls, and no earlier than batch s - 1 (batches are taken in order)."""
    synchronous, ends = 0.0, []
    for s, prompts in enumerate(batches):
        latencies = [Tool.draw(p.label)[1] for p in prompts]
        synchronous += sum(max((c[k] for c in latencies if len(c) > k), default=0.0)
                           for k in range(6))  # fmt: skip
        start = ends[s - window - 1] if s - window - 1 >= 0 else 0.0
        longest = max(sum(c) for c in latencies)
        ends.append(max(ends[-1] if ends else 0.0, start + longest))
    return synchronous / ends[-1]


def build_generator_process(config, policy, mode: str):
    """The generator process of rollout.mode=`mode` over the policy's weights (the product's
    builder), version 0 published, and its driver."""
    from gspo_megatron.config import RunConfig
    from gspo_megatron.ranks import SingleRank
    from gspo_megatron.rollout.driver import RolloutDriver
    from gspo_megatron.rollout.embedded.backend import build_generator_process as build

    cfg = RunConfig()
    cfg.rollout.mode = mode
    cfg.rollout.max_batch_tokens = 1 << 16
    cfg.engine.max_sequence_length = config.max_position_embeddings
    engine, source = build(cfg, policy, record_routes=False)
    driver = RolloutDriver(FixedJobs(engine), SingleRank(), source)
    driver.update_weights(0)
    return engine, driver


def measure_stream(args, runner, driver, batches, params_for) -> None:
    """Per median latency: `args.batches` batches turn-synchronous one after the other vs
    streamed by the rollout pipeline (RolloutPipeline + EpisodeRunner.submit), a weight
    update between batches in both, on the same generator process."""
    from gspo_megatron.data.sampler import PromptSampler
    from gspo_megatron.ranks import SingleRank
    from gspo_megatron.rollout.pipeline import RolloutPipeline

    depth = 1 if args.stream_mode == "one_step_off" else args.queue_batches
    window = min(depth, args.max_staleness)
    counted = batches[: args.batches]
    turns = sum(Tool.draw(p.label)[0] for b in counted for p in b)
    episodes = args.batches * args.episodes

    def synchronous():
        for step, prompts in enumerate(counted):
            turn_synchronous(runner, driver.engine, prompts, params_for(step))
            driver.update_weights(driver.version + 1)

    def streamed():
        # the trainer's step count is the weight version, carried on from the runs before
        base = driver.version
        pipeline = RolloutPipeline(
            driver, PromptSampler([p for b in batches for p in b], args.episodes,
                                  shuffle=False), SingleRank(),
            depth=depth, max_staleness=args.max_staleness, group_size=1,
            params_for=lambda step: params_for(step - base), episodes=runner,
        )  # fmt: skip
        done = 0
        for step in range(base, base + args.batches):
            _, groups, _ = pipeline.take(step)
            done += sum(s.episode.turns for g in groups for s in g)
            driver.update_weights(step + 1)
        return done, pipeline

    print(f"\nstream: {args.batches} batches of {args.episodes} episodes ({turns} model turns), "
          f"rollout.mode={args.stream_mode}, depth {depth}, max_staleness "
          f"{args.max_staleness}, the generator process (one torch thread), a weight update "
          f"after each batch")  # fmt: skip
    print(f"{'median tool latency':>20} {'turn-sync ep/s':>15} {'streamed ep/s':>14} "
          f"{'ratio':>6} {'free-generation ratio':>22}")  # fmt: skip
    synchronous()  # warm-up (the process's kernels and first weights)
    for latency in args.median_latency_s:
        Tool.median_latency_s = latency
        timings = {"turn-synchronous": [], "streamed": []}
        for r in range(args.repeats):
            order = ["turn-synchronous", "streamed"]
            for name in order if r % 2 == 0 else order[::-1]:
                started = time.perf_counter()
                if name == "streamed":
                    done, pipeline = streamed()
                    timings[name].append(time.perf_counter() - started)
                    assert done == turns  # the same work
                    for a in pipeline.ahead:  # the batches ahead finish, untimed
                        a.submitted.job.result()
                    pipeline.abandon()
                else:
                    synchronous()
                    timings[name].append(time.perf_counter() - started)
        rate = {name: episodes / statistics.median(t) for name, t in timings.items()}
        ratio = rate["streamed"] / rate["turn-synchronous"]
        print(f"{latency * 1e3:17g} ms {rate['turn-synchronous']:15.2f} "
              f"{rate['streamed']:14.2f} {ratio:5.2f}x "
              f"{stream_ceiling(counted, window):21.2f}x")  # fmt: skip


def measure_single(args, runner, engine, prompts, params) -> None:
    """Per median latency: one batch, turn-synchronous vs per-episode (EpisodeRunner.run on
    the embedded engine in this process)."""
    turns = sum(random.Random(p.label).randint(1, 6) for p in prompts)

    def per_episode():
        groups = runner.run(engine, prompts, 1, params)
        assert sum(s.episode.turns for g in groups for s in g) == turns
        return prefill_counts(groups)

    def synchronous():
        _, whole, new = turn_synchronous(runner, engine, prompts, params)
        return whole, new

    ways = [("turn-synchronous", synchronous), ("per-episode", per_episode)]
    per_episode()  # warm-up (kernels, threads)
    print(f"{args.episodes} episodes, {turns} model turns of {args.new_tokens} tokens, tool "
          f"latency log-normal (sigma 1.5, capped at 20x the median), {args.repeats} rounds "
          f"each, torch threads {args.threads}")  # fmt: skip
    print(f"{'median tool latency':>20} {'turn-sync ep/s':>15} {'per-episode ep/s':>17} "
          f"{'ratio':>6} {'ceiling':>8} {'engine: turn-sync':>18} {'per-episode':>16} "
          f"{'prefill: whole ctx':>19} {'new tokens only':>16}")  # fmt: skip
    for latency in args.median_latency_s:
        Tool.median_latency_s = latency
        timings = {"turn-synchronous": [], "per-episode": []}
        prefill, engine_time = {}, {name: [0, 0.0, 0.0] for name in timings}
        for r in range(args.repeats):
            for name, fn in ways if r % 2 == 0 else ways[::-1]:
                engine.calls, engine.seconds = 0, 0.0
                started = time.perf_counter()
                prefill[name] = fn()
                timings[name].append(time.perf_counter() - started)
                spent = engine_time[name]
                spent[0] += engine.calls
                spent[1] += engine.seconds
                spent[2] += timings[name][-1]
        assert prefill["per-episode"] == prefill["turn-synchronous"]  # the same work
        rate = {name: args.episodes / statistics.median(t) for name, t in timings.items()}
        ratio = rate["per-episode"] / rate["turn-synchronous"]
        whole, new = prefill["per-episode"]
        # per run: generate calls, and the share of the wall time spent in them
        share = {name: f"{c / args.repeats:4.1f} calls {s / wall:4.0%}"
                 for name, (c, s, wall) in engine_time.items()}  # fmt: skip
        print(f"{latency * 1e3:17g} ms {rate['turn-synchronous']:15.2f} "
              f"{rate['per-episode']:17.2f} {ratio:5.2f}x {ceiling(prompts):7.2f}x "
              f"{share['turn-synchronous']:>18} {share['per-episode']:>16} "
              f"{whole:19d} {new:16d}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--median-latency-s", type=float, nargs="+", default=[0.02, 0.1, 0.3])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, default=4, help="stream of batches (0: none)")
    ap.add_argument("--stream-mode", choices=["one_step_off", "async"], default="async")
    ap.add_argument("--queue-batches", type=int, default=2, help="async's depth")
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--skip-single", action="store_true", help="the stream only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from gspo_megatron.data.dataset import Prompt
    from gspo_megatron.data.tokenizer import build_char_tokenizer
    from gspo_megatron.envs.registry import EnvConfig
    from gspo_megatron.ranks import SingleRank
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.episodes import EpisodeRunner

    config, engine = build_embedded("tiny_moe", batch_tokens=1 << 16)
    engine = FixedTurns(engine)
    tokenizer = build_char_tokenizer()
    rng = random.Random(0)
    prompts = []
    for i in range(args.episodes):
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        ids = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
        prompts.append(Prompt(i, ids, f"{a}+{b}=", f"episode {i}"))
    cfg = EnvConfig(name="__main__:Tool", max_turns=6, max_tokens=6 * (args.new_tokens + 8),
                    executor="thread", timeout_s=60.0)  # fmt: skip
    runner = EpisodeRunner(cfg, tokenizer, SingleRank(), config.max_position_embeddings)
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=1)
    if not args.skip_single:
        measure_single(args, runner, engine, prompts, params)
    if args.batches:
        depth = 1 if args.stream_mode == "one_step_off" else args.queue_batches
        batches = [[Prompt(b * len(prompts) + i, p.prompt_ids, p.prompt, f"{b}:{i}")
                    for i, p in enumerate(prompts)]
                   for b in range(args.batches + depth + 1)]  # fmt: skip
        process, driver = build_generator_process(config, engine.engine._trainer,
                                                  args.stream_mode)  # fmt: skip
        try:
            measure_stream(args, runner, driver, batches,
                           lambda step: SamplingParams(max_new_tokens=args.new_tokens,
                                                       seed=1 + step))  # fmt: skip
        finally:
            process.close()
    runner.close()


if __name__ == "__main__":
    main()
