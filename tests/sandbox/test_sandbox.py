"""The sandbox executor: layers, limits, languages, what a program sees."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_host import requires_sandbox

from gspo_megatron.sandbox import (
    LANGUAGES,
    Language,
    Sandbox,
    SandboxConfig,
    SandboxLimits,
    SandboxUnavailable,
    executor,
)

pytestmark = requires_sandbox


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(SandboxConfig(workers=2, limits=SandboxLimits(wall_s=10, memory_mb=256)))


def run(sandbox: Sandbox, program: str, stdin: str = "", **kw):
    return asyncio.run(sandbox.run(program, stdin, **kw))


def test_layers_are_detected_and_reported(sandbox):
    assert set(sandbox.layers) == {"rlimits", "namespaces", "unprivileged", "seccomp"}
    result = run(sandbox, "print(input()[::-1])", "abc\n")
    assert result.status == "ok" and result.stdout == "cba\n"
    assert result.layers == sandbox.layers


def test_what_a_program_sees(sandbox):
    program = (
        "import os\n"
        "print(sorted(os.environ))\n"
        "print(os.getuid() >= 2_000_000_000, os.getpid())\n"
        "print(sorted(os.listdir('/')))\n"
        "print(sorted(os.listdir('/code')))\n"
        "print(sorted(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
        "print(open('/proc/self/status').read().count('0000000000000000'))\n"
    )
    lines = run(sandbox, program).stdout.splitlines()
    assert lines[0] == "['HOME', 'LANG', 'PATH', 'TMPDIR']"  # no secret of the trainer's
    assert lines[1] == "True 2"  # an unprivileged uid, PID 2 of its own namespace
    assert eval(lines[2]) == ["bin", "code", "dev", "lib", "lib64", "proc", "root", "sandbox",
                              "sbin", "tmp", "usr"]  # fmt: skip
    assert eval(lines[3]) == ["harness.py", "input", "main.py", "spec"]
    assert eval(lines[4]) == [0, 1, 2, 3]  # stdin, stdout, stderr and listdir's own
    assert int(lines[5]) >= 5  # CapInh, CapPrm, CapEff, CapBnd, CapAmb all empty


def test_the_sandbox_directory_is_the_only_writable_place(sandbox):
    program = (
        "import os\n"
        "open('/sandbox/a', 'w').write('x'); open('/tmp/b', 'w').write('y')\n"
        "print(sorted(os.listdir('/sandbox')))\n"
        "for path in ('/usr/x', '/code/main.py', '/x', '/proc/x', '/dev/x'):\n"
        "    try:\n"
        "        open(path, 'w'); print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print(type(exc).__name__)\n"
    )
    out = run(sandbox, program).stdout
    assert "['a', 'b']" in out and "wrote" not in out


def test_limits_each_name_their_status(sandbox):
    tight = SandboxLimits(wall_s=1.0, memory_mb=128, output_bytes=1000, disk_mb=1)
    cases = {
        "import time\ntime.sleep(30)": "timeout",
        "x = bytearray(1 << 30)": "memory",
        "print('x' * 5000)": "output_limit",
        "raise SystemExit(3)": "runtime_error",
        "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)": "signal",
    }
    for program, status in cases.items():
        result = run(sandbox, program, limits=tight)
        assert result.status == status, (program, result)
    cpu = run(sandbox, "while True: pass", limits=SandboxLimits(wall_s=20, cpu_s=1))
    assert cpu.status == "cpu_time"
    big = run(sandbox, "open('/sandbox/f', 'wb').write(b'0' * (4 << 20))", limits=tight)
    assert big.status in ("runtime_error", "signal")  # EFBIG / SIGXFSZ past disk_mb


def test_function_call_and_expression_modes(sandbox):
    call = run(
        sandbox,
        "class Solution:\n    def add(self, a: List[int], b: int):\n        print('noise')\n"
        "        return tuple(x + b for x in a)\n",
        "[1, 2]\n3\n",
        spec={"mode": "call", "fn_name": "add"},
    )
    assert call.status == "ok" and call.stdout == "[4, 5]\n"  # prints go to stderr
    expr = run(sandbox, "35+807", spec={"mode": "expression"})
    assert expr.stdout == "842\n"
    exits = run(sandbox, "print(1)\nexit(0)\nprint(2)")  # exit() exists as without -S
    assert exits.status == "ok" and exits.stdout == "1\n"


def test_another_language(sandbox):
    result = run(sandbox, 'read x; echo "got $x"', "5\n", language="sh")
    assert result.stdout == "got 5\n"
    shout = Language(
        "shout", lambda program, spec: {"main.sh": program}, ("/bin/sh", "/code/main.sh")
    )
    assert run(sandbox, "echo hi", language=shout).stdout == "hi\n"
    with pytest.raises(ValueError, match="unknown sandbox language"):
        run(sandbox, "x", language="cobol")
    with pytest.raises(ValueError, match="cannot run mode"):
        run(sandbox, "x", language="sh", spec={"mode": "call", "fn_name": "f"})
    assert "python" in LANGUAGES


def test_without_namespaces_the_weaker_mode_still_runs_and_says_so(tmp_path):
    plain = Sandbox(SandboxConfig(workers=1, namespaces=False, python="/usr/bin/python3"))
    assert "namespaces" not in plain.layers and "seccomp" in plain.layers
    result = run(plain, "import socket\nsocket.socket()")
    assert result.status == "runtime_error" and "PermissionError" in result.stderr
    detach = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    null = os.open('/dev/null', os.O_WRONLY)\n    os.dup2(null, 1); os.dup2(null, 2)\n    time.sleep(60)\n"  # noqa: E501
    left = run(plain, detach)
    assert left.left_processes == 1  # killed by the executor's sweep of the slot's uid
    uid = plain.first_uid
    owners = [p for p in os.listdir("/proc") if p.isdigit() and _live_uid(p) == uid]
    assert owners == []


def _live_uid(pid: str) -> int | None:
    """The uid of a running process (None for a zombie: the host's PID 1 reaps those)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    if fields["State"].strip().startswith("Z"):
        return None
    return int(fields["Uid"].split()[0])


def test_a_missing_libseccomp_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(executor, "SECCOMP_LIBRARY", "libseccomp-missing.so.2")
    with pytest.raises(SandboxUnavailable) as err:
        Sandbox(SandboxConfig(workers=1))
    assert "libseccomp-missing.so.2 is not installed" in str(err.value)
    assert "install libseccomp2 (Debian/Ubuntu: apt-get install libseccomp2)" in str(err.value)
    without = Sandbox(SandboxConfig(workers=1, seccomp=False))  # the other fix it names
    assert without.layers == ["rlimits", "namespaces", "unprivileged"]
    without.close()


def test_unavailable_layers_are_refused_with_the_fix():
    with pytest.raises(SandboxUnavailable, match="python=/usr/bin/python3|readable"):
        Sandbox(SandboxConfig(workers=1, namespaces=False))  # the venv's python is under /root
    with pytest.raises(ValueError, match="workers must be in 1..64"):
        Sandbox(SandboxConfig(workers=0))
    with pytest.raises(ValueError, match="workers must be in 1..64"):
        Sandbox(SandboxConfig(workers=65))


def test_the_sandbox_and_the_code_reward_import_no_megatron_nor_torch():
    """Their layer (docs/ARCHITECTURE.md): a sandbox service or a reward worker stays light."""
    code = (
        "import sys, gspo_megatron.sandbox, gspo_megatron.rewards.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('megatron', 'torch', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


UNPRIVILEGED = """\
import os, sys
sys.path.insert(0, sys.argv[1])
from gspo_megatron.sandbox import Sandbox, SandboxConfig, SandboxLimits
sandbox = Sandbox(SandboxConfig(workers=1, python=sys.executable))
seen = sandbox.run_blocking("import os\\nprint(os.getuid(), os.getpid(), sorted(os.listdir('/')))")
net = sandbox.run_blocking("import socket\\nsocket.socket()")
loop = sandbox.run_blocking(
    "while True: pass", limits=SandboxLimits(wall_s=1, cpu_s=5)
)  # the CPU limit far away: the wall clock ends it
print(repr([os.getuid(), sandbox.layers, seen.stdout, net.status, loop.status]))
sandbox.close()
"""


def test_without_root_a_user_namespace_stands_in():
    """The sandbox started by an unprivileged user (uid 65534): the slot's user namespace
    maps it to uid 0 inside, which gives up its capabilities before the program runs."""
    python = "/usr/bin/python3"
    repo = Path(__file__).resolve().parents[2]
    if shutil.which("setpriv") is None or not os.access(python, os.X_OK):
        pytest.skip("needs setpriv (util-linux) and /usr/bin/python3")
    if not all(d.stat().st_mode & 0o005 == 0o005 for d in [repo, *repo.parents]):
        pytest.skip(f"uid 65534 cannot read the checkout at {repo}")
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I", "-c",
           UNPRIVILEGED, str(repo)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    uid, layers, seen, net, loop = eval(out.stdout)
    assert uid == 65534 and layers == ["rlimits", "namespaces", "unprivileged", "seccomp"]
    assert (
        seen
        == "0 2 ['bin', 'code', 'dev', 'lib', 'lib64', 'proc', 'sandbox', 'sbin', 'tmp', 'usr']\n"
    )  # noqa: E501
    assert (net, loop) == ("runtime_error", "timeout")
