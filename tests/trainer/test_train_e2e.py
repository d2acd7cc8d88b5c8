"""`gspo-train` end to end on CPU: learning, layout invariance, exact resume, SIGTERM."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from launch import (
    REPO,
    checkpoint_tensors,
    free_port,
    gspo_train,
    gspo_train_command,
    gspo_train_env,
    hf_policy,
    read_metrics,
)

from gspo_megatron.data.tokenizer import load_tokenizer

# A short version of the default run: same model, task, algorithm and engine.
SMALL = [
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "rollout.max_new_tokens=6",
    "eval.heldout.problems=16",
    "logging.progress=false",
    "logging.tensorboard=false",
]


def train(
    run_dir: Path,
    *overrides: str,
    nproc: int = 1,
    timeout: float = 600,
    check: bool = True,
    faults: str | None = None,
) -> subprocess.CompletedProcess:
    expect = "success" if check else ("killed" if faults else "failure")
    return gspo_train(
        run_dir, *SMALL, *overrides, nproc=nproc, timeout=timeout, expect=expect, faults=faults,
    )  # fmt: skip


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory) -> Path:
    """A finished one-step run of SMALL (read-only: copy it to change it)."""
    run_dir = tmp_path_factory.mktemp("one_step") / "run"
    train(run_dir, "trainer.steps=1", "eval.every=0")
    return run_dir


def metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir)


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model tensors."""
    return checkpoint_tensors(sorted((run_dir / "checkpoints").glob("step_*"))[-1])


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    """The default configuration, shortened to 210 of its 800 steps: the reward of the last 20
    steps is clearly above that of the first 20 (the full run reaches ~1.0, see README; at seed 0
    the reward is ~0.01 over the first 20 steps, ~0.26 over steps 191-210, ~0.34 over 231-250)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "gspo_megatron.train",
        f"hydra.run.dir={tmp_path}",
        "trainer.steps=210",
        "eval.every=125",
        "logging.progress=false",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 211))
    start = sum(r["reward/mean"] for r in records[:20]) / 20
    end = sum(r["reward/mean"] for r in records[-20:]) / 20
    assert end > start + 0.15, (start, end)
    for key in (
        "reward/mean",
        "reward/std",
        "reward/accuracy",
        "response/length_mean",
        "actor/clip_fraction",
        "actor/seq_clip_fraction",
        "actor/ratio_mean",
        "actor/approx_kl",
        "actor/entropy",
        "actor/grad_norm",
        "actor/lr",
        "moe/route_change_fraction",
        "moe/max_expert_load_over_mean",
        "perf/rollout_tokens_per_s",
        "perf/train_tokens_per_s",
        "time/generate",
        "time/train",
        "time/sync_weights",
        "sampling/groups_zero_variance",
    ):
        assert key in records[-1], key
    assert "eval/pass@1" in records[124] and "eval/avg@1" in records[-1]
    assert (tmp_path / "run_config.json").is_file()
    assert (tmp_path / "tensorboard").is_dir()
    # periodic checkpoints (trainer.save_every=100) and the final one; keep_last=2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_000200",
        "step_000210",
    ]
    # gspo-eval on the last checkpoint: the greedy evaluation the loop made at that step
    out = tmp_path / "gspo_eval"
    cmd = [sys.executable, "-m", "gspo_megatron.evaluate", f"hydra.run.dir={out}",
           f"model.init_from={tmp_path / 'checkpoints' / 'step_000210'}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    summary = json.loads((out / "summary.json").read_text())["benchmarks"]["heldout"]["metrics"]
    # the benchmark's metrics (eval/rollout/* are the engine's counts while the loop evaluated)
    in_loop = {
        k.removeprefix("eval/"): v
        for k, v in records[-1].items()
        if k.startswith("eval/") and not k.startswith("eval/rollout/")
    }
    assert summary == pytest.approx(in_loop), (summary, in_loop)
    assert 0 < summary["reward_mean"] < 1, summary  # no exact solve yet, but partial credit
    step_210 = tmp_path / "eval" / "step_000210" / "heldout.jsonl"
    assert (out / "heldout.jsonl").read_text() == step_210.read_text()


def test_sigterm_checkpoints_and_exits_zero(tmp_path):
    cmd = gspo_train_command(tmp_path, [*SMALL, "trainer.steps=500", "eval.every=0"])
    proc = subprocess.Popen(
        cmd, env=gspo_train_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip
    metrics_file = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while (not metrics_file.exists() or not metrics_file.read_text().count("\n") >= 2) and (
        time.time() < deadline
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    steps = len(metrics(tmp_path))
    assert 2 <= steps < 500
    checkpoint = tmp_path / "checkpoints" / f"step_{steps:06d}"
    assert (checkpoint / "gspo_checkpoint.json").is_file()
    assert "SIGTERM" in out


@pytest.mark.distributed
def test_two_processes_match_one_given_the_same_rollouts(tmp_path, one_step_run):
    """EP2 over two processes vs one process, from the same initial weights and seed.

    Random initialisation is not layout-invariant (each expert-parallel or pipeline rank draws
    only its own shard), so both start from one checkpoint (model.init_from). The embedded
    engine then samples the same tokens on both (per-sequence seeded uniforms, prompts split
    over data-parallel replicas), and the training side agrees to float32 precision; timings
    and throughput differ. The MoE load-balancing loss is computed per micro-batch (as in
    megatron), so it depends on how the batch is split over ranks: it is off by default."""
    one, two = tmp_path / "one", tmp_path / "two"
    init = f"model.init_from={one_step_run / 'checkpoints' / 'step_000001'}"
    common = [
        "trainer.steps=3",
        "eval.every=0",
        "seed=11",
        init,
    ]
    train(one, *common)
    train(two, *common, "parallel=ep2", nproc=2)
    a, b = metrics(one), metrics(two)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b, strict=True):
        assert ra["reward/mean"] == rb["reward/mean"]
        assert ra["response/length_mean"] == rb["response/length_mean"]
        for key in ("actor/loss", "actor/clip_fraction", "actor/entropy", "actor/grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-6), key


def test_config_errors_are_reported_before_building(tmp_path):
    proc = train(tmp_path, "algorithm.loss=gspoo", check=False)
    assert proc.returncode != 0
    assert "algorithm.loss='gspoo'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = train(tmp_path / "b", "parallel.tp=3", check=False)
    assert "world size 1 is not divisible by parallel.tp*pp*cp" in proc.stderr


def test_refuses_directory_of_another_run(tmp_path, one_step_run):
    run_dir = tmp_path / "run"
    shutil.copytree(one_step_run, run_dir)
    proc = train(run_dir, "trainer.steps=2", "algorithm=grpo", check=False)
    assert proc.returncode != 0
    assert "holds a run with a different config" in proc.stderr
    assert "algorithm.loss" in proc.stderr


def test_starts_from_a_hugging_face_checkpoint(tmp_path):
    init = hf_policy(tmp_path / "hf")
    proc = train(tmp_path / "run", f"model.init_from={init}", "trainer.steps=1", "eval.every=0")
    assert proc.returncode == 0
    assert len(metrics(tmp_path / "run")) == 1
    other = hf_policy(tmp_path / "hf_wide", hidden_size=32)
    proc = train(tmp_path / "run2", f"model.init_from={other}", "trainer.steps=1", check=False)
    assert proc.returncode != 0
    assert "checkpoint has model.hidden_size=32" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "overrides",
    [
        # (every loss preset, dynamic sampling and routing replay also run in test_option_sweep.py)
        # duplication of informative groups, solved-prompt pre-filter; one step off policy
        ["algorithm=dupo", "rollout.mode=one_step_off"],
        [
            "algorithm=grpo",
            "algorithm.routing_replay=r2",
            "algorithm.mismatch=tis",
            "algorithm.mismatch_level=sequence",
            "algorithm.kl_coef=0.01",
            "algorithm.num_minibatches=1",
            "rollout.mode=async",
        ],  # recorded routes, decoupled PPO (TIS per sequence), KL to the initial policy
    ],
    ids=["dupo-one-step-off", "grpo-r2-tis-kl-async"],
)
def test_algorithm_options_run(tmp_path, overrides):
    train(tmp_path, "trainer.steps=2", "eval.every=0", *overrides)
    records = metrics(tmp_path)
    assert len(records) == 2
    for record in records:  # trained, or dynamic sampling found nothing to learn from
        assert "actor/loss" in record or record["sampling/groups_used"] == 0, record
    # step 2's batch generated while step 1 trained: with the initial weights
    assert [r["async/staleness_max"] for r in records] == [0, 1]
    if "algorithm.kl_coef=0.01" in overrides:
        # The reference is the initial policy: step 1's only minibatch trains from it. The
        # reference forward and the training forward pack each sequence with other neighbours,
        # so the same weights agree to float32 rounding (measured ~1e-15), not bitwise.
        assert abs(records[0]["actor/kl_ref"]) < 1e-9
        assert records[1]["actor/kl_ref"] > 1e-6


def _sglang_stand_in():
    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    import sglang_test_server

    return sglang_test_server


# Server faults are noticed and waited out at test speed (docs/SGLANG.md, "Failures").
SGLANG_FAULTS = [
    "rollout=sglang",
    "rollout.sglang.weight_sync=disk",
    "+rollout.sglang.health_check_interval_s=0.2",
    "+rollout.sglang.max_retries=1",
    "+rollout.sglang.backoff_s=0.01",
    "+rollout.sglang.samples_per_request=8",
]


def _train_on(server, tmp_path: Path, *overrides: str) -> list[dict]:
    """gspo-train (run directory tmp_path/run) on the stand-in `server` with SGLANG_FAULTS and
    disk weight sync; the server's request log. The server is stopped either way."""
    try:
        train(
            tmp_path / "run", *overrides, *SGLANG_FAULTS, f"+rollout.sglang.urls=[{server.url}]",
            f"+rollout.sglang.disk_dir={tmp_path / 'weights'}",
        )  # fmt: skip
        server.assert_not_crashed()
        return server.log()
    finally:
        server.stop()


