"""The schema as migrations: the chain builds schema.sql, Alembic and the store agree."""

from __future__ import annotations

import re
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest
from alembic.config import Config
from alembic.script import ScriptDirectory
from mako.template import Template

from harel_store import LibsqlStore, SchemaError, SqliteStore
from harel_store.schema import describe, head_schema
from harel_store.sql import HEAD, MIGRATIONS, SQL_DIR
from tests.helpers import (
    ALEMBIC,
    ROWS_0003,
    alembic_steps,
    check_0003_rows,
    raw,
    rows_0003,
    stage_0003,
)
from tests.in_process import alembic_in_process

ROOT = Path(__file__).resolve().parent.parent
ALEMBIC_INI = ROOT / "alembic.ini"


def alembic(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = alembic_in_process([*ALEMBIC, *args], cwd=cwd)
    done.check_returncode()
    return done


def schema_of(path: Path) -> object:
    with closing(sqlite3.connect(path)) as conn, conn:
        return describe(conn)


def without_rowid(path: Path) -> dict[str, bool]:
    """Whether each table 0003 rebuilds is WITHOUT ROWID."""
    with closing(sqlite3.connect(path)) as conn:
        tables = describe(conn)
    return {table: tables[table]["without_rowid"] for table in ROWS_0003}


def test_every_sql_migration_is_named_by_exactly_one_revision() -> None:
    script = ScriptDirectory.from_config(Config(str(ALEMBIC_INI)))
    revisions = list(reversed(list(script.walk_revisions())))
    assert [r.revision for r in revisions] == [m.revision for m in MIGRATIONS]
    assert [r.down_revision for r in revisions] == [m.down_revision for m in MIGRATIONS]
    assert [m.revision for m in MIGRATIONS] == [f"{i:04d}" for i in range(1, len(MIGRATIONS) + 1)]
    named: list[str] = []
    for rev in revisions:
        assert rev.path is not None
        for name in re.findall(r'sql_revision\("([^"]+)"\)', Path(rev.path).read_text()):
            named += [f"{name}.up.sql", f"{name}.down.sql"]
    files = sorted(p.name for p in (SQL_DIR / "migrations").iterdir())
    assert sorted(named) == files, "each .sql migration is used exactly once"
    for m in MIGRATIONS:
        assert f"{m.name}.up.sql" in named and f"{m.name}.down.sql" in named
    assert all(re.fullmatch(r"\d{4}_[a-z0-9_]+\.(up|down)\.sql", f) for f in files)


def test_every_revision_script_is_what_the_template_makes() -> None:
    """Each script in migrations/versions/ is, to the letter, what `alembic revision` makes
    from script.py.mako given its message and numbers: a title and two lines, the SQL files
    doing the work. So no two scripts repeat a block of code and a new one looks like the
    others."""
    template = Template(filename=str(ROOT / "migrations" / "script.py.mako"))
    script = ScriptDirectory.from_config(Config(str(ALEMBIC_INI)))
    for m in MIGRATIONS:
        rev = script.get_revision(m.revision)
        assert rev is not None and rev.path is not None
        rendered = template.render(
            message=rev.doc,
            up_revision=m.revision,
            down_revision=m.down_revision,
            migration_name=m.name,
        )
        assert Path(rev.path).read_text() == rendered, rev.path
        assert rev.module.upgrade.__name__ == "upgrade"  # Alembic logs "Running upgrade ..."
        assert rev.module.downgrade.__name__ == "downgrade"


def test_the_migration_chain_builds_schema_sql(tmp_path: Path) -> None:
    db = tmp_path / "alembic.db"
    alembic("-x", f"url={db}", "upgrade", "head")
    assert schema_of(db) == head_schema()


def test_the_store_builds_the_same_database_as_alembic(tmp_path: Path) -> None:
    by_alembic, by_libsql, by_sqlite = (tmp_path / n for n in ("a.db", "l.db", "s.db"))
    alembic("-x", f"url={by_alembic}", "upgrade", "head")
    LibsqlStore(by_libsql).close()
    SqliteStore(by_sqlite).close()
    expected = schema_of(by_alembic)
    assert schema_of(by_libsql) == expected == schema_of(by_sqlite)
    for db in (by_alembic, by_libsql, by_sqlite):
        with closing(sqlite3.connect(db)) as conn, conn:
            assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]
            version_table = conn.execute(
                "SELECT sql FROM sqlite_master WHERE name = 'alembic_version'"
            ).fetchone()[0]
        assert "alembic_version_pkc PRIMARY KEY (version_num)" in version_table
    assert f"{HEAD} (head)" in alembic("-x", f"url={by_libsql}", "current").stdout
    alembic("-x", f"url={by_libsql}", "upgrade", "head")  # a no-op
    assert schema_of(by_libsql) == expected


