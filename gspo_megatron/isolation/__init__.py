"""Calls that may hang or crash, run in worker processes that are killed on timeout."""

from gspo_megatron.isolation.pool import ProcessPool, WorkerStartError

__all__ = ["ProcessPool", "WorkerStartError"]