def _safetensors_sums(directory: Path) -> dict[str, dict]:
    """{name: shape, dtype, sha256} of a safetensors directory, as the stand-in reports them."""
    from safetensors.torch import load_file

    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, t in load_file(str(file)).items():
            data = t.contiguous().view(torch.uint8).numpy().tobytes()
            out[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                         "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    return out


def test_sglang_server_killed_mid_run_is_restarted_and_nothing_is_lost(tmp_path):
    """Two launched servers (the stand-in behind a fake interpreter) and two trainer ranks; one
    server dies at its 5th /generate (step 3 of 8) with requests in flight. They are resubmitted
    to the other server, the dead one is restarted with its launch command and given the
    trainer's weights before it serves again, and the run completes: every step once, one
    restart counted, and each server holds the trainer's last weights. (A /generate takes 1 s,
    so that the restarted stand-in, ~3 s to start, is back before the run ends.)"""
    fake = _sglang_stand_in()
    launch = []
    for i, dies in enumerate([["--exit-at", f"/generate:5:{tmp_path / 'died'}"], []]):
        python = fake.fake_interpreter(
            tmp_path, "--vocab-size", "48", "--state-file", str(tmp_path / f"held_{i}.json"),
            "--generate-delay-s", "1", "--crash-file", str(tmp_path / f"crash_{i}"), *dies,
            name=f"python_{i}",
        )  # fmt: skip
        launch.append(f"{{model_path:/nowhere,port:{free_port()},python:'{python}'}}")
    train(
        tmp_path / "run", "trainer.steps=8", "eval.every=0", *SGLANG_FAULTS,
        f"+rollout.sglang.launch=[{','.join(launch)}]",
        f"+rollout.sglang.disk_dir={tmp_path / 'weights'}",
        f"+rollout.sglang.log_dir={tmp_path / 'logs'}",
        nproc=2,
    )  # fmt: skip
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert fake.read_crashes(tmp_path / "crash_0") == fake.read_crashes(tmp_path / "crash_1") == []
    assert sum(r["rollout/server_restarts"] for r in records) == 1
    assert sum(r["rollout/requests_resubmitted"] for r in records) >= 1
    assert (tmp_path / "died").exists()
    final = _safetensors_sums(tmp_path / "weights" / "weights_v8")
    for i in range(2):
        held = json.loads((tmp_path / f"held_{i}.json").read_text())
        assert held["version"] == "8" and held["weights"] == final, f"server {i}"


# Each server misbehaves in one way (the stand-in's --fault/--exit-at), and what the log line
# its failure leaves says next to its URL (a state change, or the resubmission of a request).
FAULT_MODES = {
    "exit_mid_request": (["--exit-at", "/generate:3"], "cannot reach SGLang server at"),
    "hang": (["--fault", "/generate:hang:3"], "hung or gone"),
    "503_for_a_while": (["--fault", "/generate:503:3:6"], "answered HTTP 503"),
    "refused_update": (
        ["--fault", "/update_weights_from_disk:weight_fail:2"],
        "-> stale (weight update to version 1 failed",
    ),
    "slow_health": (["--fault", "/health:slow:4:2:3"], "no /health"),
    "sound": ([], None),
}


def test_sglang_fault_modes_through_gspo_train(tmp_path):
    """Six attached servers, five misbehaving (FAULT_MODES): every step completes once on what
    serves, each failure is one log line with its server's URL and the reason, and every server
    that still answers at the end holds the trainer's last weights."""
    from concurrent.futures import ThreadPoolExecutor

    fake = _sglang_stand_in()
    held = {mode: tmp_path / f"held_{mode}.json" for mode in FAULT_MODES}

    def start(mode: str):
        args = [*FAULT_MODES[mode][0], "--state-file", str(held[mode])]
        return fake.start_fake_server(
            routed_experts=False, vocab_size=48,
            extra_args=[*args, "--generate-delay-s", "0.2"],
        )  # fmt: skip

    with ThreadPoolExecutor(len(FAULT_MODES)) as pool:
        servers = dict(zip(FAULT_MODES, pool.map(start, FAULT_MODES), strict=True))
    steps = 6
    try:
        train(
            tmp_path / "run", f"trainer.steps={steps}", "eval.every=0", *SGLANG_FAULTS,
            f"+rollout.sglang.urls=[{','.join(s.url for s in servers.values())}]",
            f"+rollout.sglang.disk_dir={tmp_path / 'weights'}",
            "+rollout.sglang.liveness_timeout_s=1", "rollout.sglang.samples_per_request=4",
        )  # fmt: skip
    finally:
        for server in servers.values():
            server.proc.send_signal(signal.SIGCONT)
            server.stop()
    for server in servers.values():  # whatever else went wrong, nothing a real server dies of
        server.assert_not_crashed()
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    total = {k: sum(r[k] for r in records) for k in records[0] if k.startswith("rollout/")}
    assert total["rollout/requests_resubmitted"] >= 3  # exit, hang, 503
    assert total["rollout/weight_update_failures"] == 1
    log = (tmp_path / "run" / "train.rank0.log").read_text().splitlines()
    for mode, (_, line) in FAULT_MODES.items():
        url = servers[mode].url
        if line is not None:
            assert [x for x in log if url in x and line in x], (mode, url, line)
    final = _safetensors_sums(tmp_path / "weights" / f"weights_v{steps}")
    for mode in ("503_for_a_while", "refused_update", "slow_health", "sound"):
        state = json.loads(held[mode].read_text())
        assert state["version"] == str(steps) and state["weights"] == final, mode


def test_sglang_servers_down_past_the_deadline_checkpoint_and_stop(tmp_path):
    """The only server dies at step 3: the run waits rollout.sglang.recovery_timeout_s, saves
    the state before step 3, and exits non-zero with one line naming the server. With the server
    back, the same command resumes there and completes, each step recorded once."""
    fake = _sglang_stand_in()
    server = fake.start_fake_server(
        routed_experts=False, vocab_size=48, extra_args=["--exit-at", "/generate:3"]
    )
    run = tmp_path / "run"
    args = [
        "trainer.steps=4", "eval.every=0", *SGLANG_FAULTS,
        "+rollout.sglang.recovery_timeout_s=3", "rollout.sglang.samples_per_request=32",
        f"+rollout.sglang.urls=[{server.url}]", f"+rollout.sglang.disk_dir={tmp_path / 'w'}",
    ]  # fmt: skip
    try:
        proc = train(run, *args, check=False)
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("gspo-train: error: no SGLang server could generate for 3 s")
        assert f"{server.url}: suspect" in last
        # the wait said at once what it waits for, until when, and which key sets it
        waits = [x for x in proc.stderr.splitlines() if "no SGLang server can generate:" in x]
        assert len(waits) == 1 and f"{server.url}: suspect" in waits[0], proc.stderr[-3000:]
        assert "(rollout.sglang.recovery_timeout_s=3)" in waits[0]
        assert [r["step"] for r in metrics(run)] == [1, 2]
        assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002"]
        server.proc.wait(timeout=10)
        server.assert_not_crashed()  # it died of --exit-at, not of a request SGLang dies of
        server = fake.start_fake_server(routed_experts=False, vocab_size=48, port=server.port)
        train(run, *args)
        server.assert_not_crashed()
    finally:
        server.stop()
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


# SGLang servers attached to a run, in the memory state a previous run left them
# (docs/SGLANG.md, "Server memory"): they must survive the run. Offloading releases their
# memory after each generation (the stand-in starts with --enable-memory-saver).
OFFLOAD = [*SGLANG_FAULTS, "+rollout.sglang.offload_after_generate=true",
           "+rollout.sglang.recovery_timeout_s=20", "eval.every=0"]  # fmt: skip
ALL_RELEASED = ["weights", "kv_cache", "cuda_graph"]


def _memory_record(run: Path) -> dict[str, dict]:
    return json.loads((run / "sglang_memory.json").read_text())["servers"]


def _train_and_survive(servers, run: Path, *overrides: str, **kw) -> subprocess.CompletedProcess:
    """gspo-train on `servers`; fails first, naming the reason, if one died as SGLang would."""
    failure = None
    try:
        proc = train(run, *overrides, **kw)
    except pytest.fail.Exception as e:
        failure, proc = e, None
    for server in servers:
        server.assert_not_crashed()
        assert server.proc.poll() is None, f"{server.url} exited"
    if failure is not None:
        raise failure
    return proc


def test_sglang_attached_servers_survive_gspo_train(tmp_path):
    """Attached servers holding all their memory (the state every server starts in): the run
    sends no memory call a server would die of (a /resume_memory_occupation of a resident tag
    raises KeyError in SGLang's scheduler, which ends the server), and they still serve after,
    left with their memory released as the record says."""
    fake = _sglang_stand_in()
    servers = [fake.start_fake_server(routed_experts=False, vocab_size=48) for _ in range(2)]
    run = tmp_path / "run"
    try:
        _train_and_survive(
            servers, run, "trainer.steps=2", *OFFLOAD,
            f"+rollout.sglang.urls=[{','.join(s.url for s in servers)}]",
            f"+rollout.sglang.disk_dir={tmp_path / 'weights'}",
        )  # fmt: skip
        for server in servers:
            assert "/generate" in [e["path"] for e in server.log()]
            assert server.state()["released"] == sorted(ALL_RELEASED)
            assert _memory_record(run)[server.url]["released"] == ALL_RELEASED
    finally:
        for server in servers:
            server.stop()
    assert [r["step"] for r in metrics(run)] == [1, 2]


def test_sglang_servers_left_released_by_a_killed_run_or_restarted_since(tmp_path):
    """A run releasing its servers' memory after each generation is killed in step 2's training:
    both servers hold everything released, as the run directory records. One is restarted
    (a new process holds everything again), and a third server joins. The resumed run brings
    back exactly what each one released, when it needs it (never a resident tag: that would
    kill the server), completes, and leaves them as the last generation left them: released,
    the record and a line saying so."""
    fake = _sglang_stand_in()
    run = tmp_path / "run"
    servers = {name: fake.start_fake_server(routed_experts=False, vocab_size=48)
               for name in ("released", "restarted")}  # fmt: skip
    args = ["trainer.steps=3", "trainer.save_every=1", *OFFLOAD,
            f"+rollout.sglang.disk_dir={tmp_path / 'weights'}"]  # fmt: skip

    def urls() -> str:
        return f"+rollout.sglang.urls=[{','.join(s.url for s in servers.values())}]"

    try:
        # 4 optimizer steps per RL step: the 5th is in step 2, after its generation
        _train_and_survive(servers.values(), run, *args, urls(), check=False,
                           faults="kill_after_optimizer_step=5")  # fmt: skip
        for server in servers.values():
            assert server.state()["released"] == sorted(ALL_RELEASED)
            assert _memory_record(run)[server.url]["released"] == ALL_RELEASED
        old = servers["restarted"]
        old.stop()
        servers["restarted"] = fake.start_fake_server(routed_experts=False, vocab_size=48,
                                                      port=old.port)  # fmt: skip
        servers["new"] = fake.start_fake_server(routed_experts=False, vocab_size=48)
        proc = _train_and_survive(servers.values(), run, *args, urls())
        assert "resumed at step 1" in proc.stderr
        left = [x for x in proc.stderr.splitlines() if "left with GPU memory released" in x]
        assert len(left) == 1 and all(s.url in left[0] for s in servers.values())
        record = _memory_record(run)
        for server in servers.values():
            assert server.state()["released"] == sorted(ALL_RELEASED)
            assert record[server.url]["released"] == ALL_RELEASED
            assert record[server.url]["in_doubt"] == []
        logs = {name: [e["path"] for e in server.log()] for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    # The released server: its weights back before the resumed run's first update.
    released = logs["released"]
    resumed = released.index("/resume_memory_occupation", released.index("/generate") + 1)
    assert resumed < released.index("/update_weights_from_disk", resumed)
    # The others held everything: nothing resumed before their first release.
    for name in ("restarted", "new"):
        paths = logs[name]
        assert paths.index("/release_memory_occupation") < paths.index(
            "/resume_memory_occupation"
        ), name


def test_sglang_servers_left_partly_released_by_a_killed_run(tmp_path):
    """Killed while writing step 1's metrics, after the weight update: the server holds its
    weights and has its KV cache and CUDA graphs released. The resumed run brings back only
    those, before its first generation."""
    fake = _sglang_stand_in()
    run = tmp_path / "run"
    server = fake.start_fake_server(routed_experts=False, vocab_size=48)
    args = ["trainer.steps=2", *OFFLOAD, f"+rollout.sglang.urls=[{server.url}]",
            f"+rollout.sglang.disk_dir={tmp_path / 'weights'}"]  # fmt: skip
    try:
        _train_and_survive([server], run, *args, check=False, faults="kill_mid_metrics=1")
        assert server.state()["released"] == ["cuda_graph", "kv_cache"]
        assert _memory_record(run)[server.url]["released"] == ["kv_cache", "cuda_graph"]
        before = len(server.log())
        _train_and_survive([server], run, *args)
        log = server.log()[before:]  # the resumed run's requests
    finally:
        server.stop()
    assert [r["step"] for r in metrics(run)] == [1, 2]
    paths = [e["path"] for e in log]
    first = paths.index("/resume_memory_occupation")
    assert log[first]["body"]["tags"] == ["kv_cache", "cuda_graph"]
    assert first < paths.index("/generate")


def test_sglang_rollouts_and_disk_weight_sync(tmp_path):
    """The SGLang path of the trainer against the stand-in server of tests/rollout (it answers
    /generate like SGLang and checks every request with SGLang's own classes): generation
    requests, then after each step the policy's weights exported to HF safetensors and loaded
    with /update_weights_from_disk. (Tensor mode passes shared-memory handles that only a
    process sharing the trainer's multiprocessing key can open; tests/rollout covers it.)"""
    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    from sglang_test_server import start_fake_server

    server = start_fake_server(routed_experts=False, vocab_size=48)
    sglang = [
        "rollout=sglang",
        f"+rollout.sglang.urls=[{server.url}]",
        "rollout.sglang.weight_sync=disk",
        f"+rollout.sglang.disk_dir={tmp_path / 'weights'}",
    ]
    try:
        train(tmp_path / "run", "trainer.steps=2", "eval.every=0", *sglang)
        log = server.log()
        weights = server.weights()
        # gspo-eval on the last checkpoint sends the servers its weights, then generates
        checkpoint = tmp_path / "run" / "checkpoints" / "step_000002"
        cmd = [sys.executable, "-m", "gspo_megatron.evaluate", *SMALL, *sglang,
               f"hydra.run.dir={tmp_path / 'eval'}", f"model.init_from={checkpoint}"]  # fmt: skip
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env=gspo_train_env(), cwd=REPO
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
        eval_paths = [entry["path"] for entry in server.log()[len(log) :]]
        eval_weights = server.weights()
        server.assert_not_crashed()
    finally:
        server.stop()
    paths = [entry["path"] for entry in log]
    assert paths.count("/generate") >= 2
    # The servers hold the trainer's weights before the first generation, then after each step.
    assert paths.count("/update_weights_from_disk") == 3
    assert paths.index("/update_weights_from_disk") < paths.index("/generate")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in weights
    assert len(metrics(tmp_path / "run")) == 2
    assert eval_paths.index("/update_weights_from_disk") < eval_paths.index("/generate")
    assert eval_weights == weights  # the checkpoint holds the weights of the last sync
    problems = (tmp_path / "eval" / "heldout.jsonl").read_text().splitlines()
    assert len(problems) == 16  # SMALL: eval.heldout.problems=16


def test_sglang_async_rollouts_through_gspo_train(tmp_path):
    """rollout.mode=async on SGLang (the stand-in, 32 tokens of 30 ms: a batch generates for
    longer than a step trains): batches generate ahead while steps train, weight updates abort
    the requests running and continue them on the new weights (partial rollouts), no trained
    token is older than max_staleness, and every step is recorded once."""
    fake = _sglang_stand_in()
    server = fake.start_fake_server(
        routed_experts=False, vocab_size=48, extra_args=["--token-delay-s", "0.03"]
    )
    log = _train_on(
        server, tmp_path, "trainer.steps=4", "eval.every=4", "rollout.mode=async",
        "rollout.max_staleness=2", "rollout.partial_rollout_mask=true",
        "rollout.max_new_tokens=32",
    )  # fmt: skip
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["async/staleness_max"] <= 2 and r["async/dropped_samples"] == 0 for r in records)
    partial = [r["async/partial_responses"] for r in records]
    assert sum(partial) > 0 and sum(r["async/weight_swaps"] for r in records) > 0, partial
    assert sum(r["async/masked_tokens"] for r in records) > 0  # partial_rollout_mask
    assert "eval/pass@1" in records[-1]
    pauses = [e["body"] for e in log if e["path"] == "/pause_generation"]
    assert pauses and all(b == {"mode": "abort"} for b in pauses)
    assert len(pauses) == sum(e["path"] == "/continue_generation" for e in log)


def test_async_killed_and_resumed_records_every_step_once(tmp_path):
    """rollout.mode=async killed (kill -9) in step 3: its generator process leaves with the
    trainer, and the resumed run draws the batches that were in flight again and records every
    step once, with no token more than max_staleness versions old. (Two ranks run async in
    tests/device/test_emulated_train.py.)"""
    common = [
        "rollout.mode=async",
        "rollout.queue_batches=3",
        "rollout.max_staleness=2",
        "rollout.max_new_tokens=12",
        "trainer.steps=5",
        "trainer.save_every=2",
        "eval.every=5",
    ]
    started = time.time()
    # num_minibatches=4 optimizer steps per RL step: the 10th is in step 3
    killed = train(tmp_path, *common, check=False, faults="kill_after_optimizer_step=10")
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2]
    # the resource tracker unlinks the generator's semaphores without telling the user
    assert "leaked semaphore" not in killed.stderr, killed.stderr[-2000:]
    time.sleep(2)  # the process notices its trainer is gone within 0.5 s
    orphans = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline", "create_time"])
        if p.info["create_time"] >= started and "spawn_main" in " ".join(p.info["cmdline"] or [])
    ]
    assert not orphans, orphans
    proc = train(tmp_path, *common)
    assert "resumed at step 2" in proc.stderr
    records = metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["async/staleness_max"] <= 2 for r in records)
    assert all(r["async/dropped_samples"] == 0 for r in records)
    assert "eval/pass@1" in records[-1]


