"""Leave within seconds when another rank of the job is gone, instead of hanging in a collective.

gloo notices a peer whose process ended (its sockets close), but not one that hangs or whose
host vanished, and NCCL waits for its timeout (minutes) either way. Each rank's watchdog thread
publishes a heartbeat counter in the job's rendezvous store and watches one neighbour's (a ring:
O(1) store traffic per rank); a neighbour silent for `timeout_s` is declared dead in the store,
and every rank that sees the declaration (or cannot reach the store, whose host is rank 0's
node) prints one line and exits with status 1.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

_POLL_S = 1.0


class PeerWatchdog:
    def __init__(self, timeout_s: float, *, poll_s: float = _POLL_S) -> None:
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"gspo/peers/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{attempt}/"

    def start(self) -> None:
        if self.world == 1:
            return
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=max(self.timeout_s, 5.0)),
            wait_for_workers=False,
        )
        self._thread = threading.Thread(
            target=self._run, args=(store,), name="peer-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self, store) -> None:
        neighbour = (self.rank + 1) % self.world
        beat = 0
        seen, seen_at = None, time.monotonic()
        try:
            while not self._stop.wait(self.poll_s):
                beat += 1
                store.set(f"{self._prefix}beat/{self.rank}", str(beat))
                if store.check([f"{self._prefix}dead"]):
                    self._leave(store.get(f"{self._prefix}dead").decode())
                    return
                key = f"{self._prefix}beat/{neighbour}"
                value = store.get(key) if store.check([key]) else None
                now = time.monotonic()
                if value != seen:
                    seen, seen_at = value, now
                elif now - seen_at > self.timeout_s:
                    reason = f"rank {neighbour} sent no heartbeat for {now - seen_at:.0f} s"
                    store.set(f"{self._prefix}dead", reason)
                    self._leave(reason)
                    return
        except Exception as err:  # noqa: BLE001 - the store's host (rank 0's node) is gone
            if not self._stop.is_set():
                self._leave(f"the job's rendezvous store is unreachable ({err})")

    def _leave(self, reason: str) -> None:
        if self._stop.is_set():
            return
        print(
            f"gspo-train: rank {self.rank}: {reason}: another rank is gone (crashed, killed or "
            "hung); exiting instead of waiting in a collective",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)
