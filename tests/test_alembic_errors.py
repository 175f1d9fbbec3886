"""Plain Alembic on the repository's alembic.ini: a failure is one line in the store's words
(the line `harel-store migrate` prints, never a token, never a traceback), and
`alembic revision -m NAME` makes the next numbered revision with its two SQL files."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from alembic.config import Config
from alembic.script import ScriptDirectory

from harel_store import SqliteStore
from harel_store.sql import _MIGRATION_FILE, HEAD
from tests.helpers import ALEMBIC, ROOT, refused_port
from tests.in_process import alembic_in_process
from tests.proxy import Proxy

HARELSTORE = Path(sys.executable).with_name("harel-store")
# What Alembic's command line prints for a CommandError: the message on stdout after
# FAILED:, and the same message logged at ERROR on stderr (alembic.ini's console handler).
ERROR = "ERROR [alembic.util.messaging] "
# The lines Alembic logs once env.py has configured its context on a connection.
CONFIGURED = [
    "INFO  [alembic.runtime.migration] Context impl SQLiteImpl.",
    "INFO  [alembic.runtime.migration] Will assume transactional DDL.",
]


def environment(**extra: str) -> dict[str, str]:
    """This process's environment without any database or token of its own, plus ``extra``."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_", "RUST_LOG"))
    }
    return {**base, **extra}


def run(
    command: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    if command[1:3] == ["-m", "alembic"]:
        return alembic_in_process(command, cwd=cwd, env=env if env is not None else environment())
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env if env is not None else environment(),
        timeout=120,
    )


