"""Dead letters through the ``harel-store`` console script, in subprocesses as in
tests/test_cli.py: ``dead``, ``revive`` and ``discard``, the relay views' ``--dead`` and
their TRIES and LAST ERROR columns, and ``status``'s dead counts and ``--max-dead``; on a
local file and on sqld.

Dead letters are made as a relay makes them: a claim with max_attempts=1 counts the one
attempt, the lease runs out (moved back, as tests/test_claims.py's `elapse` does: never
waited on) and the next claim sets the rows aside.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, Execution, LibsqlStore, StoreError
from harel_store.cli.output import when
from tests.conftest import reset_remote
from tests.helpers import raw
from tests.sqld import SqldServer
from tests.test_claims import elapse
from tests.test_cli import CONTROL, _on_a_terminal, cli, failed, ok, seed

# The dead letters of the `db` fixture, in the order they died: (kind, key, attempts).
BURIED = [
    ("outbox", 1, 1),
    ("spawn", 1, 1),
    ("timer", ("order-1", "placed.late"), 1),
]


def claim_all(store: Any, worker: str = "w1", **options: Any) -> list[Any]:
    """What ``worker`` claims of every kind due now, outbox first."""
    return [
        *store.claim_outbox(worker, **options),
        *store.claim_spawns(worker, **options),
        *store.claim_due_timers(worker, time.time(), **options),
    ]


def bury(store: Any, error: str | None = None) -> None:
    """Make every live row due now a dead letter: claimed once at max_attempts=1 (and
    failed with ``error``, if given), its lease run out, then the claim that sets it aside."""
    claimed = claim_all(store, max_attempts=1)
    assert claimed
    if error is not None:
        assert store.fail("w1", claimed, error=error) == len(claimed)
    elapse(store, 3600.0)
    assert claim_all(store, "w2", max_attempts=1) == []


def publish(store: Any) -> None:
    """invoice-1 publishes an event: a live outbox entry."""
    invoice = store.load("invoice-1")
    assert invoice is not None
    store.commit(invoice, [(None, Event(name="published", id="evt-pub"))])


@pytest.fixture
def db(tmp_path: Path) -> str:
    """tests/test_cli.py's seeded database with its outbox entry, spawn and due timer made
    dead letters (each failed once with "boom"), then one live outbox entry (seq 2)."""
    database = str(tmp_path / "state.db")
    seed(database)
    with LibsqlStore(database) as store:
        bury(store, "boom")
        publish(store)
    return database


def dead_in(database: str, **options: Any) -> list[tuple[str, Any, int]]:
    """The database's dead letters as (kind, key, attempts), in the order they died."""
    with LibsqlStore(database, **options) as store:
        return [
            (d.kind, tuple(d.item[:2]) if d.kind == "timer" else d.item.seq, d.attempts)
            for d in store.dead_letters()
        ]


def table_of(out: str) -> list[dict[str, str]]:
    """A printed table as one dict per row: each cell cut at its header's offsets (a cell
    is padded to its column's width; columns are two spaces apart)."""
    header, *lines = out.splitlines()
    spans = [(m[0], m.start()) for m in re.finditer(r"\S+(?: \S+)*", header)]
    ends: list[int | None] = [start for _, start in spans[1:]]
    ends.append(None)
    return [
        {name: line[start:end].strip() for (name, start), end in zip(spans, ends, strict=True)}
        for line in lines
    ]


def json_lines(out: str) -> list[Any]:
    return [json.loads(line) for line in out.splitlines()]


