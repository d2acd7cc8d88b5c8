"""`gspo-eval` / `python -m gspo_megatron.evaluate`: a checkpoint on the benchmarks of the `eval`
section, with the config gspo-train composes (so a run's own overrides evaluate its checkpoints
as the training loop did), on any layout (under torchrun every rank runs this), with the
embedded engine or SGLang servers.

    gspo-eval model.init_from=outputs/DATE/TIME/checkpoints/step_000100
    gspo-eval model.init_from=/ckpt/qwen3-hf model.tokenizer=/ckpt/qwen3-hf ... \\
        '+eval.benchmarks.aime24={files: [aime24.jsonl], samples: 32, temperature: 0.6}'

Writes, in the output directory (hydra.run.dir): <name>.jsonl per benchmark (one line per
problem: its responses, rewards, answers), summary.json and summary.md (one row per benchmark).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from gspo_megatron import CONF_DIR
from gspo_megatron.config import ConfigError, RunConfig, resolve
from gspo_megatron.data.dataset import DataError
from gspo_megatron.data.vocab import VocabMismatchError
from gspo_megatron.spec.layout import ParallelLayout
from gspo_megatron.spec.model_config import ModelConfig
from gspo_megatron.train import fail, quiet_libraries, start

PROGRAM = "gspo-eval"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def run(cfg: DictConfig) -> None:
    quiet_libraries()
    evaluate_composed(
        OmegaConf.to_container(cfg, resolve=True), Path(HydraConfig.get().runtime.output_dir)
    )


def evaluate_composed(raw: dict, out_dir: Path) -> dict[str, dict[str, float]]:
    """Everything gspo-eval does with a composed config; the metrics by benchmark.

    Exits (SystemExit) with one line on a bad config or a failed evaluation.
    """
    from gspo_megatron.checkpoint.mapping import ConversionError
    from gspo_megatron.checkpoint.meta import CheckpointError

    try:
        cfg, model, layout = resolve(
            raw, int(os.environ.get("WORLD_SIZE", "1")), for_training=False
        )
        if not cfg.model.init_from:
            raise ConfigError(
                "model.init_from is null: gspo-eval evaluates a checkpoint (a gspo-megatron "
                "checkpoint directory or a Hugging Face directory)"
            )
        if not cfg.eval.named():
            raise ConfigError(
                "nothing to evaluate: eval.heldout.problems=0 and eval.benchmarks is empty"
            )
        from gspo_megatron.megatron import cpu_compat

        cpu_compat.apply()  # before megatron-core is imported
        evaluation = Evaluation(cfg, model, layout, out_dir)
    except ConfigError as err:
        sys.exit(f"{PROGRAM}: config error: {err}")
    except (DataError, VocabMismatchError, CheckpointError, ConversionError) as err:
        fail(err, traceback=False, program=PROGRAM)
    except Exception as err:  # noqa: BLE001 - one line here, the traceback in the log
        fail(err, program=PROGRAM)
    try:
        return evaluation.run(out_dir)
    except Exception as err:  # noqa: BLE001 - one line here, the traceback in the log
        fail(err, program=PROGRAM)
    finally:
        evaluation.close()


class Evaluation:
    """The parts gspo-eval runs: tokenizer, benchmarks, a frozen engine holding the checkpoint,
    and the rollout engine over it. Bad input is refused before the model is built."""

    def __init__(
        self, cfg: RunConfig, model: ModelConfig, layout: ParallelLayout, out_dir: Path
    ) -> None:
        from gspo_megatron.collector import RolloutCollector
        from gspo_megatron.components import build_rollout, init_weights, load_run_tokenizer
        from gspo_megatron.data.config import build_heldout_dataset
        from gspo_megatron.data.vocab import check_vocab
        from gspo_megatron.evaluation.benchmarks import build_benchmarks
        from gspo_megatron.megatron import parallel
        from gspo_megatron.notes import note
        from gspo_megatron.ranks import ProcessGroupRanks
        from gspo_megatron.rewards.registry import build_scorer
        from gspo_megatron.rollout.backends import rollout_backend

        if cfg.rollout.mode != "sync":
            note(f"rollout.mode={cfg.rollout.mode} is for training; gspo-eval generates in sync")
        # Generation only: no routes to record, no generator process.
        cfg = replace(
            cfg,
            rollout=replace(cfg.rollout, mode="sync"),
            algorithm=replace(cfg.algorithm, routing_replay="off"),
        )
        self.cfg = cfg
        self.tokenizer = load_run_tokenizer(cfg)
        check_vocab(self.tokenizer, model.vocab_size)
        self.scorer = build_scorer(cfg.reward)
        self.benchmarks = build_benchmarks(
            cfg,
            self.tokenizer,
            build_heldout_dataset(cfg.data, self.tokenizer) if cfg.eval.heldout.enabled else None,
            self.scorer,
            vocab_size=model.vocab_size,
            seed=cfg.seed,
        )
        if not self.benchmarks:
            raise ConfigError("nothing to evaluate: no benchmark has problems")
        # gspo-eval keeps the rollout backend's files (SGLang's memory record) in out_dir
        rollout_backend(cfg.rollout.engine).check_run_dir(cfg, out_dir)
        self.engine = self.collector = None
        parallel.initialize(layout, seed=cfg.seed)
        from gspo_megatron.megatron.training_engine import TrainingEngine

        self.engine = TrainingEngine(model, layout, cfg.engine, trainable=False)
        init_weights(self.engine, cfg.model.init_from)
        rollout, source = build_rollout(cfg, self.engine, out_dir)
        self.ranks = ProcessGroupRanks()
        self.collector = RolloutCollector.for_run(
            cfg, rollout, weight_source=source, ranks=self.ranks, tokenizer=self.tokenizer
        )
        self.collector.update_weights(0)

    def run(self, out_dir: Path) -> dict[str, dict[str, float]]:
        from gspo_megatron.evaluation.benchmarks import run_benchmark, write_records
        from gspo_megatron.files import write_atomically
        from gspo_megatron.notes import note

        r = self.cfg.rollout
        results: dict[str, dict[str, float]] = {}
        for bench in self.benchmarks:
            # As many responses per generate call as one RL step generates.
            chunk = max(1, r.prompts_per_step * r.group_size // bench.settings.samples)
            result = run_benchmark(
                bench,
                self.collector,
                self.ranks,
                chunk_problems=chunk,
                progress=self.cfg.logging.progress,
            )
            results[bench.name] = result.metrics
            if self.ranks.rank == 0:
                write_records(out_dir / f"{bench.name}.jsonl", result.records)
                note(f"{bench.name}: " + _inline(result.metrics))
        if self.ranks.rank == 0:
            summary = {
                "checkpoint": self.cfg.model.init_from,
                "benchmarks": {
                    b.name: {
                        "metrics": results[b.name],
                        "samples": b.settings.samples,
                        "temperature": b.settings.temperature,
                        "top_p": b.settings.top_p,
                        "max_new_tokens": b.params.max_new_tokens,
                        "loading": b.loading,
                    }
                    for b in self.benchmarks
                },
            }
            write_atomically(out_dir / "summary.json", json.dumps(summary, indent=1) + "\n")
            table = summary_table(results)
            write_atomically(out_dir / "summary.md", table)
            print(table, flush=True)
        return results

    def close(self) -> None:
        from gspo_megatron.megatron import parallel

        for part in (self.scorer, *self.benchmarks, self.collector, self.engine):
            if part is not None:
                part.close()
        parallel.destroy()


def _inline(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def summary_table(results: dict[str, dict[str, float]]) -> str:
    """A Markdown table: one row per benchmark, a column per metric any benchmark has (avg@n,
    pass@k, maj@k by k, then the rest)."""
    columns: list[str] = []
    for metrics in results.values():
        columns += [k for k in metrics if k not in columns]

    def order(column: str) -> tuple[int, int]:
        name, _, k = column.partition("@")
        return {"avg": 0, "pass": 1, "maj": 2}.get(name, 3), int(k) if k else 0

    columns.sort(key=order)
    lines = [
        "| benchmark | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 1) + "|",
    ]
    for name, metrics in results.items():
        cells = [f"{metrics[c]:.4g}" if c in metrics else "" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    start(PROGRAM, run)


if __name__ == "__main__":
    main()