def test_downgrade_to_base_and_back(tmp_path: Path) -> None:
    db = tmp_path / "d.db"
    alembic_steps((db, "upgrade", "head"), (db, "downgrade", "base"))
    with closing(sqlite3.connect(db)) as conn, conn:
        left = conn.execute("SELECT name FROM sqlite_master WHERE name LIKE 'harel%'").fetchall()
    assert left == []
    alembic_steps(  # one step at a time, each reversible
        *(
            (db, command, target)
            for m in MIGRATIONS
            for command, target in (("upgrade", "+1"), ("downgrade", "-1"), ("upgrade", m.revision))
        )
    )
    assert schema_of(db) == head_schema()


@pytest.mark.slow
def test_each_downgrade_restores_the_schema_before_it(tmp_path: Path) -> None:
    db = tmp_path / "d.db"
    built = {m.name: tmp_path / f"built-{m.down_revision}.db" for m in MIGRATIONS[1:]}
    after = {m.name: tmp_path / f"after-{m.name}.db" for m in MIGRATIONS[1:]}
    alembic_steps(
        # each revision before head, built from nothing
        *((built[m.name], "upgrade", str(m.down_revision)) for m in MIGRATIONS[1:]),
        # then one file up to head, and down one step at a time, each step's result copied
        (db, "upgrade", "head"),
        *(
            step
            for m in reversed(MIGRATIONS[1:])
            for step in ((db, "downgrade", "-1"), (db, "copy", str(after[m.name])))
        ),
    )
    for m in reversed(MIGRATIONS[1:]):
        assert schema_of(after[m.name]) == schema_of(built[m.name]), m.name


