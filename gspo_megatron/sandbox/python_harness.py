"""Runs a Python program inside the sandbox, as /code/harness.py (standard library only).

Two ways in (SandboxConfig.prewarm): exec'd as `python -I -S -B /code/harness.py`, or loaded
once by the slot's server (gspo_megatron/sandbox/slot.py), which imports PRELOAD with it and
calls `run_in_this_process` in each program's fork, sparing the interpreter's start-up.

/code/spec (its mode on the first line, a function name on the second) says how:
- script: /code/main.py runs as `__main__` with the test input on stdin (the
  stdin/stdout style of CodeForces and LiveCodeBench's stdin problems). `exit` and `quit`
  exist as in a normal interpreter, which `python -S` would leave out.
- call NAME: LiveCodeBench's functional style. The program runs with
  LiveCodeBench's imports in scope (`from typing import *`, collections, ...); NAME is a method
  of `Solution()` when the program defines that class, else a top-level function. Each line of
  stdin is one JSON argument; the JSON of the return value (tuples as lists) is written to the
  original stdout, everything the program prints goes to stderr.
- expression: /code/main.py is one Python expression; its value is printed.

Nothing here can be trusted to report honestly (the program runs in this interpreter and may
patch it); the executor compares the outputs with the expected ones outside the sandbox,
where the program cannot reach them.
"""

import builtins
import os
import sys

CALL_PRELUDE = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\n"
    "from random import *\nfrom statistics import *\nfrom itertools import *\n"
    "from functools import *\nfrom operator import *\nfrom io import *\nfrom sys import *\n"
    "from json import *\nfrom builtins import *\nfrom typing import *\nimport string\nimport re\n"
    "import datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\nimport math\n"
    "import random\nimport statistics\nimport itertools\nimport functools\nimport operator\n"
    "import io\nimport sys\nimport json\nsys.setrecursionlimit(50000)\n"
)
# What a warm slot imports once: the prelude's modules and what run_in_this_process needs.
PRELOAD = (
    "string", "re", "datetime", "collections", "heapq", "bisect", "copy", "math", "random",
    "statistics", "itertools", "functools", "operator", "io", "json", "typing", "atexit",
    "threading", "traceback",
)  # fmt: skip


def _exit(code=None):
    raise SystemExit(code)


def main(code_dir: str) -> None:
    """Run /code/main.py as /code/spec says (module docstring)."""
    main_path = os.path.join(code_dir, "main.py")
    builtins.exit = builtins.quit = _exit
    with open(os.path.join(code_dir, "spec")) as f:
        mode, _, fn_name = f.read().partition("\n")
    with open(main_path, encoding="utf-8") as f:
        source = f.read()
    module = type(sys)("__main__")  # a fresh __main__, as the interpreter gives a script
    module.__file__ = main_path
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = [main_path]
    namespace = module.__dict__
    if mode == "script":
        exec(compile(source, main_path, "exec"), namespace)
        return
    if mode == "expression":
        print(eval(compile(source, main_path, "eval"), namespace))
        return
    import json  # only here: it costs a third of an exec'd start-up

    result_fd = os.dup(1)
    os.dup2(2, 1)  # the program's prints go to stderr, the result alone to stdout
    sys.stdout = sys.stderr
    args = [json.loads(line) for line in sys.stdin.read().split("\n") if line.strip()]
    namespace["__name__"] = "solution"
    exec(CALL_PRELUDE, namespace)
    exec(compile(source, main_path, "exec"), namespace)
    owner = namespace["Solution"]() if "Solution" in namespace else None
    fn = getattr(owner, fn_name) if owner is not None else namespace[fn_name]
    value = fn(*args)
    if isinstance(value, tuple):
        value = list(value)
    os.write(result_fd, (json.dumps(value) + "\n").encode())


def _exit_status(exc: SystemExit) -> int:
    """The process's exit status for an uncaught SystemExit, as the interpreter computes it."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_in_this_process(code_dir: str) -> int:
    """`main` in a fork of the slot's interpreter, finishing as an exec'd interpreter would:
    fresh standard streams on fds 0-2 (UTF-8, as under LANG=C.UTF-8), an uncaught exception's
    traceback on stderr and status 1, non-daemon threads joined, atexit handlers run, the
    streams flushed (status 120 when that fails). Returns the exit status."""
    import atexit
    import io
    import threading
    import traceback

    def stream(fd: int, mode: str, errors: str, line_buffering: bool = False):
        raw = io.FileIO(fd, mode, closefd=False)
        buffered = io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw)
        return io.TextIOWrapper(
            buffered, encoding="utf-8", errors=errors, line_buffering=line_buffering
        )

    sys.stdin = sys.__stdin__ = stream(0, "r", "surrogateescape")
    sys.stdout = sys.__stdout__ = stream(1, "w", "surrogateescape")
    sys.stderr = sys.__stderr__ = stream(2, "w", "backslashreplace", line_buffering=True)
    status = 0
    try:
        main(code_dir)
    except SystemExit as exc:
        status = _exit_status(exc)
    except BaseException:
        traceback.print_exc()
        status = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except BaseException:
            status = 120
    return status


if __name__ == "__main__":
    main(os.path.dirname(os.path.abspath(__file__)))
