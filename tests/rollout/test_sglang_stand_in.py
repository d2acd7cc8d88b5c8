"""The SGLang stand-in (sglang_test_server.py) dies where SGLang 0.5.23's server dies and answers
where it answers (docs/SGLANG.md, "What kills a server"): a client change that would kill a real
server kills the stand-in, and the tests that use it fail."""

import json
import urllib.error
import urllib.request

import pytest
from launch import needs_sglang

try:  # tests/rollout may or may not be a package
    from . import sglang_test_server as fake
except ImportError:
    import sglang_test_server as fake

pytestmark = needs_sglang

ALL = ["weights", "kv_cache", "cuda_graph"]


def post(srv, path: str, body: dict, timeout: float = 10) -> tuple[int | None, bytes]:
    """(status, body); status None when the connection dropped without an answer."""
    req = urllib.request.Request(
        srv.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, ConnectionError):
        return None, b""


def get(srv, path: str) -> int | None:
    try:
        with urllib.request.urlopen(srv.url + path, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError):
        return None


def release(srv, tags):
    return post(srv, "/release_memory_occupation", {"tags": tags})


def resume(srv, tags):
    return post(srv, "/resume_memory_occupation", {"tags": tags})


def hold_a_request(srv):
    """A /generate that stays running until /abort_request (the scheduler is busy)."""
    import threading
    import time

    srv.fault("/generate", "hold")
    body = {"input_ids": [[1, 2]], "sampling_params": [{"max_new_tokens": 2}]}
    threading.Thread(target=post, args=(srv, "/generate", body, 30), daemon=True).start()
    for _ in range(200):
        if any(e["path"] == "/generate" for e in srv.log()):
            return
        time.sleep(0.02)
    raise AssertionError("the held /generate never arrived")


