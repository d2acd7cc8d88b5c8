"""SGLangEngine against a stand-in SGLang 0.5.23 server (tests/rollout/sglang_test_server.py)
that validates every request body with sglang's own request classes: generation, every weight
sync mode with the begin/end protocol, memory release, control calls, and failures."""

import hashlib
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from launch import needs_sglang

from gspo_megatron.ranks import SingleRank
from gspo_megatron.rollout.base import RolloutUnavailableError, SamplingParams, ServerRolloutEngine
from gspo_megatron.rollout.driver import RolloutDriver
from gspo_megatron.rollout.sglang.config import ServerLaunchConfig, SGLangEngineConfig
from gspo_megatron.rollout.sglang.engine import SGLangEngine
from gspo_megatron.rollout.sglang.protocol import (
    SGLangError,
    SGLangHTTPError,
    SGLangProtocolError,
    SGLangTimeoutError,
    WeightUpdateError,
)
from gspo_megatron.rollout.sglang.servers import ServerState, ServersUnavailableError

try:  # tests/rollout may or may not be a package
    from . import sglang_test_server as fake
except ImportError:
    import sglang_test_server as fake

pytestmark = needs_sglang

FAST = {"health_timeout_s": 20.0, "max_retries": 2, "backoff_s": 0.01, "backoff_max_s": 0.05}


@pytest.fixture(scope="module")
def server():
    s = fake.start_fake_server(tp_size=2, routed_experts=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server_b():
    s = fake.start_fake_server(tp_size=1, routed_experts=False)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def slow_server():
    """Each output token takes 20 ms: weight updates come while requests run."""
    s = fake.start_fake_server(
        tp_size=1, routed_experts=True, extra_args=["--token-delay-s", "0.02"]
    )
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _reset(request):
    used = [request.getfixturevalue(n) for n in ("server", "server_b", "slow_server")
            if n in request.fixturenames]  # fmt: skip
    for srv in used:
        srv.reset()
    yield
    for srv in used:  # nothing the engine did would have killed a real SGLang server
        srv.assert_not_crashed()


def make_engine(urls, partial_rollouts: bool = False, engine_kw=None, **kw) -> SGLangEngine:
    """An engine attached to `urls`; `engine_kw`: SGLangEngine's own keyword arguments
    (memory_record, announce, status_interval_s)."""
    cfg = {"weight_sync": "tensor", **FAST, **kw}
    return SGLangEngine(
        SGLangEngineConfig(urls=list(urls), **cfg),
        partial_rollouts=partial_rollouts,
        **(engine_kw or {}),
    )


class FakeSource:
    """A WeightSource of random HF-named tensors (MoE experts in bf16, norms in fp32)."""

    def __init__(self, seed: int, layers: int = 2, experts: int = 4) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tensors: list[tuple[str, torch.Tensor]] = [
            ("model.embed_tokens.weight", torch.randn(64, 16, generator=g).bfloat16())
        ]
        for layer in range(layers):
            p = f"model.layers.{layer}"
            self.tensors.append((f"{p}.input_layernorm.weight", torch.randn(16, generator=g)))
            self.tensors.append((f"{p}.mlp.gate.weight", torch.randn(experts, 16, generator=g)))
            for e in range(experts):
                for proj, shape in (("gate_proj", (8, 16)), ("up_proj", (8, 16)),
                                    ("down_proj", (16, 8))):  # fmt: skip
                    t = torch.randn(*shape, generator=g).bfloat16()
                    self.tensors.append((f"{p}.mlp.experts.{e}.{proj}.weight", t))
        self.bucket_calls: list[int] = []

    def buckets(self, bucket_bytes: int):
        self.bucket_calls.append(bucket_bytes)
        bucket, size = [], 0
        for name, t in self.tensors:
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += nbytes
        if bucket:
            yield bucket

    def is_sender(self) -> bool:
        return True

    def expected(self) -> dict[str, dict]:
        return {
            n: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                "sha256": hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes())
                .hexdigest()}
            for n, t in self.tensors
        }  # fmt: skip


def paths(srv) -> list[str]:
    return [e["path"] for e in srv.log()]


# ---- generation -------------------------------------------------------------------------------


def test_generate_parses_ids_logprobs_finish_and_routed_experts(server):
    prompts = [[1, 2, 3], [4, 5], [6]]
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_new_tokens=6, seed=100)
    with make_engine([server.url], return_routed_experts=True, routed_experts_layers=2,
                     routed_experts_top_k=2, samples_per_request=4) as eng:  # fmt: skip
        assert isinstance(eng, ServerRolloutEngine)
        groups = eng.generate(prompts, 3, params)
    assert [len(g) for g in groups] == [3, 3, 3]
    seeds = []
    for i, group in enumerate(groups):
        for j, s in enumerate(group):
            seed = 100 + i * 3 + j
            seeds.append(seed)
            ids, lps, _ = fake.fake_completion(prompts[i], seed, "default", 6)
            assert s.prompt_ids == prompts[i]
            assert s.response_ids == ids and s.logprobs == lps
            assert s.finish_reason == "length" and s.weight_version == 0
            want = fake.fake_routed_experts(len(prompts[i]) + len(ids) - 1)
            assert s.routed_experts.shape == (len(prompts[i]) + 5, 2, 2)
            assert (s.routed_experts == want).all()
    reqs = [e["body"] for e in server.log() if e["path"] == "/generate"]
    assert [len(r["input_ids"]) for r in reqs] == [4, 4, 1]  # 9 samples, 4 per request
    sent = [sp for r in reqs for sp in r["sampling_params"]]
    assert sorted(sp["sampling_seed"] for sp in sent) == seeds
    assert all(sp["top_k"] == 50 and "n" not in sp for sp in sent)
    assert all(r["return_logprob"] and r["logprob_start_len"] == -1 for r in reqs)
    assert all(r["return_routed_experts"] for r in reqs)


