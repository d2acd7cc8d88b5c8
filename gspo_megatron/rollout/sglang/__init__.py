"""SGLang rollout engine: launcher, async HTTP client, weight sync (tensor / distributed / disk).

A real SGLang server needs a GPU; see docs/SGLANG.md. Nothing here imports sglang itself.
"""

from gspo_megatron.rollout.sglang.client import RetryPolicy, SGLangClient
from gspo_megatron.rollout.sglang.engine import SGLangEngine, SGLangEngineConfig
from gspo_megatron.rollout.sglang.launcher import (
    ServerLaunchConfig,
    SGLangServerProcess,
    launch_command,
    wait_until_healthy,
)
from gspo_megatron.rollout.sglang.protocol import (
    SGLangConnectionError,
    SGLangError,
    SGLangHTTPError,
    SGLangProtocolError,
    SGLangTimeoutError,
    WeightUpdateError,
)

__all__ = [
    "RetryPolicy",
    "SGLangClient",
    "SGLangConnectionError",
    "SGLangEngine",
    "SGLangEngineConfig",
    "SGLangError",
    "SGLangHTTPError",
    "SGLangProtocolError",
    "SGLangServerProcess",
    "SGLangTimeoutError",
    "ServerLaunchConfig",
    "WeightUpdateError",
    "launch_command",
    "wait_until_healthy",
]
