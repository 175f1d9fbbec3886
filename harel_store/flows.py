"""Flow control: the settings of flow keys, which every claim honours, and failover.

Every outbox entry, spawn and timer carries a *flow key*, written with it at commit: by
default the root key of the execution it concerns (an entry's target, ``""`` for none; a
spawn's child; a timer's execution), or what the store's ``flow_key`` function says. A key
with settings (`Flows.set_flow`) may be paused, limited in how many of its items are held
at once and in how many are claimed per period, and put before or after the others; keys
are served round-robin within a priority. The claims (`harel_store.queues`) decide all of it
in their one transaction, on the database's clock: ``sql/queries.sql`` ("Flow control")
holds the SQL and says why.

A worker's items can be handed back at once (`Flows.release_worker`: a relay does it as it
starts, so a worker restarted under its id does not wait out its own leases), and
`Flows.workers` says who holds what.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from harel_store import wakeup
from harel_store.batch import Batch, Plan, fresh
from harel_store.checks import MAX_ID_LENGTH, MAX_SECONDS, check_column_text, check_id, check_int
from harel_store.core import StoreCore
from harel_store.models import Flow, WorkerHold
from harel_store.operation import operation

FlowKey = Callable[[str], str]
"""A store's ``flow_key`` function: an execution id in, its flow key out."""


def root_key(execution_id: str) -> str:
    """The default flow key: the text before the execution id's first ``"."`` (all of it
    when it has none), the key a fleet routes by."""
    return execution_id.partition(".")[0]


def check_flow_key(value: object, name: str = "flow key") -> str:
    """A flow key: a string of at most MAX_ID_LENGTH characters (``""`` included: the key of
    outbox entries with no target), no NUL, no lone surrogate."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    if len(value) > MAX_ID_LENGTH:
        raise ValueError(f"{name} must be at most {MAX_ID_LENGTH} characters, not {len(value)}")
    return check_column_text(value, name)


def check_flow_function(value: object) -> FlowKey | None:
    """A store's ``flow_key`` option: None (the root key) or a callable."""
    if value is not None and not callable(value):
        raise TypeError(f"flow_key must be a function of an execution id, not {value!r:.80}")
    return value


def flow_of(function: FlowKey | None, execution_id: str | None) -> str:
    """The flow key of an item concerning ``execution_id`` (None: an outbox entry with no
    target, whose key is ``""``; the function is not called for it)."""
    if execution_id is None:
        return ""
    if function is None:
        return root_key(execution_id)
    return check_flow_key(function(execution_id), f"flow_key({execution_id!r:.80})")


def _check_rate(rate: object) -> tuple[int | None, float | None]:
    if rate is None:
        return None, None
    if isinstance(rate, (str, bytes)) or not isinstance(rate, Sequence) or len(rate) != 2:
        raise TypeError(f"rate must be (count, seconds) or None, not {rate!r:.80}")
    count, seconds = rate
    if check_int(count, "rate count") < 1:
        raise ValueError(f"rate count must be >= 1, not {count}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise TypeError(f"rate seconds must be a number, not {type(seconds).__name__}")
    # Compared before any float(): an int past every float (10**400) is out of range, not an
    # OverflowError; NaN compares false.
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"rate seconds must be > 0 and at most {MAX_SECONDS}, not {seconds!r:.40}")
    return count, float(seconds)


def _flow(row: Sequence[Any]) -> Flow:
    key, priority, concurrency, paused, count, seconds, pending, held = row
    rate = None if count is None or seconds is None else (count, float(seconds))
    return Flow(key, priority, concurrency, bool(paused), rate, pending, held)


# What a change of a key's settings writes after its row: the key's live items marked as
# the flows now say (the claims walk them by it), and its rate log dropped once it has none.
_MARK = ("mark_flowed_outbox", "mark_flowed_spawns", "mark_flowed_timers", "forget_flow_claims")
# A change may make items claimable (a resume, a higher limit): the relays look again.
_SIGNALS = (wakeup.OUTBOX, wakeup.SPAWN, wakeup.TIMER)


def _resumed(batch: Batch, key: str, unpaused: bool) -> None:
    """Add to ``batch``, before the change of ``key``'s row it makes, the new ranks of the
    key's items should the change leave it ``unpaused`` (and it has settings now: it may
    have been paused, or held back by a limit): they take their turns from where the claims
    stand, not every claim until they caught up."""
    for name in ("rerank_outbox", "rerank_spawns"):
        batch.add(name, key, int(unpaused))


