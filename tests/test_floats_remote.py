"""Every float the store accepts comes back exactly from sqld (issue 25, class 19).

A float goes to the server as decimal text (`harel_store.connection.hrana._value`), which a
REAL column's affinity turns back into a double with the server's SQLite. Its shortest repr
came back one ulp off for about one double in 8,000 (one in 20,000 epoch-like times), the
largest double as infinity; these
tests send 100k random doubles of every kind through the store's own paths on a real sqld:
timers' ``fire_at`` (armed, listed, swept by ``now`` and acked by that float), an
execution's ``finished_at`` (the summary column) and floats inside a document.
"""

from __future__ import annotations

import math
import random
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from harel_store import DueTimer, Execution, LibsqlStore, TimerOp
from harel_store.connection.hrana import _value

TIMERS = 93_000
PER_COMMIT = 1_000
SEED = 20261204


def doubles(rng: random.Random, n: int) -> Iterator[float]:
    """Finite doubles of every kind: epoch-like times (as time.time() gives them, and cut to
    microseconds), any bit pattern (subnormals, huge exponents, negatives), and the edges."""
    edges = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308]
    yield from edges
    for i in range(n - len(edges)):
        kind = i % 4
        if kind == 0:
            yield rng.uniform(1.6e9, 2.2e9)
        elif kind == 1:
            yield round(rng.uniform(1.6e9, 2.2e9), 6)
        elif kind == 2:
            while not math.isfinite(x := struct.unpack("<d", rng.randbytes(8))[0]):
                pass
            yield x
        else:
            yield rng.uniform(-1e6, 1e6)


def same(a: float, b: float) -> bool:
    """Equal as doubles; -0.0 and 0.0 alike (SQLite keeps no negative zero, on any kind)."""
    return struct.pack("<d", a + 0.0) == struct.pack("<d", b + 0.0)


@pytest.fixture
def remote(server: Any) -> Iterator[LibsqlStore]:
    with LibsqlStore(server.url, auth_token=server.token) as store:
        yield store


def test_floats_travel_as_eighteen_significant_digits_cut_toward_zero() -> None:
    # The shortest repr of the first came back as its neighbour from sqld's SQLite.
    assert _value(-613204.117655946) == {"type": "text", "value": "-6.13204117655945941e+5"}
    # Cut toward zero: rounded up to 18 digits, the largest double overflowed to infinity.
    assert _value(1.7976931348623157e308)["value"] == "1.79769313486231570e+308"
    assert _value(5e-324)["value"] == "4.94065645841246544e-324"
    assert _value(2.5)["value"] == "2.5e+0" and _value(-0.0)["value"] == "0e+0"


@pytest.mark.slow
def test_a_hundred_thousand_random_doubles_come_back_exactly(remote: LibsqlStore) -> None:
    rng = random.Random(SEED)
    fire = list(doubles(rng, TIMERS))
    armed: dict[tuple[str, str], float] = {}
    for start in range(0, TIMERS, PER_COMMIT):
        exe = Execution(id=f"t{start // PER_COMMIT:03d}", definition_id="floats")
        ops = []
        for i, at in enumerate(fire[start : start + PER_COMMIT]):
            ops.append(TimerOp.schedule(f"p{i:04d}", at))
            armed[exe.id, f"p{i:04d}"] = at
        remote.commit(exe, [], timers=ops)

    # Timers: listed as armed, soonest first, every fire_at exactly; then acked by that
    # float (a timer goes only while armed at exactly its fire_at), a page at a time.
    swept: list[DueTimer] = []
    while page := remote.due_timers(1.7976931348623157e308, limit=10_000):
        off = [(t, armed[t[:2]]) for t in page if not same(t.fire_at, armed[t[:2]])]
        assert off == [], f"{len(off)} fire_at off, e.g. {off[:3]}"
        if not swept:  # a sweep by `now` meets a timer at its time, not one ulp before it
            for timer in rng.sample(page, 40):
                at = timer.fire_at
                assert timer in remote.due_timers(at)
                assert timer not in remote.due_timers(math.nextafter(at, -math.inf))
        assert remote.ack(page) == len(page)
        swept.extend(page)
    assert len(swept) == TIMERS and {t[:2] for t in swept} == armed.keys()
    assert [t.fire_at for t in swept] == sorted(at + 0.0 for at in armed.values())

    # finished_at, as the summary column a listing reads, and floats inside a document:
    # 93k + 2k + 5k = 100k doubles in all.
    finished = list(doubles(rng, 5_000))
    inside = list(doubles(rng, 5_000))

    def finish(i: int) -> None:
        exe = Execution(id=f"f{i:04d}", definition_id="finished", status="finished")
        exe.finished_at = finished[i]
        exe.context = {"x": inside[i]}
        remote.commit(exe, [])

    # From 16 threads: their commits ride together (group commit), ~140 requests, not
    # 2,000 one after another.
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(finish, range(2_000)))
    listed = remote.list_executions(definition_id="finished", limit=1000)
    summaries = list(listed.items)
    while listed.next_cursor is not None:
        listed = remote.list_executions(
            definition_id="finished", limit=1000, cursor=listed.next_cursor
        )
        summaries.extend(listed.items)
    got = {s.id: s.finished_at for s in summaries}
    assert len(got) == 2_000
    bad = [(i, at) for i, at in enumerate(finished[:2_000]) if not same(got[f"f{i:04d}"], at)]
    assert bad == []
    document = Execution(id="doc", definition_id="floats", context={"values": inside})
    remote.commit(document, [])
    loaded = remote.load("doc")
    assert loaded is not None
    assert all(same(a, b) for a, b in zip(loaded.context["values"], inside, strict=True))
