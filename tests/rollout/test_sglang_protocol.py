"""SGLang engine pieces that need no server: command line, request bodies (checked against
sglang's own JSON contract), response parsing, bucket layout, disk writer, launcher errors."""

import base64
import importlib.util
import json
import os
import stat
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.sglang import weight_sync as ws
from gspo_megatron.rollout.sglang.client import RetryPolicy
from gspo_megatron.rollout.sglang.config import ServerLaunchConfig, SGLangEngineConfig
from gspo_megatron.rollout.sglang.launcher import SGLangServerProcess, launch_command
from gspo_megatron.rollout.sglang.protocol import (
    SGLangError,
    SGLangProtocolError,
    error_reason,
    generate_body,
    parse_generate_item,
    parse_generate_response,
)

_SGLANG = importlib.util.find_spec("sglang")


def _load_sglang_file(rel: str, name: str) -> types.ModuleType:
    """A self-contained sglang source file loaded by path (no sglang package import)."""
    if _SGLANG is None:
        pytest.skip("sglang==0.5.23 not installed (pip install --no-deps sglang==0.5.23)")
    path = Path(_SGLANG.submodule_search_locations[0], rel)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def api_types():
    return _load_sglang_file("api/v1/api_types.py", "sglang_api_v1_types_for_tests")


@pytest.fixture(scope="module")
def tensor_bucket():
    return _load_sglang_file("srt/weight_sync/tensor_bucket.py", "sglang_tensor_bucket_for_tests")


# ---- launcher -----------------------------------------------------------------------------------