def alembic_failure(result: subprocess.CompletedProcess[str], logged: list[str]) -> str:
    """The message of Alembic's one-line failure: exit status 255 (Alembic's
    ``sys.exit(-1)``), stdout exactly ``FAILED: <message>``, stderr exactly the ``logged``
    INFO lines then the same message at ERROR; no traceback."""
    assert result.returncode == 255, (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAILED: "), result.stdout
    message = lines[0].removeprefix("FAILED: ")
    assert message.strip() == message and message
    assert result.stderr.splitlines() == [*logged, ERROR + message], result.stderr
    return message


def upgrade_fails(
    url: str, env: dict[str, str], logged: list[str], secrets: tuple[str, ...] = ()
) -> str:
    """``alembic -x url=URL upgrade head`` fails as one line, which is word for word the line
    ``harel-store migrate --url URL`` prints; neither shows a secret."""
    result = run([*ALEMBIC, "-x", f"url={url}", "upgrade", "head"], env=env)
    message = alembic_failure(result, logged)
    cli = run([str(HARELSTORE), "migrate", "--url", url], env=env)
    assert (cli.returncode, cli.stdout, cli.stderr) == (1, "", f"harel-store: error: {message}\n")
    for secret in secrets:
        assert secret not in result.stdout + result.stderr + cli.stdout + cli.stderr
    return message


@pytest.mark.sqld
def test_alembic_against_a_server_gone_silent_ends_within_its_timeout(sqld: Any) -> None:
    """The store's revision check passes; the libsql driver's requests are never answered.
    The run ends at -x timeout= as any failure does, one line naming the server (the run
    goes on in a child process that is stopped: the driver holds the GIL while it waits)."""
    with Proxy(sqld.port or 0) as proxy:
        proxy.hang_on = b"x-libsql-client-version"  # the driver's requests, not the store's
        env = environment(HAREL_AUTH_TOKEN=sqld.token)
        command = [*ALEMBIC, "-x", f"url={proxy.url()}", "-x", "timeout=2", "upgrade", "head"]
        result = run(command, env=env)
    assert alembic_failure(result, []) == (
        f"{proxy.url()} did not answer within 2 s: the migration was stopped, nothing"
        " of it committed (a longer bound: HAREL_TIMEOUT=SECONDS)"
    )
    assert sqld.token not in result.stdout + result.stderr


def without_tls(port: int) -> str:
    return (
        "; the server answered without TLS: for a plain-HTTP server use "
        f"http://127.0.0.1:{port} or libsql://127.0.0.1:{port}?tls=0"
    )


REFUSED = "authentication failed: the server refused the auth token (HTTP 401 from "


# ------------------------------------------------------------------ a failure is one line


@pytest.mark.sqld
@pytest.mark.parametrize("scheme", ["libsql", "https"])
def test_a_tls_url_at_a_plain_http_server_is_one_line_with_the_hint(scheme: str, sqld: Any) -> None:
    url = f"{scheme}://127.0.0.1:{sqld.port}"
    env = environment(HAREL_AUTH_TOKEN=sqld.token)
    message = upgrade_fails(url, env, [], secrets=(sqld.token,))
    assert message.startswith(f"cannot reach {url}: TLS handshake failed")
    assert message.endswith(without_tls(sqld.port))


@pytest.mark.sqld
@pytest.mark.parametrize("given", ["environment", "url"])
def test_a_wrong_token_is_one_line_and_never_shown(given: str, sqld: Any) -> None:
    wrong = sqld.foreign_token()  # well-formed, signed by another key
    url = f"http://127.0.0.1:{sqld.port}"
    if given == "url":
        url, env = f"{url}?authToken={wrong}", environment()
    else:
        env = environment(HAREL_AUTH_TOKEN=wrong)
    message = upgrade_fails(url, env, [], secrets=(wrong, wrong[-40:]))
    assert message.startswith(f"{REFUSED}http://127.0.0.1:{sqld.port}: ")
    assert "JWT is invalid" in message


@pytest.mark.sqld
def test_a_missing_token_is_one_line(sqld: Any) -> None:
    message = upgrade_fails(f"http://127.0.0.1:{sqld.port}", environment(), [])
    assert message.startswith(f"{REFUSED}http://127.0.0.1:{sqld.port}: ")
    assert "authorization header" in message


def test_an_unreachable_server_is_one_line() -> None:
    port = refused_port()  # nothing listens there
    message = upgrade_fails(f"http://127.0.0.1:{port}", environment(HAREL_AUTH_TOKEN="t0ken-x"), [])
    assert message == f"cannot reach http://127.0.0.1:{port}: connection refused"


def test_a_database_ahead_of_head_is_one_line_in_the_store_words(tmp_path: Path) -> None:
    db = tmp_path / "ahead.db"
    SqliteStore(db).close()
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    # Alembic fails inside the migration context (its "Can't locate revision identified by
    # '9999'"), after it logged its two lines about the connection.
    message = upgrade_fails(str(db), environment(), CONFIGURED)
    assert message == (
        f"{db} is at schema revision '9999', which this version of harel-store does not know"
        f" (its head is {HEAD!r}): upgrade harel-store"
    )
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [("9999",)]


@pytest.mark.slow
def test_a_url_the_store_cannot_read_and_a_file_that_cannot_be_opened_are_one_line(
    tmp_path: Path,
) -> None:
    bad = run(
        [*ALEMBIC, "-x", "url=foo://db.example.com?authToken=s3cret-token", "upgrade", "head"]
    )
    assert alembic_failure(bad, []) == (
        "foo://db.example.com: unknown scheme foo:// (use a path, file:, http(s)://, libsql://,"
        " ws(s):// or sqlite+libsql://)"
    )
    assert "s3cret-token" not in bad.stdout + bad.stderr
    empty = run([*ALEMBIC, "-x", "url=", "upgrade", "head"], cwd=tmp_path)
    assert alembic_failure(empty, []) == "the database URL is empty: give a path or a URL"
    assert list(tmp_path.iterdir()) == []
    missing = tmp_path / "no" / "such" / "x.db"
    message = upgrade_fails(str(missing), environment(), [])
    assert message == (
        f"cannot open {missing}: the file cannot be opened or created there (no such directory,"
        " or no permission)"
    )
    assert not missing.parent.exists()


# ------------------------------------------------- alembic revision: the next NNNN revision


def scripts_of(ini: Path) -> ScriptDirectory:
    return ScriptDirectory.from_config(Config(str(ini)))


def files_under(root: Path) -> set[str]:
    return {
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def copy_of_the_migrations(tmp_path: Path) -> Path:
    """alembic.ini, migrations/ and sql/ copied into ``tmp_path`` (the test never writes into
    the checkout); the copy's ini."""
    for folder in ("migrations", "sql"):
        shutil.copytree(
            ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copy(ROOT / "alembic.ini", tmp_path / "alembic.ini")
    return tmp_path / "alembic.ini"


def revision(ini: Path, *args: str) -> subprocess.CompletedProcess[str]:
    alembic = [sys.executable, "-m", "alembic", "-c", str(ini)]
    return run([*alembic, "revision", *args], cwd=ini.parent)


def test_alembic_ini_runs_env_py_for_a_revision() -> None:
    """Alembic runs env.py (whose hook numbers the revision) for `alembic revision` only when
    alembic.ini says ``revision_environment = true``; without it the revision is a random
    hex id such as cc3265cbb803."""
    config = Config(str(ROOT / "alembic.ini"))
    assert config.get_alembic_option("revision_environment") == "true"


def test_alembic_revision_makes_the_next_numbered_revision_and_its_sql_files(
    tmp_path: Path,
) -> None:
    checkout = {folder: files_under(ROOT / folder) for folder in ("migrations", "sql")}
    ini = copy_of_the_migrations(tmp_path)
    head = scripts_of(ini).get_current_head()
    assert head is not None and re.fullmatch(r"\d{4}", head)
    before = files_under(tmp_path)
    expected: list[str] = []
    for message, slug in [("add a thing", "add_a_thing"), ("And: another one!", "and_another_one")]:
        rev = f"{int(head) + len(expected) + 1:04d}"
        down = expected[-1] if expected else head
        result = revision(ini, "-m", message)
        assert result.returncode == 0, (result.stdout, result.stderr)
        name = f"{rev}_{slug}"
        script = tmp_path / "migrations" / "versions" / f"{name}.py"
        assert result.stdout == f"Generating {script} ...  done\n"
        assert result.stderr == ""
        made = files_under(tmp_path) - before
        assert made == {
            f"migrations/versions/{name}.py",
            f"sql/migrations/{name}.up.sql",
            f"sql/migrations/{name}.down.sql",
        }
        before |= made
        assert _MIGRATION_FILE.match(f"{name}.up.sql")
        for way in ("up", "down"):
            sql = (tmp_path / "sql" / "migrations" / f"{name}.{way}.sql").read_text()
            assert sql.startswith(f"-- {name}: {message}\n")
        text = script.read_text()
        assert f'revision, down_revision = "{rev}", "{down}"\n' in text
        assert re.findall(r'sql_revision\("([^"]+)"\)', text) == [name]
        assert text.startswith(f'"""{message}"""\n')
        expected.append(rev)
    # The chain loads: one line from 0001 to the new head, every .sql file named once.
    scripts = scripts_of(ini)
    chain = list(reversed(list(scripts.walk_revisions())))
    numbers = [f"{i:04d}" for i in range(1, int(head) + 3)]
    assert [s.revision for s in chain] == numbers
    assert [s.down_revision for s in chain] == [None, *numbers[:-1]]
    assert scripts.get_heads() == [expected[-1]]
    named = [
        n
        for s in chain
        if s.path
        for named in re.findall(r'sql_revision\("([^"]+)"\)', Path(s.path).read_text())
        for n in (f"{named}.up.sql", f"{named}.down.sql")
    ]
    assert sorted(named) == sorted(p.name for p in (tmp_path / "sql" / "migrations").iterdir())
    history = run([sys.executable, "-m", "alembic", "-c", str(ini), "history"], cwd=tmp_path)
    assert history.stdout.startswith(f"{expected[0]} -> {expected[1]} (head), And: another one!\n")
    assert not (tmp_path / "harel.db").exists()  # revision and history opened no database
    assert {folder: files_under(ROOT / folder) for folder in checkout} == checkout


def alembic_over_the_copy(ini: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``alembic -c INI ARGS`` whose revisions read the copy's sql/migrations/ (`run_sql`
    reads the package's, where a revision made in the copy has no files)."""
    code = (
        "import sys, pathlib, harel_store.migrate as m; m.SQL_DIR = pathlib.Path(sys.argv[1]);"
        " from alembic.config import main; main(sys.argv[2:], prog='alembic')"
    )
    command = [sys.executable, "-c", code, str(ini.parent / "sql"), "-c", str(ini), *args]
    return run(command, cwd=ini.parent)


@pytest.mark.slow
def test_a_revision_alembic_makes_upgrades_and_downgrades(tmp_path: Path) -> None:
    """The script `alembic revision` makes (a title and two lines) is a whole revision:
    with its two files written it upgrades, downgrades, prints its SQL offline and shows in
    the history, each as the hand-written revisions before it do."""
    ini = copy_of_the_migrations(tmp_path)
    head = scripts_of(ini).get_current_head()
    assert head is not None
    rev = f"{int(head) + 1:04d}"
    name = f"{rev}_a_thing_table"
    assert revision(ini, "-m", "a thing table").returncode == 0
    folder = tmp_path / "sql" / "migrations"
    (folder / f"{name}.up.sql").write_text("CREATE TABLE harel_things (id INTEGER PRIMARY KEY);\n")
    (folder / f"{name}.down.sql").write_text("DROP TABLE harel_things;\n")
    db = tmp_path / "things.db"

    def state() -> tuple[list[tuple[str]], list[tuple[str]]]:
        with closing(sqlite3.connect(db)) as conn:
            version = conn.execute("SELECT version_num FROM alembic_version").fetchall()
            things = conn.execute("SELECT name FROM sqlite_master WHERE name = 'harel_things'")
            return version, things.fetchall()

    up = alembic_over_the_copy(ini, "-x", f"url={db}", "upgrade", "head")
    assert up.returncode == 0, up.stderr
    assert f"Running upgrade {head} -> {rev}, a thing table\n" in up.stderr
    assert state() == ([(rev,)], [("harel_things",)])
    down = alembic_over_the_copy(ini, "-x", f"url={db}", "downgrade", "-1")
    assert down.returncode == 0, down.stderr
    assert f"Running downgrade {rev} -> {head}, a thing table\n" in down.stderr
    assert state() == ([(head,)], [])
    offline = alembic_over_the_copy(ini, "upgrade", f"{head}:head", "--sql")
    assert offline.returncode == 0, offline.stderr
    assert f"-- Running upgrade {head} -> {rev}\n\nCREATE TABLE harel_things" in offline.stdout
    history = alembic_over_the_copy(ini, "history", "-r", f"{head}:")
    assert history.stdout.startswith(f"{head} -> {rev} (head), a thing table\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "café crème"], "a revision is named from its message in ASCII letters, digits"),
        ([], "a revision is named from its message: alembic revision -m 'what it does'"),
        (["-m", "x", "--rev-id", "0001"], "not 0001: they are numbered in order"),
    ],
)
def test_alembic_revision_refuses_what_would_break_the_numbered_chain(
    args: list[str], message: str, tmp_path: Path
) -> None:
    ini = copy_of_the_migrations(tmp_path)
    before = files_under(tmp_path)
    failure = alembic_failure(revision(ini, *args), [])
    assert message in failure
    assert files_under(tmp_path) == before
