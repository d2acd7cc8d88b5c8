"""What each SGLang server holds in GPU memory (weights, KV cache, CUDA graphs): known, never
guessed (docs/SGLANG.md, "Server memory").

SGLang 0.5.23 has no query for it, and its memory calls kill a server used the wrong way: a
/resume_memory_occupation of a tag that is not released raises KeyError in the scheduler's event
loop, a second /release_memory_occupation of a tag makes torch_memory_saver exit the process, and
anything that runs the model over released memory (a generation, a weight update, the one-token
generation behind GET /health) reads unmapped GPU memory. So:

- memory changes only through `MemoryTracker.release` / `resume`, for tags whose state is known,
  each call right after GET /server_info has shown which server process answers: the one the
  state is about, or a new one (restarted), which holds everything again;
- before each call the tracker records what it is about to do, and after the answer what the
  server holds, in the run directory (`MemoryRecord`): a resumed or requeued run finds the tags
  a previous one left released, keyed by URL and server process;
- a call whose outcome is unknown (it never answered) leaves the server's state unknown: it
  gets no memory call, no generation, no weight update and no generating health check until a
  new process answers at its URL (the engine restarts launched servers at once);
- `probe` checks a server whose memory is not all resident with GET /server_info, which runs
  nothing on the GPU, and never with GET /health.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo_megatron import files
from gspo_megatron.rollout.sglang.client import NO_RETRY, SGLangClient
from gspo_megatron.rollout.sglang.protocol import (
    SGLangConnectionError,
    SGLangError,
    SGLangHTTPError,
)

logger = logging.getLogger(__name__)

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
RECORD_FILE = "sglang_memory.json"
_RELEASE = "/release_memory_occupation"
_RESUME = "/resume_memory_occupation"


def _ordered(tags: Iterable[str]) -> list[str]:
    tags = set(tags)
    return [t for t in MEMORY_TAGS if t in tags]


def identity_of(info: Any) -> str | None:
    """The server process a /server_info answer comes from: its `startup_time` (SGLang 0.5.23:
    the durations of that process's start-up phases, measured with time.perf_counter, so a new
    process reports new values). None when the answer has none."""
    startup = info.get("startup_time") if isinstance(info, dict) else None
    return json.dumps(startup, sort_keys=True) if startup else None


@dataclass
class ServerMemory:
    """One server process's memory as far as the engine knows it."""

    identity: str | None = None  # the process (identity_of); None until read
    released: set[str] = field(default_factory=set)
    in_doubt: set[str] = field(default_factory=set)  # a call on these never answered
    doubt: str = ""  # why

    @property
    def known(self) -> bool:
        return not self.in_doubt

    @property
    def resident(self) -> bool:
        """Known, and nothing released: the model may run."""
        return self.known and not self.released

    def to_json(self) -> dict:
        return {
            "identity": self.identity,
            "released": _ordered(self.released),
            "in_doubt": _ordered(self.in_doubt),
            "doubt": self.doubt,
        }


class MemoryRecordError(SGLangError):
    """The run directory's memory record cannot be read."""


