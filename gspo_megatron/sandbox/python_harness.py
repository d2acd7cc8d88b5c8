"""Runs a Python program inside the sandbox, as /code/harness.py (standard library only).

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

It imports as little as it can (start-up time is paid per test). Nothing here can be trusted
to report honestly (the program runs in this interpreter and may patch it); the executor
compares the outputs with the expected ones outside the sandbox, where the program cannot
reach them.
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


CODE = os.path.dirname(os.path.abspath(__file__))  # /code, or a host directory without namespaces
MAIN = os.path.join(CODE, "main.py")


def _exit(code=None):
    raise SystemExit(code)


def _run(source: str, namespace: dict) -> None:
    exec(compile(source, MAIN, "exec"), namespace)


def main() -> None:
    builtins.exit = builtins.quit = _exit
    with open(os.path.join(CODE, "spec")) as f:
        mode, _, fn_name = f.read().partition("\n")
    with open(MAIN, encoding="utf-8") as f:
        source = f.read()
    namespace = {"__name__": "__main__", "__file__": MAIN, "__builtins__": builtins}
    if mode == "script":
        _run(source, namespace)
        return
    if mode == "expression":
        print(eval(compile(source, MAIN, "eval"), namespace))
        return
    import json  # only here: it costs a third of the start-up

    result_fd = os.dup(1)
    os.dup2(2, 1)  # the program's prints go to stderr, the result alone to stdout
    sys.stdout = sys.stderr
    args = [json.loads(line) for line in sys.stdin.read().split("\n") if line.strip()]
    namespace["__name__"] = "solution"
    exec(CALL_PRELUDE, namespace)
    _run(source, namespace)
    owner = namespace["Solution"]() if "Solution" in namespace else None
    fn = getattr(owner, fn_name) if owner is not None else namespace[fn_name]
    value = fn(*args)
    if isinstance(value, tuple):
        value = list(value)
    os.write(result_fd, (json.dumps(value) + "\n").encode())


if __name__ == "__main__":
    main()
