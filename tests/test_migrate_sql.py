"""``harel-store migrate --sql``: the script from the database's revision to the target (an
upgrade or a downgrade), or of a range given as FROM:TO, read from real files and a real
sqld, the database never written."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libsql
import pytest

from harel_store import HEAD, LibsqlStore, SqliteStore
from harel_store.cli import main
from harel_store.sql import MIGRATIONS, split_statements
from tests.test_cli import CLI, cli, failed, ok

REVISIONS = ["base", *(m.revision for m in MIGRATIONS), "head"]
NEXT = f"{len(MIGRATIONS) + 1:04d}"  # the revision after head: none yet
ALL_DOWN = [*(str(m.down_revision) for m in reversed(MIGRATIONS[1:])), "base"]  # head to base
_VERSION = re.compile(  # what Alembic writes to alembic_version (newlines made spaces)
    r"CREATE TABLE alembic_version \(.*\)"
    r"|INSERT INTO alembic_version \(version_num\) VALUES \('(\d+)'\)(?: RETURNING version_num)?"
    r"|UPDATE alembic_version SET version_num='(\d+)' WHERE alembic_version.version_num = '(\d+)'"
    r"|DELETE FROM alembic_version WHERE alembic_version.version_num = '(\d+)'"
)


def at(revision: str) -> int:
    """The index in MIGRATIONS of ``revision``."""
    return [m.revision for m in MIGRATIONS].index(revision)


def ups(first: str, last: str) -> list[str]:
    """The statements of the .up.sql files of ``first`` to ``last``, in the order they run."""
    return [s for m in MIGRATIONS[at(first) : at(last) + 1] for s in m.statements("up")]


def downs(newest: str, oldest: str) -> list[str]:
    """The statements of the .down.sql files of ``newest`` down to ``oldest``, in order."""
    chain = MIGRATIONS[at(oldest) : at(newest) + 1]
    return [s for m in reversed(chain) for s in m.statements("down")]


def parse(script: str) -> tuple[list[str], list[str], int]:
    """A printed script as (the migrations' statements, its alembic_version statements, the
    number of transactions), checking every BEGIN has its COMMIT."""
    statements = list(split_statements(script))
    begins = statements.count("BEGIN")
    assert begins == statements.count("COMMIT") and begins > 0, script
    body = [s for s in statements if s not in ("BEGIN", "COMMIT")]
    versions = [s for s in body if "alembic_version" in s]
    assert all(_VERSION.fullmatch(s.replace("\n", " ")) for s in versions), versions
    return [s for s in body if "alembic_version" not in s], versions, begins


def moves(versions: list[str]) -> list[str]:
    """The alembic_version statements as the revisions they move to (``base`` at the end)."""
    out = []
    for s in versions:
        match = _VERSION.fullmatch(s.replace("\n", " "))
        assert match is not None
        if match[1] or match[2]:
            out.append(match[1] or match[2])
        elif match[4]:
            out.append("base")
    return out


def snapshot(path: Path) -> tuple[int, int, str]:
    """The file as --sql must leave it: its size, mtime and bytes."""
    info = path.stat()
    return info.st_size, info.st_mtime_ns, hashlib.sha256(path.read_bytes()).hexdigest()


def untouched(path: Path, before: tuple[int, int, str]) -> None:
    """``path`` is as it was; SQLite's read-only connection may leave an empty WAL beside a
    WAL-mode file (and its index, -shm), never a frame in it and no other file."""
    assert snapshot(path) == before
    wal = path.with_name(path.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    others = {p.name for p in path.parent.iterdir()} - {path.name, wal.name, path.name + "-shm"}
    assert not {n for n in others if n.startswith(path.name)}, others


def migrated(tmp_path: Path, revision: str, name: str = "state.db") -> Path:
    """A local file brought to ``revision`` by the command itself."""
    path = tmp_path / name
    shown = HEAD if revision == "head" else revision
    assert f"revision {shown} " in ok(cli("migrate", "--to", revision, "--url", str(path)))
    return path


# --- a local file ---


def test_sql_on_a_file_at_0004_prints_only_0005_to_head(tmp_path: Path) -> None:
    path = migrated(tmp_path, "0004")
    before = snapshot(path)
    result = cli("migrate", "--sql", env={"HAREL_DATABASE_URL": str(path)})
    statements, versions, transactions = parse(ok(result))
    assert statements == ups("0005", HEAD)
    assert MIGRATIONS[at("0005")].statements("up")[0] in result.stdout
    assert MIGRATIONS[0].statements("up")[0] not in result.stdout  # 0001's CREATE TABLE
    assert "CREATE TABLE harel_executions" not in result.stdout  # 0001's
    assert "CREATE TABLE alembic_version" not in result.stdout
    assert moves(versions) == [m.revision for m in MIGRATIONS[at("0005") :]]
    assert transactions == len(MIGRATIONS) - at("0005")
    assert [line.split(",")[0] for line in result.stderr.splitlines()] == [
        f"harel-store: Running upgrade {m.down_revision} -> {m.revision}"
        for m in MIGRATIONS[at("0005") :]
    ]
    untouched(path, before)
    assert "revision 0004 " in ok(cli("migrate", "--to", "0004", "--url", str(path)))


def test_sql_to_an_older_revision_prints_the_downgrades_newest_first(tmp_path: Path) -> None:
    path = migrated(tmp_path, "0004")
    before = snapshot(path)
    result = cli("migrate", "--sql", "--to", "0002", "--url", str(path))
    statements, versions, transactions = parse(ok(result))
    assert statements == downs("0004", "0003")
    assert statements[0] == MIGRATIONS[at("0004")].statements("down")[0]
    assert moves(versions) == ["0003", "0002"] and transactions == 2
    assert "ADD COLUMN" not in result.stdout  # no upgrade's (0004's adds the claim columns)
    assert [line.split(",")[0] for line in result.stderr.splitlines()] == [
        "harel-store: Running downgrade 0004 -> 0003",
        "harel-store: Running downgrade 0003 -> 0002",
    ]
    untouched(path, before)


def test_sql_to_base_from_head_prints_every_downgrade(tmp_path: Path) -> None:
    path = migrated(tmp_path, "head")
    before = snapshot(path)
    statements, versions, transactions = parse(
        ok(cli("migrate", "--sql", "--to", "base", "--url", str(path)))
    )
    assert statements == downs(HEAD, "0001")
    assert moves(versions) == ALL_DOWN
    assert transactions == len(MIGRATIONS)
    untouched(path, before)


@pytest.mark.slow
def test_sql_at_the_target_says_nothing_to_do(tmp_path: Path) -> None:
    path = migrated(tmp_path, "head")
    before = snapshot(path)
    result = cli("migrate", "--sql", "--url", str(path))
    assert (result.returncode, result.stdout) == (0, "")
    assert result.stderr == f"harel-store: {path} is at {HEAD} (head): nothing to do\n"
    result = cli("migrate", "--sql", "--to", HEAD, "--url", str(path))
    assert result.stderr == f"harel-store: {path} is at {HEAD} (head): nothing to do\n"
    untouched(path, before)

    old = migrated(tmp_path, "0004", "old.db")
    result = cli("migrate", "--sql", "--to", "0004", "--url", str(old))
    assert (result.returncode, result.stdout) == (0, "")
    assert result.stderr == f"harel-store: {old} is at 0004: nothing to do\n"

    # A missing file is at base, and stays missing.
    result = cli("migrate", "--sql", "--to", "base", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "")
    assert result.stderr == "harel-store: harel.db is at base: nothing to do\n"
    result = cli("migrate", "--sql", "--to", "0004:0004", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (0, "")
    assert result.stderr == "harel-store: the range 0004:0004 is empty: nothing to do\n"
    assert not (tmp_path / "harel.db").exists()


def test_sql_on_a_missing_file_prints_everything_and_creates_nothing(tmp_path: Path) -> None:
    result = cli("migrate", "--sql", "--url", "never.db", cwd=tmp_path)
    statements, versions, _ = parse(ok(result))
    assert statements == ups("0001", HEAD)
    assert versions[0].startswith("CREATE TABLE alembic_version")
    assert moves(versions) == [m.revision for m in MIGRATIONS]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_range_is_printed_without_reading_any_database(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"  # reading it would fail: "it is not a SQLite database"
    junk.write_text("not a database, " * 200)
    before = snapshot(junk)
    assert "it is not a SQLite database" in failed(cli("migrate", "--sql", "--url", str(junk)))
    cases = {
        "0004:head": (ups("0005", HEAD), [m.revision for m in MIGRATIONS[at("0005") :]]),
        "base:0002": (ups("0001", "0002"), ["0001", "0002"]),
        "0005:0003": (downs("0005", "0004"), ["0004", "0003"]),
        "head:base": (downs(HEAD, "0001"), ALL_DOWN),
    }
    # Every span from the junk file; one span each from a server nothing answers at and from
    # the default database (harel.db in the working folder, junk too): a range reads none.
    here = tmp_path / "here"
    here.mkdir()
    default = here / "harel.db"
    default.write_text("not a database, " * 200)
    default_before = snapshot(default)
    runs = [(["--url", str(junk)], span, tmp_path) for span in cases]
    runs += [(["--url", "http://127.0.0.1:1"], "0005:0003", tmp_path), ([], "0004:head", here)]
    for where, span, cwd in runs:
        expected, revisions = cases[span]
        statements, versions, _ = parse(ok(cli("migrate", "--sql", "--to", span, *where, cwd=cwd)))
        assert statements == expected, (span, where)
        assert moves(versions) == revisions, (span, where)
    untouched(junk, before)
    untouched(default, default_before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "junk.db"]
    assert [p.name for p in here.iterdir()] == ["harel.db"]


@pytest.mark.parametrize(
    "to",
    ["zz", "", NEXT, "0004:", ":head", "0004:head:base", "1", "-1", "0004-0002", "0001:" + NEXT],
)
def test_a_target_that_is_not_a_revision_is_a_usage_error(to: str, tmp_path: Path) -> None:
    result = cli("migrate", "--sql", f"--to={to}", "--url", "x.db", cwd=tmp_path)
    line = failed(result, 2)
    assert line.startswith(f"harel-store migrate: error: argument --to: not a revision: {to!r}")
    assert all(rev in line for rev in REVISIONS) and "FROM:TO" in line
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_a_range_without_sql_is_a_usage_error_and_migrates_nothing(tmp_path: Path) -> None:
    path = migrated(tmp_path, "0004")
    before = snapshot(path)
    line = failed(cli("migrate", "--to", "0004:head", "--url", str(path)), 2)
    assert (
        line
        == "harel-store: error: --to 0004:head: a range FROM:TO is for --sql (the script of it)"
    )
    untouched(path, before)


def test_a_revision_this_version_does_not_know_is_one_line(tmp_path: Path) -> None:
    path = migrated(tmp_path, "head")
    conn = libsql.connect(str(path))
    conn.execute("UPDATE alembic_version SET version_num = '0099'")
    conn.commit()
    conn.close()
    before = snapshot(path)
    line = failed(cli("migrate", "--sql", "--url", str(path)))
    assert line == (
        f"harel-store: error: {path} is at schema revision '0099', which this version of "
        f"harel-store does not know (its head is '{HEAD}'): upgrade harel-store"
    )
    untouched(path, before)


def test_sql_beside_a_store_of_either_library_in_the_same_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The revision is read through the library this process has the file open with."""
    monkeypatch.setenv("RUST_LOG", "off")  # what main() sets: undone after the test
    for opener, name in ((SqliteStore, "s.db"), (LibsqlStore, "l.db")):
        path = tmp_path / name
        with opener(path) as store:  # a store migrates a local file to head on open
            assert main(["migrate", "--sql", "--url", str(path)]) == 0
            captured = capsys.readouterr()
            assert captured.out == ""
            assert captured.err == f"harel-store: {path} is at {HEAD} (head): nothing to do\n"
            assert store.schema_revision == HEAD


