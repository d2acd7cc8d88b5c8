"""The adversarial suite: programs that attack the grader, each scored 0 with a named reason
while scoring goes on, and afterwards: no process left, nothing written outside the sandbox,
the trainer's state unchanged. Network tests send traffic to loopback only."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from sandbox_host import requires_sandbox

from gspo_megatron.rewards.code import CodeReward
from gspo_megatron.rewards.scorer import RewardScorer
from gspo_megatron.sandbox import SandboxLimits

pytestmark = requires_sandbox

SECRET = "gspo-test-secret-7f3a"
PROCESSES = 16
# A stdin problem whose expected output (two large primes' sum) never enters the sandbox.
LABEL = {"tests": [{"input": "1000003 998244353\n", "output": "999244356\n"}]}
RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"


def fenced(program: str) -> str:
    return f"```python\n{program}```"


class LoopbackServer:
    """A TCP server on 127.0.0.1 counting connections (the localhost service a program tries
    to reach)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The trainer's side: a file of its own, a secret in its environment, a unix socket, a
    victim process, a localhost service; what the suite must leave unchanged."""
    home = tmp_path_factory.mktemp("trainer")
    state = home / "state.json"
    state.write_text('{"step": 7}')
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(home / "trainer.sock"))
    unix.listen()
    os.environ["GSPO_TEST_SECRET"] = SECRET
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    server = LoopbackServer()
    before = {
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "state": (state.read_bytes(), state.stat().st_mtime_ns),
        "home": sorted(p.name for p in home.iterdir()),
        "tmp": set(os.listdir("/tmp")),
    }
    reward = CodeReward(scoring="all", test_timeout_s=2.0, memory_mb=256, processes=PROCESSES,
                        max_output_bytes=1 << 16, workers=2, cache_size=0)  # fmt: skip
    yield {"home": home, "server": server, "victim": victim, "reward": reward, "before": before}
    server.close()
    unix.close()
    victim.kill()
    os.environ.pop("GSPO_TEST_SECRET")


def outcome(world, program: str, label=LABEL):
    return asyncio.run(world["reward"].evaluate("", fenced(program), label))


def sandbox_run(world, program: str, **limits):
    limits = SandboxLimits(**{"wall_s": 5.0, "memory_mb": 256, "processes": PROCESSES, **limits})
    return asyncio.run(world["reward"].sandbox.run(program, limits=limits))


def test_a_right_program_passes(world):
    assert outcome(world, RIGHT).reason == "passed"


def test_infinite_loop(world):
    out = outcome(world, "while True:\n    pass\n")
    assert (out.reward, out.reason) == (0.0, "timeout")


def test_the_process_limit_holds_before_a_fork_bomb(world):
    harmless = (
        "import os, time\nmade = 0\n"
        "for _ in range(40):\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(3); os._exit(0)\n"
        "    made += 1\nprint(made)\n"
    )
    made = int(sandbox_run(world, harmless).stdout)
    assert 0 < made < PROCESSES  # the limit, not 40
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    out = outcome(world, bomb)
    assert (out.reward, out.reason) == (0.0, "timeout")


def test_memory_bomb(world):
    out = outcome(world, "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))\n")
    assert (out.reward, out.reason) == (0.0, "memory")


def test_a_gigabyte_of_output(world):
    program = "import sys\nfor _ in range(16384):\n    sys.stdout.write('x' * 65536)\n"
    out = outcome(world, program)
    assert (out.reward, out.reason) == (0.0, "output_limit")


def test_writing_outside_its_directory(world):
    targets = [str(world["home"] / "state.json"), str(world["home"] / "new"), "/tmp/gspo-escape",
               "/root/gspo-escape", "/usr/gspo-escape", "/code/main.py", "/proc/sys/kernel/hostname"]  # fmt: skip  # noqa: E501
    program = (
        f"import os\nwrote = []\nfor path in {targets!r}:\n"
        "    try:\n        with open(path, 'w') as f:\n            f.write('pwned')\n"
        "        wrote.append(path)\n    except OSError:\n        pass\nprint(wrote)\n"
    )
    # its /tmp is its own /sandbox: the write lands there and vanishes with the run
    assert sandbox_run(world, program).stdout == "['/tmp/gspo-escape']\n"
    out = outcome(world, program)
    assert (out.reward, out.reason) == (0.0, "wrong_answer")
    assert not os.path.exists("/tmp/gspo-escape") and not os.path.exists("/root/gspo-escape")


def test_reading_the_trainers_files_keys_and_environment(world):
    paths = [str(world["home"] / "state.json"), "/root/.ssh/id_rsa", "/etc/ssh/ssh_host_rsa_key",
             "/etc/passwd", "/etc/shadow", f"/proc/{os.getpid()}/environ", "/proc/1/environ",
             "/work", "/root", sys.executable]  # fmt: skip
    program = (
        f"import os\nfound = dict(os.environ)\nfor path in {paths!r}:\n"
        "    try:\n        found[path] = open(path, 'rb').read(200)\n"
        "    except OSError as exc:\n        found[path] = type(exc).__name__\n"
        "print(found)\n"
    )
    seen = sandbox_run(world, program).stdout
    assert SECRET not in seen and '"step"' not in seen
    found = eval(seen)
    assert [k for k in found if not k.startswith("/")] == ["PATH", "HOME", "TMPDIR", "LANG"]
    hidden = [p for p in paths if found[p] == "FileNotFoundError"]
    assert (
        hidden == paths[:6] + paths[7:8] + paths[9:]
    )  # all but /proc/1 (init: not readable) and /root
    assert found["/proc/1/environ"] == "PermissionError"  # the sandbox's own init, not ours
    assert found["/root"] == "IsADirectoryError"  # only the interpreter's prefix is under it
    assert outcome(world, program).reward == 0.0


def test_network_localhost_interfaces_and_routes(world):
    port = world["server"].port
    program = (
        (
            "import os, socket\nresult = {}\n"
            "for family, address in ((socket.AF_INET, ('127.0.0.1', %d)), "
            "(socket.AF_INET6, ('::1', %d))):\n"
            "    try:\n        s = socket.socket(family)\n        s.settimeout(1)\n"
            "        s.connect(address)\n        result[str(address)] = 'connected'\n"
            "    except OSError as exc:\n        result[str(address)] = type(exc).__name__\n"
            "try:\n    u = socket.socket(socket.AF_UNIX)\n    u.connect(%r)\n    result['unix'] = 'connected'\n"  # noqa: E501
            "except OSError as exc:\n    result['unix'] = type(exc).__name__\n"
            "try:\n    result['netlink'] = socket.if_nameindex()\n"
            "except OSError as exc:\n    result['netlink'] = type(exc).__name__\n"
            "result['interfaces'] = [l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]]\n"  # noqa: E501
            "result['routes'] = open('/proc/net/route').read().splitlines()[1:]\n"
            "result['net'] = os.listdir('/sys/class/net') if os.path.exists('/sys') else []\n"
            "print(result)\n"
        )
        .replace("%d", str(port))
        .replace("%r", repr(str(world["home"] / "trainer.sock")))
    )
    seen = eval(sandbox_run(world, program).stdout)
    assert "connected" not in seen.values()
    assert seen["interfaces"] == ["lo"]  # nothing leads off the machine
    assert seen["netlink"] == "PermissionError"  # seccomp: no socket but AF_UNIX
    assert seen["routes"] == [] and seen["net"] == []
    assert outcome(world, program).reward == 0.0
    assert world["server"].connections == 0


def test_killing_its_parent_and_other_processes(world):
    victim = world["victim"].pid
    program = (
        "import os, signal\n"
        f"for pid in (os.getppid(), 1, {victim}, {os.getpid()}, -1):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass\n"
    )
    out = outcome(world, program)
    assert out.reward == 0.0 and out.reason in ("wrong_answer", "signal")
    assert world["victim"].poll() is None  # still running
    assert outcome(world, RIGHT).reason == "passed"  # and the grader still works


def test_a_background_child_is_killed_with_the_run(world):
    marker = world["home"] / "daemon-was-here"
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(1.5)\n"
        f"        open({str(marker)!r}, 'w').write('x')\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n"
    )
    result = sandbox_run(world, program)
    assert result.status == "ok" and result.left_processes == 1
    out = outcome(world, program)
    assert (out.reward, out.reason) == (0.0, "wrong_answer")
    time.sleep(2)
    assert not marker.exists()


def test_changing_the_harness_or_finding_the_expected_output(world):
    program = (
        "import os, builtins\nhits = []\n"
        "for path in ('/code/harness.py', '/code/input', '/code/spec'):\n"
        "    try:\n        open(path, 'a').write('x')\n        hits.append(path)\n"
        "    except OSError:\n        pass\n"
        "for top in ('/code', '/sandbox', '/proc/self', '/usr/lib'):\n"
        "    for root, dirs, files in os.walk(top):\n"
        "        for name in files:\n"
        "            try:\n                if str(999244355 + 1).encode() in open(os.path.join(root, name), 'rb').read(1 << 20):\n"  # noqa: E501
        "                    hits.append(os.path.join(root, name))\n"
        "            except OSError:\n                pass\n"
        "builtins.print = lambda *a, **k: None\n"
        "os.write(1, repr(hits).encode())\n"
    )
    assert sandbox_run(world, program, wall_s=20).stdout == "[]"
    assert outcome(world, program).reward == 0.0


def test_ctypes_escape(world):
    program = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nok = []\n"
        "calls = {\n"
        "    'unshare_user': lambda: libc.unshare(0x10000000),\n"
        "    'mount': lambda: libc.mount(b'none', b'/sandbox', b'tmpfs', 0, None),\n"
        "    'ptrace_init': lambda: libc.ptrace(16, 1, None, None),\n"
        "    'setuid_root': lambda: libc.setuid(0),\n"
        "    'chroot': lambda: libc.chroot(b'/sandbox'),\n"
        "    'bpf': lambda: libc.syscall(321, 0, None, 0),\n"
        "    'keyctl': lambda: libc.syscall(250, 0, 0, 0),\n"
        "    'clone_newuser': lambda: libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0),\n"
        "}\n"
        "for name, call in calls.items():\n"
        "    if call() == 0:\n        ok.append(name)\n"
        "print(ok)\n"
    )
    assert sandbox_run(world, program).stdout == "[]\n"
    assert outcome(world, program).reward == 0.0


def test_a_sleeper_holding_the_pool_does_not_stall_the_others(world):
    async def both():
        reward = world["reward"]
        sleepers = [reward.evaluate("", fenced("import time\ntime.sleep(600)\n"), LABEL)
                    for _ in range(reward.sandbox.workers)]  # fmt: skip
        return await asyncio.gather(*sleepers, reward.evaluate("", fenced(RIGHT), LABEL))

    start = time.monotonic()
    *slept, right = asyncio.run(both())
    assert [o.reason for o in slept] == ["timeout"] * len(slept) and right.reason == "passed"
    assert time.monotonic() - start < 60  # a hang detector, not a timing claim


def test_the_whole_suite_in_one_batch_while_scoring_goes_on(world):
    """Every attack at once through the scorer (as a training step scores them), then a
    normal batch: rewards, named reasons, no failed reward call."""
    attacks = {
        "while True: pass\n": "timeout",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n": "timeout",  # noqa: E501
        "x = [bytearray(1 << 24) for _ in range(100)]\n": "memory",
        "import sys\nwhile True: sys.stdout.write('y' * 65536)\n": "output_limit",
        "import os\nos.kill(os.getppid(), 9)\n": "wrong_answer",
        "import ctypes\nctypes.CDLL(None).unshare(0x10000000)\n": "wrong_answer",
        "open('/usr/x', 'w')\n": "runtime_error",
    }  # fmt: skip
    responses = [fenced(p) for p in attacks] + [fenced(RIGHT)]
    world["reward"].pop_metrics()  # the counts of the tests before
    with RewardScorer(world["reward"], timeout_s=60, max_concurrency=8) as scorer:
        batch = scorer.score([""] * len(responses), responses, [LABEL] * len(responses))
        assert batch.rewards == [0.0] * len(attacks) + [1.0]
        assert batch.num_failures == batch.num_timeouts == 0
        expected: dict[str, float] = {}
        for reason in [*attacks.values(), "passed"]:
            expected[f"code/{reason}"] = expected.get(f"code/{reason}", 0.0) + 1
        assert batch.details == expected
        again = scorer.score([""], [fenced(RIGHT)], [LABEL])
        assert again.rewards == [1.0]


def test_after_the_suite_nothing_escaped(world):
    """Runs last in this module: no process of the sandbox uids, no new file in /tmp from a
    program, the trainer's cwd, environment and files unchanged."""
    first = world["reward"].sandbox.first_uid
    owners = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if first <= uid < first + 64:
            owners.append(pid)
    assert owners == []
    before = world["before"]
    state = world["home"] / "state.json"
    assert os.getcwd() == before["cwd"]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    assert env == {k: v for k, v in before["env"].items() if k != "PYTEST_CURRENT_TEST"}
    assert (state.read_bytes(), state.stat().st_mtime_ns) == before["state"]
    assert sorted(p.name for p in world["home"].iterdir()) == before["home"]
    new_in_tmp = set(os.listdir("/tmp")) - before["tmp"]
    assert not [n for n in new_in_tmp if "gspo-escape" in n or n.startswith("gspo-sandbox-")]
    assert world["victim"].poll() is None
    assert Path(sys.executable).exists()
