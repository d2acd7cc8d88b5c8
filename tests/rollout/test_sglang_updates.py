"""The SGLang engine's parts, each alone (no SGLangEngine): the weight updaters of
gspo_megatron/rollout/sglang/updates/ against the stand-in server (tests/rollout/
sglang_test_server.py, which checks every request with SGLang's own classes) or a scripted
client; the weight-update session; the weight versions generation accepts; the pool's moves
after an update; and the first contact, which never runs the model of a released server."""

from __future__ import annotations

import asyncio
import hashlib
import json
import urllib.error

import pytest
import torch
from launch import needs_sglang

from gspo_megatron.event_loop import LoopThread
from gspo_megatron.rollout.sglang.client import SGLangClient
from gspo_megatron.rollout.sglang.config import SGLangEngineConfig
from gspo_megatron.rollout.sglang.generation import WeightVersions
from gspo_megatron.rollout.sglang.memory import (
    MEMORY_TAGS,
    MemoryRecord,
    MemoryTracker,
    ServerMemory,
    identity_of,
)
from gspo_megatron.rollout.sglang.protocol import (
    GenerateOutput,
    SGLangConnectionError,
    SGLangError,
    SGLangHTTPError,
    WeightUpdateError,
)
from gspo_megatron.rollout.sglang.servers import (
    HealthSettings,
    Server,
    ServerInfos,
    ServerPool,
    ServerState,
)
from gspo_megatron.rollout.sglang.startup import ServerStartup
from gspo_megatron.rollout.sglang.updates.disk import DiskUpdater
from gspo_megatron.rollout.sglang.updates.distributed import DistributedUpdater
from gspo_megatron.rollout.sglang.updates.session import begin_session, tp_sizes
from gspo_megatron.rollout.sglang.updates.tensor import TensorUpdater

try:  # tests/rollout may or may not be a package
    from . import sglang_test_server as fake
except ImportError:
    import sglang_test_server as fake


A, B, C = "http://a:1", "http://b:1", "http://c:1"
OPEN = "a weight-update session is already open"


