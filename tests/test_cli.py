"""The ``harel-store`` console script on a local file and on sqld: its ``main`` run in the
test's process as a process would run it (`cli`), and the script in processes of its own
where the process is what is tested (its entry point, version, pipes, a terminal)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import libsql
import pytest

import harel_store
from harel_store import HEAD, Event, Execution, LibsqlStore, SqliteStore, StoreError, TimerOp
from harel_store.cli import COMMANDS, main
from harel_store.models import Status
from harel_store.sql import MIGRATIONS, SQL_DIR
from tests.in_process import in_process
from tests.proxy import Proxy
from tests.sqld import SqldServer

CLI = Path(sys.executable).with_name("harel-store")
REPO = Path(__file__).resolve().parent.parent


def cli(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The console script run as ``subprocess.run([CLI, *args], ...)`` would run it, with
    this environment's $HAREL_* variables left out and ``env`` added, but its ``main`` in
    this process: see `tests.in_process`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HAREL_")}
    return in_process(main, [str(CLI), *args], cwd=cwd, env={**base, **(env or {})})


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stdout, result.stdout  # no colour into a pipe
    return result.stdout


def failed(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    """The one line a failure prints on stderr (never a traceback)."""
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def seed(database: str, *, auth_token: str = "", now: float | None = None) -> None:
    """A parent with two children (one running), a finished and a failed root, a pending
    outbox entry and spawn, one due and one future timer, and two trace steps."""
    now = time.time() if now is None else now
    with LibsqlStore(database, auth_token=auth_token) as s:
        root = Execution(id="order-1", definition_id="order", active_path="placed")
        s.save(root)
        s.commit(
            root,
            [("order-1", Event(name="ping", id="evt-ping"))],
            timers=(
                TimerOp.schedule("placed.late", now - 10),
                TimerOp.schedule("placed.remind", now + 3600),
            ),
            spawns=(("order-1.later", "later", {}),),
            trace={"event": "place", "transition": "new -> placed", "at": now - 2.5},
        )
        s.append_trace("order-1", {"event": "pay", "transition": "placed -> paid", "at": now})
        children: list[tuple[str, Status]] = [
            ("order-1.pay", "finished"),
            ("order-1.ship", "running"),
        ]
        for cid, status in children:
            s.save(Execution(id=cid, definition_id="order", parent_id="order-1", status=status))
        s.save(Execution(id="invoice-1", definition_id="invoice", status="finished"))
        s.save(Execution(id="invoice-2", definition_id="invoice", status="failed"))


@pytest.fixture
def db(tmp_path: Path) -> str:
    database = str(tmp_path / "state.db")
    seed(database)
    return database


# --- local file ---


def test_help_everywhere_has_examples() -> None:
    top = ok(cli("--help"))
    assert "examples:" in top and "HAREL_AUTH_TOKEN" in top
    for name, *_ in COMMANDS:
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert failed(cli(), 2).startswith("harel-store: error:")
    assert "invalid choice: 'paused'" in failed(cli("ls", "--status", "paused"), 2)
    assert "must be at least 1" in failed(cli("ls", "--limit", "0"), 2)
    assert "--version" in failed(cli("purge", "x", "--version", "seven"), 2)
    long_id = "x" * 600
    assert "1 to 512 characters" in failed(cli("show", long_id, "--url", _migrated(tmp_path)), 2)


def _migrated(tmp_path: Path) -> str:
    database = str(tmp_path / "migrated.db")
    ok(cli("migrate", "--url", database, cwd=tmp_path))
    return database


def test_migrate_outside_the_repository_then_status(tmp_path: Path) -> None:
    result = cli("migrate", cwd=tmp_path, env={"HAREL_DATABASE_URL": "fresh.db"})
    assert ok(result) == f"fresh.db: schema at revision {HEAD} (head {HEAD})\n"
    assert f"Running upgrade  -> {MIGRATIONS[0].revision}" in result.stderr
    with closing(sqlite3.connect(tmp_path / "fresh.db")) as conn, conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]
    status = json.loads(ok(cli("status", "--json", "--url", str(tmp_path / "fresh.db"))))
    assert status["schema_revision"] == status["head"] == HEAD
    assert status["executions"] == {"running": 0, "finished": 0, "failed": 0, "cancelled": 0}


def test_migrate_sql_prints_the_script_and_touches_nothing(tmp_path: Path) -> None:
    script = ok(cli("migrate", "--sql", "--url", "never.db", cwd=tmp_path))
    assert "CREATE TABLE harel_executions" in script and "COMMIT;" in script
    assert not (tmp_path / "never.db").exists()


@pytest.mark.slow
def test_a_schema_behind_head_is_one_line_telling_to_migrate(tmp_path: Path) -> None:
    database = _migrated(tmp_path)
    old = MIGRATIONS[-2].revision if len(MIGRATIONS) > 1 else "base"
    assert f"revision {old}" in ok(cli("migrate", "--to", old, "--url", database))
    for command in (("status",), ("ls",), ("show", "x"), ("trace", "x"), ("purge", "x")):
        assert "harel-store migrate" in failed(cli(*command, "--url", database))
    drift = cli("schema", "--check", "--url", database)
    assert f"head is {HEAD}" in failed(drift)
    assert "is behind: its schema matches revision" in failed(drift) and drift.stdout == ""
    ok(cli("migrate", "--url", database))
    assert "matches head" in ok(cli("schema", "--check", "--url", database))


def test_a_missing_file_is_an_error_not_a_new_database(tmp_path: Path) -> None:
    missing = tmp_path / "nope.db"
    for command in (("status",), ("ls",), ("schema", "--check")):
        assert "does not exist" in failed(cli(*command, "--url", str(missing)))
    assert not missing.exists()
    assert "does not exist" in failed(cli("status", cwd=tmp_path))  # the default, harel.db
    assert not (tmp_path / "harel.db").exists()


def test_status_counts(db: str) -> None:
    status = json.loads(ok(cli("status", "--json", "--url", db)))
    assert status["executions"] == {"running": 2, "finished": 2, "failed": 1, "cancelled": 0}
    assert (status["pending_outbox"], status["pending_spawns"]) == (1, 1)
    assert (status["timers_due"], status["timers_future"]) == (1, 1)
    assert 0 <= status["oldest_outbox_age"] < 3600
    text = ok(cli("status", "--url", db))
    assert "5 total: running 2, finished 2, failed 1, cancelled 0" in text
    assert "1 pending, oldest " in text and "1 due, most overdue by 1" in text
    assert ", 1 future" in text
    assert "claimed" not in text
    assert (status["claimed_outbox"], status["claimed_spawns"], status["claimed_timers"]) == (
        0,
    ) * 3


def test_status_counts_what_workers_hold(db: str) -> None:
    with LibsqlStore(db) as store:
        assert len(store.claim_outbox("w1")) == 1
        assert len(store.claim_due_timers("w1", time.time())) == 1
    status = json.loads(ok(cli("status", "--json", "--url", db)))
    assert (status["claimed_outbox"], status["claimed_spawns"], status["claimed_timers"]) == (
        1,
        0,
        1,
    )
    text = ok(cli("status", "--url", db))
    assert "outbox      1 pending, oldest " in text and "(1 claimed by a worker)" in text
    assert "spawns      1 pending, oldest " in text and text.count("claimed by a worker") == 2


def test_status_says_unknown_for_an_outbox_entry_without_a_time(db: str) -> None:
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE harel_outbox SET created_at = NULL")
    assert "1 pending, oldest unknown" in ok(cli("status", "--url", db))


def test_ls_filters_and_json(db: str) -> None:
    table = ok(cli("ls", "--url", db)).splitlines()
    assert table[0].split()[:4] == ["ID", "DEFINITION", "VERSION", "STATUS"]
    assert [row.split()[0] for row in table[1:]] == [
        "invoice-1",
        "invoice-2",
        "order-1",
        "order-1.pay",
        "order-1.ship",
    ]

    def ids(*args: str) -> list[str]:
        return [json.loads(ln)["id"] for ln in ok(cli("ls", "--json", "--url", db, *args)).split()]

    assert ids("--status", "running") == ["order-1", "order-1.ship"]
    assert ids("--status", "failed", "--status", "finished") == [
        "invoice-1",
        "invoice-2",
        "order-1.pay",
    ]
    assert ids("--roots", "--definition", "order") == ["order-1"]
    assert ids("--definition", "nothing") == []
    limited = cli("ls", "--json", "--limit", "2", "--url", db)
    assert len(ok(limited).splitlines()) == 2
    assert "more match" in limited.stderr


def test_ls_all_pages_with_the_cursor_and_pipes_cleanly(tmp_path: Path) -> None:
    database = str(tmp_path / "many.db")
    with LibsqlStore(database, synchronous="OFF") as s:
        for i in range(1234):
            s.save(Execution(id=f"e-{i:05d}", definition_id="bulk"))
    lines = ok(cli("ls", "--all", "--json", "--url", database)).splitlines()
    assert [json.loads(ln)["id"] for ln in lines] == [f"e-{i:05d}" for i in range(1234)]
    table = ok(cli("ls", "--all", "--url", database)).splitlines()
    assert len(table) == 1235
    head = subprocess.run(
        f"'{CLI}' ls --all --url '{database}' | head -n 1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert head.stdout.split()[0] == "ID" and head.stderr == ""


def test_show(db: str) -> None:
    doc = json.loads(ok(cli("show", "order-1", "--json", "--url", db)))
    assert doc["execution"]["id"] == "order-1" and doc["execution"]["version"] == 2
    assert [t["path"] for t in doc["timers"]] == ["placed.late", "placed.remind"]
    assert [e["event"]["id"] for e in doc["outbox"]] == ["evt-ping"]
    assert [c["id"] for c in doc["children"]] == ["order-1.pay", "order-1.ship"]
    assert "no execution 'ghost'" in failed(cli("show", "ghost", "--url", db))


def test_trace(db: str) -> None:
    lines = ok(cli("trace", "order-1", "--url", db)).splitlines()
    assert [ln.split()[0] for ln in lines] == ["0", "1"]
    assert "+0.000s" in lines[0] and "+2.500s" in lines[1]
    assert "new -> placed" in lines[0] and "placed -> paid" in lines[1]
    steps = [
        json.loads(ln)
        for ln in ok(cli("trace", "order-1", "--json", "--url", db)).split("\n")
        if ln
    ]
    assert [(s["index"], s["event"]) for s in steps] == [(0, "place"), (1, "pay")]
    assert all(isinstance(s["recorded_at"], float) for s in steps)
    assert "no execution 'ghost'" in failed(cli("trace", "ghost", "--url", db))


def test_trace_shows_when_a_step_without_its_own_time_was_recorded(tmp_path: Path) -> None:
    db = str(tmp_path / "t.db")
    with LibsqlStore(db) as s:
        s.append_trace("e", {"event": "go"})
        (step,) = s.trace_view("e")
    assert step.recorded_at is not None
    (line,) = ok(cli("trace", "e", "--url", db)).splitlines()
    stamp = time.strftime("%Y-%m-%dT%H:%M", time.gmtime(step.recorded_at))
    assert line.split()[:4] == ["0", line.split()[1], "+0.000s", "go"]
    assert line.split()[1].startswith(stamp), line


def test_purge_one_and_a_tree(db: str) -> None:
    assert "pass --version 1" in failed(cli("purge", "order-1.ship", "--url", db))
    assert "at version 1, not 5" in failed(cli("purge", "invoice-1", "--version", "5", "--url", db))
    assert ok(cli("purge", "invoice-1", "--url", db)) == "purged invoice-1 (version 1)\n"
    refused = failed(cli("purge", "order-1", "--tree", "--url", db))
    assert "still running (order-1, order-1.ship)" in refused
    with LibsqlStore(db) as s:
        assert len(s.list_executions().items) == 4  # nothing was deleted
        for eid in ("order-1", "order-1.ship"):
            exe = s.load(eid)
            assert exe is not None
            exe.status = "cancelled"
            s.save(exe)
    purged = ok(cli("purge", "order-1", "--tree", "--url", db))
    assert purged == "purged 3 executions: order-1, order-1.pay, order-1.ship\n"
    with LibsqlStore(db) as s:
        assert [e.id for e in s.list_executions().items] == ["invoice-2"]
        assert s.pending_outbox() == [] and s.pending_spawns() == []
        assert s.due_timers(time.time() + 7200) == [] and s.read_trace("order-1") == []


def test_purge_of_a_parent_names_its_children_and_needs_tree_or_orphan(tmp_path: Path) -> None:
    db = str(tmp_path / "p.db")
    with LibsqlStore(db) as s:
        s.save(Execution(id="p", definition_id="d", status="finished"))
        for i in range(5):
            s.save(Execution(id=f"p.{i}", definition_id="d", parent_id="p", status="finished"))
    refused = failed(cli("purge", "p", "--url", db))
    assert "p has 5 child executions (p.0, p.1, p.2 and 2 more): pass --tree" in refused
    assert "not allowed with argument" in failed(
        cli("purge", "p", "--tree", "--orphan", "--url", db), 2
    )
    with LibsqlStore(db) as s:
        assert len(s.list_executions().items) == 6  # nothing was deleted
    assert ok(cli("purge", "p", "--orphan", "--url", db)) == "purged p (version 1)\n"
    with LibsqlStore(db) as s:
        assert [c.parent_id for c in s.children_of("p")] == ["p"] * 5
        assert s.load("p") is None
    assert ok(cli("purge", "p.0", "--url", db)) == "purged p.0 (version 1)\n"


def test_schema_check_says_behind_or_unknown_before_drifted(tmp_path: Path) -> None:
    db = str(tmp_path / "b.db")
    behind = MIGRATIONS[-2].revision
    ok(cli("migrate", "--to", behind, "--url", db))
    line = failed(cli("schema", "--check", "--url", db))
    assert line == (
        f"harel-store: error: {db} is behind: its schema matches revision {behind}, head is"
        f" {HEAD}: run `harel-store migrate --url {db}`"
    )
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("DROP INDEX harel_timers_fire_at")
    result = cli("schema", "--check", "--url", db)
    assert f"drifted from the schema of revision {behind} (behind head {HEAD}) (1 differences)" in (
        failed(result)
    )
    assert result.stdout.startswith("harel_timers: index harel_timers_fire_at")
    assert result.stdout.rstrip().endswith("missing from database"), result.stdout
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    assert "revision '9999', which this version of harel-store does not know" in failed(
        cli("schema", "--check", "--url", db)
    )
    empty = str(tmp_path / "e.db")
    with closing(sqlite3.connect(empty)) as conn, conn:
        conn.execute("CREATE TABLE t (x)")
    assert f"{empty} has no harel-store schema: run `harel-store migrate --url {empty}`" in (
        failed(cli("schema", "--check", "--url", empty))
    )


def test_schema_prints_head_and_check_catches_drift(db: str) -> None:
    assert ok(cli("schema")) == (SQL_DIR / "schema.sql").read_text(encoding="utf-8")
    assert (
        ok(cli("schema", "--check", "--url", db))
        == f"{db}: schema matches head (revision {HEAD})\n"
    )
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("ALTER TABLE harel_timers ADD COLUMN note TEXT NOT NULL DEFAULT ''")
        conn.execute("DROP INDEX harel_timers_fire_at")
        conn.execute(
            "CREATE UNIQUE INDEX harel_outbox_target2 ON harel_outbox (target_id) WHERE seq > 0"
        )
    result = cli("schema", "--check", "--url", db)
    assert "drifted from the schema of head (3 differences)" in failed(result)
    assert result.stdout.splitlines() == [
        "harel_outbox: index harel_outbox_target2 UNIQUE (target_id) WHERE seq > 0 in database, "
        "not in head",
        "harel_timers: column note TEXT NOT NULL DEFAULT '' in database, not in head",
        "harel_timers: index harel_timers_fire_at (fire_at, execution_id, path, dead_at) "
        "WHERE dead_at IS NULL missing from database",
    ]


def test_the_operator_guide_shows_what_schema_check_prints(db: str) -> None:
    guide = (REPO / "docs" / "how-to" / "operate.md").read_text(encoding="utf-8")
    shown = re.search(r"primary is checked\):\n\n```text\n(.*?)```", guide, re.S)
    assert shown is not None
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("ALTER TABLE harel_timers ADD COLUMN note TEXT")
        conn.execute("DROP INDEX harel_timers_fire_at")
    result = cli("schema", "--check", "--url", db)
    assert "(2 differences)" in failed(result)
    assert result.stdout == shown[1]


def test_the_demo_still_runs_with_no_arguments(tmp_path: Path) -> None:
    out = ok(cli("demo", cwd=tmp_path))
    assert "trace of order-" in out and (tmp_path / "harel-demo.db").exists()


# --- the wheel ---


def test_the_wheel_carries_sql_and_migrations_and_migrates_outside_the_repo(
    tmp_path: Path,
) -> None:
    from hatchling.build import build_wheel

    cwd = Path.cwd()
    try:
        os.chdir(REPO)
        wheel = tmp_path / build_wheel(str(tmp_path / "dist"))
    finally:
        os.chdir(cwd)
    wheel = tmp_path / "dist" / wheel.name
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
        zf.extractall(tmp_path / "site")
    assert "harel-store = harel_store.cli:main" in entry_points
    expected = {"harel_store/sql/queries.sql", "harel_store/sql/schema.sql"}
    expected |= {"harel_store/migrations/env.py", "harel_store/migrations/script.py.mako"}
    for m in MIGRATIONS:
        expected |= {f"harel_store/sql/migrations/{m.name}.{d}.sql" for d in ("up", "down")}
        expected.add(f"harel_store/migrations/versions/{m.name}.py")
    expected |= {"harel_store/py.typed", "harel_store/__main__.py"}
    assert expected <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    env.pop("HAREL_DATABASE_URL", None)
    run = subprocess.run(
        [sys.executable, "-c", "import harel_store.cli, sys; sys.argv[0] = 'harel-store';"
         " print(harel_store.cli.__file__); sys.exit(harel_store.cli.main())", "migrate",
         "--url", "w.db"],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith(str(tmp_path / "site"))
    with closing(sqlite3.connect(work / "w.db")) as conn, conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]

    # python -m harel_store, and --version from the package's own __version__
    version = subprocess.run(
        [sys.executable, "-m", "harel_store", "--version"],
        capture_output=True, text=True, cwd=work, env=env, timeout=60, check=True,
    )  # fmt: skip
    assert version.stdout.split() == ["harel-store", harel_store.__version__]

    # Plain Alembic from the installed wheel, with the minimal ini of docs/how-to/operate.md
    # (no logging sections: env.py used to fail on them with KeyError 'formatters').
    (work / "alembic.ini").write_text("[alembic]\nscript_location = harel_store:migrations\n")
    alembic = subprocess.run(
        [sys.executable, "-m", "alembic", "-x", "url=a.db", "upgrade", "head"],
        capture_output=True, text=True, cwd=work, env=env, timeout=120,
    )  # fmt: skip
    assert alembic.returncode == 0, alembic.stderr
    with closing(sqlite3.connect(work / "a.db")) as conn, conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]


# --- a real libSQL server ---


@pytest.fixture(scope="module")
def sqld() -> Iterator[SqldServer]:
    """A server of this module's own (not conftest's session one): these tests start from an
    empty database, migrate it with the CLI, and alter its schema by hand."""
    with SqldServer(auth=True) as server:
        yield server


@pytest.mark.slow
@pytest.mark.sqld
def test_against_sqld_with_a_token_from_the_environment(sqld: SqldServer, tmp_path: Path) -> None:
    env = {"HAREL_DATABASE_URL": sqld.url, "HAREL_AUTH_TOKEN": sqld.token}
    assert "harel-store migrate" in failed(cli("status", env=env))  # an empty server
    ok(cli("migrate", env=env, cwd=tmp_path))
    seed(sqld.url, auth_token=sqld.token)
    status = json.loads(ok(cli("status", "--json", env=env)))
    assert status["executions"]["running"] == 2 and status["pending_outbox"] == 1
    assert "order-1.ship" in ok(cli("ls", "--status", "running", env=env))
    assert (
        json.loads(ok(cli("show", "order-1", "--json", env=env)))["children"][0]["id"]
        == "order-1.pay"
    )
    assert "placed -> paid" in ok(cli("trace", "order-1", env=env))
    assert ok(cli("purge", "invoice-1", env=env)) == "purged invoice-1 (version 1)\n"
    replica = ["--url", str(tmp_path / "replica.db"), "--sync-url", sqld.url]
    assert "invoice-1" not in ok(cli("ls", *replica, env=env))
    assert "invoice-2" in ok(cli("ls", *replica, env=env))

    assert "matches head" in ok(cli("schema", "--check", env=env))
    conn = libsql.connect(sqld.url, auth_token=sqld.token)
    conn.execute("CREATE INDEX harel_trace_entry ON harel_trace (entry)")
    conn.commit()
    result = cli("schema", "--check", env=env)
    assert "(1 differences)" in failed(result)
    assert result.stdout == (
        "harel_trace: index harel_trace_entry (entry) in database, not in head\n"
    )
    conn.execute("DROP INDEX harel_trace_entry")
    conn.commit()
    conn.close()


@pytest.mark.sqld
def test_a_refused_token_is_one_line_without_the_token(sqld: SqldServer) -> None:
    wrong = sqld.foreign_token()
    for command in (("status",), ("ls",), ("schema", "--check"), ("migrate",)):
        result = cli(*command, env={"HAREL_DATABASE_URL": sqld.url, "HAREL_AUTH_TOKEN": wrong})
        line = failed(result)
        assert wrong not in result.stdout + result.stderr
        assert "401" in line or "auth" in line.lower(), line


def test_migrate_refuses_a_timeout_of_nothing(tmp_path: Path) -> None:
    """--timeout 0 once fell back to $HAREL_TIMEOUT or 30 s unsaid (0 is falsy)."""
    db = str(tmp_path / "t.db")
    for given in ("0", "0s", "-5"):
        line = failed(cli("migrate", "--url", db, "--timeout", given), 2)
        assert "timeout" in line and ("more than 0" in line or "not a duration" in line), line
    assert not Path(db).exists()
    assert HEAD in ok(cli("migrate", "--url", db, "--timeout", "1m"))


@pytest.mark.sqld
def test_migrate_against_a_server_gone_silent_ends_within_its_timeout(sqld: SqldServer) -> None:
    """Our own revision checks pass; then the server stops answering the libsql driver
    Alembic runs on (which has no timeout, and holds the GIL while it waits)."""
    with Proxy(sqld.port or 0) as proxy:
        proxy.hang_on = b"x-libsql-client-version"  # the driver's requests, not ours
        env = {"HAREL_DATABASE_URL": proxy.url(), "HAREL_AUTH_TOKEN": sqld.token}
        started = time.monotonic()
        result = cli("migrate", "--timeout", "3", env=env)
        assert time.monotonic() - started < 60
    assert result.returncode != 0
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0] == (
        f"harel-store: error: {proxy.url()} did not answer within 3 s: the migration was stopped,"
        " nothing of it committed (a longer bound: HAREL_TIMEOUT=SECONDS)"
    )
    assert sqld.token not in result.stdout + result.stderr


def test_colour_only_on_a_terminal(db: str) -> None:
    out = _on_a_terminal("ls", "--url", db, env={})
    assert b"\x1b[32mfinished" in out and b"\x1b[33mrunning" in out
    assert "\x1b[" not in ok(cli("ls", "--url", db))


def test_describe_and_diff_see_through_layout_but_not_meaning() -> None:
    from harel_store.schema import describe, diff

    def schema(sql: str) -> dict[str, dict[str, object]]:
        with closing(sqlite3.connect(":memory:")) as conn:
            conn.executescript(sql)
            return describe(conn)

    base = schema(
        "CREATE TABLE t (a TEXT NOT NULL, b int);\nCREATE INDEX t_b ON t (b) WHERE b > 0;"
    )
    assert (
        diff(
            base,
            schema(
                "create table t (a text not null,\n  b INT);"
                "create index t_b on t(b)\n  where b > 0;"
            ),
        )
        == []
    )
    assert diff(
        base,
        schema("CREATE TABLE t (b INT, a TEXT NOT NULL); CREATE INDEX t_b ON t (b) WHERE b > 1;"),
    ) == [
        "t: column order is a, b in head, b, a in database",
        "t: index t_b is (b) WHERE b > 0 in head, (b) WHERE b > 1 in database",
    ]
    assert diff(base, schema("CREATE TABLE t (a TEXT, b INT); CREATE INDEX t_b ON t (b);")) == [
        "t: column a is a TEXT NOT NULL in head, a TEXT in database",
        "t: index t_b is (b) WHERE b > 0 in head, (b) in database",
    ]
    keyed = "CREATE TABLE k (a TEXT NOT NULL, b INT, PRIMARY KEY (a))"
    assert diff(schema(f"{keyed} WITHOUT ROWID;"), schema(f"{keyed};")) == [
        "k: a WITHOUT ROWID table in head, a rowid table in database"
    ]
    assert diff(schema(f"{keyed} WITHOUT ROWID;"), schema(f"{keyed}\n  without\n rowid;")) == []


# --- hardening (issue 10) ---

# What a terminal acts on: C0 (but the newlines and tabs of the output itself), DEL, C1.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def test_a_time_out_of_datetime_range_is_printed_as_its_number(db: str) -> None:
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE harel_executions SET finished_at = 1.7e15 WHERE id = 'invoice-1'")
        conn.execute("UPDATE harel_timers SET fire_at = 1e308 WHERE path = 'placed.remind'")
        conn.execute("UPDATE harel_trace SET entry = json_set(entry, '$.at', 1.7e15) WHERE idx = 1")
    table = ok(cli("ls", "--url", db)).splitlines()
    assert next(row for row in table if row.startswith("invoice-1")).endswith("1700000000000000.0")
    timers = json.loads(ok(cli("show", "order-1", "--json", "--url", db)))["timers"]
    assert timers[1] == {"path": "placed.remind", "fire_at": 1e308, "fire_at_utc": "1e+308"}
    lines = ok(cli("trace", "order-1", "--url", db)).splitlines()
    assert "+0.000s" in lines[0] and "1700000000000000.0" in lines[1]


def test_a_corrupt_row_is_purged_unread_with_its_version(db: str) -> None:
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE harel_executions SET data = 'not json' WHERE id = 'invoice-1'")
        conn.execute("UPDATE harel_executions SET data = '{\"id\": 1}' WHERE id = 'order-1.pay'")
    line = failed(cli("purge", "invoice-1", "--url", db))
    assert "corrupt" in line and "--version" in line and "validation error" not in line
    assert "not at version 5" in failed(cli("purge", "invoice-1", "--version", "5", "--url", db))
    assert "no execution 'ghost'" in failed(cli("purge", "ghost", "--version", "1", "--url", db))
    purged = ok(cli("purge", "invoice-1", "--version", "1", "--url", db))
    assert purged == "purged invoice-1 (version 1)\n"
    tree = ok(cli("purge", "order-1.pay", "--tree", "--version", "1", "--url", db))
    assert tree == "purged 1 execution: order-1.pay\n"  # one: singular (issue 36)
    with LibsqlStore(db) as s:
        assert [e.id for e in s.list_executions().items] == ["invoice-2", "order-1", "order-1.ship"]


def test_migrate_into_a_missing_directory_is_a_failure_not_a_usage_error(tmp_path: Path) -> None:
    assert "missing-dir" in failed(cli("migrate", "--url", str(tmp_path / "missing-dir" / "x.db")))


def test_migrate_to_an_unknown_revision_names_the_known_ones(tmp_path: Path) -> None:
    for target in ("", "zz"):
        line = failed(cli("migrate", "--to", target, "--url", "x.db", cwd=tmp_path), 2)
        assert all(rev in line for rev in ("base", "head", *(m.revision for m in MIGRATIONS)))
    assert not (tmp_path / "x.db").exists()


def test_trace_json_escapes_a_lone_surrogate(db: str) -> None:
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE harel_trace SET entry = ? WHERE idx = 1", ('{"k":"\\ud800"}',))
    lines = ok(cli("trace", "order-1", "--json", "--url", db)).splitlines()
    step = json.loads(lines[1])
    assert (step["k"], step["index"], type(step["recorded_at"])) == ("\ud800", 1, float)
    assert '{"k":"\\ud800"}' in ok(cli("trace", "order-1", "--url", db))


@pytest.mark.slow
def test_control_characters_in_stored_strings_reach_no_terminal(tmp_path: Path) -> None:
    database = _migrated(tmp_path)
    nasty = "\x1b[31mred\x07\r\x7f\x9b"
    shown = "\\x1b[31mred\\x07\\r\\x7f\\x9b"
    with LibsqlStore(database) as s:
        s.save(Execution(id=nasty, definition_id=nasty, active_path=nasty, status="finished"))
        s.save(Execution(id=f"{nasty}.child", definition_id="d", parent_id=nasty, status="failed"))
        s.append_trace(nasty, {"event": nasty, "transition": nasty, "note": nasty})
        exe = s.load(nasty)
        assert exe is not None
        s.commit(
            exe,
            [(nasty, Event(name=nasty))],
            timers=(TimerOp.schedule(nasty, time.time() + 60),),
            spawns=((f"{nasty}.spawned", nasty, {}),),
        )
        assert s.claim_outbox(nasty)
    with closing(sqlite3.connect(database)) as conn, conn:
        conn.execute(
            "UPDATE harel_executions SET status = ? WHERE id = ?", (nasty, f"{nasty}.child")
        )
    outputs = {
        "ls": cli("ls", "--url", database),
        "status": cli("status", "--url", database),
        "trace": cli("trace", nasty, "--url", database),
        "show": cli("show", nasty, "--json", "--url", database),
        "show text": cli("show", nasty, "--url", database),
        "outbox": cli("outbox", "--url", database),
        "spawns": cli("spawns", "--url", database),
        "timers": cli("timers", "--url", database),
        "ls --json": cli("ls", "--json", "--url", database),
        "status --json": cli("status", "--json", "--url", database),
        "trace --json": cli("trace", nasty, "--json", "--url", database),
        "missing": cli("trace", f"{nasty}.gone", "--url", database),
    }
    for name, result in outputs.items():
        assert not CONTROL.search(result.stdout + result.stderr), (name, result)
    assert ok(outputs["ls"]).splitlines()[1].split()[:2] == [shown, shown]
    assert f"running 0, finished 1, failed 0, cancelled 0, {shown} 1" in ok(outputs["status"])
    timeline = ok(outputs["trace"])
    assert timeline.count(shown) == 2 and '"\\u001b[31mred\\u0007\\r\\u007f\\u009b"' in timeline
    assert json.loads(ok(outputs["show"]))["execution"]["active_path"] == nasty
    assert f"execution {shown}" in ok(outputs["show text"])
    assert [json.loads(ln)["id"] for ln in ok(outputs["ls --json"]).splitlines()] == [
        nasty,
        f"{nasty}.child",
    ]
    assert json.loads(ok(outputs["status --json"]))["executions"][nasty] == 1
    assert json.loads(ok(outputs["trace --json"]))["note"] == nasty
    assert shown in failed(outputs["missing"])
    purged = cli("purge", nasty, "--tree", "--url", database)
    assert ok(purged) == f"purged 2 executions: {shown}, {shown}.child\n"


def _on_a_terminal(*args: str, env: dict[str, str]) -> bytes:
    """What the command writes to stdout when stdout is a terminal."""
    import pty

    main_fd, child_fd = pty.openpty()
    base = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    proc = subprocess.run(
        [str(CLI), *args], stdout=child_fd, stderr=subprocess.PIPE, env={**base, **env}, timeout=60
    )
    os.close(child_fd)
    out = b""
    with contextlib.suppress(OSError):  # EIO once the terminal's writer is gone
        while chunk := os.read(main_fd, 65536):
            out += chunk
    os.close(main_fd)
    assert proc.returncode == 0, proc.stderr
    return out


def test_an_empty_no_color_is_not_set(db: str) -> None:
    assert b"\x1b[32mfinished" in _on_a_terminal("ls", "--url", db, env={"NO_COLOR": ""})
    assert b"\x1b[" not in _on_a_terminal("ls", "--url", db, env={"NO_COLOR": "1"})


@pytest.mark.slow
def test_no_secret_of_a_url_is_printed(tmp_path: Path) -> None:
    remote = "http://user:SECRET@127.0.0.1:1/?authToken=SECRET"  # nothing listens on port 1
    missing = str(tmp_path / "missing.db")
    wheres = [
        ["--url", remote],
        ["--url", remote.replace("http", "libsql", 1)],
        ["--url", missing, "--sync-url", remote],
        ["--url", "sqlite+libsql://user:SECRET@127.0.0.1:1/?authToken=SECRET"],
        ["--url", f"{missing}?authToken=SECRET"],
    ]
    commands = [["status"], ["ls"], ["show", "x"], ["trace", "x"], ["purge", "x"]]
    commands += [["schema", "--check"], ["migrate"]]
    for where in wheres:
        for command in commands:
            result = cli(*command, *where, cwd=tmp_path)
            assert result.returncode in (1, 2) and len(result.stderr.splitlines()) == 1, result
            assert "SECRET" not in result.stdout + result.stderr, (command, where, result.stderr)
    # Alembic would read "?authToken=..." as options and migrate missing.db; the store would
    # open a file of the whole name: a path with a token in it is refused.
    line = failed(cli("migrate", "--url", f"{missing}?authToken=SECRET"), 2)
    assert "an authToken means nothing to it" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("token", ["sekret-token-123\n", "sekret\r\ntoken-123", "sekret%00x"])
def test_a_token_that_cannot_be_a_header_is_refused_and_never_printed(
    token: str, tmp_path: Path
) -> None:
    if "%" in token:  # no environment variable or argument holds a NUL: a URL's %00 does
        result = cli("status", "--url", f"http://127.0.0.1:9?authToken={token}", cwd=tmp_path)
    else:
        env = {"HAREL_AUTH_TOKEN": token}
        result = cli("status", "--url", "http://127.0.0.1:9", cwd=tmp_path, env=env)
    line = failed(result, 2)
    assert "Authorization" in line
    assert "sekret" not in result.stdout + result.stderr


def test_a_file_that_cannot_be_opened_is_named_with_its_cause(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "x.db"
    junk = tmp_path / "junk.db"
    junk.write_text("not a database, " * 200)
    causes = {missing: "the file cannot be opened or created", junk: "it is not a SQLite database"}
    for path, cause in causes.items():
        for command in (("migrate",), ("status",))[: 1 if path == missing else 2]:
            line = failed(cli(*command, "--url", str(path), cwd=tmp_path))
            assert line.startswith(f"harel-store: error: cannot open {path}: {cause}"), line
        for opener in (LibsqlStore, SqliteStore):
            with pytest.raises(StoreError, match=f"^cannot open {re.escape(str(path))}: {cause}"):
                opener(path)
    assert not missing.parent.exists()


def test_a_corrupt_summary_is_one_line_and_exit_1(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    with LibsqlStore(db) as store:
        store.save(Execution(id="kid", definition_id="d"))
    raw = sqlite3.connect(db)  # the store is closed: one library on the file at a time
    with raw:
        raw.execute("UPDATE harel_executions SET version = 'seven'")
    raw.close()
    line = failed(cli("ls", "--url", str(db), cwd=tmp_path), 1)
    assert "does not fit (version: text 'seven', not an integer; row 'kid')" in line, line
    # show loads the execution first, at its version column (issue 35, class 13): its row
    # is the record and the version, named by the record's start
    line = failed(cli("show", "kid", "--url", str(db), cwd=tmp_path), 1)
    assert "row of load_execution that does not fit (version: text 'seven'" in line, line
    assert """row '{"id":"kid",""" in line, line


