"""Starting and stopping `python -m sglang.launch_server` processes (a real server needs a GPU).

`launch_command` is a pure function from a `ServerLaunchConfig` to the argv list, so the command
line is testable without SGLang. `SGLangServerProcess` runs it with its output in a log file,
waits for GET /health with a deadline (failing early, with the log tail, if the process exits),
and stops the whole process group on `stop()`.
"""

from __future__ import annotations

import http.client
import logging
import os
import shlex
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from gspo_megatron.rollout.sglang.config import ServerLaunchConfig
from gspo_megatron.rollout.sglang.protocol import SGLangError

logger = logging.getLogger(__name__)


def launch_command(cfg: ServerLaunchConfig) -> list[str]:
    """The argv that starts `cfg` (pure; no SGLang import)."""
    cmd = [
        cfg.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        cfg.model_path,
        "--host",
        cfg.host,
        "--port",
        str(cfg.port),
        "--tp-size",
        str(cfg.tp_size),
        "--dp-size",
        str(cfg.dp_size),
        "--ep-size",
        str(cfg.ep_size),
    ]
    if cfg.mem_fraction_static is not None:
        cmd += ["--mem-fraction-static", repr(float(cfg.mem_fraction_static))]
    if cfg.base_gpu_id is not None:
        cmd += ["--base-gpu-id", str(cfg.base_gpu_id)]
    if cfg.enable_return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if cfg.enable_memory_saver:
        cmd.append("--enable-memory-saver")
    if cfg.deterministic:
        cmd.append("--enable-deterministic-inference")
    if cfg.api_key:
        cmd += ["--api-key", cfg.api_key]
    if cfg.weight_version is not None:
        cmd += ["--weight-version", cfg.weight_version]
    return cmd + list(cfg.extra_args)


def _redact(cmd: list[str]) -> str:
    shown = list(cmd)
    for i, arg in enumerate(shown[:-1]):
        if arg == "--api-key":
            shown[i + 1] = "REDACTED"
    return shlex.join(shown)


def http_health(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> bool:
    """GET {url}/health answers 200 (stdlib, usable before any event loop exists). Anything
    else is "not healthy", including an answer that is not HTTP (another program on the port,
    or a connection to the port from itself, which Linux allows while nothing listens)."""
    req = urllib.request.Request(url.rstrip("/") + "/health")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return False


def wait_until_healthy(
    url: str,
    *,
    timeout_s: float,
    api_key: str | None = None,
    poll_s: float = 2.0,
    alive: Callable[[], str | None] | None = None,
    what: str = "",
) -> None:
    """Poll GET /health until 200 or the deadline. `alive()` returns None while the server
    process runs, or a description of why it stopped (then we fail at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if http_health(url, api_key, timeout_s=min(5.0, max(poll_s, 0.5))):
            return
        if alive is not None and (why := alive()) is not None:
            raise SGLangError(f"SGLang server for {url} exited before becoming healthy: {why}", url)
        if time.monotonic() >= deadline:
            raise SGLangError(
                f"SGLang server at {url} did not answer GET /health with 200 within "
                f"{timeout_s:g} s{what}",
                url,
            )
        time.sleep(poll_s)


class SGLangServerProcess:
    """A launched server: `start()`, `wait_healthy()`, `stop()` (idempotent)."""

    def __init__(self, cfg: ServerLaunchConfig, log_path: str | Path) -> None:
        self.cfg = cfg
        self.command = launch_command(cfg)
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return self.cfg.url

    def start(self) -> None:
        if self._proc is not None:
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        logger.info("launching SGLang server: %s (log: %s)", _redact(self.command), self.log_path)
        try:
            self._proc = subprocess.Popen(
                self.command,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: stop() reaches its workers
            )
        except OSError as e:
            self._log.close()
            raise SGLangError(f"cannot start `{_redact(self.command)}`: {e}", self.url) from e

    def exit_reason(self) -> str | None:
        """None while the process runs (or before it started), else why it stopped."""
        if self._proc is None or self._proc.poll() is None:
            return None
        return f"exit code {self._proc.returncode}; {self.context()}"

    def context(self) -> str:
        """The command (API key redacted) and the last lines of its log."""
        tail = ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-20:]
            tail = "\n  ".join(lines)
        except OSError:
            pass
        return f"command: {_redact(self.command)}\n  log {self.log_path}, last lines:\n  {tail}"

    def wait_healthy(self, timeout_s: float, poll_s: float = 2.0) -> None:
        try:
            wait_until_healthy(
                self.url,
                timeout_s=timeout_s,
                api_key=self.cfg.api_key,
                poll_s=poll_s,
                alive=self.exit_reason,
                what=f"; {self.context()}",
            )
        except SGLangError:
            self.stop()
            raise

    def stop(self, grace_s: float = 15.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._log is not None:
            self._log.close()
            self._log = None