def test_launch_command_has_every_setting():
    cfg = ServerLaunchConfig(
        model_path="/models/qwen3-30b-a3b",
        host="0.0.0.0",
        port=31000,
        tp_size=4,
        dp_size=2,
        ep_size=4,
        mem_fraction_static=0.7,
        base_gpu_id=4,
        enable_return_routed_experts=True,
        enable_memory_saver=True,
        deterministic=True,
        api_key="secret",
        weight_version="0",
        extra_args=["--context-length", "8192"],
        python="/usr/bin/python3",
    )
    cmd = launch_command(cfg)
    assert cmd[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    pairs = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    for flag, value in {
        "--model-path": "/models/qwen3-30b-a3b",
        "--host": "0.0.0.0",
        "--port": "31000",
        "--tp-size": "4",
        "--dp-size": "2",
        "--ep-size": "4",
    }.items():
        assert pairs[flag] == value
    for flag in (
        "--enable-return-routed-experts",
        "--enable-memory-saver",
        "--enable-deterministic-inference",
    ):
        assert flag in cmd
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"
    assert cmd[cmd.index("--base-gpu-id") + 1] == "4"
    assert cmd[cmd.index("--api-key") + 1] == "secret"
    assert cmd[cmd.index("--weight-version") + 1] == "0"
    assert cmd[-2:] == ["--context-length", "8192"]
    assert cfg.url == "http://127.0.0.1:31000"


def test_launch_command_minimal_and_flags_off():
    cmd = launch_command(ServerLaunchConfig(model_path="m", python="py"))
    assert "--enable-return-routed-experts" not in cmd
    assert "--api-key" not in cmd and "--mem-fraction-static" not in cmd


@pytest.mark.parametrize(
    "kwargs, key",
    [({"tp_size": 0}, "tp_size"), ({"port": 0}, "port"), ({"mem_fraction_static": 1.5}, "mem")],
)
def test_launch_config_rejects_bad_values(kwargs, key):
    launch = [ServerLaunchConfig(model_path="m", **kwargs)]
    with pytest.raises(ValueError, match=rf"rollout\.sglang\.launch\[0\]\.{key}"):
        SGLangEngineConfig(launch=launch, disk_dir="/w").validate()


def _fake_python(tmp_path: Path, body: str) -> str:
    script = tmp_path / "fake_python"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_launcher_reports_a_server_that_exits(tmp_path):
    py = _fake_python(tmp_path, 'echo "CUDA error: no GPU found" >&2; exit 3')
    proc = SGLangServerProcess(
        ServerLaunchConfig(model_path="m", port=39999, python=py), tmp_path / "s.log"
    )
    proc.start()
    with pytest.raises(SGLangError) as e:
        proc.wait_healthy(timeout_s=20, poll_s=0.05)
    msg = str(e.value)
    assert "exit code 3" in msg and "http://127.0.0.1:39999" in msg
    assert "sglang.launch_server" in msg and "no GPU found" in msg


def test_launcher_times_out_and_kills_the_process_group(tmp_path):
    pidfile = tmp_path / "pid"
    py = _fake_python(tmp_path, f"sleep 60 & echo $! > {pidfile}; wait")
    proc = SGLangServerProcess(
        ServerLaunchConfig(model_path="m", port=39998, api_key="k", python=py), tmp_path / "s.log"
    )
    proc.start()
    t0 = time.monotonic()
    with pytest.raises(SGLangError) as e:
        proc.wait_healthy(timeout_s=0.5, poll_s=0.05)
    assert time.monotonic() - t0 < 10
    msg = str(e.value)
    assert "did not answer GET /health" in msg and "http://127.0.0.1:39998" in msg
    assert "--api-key REDACTED" in msg and " k " not in msg  # the key is not printed
    child = int(pidfile.read_text())
    for _ in range(100):  # the child (a server worker) is gone too
        if not os.path.exists(f"/proc/{child}") or "Z" in _proc_state(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail("server worker survived stop()")


def test_health_poll_takes_an_answer_that_is_not_http_as_not_healthy():
    """What answered GET /health once in CI: the request itself, echoed (a connection from the
    polled port to itself while nothing listened there). Any non-HTTP answer means "not yet"."""
    import socket
    import threading

    from gspo_megatron.rollout.sglang.launcher import http_health

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def echo_once():
        conn, _ = server.accept()
        with conn:
            conn.sendall(conn.recv(4096))

    thread = threading.Thread(target=echo_once, daemon=True)
    thread.start()
    port = server.getsockname()[1]
    assert http_health(f"http://127.0.0.1:{port}", timeout_s=5.0) is False
    thread.join(5)
    server.close()


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return "gone"


# ---- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"urls": []}, "rollout.sglang.urls"),
        ({"weight_sync": "nccl"}, "rollout.sglang.weight_sync"),
        ({"weight_sync": "disk"}, "rollout.sglang.disk_dir"),
        ({"pause_mode": "stop"}, "rollout.sglang.pause_mode"),
        (
            {"weight_sync": "tensor", "launch": [ServerLaunchConfig(model_path="m", dp_size=2)]},
            "launch[0].dp_size",
        ),
        (
            {"offload_after_generate": True, "launch": [ServerLaunchConfig(model_path="m")]},
            "launch[0].enable_memory_saver",
        ),
        (
            {"return_routed_experts": True, "launch": [ServerLaunchConfig(model_path="m")]},
            "launch[0].enable_return_routed_experts",
        ),
        # sglang-router health-checks its workers with GET /health: fatal on released memory
        ({"offload_after_generate": True, "router_url": "http://r:1"}, "rollout.sglang.router_url"),
        # SGLang asserts a non-empty name outside any try: the server would exit
        ({"weight_sync": "distributed", "group_name": ""}, "rollout.sglang.group_name"),
    ],
)
def test_engine_config_errors_name_the_key(kwargs, fragment):
    base = {"urls": ["http://127.0.0.1:1"], "weight_sync": "tensor"}
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        SGLangEngineConfig(**{**base, **kwargs}).validate()


def test_engine_config_is_a_hydra_structured_config():
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(
        OmegaConf.structured(SGLangEngineConfig(urls=["http://h:1"], weight_sync="tensor")),
        {"launch": [{"model_path": "/m", "tp_size": 2}], "bucket_bytes": 1024},
    )
    cfg = OmegaConf.to_object(merged)
    assert cfg.launch[0].tp_size == 2 and cfg.bucket_bytes == 1024


# ---- /generate body and parsing -------------------------------------------------------------


def test_generate_body_one_entry_per_sample_with_its_seed(api_types):
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=16,
                            stop_token_ids=(2, 5))  # fmt: skip
    body = generate_body([[1, 2], [1, 2], [3]], [10, 11, 12], params, return_routed_experts=True)
    assert body["input_ids"] == [[1, 2], [1, 2], [3]]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["return_routed_experts"] is True
    assert [sp["sampling_seed"] for sp in body["sampling_params"]] == [10, 11, 12]
    assert all("n" not in sp for sp in body["sampling_params"])
    assert body["sampling_params"][0] == {
        "max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
        "stop_token_ids": [2, 5], "sampling_seed": 10,
    }  # fmt: skip
    api_types.GenerateRequest.from_json_value(json.loads(json.dumps(body)))  # sglang's contract