MULTI_TURN = (
    "env.name=envs.scripted_envs:TwoObservations", "env.max_turns=4", "env.max_tokens=40",
    "model.tokenizer=char_tools", "model.vocab_size=80", "rollout.max_new_tokens=16",
)  # fmt: skip


def test_multi_turn_episodes_through_gspo_train(tmp_path):
    """Episodes with observations between model turns, on the embedded engine with routing
    replay R3 (the last turn's routes cover the whole trajectory) and TIS: every step trains,
    observations are masked out (model-token fraction < 1), failures are counted."""
    train(
        tmp_path / "run", *MULTI_TURN, "trainer.steps=3", "eval.every=3",
        "algorithm.routing_replay=r3", "algorithm.mismatch=tis",
        "algorithm.mismatch_level=sequence",
    )  # fmt: skip
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(1 < r["env/turns_mean"] <= 4 for r in records)
    assert all(0 < r["env/model_token_fraction"] < 1 for r in records)
    assert all(r["actor/optimizer_steps"] >= 1 for r in records)
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-4 for r in records)
    assert "eval/pass@1" in records[-1]


def test_multi_turn_episodes_on_sglang(tmp_path):
    """The same episodes on SGLang (the stand-in): each turn is a /generate request with the
    whole trajectory as input_ids; the observations' tokens are in the next request's input."""
    fake = _sglang_stand_in()
    server = fake.start_fake_server(routed_experts=False, vocab_size=80)
    log = _train_on(server, tmp_path, *MULTI_TURN, "trainer.steps=2", "eval.every=0")
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["env/turns_mean"] > 1 for r in records)
    inputs = [e["body"]["input_ids"] for e in log if e["path"] == "/generate"]
    flat = [ids for body in inputs for ids in (body if isinstance(body[0], list) else [body])]
    # a later turn's request ends with the observation: <eos> <tool_response>+:+...</tool_response>
    tokenizer = load_tokenizer("char_tools")
    opening, closing = tokenizer.convert_tokens_to_ids(["<tool_response>", "</tool_response>"])
    later = [ids for ids in flat if opening in ids]
    assert later and all(ids[-1] == closing for ids in later)
    assert all(ids[ids.index(opening) - 1] == tokenizer.eos_token_id for ids in later)
    # ... whose request starts with the request of the turn before it
    assert all(any(ids[: len(p)] == p for p in flat if len(p) < len(ids)) for ids in later)