@pytest.mark.slow
def test_the_help_examples_run_as_written(tmp_path: Path) -> None:
    text = ok(cli("migrate", "--help"))
    examples = [
        line.split("#")[0].strip()
        for line in text[text.index("examples:") :].splitlines()[1:]
        if line.startswith("  harel-store migrate")
    ]
    assert any("--sql --to base" in e for e in examples), examples
    assert any(re.search(r"--to \d{4}:head", e) for e in examples), examples
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAREL_")}
    env["PATH"] = f"{CLI.parent}{os.pathsep}{env.get('PATH', '')}"
    for example in examples:
        run = subprocess.run(
            ["bash", "-c", example],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env=env,
            timeout=120,
        )
        assert run.returncode == 0, (example, run.stderr)
        assert "Traceback" not in run.stderr
    assert parse((tmp_path / "upgrade.sql").read_text())[0] == ups("0002", HEAD)
    assert parse((tmp_path / "down.sql").read_text())[0] == downs("0001", "0001")


# --- a real libSQL server (conftest's session sqld, emptied) ---


@pytest.fixture
def older(server: Any) -> Iterator[Any]:
    """The session's server brought down to 0005 by the command, and back to head after."""
    env = {"HAREL_DATABASE_URL": server.url, "HAREL_AUTH_TOKEN": server.token}
    assert "revision 0005 " in ok(cli("migrate", "--to", "0005", env=env))
    try:
        yield server
    finally:
        assert f"revision {HEAD} " in ok(cli("migrate", env=env))


