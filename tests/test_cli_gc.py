"""``harel-store gc`` through the console script, in subprocesses as in tests/test_cli.py:
final trees, dedupe markers and dead letters by age, ``--dry-run``, ``--json``, ``--batch``,
progress on a terminal, usage errors; on a local file and on sqld (the token never shown).

Ages are made by moving stored times back with the database's own connection (never waited
on): ``updated_at`` of executions, ``recorded_at`` of markers (and the execution's
``markers_since`` with it, as the store keeps it), ``dead_at`` of dead letters.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, LibsqlStore
from tests.conftest import reset_remote
from tests.helpers import raw
from tests.sqld import SqldServer
from tests.test_cli import CLI, cli, failed, ok, seed
from tests.test_cli_dead import bury

DAY = 86400.0


def age(store: Any, days: float) -> None:
    """Move every stored time back by ``days``: executions, markers, dead letters."""
    conn = raw(store)
    back = days * DAY
    conn.execute("UPDATE harel_executions SET updated_at = updated_at - ?", (back,))
    conn.execute("UPDATE harel_processed_events SET recorded_at = recorded_at - ?", (back,))
    conn.execute("UPDATE harel_executions SET markers_since = markers_since - ?", (back,))
    for table in ("harel_outbox", "harel_spawns", "harel_timers"):
        conn.execute(f"UPDATE {table} SET dead_at = dead_at - ? WHERE dead_at IS NOT NULL", (back,))
    conn.commit()


def markers(store: Any) -> int:
    (n,) = raw(store).execute("SELECT count(*) FROM harel_processed_events").fetchone()
    return int(n)


@pytest.fixture
def db(tmp_path: Path) -> str:
    """tests/test_cli.py's seed (order-1 running with a finished and a running child,
    invoice-1 finished, invoice-2 failed), with a marker on invoice-1 and on order-1, its
    outbox entry, spawn and due timer made dead letters, everything 10 days old."""
    database = str(tmp_path / "state.db")
    seed(database)
    with LibsqlStore(database) as store:
        for eid in ("invoice-1", "order-1"):
            exe = store.load(eid)
            assert exe is not None
            store.commit(exe, [], processed_event_id=f"evt-{eid}")
        bury(store)
        age(store, 10)
    return database


def ids(database: str) -> list[str]:
    with LibsqlStore(database) as store:
        return [s.id for s in store.list_executions(limit=100).items]


def test_nothing_to_collect_and_bad_batches_are_usage_errors(db: str) -> None:
    assert "nothing to collect" in failed(cli("gc", "--url", db), 2)
    assert "must be at least 1" in failed(
        cli("gc", "--url", db, "--dead-older-than", "1d", "--batch", "0"), 2
    )
    line = failed(cli("gc", "--url", db, "--dead-older-than", "1d", "--batch", "10001"), 2)
    assert "at most 10000" in line
    assert "not a duration" in failed(cli("gc", "--url", db, "--finished-older-than", "soon"), 2)
    assert len(ids(db)) == 5  # nothing removed


@pytest.mark.parametrize(
    "flag", ["--finished-older-than", "--markers-older-than", "--dead-older-than"]
)
def test_an_age_without_a_unit_is_a_usage_error(db: str, flag: str) -> None:
    # "--markers-older-than 30" meant 30 seconds: every marker (these are 10 days old) gone.
    for bare in ("30", "0", "1.5"):
        line = failed(cli("gc", "--url", db, flag, bare), 2)
        assert "needs a unit" in line and repr(bare) in line, line
    assert len(ids(db)) == 5
    with LibsqlStore(db) as store:
        assert markers(store) == 2 and len(store.dead_letters()) == 3


def test_a_dry_run_counts_and_removes_nothing(db: str) -> None:
    out = ok(cli("gc", "--url", db, "--finished-older-than", "7d", "--markers-older-than", "7d",
                 "--dead-older-than", "7d", "--dry-run"))  # fmt: skip
    # invoice-1 and invoice-2 (order-1's tree is still running); their marker and order-1's;
    # the three dead letters.
    assert out == "would remove 2 executions, 2 markers, 3 dead letters\n"
    assert len(ids(db)) == 5
    younger = ok(cli("gc", "--url", db, "--finished-older-than", "11d", "--json", "--dry-run"))
    assert json.loads(younger) | {"seconds": 0} == {
        "executions": 0, "markers": 0, "dead_letters": 0, "dry_run": True, "seconds": 0
    }  # fmt: skip


def test_gc_removes_final_trees_markers_and_dead_letters_by_age(db: str) -> None:
    out = ok(cli("gc", "--url", db, "--finished-older-than", "7d", "--json"))
    assert json.loads(out)["executions"] == 2
    assert ids(db) == ["order-1", "order-1.pay", "order-1.ship"]  # a running tree stays whole
    with LibsqlStore(db) as store:
        assert markers(store) == 1 and len(store.dead_letters()) == 3
    # The default horizon (30 days) keeps a 10-day-old marker; 7 days does not.
    assert json.loads(ok(cli("gc", "--url", db, "--markers-older-than", "--json")))["markers"] == 0
    out = ok(cli("gc", "--url", db, "--markers-older-than", "7d", "--dead-older-than", "7d"))
    assert out.startswith("removed 1 marker, 3 dead letters in ")
    with LibsqlStore(db) as store:
        assert markers(store) == 0 and store.dead_letters() == []
        assert not store.is_processed("order-1", "evt-order-1")
        assert store.outbox_for("order-1") == []  # its entry was a dead letter, now gone
    # Once the tree's last execution ends and ages, the tree goes whole.
    with LibsqlStore(db) as store:
        ship = store.load("order-1.ship")
        root = store.load("order-1")
        assert ship is not None and root is not None
        ship.status = root.status = "finished"
        store.save(ship)
        store.save(root)
        store.commit(root, [(None, Event(name="done", id="evt-done"))])
        age(store, 10)
    out = ok(cli("gc", "--url", db, "--finished-older-than", "7d", "--batch", "1"))
    assert out.startswith("removed 3 executions in ")  # a tree larger than --batch, whole
    assert ids(db) == []


def test_progress_shows_on_a_terminal_only(db: str) -> None:
    import pty

    main_fd, child_fd = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    proc = subprocess.run(
        [str(CLI), "gc", "--url", db, "--finished-older-than", "7d", "--batch", "1"],
        stdout=subprocess.PIPE, stderr=child_fd, env=env, timeout=60, text=True,
    )  # fmt: skip
    os.close(child_fd)
    shown = b""
    try:
        while chunk := os.read(main_fd, 65536):
            shown += chunk
    except OSError:  # EIO once the terminal's writer is gone
        pass
    os.close(main_fd)
    assert proc.returncode == 0
    assert b"executions: 1 removed" in shown and b"executions: 2 removed" in shown
    assert proc.stdout.startswith("removed 2 executions")
    # into a pipe: the totals alone (order-1's tree still runs; its marker goes)
    piped = cli("gc", "--url", db, "--finished-older-than", "0s", "--markers-older-than", "0s")
    assert ok(piped).startswith("removed 0 executions, 1 marker in ") and piped.stderr == ""


def test_gc_on_a_remote_primary_never_shows_the_token(sqld: SqldServer, tmp_path: Path) -> None:
    reset_remote(sqld)
    seed(sqld.url, auth_token=sqld.token)
    env = {"HAREL_DATABASE_URL": sqld.url, "HAREL_AUTH_TOKEN": sqld.token}
    with LibsqlStore(sqld.url, auth_token=sqld.token) as store:
        age(store, 10)
    out = cli("gc", "--finished-older-than", "7d", "--markers-older-than", "--json", env=env)
    assert json.loads(ok(out))["executions"] == 2
    assert sqld.token not in out.stdout + out.stderr
    refused = cli("gc", "--dead-older-than", "1d", env={**env, "HAREL_AUTH_TOKEN": "wrong"})
    assert sqld.token not in failed(refused) and "wrong" not in refused.stderr
    with LibsqlStore(sqld.url, auth_token=sqld.token) as store:
        assert {s.id for s in store.list_executions().items} == {
            "order-1", "order-1.pay", "order-1.ship"
        }  # fmt: skip
