"""Convert a megatron torch_dist checkpoint (converted, or saved by training on any layout) into
a Hugging Face directory: safetensors shards with per-expert names, the index, config.json and
tokenizer files — loadable by transformers and SGLang. A checkpoint with a value head
(output_layer.weight [1, hidden]: a critic or reward model) is written as
*ForSequenceClassification with one label.

    python tools/convert_megatron_to_hf.py --megatron-path ckpt/step_100 --output hf/step_100 \
        [--tokenizer Qwen3-30B-A3B-Base] [--dtype bf16] [--verify] [--overwrite]

A LoRA checkpoint (lora.rank) is written merged (base + alpha/r · B @ A, the trained policy),
or with `--lora-weights base` as its frozen base model; `--peft` writes its adapters as a
Hugging Face PEFT adapter instead (adapter_model.safetensors + adapter_config.json, naming
`--base-model` as the model it loads onto):

    python tools/convert_megatron_to_hf.py --megatron-path ckpt/step_100 --output adapter \
        --peft --base-model Qwen/Qwen3-30B-A3B-Base

See docs/CHECKPOINTS.md and docs/LORA.md.
"""

from __future__ import annotations

import argparse
import sys

VERIFY_TOL = 1e-3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megatron-path", required=True, help="megatron checkpoint directory")
    parser.add_argument("--output", required=True, help="new HF model directory")
    parser.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: as stored)")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="directory with tokenizer files (default: those the checkpoint "
        "carries from its HF conversion, if any)",
    )
    parser.add_argument(
        "--hf-config",
        default=None,
        help="config.json describing the model (for checkpoints without gspo_checkpoint.json)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="compare log-probs (value models: values) of transformers and megatron on "
        "random tokens",
    )
    parser.add_argument("--verify-tol", type=float, default=VERIFY_TOL)
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0)
    parser.add_argument(
        "--lora-weights",
        choices=["merged", "base"],
        default="merged",
        help="a LoRA checkpoint: its adapters merged into the weights, or its base alone",
    )
    parser.add_argument(
        "--peft", action="store_true", help="a LoRA checkpoint's adapters as a PEFT adapter"
    )
    parser.add_argument(
        "--base-model", default=None, help="--peft: adapter_config's base_model_name_or_path"
    )
    args = parser.parse_args(argv)

    from gspo_megatron.checkpoint.convert import (
        convert_megatron_to_hf,
        export_peft_adapter,
        run_conversion_tool,
    )
    from gspo_megatron.megatron.verify import conversion_difference

    if args.peft:
        unused = [
            flag
            for flag, value in (
                ("--tokenizer", args.tokenizer),
                ("--hf-config", args.hf_config),
                ("--verify", args.verify),
                ("--lora-weights", args.lora_weights != "merged"),
            )
            if value
        ]
        if unused:
            parser.error(f"{unused[0]} does not apply to --peft")
        return run_conversion_tool(
            export_peft_adapter,
            args.verify_tol,
            megatron_dir=args.megatron_path,
            output=args.output,
            base_model=args.base_model,
            dtype=args.dtype,
            overwrite=args.overwrite,
        )
    if args.base_model:
        parser.error("--base-model applies to --peft only")

    return run_conversion_tool(
        convert_megatron_to_hf,
        args.verify_tol,
        megatron_dir=args.megatron_path,
        output=args.output,
        dtype=args.dtype,
        tokenizer=args.tokenizer,
        hf_config=args.hf_config,
        overwrite=args.overwrite,
        verify=conversion_difference if args.verify else None,
        max_shard_bytes=int(args.max_shard_size_gb * 1e9),
        lora_weights=args.lora_weights,
    )


if __name__ == "__main__":
    sys.exit(main())
