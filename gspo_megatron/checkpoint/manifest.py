"""`manifest.json`: every file of a checkpoint with its size and SHA-256, written last.

A checkpoint directory is complete and intact exactly when its manifest exists and every file it
lists has the listed size and digest. The manifest is the last file written before the directory
is renamed to its final name, so a kill at any point leaves either no final directory or one
whose manifest can be checked. Files are hashed by the rank that wrote them, right after writing
(the bytes are still in the page cache), so the cost is spread over the ranks; verifying splits
the files over the ranks the same way.

Pure: no megatron import, so the converters and tests use it too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from gspo_megatron.files import write_atomically

MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
_CHUNK = 8 << 20


class ManifestError(RuntimeError):
    """A checkpoint's manifest is missing or unreadable, or a file does not match it."""


def file_digest(path: str | Path) -> dict[str, int | str]:
    """{"size", "sha256"} of one file, read in chunks (hashlib releases the GIL on large ones)."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def digest_files(root: str | Path, names: Iterable[str]) -> dict[str, dict[str, int | str]]:
    root = Path(root)
    return {name: file_digest(root / name) for name in sorted(names)}


def write_manifest(root: str | Path, entries: dict[str, dict[str, int | str]]) -> Path:
    """Write the manifest (durably: fsync of the file and its directory)."""
    path = Path(root) / MANIFEST_FILE
    text = json.dumps({"version": MANIFEST_VERSION, "files": entries}, indent=1, sort_keys=True)
    write_atomically(path, text)
    return path


def read_manifest(root: str | Path) -> dict[str, dict[str, int | str]]:
    path = Path(root) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if data.get("version") != MANIFEST_VERSION or not isinstance(files, dict):
            raise ValueError(f"unsupported manifest version {data.get('version')!r}")
    except FileNotFoundError:
        raise ManifestError(f"{path}: missing (the checkpoint was not completed)") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ManifestError(f"{path}: unreadable ({err})") from err
    return files


def check_sizes(root: str | Path, entries: dict[str, dict[str, int | str]]) -> list[str]:
    """Problems with files missing or of the wrong size (cheap: no reading)."""
    root = Path(root)
    problems = []
    for name, entry in sorted(entries.items()):
        path = root / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if size != entry["size"]:
            what = "truncated" if size < entry["size"] else "longer than written"
            problems.append(f"{path}: {what} ({size} bytes, the manifest says {entry['size']})")
    return problems


def check_digests(
    root: str | Path, entries: dict[str, dict[str, int | str]], names: Sequence[str]
) -> list[str]:
    """Problems with the SHA-256 of `names` (a subset of the manifest's files)."""
    root = Path(root)
    problems = []
    for name in names:
        expected = entries[name]["sha256"]
        try:
            actual = file_digest(root / name)["sha256"]
        except OSError as err:
            problems.append(f"{root / name}: unreadable ({err.strerror or err})")
            continue
        if actual != expected:
            problems.append(
                f"{root / name}: checksum mismatch (expected sha256 {expected[:16]}…, "
                f"found {actual[:16]}…)"
            )
    return problems


def verify(root: str | Path, *, required: bool = True, rank: int = 0, world: int = 1) -> list[str]:
    """This process's share of checking `root` against its manifest: sizes (on rank 0) and the
    checksums of every `world`-th file from `rank`. Without a manifest: a problem when
    `required`, else nothing to check (a checkpoint written elsewhere)."""
    root = Path(root)
    if not required and not (root / MANIFEST_FILE).exists():
        return []
    try:
        entries = read_manifest(root)
    except ManifestError as err:
        return [str(err)]
    problems = check_sizes(root, entries) if rank == 0 else []
    return problems or check_digests(root, entries, sorted(entries)[rank::world])


def unlisted_files(root: str | Path, entries: dict[str, dict[str, int | str]]) -> list[str]:
    """Files under `root` that the manifest does not list (other than the manifest itself)."""
    root = Path(root)
    present = {
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST_FILE
    }
    return sorted(present - set(entries))


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