def test_cached_token_fraction_of_a_second_turn(server):
    """SGLang's meta_info.cached_tokens, summed against the input tokens: a second turn finds
    its context (turn one's prompt and response but its last token) in the radix cache, a
    prompt seen before all its tokens but the last; a weight update flushes it all."""
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    params = SamplingParams(max_new_tokens=5, seed=3)
    with make_engine([server.url]) as eng:
        first = [g[0] for g in eng.generate(prompts, 1, params)]
        m = eng.fault_metrics()
        assert m["rollout/prefix_cache_reused_tokens"] == 0.0
        assert m["rollout/prefill_tokens"] == 7.0
        contexts = [p + s.response_ids + [9, 9] for p, s in zip(prompts, first, strict=True)]
        eng.generate(contexts, 1, params)
        m = eng.fault_metrics()
        new = 3 * len(contexts)  # turn one's last token and the observation's two
        held = sum(len(c) for c in contexts) - new
        assert m["rollout/prefix_cache_reused_tokens"] == held
        assert m["rollout/prefill_tokens"] == new
        assert m["rollout/prefix_cache_reused_fraction"] == held / (held + new)
        assert m["rollout/prefix_cache_unreported"] == 0.0
        eng.generate([prompts[0]], 2, params)
        assert eng.fault_metrics()["rollout/prefix_cache_reused_tokens"] == 2 * 3
        eng.update_weights(FakeSource(seed=0), 1)
        eng.generate(contexts, 1, params)
        assert eng.fault_metrics()["rollout/prefix_cache_reused_tokens"] == 0.0


def test_stop_token_ends_a_sample_with_stop(server):
    prompt = [9, 9, 9]
    ids, _, _ = fake.fake_completion(prompt, 5, "default", 10)
    stop = ids[3]
    with make_engine([server.url]) as eng:
        (group,) = eng.generate([prompt], 1, SamplingParams(max_new_tokens=10, seed=5,
                                                            stop_token_ids=(stop,)))  # fmt: skip
    assert group[0].response_ids == ids[: ids.index(stop) + 1]
    assert group[0].finish_reason == "stop"


def test_unseeded_calls_still_give_distinct_seeds(server):
    with make_engine([server.url], seed=0) as eng:
        eng.generate([[1, 2]], 4, SamplingParams(max_new_tokens=2))
        eng.generate([[1, 2]], 4, SamplingParams(max_new_tokens=2))
    seeds = [sp["sampling_seed"] for e in server.log() if e["path"] == "/generate"
             for sp in e["body"]["sampling_params"]]  # fmt: skip
    assert len(set(seeds)) == 8


def test_requests_spread_over_servers(server, server_b):
    with make_engine([server.url, server_b.url], samples_per_request=1, max_concurrency=2) as eng:
        groups = eng.generate([[1], [2], [3], [4]], 2, SamplingParams(max_new_tokens=2, seed=1))
    assert len(groups) == 4
    a, b = paths(server).count("/generate"), paths(server_b).count("/generate")
    assert a + b == 8 and a >= 2 and b >= 2


def test_router_gets_generation_and_workers_get_weights(server, server_b):
    """With router_url, /generate goes to the router; weight sync and control calls go to the
    worker URLs (given without a scheme here)."""
    worker = server.url.removeprefix("http://")
    with make_engine([worker], router_url=server_b.url + "/") as eng:
        eng.generate([[1, 2]], 2, SamplingParams(max_new_tokens=2, seed=0))
        eng.update_weights(FakeSource(seed=10, layers=1, experts=2), version=1)
        eng.flush_cache()
    assert paths(server_b) == ["/generate"]
    assert "/generate" not in paths(server) and "/end_weight_update" in paths(server)


# ---- weight sync ----------------------------------------------------------------------------


def test_tensor_sync_wraps_buckets_in_begin_end(server):
    src = FakeSource(seed=1)
    with make_engine([server.url], weight_sync="tensor", bucket_bytes=4096) as eng:
        before = eng.generate([[1, 2, 3]], 1, SamplingParams(max_new_tokens=4, seed=3))
        eng.update_weights(src, version=1)
        after = eng.generate([[1, 2, 3]], 1, SamplingParams(max_new_tokens=4, seed=3))
    log = server.log()
    seq = [e["path"] for e in log if e["path"] != "/server_info"]
    updates = [e for e in log if e["path"] == "/update_weights_from_tensor"]
    assert len(updates) >= 3  # several buckets
    assert seq == (
        ["/generate", "/begin_weight_update"]
        + ["/update_weights_from_tensor"] * len(updates)
        + ["/end_weight_update", "/generate"]
    )
    for u in updates:
        assert len(u["body"]["serialized_named_tensors"]) == 2  # one payload per TP rank
        assert u["body"]["load_format"] == "flattened_bucket"
        assert u["body"]["weight_version"] == "1"
    assert server.weights() == src.expected()
    assert server.state()["version"] == "1" and not server.state()["session_open"]
    assert after[0][0].weight_version == 1 and before[0][0].weight_version == 0
    assert after[0][0].response_ids != before[0][0].response_ids


def test_distributed_sync_broadcasts_over_a_real_group(server, server_b):
    src1, src2 = FakeSource(seed=2), FakeSource(seed=3)
    with make_engine([server.url, server_b.url], weight_sync="distributed", bucket_bytes=4096,
                     group_backend="gloo") as eng:  # fmt: skip
        eng.update_weights(src1, version=1)
        assert server.weights() == src1.expected() == server_b.weights()
        eng.update_weights(src2, version=2)
        assert server.weights() == src2.expected() == server_b.weights()
        (g,) = eng.generate([[5]], 1, SamplingParams(max_new_tokens=2, seed=0))
        assert g[0].weight_version == 2
    for srv, offset in ((server, 1), (server_b, 3)):  # TP 2 then TP 1, after the trainer
        log = [e for e in srv.log() if e["path"] not in ("/server_info", "/generate")]
        init = next(e["body"] for e in log if e["path"] == "/init_weights_update_group")
        assert init["world_size"] == 4 and init["rank_offset"] == offset
        assert init["backend"] == "gloo"
        n = sum(1 for e in log if e["path"] == "/update_weights_from_distributed") // 2
        one = ["/begin_weight_update"] + ["/update_weights_from_distributed"] * n
        assert [e["path"] for e in log] == (
            ["/destroy_weights_update_group", "/init_weights_update_group"]  # stale group, new
            + (one + ["/end_weight_update"]) * 2  # the group is made once
            + ["/destroy_weights_update_group"]  # close() leaves it
        )
        body = next(e["body"] for e in log if e["path"] == "/update_weights_from_distributed")
        assert body["load_format"] == "flattened_bucket" and body["weight_version"] == "1"
        assert not srv.state()["groups"]