def test_dead_lists_every_kind_in_the_order_they_died(db: str) -> None:
    docs = json_lines(ok(cli("dead", "--json", "--url", db)))
    event = {"name": "ping", "id": "evt-ping", "payload": {}}
    assert docs[:2] == [
        {
            "kind": "outbox",
            "item": {"seq": 1, "target_id": "order-1", "event": event},
            "attempts": 1,
            "last_error": "boom",
        },
        {
            "kind": "spawn",
            "item": {
                "seq": 1,
                "parent_id": "order-1",
                "child_id": "order-1.later",
                "root_path": "later",
                "context": {},
            },
            "attempts": 1,
            "last_error": "boom",
        },
    ]
    timer = docs[2]["item"]
    assert (docs[2]["kind"], timer["execution_id"], timer["path"]) == (
        "timer",
        "order-1",
        "placed.late",
    )
    assert timer["fire_at"] < time.time() and len(docs) == 3

    rows = table_of(ok(cli("dead", "--url", db)))
    assert rows == [
        {
            "KIND": "outbox",
            "ITEM": "outbox 1: ping for order-1",
            "TRIES": "1",
            "LAST ERROR": "boom",
        },
        {
            "KIND": "spawn",
            "ITEM": "spawn 1: order-1.later of order-1",
            "TRIES": "1",
            "LAST ERROR": "boom",
        },
        {
            "KIND": "timer",
            "ITEM": f"timer order-1 placed.late at {when(timer['fire_at'])}",
            "TRIES": "1",
            "LAST ERROR": "boom",
        },
    ]
    spawns = json_lines(ok(cli("dead", "--kind", "spawn", "--json", "--url", db)))
    assert [(d["kind"], d["item"]["child_id"]) for d in spawns] == [("spawn", "order-1.later")]
    limited = cli("dead", "--limit", "2", "--url", db)
    assert [r["KIND"] for r in table_of(ok(limited))] == ["outbox", "spawn"]
    assert limited.stderr == "harel-store: showing the first 2 (use --limit N for more)\n"

    # the order they died, not their kind: the outbox entry's death moved a minute later
    with LibsqlStore(db) as store:
        conn = raw(store)
        conn.execute("UPDATE harel_outbox SET dead_at = dead_at + 60")
        conn.commit()
    assert [r["KIND"] for r in table_of(ok(cli("dead", "--url", db)))] == [
        "spawn",
        "timer",
        "outbox",
    ]


def test_each_relay_view_lists_its_own_kind_of_dead_letters(db: str) -> None:
    for view, kind in (("outbox", "outbox"), ("spawns", "spawn"), ("timers", "timer")):
        assert [r["KIND"] for r in table_of(ok(cli(view, "--dead", "--url", db)))] == [kind]
    docs = json_lines(ok(cli("spawns", "--dead", "--json", "--url", db)))
    assert [(d["item"]["seq"], d["attempts"], d["last_error"]) for d in docs] == [(1, 1, "boom")]
    # the live views hold none of them
    assert [r["SEQ"] for r in table_of(ok(cli("outbox", "--url", db)))] == ["2"]
    empty = cli("spawns", "--url", db)
    assert ok(empty) == "" and empty.stderr == "harel-store: no pending spawns\n"
    # --dead lists every dead letter of the kind: a filter of the live rows is a usage error
    for argv, dropped in (
        (["outbox", "--source", "invoice-1", "--target", "order-1"], "--target, --source"),
        (["spawns", "--parent", "order-1"], "--parent"),
        (["timers", "--due"], "--due"),
    ):
        line = failed(cli(*argv, "--dead", "--url", db), 2)
        assert line.endswith(f"--dead lists every dead letter of the kind: drop {dropped}"), line