def disk_update(srv, tmp_path):
    """/update_weights_from_disk of a one-tensor checkpoint."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model.safetensors"}})
    )
    return post(srv, "/update_weights_from_disk", {"model_path": str(tmp_path)})


def tensor_update(srv):
    assert post(srv, "/begin_weight_update", {})[0] == 200
    return post(srv, "/update_weights_from_tensor",
                {"serialized_named_tensors": [""], "load_format": "flattened_bucket"})  # fmt: skip


GENERATE = {"input_ids": [[1, 2]], "sampling_params": [{"max_new_tokens": 2}]}

# (what the client does, the crash record's reason): each kills SGLang 0.5.23's server.
DEADLY = {
    "resume_a_resident_tag": (lambda s, t: resume(s, ["kv_cache"]), "KeyError: 'kv_cache'"),
    "resume_of_tags_one_of_them_resident": (
        lambda s, t: (release(s, ["weights"]), resume(s, ["weights", "kv_cache"])),
        "KeyError: 'kv_cache'",
    ),
    "release_twice": (lambda s, t: (release(s, ALL), release(s, ["kv_cache"])), "Cannot pause"),
    "release_while_a_request_runs": (
        lambda s, t: (hold_a_request(s), release(s, ALL)),
        "only when server is idle",
    ),
    "generate_with_kv_cache_released": (
        lambda s, t: (release(s, ["kv_cache"]), post(s, "/generate", GENERATE)),
        "model ran with ['kv_cache'] released",
    ),
    "health_check_with_memory_released": (
        lambda s, t: (release(s, ["cuda_graph"]), get(s, "/health")),
        "model ran with ['cuda_graph'] released",
    ),
    "disk_update_into_released_weights": (
        lambda s, t: (release(s, ["weights"]), disk_update(s, t)),
        "weights loaded into released memory",
    ),
    "tensor_update_into_released_weights": (
        lambda s, t: (release(s, ["weights"]), tensor_update(s)),
        "weights loaded into released memory",
    ),
    "weight_update_group_without_a_name": (
        lambda s, t: post(
            s,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "",
                "backend": "gloo",
            },
        ),
        "Group name cannot be empty",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", DEADLY)
def test_the_stand_in_dies_where_sglang_dies(case, tmp_path):
    action, reason = DEADLY[case]
    srv = fake.start_fake_server(routed_experts=False, crash_file=tmp_path / "crash")
    try:
        action(srv, tmp_path)
        assert srv.proc.wait(timeout=20) == fake.CRASH_EXIT_CODE
        (crash,) = srv.crashes()
        assert reason in crash["reason"], crash
    finally:
        srv.stop()


def test_what_sglang_survives_the_stand_in_survives(tmp_path):
    """Refusals SGLang answers (HTTP 400) or no-ops, one server through all of them."""
    srv = fake.start_fake_server(routed_experts=False)
    try:
        # a weight-update group that does not exist, a session begun twice, one never begun
        status, raw = post(srv, "/destroy_weights_update_group", {"group_name": "nope"})
        assert status == 400 and b"does not exist" in raw
        assert post(srv, "/begin_weight_update", {})[0] == 200
        status, raw = post(srv, "/begin_weight_update", {})
        assert status == 400 and b"already open" in raw
        assert post(srv, "/end_weight_update", {})[0] == 200
        status, raw = post(srv, "/end_weight_update", {})
        assert status == 400 and b"no weight-update session" in raw
        status, raw = post(
            srv,
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [""], "load_format": "flattened_bucket"},
        )
        assert status == 400 and b"begin_weight_update" in raw  # fmt: skip
        # a cache flush while a request runs is refused, not fatal
        hold_a_request(srv)
        status, raw = post(srv, "/flush_cache", {})
        assert status == 400 and b"Flush cache failed" in raw
        assert post(srv, "/abort_request", {"abort_all": True})[0] == 200
        # released memory, then resumed: generation and health checks run again
        assert release(srv, ALL)[0] == 200 and srv.state()["memory_gone"] == sorted(ALL)
        assert get(srv, "/server_info") == 200  # runs nothing on the GPU
        assert resume(srv, ALL)[0] == 200
        assert get(srv, "/health") == 200 and post(srv, "/generate", GENERATE)[0] == 200
        assert srv.proc.poll() is None and srv.crashes() == []
    finally:
        srv.stop()


def test_without_the_memory_saver_a_release_frees_nothing_and_a_second_one_is_harmless(tmp_path):
    """Without --enable-memory-saver SGLang's release only notes the tags: the model still
    runs, but a resume of a tag not noted still raises (KeyError)."""
    srv = fake.start_fake_server(
        routed_experts=False, memory_saver=False, crash_file=tmp_path / "crash"
    )
    try:
        assert release(srv, ALL)[0] == 200 and release(srv, ["kv_cache"])[0] == 200
        assert get(srv, "/health") == 200 and post(srv, "/generate", GENERATE)[0] == 200
        assert resume(srv, ALL)[0] == 200
        resume(srv, ["weights"])
        assert srv.proc.wait(timeout=20) == fake.CRASH_EXIT_CODE
        assert "KeyError: 'weights'" in srv.crashes()[0]["reason"]
    finally:
        srv.stop()


def test_each_process_reports_its_own_startup_time():
    """/server_info's startup_time identifies the server process (the memory record's key)."""
    a = fake.start_fake_server(routed_experts=False)
    try:
        with urllib.request.urlopen(a.url + "/server_info", timeout=10) as resp:
            first = json.loads(resp.read())
        a.stop()
        b = fake.start_fake_server(routed_experts=False, port=a.port)
        try:
            with urllib.request.urlopen(b.url + "/server_info", timeout=10) as resp:
                second = json.loads(resp.read())
        finally:
            b.stop()
    finally:
        a.stop()
    assert first["startup_time"] and first["startup_time"] != second["startup_time"]
    assert first["internal_states"][0]["startup_time"] == first["startup_time"]
