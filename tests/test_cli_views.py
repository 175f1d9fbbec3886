"""The operator's views: ls by time, the relay views, show in sections, status --check,
and the demo's suggestions (issue 11)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from harel_store import Event, LibsqlStore
from harel_store.sql import HEAD
from tests.test_cli import cli, failed, ok, seed

T0 = 1_780_000_000.0  # 2026-05-28T20:26:40Z


@pytest.fixture
def db(tmp_path: Path) -> str:
    database = str(tmp_path / "state.db")
    seed(database)
    return database


def _set_updated(db: str, times: dict[str, float]) -> None:
    with closing(sqlite3.connect(db)) as conn, conn:
        for eid, at in times.items():
            conn.execute("UPDATE harel_executions SET updated_at = ? WHERE id = ?", (at, eid))


def ids(db: str, *args: str) -> list[str]:
    out = ok(cli("ls", "--json", "--url", db, *args))
    return [json.loads(line)["id"] for line in out.splitlines()]


@pytest.mark.slow
def test_ls_by_time_newest_first_and_by_prefix(db: str) -> None:
    _set_updated(
        db,
        {
            "invoice-1": T0,
            "invoice-2": T0 + 60,
            "order-1": T0 + 120,
            "order-1.pay": T0 + 60,
            "order-1.ship": T0 + 180,
        },
    )
    assert ids(db, "--newest") == [
        "order-1.ship",
        "order-1",
        "order-1.pay",
        "invoice-2",
        "invoice-1",
    ]
    # --since inclusive, --until exclusive, ISO 8601 with Z or an offset, or no zone (UTC);
    # a time window is listed in update order, oldest first unless --newest
    assert ids(db, "--since", "2026-05-28T20:27:40Z") == [
        "invoice-2",
        "order-1.pay",
        "order-1",
        "order-1.ship",
    ]
    assert ids(db, "--since", "2026-05-28T20:27:40Z", "--until", "2026-05-28T22:29:40+02:00") == [
        "invoice-2",
        "order-1.pay",
        "order-1",
    ]
    assert ids(db, "--until", "2026-05-28T20:27:40") == ["invoice-1"]
    assert ids(db, "--status", "running", "--newest") == ["order-1.ship", "order-1"]
    assert ids(db, "--id-prefix", "order-1.") == ["order-1.pay", "order-1.ship"]
    assert ids(db, "--id-prefix", "order-1", "--newest", "--limit", "2") == [
        "order-1.ship",
        "order-1",
    ]
    table = ok(cli("ls", "--newest", "--url", db)).splitlines()
    assert "UPDATED" in table[0].split()
    assert "2026-05-28T20:29:40.000Z" in table[1]  # order-1.ship, ISO 8601 UTC
    # a duration back from now: everything above is months old, nothing is that recent
    assert ids(db, "--since", "1h") == []
    _set_updated(db, {"invoice-1": time.time() - 30})
    assert ids(db, "--since", "1h") == ["invoice-1"]


@pytest.mark.parametrize("bad", ["yesterday", "1y", "5 m", "2026-13-01", ""])
def test_ls_refuses_a_time_it_cannot_read(db: str, bad: str) -> None:
    assert "not a time" in failed(cli("ls", "--since", bad, "--url", db), 2)


def test_outbox_view(db: str) -> None:
    with LibsqlStore(db) as store:
        invoice = store.load("invoice-1")
        assert invoice is not None
        store.commit(invoice, [(None, Event(name="published", id="evt-pub"))])
        assert [e.seq for e in store.claim_outbox("relay-7", limit=1)] == [1]
    table = ok(cli("outbox", "--url", db)).splitlines()
    assert table[0].split() == [
        "SEQ", "AGE", "SOURCE", "TARGET", "EVENT", "CLAIMED", "BY", "TRIES", "LAST", "ERROR"
    ]  # fmt: skip
    assert table[1].split()[:5] == ["1", table[1].split()[1], "order-1", "order-1", "ping"]
    assert table[1].split()[-1] == "1"  # the claim's attempt
    assert "relay-7 (" in table[1] and "left)" in table[1]
    assert table[2].split()[2:5] == ["invoice-1", "(publish)", "published"]
    docs = [json.loads(line) for line in ok(cli("outbox", "--json", "--url", db)).splitlines()]
    assert [(d["seq"], d["source_id"], d["target_id"], d["claimed_by"]) for d in docs] == [
        (1, "order-1", "order-1", "relay-7"),
        (2, "invoice-1", None, None),
    ]
    assert docs[0]["event"]["id"] == "evt-ping" and docs[0]["created_at"] > T0

    def seqs(*args: str) -> list[int]:
        out = ok(cli("outbox", "--json", "--url", db, *args))
        return [json.loads(line)["seq"] for line in out.splitlines()]

    assert seqs("--target", "order-1") == [1]
    assert seqs("--source", "invoice-1") == [2]
    assert seqs("--source", "nobody") == []
    limited = cli("outbox", "--limit", "1", "--json", "--url", db)
    assert len(ok(limited).splitlines()) == 1 and "--limit" in limited.stderr


def test_timers_and_spawns_views(db: str) -> None:
    table = ok(cli("timers", "--url", db)).splitlines()
    assert table[0].split()[:4] == ["EXECUTION", "PATH", "FIRE", "AT"]
    assert [row.split()[1] for row in table[1:]] == ["placed.late", "placed.remind"]
    assert " ago" in table[1] and " in " in table[2]
    due = [
        json.loads(line) for line in ok(cli("timers", "--due", "--json", "--url", db)).splitlines()
    ]
    assert [(d["execution_id"], d["path"]) for d in due] == [("order-1", "placed.late")]
    spawns = ok(cli("spawns", "--url", db)).splitlines()
    assert spawns[0].split()[:4] == ["SEQ", "AGE", "PARENT", "CHILD"]
    assert spawns[1].split()[2:5] == ["order-1", "order-1.later", "later"]
    docs = ok(cli("spawns", "--parent", "order-1", "--json", "--url", db)).splitlines()
    assert [json.loads(line)["child_id"] for line in docs] == ["order-1.later"]
    empty = cli("spawns", "--parent", "invoice-1", "--url", db)
    assert ok(empty) == "" and "no pending spawns" in empty.stderr


def test_show_in_sections_and_as_json(db: str) -> None:
    text = ok(cli("show", "order-1", "--url", db))
    for line in (
        "execution order-1",
        "timers (2)",
        "pending outbox entries it emitted (1)",
        "pending outbox entries for it (1)",
        "pending spawns (1)",
        "children (2)",
    ):
        assert line in text.splitlines(), text
    assert "  status       running" in text and "  created      20" in text
    assert "placed.late" in text and "order-1.later" in text and "order-1.ship" in text
    doc = json.loads(ok(cli("show", "order-1", "--json", "--url", db)))
    assert doc["execution"]["id"] == "order-1" and doc["execution"]["version"] == 2
    assert [t["path"] for t in doc["timers"]] == ["placed.late", "placed.remind"]
    assert [e["event"]["id"] for e in doc["outbox"]] == ["evt-ping"]
    assert [e["seq"] for e in doc["emitted"]] == [1] and doc["emitted"][0]["source_id"] == "order-1"
    assert [s["child_id"] for s in doc["spawns"]] == ["order-1.later"]
    assert [c["id"] for c in doc["children"]] == ["order-1.pay", "order-1.ship"]
    assert doc["created_at"] <= doc["updated_at"]
    quiet = ok(cli("show", "invoice-1", "--url", db))
    assert "timers (0)" in quiet and "children (0)" in quiet


def test_status_shows_spawn_age_and_timer_lag(db: str) -> None:
    doc = json.loads(ok(cli("status", "--json", "--url", db)))
    assert 0 <= doc["oldest_spawn_age"] < 600
    assert 9 <= doc["timer_lag"] < 600  # seeded 10 s overdue
    text = ok(cli("status", "--url", db))
    assert "spawns      1 pending, oldest " in text
    assert "timers      1 due, most overdue by " in text


def test_status_check_passes_then_names_each_threshold_crossed(db: str) -> None:
    generous = ("--max-outbox-age", "1h", "--max-timer-lag", "1h", "--max-spawn-age", "1h")
    ok(cli("status", "--check", "--url", db))
    ok(cli("status", "--check", *generous, "--url", db))
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE harel_outbox SET created_at = created_at - 7200")
        conn.execute("UPDATE harel_spawns SET created_at = created_at - 7200")
    crossed = cli("status", "--check", *generous, "--url", db)
    assert crossed.returncode == 1 and "Traceback" not in crossed.stderr
    lines = crossed.stderr.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("harel-store: check failed: --max-outbox-age 1h 0m: ")
    assert lines[1].startswith("harel-store: check failed: --max-spawn-age 1h 0m: ")
    assert "outbox" in crossed.stdout  # the status itself is still printed
    lag = cli("status", "--max-timer-lag", "5s", "--json", "--url", db)  # implies --check
    assert lag.returncode == 1 and "--max-timer-lag 5.0s: the most overdue timer is" in lag.stderr
    assert json.loads(lag.stdout)["check"]["ok"] is False
    assert "not a duration" in failed(cli("status", "--max-timer-lag", "soon", "--url", db), 2)


def test_status_check_fails_on_a_schema_behind_ahead_or_drifted(tmp_path: Path) -> None:
    database = str(tmp_path / "s.db")
    ok(cli("migrate", "--to", "0004", "--url", database))
    line = failed(cli("status", "--check", "--url", database))
    assert f"schema: at revision 0004, behind head {HEAD}" in line
    ok(cli("migrate", "--url", database))
    ok(cli("status", "--check", "--url", database))
    with closing(sqlite3.connect(database)) as conn, conn:
        conn.execute("DROP INDEX harel_outbox_target")
    assert "schema drifted from head: " in failed(cli("status", "--check", "--url", database))
    with closing(sqlite3.connect(database)) as conn, conn:
        conn.execute("CREATE INDEX harel_outbox_target ON harel_outbox (target_id)")
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    assert f"at revision 9999, ahead of head {HEAD}" in failed(
        cli("status", "--check", "--url", database)
    )


VENV = Path(sys.executable).parent.parent  # this test run's venv (not resolved: a link)


@pytest.mark.parametrize(
    ("typed", "on_path", "program"),
    [
        # The quick start: the venv's script, not on the PATH (issue 36).
        (".venv/bin/harel-store demo", False, ".venv/bin/harel-store"),
        ("harel-store demo", True, "harel-store"),  # an activated venv
        ("python -m harel_store demo", True, "python -m harel_store"),
        (".venv/bin/python -m harel_store demo", False, None),  # this interpreter, by its path
    ],
)
def test_every_command_the_demo_suggests_runs_as_printed(
    tmp_path: Path, typed: str, on_path: bool, program: str | None
) -> None:
    """The demo run as a user types it, in a folder holding the venv; then each suggested
    line pasted into the same shell, with the same PATH."""
    (tmp_path / ".venv").symlink_to(VENV)
    bin_dir = str(VENV / "bin")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join([bin_dir, *path] if on_path else path)

    def shell(line: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )

    out = ok(shell(typed)).splitlines()
    start = next(i for i, line in enumerate(out) if "the demo's database is harel-demo.db" in line)
    suggested = [line.strip() for line in out[start + 1 :]]
    assert len(suggested) >= 5
    for line in suggested:
        result = shell(line)
        assert result.returncode == 0, (line, result.stderr)
        assert "error" not in result.stderr, (line, result.stderr)
    # As short as works: the script as typed, the bare name when it is on the PATH.
    expected = program or f"{tmp_path / '.venv' / 'bin' / 'python'} -m harel_store"
    assert all(line.startswith(f"{expected} ") for line in suggested), suggested
    assert "order-" in ok(cli("ls", "--newest", "--url", "harel-demo.db", cwd=tmp_path))