def test_disk_sync_writes_safetensors_and_loads_them(server, tmp_path):
    base = tmp_path / "hf_model"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen3_moe"}')
    src1, src2 = FakeSource(seed=4), FakeSource(seed=5)
    with make_engine([server.url], weight_sync="disk", disk_dir=str(tmp_path / "sync"),
                     disk_base_model_path=str(base), bucket_bytes=8192) as eng:  # fmt: skip
        eng.update_weights(src1, version=1)
        assert server.weights() == src1.expected()
        eng.update_weights(src2, version=2)
        assert server.weights() == src2.expected()
    calls = [e for e in server.log() if e["path"] == "/update_weights_from_disk"]
    assert [c["body"]["weight_version"] for c in calls] == ["1", "2"]
    first, second = (Path(c["body"]["model_path"]) for c in calls)
    assert not first.exists() and (second / "config.json").exists()
    # disk updates are not a begin/end session in sglang 0.5.23 (the loader finalizes itself)
    assert "/begin_weight_update" not in paths(server)


def test_failed_update_raises_with_the_servers_reason(server):
    server.fault("/update_weights_from_tensor", "weight_fail")
    with make_engine([server.url], health_check_interval_s=0.2) as eng:
        with pytest.raises(WeightUpdateError, match="injected shape mismatch") as e:
            eng.update_weights(FakeSource(seed=6), version=7)
        # Version 7 is the policy's now; the server is fenced until it holds it, and due for
        # another full update one health-check interval after the failed one.
        assert eng.version == 7 and eng.pool.in_state(ServerState.STALE) == [server.url]
        assert eng.servers_to_resync() == []
        time.sleep(0.3)
        assert eng.servers_to_resync() == [server.url]
    assert server.url in str(e.value) and "failed on every server" in str(e.value)
    assert "/end_weight_update" not in paths(server)  # no finalize over partial weights


@pytest.mark.parametrize("weight_sync", ["tensor", "disk"])
def test_failed_update_fences_the_server_until_a_full_update_succeeds(
    server, tmp_path, weight_sync
):
    path = "/update_weights_from_tensor" if weight_sync == "tensor" else "/update_weights_from_disk"
    prompt, params = [[1, 2, 3]], SamplingParams(max_new_tokens=4, seed=3)
    options = {"disk_dir": str(tmp_path)} if weight_sync == "disk" else {"bucket_bytes": 4096}
    src = FakeSource(seed=6)
    fast = {"recovery_timeout_s": 1.0, "health_check_interval_s": 0.2}
    with make_engine([server.url], weight_sync=weight_sync, **options, **fast) as eng:
        server.fault(path, "weight_fail")
        with pytest.raises(WeightUpdateError):
            eng.update_weights(src, version=1)
        assert eng.pool.in_state(ServerState.STALE) == [server.url]
        with pytest.raises(ServersUnavailableError, match="stale .*weight update to version 1"):
            eng.generate(prompt, 1, params)  # waits recovery_timeout_s for a current server
        # The next update closes the session the failure left open and loads everything.
        eng.update_weights(src, version=2)
        assert eng.pool.serving() == [server.url] and eng.version == 2
        out = eng.generate(prompt, 1, params)
    assert out[0][0].weight_version == 2
    assert server.weights() == src.expected()
    assert server.state()["version"] == "2" and not server.state()["session_open"]


def test_a_session_left_open_by_a_killed_trainer_is_closed_by_the_next_one(server):
    # A trainer killed between /begin_weight_update and /end_weight_update.
    status, _ = _post_raw(server, "/begin_weight_update", {})
    assert status == 200 and server.state()["session_open"]
    src = FakeSource(seed=8)
    with make_engine([server.url], weight_sync="tensor") as eng:
        eng.update_weights(src, version=1)
    seq = [p for p in paths(server) if p.endswith("_weight_update")]
    assert seq[-4:-1] == ["/begin_weight_update", "/end_weight_update", "/begin_weight_update"]
    assert server.weights() == src.expected() and not server.state()["session_open"]


def test_refused_distributed_bucket_fails_fast(server):
    with make_engine([server.url], weight_sync="distributed", group_backend="gloo") as eng:
        server.fault("/update_weights_from_distributed", "weight_fail")
        t0 = time.monotonic()
        with pytest.raises(WeightUpdateError, match="injected shape mismatch"):
            eng.update_weights(FakeSource(seed=7), version=1)
        assert time.monotonic() - t0 < 20  # not the group timeout
        # The broken group is rebuilt by the next update, which loads everything.
        src = FakeSource(seed=8)
        eng.update_weights(src, version=2)
        assert eng.pool.serving() == [server.url]
    assert server.weights() == src.expected()


def _post_raw(srv, path: str, body: dict) -> tuple[int, bytes]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        srv.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        # 0.5.23's session rule: tensor updates only between begin and end
        ("/update_weights_from_tensor",
         {"serialized_named_tensors": [""], "load_format": "flattened_bucket"},
         b"begin_weight_update"),
        # pydantic over io_struct: a required field missing
        ("/update_weights_from_distributed", {"names": ["w"], "shapes": [[1]]}, b"dtypes"),
        ("/init_weights_update_group", {"master_address": "h", "master_port": "x"}, b"master_port"),
        # the /generate JSON contract: `seed` is not SGLang's name for it
        ("/generate", {"input_ids": [[1]], "sampling_params": [{"seed": 1}]}, b"seed"),
        # SamplingParams.verify
        ("/generate", {"input_ids": [[1]], "sampling_params": [{"top_p": 0}]}, b"top_p"),
        # normalize_batch_and_arguments
        ("/generate", {"input_ids": [], "sampling_params": {}}, b"input_ids cannot be empty"),
    ],
)  # fmt: skip
def test_test_server_rejects_what_sglang_rejects(server, path, body, fragment):
    """The stand-in's validation is not vacuous: bodies SGLang refuses get a 400 here too."""
    status, raw = _post_raw(server, path, body)
    assert status == 400 and fragment in raw


def test_offload_releases_after_generate_and_resumes_when_needed(server):
    with make_engine([server.url], offload_after_generate=True) as eng:
        eng.generate([[1]], 1, SamplingParams(max_new_tokens=2, seed=0))
        assert server.state()["released"] == ["cuda_graph", "kv_cache", "weights"]
        eng.update_weights(FakeSource(seed=8), version=1)
        assert server.state()["released"] == ["cuda_graph", "kv_cache"]
        eng.generate([[1]], 1, SamplingParams(max_new_tokens=2, seed=0))
    log = [e for e in server.log() if e["path"] != "/server_info"]
    seq = [e["path"] for e in log]
    begin = seq.index("/begin_weight_update")
    assert seq[begin - 1] == "/resume_memory_occupation"
    assert log[begin - 1]["body"] == {"tags": ["weights"]}
    second_gen = len(seq) - 1 - seq[::-1].index("/generate")
    assert seq[second_gen - 1] == "/resume_memory_occupation"
    assert log[second_gen - 1]["body"] == {"tags": ["kv_cache", "cuda_graph"]}