@pytest.mark.slow
def test_live_views_show_tries_and_the_last_error_escaped_and_cut(tmp_path: Path) -> None:
    database = str(tmp_path / "live.db")
    seed(database)
    error = "boom:\n\tline 2 \x1b[31mred\x07\r\x9b " + "x" * 500  # kept whole (< MAX_ERROR)
    start = "boom: line 2 \\x1b[31mred\\x07 \\x9b "  # one line, escaped
    shown = start + "x" * (77 - len(start)) + "..."  # cut to 80 characters
    with LibsqlStore(database) as store:
        claimed = claim_all(store)
        assert store.fail("w1", claimed, error=error, retry_in=3600.0) == 3
        publish(store)
        assert [e.seq for e in store.claim_outbox("w2", lease=600.0)] == [2]
    for view in ("outbox", "spawns", "timers"):
        result = cli(view, "--url", database)
        assert not CONTROL.search(result.stdout + result.stderr), result
        rows = table_of(ok(result))
        assert (rows[0]["TRIES"], rows[0]["LAST ERROR"]) == ("1", shown), view
        assert rows[0]["CLAIMED BY"].startswith("(retry in "), rows[0]  # nobody holds it
        docs = json_lines(ok(cli(view, "--json", "--url", database)))
        assert (docs[0]["attempts"], docs[0]["last_error"], docs[0]["claimed_by"]) == (
            1,
            error,
            None,
        )
        if view == "outbox":  # held by the worker that claimed it, not failed
            assert (rows[1]["SEQ"], rows[1]["TRIES"], rows[1]["LAST ERROR"]) == ("2", "1", "")
            assert rows[1]["CLAIMED BY"].startswith("w2 (") and rows[1]["CLAIMED BY"].endswith(
                "left)"
            )
        if view == "timers":  # never claimed
            assert (rows[1]["PATH"], rows[1]["TRIES"], rows[1]["LAST ERROR"]) == (
                "placed.remind",
                "",
                "",
            )

    with LibsqlStore(database) as store:
        elapse(store, 3600.0)  # the retry is due: claimable, held by nobody
    rows = table_of(ok(cli("outbox", "--url", database)))
    assert [(r["CLAIMED BY"], r["TRIES"]) for r in rows] == [("", "1"), ("", "1")]

    with LibsqlStore(database) as store:
        assert claim_all(store, max_attempts=1) == []  # all four set aside
    dead = cli("dead", "--url", database)
    assert not CONTROL.search(dead.stdout + dead.stderr), dead
    assert [(r["ITEM"][:8], r["LAST ERROR"]) for r in table_of(ok(dead))] == [
        ("outbox 1", shown),
        ("outbox 2", ""),
        ("spawn 1:", shown),
        ("timer or", shown),
    ]
    assert [d["last_error"] for d in json_lines(ok(cli("dead", "--json", "--url", database)))] == [
        error,
        None,
        error,
        error,
    ]
    screen = _on_a_terminal("dead", "--url", database, env={})
    assert screen.startswith(b"\x1b[1mKIND") and b"\\x1b[31mred" in screen
    assert b"\x1b[31m" not in screen and b"\x07" not in screen


def test_revive_and_discard_by_key(db: str) -> None:
    # a key that names no dead letter (none such; a live row) is said on stderr and exits
    # 1; the others are revived all the same
    result = cli(
        "revive", "--timer", "order-1", "placed.late", "--spawn", "9", "--outbox", "1",
        "--outbox", "2", "--url", db,
    )  # fmt: skip
    assert result.returncode == 1 and result.stdout == "revived 2\n"
    assert result.stderr.splitlines() == [
        "harel-store: not a dead letter: outbox 2",
        "harel-store: not a dead letter: spawn 9",
    ]
    with LibsqlStore(db) as store:
        assert dead_in(db) == [("spawn", 1, 1)]
        outbox = store.outbox_view()  # attempts back to 0, the last error kept
        assert [(e.seq, e.attempts, e.last_error) for e in outbox] == [(1, 0, "boom"), (2, 0, None)]
        timers = store.timers_view()
        assert [(t.path, t.attempts) for t in timers] == [("placed.late", 0), ("placed.remind", 0)]
        assert [e.seq for e in store.claim_outbox("w3")] == [1, 2]  # claimable at once

    result = cli("discard", "--spawn", "1", "--spawn", "1", "--outbox", "1", "--json", "--url", db)
    assert result.returncode == 1
    assert json.loads(result.stdout) == {"discarded": 1, "missing": [{"kind": "outbox", "key": 1}]}
    assert result.stderr == "harel-store: not a dead letter: outbox 1\n"
    with LibsqlStore(db) as store:
        assert store.dead_letters() == [] and store.pending_spawns() == []
        assert [e.seq for e in store.pending_outbox()] == [1, 2]  # the live one left alone
    # a timer's key is named as --timer takes it, quoted for a shell
    line = failed(cli("discard", "--timer", "order 1", "placed.late", "--url", db))
    assert line == "harel-store: not a dead letter: timer 'order 1' placed.late"