def test_sglang_contract_rejects_a_wrong_sampling_key(api_types):
    """The contract check the test server applies is not vacuous: `seed` is not SGLang's name."""
    body = generate_body([[1]], [3], SamplingParams(), return_routed_experts=False)
    body["sampling_params"][0]["seed"] = body["sampling_params"][0].pop("sampling_seed")
    with pytest.raises(api_types.JsonContractError, match="seed"):
        api_types.GenerateRequest.from_json_value(body)


def test_generate_body_takes_a_token_budget_per_sample(api_types):
    """Continued partial rollouts: each sample may still generate a different number of tokens."""
    body = generate_body([[1, 2, 7], [3]], [4, 5], SamplingParams(max_new_tokens=16),
                         return_routed_experts=False, max_new_tokens=[13, 16])  # fmt: skip
    assert [sp["max_new_tokens"] for sp in body["sampling_params"]] == [13, 16]
    api_types.GenerateRequest.from_json_value(json.loads(json.dumps(body)))
    with pytest.raises(ValueError, match="2 prompts but 1 max_new_tokens"):
        generate_body([[1], [2]], [4, 5], SamplingParams(), return_routed_experts=False,
                      max_new_tokens=[3])  # fmt: skip


def test_generate_body_rejects_empty_prompt():
    with pytest.raises(ValueError, match="empty"):
        generate_body([[]], [1], SamplingParams(), return_routed_experts=False)


def _item(output_ids, lp_ids=None, finish=None, routed=None, **meta):
    lp_ids = output_ids if lp_ids is None else lp_ids
    m = {
        "finish_reason": finish or {"type": "length", "length": len(output_ids)},
        "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(lp_ids)],
        "weight_version": "3",
        **meta,
    }
    if routed is not None:
        m["routed_experts"] = base64.b64encode(routed.astype(np.int32).tobytes()).decode()
    return {"text": "", "output_ids": output_ids, "meta_info": m}


def test_parse_item_reads_logprobs_finish_and_routes(api_types):
    routes = np.arange(4 * 3 * 2).reshape(4, 3, 2)
    item = _item([7, 8], finish={"type": "stop", "matched": 8}, routed=routes, cached_tokens=2)
    api_types.GenerateResponse.from_json_value(item)  # a response sglang's contract accepts
    out = parse_generate_item(item, prompt_len=3, url="u", routed_experts_shape=(3, 2))
    assert out.output_ids == [7, 8] and out.logprobs == [-0.5, -1.5]
    assert out.cached_tokens == 2
    assert out.finish_reason == "stop" and out.weight_version == "3"
    assert out.routed_experts.dtype == np.int32
    np.testing.assert_array_equal(out.routed_experts, routes)


@pytest.mark.parametrize(
    "item, fragment",
    [
        (_item([7, 8], lp_ids=[7, 9]), "differ from output_ids"),
        (_item([7, 8], lp_ids=[7]), "differ from output_ids"),
        (_item([7], finish={"type": "paused"}), "finish_reason"),
        (_item([7], finish=None) | {"output_ids": ["7"]}, "integer output_ids"),
        ({"output_ids": [1]}, "meta_info"),
        (_item([7], routed=np.zeros(5)), "routed_experts from u holds 5 int32 values"),
        (_item([7]), "--enable-return-routed-experts"),
        (_item([7], routed=np.zeros(4), cached_tokens=3), "cached_tokens 3 from u is not a"),
        (_item([7], routed=np.zeros(4), cached_tokens="1"), "cached_tokens '1'"),
    ],
)
def test_parse_item_rejects_what_sglang_does_not_send(item, fragment):
    with pytest.raises(SGLangProtocolError, match=fragment):
        parse_generate_item(item, prompt_len=2, url="u", routed_experts_shape=(1, 2))


def test_parse_response_checks_batch_length():
    with pytest.raises(SGLangProtocolError, match="2 results for 3 samples"):
        parse_generate_response([_item([1]), _item([2])], [1, 1, 1], "u", routed_experts_shape=None)
    with pytest.raises(SGLangProtocolError, match="expected a list"):
        parse_generate_response(_item([1]), [1], "u", routed_experts_shape=None)


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b'{"error": {"message": "bad top_p"}}', "bad top_p"),
        (b'{"error": "Unauthorized"}', "Unauthorized"),
        (b'{"success": false, "message": "no session"}', "no session"),
        (
            b'{"object": "error", "message": "1 validation error", "code": 400}',
            "1 validation error",
        ),
        (b'{"detail": "Not Found"}', "Not Found"),
        (b"Internal Server Error", "Internal Server Error"),
    ],
)
def test_error_reason_reads_every_sglang_error_shape(raw, reason):
    assert error_reason(raw) == reason


