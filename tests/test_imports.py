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

# Runs the CLI's `main` with the given arguments in a fresh interpreter; prints, as the last
# line of stdout, its exit status and which of the watched modules it imported.
_PROBE = """
import json, sys
from harel_store.cli import main
status = main(sys.argv[1:])
watched = ("alembic", "sqlalchemy", "harel_store.aio", "harel_store.relay")
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


def test_a_sync_store_and_a_cli_command_import_no_asyncio(tmp_path: Path) -> None:
    """A process that runs no loop imports no asyncio (`harel_store.lazy`), through a sync
    store's whole path (a commit, reads, wait_for, a claim and an ack, a server's HTTP
    client's request) and a CLI command; the first async use imports it then."""
    db = tmp_path / "LibsqlStore.db"
    code = f"""
import sys
from harel_store import Event, Execution, LibsqlStore, SqliteStore
from harel_store.connection.http import Client, ConnectFailed
for kind in (LibsqlStore, SqliteStore):  # one library a file
    with kind(f"{tmp_path}/{{kind.__name__}}.db") as store:
        exe = Execution(id=kind.__name__, definition_id="d", status="finished")
        store.commit(exe, [(None, Event(name="e"))], timers=[])
        store.wait_for(exe.id, timeout=5)
        store.ack(store.claim_outbox("w", limit=10))
        assert store.list_executions().items
client = Client("http://127.0.0.1:9", headers={{}}, timeout=1, ssl_context=None)
try:
    client.post("/v2/pipeline", b"{{}}")  # nothing listens on port 9: refused
except ConnectFailed:
    pass
client.close()
print("asyncio" in sys.modules)
from harel_store import AsyncLibsqlStore
import asyncio
async def main():
    async with await AsyncLibsqlStore.create({str(db)!r}) as store:
        return (await store.load("LibsqlStore")).status
print(asyncio.run(main()))
"""
    assert printed(code) == ["False", "finished"]
    result, said = probe("status", "--url", str(db), cwd=tmp_path)
    assert result["status"] == 0 and said
    code = _PROBE.replace('"harel_store.relay"', '"harel_store.relay", "asyncio"')
    out = subprocess.run(
        [sys.executable, "-c", code, "status", "--url", str(db)],
        capture_output=True, text=True, cwd=tmp_path, timeout=120, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout.splitlines()[-1]) == {"status": 0, "imported": []}


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
