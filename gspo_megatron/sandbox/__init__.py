"""A sandbox for untrusted programs (model-written code): each run in its own process tree with
its own namespaces, no network, a private writable tmpfs, an unprivileged uid, a seccomp filter
and resource limits. See docs/SANDBOX.md.

    sandbox = Sandbox(SandboxConfig(workers=2))
    result = await sandbox.run("print(input()[::-1])", "abc\\n")   # result.stdout == "cba\\n"
"""

from gspo_megatron.sandbox.executor import (
    LAYERS,
    RUN_STATUSES,
    RunResult,
    Sandbox,
    SandboxConfig,
    SandboxLimits,
    SandboxUnavailable,
)
from gspo_megatron.sandbox.languages import LANGUAGES, Language, get_language

__all__ = [
    "LANGUAGES",
    "LAYERS",
    "RUN_STATUSES",
    "Language",
    "RunResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxLimits",
    "SandboxUnavailable",
    "get_language",
]
