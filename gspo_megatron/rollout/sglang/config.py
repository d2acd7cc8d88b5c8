"""The `rollout.sglang` section: what the SGLang engine needs, as plain dataclasses (no import
beyond the standard library and config_fields, so gspo_megatron/config.py nests them in
`RunConfig` and checks them with the rest before anything starts).

Field names follow SGLang's flags where they are SGLang's (`tp_size` -> `--tp-size`). Every
error names its key path (`rollout.sglang.weight_sync`, `rollout.sglang.launch[0].port`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from gspo_megatron.config_fields import bounded, choice, raise_on_problems

SECTION = "rollout.sglang"


@dataclass
class ServerLaunchConfig:
    """One SGLang server to start (`rollout.sglang.launch[i]`)."""

    model_path: str
    host: str = "127.0.0.1"
    port: int = bounded(30000, ge=1, le=65535)
    tp_size: int = bounded(1, ge=1)
    dp_size: int = bounded(1, ge=1)
    ep_size: int = bounded(1, ge=1)
    # None: SGLang's own default
    mem_fraction_static: float | None = bounded(None, gt=0, lt=1)
    base_gpu_id: int | None = None  # first GPU of this server when several share a node
    enable_return_routed_experts: bool = False  # needed for routing replay (R3)
    enable_memory_saver: bool = False  # needed for /release_memory_occupation (colocated)
    deterministic: bool = False  # --enable-deterministic-inference: honours sampling_seed
    api_key: str | None = None
    weight_version: str | None = None
    extra_args: list[str] = field(default_factory=list)  # passed through verbatim
    python: str = sys.executable

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"


@dataclass
class SGLangEngineConfig:
    """Everything the SGLang engine needs (Hydra-friendly: plain types, lists, no Literals).
    `validate()` checks it (gspo_megatron/config.py calls it when rollout.engine=sglang, the
    engine when it is built)."""

    # Servers. `urls`: running SGLang servers to attach to (also the targets of weight sync and
    # control calls); `launch`: servers to start here (their URLs are added to `urls`);
    # `router_url`: an sglang-router in front of the servers, used for /generate only.
    urls: list[str] = field(default_factory=list)
    launch: list[ServerLaunchConfig] = field(default_factory=list)
    router_url: str | None = None
    api_key: str | None = None
    # Start: wait this long for every server to answer (docs/SGLANG.md, "Server memory").
    health_timeout_s: float = 900.0
    log_dir: str = "sglang_logs"  # launched servers' stdout/stderr

    # Generation.
    samples_per_request: int = bounded(32, ge=1)  # batch entries per /generate request
    max_concurrency: int = bounded(64, ge=1)  # requests in flight over all servers
    request_timeout_s: float = 1800.0  # one /generate request, however long its samples
    # A server that answers no /health for this long while generating is hung or gone: its
    # requests fail at once, naming it, instead of after request_timeout_s (0: no check).
    liveness_timeout_s: float = bounded(60.0, ge=0)
    # Failures (docs/SGLANG.md): a /generate request that fails on a server (connection lost,
    # 5xx after max_retries, liveness deadline, an answer from other weights) is resubmitted to
    # a healthy server with the same seeds, at most max_resubmits times.
    max_resubmits: int = bounded(8, ge=0)
    # every server's /health, and waits for one
    health_check_interval_s: float = bounded(10.0, gt=0)
    # a launched server with no /health this long is restarted
    restart_after_s: float = bounded(60.0, ge=0)
    max_restarts: int = bounded(5, ge=0)  # per launched server over the run; then out of service
    # generation waits this long for any server, then fails
    recovery_timeout_s: float = bounded(900.0, gt=0)
    connect_timeout_s: float = 10.0
    max_retries: int = 3  # on connection errors and 5xx, with exponential backoff
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    seed: int | None = None  # seeds the per-call seed base when SamplingParams.seed is None
    return_routed_experts: bool = False  # needs --enable-return-routed-experts on the servers
    routed_experts_layers: int | None = None  # the model's num_hidden_layers
    routed_experts_top_k: int | None = None  # the model's num_experts_per_tok
    pause_mode: str = choice("abort", "retract", "in_place")  # /pause_generation mode

    # Weight sync: disk | tensor (colocated) | distributed (disaggregated).
    weight_sync: str = choice("disk", "tensor", "distributed")
    bucket_bytes: int = bounded(512 * 1024 * 1024, ge=1)
    weight_update_timeout_s: float = 1800.0
    # Colocated: free the servers' GPU memory after each generate() (needs enable_memory_saver);
    # weights come back for the next update, KV cache and CUDA graphs for the next generate().
    offload_after_generate: bool = False
    # distributed mode: the trainer's sender is rank 0 of a group at master_address:master_port
    # (0 = pick a free port); the servers must reach that address.
    master_address: str = "127.0.0.1"
    master_port: int = 0
    group_backend: str = "nccl"
    group_name: str = "gspo_weight_update"
    # disk mode: where the sender writes HF safetensors (a filesystem the servers can read) and
    # the model directory whose config/tokenizer files are copied next to them.
    disk_dir: str | None = None
    disk_base_model_path: str | None = None
    # A LoRA policy (lora.rank): merged = base + alpha/r * B @ A sent through weight_sync like
    # full weights; adapter = the adapters through SGLang's LoRA API, a PEFT directory per
    # version under disk_dir (weight_sync=disk). docs/LORA.md, "Weight sync".
    lora_sync: str = choice("merged", "adapter")

    def validate(self, *, servers: bool = True) -> None:
        """Ranges and choices of every key (the launch entries' too), and the keys that only
        work together; ValueError naming the key path. `servers`: some must be given (the
        config check leaves that to its check of the run's inputs, so that a preset whose
        servers come from the launch script is checked anywhere)."""
        raise_on_problems(self, SECTION)

        def bad(key: str, msg: str) -> ValueError:
            return ValueError(f"{SECTION}.{key}: {msg}")

        if servers and not self.urls and not self.launch:
            raise bad("urls", "give server URLs to attach to, or servers to launch")
        if self.weight_sync == "disk" and not self.disk_dir:
            raise bad("disk_dir", "weight_sync=disk needs a directory the servers can read")
        if not self.group_name:
            raise bad(
                "group_name",
                "must not be empty (SGLang 0.5.23 asserts it, and a failed assertion there ends "
                "the server)",
            )
        if self.offload_after_generate and self.router_url:
            raise bad(
                "router_url",
                "offload_after_generate cannot go with a router: sglang-router health-checks its "
                "workers with GET /health, which runs a generation on a server whose memory is "
                "released and kills it (SGLang 0.5.23); list the servers in urls instead",
            )
        for i, lc in enumerate(self.launch):
            if self.offload_after_generate and not lc.enable_memory_saver:
                raise bad(
                    f"launch[{i}].enable_memory_saver",
                    "must be true when offload_after_generate is set",
                )
            if self.weight_sync in ("tensor", "distributed") and lc.dp_size != 1:
                raise bad(
                    f"launch[{i}].dp_size",
                    f"SGLang refuses {self.weight_sync} weight updates when dp_size > 1; "
                    "launch one server per replica (several launch entries) with dp_size=1",
                )
            if self.return_routed_experts and not lc.enable_return_routed_experts:
                raise bad(
                    f"launch[{i}].enable_return_routed_experts",
                    "must be true when return_routed_experts is set",
                )