def test_all_of_a_kind_then_all_kinds(db: str) -> None:
    assert ok(cli("revive", "--all", "timer", "--url", db)) == "revived 1\n"
    assert dead_in(db) == BURIED[:2]
    discarded = json.loads(ok(cli("discard", "--all", "all", "--json", "--url", db)))
    assert discarded == {"discarded": 2, "missing": []}
    assert dead_in(db) == []
    with LibsqlStore(db) as store:
        assert [e.seq for e in store.pending_outbox()] == [2] and store.pending_spawns() == []
        assert [t[1] for t in store.due_timers(time.time())] == ["placed.late"]
    assert ok(cli("revive", "--all", "all", "--url", db)) == "revived 0\n"


def test_all_reaches_past_a_page_and_a_dry_run_counts_every_one(tmp_path: Path) -> None:
    database = str(tmp_path / "many.db")
    with LibsqlStore(database, synchronous="OFF") as store:
        emits = [("bulk", Event(name=f"e{i}", id=f"ev{i}")) for i in range(1001)]
        store.commit(Execution(id="bulk", definition_id="d"), emits)
        for _ in range(2):
            assert store.claim_outbox("w1", limit=1000, max_attempts=1)
        elapse(store, 60.0)
        for _ in range(2):  # the oldest 1000 set aside, then the last one
            assert store.claim_outbox("w1", limit=1000, max_attempts=1) == []
        assert store.stats(0.0).dead_outbox == 1001
    dry = cli("discard", "--all", "all", "--dry-run", "--url", database)
    assert [r["ITEM"].split(":")[0] for r in table_of(ok(dry))] == [
        f"outbox {seq}" for seq in range(1, 51)
    ]
    assert dry.stderr == (
        "harel-store: dry run: would discard 1001 (the first 50 listed); nothing changed\n"
    )
    assert ok(cli("revive", "--all", "outbox", "--url", database)) == "revived 1001\n"
    with LibsqlStore(database) as store:
        stats = store.stats(0.0)
        assert (stats.dead_outbox, stats.pending_outbox) == (0, 1001)


def test_a_dry_run_says_what_would_change_and_changes_nothing(db: str) -> None:
    dry = cli("revive", "--all", "all", "--dry-run", "--url", db)
    rows = table_of(ok(dry))
    assert [r["KIND"] for r in rows] == ["outbox", "spawn", "timer"]
    assert rows[2]["ITEM"].startswith("timer order-1 placed.late at ")
    assert dry.stderr == "harel-store: dry run: would revive 3; nothing changed\n"
    keyed = cli(
        "discard", "--outbox", "1", "--timer", "order-1", "placed.late", "--spawn", "5",
        "--outbox", "1", "--dry-run", "--json", "--url", db,
    )  # fmt: skip
    assert keyed.returncode == 1  # a key given twice is one dead letter
    assert [(d["kind"], d["attempts"]) for d in json_lines(keyed.stdout)] == [
        ("outbox", 1),
        ("timer", 1),
    ]
    assert keyed.stderr.splitlines() == [
        "harel-store: not a dead letter: spawn 5",
        "harel-store: dry run: would discard 2; nothing changed",
    ]
    assert dead_in(db) == BURIED
    with LibsqlStore(db) as store:
        assert [e.seq for e in store.pending_outbox()] == [2] and store.pending_spawns() == []