# --- the global options, on either side of the command (issue 48) ---

GLOBAL = {
    "--url": ("url", "a.db", "b.db"),
    "--sync-url": ("sync_url", "http://127.0.0.1:1", "http://127.0.0.1:2"),
    "--fleet": ("fleet", "one.txt", "two.txt"),
    "--jobs": ("jobs", "2", "3"),
}


def test_each_global_option_is_taken_before_or_after_the_command() -> None:
    from harel_store.cli import build_parser

    for option, (attr, first, second) in GLOBAL.items():
        for argv in ([option, first, "status"], ["status", option, first]):
            assert str(getattr(build_parser().parse_args(argv), attr)) == first, argv
        # one after the command wins over one before; left out after, the one before stands
        both = build_parser().parse_args([option, first, "status", option, second])
        assert str(getattr(both, attr)) == second, option
        before = build_parser().parse_args([option, first, "status", "--json"])
        assert str(getattr(before, attr)) == first, option
        assert getattr(build_parser().parse_args(["status"]), attr) is None, option


def test_url_before_the_command_runs_it_on_that_database(db: str, tmp_path: Path) -> None:
    before = json.loads(ok(cli("--url", db, "status", "--json")))
    after = json.loads(ok(cli("status", "--json", "--url", db)))
    assert before["executions"] == after["executions"] and before["executions"]["failed"] == 1
    ignored = str(tmp_path / "not-this.db")
    later = json.loads(ok(cli("--url", ignored, "status", "--json", "--url", db)))
    assert later["executions"] == after["executions"]
    assert not Path(ignored).exists()


def test_fleet_and_jobs_after_the_command_run_over_the_fleet(db: str, tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.txt"
    fleet_file.write_text(f"east {db}\n")
    for argv in (
        ("--fleet", str(fleet_file), "status"),
        ("status", "--fleet", str(fleet_file)),
        ("--jobs", "1", "status", f"--fleet={fleet_file}"),
        ("status", "--fleet", str(fleet_file), "--jobs", "1"),
    ):
        out = ok(cli(*argv))
        assert "east: " in out and "1 database, 1 ok, 0 failed" in out, (argv, out)
