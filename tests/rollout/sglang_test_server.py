"""A stand-in SGLang 0.5.23 HTTP server for CPU tests, run as its own process.

Every request body is validated the way sglang's own http_server does it, with sglang's own
classes: pydantic validation of the io_struct request class (what FastAPI does for a body
parameter), the /generate JSON contract (`sglang.api.v1.api_types.GenerateRequest`),
`GenerateReqInput.normalize_batch_and_arguments()`, and `SamplingParams(**d)` + `normalize` +
`verify`. Tensor payloads are decoded with sglang's SafeUnpickler allow-list and rebuilt with its
`FlattenedTensorBucket`; distributed updates join a real (gloo) process group and receive the
broadcast. Weight updates follow the 0.5.23 session rules (tensor/distributed only between
/begin_weight_update and /end_weight_update). Answers have the shapes sglang's handlers return.

It also dies where SGLang 0.5.23's server dies (the table in docs/SGLANG.md, "What kills a
server"): an exception that escapes the scheduler's event loop ends the whole server, and so does
torch_memory_saver's exit on a double pause. Here that is `crash(reason)`: the reason goes to
stderr and to `--crash-file` (one JSON line), and the process exits with CRASH_EXIT_CODE, so a
client change that would kill a real server fails the tests. Modelled: a resume of a tag that is
not released (KeyError), a release while a request runs (the idle assertion), a second release
of a tag (memory saver: pause of a paused allocation), and the model running over released memory
(memory saver: a generation, the one-token generation GET /health runs on an idle server, a
weight update into released weights), an empty weight-update group name (an assertion).

Generation is fake and deterministic (`fake_completion`, `fake_routed_experts`); the weight
version is part of the hash, so new weights give new samples. `meta_info.cached_tokens` comes
from a radix cache as SGLang's: the longest prefix of a sample's input_ids among the sequences
prefilled and generated before it (the last input token always computed), flushed by a weight
update, /flush_cache and a release of the kv_cache. Test-only endpoints under /_test/
inject faults (500, slow, malformed JSON, a failing weight update) and expose the request log and
the received weights.

Importing sglang's request classes: `sglang/__init__.py` and `sglang/srt/utils/__init__.py`
import the whole server (triton, CUDA kernels, every model config). `load_sglang_classes`
registers the `sglang` and `sglang.srt.utils` packages without running those `__init__` files and
puts small stand-ins in place of the four server-side modules io_struct reaches only for
multimodal/scheduler types (listed there); io_struct, sampling_params, tensor_bucket, auth and the
api_types contract are sglang's real code. Extra dependency: pyzmq (io_struct imports zmq).
This happens only in the server process, never in the pytest process.

Run: python sglang_test_server.py --port 0 [--tp-size 2] ...; it prints "READY <port>".
"""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

VOCAB_SIZE = 1000
NUM_LAYERS = 2
TOP_K = 2
NUM_EXPERTS = 8
CRASH_EXIT_CODE = 3  # the stand-in died where SGLang's server dies (see `crash` in build_app)


# ---- deterministic fake model (shared with the tests) -----------------------------------------


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def fake_completion(
    prompt: list[int],
    seed: int | None,
    version: str,
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    vocab_size: int = VOCAB_SIZE,
) -> tuple[list[int], list[float], dict]:
    """(output ids, log-probs, finish_reason) the fake server returns for one sample."""
    base = _h(tuple(prompt), seed, version)
    stops = set(stop_token_ids or [])
    ids: list[int] = []
    for k in range(max_new_tokens):
        tok = (base + 7919 * k) % vocab_size
        ids.append(tok)
        if tok in stops:
            return (
                ids,
                [fake_logprob(t, i) for i, t in enumerate(ids)],
                {
                    "type": "stop",
                    "matched": tok,
                },
            )
    return (
        ids,
        [fake_logprob(t, i) for i, t in enumerate(ids)],
        {
            "type": "length",
            "length": max_new_tokens,
        },
    )


def fake_logprob(token: int, position: int) -> float:
    return -((token * 31 + position) % 97 + 1) / 16.0


def fake_routed_experts(num_tokens: int, layers: int = NUM_LAYERS, top_k: int = TOP_K):
    import numpy as np

    p = np.arange(num_tokens)[:, None, None]
    layer = np.arange(layers)[None, :, None]
    k = np.arange(top_k)[None, None, :]
    return ((p * 5 + layer * 3 + k) % NUM_EXPERTS).astype(np.int32)


# ---- the handle tests use (light imports only) --------------------------------------------------


