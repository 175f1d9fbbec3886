"""One database-URL grammar (`harel_store.connection.url`) through the library, Alembic and
the CLI, on a local file and on a real sqld with token auth on. Every form is opened for
real (save, then load back); a form that cannot be honoured is refused with nothing written;
the token is never printed."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import sqlite3
import traceback
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    HEAD,
    AsyncLibsqlStore,
    Execution,
    LibsqlStore,
    SchemaError,
    SqliteStore,
    StoreError,
)
from harel_store.connection.url import (
    DatabaseURL,
    alembic_url,
    database_from_env,
    is_remote,
    migration_hint,
    parse_database,
    show,
    token_from_env,
)
from tests.helpers import ALEMBIC
from tests.in_process import alembic_in_process
from tests.sqld import SqldServer
from tests.test_cli import cli, failed, ok

ENV_NAMES = ("HAREL_DATABASE_URL", "TURSO_DATABASE_URL", "HAREL_AUTH_TOKEN", "TURSO_AUTH_TOKEN")

# A local form, and the file it names ({tmp}: the test's directory, also the working one).
LOCAL_FORMS = [
    ("state.db", "state.db"),
    ("file:state.db", "state.db"),
    ("file:sub/state.db", "sub/state.db"),
    ("file://{tmp}/abs.db", "abs.db"),
    ("file://localhost{tmp}/abs.db", "abs.db"),
    ("sqlite+libsql:///state.db", "state.db"),
    ("sqlite+libsql:///sub/state.db", "sub/state.db"),
    ("sqlite+libsql:///{tmp}/abs.db", "abs.db"),
    ("file:odd%20name.db", "odd name.db"),
]
# A form reaching the plain-HTTP sqld ({hp}: 127.0.0.1:PORT); {token}: its token.
REMOTE_FORMS = [
    "http://{hp}",
    "http://{hp}/",
    "ws://{hp}",
    "libsql://{hp}?tls=0",
    "sqlite+libsql://{hp}?secure=false",
    "sqlite+libsql://{hp}",  # sqlalchemy-libsql's default: secure=false
    "http://{hp}?authToken={token}",
    "libsql://{hp}?tls=0&authToken={token}",
    "sqlite+libsql://{hp}?authToken={token}&secure=false",
]
# A form meaning TLS: against the plain-HTTP sqld it must fail, and say why.
TLS_FORMS = [
    "https://{hp}",
    "libsql://{hp}",
    "libsql://{hp}?tls=1",
    "wss://{hp}",
    "sqlite+libsql://{hp}?secure=true",
]
# Refused, naming what is wrong and never the secret in it.
REFUSED = [
    ("file:f.db?mode=ro", "cannot honour URI options (mode)"),
    ("file:f.db?cache=shared&mode=rwc", "(cache, mode)"),
    ("file:f.db?authToken=SECRET", "an authToken means nothing to it"),
    ("f.db?authToken=SECRET", "an authToken means nothing to it"),
    ("f.db?x=1&authToken=SECRET", "an authToken means nothing to it"),
    ("sqlite+libsql:///f.db?authToken=SECRET", "an authToken means nothing to it"),
    ("sqlite+libsql:///f.db?timeout=5", "cannot honour URI options (timeout)"),
    ("file://otherhost/f.db", "names a file on this machine"),
    ("file:f%00.db", "must not contain a NUL character"),
    ("http://user:SECRET/x@h:1", "takes no user name or password"),
    ("https://user:SE?SECRET@h", "takes no user name or password"),
    ("libsql://u:SECRET#x@h", "takes no user name or password"),
    ("sqlite+libsql://u:x/SECRET@h:1?secure=true", "takes no user name or password"),
    ("sqlite+libsql:///f%00.db", "must not contain a NUL character"),
    ("file:", "no path"),
    ("file:f.db#SECRET", "no #fragment"),
    ("http://127.0.0.1:1?foo=SECRET", "unknown query parameter 'foo'"),
    ("http://127.0.0.1:1?tls=0", "unknown query parameter 'tls'"),
    ("libsql://127.0.0.1:1?secure=false", "unknown query parameter 'secure'"),
    ("http://127.0.0.1:1?SECRET", "each query parameter must be name=value"),
    ("libsql://127.0.0.1:1?tls=SECRET", "tls must be 1 or 0"),
    ("sqlite+libsql://127.0.0.1:1?secure=SECRET", "secure must be true or 1 or false or 0"),
    ("http://127.0.0.1:1?authToken=", "authToken= is empty"),
    ("http://127.0.0.1:1?authToken=SECRET&authToken=SECRET", "'authToken' is given twice"),
    ("http://user:SECRET@127.0.0.1:1", "takes no user name or password"),
    # An @ in the token or a fragment: nothing after it may be shown as if it were the host.
    ("http://127.0.0.1:1/?authToken=SE@SECRET", "takes no user name or password"),
    ("libsql://h?tls=0&authToken=SE/x@SECRET.example:9", "takes no user name or password"),
    ("http://127.0.0.1:1#x@SECRET", "takes no user name or password"),
    ("http://127.0.0.1:1#SECRET", "no #fragment"),
    ("http://127.0.0.1:99999", "the port must be a number"),
    ("http://", "names no host"),
    ("postgres://SECRET@db/x", "unknown scheme postgres://"),
]


@pytest.fixture(autouse=True)
def _no_database_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's directory, as the working one (where a relative form lands)."""
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def own_sqld() -> Iterator[SqldServer]:
    """A server of this module's own, for Alembic to move between base and head."""
    with SqldServer(auth=True) as srv:
        yield srv


