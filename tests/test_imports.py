"""What a process imports: the package's public names load their modules when first asked
for, and ``migrate`` imports Alembic only when it runs it (each is ~0.1-0.7 s of CPU a
process, and a test run starts ~1,600 of them)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import harel_store
from harel_store import HEAD, LibsqlStore
from tests.helpers import refused_port

# Runs the CLI's `main` with the given arguments in a fresh interpreter; prints, as the last
# line of stdout, its exit status and which of the watched modules it imported.
_PROBE = """
import json, sys
from harel_store.cli import main
status = main(sys.argv[1:])
watched = ("alembic", "sqlalchemy", "harel_store.aio", "harel_store.relay", "asyncio")
print(json.dumps({"status": status, "imported": [m for m in watched if m in sys.modules]}))
"""


def probe(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_"))}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**base, **(env or {})},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    *printed, last = result.stdout.splitlines()
    return json.loads(last), "\n".join(printed) + result.stderr


def printed(code: str) -> list[str]:
    """The lines ``code`` prints, run in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_importing_the_package_imports_none_of_its_modules() -> None:
    prefixes = "('harel_store.', 'pydantic', 'asyncio')"
    code = f"import sys, harel_store; print([m for m in sys.modules if m.startswith({prefixes})])"
    assert printed(code) == ["[]"]


def test_every_public_name_resolves_once_asked_for() -> None:
    code = "import harel_store as h; print(all(getattr(h, n) is getattr(h, n) for n in h.__all__))"
    assert printed(code) == ["True"]
    assert set(harel_store.__all__) <= set(dir(harel_store))
    assert harel_store.LibsqlStore.__module__ == "harel_store.store"
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        harel_store.Nope  # noqa: B018
    with pytest.raises(ImportError):
        from harel_store import Nope  # type: ignore[attr-defined]  # noqa: F401


def test_a_submodule_is_an_attribute_of_the_package_as_before() -> None:
    """`import harel_store` once imported every module, so `harel_store.store.StoreStats`
    worked (the docs name it so): it still does, a module imported when asked for; a module
    that a submodule needs and that is missing is said, not hidden as a missing attribute."""
    code = (
        "import harel_store\n"
        "print(harel_store.store.StoreStats.__name__, harel_store.errors.StoreError.__name__)\n"
        "names = sorted(vars(harel_store))\n"
        "odd = ('nope', 'a.b', '..x', '', '__main__', '_repr_html_', 'connection.http')\n"
        "print([hasattr(harel_store, name) for name in odd], sorted(vars(harel_store)) == names)\n"
        "try:\n    harel_store.nope\n"
        "except AttributeError as exc:\n    print(exc)\n"
    )
    assert printed(code) == [
        "StoreStats StoreError",
        # an AttributeError each, nothing imported or kept (__main__ would run the CLI)
        f"{[False] * 7} True",
        "module 'harel_store' has no attribute 'nope'",
    ]
    code = (
        "import sys; sys.modules['pydantic'] = None  # as if it were not installed\n"
        "import harel_store\n"
        "try:\n    harel_store.models\n"
        "except ModuleNotFoundError as exc:\n    print(exc.name)\n"
    )
    assert printed(code) == ["pydantic"]


# A sync store's path on the stores ``sys.argv[1:]`` names (a file, opened by libsql and a
# second file by sqlite3; or a replica's file and its primary's URL, the token in
# $HAREL_AUTH_TOKEN): a commit, a wait_for that returns at once and one that waits out its
# timeout, a sync relay's round (its handler acks), a claim and an ack, a listing, a
# close; a fleet's name, and an HTTP client's refused request (to the port in $REFUSED).
# Prints whether asyncio was imported, then makes the first async use and prints what it
# read.
_SYNC_PATH = """
import os, sys
from harel_store import Event, Execution, Fleet, LibsqlStore, Relay, SqliteStore
from harel_store.connection.http import Client, ConnectFailed
token = os.environ.get("HAREL_AUTH_TOKEN", "")
if len(sys.argv) == 2:  # two files, one library each
    stores = [(LibsqlStore, sys.argv[1], {}), (SqliteStore, sys.argv[1] + ".sqlite", {})]
else:  # a server, and a replica of it
    replica, url = sys.argv[1:]
    stores = [(LibsqlStore, url, {"auth_token": token}),
              (LibsqlStore, replica, {"auth_token": token, "sync_url": url})]
handled = []
for n, (kind, where, options) in enumerate(stores):
    with kind(where, **options) as store:
        exe = Execution(id=f"e{n}", definition_id="d", status="finished")
        store.commit(exe, [(None, Event(name="e"))], timers=[])
        store.wait_for(exe.id, timeout=5)
        store.save(Execution(id=f"r{n}", definition_id="d"))
        try:
            store.wait_for(f"r{n}", timeout=0.3)  # running: its reader waits, and times out
        except TimeoutError:
            pass
        Relay(store, "w", on_outbox=handled.append).run_once()
        store.commit(store.load(f"e{n}"), [(None, Event(name="f"))])
        store.ack(store.claim_outbox("w", limit=10))
        assert store.list_executions().items
assert len(handled) == len(stores), handled
client = Client(f"http://127.0.0.1:{os.environ['REFUSED']}", headers={}, timeout=1,
                ssl_context=None)
try:
    client.post("/v2/pipeline", b"{}")
except ConnectFailed:
    pass
client.close()
print("asyncio" in sys.modules)
from harel_store import AsyncLibsqlStore
import asyncio
async def main():
    where, options = stores[0][1], stores[0][2]
    async with await AsyncLibsqlStore.create(where, **options) as store:
        return (await store.load("e0")).status
print(asyncio.run(main()))
"""