def test_0003_rebuilds_its_tables_keeping_every_row_up_and_down(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    alembic("-x", f"url={db}", "upgrade", "0002")
    with closing(sqlite3.connect(db)) as conn:
        stage_0003(conn)
    with LibsqlStore(db) as store:  # the store's own migration path
        assert store.schema_revision == HEAD
        check_0003_rows(store)
    assert schema_of(db) == head_schema()
    assert all(without_rowid(db).values())
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("DELETE FROM harel_trace WHERE idx = 8")
        conn.commit()
        migrated = rows_0003(conn)
    assert migrated == {table: sorted(rows) for table, rows in ROWS_0003.items()}
    alembic("-x", f"url={db}", "downgrade", "0002")
    with closing(sqlite3.connect(db)) as conn:
        assert rows_0003(conn) == migrated
    assert not any(without_rowid(db).values())


def test_upgrade_sql_prints_a_reviewable_script() -> None:
    out = alembic("upgrade", "head", "--sql").stdout
    assert out.count("BEGIN;") == len(MIGRATIONS) and out.count("COMMIT;") == len(MIGRATIONS)
    assert "CREATE TABLE harel_executions" in out
    assert f"UPDATE alembic_version SET version_num='{HEAD}'" in out or len(MIGRATIONS) == 1
    assert "INSERT INTO alembic_version (version_num) VALUES ('0001')" in out


def test_plain_alembic_upgrade_migrates_the_default_file(tmp_path: Path) -> None:
    subprocess.run(
        [*ALEMBIC, "upgrade", "head"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert schema_of(tmp_path / "harel.db") == head_schema()


def test_a_failed_migration_leaves_nothing_behind(tmp_path: Path) -> None:
    db = tmp_path / "f.db"
    with (
        closing(sqlite3.connect(db)) as conn,
        conn,
    ):  # a table in the way of the last statement of 0001
        conn.execute("CREATE TABLE harel_definitions (x)")
    with pytest.raises(subprocess.CalledProcessError):
        alembic("-x", f"url={db}", "upgrade", "0001")
    with closing(sqlite3.connect(db)) as conn, conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert names == {"harel_definitions"}  # no harel_executions left half-made, no version row
    with pytest.raises(SchemaError):  # the store's own path is just as atomic
        LibsqlStore(db)
    with closing(sqlite3.connect(db)) as conn, conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert names == {"harel_definitions"}


def test_a_schema_the_code_does_not_know_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "ahead.db"
    SqliteStore(db).close()
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    for opener in (LibsqlStore, SqliteStore):
        with pytest.raises(SchemaError, match="9999"):
            opener(db)


def test_a_schema_behind_is_refused_when_migrating_is_not_allowed(tmp_path: Path) -> None:
    db = tmp_path / "behind.db"
    with pytest.raises(SchemaError, match="harel-store migrate"):
        LibsqlStore(db, migrate=False)
    with closing(sqlite3.connect(db)) as conn, conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
    LibsqlStore(db).close()  # local default: migrate
    assert schema_of(db) == head_schema()


@pytest.mark.slow
@pytest.mark.parametrize("opener", [LibsqlStore, SqliteStore])
def test_0006_up_and_down_on_a_populated_database(opener: type, tmp_path: Path) -> None:
    db, at_0005 = tmp_path / "old.db", tmp_path / "ref.db"
    alembic("-x", f"url={db}", "upgrade", "0005")
    alembic("-x", f"url={at_0005}", "upgrade", "0005")
    with closing(sqlite3.connect(db)) as conn, conn:
        for n in (1, 2, 3):
            event = f'{{"name":"e","id":"ev{n}"}}'
            conn.execute("INSERT INTO harel_outbox (target_id, event) VALUES ('t', ?)", (event,))
        conn.execute(
            "INSERT INTO harel_spawns (parent_id, child_id, root_path, context) "
            "VALUES ('p', 'kid', 'r', '{}')"
        )
        conn.execute(
            "INSERT INTO harel_timers (execution_id, path, fire_at) VALUES ('p', 'x', 1.5)"
        )
    with opener(db) as store:  # migrates to head: every row live, no attempt yet
        assert store.schema_revision == HEAD
        assert [(e.seq, e.attempts, e.last_error) for e in store.outbox_view()] == [
            (1, 0, None),
            (2, 0, None),
            (3, 0, None),
        ]
        claims = lambda: [  # noqa: E731
            *store.claim_outbox("w", limit=2, max_attempts=1),
            *store.claim_spawns("w", max_attempts=1),
            *store.claim_due_timers("w", 2.0, max_attempts=1),
        ]
        assert len(claims()) == 4
        store.fail("w", store.claim_outbox("w"), error="boom", retry_in=0.0)
        raw(store).execute("UPDATE harel_outbox SET claimed_until = NULL WHERE seq < 3")
        raw(store).execute("UPDATE harel_spawns SET claimed_until = NULL")
        raw(store).execute("UPDATE harel_timers SET claimed_until = NULL")
        raw(store).commit()
        assert claims() == []  # 1, 2, the spawn and the timer die; 3 is at max_attempts
        assert len(store.dead_letters()) == 4
        assert [(e.seq, e.attempts, e.last_error) for e in store.outbox_view()] == [(3, 1, "boom")]
    alembic("-x", f"url={db}", "downgrade", "0005")
    assert schema_of(db) == schema_of(at_0005)
    with closing(sqlite3.connect(db)) as conn:  # the dead letters are pending rows again
        assert conn.execute("SELECT seq FROM harel_outbox ORDER BY seq").fetchall() == [
            (1,),
            (2,),
            (3,),
        ]
        assert conn.execute("SELECT child_id FROM harel_spawns").fetchall() == [("kid",)]
        assert conn.execute("SELECT path, fire_at FROM harel_timers").fetchall() == [("x", 1.5)]
    alembic("-x", f"url={db}", "upgrade", "head")
    with opener(db) as store:
        assert [(e.seq, e.attempts) for e in store.outbox_view()] == [(1, 0), (2, 0), (3, 0)]
        assert store.dead_letters() == [] and len(store.claim_due_timers("w", 2.0)) == 1


def test_0008_stamps_new_trace_steps_and_leaves_older_ones_untimed(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    alembic("-x", f"url={db}", "upgrade", "0007")
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("INSERT INTO harel_trace (execution_id, idx, entry) VALUES ('e', 0, '{}')")
    with LibsqlStore(db) as store:  # migrates to head
        store.append_trace("e", {"event": "later"})
        old, new = store.trace_view("e")
        assert (old.index, old.recorded_at, old.entry) == (0, None, {})
        assert (new.index, new.entry) == (1, {"event": "later"})
        assert isinstance(new.recorded_at, float) and new.recorded_at > 1.7e9
    alembic("-x", f"url={db}", "downgrade", "0007")
    with closing(sqlite3.connect(db)) as conn:  # the steps stay, their times are forgotten
        assert conn.execute("SELECT idx, entry FROM harel_trace ORDER BY idx").fetchall() == [
            (0, "{}"),
            (1, '{"event":"later"}'),
        ]


def test_0009_indexes_the_orphans_already_there(tmp_path: Path) -> None:
    # An execution whose parent was purged alone before 0009 is found by purge_finished
    # after it: the index is built from the rows there.
    db = tmp_path / "old.db"
    alembic("-x", f"url={db}", "upgrade", "0008")
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.executemany(
            "INSERT INTO harel_executions (id, definition_id, data, version, status, parent_id,"
            " updated_at) VALUES (?, 'd', ?, 1, ?, ?, 1000.0)",
            [
                (eid, f'{{"id": "{eid}", "definition_id": "d"}}', status, parent)
                for eid, status, parent in [
                    ("kid", "finished", "gone"),
                    ("kid.a", "failed", "kid"),
                    ("run", "running", "gone"),
                ]
            ],
        )
    with SqliteStore(db) as store:  # migrates to head
        assert store.retention_counts(finished_before=2000.0) == (2, 0, 0)
        assert store.purge_finished(2000.0) == 2
        assert [s.id for s in store.list_executions().items] == ["run"]
    alembic("-x", f"url={db}", "downgrade", "0008")
    with closing(sqlite3.connect(db)) as conn:
        names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert "harel_executions_final_children" not in names
