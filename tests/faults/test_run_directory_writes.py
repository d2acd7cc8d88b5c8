"""Many processes, one run directory: every rank of a job runs `check_run_directory` at start-up,
before any process group exists, against the same (fresh or existing) directory. Exactly one of
them writes; no start fails or reads half a file; nothing temporary is left behind. And every
atomic write goes through a temporary of its own, so even writers that do race on one file
(two jobs, or a bug) never take each other's temporary. A second run in the directory is
refused; what kills leave (temporaries, a checkpoint half deleted by a rotation, records moved
aside twice) is cleaned or kept once; a run directory that cannot be made is one line.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
from launch import gspo_train_env

from gspo_megatron import files
from gspo_megatron.config import ConfigError, compose, resolve, to_dict
from gspo_megatron.run_files import (
    CONFIG_FILE,
    MetricsLogger,
    RunDirectoryInUse,
    check_run_directory,
)

RANKS = 8
ROUNDS = 25


def _run_config():
    cfg, _, _ = resolve(compose(["parallel=ep2"]), 2)
    return cfg


def _start_up(rank: int, root: Path, barrier, results) -> None:
    """One rank of a job starting ROUNDS times: in a fresh directory and in an existing one,
    all ranks released together."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(RANKS))
    cfg = _run_config()
    errors = []
    for i in range(ROUNDS):
        for run_dir in (root / f"fresh_{i}", root / "existing"):
            barrier.wait()
            try:
                lock = check_run_directory(run_dir, cfg)
                # A job's ranks all start before any of them ends: the writer keeps its lock
                # (if it took one) until every rank of this round is done.
                barrier.wait()
                del lock
            except (ConfigError, OSError, RuntimeError, ValueError) as err:
                errors.append(f"rank {rank}, {run_dir.name}: {type(err).__name__}: {err}")
                barrier.abort()
                results.put(errors)
                return
            except Exception:
                errors.append(traceback.format_exc())
                barrier.abort()
                results.put(errors)
                return
    results.put(errors)


def test_every_rank_starting_in_one_run_directory_at_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(RANKS, timeout=60)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_start_up, args=(r, tmp_path, barrier, results)) for r in range(RANKS)
    ]
    for p in procs:
        p.start()
    errors = [e for _ in procs for e in results.get(timeout=300)]
    for p in procs:
        p.join(timeout=60)
    broken = [e for e in errors if "BrokenBarrierError" not in e]
    assert not broken, "\n".join(broken[:8])
    assert not errors
    expected = to_dict(_run_config())
    for run_dir in [tmp_path / "existing", *(tmp_path / f"fresh_{i}" for i in range(ROUNDS))]:
        assert json.loads((run_dir / CONFIG_FILE).read_text()) == expected
        left = [p.name for p in run_dir.iterdir() if files.is_temporary(p)]
        assert not left, (run_dir, left)


def _write_many(path: Path, text: str, count: int, barrier, results) -> None:
    barrier.wait()
    try:
        for _ in range(count):
            files.write_atomically(path, text)
    except OSError as err:
        results.put(f"{type(err).__name__}: {err}")
        return
    results.put(None)