@pytest.fixture
def own_server(own_sqld: SqldServer) -> SqldServer:
    """That server at head, whatever the test before it (on this worker) left it at."""
    LibsqlStore(own_sqld.url, auth_token=own_sqld.token, migrate=True).close()
    return own_sqld


def fill(form: str, srv: SqldServer | None = None, tmp: Path | None = None) -> str:
    hp = f"127.0.0.1:{srv.port}" if srv else ""
    return form.format(hp=hp, token=srv.token if srv else "", tmp=tmp or "")


def roundtrip(database: str, **options: Any) -> None:
    """Save and load one execution through LibsqlStore, another through AsyncLibsqlStore."""
    with LibsqlStore(database, **options) as store:
        store.save(Execution(id="sync", definition_id="d"))
        assert store.load("sync") is not None

    async def main() -> None:
        async with await AsyncLibsqlStore.create(database, **options) as store:
            await store.save(Execution(id="async", definition_id="d"))
            assert await store.load("async") is not None

    asyncio.run(main())


def ids_in(path: Path) -> list[str]:
    with closing(sqlite3.connect(path)) as conn:
        return sorted(r[0] for r in conn.execute("SELECT id FROM harel_executions"))


def entries(directory: Path) -> set[str]:
    """What is in ``directory``, its ``sub`` folder included (no WAL or SHM files)."""
    found = {p.relative_to(directory).as_posix() for p in directory.rglob("*")}
    return {name for name in found if not name.endswith(("-wal", "-shm")) and name != "sub"}


# --- the grammar ---


def test_each_form_means_one_database() -> None:
    cases: list[tuple[str | Path, str | None, str | None]] = [
        (":memory:", ":memory:", None),
        (Path("file:x.db"), "file:x.db", None),  # a Path is always a path
        ("a:b.db", "a:b.db", None),  # a colon, no //: a file name
        ("a?b=c.db", "a?b=c.db", None),  # so is a '?' in a path (not in a URL)
        ("file::memory:", ":memory:", None),
        ("sqlite+libsql://", ":memory:", None),
        ("sqlite+libsql:///:memory:", ":memory:", None),
        ("sqlite:///x.db", "x.db", None),  # SQLAlchemy's own sqlite:// reads alike
        ("sqlite+libsql:///a%3Fb.db", "a?b.db", None),
        ("https://h", None, "https://h"),
        ("HTTP://h:1/p", None, "http://h:1/p"),
        ("libsql://h", None, "https://h"),
        ("libsql://h:1?tls=0", None, "http://h:1"),
        ("ws://h:1", None, "http://h:1"),
        ("wss://h", None, "https://h"),
        ("sqlite+libsql://h:1", None, "http://h:1"),
        ("sqlite+libsql://h:1?secure=TRUE", None, "https://h:1"),
        ("sqlite+libsql://h:1/db?secure=false", None, "http://h:1/db"),
    ]
    for form, local, remote in cases:
        db = parse_database(form)
        assert (db.local, db.remote) == (local, remote), form
        assert is_remote(form) == (remote is not None)


