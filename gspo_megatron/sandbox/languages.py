"""Languages the sandbox runs: what files a program becomes under /code and which command runs it.

A language is a `Language`: `files(program, spec)` gives the files written read-only into
/code (the program's input is /code/input, its stdin), `argv` the command (an absolute path
inside the sandbox's root; "{python}" stands for the interpreter the sandbox uses), and
`ro_paths` the host directories it needs besides /usr and the interpreter's prefix (bound
read-only at the same path). To add one, register it:

    LANGUAGES["cpp"] = Language(
        "cpp",
        files=lambda program, spec: {"main.cpp": program},
        argv=("/bin/sh", "-c", "g++ -O2 -o /sandbox/a.out /code/main.cpp && exec /sandbox/a.out"),
    )

(a compiler's temporary files and output go to /sandbox, the only writable place; give such a
language a larger `SandboxLimits` as compilers need more memory and time). `spec` is the
harness's settings, e.g. {"mode": "call", "fn_name": ...}; a language without a harness
supports only {"mode": "script"}. `prewarm`: the language's programs can also run through
Python's harness loaded once by the slot, in a fork of the slot's interpreter, instead of by
exec of `argv` (SandboxConfig.prewarm); only Python's files fit that harness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HARNESS = Path(__file__).with_name("python_harness.py")
MODES = ("script", "call", "expression")


@dataclass(frozen=True)
class Language:
    name: str
    files: Callable[[str, dict], dict[str, str]]
    argv: tuple[str, ...]
    ro_paths: tuple[str, ...] = field(default_factory=tuple)
    modes: tuple[str, ...] = ("script",)
    prewarm: bool = False


def _python_files(program: str, spec: dict) -> dict[str, str]:
    return {
        "main.py": program,
        "harness.py": HARNESS.read_text(encoding="utf-8"),
        "spec": f"{spec['mode']}\n{spec.get('fn_name') or ''}",
    }


def _shell_files(program: str, spec: dict) -> dict[str, str]:
    return {"main.sh": program}


LANGUAGES: dict[str, Language] = {
    "python": Language(
        "python",
        _python_files,
        ("{python}", "-I", "-S", "-B", "/code/harness.py"),
        modes=MODES,
        prewarm=True,
    ),
    "sh": Language("sh", _shell_files, ("/bin/sh", "/code/main.sh")),
}


def get_language(name: str) -> Language:
    if name not in LANGUAGES:
        raise ValueError(f"unknown sandbox language {name!r}; choose one of {sorted(LANGUAGES)}")
    return LANGUAGES[name]
