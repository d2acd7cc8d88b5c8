"""Where an RL step's time goes, on the default configuration (CPU, one process), from one run.

    python benchmarks/bench_step.py [--steps 40] [--warmup 5] [--profile 25] [overrides ...]

Runs gspo-train's own code path (Hydra compose, resolve, build_trainer, Trainer.train) in this
process (no evaluation, no progress bar, no TensorBoard) and prints, as means over steps
--warmup+1 .. --steps, each step's wall and CPU time split two ways:

1. By phase: the trainer's own `time/*` metrics (generation with scoring, old-policy log-probs,
   the optimizer steps, the weight sync) and the rest of the loop.
2. By kind of work: the model's compute — the policy's forward passes (old log-probs and
   training), the log-probs and loss computed from its outputs inside megatron's schedule, the
   backward passes, the optimizer steps (gradient norm, clipping, Adam, parameter copies) and the
   rollout decoder's forward passes — against everything else: planning and building
   micro-batches, advantages, masks, metrics, rewards, sampling, logging, Python bookkeeping and
   synchronisation. The goal for "everything else" is <= 10% of the step.

The second split times calls made by the run itself: forward hooks on the model chunks, and
wrappers around megatron's `backward_step` / `forward_step_calc_loss`, the optimizer's `step`
and the rollout decoder's `forward`, each counting its own time exclusive of the others nested in
it. --profile N then runs --profile-steps more steps under cProfile and prints the N functions
with the most own time (the profiler slows Python code, so it never overlaps the timed steps);
with --profile-rest the profiler pauses inside the timed calls, so it shows only "everything
else". --itemise splits "everything else" by the named parts in ITEMS (micro-batch building, the
gradient sync, the rollout engine's Python, route and mismatch metrics, ...), timed the same way.
One step more ends the run (its evaluation and checkpoint are not measured).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ["time/generate", "time/old_logprobs", "time/train", "time/sync_weights"]
COMPUTE = [
    "model forward",
    "log-probs and loss",
    "backward",
    "optimizer step",
    "rollout decoder",
]
# --itemise: the named parts of "everything else" (module, attribute path), each timed like the
# model's work (exclusive of what nests in it); what none of them covers stays "not itemised".
ITEMS = {
    "micro-batch building (plan, pad, pack)": [
        ("gspo_megatron.megatron.training_engine", "TrainingEngine._microbatches"),
    ],
    "gradient sync (finalize_model_grads)": [],  # the engine's config holds it: see itemise()
    "megatron's schedule, its own Python": [
        ("megatron.core.pipeline_parallel.schedules", "forward_backward_no_pipelining"),
    ],
    "the rollout engine's Python (batching, sampling)": [
        ("gspo_megatron.rollout.embedded.in_process", "EmbeddedEngine.generate"),
        ("gspo_megatron.rollout.embedded.batching", "GenerationBatch.__init__"),
        ("gspo_megatron.rollout.embedded.batching", "GenerationBatch._prefill"),
        ("gspo_megatron.rollout.embedded.batching", "GenerationBatch._choose"),
        ("gspo_megatron.rollout.embedded.batching", "GenerationBatch._finish_rows"),
        ("gspo_megatron.rollout.embedded.batching", "GenerationBatch._emit"),
    ],
    "route recording and route-change metrics": [
        ("gspo_megatron.megatron.routing", "RouteRecorder.begin"),
        ("gspo_megatron.megatron.routing", "RouteRecorder.before_forward"),
        ("gspo_megatron.megatron.routing", "RouteRecorder.after_forward"),
        ("gspo_megatron.megatron.routing", "RouteRecorder.end"),
        ("gspo_megatron.megatron.routing", "RouteRecorder.collect"),
        ("gspo_megatron.megatron.routing", "RouteRecorder.step_metrics"),
    ],
    "loss denominator, metric sums, finiteness": [
        ("gspo_megatron.megatron.training_engine", "TrainingEngine._global_denominator"),
        ("gspo_megatron.megatron.training_engine", "TrainingEngine._reduce_metric_sums"),
        ("gspo_megatron.megatron.training_engine", "TrainingEngine._all_finite"),
    ],
    "old-policy results per token, sample checks": [
        ("gspo_megatron.megatron.training_engine", "TrainingEngine._collect_per_token"),
        ("gspo_megatron.megatron.training_engine", "validate_samples"),
    ],
    "mismatch, route-flip and expert-load metrics": [
        ("gspo_megatron.step_inputs", "_mismatch_stats"),
        ("gspo_megatron.step_inputs", "_route_flips"),
        ("gspo_megatron.step_inputs", "_expert_load"),
    ],
    "reward scoring": [("gspo_megatron.collector", "RolloutCollector.score")],
}


class WorkClock:
    """Exclusive wall and CPU seconds per kind of work: time in a nested timed call counts for
    the inner kind only. The CPU time is the main thread's (the process's would charge the
    work of other threads to whatever the main thread runs meanwhile); it holds steadier than
    wall time on a machine that other jobs share."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [kind, wall started, cpu started]
        # profiles only what no timed call covers ("everything else") while set
        self.profiler: cProfile.Profile | None = None

    def _charge(self, entry: list, wall: float, cpu: float) -> None:
        self.wall[entry[0]] += wall - entry[1]
        self.cpu[entry[0]] += cpu - entry[2]

    def enter(self, kind: str) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        if self._stack:
            self._charge(self._stack[-1], wall, cpu)
        elif self.profiler is not None:
            self.profiler.disable()
        self._stack.append([kind, wall, cpu])

    def leave(self) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        self._charge(self._stack.pop(), wall, cpu)
        if self._stack:
            self._stack[-1][1:] = [wall, cpu]
        elif self.profiler is not None:
            self.profiler.enable()

    def wrap(self, kind: str, fn):
        def timed(*args, **kwargs):
            self.enter(kind)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()

        return timed

    def take(self) -> dict[str, dict[str, float]]:
        out = {"wall": dict(self.wall), "cpu": dict(self.cpu)}
        self.wall, self.cpu = defaultdict(float), defaultdict(float)
        return out