def test_retry_policy_backoff_is_exponential_and_capped():
    p = RetryPolicy(max_retries=5, backoff_s=0.5, backoff_max_s=3.0)
    assert [p.delay(k) for k in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


# ---- weight buckets ---------------------------------------------------------------------------


def test_flattened_bucket_rebuilds_with_sglangs_class(tensor_bucket):
    g = torch.Generator().manual_seed(0)
    named = [
        ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=g).bfloat16()),
        ("model.layers.0.mlp.experts.3.gate_proj.weight", torch.randn(4, 6, generator=g)),
        ("model.layers.0.mlp.gate.weight", torch.randn(3, 5, generator=g).half()),
    ]
    aligned = ws.order_for_alignment(named)
    assert [t.element_size() for _, t in aligned] == [4, 2, 2]
    flat, meta = ws.flatten_bucket(aligned)
    assert flat.dtype == torch.uint8
    # the distributed receive side allocates from names/dtypes/shapes and checks alignment
    body = ws.distributed_update_body(aligned, "g", "1")
    recv = tensor_bucket.FlattenedTensorBucket.empty(body["names"], body["dtypes"],
                                                     body["shapes"], "cpu")  # fmt: skip
    recv.get_flattened_tensor().copy_(flat)
    for (n0, t0), (n1, t1) in zip(aligned, recv.reconstruct_tensors(), strict=True):
        assert n0 == n1 and t0.dtype == t1.dtype and torch.equal(t0, t1)
    # the tensor path rebuilds from our metadata objects
    metadata = [tensor_bucket.FlattenedTensorMetadata(**vars(m)) for m in meta]
    rebuilt = tensor_bucket.FlattenedTensorBucket(flattened_tensor=flat, metadata=metadata)
    assert [n for n, _ in rebuilt.reconstruct_tensors()] == [n for n, _ in aligned]


def test_unaligned_order_is_what_sglang_rejects(tensor_bucket):
    named = [("a", torch.zeros(3, dtype=torch.bfloat16)), ("b", torch.zeros(2))]
    body = ws.distributed_update_body(named, "g", "1")
    with pytest.raises(ValueError, match="Unaligned"):
        tensor_bucket.FlattenedTensorBucket.empty(body["names"], body["dtypes"], body["shapes"],
                                                  "cpu")  # fmt: skip
    ws_body = ws.distributed_update_body(ws.order_for_alignment(named), "g", "1")
    tensor_bucket.FlattenedTensorBucket.empty(ws_body["names"], ws_body["dtypes"],
                                              ws_body["shapes"], "cpu")  # fmt: skip


def test_disk_writer_writes_hf_shards_and_drops_the_previous_version(tmp_path):
    from safetensors.torch import load_file

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "qwen3_moe"}')
    (base / "tokenizer.json").write_text("{}")
    (base / "model-00001-of-00001.safetensors").write_bytes(b"old weights, not copied")
    writer = ws.DiskWriter(tmp_path / "out", base)
    b1 = [("model.embed_tokens.weight", torch.ones(4, 2))]
    b2 = [("model.norm.weight", torch.arange(3.0).bfloat16())]
    p1 = writer.write(iter([b1, b2]), version=1)
    index = json.loads((p1 / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"model.embed_tokens.weight", "model.norm.weight"}
    assert sorted(f.name for f in p1.iterdir()) == [
        "config.json", "model-00001.safetensors", "model-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json",
    ]  # fmt: skip
    assert torch.equal(
        load_file(str(p1 / "model-00002.safetensors"))["model.norm.weight"], b2[0][1]
    )
    writer.committed(p1)
    p2 = writer.write(iter([b1]), version=2)
    writer.committed(p2)
    assert not p1.exists() and p2.exists()
    with pytest.raises(ValueError, match="twice"):
        writer.write(iter([b1, b1]), version=3)


def test_disk_writer_refuses_an_empty_source(tmp_path):
    with pytest.raises(ValueError, match="no tensors"):
        ws.DiskWriter(tmp_path, None).write(iter([]), version=1)