@pytest.mark.parametrize("layout", [(), ("parallel.tp=2", "parallel.sequence_parallel=true")],
                         ids=["one-rank", "tp2"])  # fmt: skip
def test_lora_adapters_synced_to_sglang_through_its_lora_api(tmp_path, layout):
    """rollout.sglang.lora_sync=adapter: a LoRA policy (rank 4, attention; on one rank, and
    TP-split on two, gathered by the sender) sends the stand-in
    (started as SGLang would be for it: --enable-lora, --max-lora-rank, --lora-target-modules)
    a PEFT adapter directory per version; it generates with the newest one named in every
    /generate, and holds only that one at the end."""
    from safetensors.torch import load_file

    sys.path.insert(0, str(REPO / "tests" / "rollout"))
    from sglang_test_server import start_fake_server

    lora = ["--enable-lora", "--max-lora-rank", "4",
            "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj"]  # fmt: skip
    server = start_fake_server(routed_experts=False, vocab_size=48, extra_args=lora)
    adapters = tmp_path / "adapters"
    try:
        train(tmp_path / "run", "trainer.steps=2", "eval.every=0", "rollout=sglang",
              f"+rollout.sglang.urls=[{server.url}]", "rollout.sglang.weight_sync=disk",
              f"+rollout.sglang.disk_dir={adapters}", "rollout.sglang.lora_sync=adapter",
              "lora.rank=4",
              "lora.targets=[attention.linear_qkv,attention.linear_proj]", *layout,
              nproc=2 if layout else 1)  # fmt: skip
        log, state = server.log(), server.state()
        server.assert_not_crashed()
    finally:
        server.stop()
    loads = [e["body"]["lora_name"] for e in log if e["path"] == "/load_lora_adapter"]
    assert len(loads) == 3 and len(set(loads)) == 3  # before the first step, after each
    last = loads[-1]
    assert state["loras"] == {last: str(adapters / f"adapter_v{last.removeprefix('gspo_v')}")}
    assert not [e for e in log if e["path"] == "/update_weights_from_disk"]  # no full weights
    named = [e["body"].get("lora_path") for e in log if e["path"] == "/generate"]
    assert named[0] == loads[0] and set(named) <= set(loads), (loads, named)
    written = load_file(str(Path(state["loras"][last]) / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in written
    assert all(".mlp." not in name for name in written)
    config = json.loads((Path(state["loras"][last]) / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert len(metrics(tmp_path / "run")) == 2