def test_usage_errors_exit_2_and_change_nothing(db: str) -> None:
    for argv, says in (
        (["revive"], "name what to revive: --outbox SEQ, --spawn SEQ, --timer ID PATH"),
        (["discard", "--dry-run"], "name what to discard: "),
        (["discard", "--outbox", "1", "--all", "all"], "--all all takes no --outbox, --spawn"),
        (["revive", "--timer", "order-1", "placed.late", "--all", "timer"], "--all timer takes"),
        (["revive", "--all", "spawns"], "invalid choice: 'spawns'"),
        (["discard", "--outbox", "0"], "must be at least 1, not 0"),
        (["revive", "--timer", "order-1"], "expected 2 arguments"),
        (["dead", "--kind", "timers"], "invalid choice: 'timers'"),
    ):
        assert says in failed(cli(*argv, "--url", db), 2), argv
    assert dead_in(db) == BURIED


@pytest.mark.slow
def test_status_counts_dead_letters_and_max_dead_fails_over_n(db: str) -> None:
    counted = "3 dead letters (outbox 1, spawn 1, timer 1)"
    assert f"dead        {counted}" in ok(cli("status", "--url", db)).splitlines()
    doc = json.loads(ok(cli("status", "--json", "--url", db)))
    assert doc["dead_letters"] == {"outbox": 1, "spawn": 1, "timer": 1}
    assert (doc["pending_outbox"], doc["pending_spawns"], doc["timers_due"]) == (1, 0, 0)
    assert "check" not in doc
    assert ok(cli("status", "--max-dead", "3", "--url", db))  # at N: healthy (implies --check)
    over = cli("status", "--max-dead", "2", "--url", db)
    assert failed(over) == f"harel-store: check failed: --max-dead 2: {counted}"
    assert f"dead        {counted}" in over.stdout  # the status is still printed
    checked = cli("status", "--max-dead", "0", "--json", "--url", db)
    assert checked.returncode == 1
    assert json.loads(checked.stdout)["check"] == {
        "ok": False,
        "failures": [f"--max-dead 0: {counted}"],
    }

    with LibsqlStore(db) as store:
        assert store.ack([d.item for d in store.dead_letters(kind="outbox")]) == 1
        assert store.ack([d.item for d in store.dead_letters(kind="spawn")]) == 1
    line = failed(cli("status", "--max-dead", "0", "--url", db))
    assert line == "harel-store: check failed: --max-dead 0: 1 dead letter (timer 1)"
    assert ok(cli("status", "--max-dead", "1", "--url", db))

    assert ok(cli("discard", "--all", "all", "--url", db)) == "discarded 1\n"
    assert "dead        0 dead letters" in ok(cli("status", "--max-dead", "0", "--url", db))
    doc = json.loads(ok(cli("status", "--max-dead", "0", "--json", "--url", db)))
    assert doc["dead_letters"] == {"outbox": 0, "spawn": 0, "timer": 0}
    assert doc["check"] == {"ok": True, "failures": []}
    none = cli("dead", "--url", db)
    assert ok(none) == "" and none.stderr == "harel-store: no dead letters\n"


@pytest.mark.sqld
def test_dead_revive_discard_and_status_on_a_remote_database(sqld: SqldServer) -> None:
    reset_remote(sqld)
    seed(sqld.url, auth_token=sqld.token)
    with LibsqlStore(sqld.url, auth_token=sqld.token) as store:
        bury(store, "remote boom")
    env = {"HAREL_DATABASE_URL": sqld.url, "HAREL_AUTH_TOKEN": sqld.token}
    docs = json_lines(ok(cli("dead", "--json", env=env)))
    assert [(d["kind"], d["attempts"], d["last_error"]) for d in docs] == [
        ("outbox", 1, "remote boom"),
        ("spawn", 1, "remote boom"),
        ("timer", 1, "remote boom"),
    ]
    assert ok(cli("revive", "--outbox", "1", "--timer", "order-1", "placed.late", env=env)) == (
        "revived 2\n"
    )
    assert json.loads(ok(cli("discard", "--all", "all", "--json", env=env))) == {
        "discarded": 1,
        "missing": [],
    }
    status = json.loads(ok(cli("status", "--max-dead", "0", "--json", env=env)))
    assert status["dead_letters"] == {"outbox": 0, "spawn": 0, "timer": 0}
    assert status["check"]["ok"] is True
    with LibsqlStore(sqld.url, auth_token=sqld.token) as store:
        assert store.dead_letters() == [] and store.pending_spawns() == []
        assert [e.seq for e in store.pending_outbox()] == [1]
        assert [t[1] for t in store.due_timers(time.time())] == ["placed.late"]


