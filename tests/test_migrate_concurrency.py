"""Several processes migrate one fresh file at once; a migration killed half-way is undone.

Both paths are checked: the store's own (at open) and ``alembic upgrade``. The number of
migrations is read from ``harel_store.sql.MIGRATIONS``, never hard-coded.
"""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from harel_store.sql import HEAD, MIGRATIONS
from tests.helpers import ALEMBIC, alembic_steps
from tests.workers.common import open_store, spawn

PROCESSES = 4
PATHS = [("store", "libsql"), ("store", "sqlite"), ("alembic", "libsql")]
REVISIONS = [m.revision for m in MIGRATIONS]


def revision(db: Path) -> str | None:
    raw = sqlite3.connect(db)
    try:
        if not raw.execute("SELECT 1 FROM sqlite_master WHERE name = 'alembic_version'").fetchone():
            return None
        row = raw.execute("SELECT version_num FROM alembic_version").fetchone()
        return None if row is None else str(row[0])
    finally:
        raw.close()


def schema(db: Path) -> dict[tuple[str, str], list[tuple[object, ...]]]:
    """Every table and index with its columns (not the DDL text, which may be spelled apart)."""
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        found = {}
        for kind, name in raw.execute(
            "SELECT type, name FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
        ):
            pragma = "table_info" if kind == "table" else "index_info"
            found[(kind, name)] = raw.execute(
                f"SELECT * FROM pragma_{pragma}(?)", (name,)
            ).fetchall()
        return found
    finally:
        raw.close()


def alembic_cli(db: Path, target: str = "head") -> None:
    """The real command line an operator runs."""
    subprocess.run(
        [
            *ALEMBIC,
            "-x",
            f"url={db}",
            "upgrade",
            target,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A file at every revision, each upgraded by Alembic from a fresh file, in one child;
    closed (no journal or WAL left beside it), so a test may copy one as its start."""
    dbs = {rev: tmp_path_factory.mktemp("ref") / f"{rev}.db" for rev in REVISIONS}
    alembic_steps(*((db, "upgrade", rev) for rev, db in dbs.items()))
    for rev, db in dbs.items():
        assert revision(db) == rev
        assert not [p for p in db.parent.iterdir() if p.name.startswith(f"{db.name}-")]
    return dbs


@pytest.fixture(scope="module")
def reference(built: dict[str, Path]) -> dict[str | None, dict]:  # type: ignore[type-arg]
    """The schema at every revision, each built by Alembic on a fresh file."""
    refs: dict[str | None, dict] = {None: {}}  # type: ignore[type-arg]
    for rev, db in built.items():
        refs[rev] = schema(db)
    return refs


def start(mode: str, driver: str, db: Path, *extra: str) -> subprocess.Popen[str]:
    # stderr goes to a file: stdout is read line by line, and a full pipe would block.
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by finish)
    proc = spawn(
        "migrator", mode, str(db), "--driver", driver, *extra, stdout=subprocess.PIPE, stderr=err
    )
    proc.err = err  # type: ignore[attr-defined]
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n"
    return proc


def finish(proc: subprocess.Popen[str]) -> tuple[list[str], str]:
    """Wait for a worker; its remaining stdout lines and its whole stderr."""
    assert proc.stdout is not None
    out = proc.stdout.read().splitlines()
    proc.stdout.close()
    proc.wait(timeout=120)
    proc.err.seek(0)  # type: ignore[attr-defined]
    err = proc.err.read()  # type: ignore[attr-defined]
    proc.err.close()  # type: ignore[attr-defined]
    return out, err


def wait_for(proc: subprocess.Popen[str], line: str) -> list[str]:
    """The lines before ``line`` (fails if the process ends first)."""
    assert proc.stdout is not None
    seen = []
    while (got := proc.stdout.readline()) != f"{line}\n":
        if not got:
            proc.wait()
            pytest.fail(f"worker ended before {line!r}: {finish(proc)[1]}")
        seen.append(got.strip())
    return seen


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "driver"), PATHS)
def test_concurrent_openers_apply_each_migration_exactly_once(
    mode: str,
    driver: str,
    tmp_path: Path,
    reference: dict,  # type: ignore[type-arg]
) -> None:
    db, go = tmp_path / "fresh.db", tmp_path / "go"
    # One process takes the lock inside the first migration and holds it a moment, so the
    # others surely start while it runs; after it, they race each other for the rest.
    # For Alembic the holder also dawdles between migrations, as a slow process may.
    pause = ["--pause-between", "0.5"] if mode == "alembic" else []
    holder = start(mode, driver, db, "--hold", REVISIONS[0], "--hold-for", "0.5", *pause)
    others = [start(mode, driver, db, "--go", str(go)) for _ in range(PROCESSES - 1)]
    wait_for(holder, "holding")
    go.touch()
    applied: Counter[str] = Counter({REVISIONS[0]: 1})
    for proc in [holder, *others]:
        out, err = finish(proc)
        assert proc.returncode == 0, err
        applied.update(line.split()[1] for line in out if line.startswith("applying"))
    assert applied == Counter(REVISIONS), "each migration must be applied exactly once"
    assert revision(db) == HEAD
    assert schema(db) == reference[HEAD]


@pytest.mark.slow
def test_concurrent_alembic_command_lines(tmp_path: Path, reference: dict) -> None:  # type: ignore[type-arg]
    db = tmp_path / "fresh.db"
    procs = [
        subprocess.Popen(
            [
                *ALEMBIC,
                "-x",
                f"url={db}",
                "upgrade",
                "head",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(PROCESSES)
    ]
    runs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, runs, strict=True):
        assert p.returncode == 0, err
    ran = Counter(
        line.split("->")[1].split(",")[0].strip()
        for _, err in runs
        for line in err.splitlines()
        if "Running upgrade" in line
    )
    assert ran == Counter(REVISIONS)
    assert revision(db) == HEAD
    assert schema(db) == reference[HEAD]


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "driver"), PATHS)
@pytest.mark.parametrize("killed", REVISIONS)
def test_a_migration_killed_midway_is_undone_and_the_next_start_completes_it(
    mode: str,
    driver: str,
    killed: str,
    tmp_path: Path,
    built: dict[str, Path],
    reference: dict,  # type: ignore[type-arg]
) -> None:
    db = tmp_path / "fresh.db"
    k = REVISIONS.index(killed)
    previous = REVISIONS[k - 1] if k else None
    if mode == "alembic" and previous is not None:
        # Start just below (one upgrade command is one transaction): a copy of the file
        # Alembic upgraded to there, not an Alembic run of its own (~1 s of CPU each).
        shutil.copyfile(built[previous], db)
    proc = start(mode, driver, db, "--hold", killed)
    wait_for(proc, "holding")  # its statements ran; its COMMIT has not
    proc.send_signal(signal.SIGKILL)
    finish(proc)
    assert revision(db) == previous
    assert schema(db) == reference[previous] if previous or mode == "store" else True
    if mode == "store":
        open_store(driver, db).close()
    else:
        alembic_cli(db)
    assert revision(db) == HEAD
    assert schema(db) == reference[HEAD]