# ---- control calls ------------------------------------------------------------------------------


def _recorded(record: Path, url: str) -> dict:
    return json.loads(record.read_text())["servers"][url]


def test_a_resumed_run_brings_back_what_the_last_one_left_released(server, tmp_path):
    """close() leaves the memory as it is and the run directory's record says so; the next
    engine with that record resumes exactly the released tags, when it needs them."""
    record = tmp_path / "sglang_memory.json"
    memory = {"offload_after_generate": True, "engine_kw": {"memory_record": record}}
    one = [[1]], 1, SamplingParams(max_new_tokens=2, seed=0)
    with make_engine([server.url], **memory) as eng:
        eng.update_weights(FakeSource(seed=8), version=1)
        eng.generate(*one)
    assert server.state()["released"] == ["cuda_graph", "kv_cache", "weights"]
    assert _recorded(record, server.url)["released"] == ["weights", "kv_cache", "cuda_graph"]
    src = FakeSource(seed=9)
    with make_engine([server.url], **memory) as eng:
        eng.update_weights(src, version=2)  # into resumed weights only
        assert server.state()["released"] == ["cuda_graph", "kv_cache"]
        assert _recorded(record, server.url)["released"] == ["kv_cache", "cuda_graph"]
        (g,) = eng.generate(*one)
    assert g[0].weight_version == 2 and server.weights() == src.expected()
    resumes = [e["body"]["tags"] for e in server.log() if e["path"] == "/resume_memory_occupation"]
    assert resumes == [["weights"], ["kv_cache", "cuda_graph"]]


def test_a_server_restarted_since_the_record_gets_no_resume(tmp_path):
    """The record names the server process (/server_info startup_time): a new process at the URL
    holds everything, and resuming any tag there would kill it (KeyError in SGLang)."""
    record = tmp_path / "sglang_memory.json"
    memory = {"offload_after_generate": True, "engine_kw": {"memory_record": record}}
    srv = fake.start_fake_server(routed_experts=False)
    back = None
    try:
        with make_engine([srv.url], **memory) as eng:
            eng.generate([[1]], 1, SamplingParams(max_new_tokens=2, seed=0))
        assert _recorded(record, srv.url)["released"] == ["weights", "kv_cache", "cuda_graph"]
        srv.stop()
        back = fake.start_fake_server(routed_experts=False, port=srv.port)
        with make_engine([back.url], **memory) as eng:
            eng.update_weights(FakeSource(seed=3, layers=1, experts=2), version=1)
            eng.generate([[1]], 1, SamplingParams(max_new_tokens=2, seed=0))
        back.assert_not_crashed()
        assert "/resume_memory_occupation" not in paths(back)
        assert back.state()["released"] == ["cuda_graph", "kv_cache", "weights"]  # released after
    finally:
        for s in (srv, back):
            if s is not None:
                s.stop()


def test_a_memory_call_without_an_answer_leaves_the_server_unused_until_it_restarts(tmp_path):
    """A release whose connection drops may or may not have happened: the server's memory is
    unknown, so it gets nothing that could run its model (no generation, weight update or
    GET /health) and no memory call, until a new process answers at its URL."""
    record = tmp_path / "sglang_memory.json"
    lines = []
    srv = fake.start_fake_server(routed_experts=False)
    back = None
    one = [[1]], 1, SamplingParams(max_new_tokens=2, seed=0)
    fast = {"health_check_interval_s": 0.2, "recovery_timeout_s": 30.0}
    try:
        eng = make_engine(
            [srv.url], offload_after_generate=True, weight_sync="disk", disk_dir=str(tmp_path),
            engine_kw={"memory_record": record, "announce": lines.append}, **fast,
        )  # fmt: skip
        src = FakeSource(seed=2, layers=1, experts=2)
        with eng:
            eng.update_weights(src, version=1)
            srv.fault("/release_memory_occupation", "close")
            eng.generate(*one)  # answered; the release after it never is
            assert eng.pool.servers[srv.url].state is ServerState.SUSPECT
            assert "memory state is unknown" in eng.pool.servers[srv.url].reason
            assert _recorded(record, srv.url)["in_doubt"] == ["weights", "kv_cache", "cuda_graph"]
            seen, health = len(srv.log()), srv.state()["health_checks"]
            time.sleep(1.0)  # health checks go on: with GET /server_info only
            assert {e["path"] for e in srv.log()[seen:]} == {"/server_info"}
            assert srv.state()["health_checks"] == health
            assert not eng.servers_to_resync()
            srv.stop()
            back = fake.start_fake_server(routed_experts=False, port=srv.port)
            _wait_for(lambda: eng.servers_to_resync() == [srv.url])  # resident, launch weights
            eng.update_weights(src, version=1, urls=[srv.url])
            (g,) = eng.generate(*one)
        assert g[0].weight_version == 1
        assert _recorded(record, srv.url)["in_doubt"] == []
        back.assert_not_crashed()
        assert "/resume_memory_occupation" not in paths(back)
    finally:
        for s in (srv, back):
            if s is not None:
                s.stop()


def test_release_memory_refuses_while_a_job_runs(slow_server):
    """SGLang asserts the server is idle on a release (the server exits otherwise)."""
    with make_engine([slow_server.url]) as eng:
        job = eng.start_generate([[1, 2]], 1, SamplingParams(max_new_tokens=50, seed=0))
        _wait_for(lambda: "/generate" in paths(slow_server))
        with pytest.raises(RuntimeError, match="asserts the server is idle"):
            eng.release_memory()
        job.result(timeout=30)
        eng.release_memory(["kv_cache"])
        eng.resume_memory()
    assert slow_server.state()["released"] == []


def test_pause_resume_flush_health(server):
    with make_engine([server.url], pause_mode="retract") as eng:
        eng.pause()
        assert server.state()["paused"]
        eng.resume()
        eng.flush_cache()
        assert eng.health()
    log = [e for e in server.log() if e["path"] != "/server_info"]
    assert [e["path"] for e in log] == ["/pause_generation", "/continue_generation", "/flush_cache"]
    assert log[0]["body"] == {"mode": "retract"}


