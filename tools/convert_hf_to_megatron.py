"""Convert a Hugging Face Qwen3 / Qwen3-MoE directory into a megatron torch_dist checkpoint.

    python tools/convert_hf_to_megatron.py --hf-path Qwen3-30B-A3B-Base --output ckpt/qwen3-30b \
        [--dtype bf16] [--verify] [--overwrite]

The checkpoint loads on any TP/PP/EP/ETP/CP/DP layout (training: model.init_from=DIR; scoring:
gspo-logprobs --checkpoint DIR). A *ForSequenceClassification directory with one label converts
as a value / reward model (its score.weight becomes the value head). See docs/CHECKPOINTS.md.
"""

from __future__ import annotations

import argparse
import sys

VERIFY_TOL = 1e-3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hf-path", required=True, help="HF model directory (safetensors)")
    parser.add_argument("--output", required=True, help="new megatron checkpoint directory")
    parser.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: as stored)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="compare log-probs (value models: values) of transformers and megatron on "
        "random tokens (loads both models: needs memory for two copies)",
    )
    parser.add_argument("--verify-tol", type=float, default=VERIFY_TOL)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="writer threads (files)")
    args = parser.parse_args(argv)

    from gspo_megatron.checkpoint.convert import convert_hf_to_megatron, run_conversion_tool
    from gspo_megatron.megatron.verify import conversion_difference

    return run_conversion_tool(
        convert_hf_to_megatron,
        args.verify_tol,
        hf_dir=args.hf_path,
        output=args.output,
        dtype=args.dtype,
        overwrite=args.overwrite,
        verify=conversion_difference if args.verify else None,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        threads=args.threads,
    )


if __name__ == "__main__":
    sys.exit(main())
