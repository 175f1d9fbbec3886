"""How much one retention write takes, so that it holds a file's write lock briefly.

Each retention call (`Store.purge_finished`, `forget_processed`, `purge_dead`) is one write
transaction, and while it is written every other writer of the file waits: a batch of 1,000
executions with random ids held the lock ~195 ms (each execution removed rewrites ~5 pages
all over the file's b-trees), and an engine's commits queued behind it. On a local file the
store times each of its retention writes and sizes the next to a time budget: short
(`BUSY`) while another connection writes the file too (its ``data_version`` moved since the
store's previous retention write), longer (`IDLE`) when the store has the file to itself,
never over the call's ``limit``. A call that removes fewer than its ``limit`` is no sign that
nothing is left: callers call again until 0, as before.

A remote primary runs the write at the server, where this process cannot time it (a
request's time is mostly the link's): there a write takes at most `REMOTE` items of its kind.
"""

from __future__ import annotations

import threading

# Seconds a retention write may hold a local file's write lock: while other connections
# write the file (a waiting commit waits about this long), and while none does.
BUSY = 0.002
IDLE = 0.010
# Items the first write of a kind takes, before any has been timed.
FIRST = 16
# The most one remote retention write takes, by kind (`Pacer.size`).
REMOTE = {"executions": 100, "markers": 2000, "dead": 1000}


class Pacer:
    """A store's estimate of the seconds a retention write spends per item, by kind
    (``"executions"``, ``"markers"``, ``"dead"``), and the sizes it picks from them."""

    def __init__(self) -> None:
        self._per_item: dict[str, float] = {}
        self._lock = threading.Lock()

    def size(self, kind: str, limit: int, *, local: bool, others_wrote: bool) -> int:
        """How many items the next write of ``kind`` takes (1 to ``limit``)."""
        if not local:
            return min(limit, REMOTE[kind])
        with self._lock:
            per_item = self._per_item.get(kind)
        if per_item is None:
            return min(limit, FIRST)
        budget = BUSY if others_wrote else IDLE
        return max(1, min(limit, int(budget / per_item)))

    def took(self, kind: str, items: int, seconds: float) -> None:
        """Record that a write of ``kind`` removed ``items`` in ``seconds`` (a write that
        removed nothing tells nothing of the cost of one)."""
        if items <= 0:
            return
        per_item = max(seconds, 1e-9) / items
        with self._lock:
            old = self._per_item.get(kind)
            self._per_item[kind] = per_item if old is None else (old + per_item) / 2