class MemoryRecord:
    """`<run directory>/sglang_memory.json`: per server URL, the process (`identity`), the tags
    released, and the tags a call never answered on. Written by the leader alone (rank 0), each
    write a new file renamed into place, so a kill leaves the previous record or the new one."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def read(self) -> dict[str, ServerMemory]:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise MemoryRecordError(f"cannot read the SGLang memory record {self.path}: {e}") from e
        try:
            servers = json.loads(raw)["servers"]
            if not isinstance(servers, dict):
                raise TypeError("`servers` is not an object")
            return {url: self._entry(entry) for url, entry in servers.items()}
        except (ValueError, KeyError, TypeError) as e:
            raise MemoryRecordError(
                f"{self.path} is not an SGLang memory record written by gspo-megatron ({e}); "
                "it says which GPU memory this run left released on its servers: restart the "
                "servers it names and remove it"
            ) from e

    @staticmethod
    def _entry(entry: Any) -> ServerMemory:
        if not isinstance(entry, dict):
            raise TypeError(f"a server's entry is {type(entry).__name__}, not an object")
        tags = {}
        for key in ("released", "in_doubt"):
            value = entry.get(key, [])
            if not isinstance(value, list) or not set(value) <= set(MEMORY_TAGS):
                raise ValueError(f"`{key}` must list tags of {MEMORY_TAGS}, got {value!r}")
            tags[key] = set(value)
        identity = entry.get("identity")
        if identity is not None and not isinstance(identity, str):
            raise TypeError("`identity` is not a string")
        return ServerMemory(identity, tags["released"], tags["in_doubt"], str(entry.get("doubt")))

    def write(self, servers: dict[str, ServerMemory]) -> None:
        text = json.dumps(
            {
                "about": "GPU memory the SGLang servers of this run hold released "
                "(docs/SGLANG.md, 'Server memory')",
                "servers": {url: mem.to_json() for url, mem in sorted(servers.items())},
            },
            indent=1,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(self.path, text + "\n")


def _not_applied(error: SGLangError) -> bool:
    """The request cannot have reached SGLang's scheduler: nothing changed."""
    if isinstance(error, SGLangConnectionError):
        return not error.request_sent
    return isinstance(error, SGLangHTTPError) and error.status in (401, 403)