def sync_path(*where: str, cwd: Path, token: str = "") -> list[str]:
    env = {**os.environ, "HAREL_AUTH_TOKEN": token, "REFUSED": str(refused_port())}
    done = subprocess.run(
        [sys.executable, "-c", _SYNC_PATH, *where],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_sync_store_and_a_cli_command_import_no_asyncio(tmp_path: Path) -> None:
    """A process that runs no loop imports no asyncio (`harel_store.lazy`): not on a sync
    store's path on files (`_SYNC_PATH`), nor in a CLI command (the probe watches for it);
    the first async use imports it then."""
    db = tmp_path / "state.db"
    assert sync_path(str(db), cwd=tmp_path) == ["False", "finished"]
    result, said = probe("status", "--url", str(db), cwd=tmp_path)
    assert result == {"status": 0, "imported": []}, said


@pytest.mark.sqld
def test_a_sync_remote_store_and_a_replica_import_no_asyncio(server: Any, tmp_path: Path) -> None:
    """Over a server, and a replica of it, as on a file: closing a remote store looked for a
    running loop (importing asyncio to look)."""
    replica = str(tmp_path / "replica.db")
    assert sync_path(replica, server.url, cwd=tmp_path, token=server.token) == [
        "False",
        "finished",
    ]
    env = {"HAREL_AUTH_TOKEN": server.token}
    result, said = probe("status", "--url", server.url, cwd=tmp_path, env=env)
    assert result == {"status": 0, "imported": []}, said


def test_migrate_with_nothing_to_do_runs_no_alembic(tmp_path: Path) -> None:
    db = tmp_path / "at.db"
    LibsqlStore(db).close()
    result, said = probe("migrate", "--url", str(db), cwd=tmp_path)
    assert result == {"status": 0, "imported": []}
    assert said.strip() == f"{db}: schema at revision {HEAD} (head {HEAD})"
    # At another revision than --to, Alembic runs (down, then up again).
    result, said = probe("migrate", "--url", str(db), "--to", "0011", cwd=tmp_path)
    assert result["status"] == 0 and "alembic" in result["imported"]
    assert "Running downgrade 0012 -> 0011" in said
    result, said = probe("migrate", "--url", str(db), "--to", "0011", cwd=tmp_path)
    assert result == {"status": 0, "imported": []}
    assert said.strip() == f"{db}: schema at revision 0011 (head {HEAD})"
    result, said = probe("migrate", "--url", str(db), cwd=tmp_path)
    assert "Running upgrade 0011 -> 0012" in said
    with LibsqlStore(db, migrate=False) as store:
        assert store.schema_revision == HEAD


@pytest.mark.sqld
def test_migrate_on_a_server_imports_no_alembic_in_the_command_itself(
    server: Any, tmp_path: Path
) -> None:
    """Its child runs the migration (`run_bounded`): the command that waits on it needs none."""
    env = {"HAREL_AUTH_TOKEN": server.token}
    result, said = probe("migrate", "--url", server.url, cwd=tmp_path, env=env)
    assert result == {"status": 0, "imported": []}
    assert said.strip().endswith(f"schema at revision {HEAD} (head {HEAD})")
    assert server.token not in said


def test_the_lazy_table_names_what_type_checkers_see() -> None:
    """`_MODULE_OF` and the `TYPE_CHECKING` imports list the same names from the same modules
    (mypy reads the one, Python the other) and the public names."""
    tree = ast.parse(Path(harel_store.__file__).read_text(encoding="utf-8"))
    (block,) = [
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    ]
    typed = {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert typed == harel_store._MODULE_OF
    assert set(typed) == set(harel_store.__all__)
