"""`gspo-logprobs`: per-token log-probs of given token sequences under a checkpoint.

    gspo-logprobs --checkpoint PATH --input IN.jsonl --output OUT.jsonl [--tp N --pp N --ep N
                  --etp N --cp N] [--dtype fp32|bf16|fp16]
    torchrun --nproc-per-node 4 -m gspo_megatron.logprobs_cli ... --tp 2 --ep 2

PATH is an HF model directory (weights are loaded straight into the sharded model) or a megatron
checkpoint (converted or saved by training, any layout). Each input line is
`{"input_ids": [...]}`; each output line is `{"logprobs": [...]}` with log p(x_t | x_<t) for
t = 1..n-1 (one shorter than the input), in input order, computed by the training engine's own
forward (so it measures what the trainer sees: use it to check a conversion or to compare with
a rollout engine's log-probs). Ranks beyond tp*pp*cp form data-parallel replicas that split
the sequences.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gspo_megatron.checkpoint.mapping import ConversionError
from gspo_megatron.checkpoint.meta import CheckpointError
from gspo_megatron.files import replacing


def read_sequences(path: str | Path, vocab_size: int | None = None) -> list[list[int]]:
    """Token id lists from a JSONL file; errors name the file and line."""
    sequences = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConversionError(f"{where}: not a JSON object ({err})") from err
            ids = record.get("input_ids") if isinstance(record, dict) else None
            if not isinstance(ids, list) or not ids:
                raise ConversionError(f'{where}: needs a non-empty "input_ids" list')
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ConversionError(f"{where}: input_ids must be integers")
            bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise ConversionError(
                    f"{where}: token id {bad[0]} outside the model's vocabulary [0, {vocab_size})"
                )
            sequences.append(ids)
    return sequences


def build_scoring_engine(
    checkpoint: str | Path,
    layout,
    *,
    dtype: str = "float32",
    max_sequence_length: int = 4096,
    max_tokens_per_microbatch: int = 8192,
    seed: int = 0,
    hf_config: str | Path | None = None,
):
    """A TrainingEngine on `layout` holding the checkpoint's weights (parallel state is
    initialised here). Collective: call on every rank."""
    from gspo_megatron.checkpoint.hf_io import dtype_name, parse_dtype, read_hf_config
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.checkpoint.reading import read_model_config
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.training_engine import TrainingEngine
    from gspo_megatron.megatron.weight_loading import load_engine_weights
    from gspo_megatron.spec.training import EngineSettings, OptimizerSettings

    params_dtype = dtype_name(parse_dtype(dtype))
    if hf_config is not None:
        cfg = read_hf_config(hf_config, params_dtype=params_dtype)[0]
    else:
        cfg = read_model_config(checkpoint, params_dtype=params_dtype)
    parallel.initialize(layout, seed=seed)
    multiple = layout.sequence_multiple
    max_len = -(-max_sequence_length // multiple) * multiple
    engine = TrainingEngine(
        cfg,
        layout,
        EngineSettings(
            max_sequence_length=max_len, max_tokens_per_microbatch=max_tokens_per_microbatch
        ),
        # No optimizer state is ever created: plain SGD, never stepped.
        OptimizerSettings(
            name="sgd", lr=0.0, weight_decay=0.0, clip_grad=0.0, distributed_optimizer=False
        ),
    )
    load_engine_weights(engine, checkpoint)
    return engine


def score(engine, sequences: Sequence[Sequence[int]], batch_size: int = 64) -> list[list[float]]:
    """log p(x_t | x_<t), t >= 1, for each sequence, on every rank."""
    from gspo_megatron.spec.sample import TrainSample

    out: list[list[float]] = [[] for _ in sequences]
    scored = [i for i, s in enumerate(sequences) if len(s) >= 2]  # one token: nothing to score
    dp = engine.layout.dp
    for start in range(0, len(scored), batch_size):
        batch = scored[start : start + batch_size]
        # every data-parallel rank needs at least one sequence: pad with copies, drop after
        padded = batch + [batch[0]] * max(0, dp - len(batch))
        samples = [
            TrainSample(prompt_ids=list(sequences[i][:1]), response_ids=list(sequences[i][1:]))
            for i in padded
        ]
        result = engine.forward(samples)
        for i, lp in zip(batch, result.logprobs, strict=False):
            out[i] = [float(x) for x in lp]
    return out


def layout_from_args(args, world_size: int):
    from gspo_megatron.spec.layout import ParallelLayout

    return ParallelLayout(
        tp=args.tp,
        pp=args.pp,
        vpp=args.vpp,
        cp=args.cp,
        ep=args.ep,
        etp=args.etp,
        sequence_parallel=args.tp > 1,
        world_size=world_size,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gspo-logprobs",
        description="Per-token log-probs of token sequences under an HF or megatron checkpoint.",
    )
    parser.add_argument("--checkpoint", required=True, help="HF directory or megatron checkpoint")
    parser.add_argument("--input", required=True, help='JSONL, one {"input_ids": [...]} a line')
    parser.add_argument("--output", required=True, help='JSONL, one {"logprobs": [...]} a line')
    for name in ("tp", "pp", "vpp", "ep", "etp", "cp"):
        parser.add_argument(f"--{name}", type=int, default=1, help=f"{name} degree (default 1)")
    parser.add_argument("--dtype", default="fp32", help="fp32 (default), bf16 or fp16")
    parser.add_argument(
        "--hf-config",
        default=None,
        help="config.json describing a megatron checkpoint that has no gspo_checkpoint.json",
    )
    parser.add_argument("--batch-size", type=int, default=64, help="sequences per forward call")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=8192)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from gspo_megatron.checkpoint.hf_io import read_hf_config
    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()  # before megatron-core is imported
    from gspo_megatron.checkpoint.reading import read_model_config
    from gspo_megatron.megatron import parallel
    from gspo_megatron.spec.layout import LayoutError

    t0 = time.perf_counter()
    try:
        if args.hf_config:
            cfg = read_hf_config(args.hf_config)[0]
        else:
            cfg = read_model_config(args.checkpoint)
        sequences = read_sequences(args.input, cfg.vocab_size)
        layout = layout_from_args(args, parallel.world_size_from_env())
        longest = max((len(s) for s in sequences), default=2)
        engine = build_scoring_engine(
            args.checkpoint,
            layout,
            dtype=args.dtype,
            max_sequence_length=max(longest, 2),
            max_tokens_per_microbatch=args.max_tokens_per_microbatch,
            hf_config=args.hf_config,
        )
        results = score(engine, sequences, args.batch_size)
    except (ConversionError, CheckpointError, LayoutError, FileNotFoundError) as err:
        print(f"gspo-logprobs: error: {err}", file=sys.stderr)
        return 2
    import torch.distributed as dist

    if dist.get_rank() == 0:
        out = Path(args.output)
        with replacing(out) as f:
            for lp in results:
                f.write(json.dumps({"logprobs": lp}) + "\n")
        print(
            f"gspo-logprobs: {len(results)} sequences ({sum(len(r) for r in results)} tokens) "
            f"on {layout.describe()} in {time.perf_counter() - t0:.1f} s -> {out}",
            file=sys.stderr,
        )
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