@dataclass
class FakeServer:
    """A running test server process."""

    proc: subprocess.Popen
    port: int
    api_key: str | None = None
    crash_file: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def crashes(self) -> list[dict]:
        """Where it died as SGLang would have: [{"path", "reason"}] (empty while it lives)."""
        return read_crashes(self.crash_file)

    def assert_not_crashed(self) -> None:
        if crashes := self.crashes():
            raise AssertionError(f"the SGLang stand-in at {self.url} died as SGLang would: "
                                 f"{crashes}")  # fmt: skip

    def _call(self, method: str, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read() or b"null")

    def fault(self, path: str, kind: str, count: int = 1, delay_s: float = 0.0) -> None:
        """Make the next `count` requests to `path` misbehave. Kinds: 500 (an error answer),
        malformed (2xx with broken JSON), slow (answer after `delay_s`), close (drop the
        connection), weight_fail (a weight update answers sglang's failure), hold (a /generate
        stays in flight until /abort_request), 503 (unavailable), exit (the process dies with
        the request in flight)."""
        self._call(
            "POST", "/_test/fault", {"path": path, "kind": kind, "count": count, "delay_s": delay_s}
        )

    def log(self) -> list[dict]:
        """Requests so far: [{"path", "body"}] (large payloads shortened)."""
        return self._call("GET", "/_test/log")

    def weights(self) -> dict[str, dict]:
        """Received weights: {name: {"shape", "dtype", "sha256"}}."""
        return self._call("GET", "/_test/weights")

    def state(self) -> dict:
        return self._call("GET", "/_test/state")

    def reset(self) -> None:
        self._call("POST", "/_test/reset", {})

    def stop(self) -> None:
        """Stop the process (a no-op if it has ended); an empty crash file goes too (reading it
        afterwards still says nothing crashed)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.crash_file is not None and not read_crashes(self.crash_file):
            self.crash_file.unlink(missing_ok=True)


def read_crashes(crash_file: Path | None) -> list[dict]:
    """The crash records a stand-in wrote to `crash_file` (see `crash` in build_app)."""
    if crash_file is None or not Path(crash_file).exists():
        return []
    return [json.loads(line) for line in Path(crash_file).read_text().splitlines() if line]


def start_fake_server(
    *,
    tp_size: int = 1,
    dp_size: int = 1,
    routed_experts: bool = True,
    api_key: str | None = None,
    health_delay_s: float = 0.0,
    vocab_size: int = VOCAB_SIZE,
    timeout_s: float = 60.0,
    port: int = 0,
    memory_saver: bool = True,
    crash_file: Path | None = None,
    extra_args: Sequence[str] = (),
) -> FakeServer:
    """Start a test server process and wait for its READY line. The process shares this
    process's multiprocessing authkey, so CPU tensors passed by file descriptor (tensor mode on
    CPU) can be received, like CUDA IPC handles between colocated processes on a GPU node.
    `memory_saver`: as launched with --enable-memory-saver (released memory is really gone);
    `crash_file`: where it records dying as SGLang would (default: a new temporary file)."""
    import multiprocessing
    import tempfile

    if crash_file is None:
        fd, name = tempfile.mkstemp(prefix="sglang-stand-in-", suffix=".crash")
        os.close(fd)
        crash_file = Path(name)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--dp-size", str(dp_size),
        "--health-delay-s", str(health_delay_s),
        "--vocab-size", str(vocab_size),
        "--crash-file", str(crash_file),
    ]  # fmt: skip
    cmd += list(extra_args)
    if routed_experts:
        cmd.append("--enable-return-routed-experts")
    if memory_saver:
        cmd.append("--enable-memory-saver")
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, SGLANG_TEST_AUTHKEY=multiprocessing.current_process().authkey.hex())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, env=env, text=True)
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    line = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("READY "):
            return FakeServer(proc, int(line.split()[1]), api_key, Path(crash_file))
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"test SGLang server did not start (last line {line!r})")


def fake_interpreter(directory: Path, *extra: str, name: str = "fake_python") -> Path:
    """An interpreter for ServerLaunchConfig.python: `python -m sglang.launch_server ARGS` runs
    this test server with ARGS (it reads the flags it knows) and `extra`."""
    import shlex
    import stat

    script = Path(directory) / name
    script.write_text(
        "#!/bin/sh\nshift 2\n"
        f'exec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "$@" '
        f"{shlex.join(extra)}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


# ---- loading sglang's request classes (server process only) ------------------------------------


def load_sglang_classes():
    """sglang 0.5.23's request classes without its GPU-only import chain (see module doc)."""
    import ast
    import dataclasses
    import enum
    import importlib
    import importlib.machinery
    import importlib.util
    import io
    import pickle
    import types
    from typing import Literal

    import msgspec
    import torch
    from packaging.version import Version

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed: pip install --no-deps sglang==0.5.23")
    base = spec.submodule_search_locations[0]

    def package(name: str, path: str | None = None, **attrs):
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=path is not None)
        if path is not None:
            mod.__path__ = [path]
            mod.__spec__.submodule_search_locations = [path]
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    # `sglang` without sglang/__init__.py (frontend DSL, IPython, transformers patches).
    package("sglang", base)

    # `sglang.srt.utils` without utils/__init__.py (re-exports utils/common.py: triton, the
    # server). io_struct takes ImageData/VideoData from it (copied from utils/common.py), and
    # lora_registry ConcurrentCounter (used only when LoRA serves).
    @dataclasses.dataclass
    class ImageData:
        url: str
        detail: Literal["auto", "low", "high"] | None = "auto"
        max_dynamic_patch: int | None = None
        preprocess_kwargs: dict | None = None
        content_hash: str | None = None
        max_long_side_pixel: int | None = None

    @dataclasses.dataclass
    class VideoData:
        url: str
        preprocess_kwargs: dict | None = None
        max_long_side_pixel: int | None = None

    def flatten_nested_list(x):
        return [i for s in x for i in flatten_nested_list(s)] if isinstance(x, list) else [x]

    package(
        "sglang.srt.utils",
        os.path.join(base, "srt", "utils"),
        ImageData=ImageData,
        VideoData=VideoData,
        flatten_nested_list=flatten_nested_list,
        ConcurrentCounter=type("ConcurrentCounter", (), {}),
    )
    # CUDA IPC transport for multimodal features (embed_types, msgpack_utils import the name).
    package(
        "sglang.srt.utils.cuda_ipc_transport_utils",
        CudaIpcTensorTransportProxy=type("CudaIpcTensorTransportProxy", (), {}),
    )

    # scheduler types io_struct annotates with (schedule_batch imports the model runner).
    class CaptureHiddenMode(enum.IntEnum):
        NULL = 0
        FULL = 1
        LAST = 2

    def get_return_hidden_states_mode(v):
        if v is True:
            return CaptureHiddenMode.FULL
        if v == "last":
            return CaptureHiddenMode.LAST
        if v is False:
            return CaptureHiddenMode.NULL
        raise ValueError("return_hidden_states must be a boolean or the string literal 'last'.")

    modality = importlib.import_module("sglang.srt.multimodal.modality")

    class MultimodalProcessorOutput(msgspec.Struct, kw_only=True):
        input_ids: list | None = None

    package(
        "sglang.srt.managers.schedule_batch",
        Modality=modality.Modality,
        MultimodalProcessorOutput=MultimodalProcessorOutput,
        ReturnHiddenStatesMode=bool | Literal["last"],
        SamplingLogprobsMode=Literal["selected", "support"],
        get_return_hidden_states_mode=get_return_hidden_states_mode,
    )

    # mm_utils imports the distributed runtime; io_struct needs has_valid_data (copied).
    def has_valid_data(data):
        if data is None:
            return False
        if isinstance(data, list):
            return any(has_valid_data(i) for i in flatten_nested_list(data))
        return True

    package("sglang.srt.multimodal.mm_utils", has_valid_data=has_valid_data)

    io_struct = importlib.import_module("sglang.srt.managers.io_struct")
    sampling_params = importlib.import_module("sglang.srt.sampling.sampling_params")
    tensor_bucket = importlib.import_module("sglang.srt.weight_sync.tensor_bucket")
    auth = importlib.import_module("sglang.srt.utils.auth")

    # The generated JSON contract (msgspec only), loaded by file path.
    api_spec = importlib.util.spec_from_file_location(
        "sglang_api_v1_types", os.path.join(base, "api", "v1", "api_types.py")
    )
    api_types = importlib.util.module_from_spec(api_spec)
    sys.modules["sglang_api_v1_types"] = api_types
    api_spec.loader.exec_module(api_types)

    # sglang's SafeUnpickler (allow-list) and init_custom_process_group (the server's end of the
    # weight-update group) live in utils/common.py, which imports the whole server: compile just
    # those definitions from sglang's own source.
    common_src = Path(base, "srt", "utils", "common.py").read_text()
    tree = ast.parse(common_src)
    keep = [
        n
        for n in tree.body
        if isinstance(n, ast.ClassDef | ast.FunctionDef)
        and n.name in ("SafeUnpickler", "_safe_load_torch_storage", "init_custom_process_group")
    ]
    if len(keep) != 3:
        raise RuntimeError("SafeUnpickler / init_custom_process_group not in sglang's common.py")
    ns = {
        "pickle": pickle,
        "io": io,
        "torch": torch,
        "torch_release": Version(torch.__version__).release,
    }
    exec(compile(ast.Module(body=keep, type_ignores=[]), "sglang/srt/utils/common.py", "exec"), ns)

    return types.SimpleNamespace(
        io=io_struct,
        SamplingParams=sampling_params.SamplingParams,
        FlattenedTensorBucket=tensor_bucket.FlattenedTensorBucket,
        FlattenedTensorMetadata=tensor_bucket.FlattenedTensorMetadata,
        SafeUnpickler=ns["SafeUnpickler"],
        init_custom_process_group=ns["init_custom_process_group"],
        api=api_types,
        auth=auth,
    )