def test_a_token_in_the_url_wins_and_is_never_shown() -> None:
    db = parse_database("libsql://h?authToken=URLTOKEN&tls=0", auth_token="ARG")
    assert db.auth_token == "URLTOKEN" and db.remote == "http://h"
    assert "URLTOKEN" not in repr(db) + db.where + str(db) + alembic_url(db) + migration_hint(db)
    assert db.where == "libsql://h?tls=0"  # tls= stays: it changes what the URL means
    assert parse_database("http://h", auth_token="ARG").auth_token == "ARG"
    assert show("sqlite+libsql://u:p@h:1?authToken=T&secure=false#f") == (
        "sqlite+libsql://h:1?secure=false"
    )
    assert show("file:f.db?authToken=T") == "file:f.db"


@pytest.mark.parametrize(("form", "message"), REFUSED)
def test_a_form_that_cannot_be_honoured_is_refused_with_nothing_written(
    form: str, message: str, here: Path
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        parse_database(form)
    assert "SECRET" not in str(info.value)
    for opener in (LibsqlStore, SqliteStore):
        with pytest.raises(ValueError) as info:
            opener(form)
        assert "SECRET" not in "".join(traceback.format_exception(info.value))
    with pytest.raises(ValueError):
        asyncio.run(AsyncLibsqlStore.create(form))
    with pytest.raises(ValueError):
        LibsqlStore(here / "replica.db", sync_url=form)
    assert entries(here) == set()


def test_wrong_types_are_refused() -> None:
    with pytest.raises(TypeError, match="auth_token must be a string"):
        parse_database("http://h", auth_token=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="database must be a path or a URL"):
        parse_database(8080)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a server's URL"):
        LibsqlStore("r.db", sync_url="file:primary.db")
    with pytest.raises(ValueError, match="a local file, not a server"):
        SqliteStore("libsql://h")


def test_the_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (database_from_env(), token_from_env()) == ("harel.db", "")
    monkeypatch.setenv("TURSO_DATABASE_URL", "libsql://turso")
    monkeypatch.setenv("TURSO_AUTH_TOKEN", "t-token")
    assert (database_from_env(), token_from_env()) == ("libsql://turso", "t-token")
    monkeypatch.setenv("HAREL_DATABASE_URL", "harel.example.db")
    monkeypatch.setenv("HAREL_AUTH_TOKEN", "h-token")
    assert (database_from_env(), token_from_env()) == ("harel.example.db", "h-token")
    assert database_from_env("given.db") == "given.db"
    with pytest.raises(ValueError, match="the database URL is empty"):
        database_from_env("")
    monkeypatch.setenv("HAREL_DATABASE_URL", "")  # set and empty counts as unset
    assert database_from_env() == "libsql://turso"
    from harel_store import migrate  # its older names still work

    assert migrate.database_from_env() == "libsql://turso"
    assert migrate.sqlalchemy_url("ws://h:1") == "sqlite+libsql://h:1?secure=false"


def test_the_alembic_form_of_each_database(tmp_path: Path) -> None:
    assert alembic_url("state.db") == "sqlite+libsql:///state.db"
    assert alembic_url(tmp_path / "a b.db") == f"sqlite+libsql:///{tmp_path}/a%20b.db"
    assert alembic_url("file:f.db") == "sqlite+libsql:///f.db"
    assert alembic_url("libsql://h:1?tls=0&authToken=T") == "sqlite+libsql://h:1?secure=false"
    assert alembic_url("libsql://h") == "sqlite+libsql://h?secure=true"
    assert alembic_url(DatabaseURL(None, "https://h/", "h")) == "sqlite+libsql://h?secure=true"
    assert migration_hint("http://127.0.0.1:8080?authToken=T") == (
        "alembic -x 'url=sqlite+libsql://127.0.0.1:8080?secure=false' upgrade head"
    )
    for form, _ in LOCAL_FORMS:  # the Alembic form names the same file
        form = fill(form, tmp=tmp_path)
        assert parse_database(alembic_url(form)).local == parse_database(form).local


# --- the library ---


@pytest.mark.parametrize(("form", "name"), LOCAL_FORMS)
def test_the_library_opens_each_local_form(form: str, name: str, here: Path) -> None:
    roundtrip(fill(form, tmp=here))
    assert entries(here) == {name}  # that file, and no file named like the URL
    assert ids_in(here / name) == ["async", "sync"]


@pytest.mark.sqld
@pytest.mark.parametrize("form", REMOTE_FORMS)
def test_the_library_opens_each_remote_form(form: str, server: SqldServer, here: Path) -> None:
    url = fill(form, server)
    # A token in the URL wins over the argument (a token the server refuses).
    token = server.foreign_token() if "authToken" in form else server.token
    roundtrip(url, auth_token=token)
    assert server.rows("SELECT id FROM harel_executions ORDER BY id") == [("async",), ("sync",)]
    assert entries(here) == set()  # not opened as a local file named like the URL
    # Without the token, or with the right one as the argument and a wrong one in the URL:
    # refused, and neither token is shown.
    wrong = url.replace(server.token, server.foreign_token())
    with pytest.raises(StoreError, match="authentication failed") as info:
        LibsqlStore(wrong, auth_token=server.token) if wrong != url else LibsqlStore(url)
    assert server.token not in str(info.value) and "eyJ" not in str(info.value)


@pytest.mark.sqld
def test_a_replica_takes_its_primary_in_any_remote_form(server: SqldServer, here: Path) -> None:
    for n, form in enumerate(("ws://{hp}?authToken={token}", "libsql://{hp}?tls=0")):
        with LibsqlStore(f"r{n}.db", sync_url=fill(form, server), auth_token=server.token) as r:
            r.save(Execution(id=f"r{n}", definition_id="d"))
    assert server.rows("SELECT id FROM harel_executions ORDER BY id") == [("r0",), ("r1",)]


@pytest.mark.sqld
@pytest.mark.parametrize("form", TLS_FORMS)
def test_a_tls_form_at_a_plain_http_server_says_what_to_write(
    form: str, server: SqldServer, here: Path
) -> None:
    url = fill(form, server)
    for open_store in (
        lambda: LibsqlStore(url, auth_token=server.token),
        lambda: asyncio.run(AsyncLibsqlStore.create(url, auth_token=server.token)),
    ):
        with pytest.raises(StoreError) as info:
            open_store()
        message = str(info.value)
        assert message.startswith(f"cannot reach {show(url)}: TLS handshake failed: [SSL"), message
        hp = f"127.0.0.1:{server.port}"
        assert message.endswith(
            "the server answered without TLS: for a plain-HTTP server use "
            f"http://{hp} or libsql://{hp}?tls=0"
        )
        assert "\n" not in message
        assert server.token not in "".join(traceback.format_exception(info.value))
    assert entries(here) == set()


# --- Alembic ---


def alembic(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    result = alembic_in_process([*ALEMBIC, *args], cwd=cwd, env={**base, **(env or {})})
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


@pytest.mark.parametrize(("form", "name"), LOCAL_FORMS)
def test_alembic_reads_each_local_form(form: str, name: str, here: Path) -> None:
    alembic("-x", f"url={fill(form, tmp=here)}", "upgrade", "head", cwd=here)
    assert entries(here) == {name}
    with LibsqlStore(here / name, migrate=False) as store:
        assert store.schema_revision == HEAD


@pytest.mark.slow
@pytest.mark.sqld
def test_alembic_reads_each_remote_form(own_server: SqldServer, tmp_path: Path) -> None:
    env = {"HAREL_AUTH_TOKEN": own_server.token}
    foreign = {"HAREL_AUTH_TOKEN": own_server.foreign_token()}  # the URL's token wins
    forms = [
        ("ws://{hp}", env),
        ("libsql://{hp}?tls=0", env),
        ("http://{hp}?authToken={token}", foreign),
        ("sqlite+libsql://{hp}?secure=false&authToken={token}", {}),
        ("sqlite+libsql://{hp}", env),
    ]
    # One write through each form, down and up in turn from head (each run is ~2.5 s of CPU
    # with its child), the server's state checked after it.
    for i, (form, token_env) in enumerate(forms):
        url = fill(form, own_server)
        if i % 2 == 0:
            out = alembic("-x", f"url={url}", "downgrade", "base", cwd=tmp_path, env=token_env)
            tables = "SELECT name FROM sqlite_master WHERE name LIKE 'harel%'"
            assert own_server.rows(tables) == []
        else:
            out = alembic("-x", f"url={url}", "upgrade", "head", cwd=tmp_path, env=token_env)
            assert own_server.rows("SELECT version_num FROM alembic_version") == [(HEAD,)]
        assert own_server.token not in out
    assert entries(tmp_path) == set()


@pytest.mark.sqld
def test_alembic_takes_the_turso_environment(own_server: SqldServer, tmp_path: Path) -> None:
    turso = {"TURSO_DATABASE_URL": fill("libsql://{hp}?tls=0", own_server)}
    turso["TURSO_AUTH_TOKEN"] = own_server.token
    assert f"{HEAD} (head)" in alembic("current", cwd=tmp_path, env=turso)
    # HAREL_* come first: the file, not the server (whose token is still TURSO_'s).
    alembic("upgrade", "head", cwd=tmp_path, env={**turso, "HAREL_DATABASE_URL": "h.db"})
    assert entries(tmp_path) == {"h.db"}


def test_the_behind_head_hint_is_a_command_that_works(here: Path) -> None:
    db = "file:behind.db"
    with pytest.raises(SchemaError) as info:
        LibsqlStore(db, migrate=False)
    command = re.findall(r"`(alembic [^`]*)`", str(info.value))
    assert command == [migration_hint("behind.db")]
    alembic(*shlex.split(command[0])[1:], cwd=here)
    with LibsqlStore(db, migrate=False) as store:
        assert store.schema_revision == HEAD


@pytest.mark.sqld
def test_the_behind_head_hint_on_a_server(own_server: SqldServer, tmp_path: Path) -> None:
    url = fill("libsql://{hp}?tls=0&authToken={token}", own_server)
    env = {"HAREL_AUTH_TOKEN": own_server.token}
    alembic("-x", f"url={url}", "downgrade", "base", cwd=tmp_path)
    with pytest.raises(SchemaError) as info:
        LibsqlStore(url)
    message = str(info.value)
    assert own_server.token not in message
    hp = f"127.0.0.1:{own_server.port}"
    assert f"harel-store migrate --url 'libsql://{hp}?tls=0'" in message
    command = re.findall(r"`(alembic [^`]*)`", message)
    assert command == [f"alembic -x 'url=sqlite+libsql://{hp}?secure=false' upgrade head"]
    alembic(*shlex.split(command[0])[1:], cwd=tmp_path, env=env)
    with LibsqlStore(url) as store:
        assert store.schema_revision == HEAD


# --- the CLI ---


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None, secret: str = "") -> str:
    """``harel-store ARGS``: its stdout; it must succeed and print no token."""
    result = cli(*args, cwd=cwd, env=env)
    if secret:
        assert secret not in result.stdout + result.stderr
    return ok(result)


@pytest.mark.parametrize(("form", "name"), LOCAL_FORMS)
def test_the_cli_reads_each_local_form(form: str, name: str, here: Path) -> None:
    url = fill(form, tmp=here)
    assert f"schema at revision {HEAD}" in run_cli("migrate", "--url", url, cwd=here)
    assert entries(here) == {name}  # not `file:state.db` nor `sqlite+libsql:` (old bugs)
    assert "executions" in run_cli("status", "--url", url, cwd=here)
    assert "matches head" in run_cli("schema", "--check", "--url", url, cwd=here)


def test_the_cli_environment_on_a_file(here: Path) -> None:
    run_cli("migrate", cwd=here, env={"TURSO_DATABASE_URL": "file:t.db"})
    assert entries(here) == {"t.db"}
    env = {"TURSO_DATABASE_URL": "file:t.db", "HAREL_DATABASE_URL": "sqlite+libsql:///h.db"}
    run_cli("migrate", cwd=here, env=env)  # HAREL_ first
    assert entries(here) == {"t.db", "h.db"}
    run_cli("migrate", "--url", "q?x=1.db", cwd=here)  # a '?' in a path is part of its name
    assert entries(here) == {"t.db", "h.db", "q?x=1.db"}
    assert "matches head" in run_cli("schema", "--check", "--url", "q?x=1.db", cwd=here)
    line = failed(cli("status", "--url", "file:t.db?mode=ro", cwd=here), 2)
    assert "cannot honour URI options (mode)" in line
    line = failed(cli("status", "--url", "sqlite+libsql:///t.db?authToken=SECRET", cwd=here), 2)
    assert "an authToken means nothing to it" in line and "SECRET" not in line
    for empty in ("", "  "):  # an unset variable in a script: not a reason to open harel.db
        line = failed(cli("status", "--url", empty, cwd=here, env=env), 2)
        assert "the database URL is empty" in line
    assert entries(here) == {"t.db", "h.db", "q?x=1.db"}


def test_the_cli_behind_head_names_both_commands(here: Path) -> None:
    run_cli("migrate", "--url", "file:b.db", "--to", "base", cwd=here)
    line = failed(cli("status", "--url", "file:b.db", cwd=here))
    assert "`harel-store migrate --url b.db`" in line
    assert f"`{migration_hint('b.db')}`" in line


@pytest.mark.slow
@pytest.mark.sqld
def test_the_cli_reads_each_remote_form(own_server: SqldServer, here: Path) -> None:
    token = own_server.token
    env = {"HAREL_AUTH_TOKEN": token}
    hp = f"127.0.0.1:{own_server.port}"
    run_cli("migrate", "--url", f"ws://{hp}", "--to", "base", cwd=here, env=env, secret=token)
    line = failed(cli("status", "--url", f"libsql://{hp}?tls=0", cwd=here, env=env))
    assert f"alembic -x 'url=sqlite+libsql://{hp}?secure=false' upgrade head" in line
    for form, form_env in [
        ("sqlite+libsql://{hp}?secure=false", env),
        ("libsql://{hp}?tls=0", env),
        ("ws://{hp}", {"TURSO_AUTH_TOKEN": token}),
        ("http://{hp}?authToken={token}", {"HAREL_AUTH_TOKEN": own_server.foreign_token()}),
    ]:
        url = fill(form, own_server)
        out = run_cli("migrate", "--url", url, cwd=here, env=form_env, secret=token)
        assert f"schema at revision {HEAD}" in out
        assert "executions" in run_cli("status", "--url", url, cwd=here, env=form_env, secret=token)
        assert "matches head" in run_cli(
            "schema", "--check", "--url", url, cwd=here, env=form_env, secret=token
        )
    assert entries(here) == set()  # none opened as a local file named like the URL


@pytest.mark.sqld
def test_the_cli_takes_the_turso_environment(own_server: SqldServer, here: Path) -> None:
    turso = {
        "TURSO_DATABASE_URL": fill("libsql://{hp}?tls=0", own_server),
        "TURSO_AUTH_TOKEN": own_server.token,
    }
    assert "executions" in run_cli("status", cwd=here, env=turso, secret=own_server.token)
    # HAREL_* win: HAREL_AUTH_TOKEN (refused) over TURSO_AUTH_TOKEN; then the file over both.
    refused = cli("status", cwd=here, env={**turso, "HAREL_AUTH_TOKEN": "x" + own_server.token})
    assert "authentication failed" in failed(refused)
    assert own_server.token not in refused.stderr
    run_cli("migrate", cwd=here, env={**turso, "HAREL_DATABASE_URL": "h.db"})
    assert entries(here) == {"h.db"}


@pytest.mark.slow
@pytest.mark.sqld
def test_the_cli_says_what_to_write_for_a_plain_http_server(
    own_server: SqldServer, here: Path
) -> None:
    hp = f"127.0.0.1:{own_server.port}"
    for form in TLS_FORMS:
        url = fill(form, own_server)
        for command in (("status",), ("migrate",)):
            result = cli(*command, "--url", url, cwd=here, env={"HAREL_AUTH_TOKEN": "T0KEN"})
            line = failed(result)
            assert "T0KEN" not in result.stdout + result.stderr
            if command == ("status",):
                assert f"use http://{hp} or libsql://{hp}?tls=0" in line, line
    assert entries(here) == set()


@pytest.mark.parametrize(
    "url",
    [
        "libsql://host?authtoken=SECRET@evil",  # the parameter's name in any case
        "libsql://host?AuthToken=SEC@RET",
        "libsql://host\\@SECRET",
        "https://host/?x=1&authToken=SEC@RET",
        "libsql://user:SECRET@host",
        "libsql://my-db.turso.io&authToken=SEC@RET.x",  # a & typed for the ?
    ],
)
def test_no_piece_of_a_secret_is_shown_as_a_host(url: str) -> None:
    """An @ after a ? or a backslash may sit inside a token: what follows it is no host."""
    assert "SEC" not in show(url) and "RET" not in show(url), show(url)


def test_a_proxys_repr_holds_no_password(monkeypatch: pytest.MonkeyPatch) -> None:
    """A report of a failing frame's locals (Sentry, capture_locals) shows reprs: the proxy's
    CONNECT request, with its Proxy-Authorization, is not in the proxy's."""
    import base64

    from harel_store.connection import http

    monkeypatch.setenv("HTTPS_PROXY", "http://alice:s3cr%2Ft@127.0.0.1:9")
    client = http.Client("https://db.example.com", headers={}, timeout=2, ssl_context=None)
    try:
        shown = repr(client._proxy)
        assert "s3cr" not in shown and base64.b64encode(b"alice:s3cr/t").decode() not in shown
        assert "127.0.0.1:9" in shown
    finally:
        client.close()
