"""The sandbox's throughput and overhead: short programs through the sandbox (warm slots, and
exec of a fresh interpreter per program) and through a bare subprocess, side by side in one run.

    python benchmarks/bench_sandbox.py                 # 2 workers, 3 rounds of 200 programs
    python benchmarks/bench_sandbox.py --workers 2 --programs 300 --rounds 5
    python benchmarks/bench_sandbox.py --attacks       # what stops each attack, and when

Each mode runs the same Python harness (gspo_megatron/sandbox/python_harness.py) on the same
files, `--workers` programs at a time:
- bare: `python -I -S -B harness.py` as a plain subprocess in a host directory: no
  namespaces, uid, seccomp or limits (what running model code without a sandbox costs);
- sandbox, prewarm: `Sandbox(SandboxConfig(prewarm=True))`, the default: each program in a
  fork of its slot's warm interpreter, in fresh pid/mount/IPC namespaces;
- sandbox, exec: `prewarm=False`: the same namespaces, then exec of `python -I -S -B`.
Two programs: `script` (reads a number, prints it plus one: the stdin/stdout style) and
`call` (a LiveCodeBench function-call problem, whose prelude imports a dozen modules).

Modes alternate within each round, so the machine's load (shared here) falls on all of them
alike; the table gives each mode's median over rounds of programs per second (wall clock) and
CPU milliseconds per program (this process plus every process it started: the slots' servers
count their runs' CPU as they reap them), and their ratios to bare.

--attacks: the adversarial suite's programs (tests/sandbox/test_adversarial.py) once each
under its limits (2 s wall, 256 MB, 16 processes, 64 KiB of output), with the status that
stopped each and the wall time from its start to its end (kill and clean-up included).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo_megatron.sandbox import Sandbox, SandboxConfig, SandboxLimits  # noqa: E402
from gspo_megatron.sandbox.languages import get_language  # noqa: E402

PROGRAMS = {
    "script": ("print(int(input()) + {i})\n", "41\n", {"mode": "script"}),
    "call": (
        "class Solution:\n    def add(self, xs: List[int]) -> int:\n        return sum(xs) + {i}\n",
        "[1, 2, 3]\n",
        {"mode": "call", "fn_name": "add"},
    ),
}
LIMITS = SandboxLimits(wall_s=10, memory_mb=512)


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def slot_cpu_s(sandbox: Sandbox) -> float:
    """CPU of the slots' processes and of the runs they reaped."""
    total = 0.0
    for slot in sandbox._slots:
        if slot.proc is None:
            continue
        launcher = psutil.Process(slot.proc.pid)
        for proc in [launcher, *launcher.children(recursive=False)]:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


async def bare(workers: int, program: str, stdin: str, spec: dict, n: int) -> int:
    """n runs of the harness as plain subprocesses, `workers` at a time; how many printed the
    right answer."""
    files = get_language("python").files
    sem = asyncio.Semaphore(workers)

    async def one(i: int) -> bool:
        async with sem:
            with tempfile.TemporaryDirectory() as d:
                for name, text in {**files(program.format(i=i), spec), "input": stdin}.items():
                    Path(d, name).write_text(text)
                with open(f"{d}/input") as input_file:
                    proc = await asyncio.create_subprocess_exec(
                        sys.executable, "-I", "-S", "-B", f"{d}/harness.py",
                        stdin=input_file, stdout=asyncio.subprocess.PIPE,
                        stderr=asyncio.subprocess.PIPE, env={"LANG": "C.UTF-8"}, cwd=d,
                    )  # fmt: skip
                    out, _ = await proc.communicate()
                return proc.returncode == 0 and out.strip() != b""

    return sum(await asyncio.gather(*(one(i) for i in range(n))))


async def sandboxed(sandbox: Sandbox, program: str, stdin: str, spec: dict, n: int) -> int:
    runs = [sandbox.run(program.format(i=i), stdin, spec=spec, limits=LIMITS) for i in range(n)]
    return sum(r.ok and r.stdout.strip() != "" for r in await asyncio.gather(*runs))


def measure(run, cpu_of) -> tuple[float, float]:
    """(programs per second, CPU ms per program) of one batch."""
    cpu0, wall0 = time.process_time() + cpu_of(), time.perf_counter()
    n, ok = run()
    wall = time.perf_counter() - wall0
    cpu = time.process_time() + cpu_of() - cpu0
    if ok != n:
        raise SystemExit(f"only {ok} of {n} programs ran right")
    return n / wall, 1000 * cpu / n


ATTACKS = {
    "infinite loop": "while True:\n    pass\n",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
    "        pass\n",
    "memory bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n",
    "1 GB of output": "import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)\n",
    "writing outside its directory": "open('/usr/x', 'w')\n",
    "reading the trainer's environment": "import os\nprint(os.environ.get('HOME'))\n",
    "socket to localhost": "import socket\nsocket.create_connection(('127.0.0.1', 22), 1)\n",
    "killing its parent": "import os\nos.kill(os.getppid(), 9)\n",
    "background child": "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
    "    time.sleep(600)\n",
    "ctypes escape (unshare)": "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0\n",
    "sleeper": "import time\ntime.sleep(600)\n",
}


def attacks(workers: int) -> None:
    limits = SandboxLimits(wall_s=2.0, memory_mb=256, processes=16, output_bytes=1 << 16)
    sandbox = Sandbox(SandboxConfig(workers=workers, limits=limits))
    print("| case | status | wall s |\n|---|---|---|")
    for name, program in ATTACKS.items():
        result = sandbox.run_blocking(program, "")
        print(f"| {name} | {result.status} | {result.wall_s:.2f} |")
    sandbox.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--programs", type=int, default=200, help="per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--attacks", action="store_true")
    args = parser.parse_args()
    if args.attacks:
        attacks(args.workers)
        return
    n = args.programs
    sandboxes = {
        "sandbox, prewarm": Sandbox(SandboxConfig(workers=args.workers, prewarm=True)),
        "sandbox, exec": Sandbox(SandboxConfig(workers=args.workers, prewarm=False)),
    }
    print(f"{args.workers} workers, {n} programs per mode and round, {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for kind, (program, stdin, spec) in PROGRAMS.items():
            for name, sandbox in [("bare", None), *sandboxes.items()]:
                if sandbox is None:
                    run = lambda: (n, asyncio.run(bare(args.workers, program, stdin, spec, n)))  # noqa: E731,B023
                    cpu_of = children_cpu_s
                else:
                    run = lambda: (n, asyncio.run(sandboxed(sandbox, program, stdin, spec, n)))  # noqa: E731,B023
                    cpu_of = lambda: slot_cpu_s(sandbox)  # noqa: E731,B023
                results.setdefault((kind, name), []).append(measure(run, cpu_of))
    print("\n| program | mode | programs/s | CPU ms/program | throughput / bare | CPU / bare |")
    print("|---|---|---|---|---|---|")
    for kind in PROGRAMS:
        base_rate = statistics.median(r for r, _ in results[(kind, "bare")])
        base_cpu = statistics.median(c for _, c in results[(kind, "bare")])
        for name in ["bare", *sandboxes]:
            rate = statistics.median(r for r, _ in results[(kind, name)])
            cpu = statistics.median(c for _, c in results[(kind, name)])
            print(f"| {kind} | {name} | {rate:.0f} | {cpu:.1f} | {rate / base_rate:.2f} | "
                  f"{cpu / base_cpu:.2f} |")  # fmt: skip
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    for sandbox in sandboxes.values():
        sandbox.close()


if __name__ == "__main__":
    main()