def instrument(trainer, clock: WorkClock) -> None:
    """Time the run's model work (see the module docstring)."""
    from megatron.core.pipeline_parallel import schedules

    for chunk in trainer.engine.unwrapped_chunks:
        chunk.register_forward_pre_hook(lambda module, args: clock.enter("model forward"))
        chunk.register_forward_hook(lambda module, args, output: clock.leave())
    # The schedule looks both up in its module when it calls them.
    schedules.forward_step_calc_loss = clock.wrap(
        "log-probs and loss", schedules.forward_step_calc_loss
    )
    schedules.backward_step = clock.wrap("backward", schedules.backward_step)
    optimizer = trainer.engine.optimizer
    optimizer.step = clock.wrap("optimizer step", optimizer.step)
    decoder = getattr(trainer.collector.driver.engine, "decoder", None)
    if decoder is not None:
        decoder.forward = clock.wrap("rollout decoder", decoder.forward)


def itemise(trainer, clock: WorkClock) -> None:
    """Time the ITEMS of "everything else" too."""
    import importlib

    for kind, targets in ITEMS.items():
        for module_name, path in targets:
            owner = importlib.import_module(module_name)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part)
            setattr(owner, name, clock.wrap(kind, getattr(owner, name)))
    config = trainer.engine.config
    config.finalize_model_grads_func = clock.wrap(
        "gradient sync (finalize_model_grads)", config.finalize_model_grads_func
    )


def run(args, overrides: list[str], run_dir: Path) -> tuple[list[dict], pstats.Stats | None]:
    import torch

    from gspo_megatron.components import build_trainer
    from gspo_megatron.config import compose, resolve
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.megatron import parallel
    from gspo_megatron.run_files import check_run_directory
    from gspo_megatron.train import quiet_libraries

    torch.set_num_threads(args.threads)
    quiet_libraries()
    raw = compose(
        [
            f"trainer.steps={args.steps + (args.profile_steps + 1 if args.profile else 1)}",
            "eval.every=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            *overrides,
        ]
    )
    run_cfg, model, layout = resolve(raw, 1)
    total = run_cfg.trainer.steps
    lock = check_run_directory(run_dir, run_cfg)  # noqa: F841 - the run directory's, for the run
    trainer = build_trainer(run_cfg, model, layout, run_dir)
    clock = WorkClock()
    instrument(trainer, clock)
    if args.itemise:
        itemise(trainer, clock)
    profiler = cProfile.Profile() if args.profile else None
    steps: list[dict] = []
    write = trainer.log.write
    stamps = [(time.perf_counter(), time.thread_time(), time.process_time())]

    def write_and_stamp(step, metrics):  # once per RL step, at its end
        write(step, metrics)
        now = (time.perf_counter(), time.thread_time(), time.process_time())
        steps.append(
            {
                "wall": now[0] - stamps[-1][0],
                "cpu": now[1] - stamps[-1][1],
                "process_cpu": now[2] - stamps[-1][2],
                "work": clock.take(),
                **{p: metrics[p] for p in PHASES},
            }
        )
        stamps.append(now)
        if profiler is not None and step == args.steps:
            profiler.enable()
            clock.profiler = profiler if args.profile_rest else None
        if profiler is not None and step == total - 1:
            profiler.disable()  # before the last step's evaluation and checkpoint
            clock.profiler = None

    trainer.log.write = write_and_stamp
    try:
        trainer.train()
    finally:
        trainer.close()
        parallel.destroy()
    stats = pstats.Stats(profiler) if profiler is not None else None
    # Steps warmup+1 .. steps; the profiled ones, and the last (it evaluates and saves), after.
    return steps[args.warmup : args.steps], stats


