"""Lines for the user: on rank 0's terminal (above the progress bar) and in every rank's log.

Every layer that has something to tell the user (the loop, the run directory, evaluations, the
composition root) says it through `note`, so the lines look the same and go to the same places.
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist


def note(message: str) -> None:
    """A line for the user on rank 0 (above the progress bar), and in every rank's log."""
    logging.getLogger("gspo_megatron").info(message)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    from tqdm import tqdm

    tqdm.write(f"[gspo-megatron] {message}", file=sys.stderr)