class Source:
    """A WeightSource of a few HF-named tensors, counting the buckets it yields."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tensors = [("model.embed_tokens.weight", torch.randn(32, 16, generator=g).bfloat16())]
        for layer in range(2):
            p = f"model.layers.{layer}"
            self.tensors.append((f"{p}.input_layernorm.weight", torch.randn(16, generator=g)))
            self.tensors.append((f"{p}.mlp.gate.weight", torch.randn(4, 16, generator=g)))
        self.yielded = 0

    def buckets(self, bucket_bytes: int):
        for name, t in self.tensors:  # one tensor per bucket
            self.yielded += 1
            yield [(name, t)]

    def is_sender(self) -> bool:
        return True

    def expected(self) -> dict[str, dict]:
        return {
            n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                "sha256": hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes())
                .hexdigest()}
            for n, t in self.tensors
        }  # fmt: skip


class Scripted(SGLangClient):
    """Answers per (url, path) as scripted: a value, an exception to raise, or a list of those
    taken in turn; by default SGLang's success. Every request is logged: (url, path) in
    `calls`, its body in `bodies`."""

    def __init__(self, script: dict | None = None, healthy: bool = True) -> None:
        super().__init__()
        self.script = dict(script or {})
        self.healthy = healthy
        self.calls: list[tuple[str, str]] = []
        self.bodies: list = []

    async def request(self, method, url, path, body=None, **kw):
        self.calls.append((url, path))
        self.bodies.append(body)
        answer = self.script.get((url, path), {"success": True, "message": "ok"})
        if isinstance(answer, list):
            answer = answer.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    async def is_healthy(self, url, timeout_s=5.0):
        self.calls.append((url, "/health"))
        return self.healthy

    def paths(self, url: str) -> list[str]:
        return [p for u, p in self.calls if u == url]


@pytest.fixture
def loop():
    thread = LoopThread("test-sglang-client")
    yield thread
    thread.close()


def config(urls, **kw) -> SGLangEngineConfig:
    cfg = SGLangEngineConfig(urls=list(urls), **{"weight_sync": "tensor", **kw})
    cfg.validate()
    return cfg


# ---- the weight-update session ------------------------------------------------------------------


def test_begin_closes_a_session_an_earlier_update_left_open_however_sglang_says_so():
    """SGLang refuses a second begin with a failure answer or an HTTP 400: either way the
    session left open is ended first, then begun again; a server that will not end it, or
    that cannot be reached, leaves the update."""
    client = Scripted({
        (A, "/begin_weight_update"): [{"success": False, "message": OPEN}, {"success": True}],
        (B, "/begin_weight_update"): [SGLangHTTPError("400", B, 400, OPEN), {"success": True}],
        (C, "/begin_weight_update"): {"success": False, "message": OPEN},
        (C, "/end_weight_update"): {"success": False, "message": "not yours"},
    })  # fmt: skip
    live, failures = [A, B, C, "http://d:1"], {}
    client.script[("http://d:1", "/begin_weight_update")] = SGLangConnectionError("gone", "d")
    asyncio.run(begin_session(client, live, failures))
    assert live == [A, B]
    for url in (A, B):
        assert client.paths(url) == [
            "/begin_weight_update", "/end_weight_update", "/begin_weight_update"
        ]  # fmt: skip
    assert str(failures[C]) == f"{C}/begin_weight_update failed: not yours"
    assert isinstance(failures["http://d:1"], SGLangConnectionError)


def test_tp_sizes_drop_a_server_that_does_not_answer_and_refuse_layouts_sglang_refuses():
    client = Scripted({
        (A, "/server_info"): {"tp_size": 2},
        (B, "/server_info"): SGLangConnectionError("gone", B),
        (C, "/server_info"): {"tp_size": 4, "dp_size": 1, "pp_size": 1},
    })  # fmt: skip
    live, failures = [A, B, C], {}
    assert asyncio.run(tp_sizes(ServerInfos(client), "tensor", live, failures)) == {A: 2, C: 4}
    assert live == [A, C] and list(failures) == [B]
    for layout, fragment in (({"dp_size": 2}, "dp_size=2; SGLang refuses distributed"),
                             ({"pp_size": 2}, "pp_size=2; distributed weight sync")):  # fmt: skip
        client = Scripted({(A, "/server_info"): {"tp_size": 1, **layout}})
        with pytest.raises(ValueError, match=fragment):
            asyncio.run(tp_sizes(ServerInfos(client), "distributed", [A], {}))


# ---- one updater per mode -----------------------------------------------------------------------


def test_tensor_updater_refused_bucket_takes_that_server_out_and_reads_the_rest(loop):
    """A server that refuses a bucket gets no more of them and no /end_weight_update (no
    finalize over partial weights); the others get every bucket, one payload per TP rank; the
    source is read to the end whatever happens (its collectives need this rank)."""
    client = Scripted({
        (A, "/server_info"): {"tp_size": 2},
        (B, "/server_info"): {"tp_size": 1},
        (B, "/update_weights_from_tensor"): [{"success": True},
                                             {"success": False, "message": "bad shape"}],
    })  # fmt: skip
    updater = TensorUpdater(config([A, B]), client, loop, ServerInfos(client))
    source, live, failures = Source(seed=0), [A, B], {}
    updater.update(source, 3, live, failures)
    assert live == [A] and "bad shape" in str(failures[B])
    assert source.yielded == len(source.tensors) == 5
    assert client.paths(A) == (
        ["/server_info", "/begin_weight_update"]
        + ["/update_weights_from_tensor"] * 5
        + ["/end_weight_update"]
    )
    assert client.paths(B) == (["/server_info", "/begin_weight_update"]
                               + ["/update_weights_from_tensor"] * 2)  # fmt: skip

    nobody = Scripted({(A, "/server_info"): SGLangConnectionError("gone", A)})
    source, live, failures = Source(seed=0), [A], {}
    TensorUpdater(config([A]), nobody, loop, ServerInfos(nobody)).update(source, 1, live, failures)
    assert live == [] and source.yielded == 5


@needs_sglang
def test_tensor_updater_alone_loads_the_stand_in_servers(loop):
    servers = [fake.start_fake_server(tp_size=2), fake.start_fake_server(tp_size=1)]
    client = SGLangClient()
    try:
        urls = [s.url for s in servers]
        updater = TensorUpdater(config(urls), client, loop, ServerInfos(client))
        source, live, failures = Source(seed=1), list(urls), {}
        updater.update(source, 4, live, failures)
        assert live == urls and failures == {}
        for server in servers:
            assert server.weights() == source.expected()
            assert server.state()["version"] == "4" and not server.state()["session_open"]
            server.assert_not_crashed()
    finally:
        loop.run(client.close())
        for server in servers:
            server.stop()


def test_disk_updater_writes_each_version_once_and_keeps_what_the_servers_hold(loop, tmp_path):
    """A re-sync at the same version reads the source (collectives) and sends the same
    directory; a version every server refused leaves the directory they hold in place."""
    client = Scripted()
    updater = DiskUpdater(
        config([A], weight_sync="disk", disk_dir=str(tmp_path)), client, loop, ServerInfos(client)
    )
    writes, write = [], updater.writer.write

    def counted(buckets, version):
        writes.append(version)
        return write(buckets, version)

    updater.writer.write = counted
    updater.update(Source(seed=2), 1, [A], {})
    again = Source(seed=2)
    updater.update(again, 1, [A], {})
    assert writes == [1] and again.yielded == 5
    assert client.paths(A) == ["/update_weights_from_disk"] * 2
    assert client.bodies[0] == client.bodies[1] == {
        "model_path": str(tmp_path / "weights_v1"), "weight_version": "1", "flush_cache": True
    }  # fmt: skip
    client.script[(A, "/update_weights_from_disk")] = {"success": False, "message": "no room"}
    live, failures = [A], {}
    updater.update(Source(seed=3), 2, live, failures)
    assert live == [] and "no room" in str(failures[A])
    assert (tmp_path / "weights_v1").is_dir() and (tmp_path / "weights_v2").is_dir()
    del client.script[(A, "/update_weights_from_disk")]
    updater.update(Source(seed=4), 3, [A], {})
    assert not (tmp_path / "weights_v1").exists() and (tmp_path / "weights_v3").is_dir()


@needs_sglang
def test_distributed_updater_alone_rebuilds_a_broken_group_under_a_new_name(loop):
    """A refused bucket breaks the broadcast: every server of the group is out of step and the
    group is dropped. The next update destroys the broken group on the servers, builds one
    named group_name.1, and loads everything; leave() and close() undo both ends."""
    server = fake.start_fake_server(tp_size=2)
    client = SGLangClient()
    # A name of its own: the broken group stays in this process (it cannot be destroyed safely),
    # and a later test's engine makes the default one.
    cfg = config([server.url], weight_sync="distributed", group_backend="gloo",
                 group_name="updater_test")  # fmt: skip
    updater = DistributedUpdater(cfg, client, loop, ServerInfos(client))
    try:
        server.fault("/update_weights_from_distributed", "weight_fail")
        live, failures = [server.url], {}
        updater.update(Source(seed=5), 1, live, failures)
        assert live == [] and "injected shape mismatch" in str(failures[server.url])
        assert updater.group.group is None and updater.group.dropped == 1
        before = len(server.log())
        source, live, failures = Source(seed=6), [server.url], {}
        updater.update(source, 2, live, failures)
        assert live == [server.url] and failures == {}
        assert server.weights() == source.expected() and server.state()["version"] == "2"
        log = server.log()[before:]
        destroyed = [e["body"]["group_name"] for e in log
                     if e["path"] == "/destroy_weights_update_group"]  # fmt: skip
        assert destroyed == ["updater_test", "updater_test.1"]
        init = next(e["body"] for e in log if e["path"] == "/init_weights_update_group")
        assert init["group_name"] == "updater_test.1" and init["world_size"] == 3
        loop.run(updater.leave())
        updater.close()
        assert not server.state()["groups"] and updater.group.group is None
        server.assert_not_crashed()
    finally:
        updater.close()
        loop.run(client.close())
        server.stop()


# ---- what generation accepts, and the pool after an update --------------------------------------


def out(version: str | None) -> GenerateOutput:
    return GenerateOutput([1], [-0.5], "stop", weight_version=version, routed_experts=None)


def test_weight_versions_before_and_after_the_first_update():
    versions = WeightVersions()
    assert versions.older([out("7"), out("junk")], min_version=3) is None  # launch weights count
    assert versions.of(out(None)) == 0
    versions.set(4)
    assert versions.older([out("4"), out(None), out("5")], min_version=4) is None
    assert versions.older([out("4"), out("3")], min_version=4) == "3"
    assert versions.older([out("junk")], min_version=0) == "junk"  # not a version we set
    assert versions.of(out("5")) == 5 and versions.of(out(None)) == 4


def test_after_an_update_each_server_moves_by_what_failed_there():
    """Took it: healthy. Refused: stale (it answers, with partial weights). Unreachable, or its
    memory state unknown: suspect (checked at once)."""

    async def moves() -> dict:
        async def no_answer(url, timeout_s):
            return False

        pool = ServerPool(
            [Server(u) for u in (A, B, C, "http://d:1")],
            Scripted(),
            HealthSettings(1.0, 60.0, 60.0, 0, 60.0),
            probe=no_answer,
            unusable=lambda url: "unknown" if url == C else None,
            weights_current=lambda url: None,
            on_restart=lambda url: None,
            announce=lambda line: None,
        )
        failures = {
            A: WeightUpdateError("refused", A),
            B: SGLangConnectionError("gone", B),
            C: WeightUpdateError("refused", C),
        }
        await pool.updated([A, B, C, "http://d:1"], failures, 5)
        states = {u: s.state for u, s in pool.servers.items()}
        counters = pool.take_counters()
        await pool.close()
        return states, counters, pool.servers[A].resync_failures

    states, counters, resync_failures = asyncio.run(moves())
    assert states == {A: ServerState.STALE, B: ServerState.SUSPECT, C: ServerState.SUSPECT,
                      "http://d:1": ServerState.HEALTHY}  # fmt: skip
    assert counters["weight_update_failures"] == 3 and resync_failures == 1


# ---- the first contact --------------------------------------------------------------------------


def test_first_contact_never_runs_the_model_of_a_server_left_released(tmp_path):
    """A server whose memory the record says released (same process) is ready once its
    /server_info is read: never GET /health, a generation in SGLang. A resident one waits for
    GET /health (its warm-up); the router is asked GET /health alone."""
    info = {"startup_time": {"tokenizer_e2e": 11.0}, "tp_size": 1}
    record = MemoryRecord(tmp_path / "sglang_memory.json")
    record.write({A: ServerMemory(identity_of(info), set(MEMORY_TAGS))})
    router = "http://router:1"
    client = Scripted({(A, "/server_info"): info, (B, "/server_info"): info}, healthy=False)
    memory = MemoryTracker(client, [A, B], record, call_timeout_s=5.0)
    startup = ServerStartup(client, ServerInfos(client), memory, router=router,
                            announce=lambda line: None, status_interval_s=60.0)  # fmt: skip

    async def contact() -> list:
        return [await startup.contact(u) for u in (A, B, router)]

    assert asyncio.run(contact()) == [
        None,
        "answers GET /server_info, GET /health not 200 yet (warming up)",
        "no GET /health answer",
    ]
    assert client.paths(A) == ["/server_info"]
    assert client.paths(B) == ["/server_info", "/health"]
    assert not memory.resident(A) and memory.resident(B)
    denied = Scripted({(A, "/server_info"): SGLangHTTPError("401", A, 401, "Unauthorized")})
    startup = ServerStartup(denied, ServerInfos(denied), MemoryTracker(denied, [A], None,
                            call_timeout_s=5.0), router=None, announce=print,
                            status_interval_s=60.0)  # fmt: skip
    with pytest.raises(SGLangHTTPError, match="is rollout.sglang.api_key right"):
        asyncio.run(startup.contact(A))


def test_the_startup_wait_ends_when_every_server_is_ready():
    client = Scripted({(A, "/server_info"): {"tp_size": 1}})
    memory = MemoryTracker(client, [A], None, call_timeout_s=5.0)
    lines = []
    startup = ServerStartup(client, ServerInfos(client), memory, router=None,
                            announce=lines.append, status_interval_s=60.0)  # fmt: skip
    asyncio.run(startup.wait([A], {}, timeout_s=5.0))
    assert client.paths(A) == ["/server_info", "/health"] and lines == []
    client.healthy = False
    startup.infos.forget(A)
    with pytest.raises(SGLangError, match=r"did not answer within 0.2 s .*health_timeout_s=0.2"):
        asyncio.run(startup.wait([A], {}, timeout_s=0.2))
    assert len(lines) == 1 and lines[0].startswith("waiting for SGLang servers to answer")


# ---- lora_sync=adapter --------------------------------------------------------------------------


class AdapterSource:
    """A LoRAAdapterSource's stand-in: PEFT-named adapters of two attention layers, rank 4."""

    def __init__(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tensors = []
        for layer in range(2):
            p = f"model.layers.{layer}.self_attn"
            for module, out in (("q_proj", 16), ("o_proj", 16)):
                a, b = torch.randn(4, 16, generator=g), torch.randn(out, 4, generator=g)
                self.tensors += [(f"{p}.{module}.lora_A.weight", a)]
                self.tensors += [(f"{p}.{module}.lora_B.weight", b)]
        self.peft_config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0,
                            "target_modules": ["o_proj", "q_proj"]}  # fmt: skip
        self.yielded = 0

    def buckets(self, bucket_bytes: int):
        self.yielded += 1
        yield list(self.tensors)

    def is_sender(self) -> bool:
        return True


