"""Long-lived sandbox slots: what one program leaves (files, processes, IPC objects, sockets,
interpreter state) never reaches the next program of the same slot; a program cannot take its
slot down, and a slot lost by other means is rebuilt with the run scored 0 (slot_lost);
cancelling a run kills it at once."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from sandbox_host import requires_sandbox

from gspo_megatron.rewards.code import CodeReward
from gspo_megatron.sandbox import Sandbox, SandboxConfig, SandboxLimits

pytestmark = requires_sandbox

LABEL = {"tests": [{"input": "1000003 998244353\n", "output": "999244356\n"}]}
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"

LEAVER = """\
import builtins, ctypes, json, os, random, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
made = {}
open('/sandbox/left', 'w').write('x')
open('/tmp/left-too', 'w').write('y')
made['shm'] = libc.shmget(0x5EED, 4096, 0o1666)
made['msg'] = libc.msgget(0x5EED, 0o1666)
made['sem'] = libc.semget(0x5EED, 1, 0o1666)
made['mq'] = libc.mq_open(b'/gspo-leak', os.O_CREAT | os.O_RDWR, 0o666, None)
listener = socket.socket(socket.AF_UNIX)
listener.bind('\\0gspo-leak')
listener.listen()
if os.fork() == 0:  # a daemon holding the socket, detached from the program
    os.setsid()
    null = os.open('/dev/null', os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    time.sleep(60)
    os._exit(0)
os.environ['LEAK'] = '1'
os.umask(0)
sys.setrecursionlimit(77)
random.seed(1)
json.dumps = None
sys.modules['json'] = None
builtins.print = lambda *a, **k: None
builtins.len = lambda x: 0
os.write(1, repr(made).encode())
"""

CHECKER = """\
import ctypes, json, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
seen = {}
seen['sandbox'] = sorted(os.listdir('/sandbox'))
seen['processes'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
seen['shm'] = libc.shmget(0x5EED, 0, 0)
seen['msg'] = libc.msgget(0x5EED, 0)
seen['sem'] = libc.semget(0x5EED, 0, 0)
seen['mq'] = libc.mq_open(b'/gspo-leak', os.O_RDWR)
try:
    socket.socket(socket.AF_UNIX).connect('\\0gspo-leak')
    seen['socket'] = 'connected'
except OSError as exc:
    seen['socket'] = type(exc).__name__
seen['environ'] = sorted(os.environ)
seen['umask'] = os.umask(0o22)
seen['recursion'] = sys.getrecursionlimit()
seen['json'] = json.dumps([1])
seen['builtins'] = (type(print).__name__, len('abc'))
print(seen)
"""


@pytest.fixture(scope="module", params=[True, False], ids=["prewarm", "exec"])
def one_slot(request):
    sandbox = Sandbox(SandboxConfig(workers=1, prewarm=request.param,
                                    limits=SandboxLimits(wall_s=20, memory_mb=256)))  # fmt: skip
    yield sandbox
    sandbox.close()


def test_nothing_a_program_leaves_reaches_the_next(one_slot):
    left = one_slot.run_blocking(LEAVER)
    assert left.status == "ok", left
    made = eval(left.stdout)
    assert made["shm"] >= 0 and made["msg"] >= 0 and made["sem"] >= 0  # they existed
    assert made["mq"] == -1  # RLIMIT_MSGQUEUE 0: no POSIX message queue at all
    assert left.left_processes == 1  # the daemon, killed with the run's namespace
    seen = eval(one_slot.run_blocking(CHECKER).stdout)
    assert seen == {
        "sandbox": [],
        "processes": [1, 2],  # the run's init and the program itself
        "shm": -1,
        "msg": -1,
        "sem": -1,
        "mq": -1,
        "socket": "ConnectionRefusedError",
        "environ": ["HOME", "LANG", "PATH", "TMPDIR"],
        "umask": 0o22,
        "recursion": 1000,
        "json": "[1]",
        "builtins": ("builtin_function_or_method", 3),
    }
    assert one_slot._slots[0].starts == 1  # the same slot served both


def _uid_processes(uid: int) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                if next(line for line in f if line.startswith("Uid:")).split()[1] == str(uid):
                    pids.append(int(pid))
        except (OSError, StopIteration):
            continue
    return pids


def _wait_for_a_run(uid: int) -> None:
    deadline = time.monotonic() + 30
    while not _uid_processes(uid):
        assert time.monotonic() < deadline, "the program never started"
        time.sleep(0.01)


def test_a_program_cannot_take_its_slot_down_and_a_lost_slot_is_rebuilt():
    reward = CodeReward(scoring="all", test_timeout_s=20, memory_mb=256, workers=1,
                        cache_size=0)  # fmt: skip
    slot = reward.sandbox._slots[0]
    first = slot.proc.pid
    attacks = [
        "import os, signal\nfor pid in (1, 0, -1, os.getppid()):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n",
        "import os\nos.closerange(0, 1024)\n",
        "import sys\nsys.stdout.write('\\xff' * 100)\nsys.stdout.buffer.write(b'\\0\\0\\0\\5{}')\n",
    ]
    for program in attacks:
        out = asyncio.run(reward.evaluate("", f"```python\n{program}```", LABEL))
        assert out.reward == 0.0
    assert (slot.proc.pid, slot.starts) == (first, 1)

    async def slot_killed_under_a_run():
        sleeper = "```python\nimport time\ntime.sleep(15)\n```"
        task = asyncio.ensure_future(reward.evaluate("", sleeper, LABEL))
        await asyncio.to_thread(_wait_for_a_run, slot.uid)
        os.killpg(first, signal.SIGKILL)  # the slot dies by something else than its program
        return await task

    out = asyncio.run(slot_killed_under_a_run())
    assert (out.reward, out.reason) == (0.0, "slot_lost")
    assert asyncio.run(reward.evaluate("", RIGHT, LABEL)).reason == "passed"
    assert slot.starts == 2 and slot.proc.pid != first
    assert reward.pop_metrics()["code/slot_lost"] == 1.0
    asyncio.run(reward.aclose())
    assert _uid_processes(slot.uid) == []


def test_cancelling_a_run_kills_it_and_frees_its_slot(one_slot):
    uid = one_slot._slots[0].uid

    async def cancel_then_run():
        task = asyncio.ensure_future(
            one_slot.run("import time\ntime.sleep(600)", limits=SandboxLimits(wall_s=600))
        )
        await asyncio.to_thread(_wait_for_a_run, uid)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await one_slot.run("print(2)")

    start = time.monotonic()
    assert asyncio.run(cancel_then_run()).stdout == "2\n"
    assert time.monotonic() - start < 60  # a hang detector, not a timing claim
    assert _uid_processes(uid) == []