def test_abort_all_ends_running_requests_with_abort(server):
    server.fault("/generate", "hold")
    with make_engine([server.url]) as eng:
        out = {}
        t = threading.Thread(
            target=lambda: out.update(g=eng.generate([[1, 2]], 1, SamplingParams(seed=1)))
        )
        t.start()
        for _ in range(200):
            if "/generate" in paths(server):
                break
            time.sleep(0.02)
        eng.abort_all()
        t.join(timeout=20)
    assert out["g"][0][0].finish_reason == "abort"


# ---- generation overlapping weight updates (rollout.mode one_step_off / async) ----------------


def test_an_update_with_partial_rollouts_continues_the_requests_it_aborts(slow_server):
    """rollout.mode=async: the update aborts the requests running (/pause_generation mode abort),
    loads the weights, and each sample continues from its prompt plus the tokens it has, with
    its seed; every token keeps the log-prob and the version of the weights that sampled it."""
    prompts, n, new = [[1, 2, 3], [4, 5]], 2, 60
    params = SamplingParams(max_new_tokens=new, seed=11)
    routes = {"return_routed_experts": True, "routed_experts_layers": fake.NUM_LAYERS,
              "routed_experts_top_k": fake.TOP_K}  # fmt: skip
    with make_engine([slow_server.url], partial_rollouts=True, **routes) as eng:
        eng.update_weights(FakeSource(seed=1), version=0)
        job = eng.start_generate(prompts, n, params)
        _wait_for(lambda: "/generate" in paths(slow_server))
        time.sleep(0.2)  # about 10 of the 60 tokens (20 ms each)
        eng.update_weights(FakeSource(seed=2), version=1)
        groups = job.result(timeout=30)
    log = slow_server.log()
    order = [e["path"] for e in log]
    pause, resume = order.index("/pause_generation"), order.index("/continue_generation")
    assert log[pause]["body"] == {"mode": "abort"}
    assert pause < order.index("/update_weights_from_tensor", pause) < resume
    first, second = (e["body"] for e in log if e["path"] == "/generate")
    for k, s in enumerate(s for group in groups for s in group):
        prompt, seed = prompts[k // n], 11 + k
        cut = s.token_versions.count(0)
        assert 0 < cut < new and s.token_versions == [0] * cut + [1] * (new - cut)
        before, before_lps, _ = fake.fake_completion(prompt, seed, "0", new)
        after, after_lps, _ = fake.fake_completion(prompt + before[:cut], seed, "1", new - cut)
        assert s.response_ids == before[:cut] + after
        assert s.logprobs == before_lps[:cut] + after_lps
        assert s.finish_reason == "length" and s.weight_version == 1
        assert (s.routed_experts == fake.fake_routed_experts(len(prompt) + new - 1)).all()
        assert first["input_ids"][k] == prompt
        assert second["input_ids"][k] == prompt + before[:cut]  # token ids, never re-tokenised
        assert second["sampling_params"][k]["max_new_tokens"] == new - cut
        assert second["sampling_params"][k]["sampling_seed"] == seed
    assert job.job_stats.weight_swaps == 1


def test_without_partial_rollouts_an_update_waits_for_the_requests_running(slow_server):
    """rollout.mode=one_step_off: a batch in flight finishes on the weights it started with (SGLang
    holds the update until it ends), and a job that needs newer weights starts after them."""
    prompts, params = [[7, 8]], SamplingParams(max_new_tokens=25, seed=4)
    with make_engine([slow_server.url]) as eng:
        eng.update_weights(FakeSource(seed=1), version=0)
        running = eng.start_generate(prompts, 2, params)
        _wait_for(lambda: "/generate" in paths(slow_server))
        waiting = eng.start_generate(prompts, 2, params, min_version=1)
        time.sleep(0.2)
        assert not waiting.done()
        eng.update_weights(FakeSource(seed=2), version=1)
        old, new = running.result(timeout=30), waiting.result(timeout=30)
    assert "/pause_generation" not in paths(slow_server)
    for samples, version in ((old[0], 0), (new[0], 1)):
        for k, s in enumerate(samples):
            ids, _, _ = fake.fake_completion([7, 8], 4 + k, str(version), 25)
            assert s.response_ids == ids and s.weight_version == version
            assert s.token_versions is None and s.finish_reason == "length"
    assert waiting.job_stats.weights_wait_s >= 0.2
    assert running.job_stats.weight_swaps == 0


def test_an_abort_that_no_update_caused_ends_the_sample(slow_server):
    """With partial rollouts on, only the engine's own swaps continue a response: an abort from
    elsewhere ends it with finish reason abort, as in sync mode."""
    with make_engine([slow_server.url], partial_rollouts=True) as eng:
        job = eng.start_generate([[1]], 1, SamplingParams(max_new_tokens=50, seed=2))
        _wait_for(lambda: "/generate" in paths(slow_server))
        time.sleep(0.1)
        eng.abort_all()
        (group,) = job.result(timeout=30)
    assert group[0].finish_reason == "abort" and 0 < len(group[0].response_ids) < 50
    assert paths(slow_server).count("/generate") == 1


def test_partial_rollouts_refuse_a_server_older_than_sglang_0_5_6():
    srv = fake.start_fake_server(routed_experts=False, extra_args=["--release", "0.5.5.post3"])
    try:
        too_old = r"runs SGLang 0\.5\.5\.post3: .* >= 0\.5\.6"
        with (
            make_engine([srv.url], partial_rollouts=True) as eng,
            pytest.raises(ValueError, match=too_old),
        ):
            eng.update_weights(FakeSource(seed=1), version=0)
    finally:
        srv.stop()


def test_close_cancels_the_jobs_in_flight(slow_server):
    eng = make_engine([slow_server.url])
    job = eng.start_generate([[1, 2]], 1, SamplingParams(max_new_tokens=500, seed=0))
    _wait_for(lambda: "/generate" in paths(slow_server))
    t0 = time.monotonic()
    eng.close()
    assert job.cancelled() and time.monotonic() - t0 < 5


# ---- failures -----------------------------------------------------------------------------------


def test_5xx_is_retried_then_succeeds(server):
    server.fault("/generate", "500", count=2)
    with make_engine([server.url]) as eng:
        (g,) = eng.generate([[3]], 1, SamplingParams(max_new_tokens=2, seed=0))
    assert len(g) == 1 and paths(server).count("/generate") == 3


def test_persistent_5xx_gives_up_naming_the_url(server):
    server.fault("/generate", "500", count=100)
    eng = make_engine([server.url], max_resubmits=1)
    with eng, pytest.raises(SGLangHTTPError) as e:
        eng.generate([[3]], 1, SamplingParams(max_new_tokens=2, seed=0))
    assert e.value.status == 500 and "injected internal error" in str(e.value)
    assert f"{server.url}/generate" in str(e.value) and "3 attempts" in str(e.value)


def test_dropped_connection_is_retried(server):
    server.fault("/generate", "close", count=1)
    with make_engine([server.url]) as eng:
        (g,) = eng.generate([[3]], 1, SamplingParams(max_new_tokens=2, seed=0))
    assert len(g) == 1


def test_slow_server_times_out_naming_the_url(server):
    server.fault("/generate", "slow", delay_s=3.0)
    eng = make_engine([server.url], request_timeout_s=0.5, max_resubmits=0)
    with eng, pytest.raises(SGLangTimeoutError, match=r"/generate timed out after 0.5 s") as e:
        eng.generate([[3]], 1, SamplingParams(max_new_tokens=2, seed=0))
    assert server.url in str(e.value)


def test_hung_server_fails_after_the_liveness_deadline_not_the_request_timeout():
    srv = fake.start_fake_server(routed_experts=False)
    try:
        eng = make_engine(
            [srv.url], request_timeout_s=120.0, liveness_timeout_s=2.0, recovery_timeout_s=2.0,
            health_check_interval_s=0.5,
        )  # fmt: skip
        with eng:
            eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2, seed=0))
            srv.proc.send_signal(signal.SIGSTOP)  # hung: connections open, nothing answers
            t0 = time.monotonic()
            # The request fails after the liveness deadline; no other server takes it within
            # recovery_timeout_s.
            hung = "suspect .*liveness_timeout_s=2"
            with pytest.raises(ServersUnavailableError, match=hung) as e:
                eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2, seed=0))
            assert time.monotonic() - t0 < 20
            assert srv.url in str(e.value) and "answered no /health" in str(e.value)
            srv.proc.send_signal(signal.SIGCONT)
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        srv.stop()


