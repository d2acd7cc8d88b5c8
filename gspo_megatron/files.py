"""Files that many processes share: one writer per file, and atomic replacement.

A run directory is written by every rank of a job (and, over requeues, by several jobs in turn),
often on a shared filesystem. Two rules keep it consistent:

- **One writer per file.** The writer is decided before any process group exists, from the rank
  the launcher gives each process (`launcher_rank`: torchrun and gspo_megatron.slurm set
  RANK), or by the process group once it exists.
- **Atomic replacement through a temporary unique to its writer.** `write_atomically` (and
  `replacing` / `staged` for writers that stream or take a path) write
  `NAME.tmp-HOST-PID-rRANK-RANDOM` in the target's directory, fsync it, rename it over `NAME`
  and fsync the directory. A reader sees the old file or the new one, never a mixture; two
  writers never share a temporary; a failure removes the temporary before the error goes on.
  A kill -9 can leave one behind: `remove_temporaries` deletes them (the run's writer does so at
  start-up, holding the run directory's lock, so none of them can still be in use).

No heavy imports: everything (converters, tools, the trainer, tests) uses these.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO

TEMPORARY_MARK = ".tmp-"
# NAME.tmp-HOST-PID-rRANK-RANDOM (HOST may hold dashes; the last three fields do not).
_TEMPORARY = re.compile(r"^(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-r(?P<rank>\d+)-[0-9a-f]+$")


class LaunchError(RuntimeError):
    """The launcher's environment does not say which process this is."""


def launcher_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank in its job as the launcher set it (RANK), before any process group
    exists; 0 for a process started alone. Decides who writes the run's shared files."""
    world = env.get("WORLD_SIZE", "1")
    rank = env.get("RANK")
    if rank is None:
        if world not in ("", "1"):
            raise LaunchError(
                f"WORLD_SIZE={world} but RANK is not set: start multi-process runs with "
                "`python -m gspo_megatron.torchrun` (torchrun's arguments) or "
                "`python -m gspo_megatron.slurm torchrun`, which give every process its rank"
            )
        return 0
    try:
        return int(rank)
    except ValueError:
        raise LaunchError(f"RANK={rank!r} is not a process rank (an integer)") from None


def temporary_path(path: str | os.PathLike) -> Path:
    """A fresh name for `path`'s temporary, in its directory, unique to this writer (host,
    process, rank) and to this call."""
    path = Path(path)
    host = socket.gethostname().replace("/", "_") or "host"
    tag = f"{host}-{os.getpid()}-r{_rank_or_zero()}-{uuid.uuid4().hex[:8]}"
    return path.with_name(f"{path.name}{TEMPORARY_MARK}{tag}")


def is_temporary(path: str | os.PathLike) -> bool:
    """Whether `path` is named as a temporary of `temporary_path` (or of an earlier version's
    `NAME.tmp` / `NAME.tmp-XXXXXXXX`)."""
    name = Path(path).name
    return name.endswith(".tmp") or TEMPORARY_MARK in name


def temporary_writer(path: str | os.PathLike) -> tuple[str, int] | None:
    """(host, pid) of the process that named this temporary, when its name says."""
    match = _TEMPORARY.match(Path(path).name)
    return (match["host"], int(match["pid"])) if match else None


def write_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """`data` in a temporary renamed over `path` (durably): a kill leaves the old file or the
    new one. Raises OSError (ENOSPC, ...) with nothing left behind."""
    mode = "wb" if isinstance(data, bytes) else "w"
    with replacing(path, mode) as f:
        f.write(data)


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """An open temporary that replaces `path` when the block ends without an error (flushed,
    fsynced, renamed, directory fsynced); removed when it raises."""
    if mode not in ("w", "wb"):
        raise ValueError(f"replacing() writes a whole file: mode 'w' or 'wb', not {mode!r}")
    with staged(path) as tmp:
        encoding = None if "b" in mode else "utf-8"
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def staged(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path for `path` (the block creates a file or a directory there), renamed
    over `path` when the block succeeds; removed, whatever it holds, when the block raises.

    A directory replacing a directory is swapped in: the old one is renamed to a temporary,
    the new one into place, then the old one removed (a kill in between leaves `path` missing
    and both under temporary names, removed as leftovers)."""
    final = Path(path)
    tmp = temporary_path(final)
    try:
        yield tmp
        if tmp.is_dir() and final.is_dir() and not final.is_symlink():
            old = temporary_path(final)
            os.replace(final, old)
            os.replace(tmp, final)
            remove(old)
        else:
            os.replace(tmp, final)
    except BaseException:
        remove(tmp)
        raise
    fsync_dir(final.parent)


def remove(path: Path) -> None:
    """Delete a file or a directory tree, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_temporaries(
    directory: str | os.PathLike, *, recursive: bool = False, only_dead_writers: bool = False
) -> list[Path]:
    """Delete the temporaries left in `directory` (and below, with `recursive`) by writers that
    were interrupted. The caller must know that nobody else writes there now (the run's writer
    holding the run directory's lock), or pass `only_dead_writers`: then only temporaries named
    by a process of this host that is gone are deleted."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    found = directory.rglob("*") if recursive else directory.iterdir()
    for path in sorted(found):
        if not is_temporary(path) or (only_dead_writers and not _writer_is_gone(path)):
            continue
        remove(path)
        removed.append(path)
    return removed


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename or creation in `directory` durable (a no-op where directories cannot be
    opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _writer_is_gone(path: Path) -> bool:
    writer = temporary_writer(path)
    if writer is None or writer[0] != socket.gethostname().replace("/", "_"):
        return False
    try:
        os.kill(writer[1], 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _rank_or_zero() -> int:
    try:
        return launcher_rank()
    except LaunchError:
        return 0