def report(measured: list[dict], overrides: list[str], itemised: bool) -> None:
    n = len(measured)

    def mean(values) -> float:
        return sum(values) / n

    wall = mean(s["wall"] for s in measured)
    cpu = mean(s["cpu"] for s in measured)
    process_cpu = mean(s["process_cpu"] for s in measured)
    print(
        f"{n} steps after the warm-up; overrides: {overrides or 'none'}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"step: {wall:.4f} s wall, {process_cpu:.4f} s CPU ({cpu:.4f} s in the main thread, "
        f"{process_cpu - cpu:.4f} s in others)"
    )
    print(f"\nby phase (the trainer's time/* metrics, wall){'seconds':>8}{'share':>8}")
    for phase in PHASES:
        value = mean(s[phase] for s in measured)
        print(f"  {phase:<50}{value:>9.4f}{value / wall:>8.1%}")
    rest = wall - sum(mean(s[p] for s in measured) for p in PHASES)
    print(f"  {'the rest of the loop (logging, votes)':<50}{rest:>9.4f}{rest / wall:>8.1%}")
    print(f"\nby kind of work{'wall s':>45}{'share':>8}{'main thread CPU s':>18}{'share':>8}")
    totals = {"wall": 0.0, "cpu": 0.0}

    def row(name: str, values: dict[str, float]) -> None:
        print(
            f"  {name:<50}{values['wall']:>9.4f}{values['wall'] / wall:>8.1%}"
            f"{values['cpu']:>18.4f}{values['cpu'] / cpu:>8.1%}"
        )

    for kind in COMPUTE:
        values = {c: mean(s["work"][c].get(kind, 0.0) for s in measured) for c in totals}
        for c in totals:
            totals[c] += values[c]
        row(kind, values)
    row("model compute, in all", totals)
    row(
        "everything else (goal <= 10%)", {"wall": wall - totals["wall"], "cpu": cpu - totals["cpu"]}
    )
    if not itemised:
        return
    items = {
        kind: {c: mean(s["work"][c].get(kind, 0.0) for s in measured) for c in totals}
        for kind in ITEMS
    }
    for kind, values in sorted(items.items(), key=lambda item: -item[1]["cpu"]):
        row(f"  {kind}", values)
    row(
        "  not itemised",
        {
            c: (wall if c == "wall" else cpu) - totals[c] - sum(v[c] for v in items.values())
            for c in totals
        },
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--profile", type=int, default=0, help="then profile --profile-steps more steps: top N"
    )
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument(
        "--profile-rest",
        action="store_true",
        help="profile only what the model's compute leaves out (everything else)",
    )
    parser.add_argument("--sort", default="tottime", help="cProfile order: tottime | cumulative")
    parser.add_argument(
        "--itemise", action="store_true", help="split everything else into ITEMS too"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the per-step records")
    args, overrides = parser.parse_known_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    with tempfile.TemporaryDirectory() as tmp:
        measured, stats = run(args, overrides, Path(tmp) / "run")
    report(measured, overrides, args.itemise)
    if args.json:
        args.json.write_text(json.dumps(measured, indent=1))
    if stats is not None:
        out = io.StringIO()
        stats.stream = out
        stats.sort_stats(args.sort).print_stats(args.profile)
        what = "everything but the model's compute" if args.profile_rest else "the measured steps"
        print(f"\nprofile of {what}, top {args.profile} by {args.sort}:")
        print(_short_paths(out.getvalue()))
    return 0


def _short_paths(text: str) -> str:
    site = str(Path(sys.modules["torch"].__file__).parents[1]) + "/"
    return text.replace(site, "").replace(str(REPO) + "/", "")


if __name__ == "__main__":
    sys.exit(main())
