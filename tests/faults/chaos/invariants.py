"""What must hold after every history, whatever was thrown at it. Each check returns the
violations it found (empty: it holds), each one line naming what and where."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from faults.chaos.jobs import temporaries
from launch import checkpoint_tensors

from gspo_megatron.checkpoint import manifest

# Keys that measure time or the machine, not the run.
VOLATILE = ("time/", "perf/")


def complete_lines(path: Path) -> list[str]:
    """The lines of a records file that are whole JSON records."""
    if not path.is_file():
        return []
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            json.loads(line)
        except ValueError:
            continue
        lines.append(line)
    return lines


def every_step_once(run_dir: Path, steps: int) -> list[str]:
    recorded = [json.loads(x).get("step") for x in complete_lines(run_dir / "metrics.jsonl")]
    if recorded != list(range(1, steps + 1)):
        return [f"metrics.jsonl records steps {recorded}, not 1..{steps} once each"]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    if len(lines) != steps:
        return [f"metrics.jsonl holds {len(lines) - steps} line(s) that are not records"]
    return []


def nothing_lost(run_dir: Path, seen: set[str]) -> list[str]:
    """Every record seen in metrics.jsonl after any attempt is still there or was moved to
    metrics.superseded.jsonl."""
    kept = set(complete_lines(run_dir / "metrics.jsonl"))
    kept |= set(complete_lines(run_dir / "metrics.superseded.jsonl"))
    lost = sorted(seen - kept)
    return [f"record lost (in neither metrics file): {line[:120]}" for line in lost[:5]]


def checkpoints_complete(run_dir: Path) -> list[str]:
    """Every checkpoint under its final name matches its manifest (sizes and checksums); what is
    not complete was moved to checkpoints/superseded/."""
    problems = []
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*")):
        found = manifest.verify(ckpt)
        problems += [f"{ckpt.name}: {p}" for p in found]
    return problems


def no_temporaries(*roots: Path) -> list[str]:
    return [f"temporary left: {p}" for p in temporaries(*roots)]


def same_as_reference(run_dir: Path, reference: Path, steps: int) -> list[str]:
    """Records (but their timings) and the final checkpoint's weights equal those of the
    uninterrupted run with the same seed, bit for bit."""

    def stable(directory: Path) -> list[dict]:
        records = [json.loads(x) for x in complete_lines(directory / "metrics.jsonl")]
        return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]

    problems = []
    mine, theirs = stable(run_dir), stable(reference)
    for a, b in zip(mine, theirs, strict=False):
        differing = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        if differing:
            shown = ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in differing[:3])
            problems.append(f"step {a.get('step')}: records differ from the reference ({shown})")
            break
    final = f"checkpoints/step_{steps:06d}"
    try:
        with warnings.catch_warnings():  # DCP's note that it loads in one process
            warnings.simplefilter("ignore", UserWarning)
            wa, wb = checkpoint_tensors(run_dir / final), checkpoint_tensors(reference / final)
    except (OSError, RuntimeError, ValueError) as err:
        return [*problems, f"{final}: cannot compare the weights ({err})"]
    differing = [k for k in wa.keys() | wb.keys() if k not in wa or k not in wb]
    differing += [k for k in wa.keys() & wb.keys() if not torch.equal(wa[k], wb[k])]
    if differing:
        problems.append(f"{final}: weights differ from the reference ({sorted(differing)[:3]})")
    return problems