def test_racing_writers_never_share_a_temporary(tmp_path):
    """Four processes replace one file 200 times each: every rename succeeds, the file always
    holds one writer's whole text, and no temporary is left."""
    ctx = multiprocessing.get_context("fork")
    barrier, results = ctx.Barrier(4, timeout=60), ctx.Queue()
    target = tmp_path / "shared.json"
    texts = [json.dumps({"writer": w, "pad": "x" * 4096 * (w + 1)}) for w in range(4)]
    procs = [
        ctx.Process(target=_write_many, args=(target, texts[w], 200, barrier, results))
        for w in range(4)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert outcomes == [None] * 4, outcomes
    assert target.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["shared.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "run_config.json"
    files.write_atomically(target, "old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomically(target, "new")
    monkeypatch.undo()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["run_config.json"]


def test_temporary_names_say_their_writer(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "7")
    name = files.temporary_path(tmp_path / "metrics.jsonl")
    assert name.parent == tmp_path and files.is_temporary(name)
    host, pid = files.temporary_writer(name)
    assert pid == os.getpid() and name.name.startswith(f"metrics.jsonl.tmp-{host}-{pid}-r7-")
    assert files.temporary_path(tmp_path / "metrics.jsonl") != name


def test_only_temporaries_of_gone_writers_are_removed_when_others_may_write(tmp_path):
    ctx = multiprocessing.get_context("fork")
    gone = ctx.Process(target=lambda: (tmp_path / "gone").write_text(
        files.temporary_path(tmp_path / "a.json").name
    ))  # fmt: skip
    gone.start()
    gone.join()
    dead = tmp_path / (tmp_path / "gone").read_text()
    alive = files.temporary_path(tmp_path / "b.json")
    for path in (dead, alive):
        path.write_text("partial")
    foreign = tmp_path / "c.json.tmp-otherhost-1-r0-abcdef12"
    foreign.write_text("partial")
    assert files.remove_temporaries(tmp_path, only_dead_writers=True) == [dead]
    assert alive.exists() and foreign.exists()
    assert sorted(files.remove_temporaries(tmp_path)) == sorted([alive, foreign])


def test_a_second_run_in_the_directory_is_refused_naming_the_first(tmp_path):
    cfg = _run_config()
    held = check_run_directory(tmp_path, cfg)
    assert held.held
    with pytest.raises(
        RunDirectoryInUse, match=rf"in use by another run \(host .*, pid {os.getpid()}"
    ):
        check_run_directory(tmp_path, cfg)
    held.release()
    check_run_directory(tmp_path, cfg).release()


def test_leftovers_of_interrupted_writes_are_removed_at_start_up(tmp_path):
    """What kill -9 can leave: a config's temporary, a records file's, a checkpoint being
    saved; removed by the next start (the writer holds the lock: nobody else writes there)."""
    run = tmp_path / "run"
    left = [
        files.temporary_path(run / "run_config.json"),
        files.temporary_path(run / "eval" / "step_000002" / "heldout.jsonl"),
        files.temporary_path(run / "checkpoints" / "step_000004"),
    ]
    for path in left:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("partial")
    (run / "checkpoints" / "step_000002").mkdir()
    check_run_directory(run, _run_config()).release()
    assert not [p for p in run.rglob("*") if files.is_temporary(p)]
    assert (run / "checkpoints" / "step_000002").is_dir()


def test_records_moved_aside_by_an_interrupted_rewind_are_kept_once(tmp_path):
    """A rewind killed after moving records to metrics.superseded.jsonl but before rewriting
    metrics.jsonl moves them again on the next start: the side file holds them once. A record
    cut short by a kill does not swallow the next one."""
    cfg, _, _ = resolve(compose(["logging.progress=false", "logging.tensorboard=false"]), 1)
    log = MetricsLogger(tmp_path, cfg, total_steps=4, enabled=True)
    for step in (1, 2, 3):
        log.write(step, {"reward/mean": step / 10})
    side = tmp_path / "metrics.superseded.jsonl"
    records = (tmp_path / "metrics.jsonl").read_text().splitlines()
    side.write_text(records[2] + "\n")  # moved aside, then killed before the rewrite
    log.rewind(2)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == records[:2]
    assert side.read_text().splitlines() == [records[2]]
    log.write(3, {"reward/mean": 0.33})
    again = (tmp_path / "metrics.jsonl").read_text().splitlines()[2]
    side.write_text(side.read_text() + '{"step": 9, "reward/me')  # a kill mid-append
    log.rewind(2)
    assert side.read_text().splitlines() == [records[2], '{"step": 9, "reward/me', again]


def test_a_rotation_killed_mid_delete_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    """The rotation deletes the oldest checkpoints beyond keep_last; a kill in the middle of a
    deletion (here: after its first file) must not leave a checkpoint under its final name
    with files missing. What it leaves is a temporary, removed at the next start."""
    from gspo_megatron.run_files import RunCheckpoints

    run = tmp_path / "run"
    for step in (2, 4, 6):
        ckpt = run / "checkpoints" / f"step_{step:06d}"
        (ckpt / "rng").mkdir(parents=True)
        for name in (".metadata", "__0_0.distcp", "manifest.json", "rng/rank_00000.pt"):
            (ckpt / name).write_text(name)

    class Killed(BaseException):
        pass

    def delete_one_file_then_die(path, *args, **kwargs):
        next(f for f in sorted(Path(path).rglob("*")) if f.is_file()).unlink()
        raise Killed

    monkeypatch.setattr("shutil.rmtree", delete_one_file_then_die)
    with pytest.raises(Killed):
        RunCheckpoints(run, keep_last=2)._rotate(6)
    monkeypatch.undo()
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left[1:] == ["step_000004", "step_000006"] and files.is_temporary(left[0]), left
    check_run_directory(run, _run_config()).release()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == left[1:]


def test_a_run_directory_that_cannot_be_made_is_one_line(tmp_path):
    """Hydra makes the run directory and its log file before gspo-train runs: when it cannot
    (here a file is in the way; a full disk or a quota alike) the user gets one line."""
    (tmp_path / "file").write_text("")
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_megatron.train", f"hydra.run.dir={tmp_path}/file/run"],
        capture_output=True, text=True, timeout=300, env=gspo_train_env(),
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"gspo-train: error: [Errno 20] Not a directory: '{tmp_path}/file/run'"
    ]


def test_a_directory_is_replaced_whole(tmp_path):
    """files.staged swaps a new directory in for an old one (the disk export of a version
    written again after a resume, a converter's --overwrite); a failure keeps the old one."""
    target = tmp_path / "weights_v3"
    for content in ("old", "new"):
        with files.staged(target) as tmp:
            tmp.mkdir()
            (tmp / "model.safetensors").write_text(content)
    with pytest.raises(OSError), files.staged(target) as tmp:
        tmp.mkdir()
        raise OSError(28, "No space left on device")
    assert (target / "model.safetensors").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["weights_v3"]


def test_the_writer_is_known_from_the_launcher_before_any_process_group():
    assert files.launcher_rank({}) == 0
    assert files.launcher_rank({"RANK": "3", "WORLD_SIZE": "8"}) == 3
    with pytest.raises(files.LaunchError, match="WORLD_SIZE=8 but RANK is not set"):
        files.launcher_rank({"WORLD_SIZE": "8"})