def _lora_server(rank: int = 4, modules=("q_proj", "k_proj", "v_proj", "o_proj"), **kw):
    extra = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules", *modules]
    return fake.start_fake_server(extra_args=extra, **kw)


def _generate(server, lora_path):
    body = {"input_ids": [[1, 2, 3]], "sampling_params": [{"max_new_tokens": 2}],
            "lora_path": lora_path}  # fmt: skip
    try:
        return server._call("POST", "/generate", body)
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


@needs_sglang
def test_adapter_updater_loads_each_version_under_its_own_name(loop, tmp_path):
    """Per version: a PEFT directory written once (safetensors named as PEFT saves them, its
    adapter_config.json), loaded under the version's name, the weight version set, the previous
    name unloaded; its directory stays one version more (SGLang reloads an unloaded name a late
    request names). A server started without --enable-lora, or with a smaller
    --max-lora-rank, fails the update with SGLang's reason; one that loaded the adapter but
    failed after is not sent it again (SGLang would refuse the name)."""
    from safetensors.torch import load_file

    from gspo_megatron.rollout.sglang.updates.adapter import AdapterUpdater, LoRAServing

    servers = [_lora_server(), _lora_server(tp_size=2), fake.start_fake_server(),
               _lora_server(rank=2)]  # fmt: skip
    client = SGLangClient()
    try:
        urls = [s.url for s in servers]
        cfg = config(urls, weight_sync="disk", disk_dir=str(tmp_path), lora_sync="adapter")
        updater = AdapterUpdater(cfg, client, loop, ServerInfos(client))
        source, live, failures = AdapterSource(seed=1), list(urls), {}
        updater.update(source, 1, live, failures)
        assert live == urls[:2] and sorted(failures) == sorted(urls[2:])
        assert "LoRA is not enabled" in str(failures[urls[2]])
        assert "--max-lora-rank" in str(failures[urls[3]])
        assert updater.current == "gspo_v1"
        written = load_file(str(tmp_path / "adapter_v1" / "adapter_model.safetensors"))
        assert written.keys() == {"base_model.model." + n for n, _ in source.tensors}
        for name, t in source.tensors:
            assert torch.equal(written["base_model.model." + name], t)
        config_json = json.loads((tmp_path / "adapter_v1" / "adapter_config.json").read_text())
        assert config_json == source.peft_config
        for server in servers[:2]:
            assert server.state()["version"] == "1"
            assert server.state()["loras"] == {"gspo_v1": str(tmp_path / "adapter_v1")}
        refused = _generate(servers[0], "gspo_v9")  # never loaded
        assert "never been loaded: gspo_v9" in refused["error"]["message"]
        assert isinstance(_generate(servers[0], "gspo_v1"), list)
        assert "LoRA is not enabled" in _generate(servers[2], "gspo_v1")["error"]["message"]
        for version in (2, 3):
            live, failures = urls[:2], {}
            updater.update(AdapterSource(seed=version), version, live, failures)
            assert live == urls[:2] and failures == {}
            for server in servers[:2]:
                held = {f"gspo_v{version}": str(tmp_path / f"adapter_v{version}")}
                assert server.state()["loras"] == held
                assert server.state()["version"] == str(version)
        # v2, unloaded, stays on disk (a late request naming it loads it again: below)
        assert not (tmp_path / "adapter_v1").exists() and (tmp_path / "adapter_v2").is_dir()
        # a re-sync at the same version sends nothing new to a server that holds it
        again = AdapterSource(seed=3)
        live = urls[:2]
        updater.update(again, 3, live, {})
        assert again.yielded == 1 and live == urls[:2]
        # loaded but not tagged: the re-sync tags it and unloads the old one, loading nothing
        servers[0].fault("/update_weight_version", "500")
        live, failures = urls[:2], {}
        updater.update(AdapterSource(seed=4), 4, live, failures)
        assert live == urls[1:2] and list(failures) == urls[:1]
        assert servers[0].state()["version"] == "3" and "gspo_v4" in servers[0].state()["loras"]
        live, failures = urls[:1], {}
        updater.update(AdapterSource(seed=4), 4, live, failures)
        assert live == urls[:1] and failures == {}
        assert servers[0].state()["version"] == "4"
        assert servers[0].state()["loras"] == {"gspo_v4": str(tmp_path / "adapter_v4")}
        assert (tmp_path / "adapter_v3").is_dir() and not (tmp_path / "adapter_v2").exists()
        assert isinstance(_generate(servers[0], "gspo_v3"), list)
        assert "gspo_v3" in servers[0].state()["loras"]
        updater.update(AdapterSource(seed=5), 5, urls[:1], {})  # unloads it with v4
        assert servers[0].state()["loras"] == {"gspo_v5": str(tmp_path / "adapter_v5")}
        serving = LoRAServing.of(source.peft_config)
        info = loop.run(client.get(urls[0], "/server_info"))
        assert serving.refusal(urls[0], info) is None
        info = loop.run(client.get(urls[2], "/server_info"))
        assert "started without --enable-lora" in serving.refusal(urls[2], info)
        info = loop.run(client.get(urls[3], "/server_info"))
        assert "--max-lora-rank 2, below lora.rank=4" in serving.refusal(urls[3], info)
        info = {"enable_lora": True, "max_lora_rank": 8, "lora_target_modules": ["q_proj"]}
        assert "without o_proj (lora.targets)" in serving.refusal(A, info)
        assert "dp_size 2" in serving.refusal(A, {**info, "dp_size": 2})
        assert serving.refusal(A, {**info, "lora_target_modules": ["all"]}) is None
        assert serving.launch_args() == ["--enable-lora", "--max-lora-rank", "4",
                                         "--lora-target-modules", "o_proj", "q_proj"]  # fmt: skip
        for server in servers:
            server.assert_not_crashed()
    finally:
        loop.run(client.close())
        for server in servers:
            server.stop()