def test_long_generation_on_a_live_server_outlasts_the_liveness_deadline(server):
    server.fault("/generate", "slow", delay_s=3.0)
    with make_engine([server.url], liveness_timeout_s=1.0) as eng:
        t0 = time.monotonic()
        (g,) = eng.generate([[3]], 1, SamplingParams(max_new_tokens=2, seed=0))
    assert len(g) == 1 and time.monotonic() - t0 >= 3.0  # health kept answering meanwhile


def test_malformed_json_is_a_clear_error(server):
    server.fault("/generate", "malformed")
    eng = make_engine([server.url])
    with eng, pytest.raises(SGLangProtocolError, match="malformed JSON from .*/generate"):
        eng.generate([[3]], 1, SamplingParams(max_new_tokens=2, seed=0))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_attach_to_a_closed_port_fails_naming_the_url():
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(SGLangError, match=f"{url} did not answer within 0.3 s"):
        make_engine([url], health_timeout_s=0.3)


def _timed_lines() -> tuple[list[tuple[float, str]], object]:
    t0, lines = time.monotonic(), []
    return lines, lambda line: lines.append((time.monotonic() - t0, line))


def test_the_start_up_wait_says_what_it_waits_for_at_once_then_every_interval():
    url = f"http://127.0.0.1:{_closed_port()}"
    lines, announce = _timed_lines()
    with pytest.raises(SGLangError, match="did not answer within 2.5 s"):
        make_engine([url], health_timeout_s=2.5,
                    engine_kw={"announce": announce, "status_interval_s": 1.0})  # fmt: skip
    (t, first), *status = lines
    assert t < 1.0  # at once
    assert first.startswith(f"waiting for SGLang servers to answer: {url} (attached): no ")
    assert re.search(r"until \d\d:\d\d:\d\d \(rollout.sglang.health_timeout_s=2.5\)$", first)
    assert 1 <= len(status) <= 3 and all("still waiting for SGLang servers after" in x
                                         for _, x in status)  # fmt: skip


def test_a_wait_for_a_server_that_can_generate_says_so_at_once_then_every_interval():
    srv = fake.start_fake_server(routed_experts=False)
    lines, announce = _timed_lines()
    back = None
    eng = make_engine(
        [srv.url], health_check_interval_s=0.2, recovery_timeout_s=30.0,
        engine_kw={"announce": announce, "status_interval_s": 1.0},
    )  # fmt: skip
    try:
        srv.stop()
        job = eng.start_generate([[1]], 1, SamplingParams(max_new_tokens=2, seed=0))
        _wait_for(lambda: len(lines) >= 3)  # the first line and two status lines
        back = fake.start_fake_server(routed_experts=False, port=srv.port)
        job.result(timeout=30)
    finally:
        eng.close()
        for s in (srv, back):
            if s is not None:
                s.stop()
    (t0, first), (t1, second), (t2, _), *rest = lines
    assert first.startswith(f"no SGLang server can generate: {srv.url}: suspect (")
    assert "(rollout.sglang.recovery_timeout_s=30)" in first
    assert second.startswith("still no SGLang server can generate after 1 s (until ")
    assert 0.5 < t1 - t0 < 2.0 and 0.5 < t2 - t1 < 2.0
    assert rest[-1][1].startswith(f"SGLang server {srv.url} can generate again after ")


def test_server_that_dies_gives_a_connection_error():
    srv = fake.start_fake_server(routed_experts=False)
    eng = make_engine([srv.url], recovery_timeout_s=1.0, health_check_interval_s=0.2)
    try:
        srv.stop()
        assert not eng.health()
        with pytest.raises(ServersUnavailableError, match=f"{srv.url}: suspect .*cannot reach"):
            eng.generate([[1]], 1, SamplingParams(max_new_tokens=2, seed=0))
    finally:
        eng.close()