class MemoryTracker:
    """The leader's view of every server's memory, the calls that change it, and the liveness
    probe that never runs the model of a server whose memory is not all resident. Use it on the
    engine's event loop."""

    def __init__(
        self,
        client: SGLangClient,
        urls: Sequence[str],
        record: MemoryRecord | None,
        *,
        call_timeout_s: float,
    ) -> None:
        self.client = client
        self.record = record
        self.call_timeout_s = call_timeout_s
        self._recorded = record.read() if record is not None else {}
        self.servers = {url: ServerMemory() for url in urls}
        # One request at a time per server between probes and memory calls: a release must not
        # meet the one-token generation of a health check (SGLang asserts the server is idle).
        self._locks = {url: asyncio.Lock() for url in urls}
        # Requests of the engine that run the model of each server (`hold`): never released
        # under them.
        self._users = dict.fromkeys(urls, 0)
        self._writing = asyncio.Lock()

    # ---- what is known -----------------------------------------------------------------------

    def resident(self, url: str) -> bool:
        return self.servers[url].resident

    def unknown(self, url: str) -> str | None:
        """Why `url`'s memory state is unknown (it must get nothing until it restarts), or None."""
        mem = self.servers.get(url)
        if mem is None or mem.known:
            return None
        return (
            f"its GPU memory state is unknown ({mem.doubt}): it gets no request that could run "
            "its model until a new server process answers at its URL"
        )

    def left_released(self) -> dict[str, list[str]]:
        """Servers holding released (or possibly released) memory, and those tags."""
        return {
            url: _ordered(mem.released | mem.in_doubt)
            for url, mem in self.servers.items()
            if mem.released or mem.in_doubt
        }

    def left_line(self, launched: Iterable[str]) -> str | None:
        """The line for the user at close about the servers (launched ones aside: they stop)
        left with memory released, or None: memory stays as it is at close (bringing it back
        could take GPU memory the trainer still holds), and the record says so too."""
        launched = set(launched)
        left = {u: t for u, t in self.left_released().items() if u not in launched}
        if not left:
            return None
        where = self.record.path if self.record is not None else None
        return (
            "SGLang servers left with GPU memory released: "
            + "; ".join(f"{u}: {', '.join(t)}" for u, t in left.items())
            + (f" (recorded in {where}: a run resumed in that directory brings it back)"
               if where else "")
            + ". Anything else must restart them, or POST /resume_memory_occupation with exactly "
            "those tags, before using them"
        )  # fmt: skip

    # ---- first contact, restarts -------------------------------------------------------------

    async def adopt(self, url: str, info: Any) -> None:
        """What `url` holds, from its /server_info answer and the run directory's record: as
        recorded when it is the process the record describes, all resident when it is a new
        process (restarted since) or one the record does not name."""
        identity = identity_of(info)
        before = self._recorded.get(url)
        if before is None or before.resident:
            mem = ServerMemory(identity)
        elif identity is not None and before.identity is not None and identity != before.identity:
            mem = ServerMemory(identity)
            logger.info("%s restarted since %s recorded %s released: all resident", url,
                        self._where(), _ordered(before.released | before.in_doubt))  # fmt: skip
        elif identity is not None and identity == before.identity:
            mem = ServerMemory(identity, set(before.released), set(before.in_doubt), before.doubt)
            if mem.released:
                logger.info("%s holds %s released, as %s recorded", url,
                            _ordered(mem.released), self._where())  # fmt: skip
        else:
            mem = ServerMemory(
                identity,
                set(before.released),
                set(MEMORY_TAGS),
                f"{self._where()} says {_ordered(before.released | before.in_doubt)} released, "
                "and its /server_info has no startup_time to tell whether it restarted since",
            )
        self.servers[url] = mem
        await self._save()

    def forget(self, url: str) -> None:
        """A launched server restarted here: a new process, everything resident."""
        self.servers[url] = ServerMemory()

    async def server_info(self, url: str, timeout_s: float) -> dict | None:
        """GET /server_info (runs nothing on the GPU); None when it does not answer."""
        try:
            info = await self.client.get(url, "/server_info", retry=NO_RETRY, timeout_s=timeout_s)
        except SGLangError:
            return None
        return info if isinstance(info, dict) else None

    def _note_identity(self, url: str, info: dict) -> bool:
        """Compare the process answering at `url` with the one its state is about; a new one
        holds everything resident. True when the state changed."""
        identity = identity_of(info)
        mem = self.servers[url]
        if identity is None or identity == mem.identity:
            return False
        if mem.identity is None:
            mem.identity = identity
            return True
        if mem.released or mem.in_doubt:
            logger.warning("%s is a new server process: its memory is all resident again", url)
        self.servers[url] = ServerMemory(identity)
        return True

    async def probe(self, url: str, timeout_s: float) -> bool:
        """Does `url` answer? GET /health (SGLang runs a one-token generation there when idle)
        only when its memory is known resident; otherwise GET /server_info, which also shows a
        restart (after which everything is resident)."""
        async with self._locks[url]:
            if self.resident(url):
                return await self.client.is_healthy(url, timeout_s=timeout_s)
            info = await self.server_info(url, timeout_s)
            if info is None:
                return False
            if self._note_identity(url, info):
                await self._save()
            return True

    # ---- memory calls ------------------------------------------------------------------------

    async def release(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        """Release the resident ones of `tags` on each of `urls`, except on a server a request
        holds (`hold`: SGLang asserts the server is idle). The servers that failed."""
        return await self._each(urls, _RELEASE, tags)

    async def hold(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        """Bring back the released ones of `tags` on each of `urls` and keep them: no release
        reaches a held server until `unhold`. For requests that run the model (generation,
        weight updates). The servers that failed, not held."""
        results = await asyncio.gather(*(self._hold(u, tags) for u in urls))
        return {u: e for u, e in zip(urls, results, strict=True) if e is not None}

    def unhold(self, urls: Sequence[str]) -> None:
        for url in urls:
            self._users[url] -= 1

    async def _hold(self, url: str, tags: Sequence[str]) -> SGLangError | None:
        mem = self.servers[url]
        # Nothing to wait for or to send (a release in flight puts its tags in doubt first).
        if mem.known and not mem.released & set(tags):
            self._users[url] += 1
            return None
        async with self._locks[url]:
            error = await self._call_locked(url, _RESUME, tags)
            if error is None:
                self._users[url] += 1
            return error

    async def resume(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        """Resume the released ones of `tags` on each of `urls` (a server restarted since holds
        them already). The servers that failed."""
        return await self._each(urls, _RESUME, tags)

    async def _each(self, urls: Sequence[str], path: str, tags: Sequence[str]) -> dict:
        # A server known to need nothing gets no request (a generation asks before each one).
        releasing = path == _RELEASE
        urls = [
            u for u in urls
            if not self.servers[u].known
            or any((t in self.servers[u].released) != releasing for t in tags)
        ]  # fmt: skip
        if not urls:
            return {}
        results = await asyncio.gather(*(self._call(u, path, tags) for u in urls))
        return {u: e for u, e in zip(urls, results, strict=True) if e is not None}

    async def _call(self, url: str, path: str, tags: Sequence[str]) -> SGLangError | None:
        async with self._locks[url]:
            return await self._call_locked(url, path, tags)

    async def _call_locked(self, url: str, path: str, tags: Sequence[str]) -> SGLangError | None:
        releasing = path == _RELEASE
        # The process answering now is the one the state is about, or a new one (restarted:
        # all resident), never a guess.
        info = await self.server_info(url, timeout_s=min(30.0, self.call_timeout_s))
        if info is None:
            return SGLangConnectionError(f"{url}/server_info did not answer before {path}", url)
        if self._note_identity(url, info):
            await self._save()
        mem = self.servers[url]
        if not mem.known:
            return SGLangError(f"{url}: {self.unknown(url)}", url)
        todo = _ordered(t for t in tags if (t in mem.released) != releasing)
        if not todo:
            return None
        # From here to the tags' doubt nothing awaits: a request that holds the server now
        # started before this release, and one that comes later waits for it (the doubt).
        if releasing and self._users[url]:
            logger.warning("%s keeps its memory: a request of this engine runs there (SGLang "
                           "kills a server released while busy)", url)  # fmt: skip
            return None
        mem.in_doubt.update(todo)
        mem.doubt = f"a {path} of {todo} did not answer"
        await self._save()  # before the call: a kill from here on leaves the doubt on record
        try:
            await self.client.post(
                url, path, {"tags": todo}, retry=NO_RETRY, expect_json=False,
                timeout_s=self.call_timeout_s,
            )  # fmt: skip
        except SGLangError as e:
            if _not_applied(e):
                mem.in_doubt.difference_update(todo)
                mem.doubt = ""
            else:
                mem.doubt = f"a {path} of {todo} failed: {e}"
                logger.warning("%s: %s", url, self.unknown(url))
            await self._save()
            return e
        mem.in_doubt.difference_update(todo)
        mem.doubt = ""
        if releasing:
            mem.released.update(todo)
        else:
            mem.released.difference_update(todo)
        await self._save()
        return None

    # ---- the record --------------------------------------------------------------------------

    def _where(self) -> str:
        return str(self.record.path) if self.record is not None else "the memory record"

    async def _save(self) -> None:
        if self.record is None:
            return
        async with self._writing:
            snapshot = {u: ServerMemory(m.identity, set(m.released), set(m.in_doubt), m.doubt)
                        for u, m in self.servers.items()}  # fmt: skip
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(None, self.record.write, snapshot)
            except OSError as e:
                raise SGLangError(
                    f"cannot write the SGLang memory record {self.record.path}: {e}"
                ) from e


class MemoryCalls:
    """The tracker's memory calls as the engine makes them: a server whose call failed is fenced
    (`fence(url, reason)`: the server pool's `failed`, suspect and checked at once), with the
    reason its state is unknown when it is (then it gets nothing until it restarts)."""

    def __init__(self, tracker: MemoryTracker, fence: Callable[[str, str], None]) -> None:
        self.tracker = tracker
        self._fence = fence

    async def release(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        return self._fenced(_RELEASE, await self.tracker.release(urls, tags))

    async def hold(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        return self._fenced(_RESUME, await self.tracker.hold(urls, tags))

    def unhold(self, urls: Sequence[str]) -> None:
        self.tracker.unhold(urls)

    async def resume(self, urls: Sequence[str], tags: Sequence[str]) -> dict[str, SGLangError]:
        return self._fenced(_RESUME, await self.tracker.resume(urls, tags))

    def _fenced(self, path: str, failed: dict[str, SGLangError]) -> dict[str, SGLangError]:
        for url, error in failed.items():
            self._fence(url, self.tracker.unknown(url) or f"{path}: {error}")
        return failed