def _corrupt_dead(database: str) -> None:
    """The dead outbox entry's event and the dead spawn's context, garbled on disk (through
    the store's own connection: one SQLite library on the file)."""
    with LibsqlStore(database) as store:
        conn = raw(store)
        conn.execute("UPDATE harel_outbox SET event = '{broken' WHERE seq = -1")
        conn.execute("UPDATE harel_spawns SET context = '[1' WHERE seq = -1")
        conn.commit()


def _dead_counts(database: str) -> tuple[int, int, int]:
    with LibsqlStore(database) as store:
        stats = store.stats(0.0)
        return stats.dead_outbox, stats.dead_spawns, stats.dead_timers


def test_a_corrupt_dead_letter_is_discarded_by_key(db: str) -> None:
    _corrupt_dead(db)
    result = cli("discard", "--outbox", "1", "--spawn", "1", "--json", "--url", db)
    assert json.loads(ok(result)) == {"discarded": 2, "missing": []}
    assert _dead_counts(db) == (0, 0, 1)
    with LibsqlStore(db) as store:  # the live entry left alone
        assert [e.seq for e in store.pending_outbox()] == [2]


def test_discard_all_removes_every_dead_letter_status_counts(db: str) -> None:
    _corrupt_dead(db)
    assert _dead_counts(db) == (1, 1, 1)
    dry = cli("discard", "--all", "all", "--dry-run", "--url", db)
    assert dry.returncode == 0 and "would discard 3" in dry.stderr
    assert ok(cli("discard", "--all", "all", "--url", db)) == "discarded 3\n"
    assert _dead_counts(db) == (0, 0, 0)


def test_a_corrupt_dead_letter_is_not_revived_and_named(db: str) -> None:
    _corrupt_dead(db)
    result = cli("revive", "--outbox", "1", "--timer", "order-1", "placed.late", "--url", db)
    assert result.returncode == 1 and result.stdout == "revived 1\n"
    (line,) = result.stderr.splitlines()
    assert line.startswith("harel-store: not revived: outbox 1 (outbox entry 1 has a corrupt")
    assert line.endswith("discard it: harel-store discard --outbox 1")
    assert _dead_counts(db) == (1, 1, 0)
    result = cli("revive", "--all", "all", "--url", db)
    assert result.returncode == 1 and result.stdout == "revived 0\n"
    # (the store's log names each corrupt row it skipped, above the summary)
    assert result.stderr.splitlines()[-1] == (
        "harel-store: not revived: 2 dead letters with a corrupt stored record "
        "(discard them: harel-store discard --all all)"
    )
    assert _dead_counts(db) == (1, 1, 0)


def test_the_api_discards_a_corrupt_dead_letter_by_key_and_all(db: str) -> None:
    _corrupt_dead(db)
    with LibsqlStore(db) as store:
        with pytest.raises(StoreError, match="outbox entry 1 has a corrupt stored record"):
            store.dead_letter("outbox", 1)
        assert store.discard_dead_letter("outbox", 1) is True
        assert store.discard_dead_letter("outbox", 1) is False
        assert store.discard_dead_letter("outbox", 2) is False  # live: left alone
        assert store.discard_dead_letters(kind="timer") == 1
        assert store.discard_dead_letters(limit=1) == 1  # the corrupt spawn
        assert store.discard_dead_letters() == 0
        stats = store.stats(0.0)
        assert (stats.dead_outbox, stats.dead_spawns, stats.dead_timers) == (0, 0, 0)
        assert [e.seq for e in store.pending_outbox()] == [2]