class Flows(StoreCore):
    """The operations on flows and workers (`harel_store.store.Store` has them all)."""

    def _changed(self, batch: Batch, key: str) -> Plan[tuple[list[Any], Flow | None]]:
        """Run ``batch`` (a change of ``key``'s row) with the marks of its items and a read
        of its settings after, in one transaction; wake this process's relays; return the
        batch's results and the settings (None: the key has none)."""
        for name in _MARK:
            batch.add(name, key)
        read = batch.add("flows", key)
        results = yield batch
        self._notify(_SIGNALS)
        rows = results[read]
        return results, (_flow(rows[0]) if rows else None)

    @operation
    def set_flow(
        self,
        key: str,
        *,
        priority: int = 0,
        concurrency: int | None = None,
        paused: bool = False,
        rate: tuple[int, float] | None = None,
    ) -> Plan[Flow]:
        """Replace every setting of flow key ``key``; return them, with its items now.

        ``priority``: higher first (any int; 0 is every other key's). ``concurrency``: at
        most this many of its items held at once, all kinds, across every worker (None: no
        limit; 0 holds nothing, as paused). ``paused``: none claimed. ``rate``: ``(count,
        seconds)``, at most ``count`` of its items claimed in any ``seconds`` on the
        database's clock (an ack does not give a claim back). Every worker sees it at its
        next claim. Marking the key's items is one write in proportion to its backlog.
        TypeError/ValueError for a bad value, nothing written.
        """
        check_flow_key(key)
        check_int(priority, "priority")
        if concurrency is not None and check_int(concurrency, "concurrency") < 0:
            raise ValueError(f"concurrency must be >= 0 (or None: no limit), not {concurrency}")
        if not isinstance(paused, bool):
            raise TypeError(f"paused must be a bool, not {type(paused).__name__}")
        count, seconds = _check_rate(rate)
        batch = Batch()
        _resumed(batch, key, not paused)
        batch.add("set_flow", key, priority, concurrency, int(paused), count, seconds)
        _, flow = yield from self._changed(batch, key)
        assert flow is not None  # the row was just written, in the same transaction
        return flow

    @operation
    def pause_flow(self, key: str) -> Plan[Flow]:
        """Pause flow key ``key``: no item of it is claimed (its due timers wait, and fire
        once resumed); its other settings stay (a key with none gets the defaults). Returns
        its settings."""
        check_flow_key(key)
        batch = Batch()
        batch.add("pause_flow", key, 1)
        _, flow = yield from self._changed(batch, key)
        assert flow is not None
        return flow

    @operation
    def resume_flow(self, key: str) -> Plan[Flow | None]:
        """Resume flow key ``key``, its other settings kept; the relays are woken (of every
        process: it is a commit like any other). Returns its settings (None: it has none)."""
        check_flow_key(key)
        batch = Batch()
        _resumed(batch, key, True)
        batch.add("pause_flow", key, 0)
        _, flow = yield from self._changed(batch, key)
        return flow

    @operation
    def clear_flow(self, key: str) -> Plan[bool]:
        """Drop every setting of flow key ``key``: priority 0, no limit, no rate, not paused,
        and no longer listed by `flows`. True if it had settings."""
        check_flow_key(key)
        batch = Batch()
        _resumed(batch, key, True)
        cleared = batch.add("clear_flow", key)
        results, _ = yield from self._changed(batch, key)
        return bool(results[cleared])

    @operation
    def flows(self) -> Plan[list[Flow]]:
        """The flow keys with settings, by key, each with its items now: ``pending``
        (outbox entries and spawns neither held nor dead, due timers not held) and
        ``held`` (claimed under a live lease). One read (at the primary on a replica)."""
        rows = yield fresh("flows", None)
        return [_flow(row) for row in rows]

    @operation
    def release_worker(self, worker: str) -> Plan[int]:
        """Hand back every item ``worker`` holds under a live lease, all kinds: claimable at
        once, each claim's attempt given back (as `release`). Returns how many. For a worker
        known to be gone (a relay does this as it starts with its id: one worker id names
        one process at a time)."""
        return (yield from self._release_worker(check_id(worker, "worker"), 1))

    @operation
    def _restarted(self, worker: str) -> Plan[int]:
        """A relay starting as ``worker``: `release_worker`, each claim's attempt kept (its
        predecessor may have died of the item: a handler that ends its process still moves
        the item toward its max_attempts)."""
        return (yield from self._release_worker(worker, 0))

    def _release_worker(self, worker: str, give_back: int) -> Plan[int]:
        if not (yield fresh("held_by", worker)):
            return 0  # nothing to write (a relay that starts idle writes nothing)
        batch = Batch()
        batch.add("touch_held_flows", worker, remote=True)  # room made: see queues.add_freed
        batch.add("rerank_worker_outbox", worker)  # what comes back takes turns from where
        batch.add("rerank_worker_spawns", worker)  # the claims stand (see release)
        names = ("release_worker_outbox", "release_worker_spawns", "release_worker_timers")
        steps = [batch.add(name, worker, give_back) for name in names]
        results = yield batch
        released: int = sum(results[step] for step in steps)
        if released:
            self._notify(_SIGNALS)
        return released

    @operation
    def workers(self) -> Plan[list[WorkerHold]]:
        """Who holds what now: each worker with items claimed under a live lease, by
        worker id, with its count of each kind and its latest lease's end. One read."""
        rows = yield fresh("workers")
        holds: dict[str, WorkerHold] = {}
        for worker, kind, held, until in rows:
            hold = holds.get(worker)
            if hold is None:
                hold = holds[worker] = WorkerHold(worker, {}, until)
            elif until > hold.lease_until:
                hold = holds[worker] = hold._replace(lease_until=until)
            hold.held[kind] = held
        return list(holds.values())
