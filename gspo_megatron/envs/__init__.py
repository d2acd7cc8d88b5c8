"""Environments of multi-turn rollouts: the interface, tool calling in the Qwen3 format, the
built-in calculator and retrieval environments, and the `env` config section."""

from gspo_megatron.envs.base import Environment, EnvironmentContractError, StepResult
from gspo_megatron.envs.registry import ENVIRONMENTS, EnvConfig, register_environment
from gspo_megatron.envs.tools import ToolCall, ToolEnvironment, ToolError, parse_tool_calls

__all__ = [
    "ENVIRONMENTS",
    "EnvConfig",
    "Environment",
    "EnvironmentContractError",
    "StepResult",
    "ToolCall",
    "ToolEnvironment",
    "ToolError",
    "parse_tool_calls",
    "register_environment",
]