def test_api_key_is_sent_and_required():
    srv = fake.start_fake_server(api_key="s3cret", routed_experts=False, health_delay_s=0.5)
    try:
        with make_engine([srv.url], api_key="s3cret") as eng:  # waits for the late /health too
            assert eng.generate([[1]], 1, SamplingParams(max_new_tokens=1, seed=0))
            eng.flush_cache()
        with pytest.raises(SGLangHTTPError) as e:  # at once, not after health_timeout_s
            make_engine([srv.url])
        assert e.value.status == 401 and "Unauthorized" in str(e.value)
        assert "rollout.sglang.api_key" in str(e.value)
    finally:
        srv.stop()


def test_missing_routed_experts_names_the_server_flag(server_b):
    eng = make_engine(
        [server_b.url], return_routed_experts=True, routed_experts_layers=2, routed_experts_top_k=2
    )
    with eng, pytest.raises(SGLangProtocolError, match="--enable-return-routed-experts"):
        eng.generate([[1]], 1, SamplingParams(max_new_tokens=2, seed=0))


def test_launch_waits_for_health_and_stops_the_server(tmp_path):
    """The launcher end to end, with `python -m sglang.launch_server` swapped for the test
    server by a fake interpreter."""
    script = fake.fake_interpreter(tmp_path)
    port = _closed_port()
    cfg = SGLangEngineConfig(
        launch=[ServerLaunchConfig(model_path="/nowhere", port=port, python=str(script))],
        weight_sync="disk", disk_dir=str(tmp_path / "sync"), log_dir=str(tmp_path / "logs"),
        **FAST,
    )  # fmt: skip
    eng = SGLangEngine(cfg)
    try:
        assert eng.urls == [f"http://127.0.0.1:{port}"]
        (g,) = eng.generate([[1, 2]], 2, SamplingParams(max_new_tokens=3, seed=0))
        assert len(g) == 2
        eng.update_weights(FakeSource(seed=9, layers=1, experts=2), version=1)
    finally:
        eng.close()
    with pytest.raises(OSError):  # stopped
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


# ---- faults: fencing, resubmission, restarts (docs/SGLANG.md, "Failures") ---------------------

FAULTS = {"health_check_interval_s": 0.2, "restart_after_s": 5.0, "recovery_timeout_s": 30.0}
PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]


def _ids_and_logprobs(groups):
    return [[(s.response_ids, s.logprobs, s.weight_version) for s in g] for g in groups]


def test_requests_of_a_server_that_dies_finish_on_another_with_the_same_samples():
    dying = fake.start_fake_server(routed_experts=False, extra_args=["--exit-at", "/generate:1"])
    other = fake.start_fake_server(routed_experts=False)
    params = SamplingParams(max_new_tokens=4, seed=11)
    try:
        with make_engine([other.url], samples_per_request=1, **FAULTS) as eng:
            expected = eng.generate(PROMPTS, 2, params)
        with make_engine([dying.url, other.url], samples_per_request=1, **FAULTS) as eng:
            got = eng.generate(PROMPTS, 2, params)
            counts = eng.fault_metrics()
            assert eng.pool.serving() == [other.url]
            assert eng.pool.servers[dying.url].state is ServerState.SUSPECT
        assert dying.proc.wait(timeout=10) != 0  # it died mid-request
    finally:
        dying.stop()
        other.stop()
    assert _ids_and_logprobs(got) == _ids_and_logprobs(expected)  # same seeds, same samples
    assert counts["rollout/requests_resubmitted"] >= 1 and counts["rollout/server_failures"] >= 1
    assert counts["rollout/servers_healthy"] == 1


def test_an_attached_server_that_comes_back_is_resynced_before_it_generates(tmp_path):
    dying = fake.start_fake_server(routed_experts=False, extra_args=["--exit-at", "/generate:1"])
    other = fake.start_fake_server(routed_experts=False)
    src = FakeSource(seed=3, layers=1, experts=2)
    back = None
    try:
        eng = make_engine(
            [dying.url, other.url], weight_sync="disk", disk_dir=str(tmp_path), **FAULTS
        )
        with eng:
            driver = RolloutDriver(eng, SingleRank(), src)
            driver.update_weights(1)
            driver.generate(PROMPTS, 2, SamplingParams(max_new_tokens=3, seed=1))
            dying.proc.wait(timeout=10)
            back = fake.start_fake_server(routed_experts=False, port=dying.port)  # launch weights
            _wait_for(lambda: eng.pool.in_state(ServerState.STALE) == [dying.url])
            assert "/generate" not in paths(back)  # fenced: it holds other weights
            _wait_for(lambda: eng.servers_to_resync() == [dying.url])
            eng.update_weights(src, 1, urls=[dying.url])
            assert sorted(eng.pool.serving()) == sorted([dying.url, other.url])
            groups = driver.generate(PROMPTS * 4, 2, SamplingParams(max_new_tokens=3, seed=2))
        assert back.weights() == src.expected() and back.state()["version"] == "1"
        assert "/generate" in paths(back)
        assert {s.weight_version for g in groups for s in g} == {1}
    finally:
        for srv in (dying, other, back):
            if srv is not None:
                srv.stop()


def test_a_launched_server_that_dies_is_restarted_resynced_and_its_requests_resubmitted(
    tmp_path,
):
    port = _closed_port()
    python = fake.fake_interpreter(tmp_path, "--exit-at", f"/generate:2:{tmp_path / 'died'}")
    cfg = SGLangEngineConfig(
        launch=[ServerLaunchConfig(model_path="/nowhere", port=port, python=str(python))],
        weight_sync="disk", disk_dir=str(tmp_path / "sync"), log_dir=str(tmp_path / "logs"),
        **FAST, **FAULTS,
    )  # fmt: skip
    src = FakeSource(seed=5, layers=1, experts=2)
    params = SamplingParams(max_new_tokens=3, seed=4)
    with SGLangEngine(cfg) as eng:
        driver = RolloutDriver(eng, SingleRank(), src)
        driver.update_weights(1)
        first = driver.generate(PROMPTS, 2, params)
        again = driver.generate(PROMPTS, 2, params)  # the server dies with this request
        counts = eng.fault_metrics()
        launched = fake.FakeServer(proc=None, port=port)
        held, version = launched.weights(), launched.state()["version"]
    assert _ids_and_logprobs(again) == _ids_and_logprobs(first)
    assert counts["rollout/server_restarts"] == 1 and counts["rollout/requests_resubmitted"] >= 1
    assert held == src.expected() and version == "1"  # re-synced before it served again
    log = (tmp_path / "logs" / f"sglang_0_{port}.log").read_text()
    assert log.count("READY") == 2  # the same command, started twice