# ---- the server (server process only) -----------------------------------------------------------


def build_app(args):  # noqa: C901 - one handler per endpoint, kept together
    import asyncio
    import base64
    import contextlib
    import io

    import pydantic
    import torch
    from aiohttp import web

    sg = load_sglang_classes()
    io_struct = sg.io
    adapters = {}

    def validate(cls, body):
        """FastAPI's body validation: pydantic over the io_struct class; ValidationError ->
        400 with sglang's ErrorResponse shape."""
        if cls not in adapters:
            adapters[cls] = pydantic.TypeAdapter(cls)
        return adapters[cls].validate_python(body)

    state = {
        "session": None,  # {"selector", "loaded"} while a weight-update session is open
        "version": "default",
        "released": set(),  # SGLang's offload_tags
        "paused": False,
        "groups": {},  # group_name -> list of per-rank ProcessGroups
        "weights": {},  # name -> tensor
        "log": [],
        "faults": {},  # path -> list of {"kind", "delay_s"}
        "inflight": set(),  # abort events of /generate requests in flight
        "generating": 0,  # /generate requests holding the model (SGLang's model_update_lock)
        "updating": 0,  # weight updates holding or waiting for it
        "health_checks": 0,  # GET /health and /health_generate (not in the log)
        # the radix cache: token sequences whose KV the server holds (meta_info.cached_tokens)
        "radix": [],
        "loras": {},  # adapter name -> path, loaded (/load_lora_adapter)
        "lora_paths": {},  # every name ever loaded -> path (SGLang's lora_ref_cache)
    }
    unpaused = asyncio.Event()
    unpaused.set()
    model_lock = asyncio.Condition()

    def crash(path, reason):
        """Die as SGLang 0.5.23's server dies here: an exception escaping the scheduler's event
        loop (run_scheduler_process logs it and SIGQUITs the server, which kills its process
        tree) or torch_memory_saver's exit(1). The request never gets an answer."""
        print(f"SGLang stand-in: SGLang's server exits here: {path}: {reason}", file=sys.stderr,
              flush=True)  # fmt: skip
        if args.crash_file:
            with open(args.crash_file, "a") as f:
                f.write(json.dumps({"path": path, "reason": reason}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        os._exit(CRASH_EXIT_CODE)

    def memory_gone():
        """Tags whose GPU memory is really released: all of SGLang's offload_tags with
        --enable-memory-saver (torch_memory_saver unmaps it), none without (a no-op)."""
        return sorted(state["released"]) if args.enable_memory_saver else []

    def model_runs(path):
        """The model runs for `path`: over unmapped memory that is an illegal memory access
        (CUDA error) in the scheduler."""
        if gone := memory_gone():
            crash(path, f"the model ran with {gone} released (a CUDA illegal memory access)")

    def idle():
        """Scheduler.is_fully_idle: no request running or queued in the scheduler."""
        return state["generating"] == 0

    @contextlib.asynccontextmanager
    async def generating():
        """A /generate request's reader hold on the model: it waits for weight updates."""
        async with model_lock:
            await model_lock.wait_for(lambda: state["updating"] == 0)
            state["generating"] += 1
        try:
            yield
        finally:
            async with model_lock:
                state["generating"] -= 1
                model_lock.notify_all()

    @contextlib.asynccontextmanager
    async def updating():
        """A weight update's writer hold: it waits for the requests running to finish, unless
        generation is paused (then it updates at once), as SGLang does."""
        if state["paused"]:
            yield
            return
        async with model_lock:
            state["updating"] += 1
            await model_lock.wait_for(lambda: state["generating"] == 0)
        try:
            yield
        finally:
            async with model_lock:
                state["updating"] -= 1
                model_lock.notify_all()

    seen: dict[str, int] = {}

    def scheduled_fault(path):
        """--fault PATH:KIND:N[:COUNT[:DELAY_S]]: requests N .. N+COUNT-1 to PATH misbehave
        as `kind` (the kinds of FakeServer.fault, and hang: the process stops answering)."""
        for spec in args.fault:
            target, kind, start, *rest = spec.split(":")
            count = int(rest[0]) if rest else 1
            delay = float(rest[1]) if len(rest) > 1 else 0.0
            if path == target and int(start) <= seen[path] < int(start) + count:
                return {"kind": kind, "delay_s": delay}
        return None

    def exit_now(path):
        """--exit-at PATH:N[:MARKER]: die at the N-th request to PATH (once, with a marker
        file: a restarted process finds it and lives)."""
        if not args.exit_at:
            return False
        target, count, *marker = args.exit_at.split(":", 2)
        if path != target or seen[path] != int(count):
            return False
        if marker:
            if Path(marker[0]).exists():
                return False
            Path(marker[0]).touch()
        return True

    def json_response(body, status=200):
        return web.Response(
            body=json.dumps(body).encode(), status=status, content_type="application/json"
        )

    def bad_request(message):  # sglang's ErrorResponse for validation errors
        return json_response(
            {"object": "error", "message": message, "type": "Bad Request", "param": None,
             "code": 400},
            400,
        )  # fmt: skip

    def summarize(body):
        if isinstance(body, dict) and "serialized_named_tensors" in body:
            body = dict(body)
            body["serialized_named_tensors"] = [
                f"<{len(s)} chars>" for s in body["serialized_named_tensors"]
            ]
        return body

    admin_paths = {
        "/flush_cache", "/update_weights_from_disk", "/init_weights_update_group",
        "/update_weights_from_tensor", "/begin_weight_update", "/end_weight_update",
        "/update_weights_from_distributed", "/release_memory_occupation",
        "/destroy_weights_update_group",
        "/resume_memory_occupation", "/abort_request", "/pause_generation",
        "/continue_generation",
    }  # fmt: skip

    weight_update_paths = {
        "/update_weights_from_tensor", "/update_weights_from_distributed",
        "/update_weights_from_disk",
    }  # fmt: skip

    @web.middleware
    async def sglang_middleware(request, handler):
        path = request.path
        if path.startswith("/_test/"):
            return await handler(request)
        level = (
            sg.auth.AuthLevel.ADMIN_OPTIONAL if path in admin_paths else sg.auth.AuthLevel.NORMAL
        )
        decision = sg.auth.decide_request_auth(
            method=request.method,
            path=path,
            authorization_header=request.headers.get("Authorization"),
            api_key=args.api_key,
            admin_api_key=None,
            auth_level=level,
        )
        if not decision.allowed:
            return json_response({"error": "Unauthorized"}, decision.error_status_code)
        raw = await request.read()
        body = None
        if raw:
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as e:
                return bad_request(f"JSON decode error: {e}")
        if not path.startswith("/health"):  # probes are not part of the protocol under test
            state["log"].append({"path": path, "method": request.method, "body": summarize(body)})
        request["json"] = body
        seen[path] = seen.get(path, 0) + 1
        faults = state["faults"].get(path)
        fault = faults.pop(0) if faults else scheduled_fault(path)
        if fault and fault["kind"] == "hang":
            os.kill(os.getpid(), signal.SIGSTOP)  # hung: connections open, nothing answers
        if fault and fault["kind"] == "slow":
            await asyncio.sleep(fault["delay_s"])
        if fault and fault["kind"] == "500":
            return json_response({"error": {"message": "injected internal error"}}, 500)
        if fault and fault["kind"] == "503":
            return json_response({"error": {"message": "injected: service unavailable"}}, 503)
        if (fault and fault["kind"] == "exit") or exit_now(path):
            os._exit(1)  # the process dies with the request in flight
        if fault and fault["kind"] == "close":
            request.transport.close()  # the client sees the connection drop
            return web.Response(status=500)
        request["fault"] = fault
        if path in weight_update_paths:
            async with updating():
                resp = await handler(request)
        else:
            resp = await handler(request)
        if fault and fault["kind"] == "malformed":
            return web.Response(
                body=b'{"text": "trunc', status=200, content_type="application/json"
            )
        return resp

    routes = web.RouteTableDef()

    @routes.get("/health")
    @routes.get("/health_generate")
    async def health(request):
        state["health_checks"] += 1
        if time.monotonic() < args.ready_at:
            return web.Response(status=503)
        if idle():  # SGLang runs a one-token generation (it skips it while requests run)
            model_runs(request.path)
        return web.Response(status=200)

    @routes.get("/server_info")
    async def server_info(request):
        # startup_time: this process's start-up durations (SGLang: perf_counter), new per process;
        # memory_usage: the sizes measured at start-up, whatever was released since.
        internal = {"startup_time": args.startup_time, "memory_usage": {"weight": 1.0,
                    "kvcache": 2.0, "graph": {"decode": 0.5}}}  # fmt: skip
        return json_response(
            {"tp_size": args.tp_size, "dp_size": args.dp_size, "pp_size": 1,
             "model_path": "fake", "weight_version": state["version"], "version": args.release,
             "startup_time": args.startup_time, "internal_states": [internal],
             "enable_lora": args.enable_lora, "max_lora_rank": args.max_lora_rank,
             "lora_target_modules": args.lora_target_modules or None}
        )  # fmt: skip

    @routes.get("/model_info")
    async def model_info(request):
        return json_response(
            {"model_path": "fake", "is_generation": True, "weight_version": state["version"]}
        )

    @routes.post("/generate")
    async def generate(request):
        body = request["json"]
        try:
            obj = validate(io_struct.GenerateReqInput, body)
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        contract_error = _contract_error(sg.api, body)
        if contract_error is not None:
            return json_response({"error": contract_error}, 400)
        if (lora_error := generate_lora_error(obj)) is not None:
            return json_response({"error": {"message": lora_error}}, 400)
        try:
            obj.normalize_batch_and_arguments()
            if obj.is_single:
                return json_response({"error": {"message": "test server: send batches"}}, 400)
            items = []
            for i in range(len(obj.input_ids)):
                sp = sg.SamplingParams(**obj.sampling_params[i])
                sp.normalize(None)
                sp.verify(args.vocab_size)
                ids = obj.input_ids[i]
                if any(not 0 <= t < args.vocab_size for t in ids):
                    raise ValueError(f"input_ids out of vocabulary [0, {args.vocab_size})")
                if obj.return_logprob[i] and obj.logprob_start_len[i] != -1:
                    return json_response({"error": {"message": "test server: input logprobs"}}, 400)
                items.append((ids, sp, obj.return_logprob[i]))
        except (ValueError, TypeError) as e:
            return json_response({"error": {"message": str(e)}}, 400)
        await unpaused.wait()
        async with generating():
            model_runs("/generate")
            return json_response(await completions(obj, items, request["fault"]))

    async def completions(obj, items, fault):
        await asyncio.sleep(args.generate_delay_s)
        version = state["version"]  # the weights this request runs on, held until it ends
        done = [
            fake_completion(
                ids, sp.sampling_seed, version, sp.max_new_tokens,
                sorted(sp.stop_token_ids or []), args.vocab_size,
            )
            for ids, sp, _ in items
        ]  # fmt: skip
        kept = None  # tokens each sample keeps when aborted
        if fault and fault["kind"] == "hold":  # stays in flight until /abort_request
            ev = asyncio.Event()
            state["inflight"].add(ev)
            await ev.wait()
            kept, message = 1, "Abort before prefill"
        elif args.token_delay_s:
            ev = asyncio.Event()
            state["inflight"].add(ev)
            loop = asyncio.get_running_loop()
            started = loop.time()
            longest = max(len(toks) for toks, _, _ in done)
            try:
                await asyncio.wait_for(ev.wait(), timeout=longest * args.token_delay_s)
                kept = int((loop.time() - started) / args.token_delay_s)
                message = "Aborted"
            except TimeoutError:
                pass
            finally:
                state["inflight"].discard(ev)
        # prefilled in order: a sample finds the prompts before it in the radix cache
        cached = []
        for ids, _, _ in items:
            cached.append(cached_tokens(ids))
            state["radix"].append(list(ids))
        out = []
        for rid, (ids, _, want_lp), (toks, lps, finish), hit in zip(
            obj.rid, items, done, cached, strict=True
        ):
            state["radix"].append(list(ids) + toks[:-1])  # the tokens it fed
            if kept is not None and len(toks) > kept:
                toks, lps = toks[:kept], lps[:kept]
                finish = {"type": "abort", "message": message, "status_code": None,
                          "err_type": None}  # fmt: skip
            meta = {
                "id": rid, "finish_reason": finish, "prompt_tokens": len(ids),
                "weight_version": version, "num_retractions": 0,
                "reasoning_tokens": 0, "completion_tokens": len(toks), "cached_tokens": hit,
                "e2e_latency": 0.001,
            }  # fmt: skip
            if want_lp:
                meta["output_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(lps, toks, strict=True)
                ]
                meta["input_token_logprobs"] = []
            if obj.return_routed_experts and args.enable_return_routed_experts:
                routes_ = fake_routed_experts(len(ids) + len(toks) - 1)
                meta["routed_experts"] = base64.b64encode(routes_.tobytes()).decode()
            item = {"text": "", "output_ids": toks, "meta_info": meta}
            sg.api.GenerateResponse.from_json_value(item)  # our answer obeys the contract
            out.append(item)
        return out

    def session_error(name):
        return json_response(
            {"success": False,
             "message": f"{name} must run between begin_weight_update() and end_weight_update()"},
            400,
        )  # fmt: skip

    def weight_fail(request):
        fault = request["fault"]
        if fault and fault["kind"] == "weight_fail":
            return json_response(
                {"success": False, "message": "Failed to update weights: injected shape mismatch "
                 "for model.layers.0.mlp.experts.3.gate_proj.weight"},
                400,
            )  # fmt: skip
        return None

    def load_into_weights(path):
        """Loading writes the model's parameters: released ones are unmapped memory."""
        if "weights" in memory_gone():
            crash(path, "weights loaded into released memory (a CUDA illegal memory access)")

    def cached_tokens(ids):
        """SGLang's prefix match: the longest prefix of `ids` the radix cache holds, leaving
        the last token to compute (it gives the first output's logits)."""
        best = 0
        for held in state["radix"]:
            n = 0
            for a, b in zip(held, ids[: len(ids) - 1], strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def record(named, version):
        state["radix"].clear()  # SGLang flushes its cache on a weight update
        for name, t in named:
            state["weights"][name] = t.clone()
        if version is not None:
            state["version"] = version
        if args.state_file:  # what a process that may die held, for the test to read
            held = {"version": state["version"], "weights": weight_sums()}
            tmp = Path(args.state_file + ".tmp")
            tmp.write_text(json.dumps(held))
            tmp.replace(args.state_file)

    def weight_sums():
        return {
            name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                   "sha256": _sha256(t)}
            for name, t in state["weights"].items()
        }  # fmt: skip

    @routes.post("/begin_weight_update")
    async def begin(request):
        try:
            obj = validate(io_struct.BeginWeightUpdateReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if state["session"] is not None:
            return json_response({"success": False, "message": "a weight-update session is "
                                  "already open; call end_weight_update() first"}, 400)  # fmt: skip
        state["session"] = {"selector": obj.selector, "loaded": False}
        return json_response({"success": True, "message": "Success"})

    @routes.post("/end_weight_update")
    async def end(request):
        try:
            validate(io_struct.EndWeightUpdateReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if state["session"] is None:
            return json_response({"success": False, "message": "no weight-update session is "
                                  "open; call begin_weight_update() first"}, 400)  # fmt: skip
        state["session"] = None
        return json_response({"success": True, "message": "Success"})

    @routes.post("/update_weights_from_tensor")
    async def from_tensor(request):
        try:
            obj = validate(io_struct.UpdateWeightsFromTensorReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if state["session"] is None:
            return session_error("update_weights_from_tensor")
        if (failed := weight_fail(request)) is not None:
            return failed
        load_into_weights("/update_weights_from_tensor")
        if len(obj.serialized_named_tensors) != args.tp_size:
            return json_response(
                {"success": False, "message": f"expected {args.tp_size} payloads (one per TP "
                 f"rank), got {len(obj.serialized_named_tensors)}"}, 400)  # fmt: skip
        per_rank = []
        for rank in range(args.tp_size):  # each TP rank reads only its own payload
            data = sg.SafeUnpickler(io.BytesIO(obj.serialized_named_tensors[rank])).load()
            if obj.load_format != "flattened_bucket":
                return json_response({"success": False, "message": "test server: "
                                      "flattened_bucket only"}, 400)  # fmt: skip
            metadata = [
                sg.FlattenedTensorMetadata(
                    name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx,
                    end_idx=m.end_idx, numel=m.numel,
                )
                for m in data["metadata"]
            ]  # fmt: skip
            bucket = sg.FlattenedTensorBucket(
                flattened_tensor=data["flattened_tensor"], metadata=metadata
            )
            per_rank.append(bucket.reconstruct_tensors())
        for other in per_rank[1:]:
            for (n0, t0), (n1, t1) in zip(per_rank[0], other, strict=True):
                assert n0 == n1 and torch.equal(t0, t1)
        record(per_rank[0], obj.weight_version)
        state["session"]["loaded"] = True
        msg = "Success" + (
            f" Weight version updated to {obj.weight_version}." if obj.weight_version else ""
        )
        return json_response({"success": True, "message": msg})

    @routes.post("/init_weights_update_group")
    async def init_group(request):
        try:
            obj = validate(io_struct.InitWeightsUpdateGroupReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if obj.group_name == "":  # an assert before WeightUpdater's try
            crash("/init_weights_update_group", "AssertionError: Group name cannot be empty")
        import multiprocessing

        loop = asyncio.get_running_loop()
        join = dict(
            backend=obj.backend, init_method=f"tcp://{obj.master_address}:{obj.master_port}",
            world_size=obj.world_size, group_name=obj.group_name,
        )  # fmt: skip
        # TP rank 0 lives here; ranks 1.. in their own processes, as sglang runs one scheduler
        # process per TP rank (torch allows one group of a name per process).
        ctx = multiprocessing.get_context("spawn")
        workers = []
        for r in range(1, args.tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_tp_rank_worker, args=(child, {**join, "rank": obj.rank_offset + r}),
                daemon=True,
            )  # fmt: skip
            proc.start()
            workers.append((proc, parent))
        try:
            pg = await loop.run_in_executor(
                None, _join_group, sg, {**join, "rank": obj.rank_offset}
            )
            for _, conn in workers:
                if isinstance(reply := await loop.run_in_executor(None, conn.recv), Exception):
                    raise reply
        except Exception as e:  # noqa: BLE001 - reported like sglang
            for proc, _ in workers:
                proc.kill()
            return json_response(
                {"success": False, "message": f"Failed to initialize custom process group: {e}."},
                400,
            )
        state["groups"][obj.group_name] = (pg, workers)
        return json_response(
            {"success": True, "message": "Succeeded to initialize custom process group."}
        )

    def destroy_group(name):
        pg, workers = state["groups"].pop(name)
        torch.distributed.destroy_process_group(pg)
        for proc, conn in workers:
            conn.send(None)
            proc.join(timeout=10)

    @routes.post("/destroy_weights_update_group")
    async def destroy(request):
        try:
            obj = validate(io_struct.DestroyWeightsUpdateGroupReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if obj.group_name not in state["groups"]:
            return json_response(
                {"success": False, "message": "The group to be destroyed does not exist."}, 400
            )
        destroy_group(obj.group_name)
        return json_response(
            {"success": True, "message": "Succeeded to destroy custom process group."}
        )

    @routes.post("/update_weights_from_distributed")
    async def from_distributed(request):
        try:
            obj = validate(io_struct.UpdateWeightsFromDistributedReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if state["session"] is None:
            return session_error("update_weights_from_distributed")
        if (failed := weight_fail(request)) is not None:
            return failed
        if obj.group_name not in state["groups"]:
            msg = (
                f"Failed to receive weights: Group {obj.group_name} not in "
                f"{list(state['groups'])}. Please call `init_weights_update_group` first."
            )
            return json_response({"success": False, "message": msg}, 400)
        load_into_weights("/update_weights_from_distributed")
        pg, workers = state["groups"][obj.group_name]
        meta = (obj.names, obj.dtypes, obj.shapes, obj.load_format)
        loop = asyncio.get_running_loop()

        def from_worker(conn):
            conn.send(meta)
            return conn.recv()

        try:
            named, *others = await asyncio.gather(
                loop.run_in_executor(None, _receive, sg, pg, *meta),
                *(loop.run_in_executor(None, from_worker, conn) for _, conn in workers),
            )
            for other in others:
                if isinstance(other, Exception):
                    raise other
        except Exception as e:  # noqa: BLE001 - reported like sglang
            return json_response({"success": False, "message": f"Failed to receive weights: {e}"},
                                 400)  # fmt: skip
        digests = {n: _sha256(t) for n, t in named}
        for other in others:  # every TP rank received the same bytes
            assert other == digests, "TP ranks received different tensors"
        record(named, obj.weight_version)
        state["session"]["loaded"] = True
        msg = "Succeeded to update parameter online." + (
            f" Weight version updated to {obj.weight_version}." if obj.weight_version else ""
        )
        return json_response({"success": True, "message": msg})

    @routes.post("/update_weights_from_disk")
    async def from_disk(request):
        try:
            obj = validate(io_struct.UpdateWeightFromDiskReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if (failed := weight_fail(request)) is not None:
            failed_body = json.loads(failed.body)
            failed_body["num_paused_requests"] = 0
            return json_response(failed_body, 400)
        from safetensors.torch import load_file

        root = Path(obj.model_path)
        index = root / "model.safetensors.index.json"
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            named = [kv for f in files for kv in load_file(str(root / f)).items()]
        except (OSError, ValueError, KeyError) as e:
            return json_response({"success": False, "message": f"Failed to get weights "
                                  f"iterator: {e}.", "num_paused_requests": 0}, 400)  # fmt: skip
        load_into_weights("/update_weights_from_disk")
        record(named, obj.weight_version)
        msg = "Succeeded to update model weights." + (
            f" Weight version updated to {obj.weight_version}." if obj.weight_version else ""
        )
        return json_response({"success": True, "message": msg, "num_paused_requests": 0})

    # ---- LoRA (SGLang's tokenizer_control_mixin / lora_manager, 0.5.23) ----------------------

    def lora_refusal(name=None):
        """Why SGLang refuses dynamic LoRA here, or None."""
        if not args.enable_lora:
            return "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
        return None

    def load_adapter(name, path):
        """SGLang's load checks: a name loaded once; rank and modules the pool can hold."""
        if name in state["loras"]:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        try:
            config = json.loads((Path(path) / "adapter_config.json").read_text())
            (Path(path) / "adapter_model.safetensors").stat()
        except (OSError, ValueError) as e:
            return f"Failed to load LoRA adapter {name}: {e}"
        modules = set(config.get("target_modules") or [])
        if config["r"] > args.max_lora_rank or not modules <= set(args.lora_target_modules):
            return (f"LoRA adapter {name} with rank {config['r']} is incompatible with the "
                    "current LoRA memory pool configuration. Please ensure that the LoRA "
                    "adapter's rank is within the configured `--max-lora-rank` and that the "
                    "target modules are included in `--lora-target-modules`.")  # fmt: skip
        state["loras"][name] = str(path)
        state["lora_paths"][name] = str(path)  # SGLang's lora_ref_cache: reloaded on demand
        return None

    def lora_answer(error):
        loaded = dict(state["loras"])
        if error is None:
            return json_response({"success": True, "error_message": None,
                                  "loaded_adapters": loaded})  # fmt: skip
        return json_response({"success": False, "error_message": error,
                              "loaded_adapters": None}, 400)  # fmt: skip

    @routes.post("/load_lora_adapter")
    async def load_lora(request):
        try:
            obj = validate(io_struct.LoadLoRAAdapterReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if args.dp_size != 1:  # an AssertionError in SGLang: a 500
            return json_response({"error": {"message": "data-parallel replicas are not "
                                  "supported for dynamic lora loading"}}, 500)  # fmt: skip
        return lora_answer(lora_refusal() or load_adapter(obj.lora_name, obj.lora_path))

    @routes.post("/unload_lora_adapter")
    async def unload_lora(request):
        try:
            obj = validate(io_struct.UnloadLoRAAdapterReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if (error := lora_refusal()) is None and obj.lora_name not in state["loras"]:
            error = f"LoRA adapter {obj.lora_name} is not loaded"
        if error is None:
            del state["loras"][obj.lora_name]
        return lora_answer(error)

    @routes.post("/update_weight_version")
    async def update_weight_version(request):
        try:
            obj = validate(io_struct.UpdateWeightVersionReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if obj.abort_all_requests:
            for event in state["inflight"]:
                event.set()
        state["version"] = obj.new_version
        message = f"Weight version updated to {obj.new_version}"
        return json_response({"success": True, "new_version": obj.new_version,
                              "message": message})  # fmt: skip

    def generate_lora_error(obj):
        """SGLang's _validate_and_resolve_lora: a named adapter must be loaded (an unloaded one
        is loaded again from its path)."""
        if not obj.lora_path:
            return None
        names = [obj.lora_path] if isinstance(obj.lora_path, str) else obj.lora_path
        for name in filter(None, names):
            if not args.enable_lora:
                return (f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please "
                        "launch the server with --enable-lora flag and preload adapters using "
                        "--lora-paths or /load_lora_adapter endpoint.")  # fmt: skip
            if name in state["loras"]:
                continue
            if name not in state["lora_paths"]:
                return f"Got LoRA adapter that has never been loaded: {name}"
            if (error := load_adapter(name, state["lora_paths"][name])) is not None:
                return f"Failed to implicitly load LoRA adapter {name}: {error}"
        return None

    def tags_of(obj):
        return obj.tags or ["weights", "kv_cache", "cuda_graph"]

    @routes.post("/release_memory_occupation")
    async def release(request):
        try:
            obj = validate(io_struct.ReleaseMemoryOccupationReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        tags = tags_of(obj)
        if not idle():  # SchedulerWeightUpdaterManager.release_memory_occupation
            crash("/release_memory_occupation", "AssertionError: release_memory_occupation should "
                  "be called only when server is idle.")  # fmt: skip
        again = sorted(set(tags) & set(memory_gone()))
        state["released"].update(tags)
        if "kv_cache" in tags:
            state["radix"].clear()
        if again:  # torch_memory_saver.pause of paused allocations: exit(1)
            crash("/release_memory_occupation", f"torch_memory_saver: Cannot pause allocation "
                  f"that is not active (tags {again} released already)")  # fmt: skip
        return json_response(None)

    @routes.post("/resume_memory_occupation")
    async def resume(request):
        try:
            obj = validate(io_struct.ResumeMemoryOccupationReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        for tag in tags_of(obj):
            if tag not in state["released"]:  # offload_tags is a set: remove raises
                crash("/resume_memory_occupation", f"KeyError: {tag!r} (not released)")
            state["released"].remove(tag)
        return json_response(None)

    @routes.route("*", "/flush_cache")
    async def flush_cache(request):
        if not idle():  # Scheduler.flush_cache refuses
            return web.Response(text="Flush cache failed.\n", status=400)
        state["radix"].clear()
        return web.Response(
            text="Cache flushed.\nPlease check backend logs for more details. (When there are "
            "running or waiting requests, the operation will not be performed.)\n"
        )

    @routes.post("/pause_generation")
    async def pause(request):
        try:
            obj = validate(io_struct.PauseGenerationReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        state["paused"] = True
        unpaused.clear()
        while obj.mode == "abort":  # requests in flight end now, with the tokens they have
            for ev in state["inflight"]:
                ev.set()
            state["inflight"].clear()
            if state["generating"] == 0:
                break
            await asyncio.sleep(0.01)  # one still starting: abort it too, as SGLang repeats
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    @routes.post("/continue_generation")
    async def cont(request):
        try:
            validate(io_struct.ContinueGenerationReqInput, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        state["paused"] = False
        unpaused.set()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    @routes.post("/abort_request")
    async def abort(request):
        try:
            obj = validate(io_struct.AbortReq, request["json"])
        except pydantic.ValidationError as e:
            return bad_request(str(e))
        if obj.abort_all:
            for ev in state["inflight"]:
                ev.set()
            state["inflight"].clear()
        return web.Response(status=200)

    # -- test controls --

    @routes.post("/_test/fault")
    async def set_fault(request):
        body = await request.json()
        state["faults"].setdefault(body["path"], []).extend(
            [{"kind": body["kind"], "delay_s": body.get("delay_s", 0.0)}] * body.get("count", 1)
        )
        return json_response({"ok": True})

    @routes.get("/_test/log")
    async def get_log(request):
        return json_response(state["log"])

    @routes.get("/_test/weights")
    async def get_weights(request):
        return json_response(weight_sums())

    @routes.get("/_test/state")
    async def get_state(request):
        return json_response(
            {"session_open": state["session"] is not None, "version": state["version"],
             "released": sorted(state["released"]), "memory_gone": memory_gone(),
             "paused": state["paused"], "health_checks": state["health_checks"],
             "groups": list(state["groups"]), "loras": state["loras"]}
        )  # fmt: skip

    @routes.post("/_test/reset")
    async def reset(request):
        state.update(session=None, version="default", paused=False, weights={}, log=[],
                     faults={})  # fmt: skip
        state["released"].clear()
        state["radix"].clear()
        for name in list(state["groups"]):
            destroy_group(name)
        unpaused.set()
        return json_response({"ok": True})

    app = web.Application(middlewares=[sglang_middleware], client_max_size=1 << 30)
    app.add_routes(routes)
    return app


def _sha256(t) -> str:
    import torch

    data = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return hashlib.sha256(data).hexdigest()


def _join_group(sg, join: dict):
    """sglang's WeightUpdater.init_weights_update_group for one TP rank."""
    from datetime import timedelta

    return sg.init_custom_process_group(**join, timeout=timedelta(seconds=60))


def _receive(sg, pg, names, dtypes, shapes, load_format):
    """sglang's receive_weights_from_distributed for one TP rank."""
    import torch

    if load_format == "flattened_bucket":
        bucket = sg.FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")
        torch.distributed.broadcast(bucket.get_flattened_tensor(), src=0, group=pg)
        return bucket.reconstruct_tensors()
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        torch.distributed.broadcast(t, src=0, group=pg)
        out.append((name, t))
    return out


def _tp_rank_worker(conn, join: dict) -> None:
    """A TP rank > 0 of a simulated multi-GPU server: joins the group, then receives each
    announced bucket and reports its digests; None ends it."""
    import torch

    try:
        sg = load_sglang_classes()
        pg = _join_group(sg, join)
    except Exception as e:  # noqa: BLE001 - sent to the server process
        conn.send(RuntimeError(str(e)))
        return
    conn.send("joined")
    while (meta := conn.recv()) is not None:
        try:
            conn.send({n: _sha256(t) for n, t in _receive(sg, pg, *meta)})
        except Exception as e:  # noqa: BLE001 - sent to the server process
            conn.send(RuntimeError(str(e)))
    torch.distributed.destroy_process_group(pg)


def _contract_error(api, body):
    """sglang's /generate contract gate (srt/entrypoints/api_contract.py)."""
    try:
        api.GenerateRequest.from_json_value(body)
    except api.JsonContractError as e:
        return str(e)
    return None


def main() -> None:
    import asyncio
    import multiprocessing

    from aiohttp import web

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--enable-return-routed-experts", action="store_true")
    p.add_argument("--api-key", default=None)
    p.add_argument("--health-delay-s", type=float, default=0.0)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    p.add_argument("--exit-at", default=None, help="PATH:N[:MARKER], see exit_now")
    p.add_argument("--fault", action="append", default=[], help="see scheduled_fault")
    p.add_argument("--generate-delay-s", type=float, default=0.0, help="each /generate's time")
    p.add_argument(
        "--token-delay-s", type=float, default=0.0,
        help="each output token's time: an abort or a pause (mode abort) cuts a request short",
    )  # fmt: skip
    p.add_argument("--release", default="0.5.23", help="the SGLang version /server_info reports")
    p.add_argument("--state-file", default=None, help="weights held, written at each update")
    p.add_argument("--enable-memory-saver", action="store_true", help="released memory is gone")
    p.add_argument("--enable-lora", action="store_true", help="/load_lora_adapter works")
    p.add_argument("--max-lora-rank", type=int, default=0)
    p.add_argument("--lora-target-modules", nargs="*", default=[])
    p.add_argument("--crash-file", default=None, help="where it records dying as SGLang would")
    args, _ = p.parse_known_args()  # launch_command's other flags (model path, host, ...)
    args.ready_at = time.monotonic() + args.health_delay_s
    if key := os.environ.get("SGLANG_TEST_AUTHKEY"):
        multiprocessing.current_process().authkey = bytes.fromhex(key)

    started = time.perf_counter()

    async def serve():
        runner = web.AppRunner(build_app(args), access_log=None)
        await runner.setup()
        # As SGLang's /server_info reports it: this process's start-up durations.
        args.startup_time = {"load_weight": time.perf_counter() - started,
                             "tokenizer_e2e": time.perf_counter() - started}  # fmt: skip
        site = web.TCPSite(runner, "127.0.0.1", args.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        print(f"READY {port}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
