"""The servers' GPU memory as the SGLang engine knows it (gspo_megatron/rollout/sglang/memory.py):
the run directory's record, the state a new engine adopts from it, and the calls that change it,
against a scripted client (no server)."""

import asyncio
import json

import pytest

from gspo_megatron.rollout.sglang.memory import (
    MEMORY_TAGS,
    MemoryRecord,
    MemoryRecordError,
    MemoryTracker,
    ServerMemory,
)
from gspo_megatron.rollout.sglang.protocol import SGLangConnectionError, SGLangTimeoutError

URL = "http://node7:30000"
ALL = list(MEMORY_TAGS)


def info(process: int) -> dict:
    """A /server_info answer of server process `process`."""
    return {"startup_time": {"tokenizer_e2e": 10.0 + process}, "tp_size": 1}


class ScriptedClient:
    """Answers like one server: /server_info of process `self.process`; memory calls succeed or
    raise `self.fail`; every call is logged, with the record's content when the call was sent."""

    def __init__(self, record: MemoryRecord | None = None) -> None:
        self.process, self.fail, self.calls, self.record = 1, None, [], record

    async def get(self, url, path, **kw):
        self.calls.append(path)
        return info(self.process)

    async def post(self, url, path, body, **kw):
        recorded = self.record.read()[url] if self.record is not None else None
        self.calls.append((path, body["tags"], recorded))
        if self.fail is not None:
            raise self.fail

    async def is_healthy(self, url, timeout_s=5.0):
        self.calls.append("/health")
        return True


def tracker(tmp_path, client=None) -> tuple[MemoryTracker, ScriptedClient, MemoryRecord]:
    record = MemoryRecord(tmp_path / "sglang_memory.json")
    client = client or ScriptedClient(record)
    return MemoryTracker(client, [URL], record, call_timeout_s=10.0), client, record


def run(coro):
    return asyncio.run(coro)


# ---- the record ---------------------------------------------------------------------------------


def test_the_record_round_trips_and_leaves_no_temporary_file(tmp_path):
    record = MemoryRecord(tmp_path / "run" / "sglang_memory.json")
    assert record.read() == {}  # no file: nothing recorded
    state = {URL: ServerMemory("p1", {"kv_cache", "weights"}, {"cuda_graph"}, "a call failed")}
    record.write(state)
    record.write(state)
    assert record.read() == state
    assert json.loads(record.path.read_text())["servers"][URL]["released"] == [
        "weights", "kv_cache"
    ]  # fmt: skip
    assert [p.name for p in record.path.parent.iterdir()] == ["sglang_memory.json"]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("{not json", "Expecting property name"),
        ('{"servers": []}', "`servers` is not an object"),
        ('{"servers": {"u": {"released": ["gpu"]}}}', "`released` must list tags"),
        ('{"servers": {"u": {"identity": 3}}}', "`identity` is not a string"),
    ],
)
def test_a_bad_record_is_one_clear_error_naming_the_file(tmp_path, text, fragment):
    path = tmp_path / "sglang_memory.json"
    path.write_text(text)
    with pytest.raises(MemoryRecordError, match=fragment) as e:
        MemoryRecord(path).read()
    assert str(path) in str(e.value) and "restart the servers it names" in str(e.value)


# ---- what a new engine adopts -------------------------------------------------------------------


def _adopted(tmp_path, recorded: ServerMemory | None, answer: dict) -> ServerMemory:
    record = MemoryRecord(tmp_path / "sglang_memory.json")
    if recorded is not None:
        record.write({URL: recorded})
    mem, _, _ = tracker(tmp_path)
    run(mem.adopt(URL, answer))
    assert record.read()[URL] == mem.servers[URL]  # recorded at once
    return mem.servers[URL]


def test_the_process_the_record_names_holds_what_it_says(tmp_path):
    p1 = json.dumps(info(1)["startup_time"], sort_keys=True)
    got = _adopted(tmp_path, ServerMemory(p1, {"kv_cache", "cuda_graph"}), info(1))
    assert got.released == {"kv_cache", "cuda_graph"} and got.known


def test_a_new_process_or_a_server_the_record_does_not_name_holds_everything(tmp_path):
    p1 = json.dumps(info(1)["startup_time"], sort_keys=True)
    assert _adopted(tmp_path, ServerMemory(p1, set(ALL)), info(2)).resident  # restarted since
    assert _adopted(tmp_path / "b", None, info(1)).resident


def test_without_a_startup_time_a_recorded_release_is_unknown(tmp_path):
    p1 = json.dumps(info(1)["startup_time"], sort_keys=True)
    got = _adopted(tmp_path, ServerMemory(p1, {"weights"}), {"tp_size": 1})
    assert not got.known and "no startup_time" in got.doubt