def server_revision(server: Any) -> str:
    conn = libsql.connect(server.url, auth_token=server.token)
    try:
        return str(conn.execute("SELECT version_num FROM alembic_version").fetchone()[0])
    finally:
        conn.close()


@pytest.mark.sqld
def test_sql_against_a_server_at_head(server: Any) -> None:
    env = {"HAREL_DATABASE_URL": server.url, "HAREL_AUTH_TOKEN": server.token}
    result = cli("migrate", "--sql", env=env)
    assert (result.returncode, result.stdout) == (0, "")
    assert result.stderr == f"harel-store: {server.url} is at {HEAD} (head): nothing to do\n"
    before = MIGRATIONS[-1].down_revision
    assert before is not None
    statements, versions, _ = parse(ok(cli("migrate", "--sql", "--to", before, env=env)))
    assert statements == downs(HEAD, HEAD) and moves(versions) == [before]
    wrong = server.foreign_token()
    result = cli("migrate", "--sql", env={**env, "HAREL_AUTH_TOKEN": wrong})
    line = failed(result)
    assert "auth" in line.lower(), line
    assert wrong not in result.stdout + result.stderr and server.token not in result.stderr
    assert server_revision(server) == HEAD


@pytest.mark.sqld
def test_sql_against_a_server_at_an_older_revision(older: Any) -> None:
    env = {"HAREL_AUTH_TOKEN": older.token}
    result = cli("migrate", "--sql", "--url", older.url, env=env)
    statements, versions, _ = parse(ok(result))
    assert statements == ups("0006", HEAD)
    assert moves(versions) == [m.revision for m in MIGRATIONS[at("0006") :]]
    statements, versions, _ = parse(
        ok(cli("migrate", "--sql", "--to", "0003", "--url", older.url, env=env))
    )
    assert statements == downs("0005", "0004") and moves(versions) == ["0004", "0003"]
    assert older.token not in result.stdout + result.stderr
    assert server_revision(older) == "0005"  # --sql changed nothing