def test_a_server_that_refuses_an_update_is_fenced_and_resynced(server, server_b):
    src = FakeSource(seed=12)
    params = SamplingParams(max_new_tokens=3, seed=5)
    server.fault("/update_weights_from_tensor", "weight_fail")
    with make_engine([server.url, server_b.url], **FAULTS) as eng:
        driver = RolloutDriver(eng, SingleRank(), src)
        driver.update_weights(1)  # the other server took it: the run goes on
        assert eng.pool.serving() == [server_b.url]
        assert eng.fault_metrics()["rollout/weight_update_failures"] == 1
        generated = [driver.generate(PROMPTS, 2, params)]
        time.sleep(0.3)  # due for a re-sync
        generated.append(driver.generate(PROMPTS, 2, params))
        assert sorted(eng.pool.serving()) == sorted([server.url, server_b.url])
    assert server.weights() == src.expected() == server_b.weights()
    assert {s.weight_version for groups in generated for g in groups for s in g} == {1}


def test_answers_from_other_weights_are_never_used(server, server_b):
    src = FakeSource(seed=13)
    with make_engine([server.url, server_b.url], samples_per_request=1, **FAULTS) as eng:
        eng.update_weights(src, version=1)
        server.reset()  # back to its launch weights behind the engine's back
        groups = eng.generate(PROMPTS, 2, SamplingParams(max_new_tokens=3, seed=6))
        counts = eng.fault_metrics()
        assert eng.pool.in_state(ServerState.STALE) == [server.url]
    assert {s.weight_version for g in groups for s in g} == {1}
    assert counts["rollout/stale_answers"] >= 1


def test_a_503_spell_is_waited_out(server):
    server.fault("/generate", "503", count=4)  # max_retries=2: one request, then a resubmission
    with make_engine([server.url], **FAULTS) as eng:
        (g,) = eng.generate([[3]], 1, SamplingParams(max_new_tokens=2, seed=0))
        assert eng.fault_metrics()["rollout/requests_resubmitted"] == 1
    assert len(g) == 1 and paths(server).count("/generate") == 5


def test_a_server_with_a_slow_health_check_loses_its_requests_to_another(server, server_b):
    with make_engine([server.url, server_b.url], liveness_timeout_s=1.0, **FAULTS) as eng:
        server.fault("/generate", "slow", delay_s=30.0)
        server.fault("/health", "slow", count=100, delay_s=3.0)
        t0 = time.monotonic()
        groups = eng.generate([[1, 2]] * 4, 1, SamplingParams(max_new_tokens=2, seed=0))
        assert time.monotonic() - t0 < 15
        assert eng.fault_metrics()["rollout/requests_resubmitted"] >= 1
    assert len(groups) == 4


def test_the_deadline_ends_a_generation_that_no_server_can_serve():
    srv = fake.start_fake_server(routed_experts=False)
    eng = make_engine([srv.url], **{**FAULTS, "recovery_timeout_s": 1.0})
    try:
        srv.stop()
        driver = RolloutDriver(eng, SingleRank(), FakeSource(seed=1))
        t0 = time.monotonic()
        with pytest.raises(RolloutUnavailableError, match=f"{srv.url}: suspect"):
            driver.generate([[1]], 1, SamplingParams(max_new_tokens=2, seed=0))
        assert time.monotonic() - t0 < 15
    finally:
        eng.close()


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


# ---- rollout.sglang.lora_sync=adapter -----------------------------------------------------------


class AdapterSource:
    """The PEFT-named adapters of one attention layer, rank 2 (LoRAAdapterSource's shape)."""

    peft_config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj"]}

    def buckets(self, bucket_bytes: int):
        a, b = torch.ones(2, 16), torch.zeros(16, 2)
        yield [("model.layers.0.self_attn.q_proj.lora_A.weight", a),
               ("model.layers.0.self_attn.q_proj.lora_B.weight", b)]  # fmt: skip

    def is_sender(self) -> bool:
        return True


def test_adapter_sync_launches_with_lora_and_names_the_adapter_in_each_generate(tmp_path):
    """A launched server gets the LoRA flags; before the first update /generate runs the base
    (no lora_path), after it every /generate names the newest version's adapter. An attached
    server started without LoRA is refused at start-up, naming the key."""
    from gspo_megatron.rollout.sglang.updates.adapter import LoRAServing

    script = fake.fake_interpreter(tmp_path)
    port = _closed_port()
    cfg = SGLangEngineConfig(
        launch=[ServerLaunchConfig(model_path="/nowhere", port=port, python=str(script))],
        weight_sync="disk", disk_dir=str(tmp_path / "sync"), log_dir=str(tmp_path / "logs"),
        lora_sync="adapter", **FAST,
    )  # fmt: skip
    serving = LoRAServing.of(AdapterSource.peft_config)
    params = SamplingParams(max_new_tokens=2, seed=0)
    with SGLangEngine(cfg, lora=serving) as eng:
        url = eng.urls[0]
        eng.generate([[1, 2]], 1, params)
        for version in (1, 2):
            eng.update_weights(AdapterSource(), version=version)
            (g,) = eng.generate([[1, 2]], 2, params)
            assert [s.weight_version for s in g] == [version, version]
        log = json.loads(_get(url, "/_test/log"))
        generates = [e["body"].get("lora_path") for e in log if e["path"] == "/generate"]
        assert generates == [None, "gspo_v1", "gspo_v2"]
        paths_ = [e["path"] for e in log if "lora" in e["path"] or "version" in e["path"]]
        assert paths_ == ["/load_lora_adapter", "/update_weight_version",
                          "/load_lora_adapter", "/update_weight_version",
                          "/unload_lora_adapter"]  # fmt: skip
        assert json.loads(_get(url, "/_test/state"))["loras"] == {
            "gspo_v2": str(tmp_path / "sync" / "adapter_v2")
        }
    plain = fake.start_fake_server(routed_experts=False)
    try:
        attached = SGLangEngineConfig(urls=[plain.url], weight_sync="disk", lora_sync="adapter",
                                      disk_dir=str(tmp_path / "sync"), **FAST)  # fmt: skip
        with pytest.raises(ValueError, match="lora_sync=adapter: the SGLang server at .* was "
                           "started without --enable-lora"):  # fmt: skip
            SGLangEngine(attached, lora=serving)
    finally:
        plain.stop()


def _get(url: str, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return resp.read().decode()