def test_a_call_the_last_run_never_saw_answered_stays_unknown(tmp_path):
    p1 = json.dumps(info(1)["startup_time"], sort_keys=True)
    got = _adopted(tmp_path, ServerMemory(p1, set(), {"kv_cache"}, "a release died"), info(1))
    assert not got.known and got.doubt == "a release died"
    assert _adopted(tmp_path / "b", ServerMemory(p1, set(), {"kv_cache"}), info(2)).resident


# ---- the calls ----------------------------------------------------------------------------------


def test_each_call_follows_server_info_and_is_recorded_as_in_doubt_before_it_is_sent(tmp_path):
    mem, client, record = tracker(tmp_path)
    run(mem.adopt(URL, info(1)))
    assert run(mem.release([URL], ALL)) == {}
    assert run(mem.release([URL], ALL)) == {}  # nothing left to release: nothing sent
    assert run(mem.resume([URL], ["weights"])) == {}
    assert client.calls[0] == "/server_info" and client.calls[2] == "/server_info"
    (_, tags, before), (_, tags2, before2) = client.calls[1], client.calls[3]
    assert tags == ALL and before.in_doubt == set(ALL) and before.released == set()
    assert tags2 == ["weights"] and before2.in_doubt == {"weights"}
    assert len(client.calls) == 4
    assert record.read()[URL].released == {"kv_cache", "cuda_graph"}
    assert not record.read()[URL].in_doubt


def test_a_server_restarted_since_gets_no_resume(tmp_path):
    mem, client, record = tracker(tmp_path)
    run(mem.adopt(URL, info(1)))
    run(mem.release([URL], ALL))
    client.process = 2  # restarted: everything resident again
    assert run(mem.resume([URL], ALL)) == {}
    assert [c for c in client.calls if isinstance(c, tuple)][-1][0] == "/release_memory_occupation"
    assert mem.resident(URL) and record.read()[URL].resident


@pytest.mark.parametrize(
    "error, known",
    [
        (SGLangConnectionError("refused", URL, request_sent=False), True),  # never reached it
        (SGLangConnectionError("disconnected", URL), False),  # may have happened
        (SGLangTimeoutError("timed out", URL), False),
    ],
)
def test_a_call_without_an_answer_makes_the_state_unknown(tmp_path, error, known):
    mem, client, record = tracker(tmp_path)
    run(mem.adopt(URL, info(1)))
    client.fail = error
    assert run(mem.release([URL], ["kv_cache"])) == {URL: error}
    assert mem.servers[URL].known is known and record.read()[URL].known is known
    client.fail, sent = None, len(client.calls)
    if known:
        assert run(mem.release([URL], ["kv_cache"])) == {}
        return
    assert "unknown" in mem.unknown(URL)
    assert URL in run(mem.resume([URL], ["kv_cache"]))  # refused here, nothing sent
    assert URL in run(mem.hold([URL], ALL))
    assert not [c for c in client.calls[sent:] if isinstance(c, tuple)]
    assert run(mem.probe(URL, 1.0)) and "/health" not in client.calls  # /server_info only
    client.process = 2  # a new process at the URL: known again, everything resident
    assert run(mem.probe(URL, 1.0)) and mem.resident(URL) and record.read()[URL].resident


def test_no_release_reaches_a_server_a_request_holds(tmp_path):
    mem, client, _ = tracker(tmp_path)
    run(mem.adopt(URL, info(1)))

    async def scenario():
        await mem.release([URL], ["kv_cache"])
        assert await mem.hold([URL], ALL) == {}  # the KV cache back first
        await mem.release([URL], ALL)  # skipped: the request runs
        assert mem.resident(URL)
        mem.unhold([URL])
        await mem.release([URL], ALL)

    run(scenario())
    sent = [(c[0], c[1]) for c in client.calls if isinstance(c, tuple)]
    assert sent == [
        ("/release_memory_occupation", ["kv_cache"]),
        ("/resume_memory_occupation", ["kv_cache"]),
        ("/release_memory_occupation", ALL),
    ]


def test_the_probe_runs_no_generation_on_released_memory(tmp_path):
    mem, client, _ = tracker(tmp_path)
    run(mem.adopt(URL, info(1)))
    assert run(mem.probe(URL, 1.0)) and client.calls[-1] == "/health"
    run(mem.release([URL], ["cuda_graph"]))
    assert run(mem.probe(URL, 1.0)) and client.calls[-1] == "/server_info"


def test_the_sglang_backend_refuses_a_damaged_record_in_the_run_directory(tmp_path):
    """components.build_trainer and gspo-eval ask the backend before the model is built."""
    from gspo_megatron.rollout.backends import rollout_backend

    check = rollout_backend("sglang").check_run_dir
    check(None, tmp_path)  # no record: nothing recorded, nothing to refuse
    (tmp_path / "sglang_memory.json").write_text("{not json")
    with pytest.raises(MemoryRecordError, match="sglang_memory.json"):
        check(None, tmp_path)
