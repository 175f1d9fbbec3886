"""A hostile review of the console (harel_store.ui): what an attacker or an on-call engineer
would try. The xfail(strict=True) tests are defects found (each its reason); the others are
attacks that were tried and held."""

from __future__ import annotations

import asyncio
import hashlib
import html
import json
import re
import select
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from harel_store import AsyncFleet, Event, Fleet, LibsqlStore, TimerOp, wakeup
from harel_store.sql import MIGRATIONS
from harel_store.ui import app
from tests.helpers import alembic_steps
from tests.test_ui import Client, _close_clients, csrf_of, dead_entry, put  # noqa: F401

HOSTILE = "'\"><img src=x onerror=alert(1)><script>alert(2)</script>"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LibsqlStore]:
    with LibsqlStore(tmp_path / "ui.db") as s:
        yield s


def raw(
    asgi: Any,
    path: str,
    *,
    method: str = "GET",
    headers: list[tuple[bytes, bytes]] | None = None,
    body: bytes = b"",
    root_path: str = "",
    host: bytes | None = b"127.0.0.1",
) -> tuple[int, bytes]:
    """One request straight into the ASGI app (no client normalising the path): status, body."""
    out: list[dict[str, Any]] = []

    async def go() -> None:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(30)
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            out.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": root_path,
            "headers": [*([(b"host", host)] if host is not None else []), *(headers or [])],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        await asgi(scope, receive, send)

    asyncio.run(go())
    return out[0]["status"], b"".join(m.get("body", b"") for m in out)


async def live_for(
    asgi: Any, seconds: float, during: Any = None, query: bytes = b"", last: str = ""
) -> bytes:
    """/live streamed for ``seconds`` (``during``: a coroutine run meanwhile), then the client
    goes away; what the stream sent."""
    gone = asyncio.Event()
    out: list[bytes] = []
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        out.append(message.get("body", b""))

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/live",
        "raw_path": b"/live",
        "query_string": query,
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1")]
        + ([(b"last-event-id", last.encode())] if last else []),
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    task = asyncio.create_task(asgi(scope, receive, send))
    if during is not None:
        await during
    await asyncio.sleep(seconds)
    gone.set()
    await asyncio.wait_for(task, 5)
    return b"".join(out)


# --- defects ---------------------------------------------------------------------------


def test_an_execution_named_dot_dot_is_reachable_from_its_link(store: LibsqlStore) -> None:
    for id in ("..", "."):
        put(store, id)
    c = Client(app(store))
    listing = c.get("/executions").text
    found = re.findall(r'href="(/executions(?:/|\?id=)[^"]+)"', listing)
    hrefs = [html.unescape(h) for h in found]
    assert len(hrefs) == 2
    for href in hrefs:
        # What a browser (and httpx, and urljoin) makes of the link: RFC 3986 dot segments.
        resolved = urljoin("http://127.0.0.1/executions", href)
        assert resolved == f"http://127.0.0.1{href}", (href, resolved)
        page = c.get(href)
        assert "<h1>.</h1>" in page.text or "<h1>..</h1>" in page.text


def in_child(db: Path, query: str) -> str:
    """``query``'s first value, read by another process (this one may hold the file open
    with libsql: one SQLite library per file per process)."""
    code = (
        "import sqlite3, sys;"
        " print(sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchone()[0])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(db), query], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _outward_address() -> str | None:
    """This host's address on its main interface (no packet sent), or None."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.254", 9))
        return str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()


def test_an_address_of_this_host_is_no_rebinding(store: LibsqlStore) -> None:
    # This host's address on its main interface (loopback where it has none), whatever
    # its hostname resolves to.
    address = _outward_address() or "127.0.0.1"
    c = Client(app(store), f"http://{address}:8765")
    assert c.get("/").status_code == 200


def test_an_execution_page_with_a_huge_trace_is_bounded(store: LibsqlStore, tmp_path: Path) -> None:
    put(store, "big")
    # Another writer with trace_max=None keeps every step.
    with LibsqlStore(tmp_path / "ui.db", trace_max=None, synchronous="OFF") as writer:
        for _ in range(1200):
            writer.append_trace("big", {"event": "tick"})
    page = Client(app(store)).get("/executions/big")
    assert page.status_code == 200
    assert page.text.count("<circle") <= 1000


def test_an_execution_page_with_many_timers_is_bounded(store: LibsqlStore) -> None:
    exe = put(store, "many")
    store.commit(exe, [], timers=[TimerOp.schedule(f"t{i}", 4e9 + i) for i in range(3000)])
    page = Client(app(store)).get("/executions/many").text
    assert len(re.findall(r"<tr><td>t\d+</td>", page)) <= 1000


def test_the_listing_of_a_fleet_with_a_dead_database_shows_the_others(tmp_path: Path) -> None:
    with LibsqlStore(tmp_path / "a.db") as s:
        put(s, "a-1")
    with Fleet({"a": str(tmp_path / "a.db"), "gone": "http://127.0.0.1:9"}, timeout=2.0) as f:
        page = Client(app(f)).get("/executions")
        assert page.status_code == 200 and "a-1" in page.text
        assert "cannot reach" in page.text


def test_a_read_only_console_writes_nothing_to_the_file(tmp_path: Path) -> None:
    db = tmp_path / "ro.db"
    with LibsqlStore(db) as s:
        put(s, "a-1")
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode=DELETE").fetchone() == ("delete",)
    conn.close()
    before = hashlib.sha256(db.read_bytes()).hexdigest()
    c = Client(app(str(db)))
    for path in ("/", "/executions", "/executions/a-1", "/dead", "/timers"):
        assert c.get(path).status_code == 200
    # Read by another process: this one has the file open with libsql (the console's).
    assert in_child(db, "PRAGMA journal_mode") == "delete"
    assert hashlib.sha256(db.read_bytes()).hexdigest() == before


def test_the_csrf_token_of_another_page_is_refused(store: LibsqlStore) -> None:
    seq = dead_entry(store)
    guard: Any = app(store, actions=True)
    c = Client(guard)
    form = {"db": "", "kind": "outbox", "key": str(seq)}
    other = {**form, "page": "overview", "csrf": guard.csrf("overview")}
    answer = c.post("/dead/discard", data=other, follow_redirects=False)
    assert answer.status_code == 403
    assert [getattr(d.item, "seq", None) for d in store.dead_letters()] == [seq]


def test_the_login_page_tells_a_stranger_nothing_of_the_database(
    store: LibsqlStore, tmp_path: Path
) -> None:
    c = Client(app(store, token="t0k-secret"))
    page = c.get("/")
    assert page.status_code == 401
    assert str(tmp_path) not in page.text
    status, body = raw(app(store, token="t0k-secret"), "/static/../dead")
    assert status == 404 and str(tmp_path).encode() not in body


@pytest.mark.slow
def test_an_idle_database_without_a_watch_is_not_polled(tmp_path: Path) -> None:
    async def main() -> bytes:
        with LibsqlStore(":memory:") as s:
            put(s, "a")
            return await live_for(app(s), 3.5)

    body = asyncio.run(main())
    assert body.count(b"event: change") <= 1, body


@pytest.mark.slow
def test_the_cli_refuses_a_fleet_with_a_url(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    LibsqlStore(db).close()
    fleet = tmp_path / "fleet.txt"
    fleet.write_text(f"main {db}\n")
    command = [sys.executable, "-m", "harel_store", "--fleet", str(fleet), "ui"]
    command += ["--url", str(tmp_path / "other.db"), "--listen", "127.0.0.1:0"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    end = time.monotonic() + 20
    # Until it exits, or says it serves (then it took the fleet and dropped --url).
    while proc.poll() is None and time.monotonic() < end:
        if select.select([proc.stdout], [], [], 0.1)[0]:
            break
    if proc.poll() is None:
        proc.kill()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and out == b"", (proc.returncode, out, err)
    assert "--url" in err.decode()


# --- what held ----------------------------------------------------------------------------


def test_hostile_text_in_every_stored_field_is_escaped(store: LibsqlStore) -> None:
    exe_id = "x" + HOSTILE
    exe = put(store, exe_id, definition_id=HOSTILE, context={HOSTILE: HOSTILE})
    put(store, "kid" + HOSTILE, parent_id=exe_id)
    store.commit(
        exe,
        [(exe_id, Event(name=HOSTILE))],
        timers=[TimerOp.schedule("t" + HOSTILE, 1.0), TimerOp.schedule("u" + HOSTILE, 1.0)],
        trace={"event": HOSTILE, "transition": HOSTILE, HOSTILE: 1},
    )
    store.claim_outbox(HOSTILE)  # claimed_by shown on the execution's page
    timers = store.claim_due_timers(HOSTILE, 2.0, max_attempts=1)
    store.fail(HOSTILE, [t for t in timers if t.path.startswith("t")], error=HOSTILE)
    store.claim_due_timers(HOSTILE, 2.0, max_attempts=1)
    c = Client(app(store, actions=True))
    for path in ("/", "/executions", f"/executions/{exe_id}", "/dead", "/timers", "/nowhere"):
        text = c.get(path.replace("#", "%23").replace("?", "%3F")).text
        assert "<img" not in text and "<script>alert" not in text, path
        assert "onerror=alert(1)>" not in text, path
    page = c.get("/dead").text
    assert "&lt;img src=x" in page
    # The dead timer's key (JSON in an attribute) survives a round trip, and discards it.
    key = html.unescape(re.findall(r'name="key" value="([^"]+)"', page)[0])
    assert json.loads(key) == [exe_id, "t" + HOSTILE]
    form = {"page": "dead", "db": "", "kind": "timer", "key": key, "csrf": csrf_of(page)}
    assert c.post("/dead/discard", data=form, follow_redirects=False).status_code == 303
    assert store.dead_letters() == []


def test_odd_ids_link_to_their_own_page(store: LibsqlStore) -> None:
    odd = ["a/b", "a?b#c", "%41", "/lead", "a/../b", "a b", "javascript:alert(1)"]
    for id in odd:
        put(store, id)
    c = Client(app(store))
    listing = c.get("/executions").text
    hrefs = [html.unescape(h) for h in re.findall(r'href="(/executions/[^"]+)"', listing)]
    assert len(hrefs) == len(odd) and all(not h.startswith("javascript") for h in hrefs)
    for href in hrefs:
        page = c.get(href)
        assert page.status_code == 200 and "<h1>Executions</h1>" not in page.text, href


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("localhost:1", 200),
        ("LOCALHOST", 200),
        ("[::1]:8765", 200),
        ("127.0.0.1", 200),
        ("", 400),
        ("evil.example", 400),
        ("evil.example:80", 400),
        ("127.0.0.1.evil.example", 400),
        ("localhost.evil.example", 400),
        ("[::1", 400),
        ("evil.example#@127.0.0.1", 400),
    ],
)
def test_host_header_variants(store: LibsqlStore, host: str, status: int) -> None:
    assert raw(app(store), "/", host=host.encode() if host else None)[0] == status


@pytest.mark.parametrize(
    "path",
    [
        "/static/../dead",
        "/static/console.css/../../dead",
        "/static/%2e%2e/dead",
        "/static/x/../../executions",
        "//static/../executions",
        "/login",
        "/live",
    ],
)
def test_no_path_trick_passes_the_token(store: LibsqlStore, path: str) -> None:
    dead_entry(store)
    status, body = raw(app(store, token="t0k"), path)
    assert status in (401, 404)
    assert b"Dead letters</h1>" not in body and b"src-t" not in body and b"boom" not in body


@pytest.mark.parametrize(
    "value",
    [
        "Basic dDBr",
        "Bearer t0",
        "Bearer t0kk",
        "Bearert0k",
        "Token t0k",
        "Bearer",
        "Bearer t0k\x00",
    ],
)
def test_authorization_variants_are_refused(store: LibsqlStore, value: str) -> None:
    asgi = app(store, token="t0k")
    status, _ = raw(asgi, "/", headers=[(b"authorization", value.encode("latin-1"))])
    assert status == 401
    assert raw(asgi, "/", headers=[(b"authorization", b"bEaReR t0k")])[0] == 200
    cookie = [(b"cookie", b"harel_ui_session=t0k")]
    assert raw(asgi, "/", headers=cookie)[0] == 401  # the token is not the cookie


@pytest.mark.parametrize(
    "wanted",
    [
        "//evil.example/",
        "/\\evil.example",
        "\\\\evil.example",
        "https://evil.example/",
        "/\t/evil.example",
        "/\r\nSet-Cookie: x=1",
        "javascript:alert(1)",
        " //evil.example",
    ],
)
def test_the_login_never_redirects_off_site(store: LibsqlStore, wanted: str) -> None:
    c = Client(app(store, token="t0k"))
    answer = c.post("/login", data={"password": "t0k", "next": wanted}, follow_redirects=False)
    assert answer.status_code == 303
    location = answer.headers["location"]
    assert "\r" not in location and "\n" not in location and "\t" not in location
    assert urljoin("http://127.0.0.1/x", location).startswith("http://127.0.0.1/"), location
    assert "set-cookie" in answer.headers and "x=1" not in answer.headers["set-cookie"]


def test_a_mounted_console_with_a_token_logs_in_under_its_prefix(store: LibsqlStore) -> None:
    put(store, "a")
    c = Client(Starlette(routes=[Mount("/ops/console", app=app(store, token="t0k"))]))
    first = c.get("/ops/console/executions?status=running")
    assert first.status_code == 401
    assert 'name="next" value="/ops/console/executions?status=running"' in first.text
    assert 'action="/ops/console/login"' in first.text
    data = {"password": "t0k", "next": "/ops/console/executions?status=running"}
    ok = c.post("/ops/console/login", data=data, follow_redirects=False)
    assert ok.headers["location"] == "/ops/console/executions?status=running"
    assert "Path=/ops/console/" in ok.headers["set-cookie"]
    assert c.get("/ops/console/executions").status_code == 200


def test_forms_that_are_not_the_pages_are_refused(store: LibsqlStore) -> None:
    seq = dead_entry(store)
    c = Client(app(store, actions=True))
    token = csrf_of(c.get("/dead").text)
    form = {"page": "dead", "csrf": token, "db": "", "kind": "outbox", "key": str(seq)}
    query = "&".join(f"{k}={v}" for k, v in form.items())
    assert c.post(f"/dead/discard?{query}").status_code == 403  # in the query: no form
    assert c.post("/dead/discard", json=form).status_code == 403
    assert c.post("/dead/discard", files={"x": b"y"}, data=form).status_code == 403
    huge = {**form, "pad": "x" * 20_000}
    assert c.post("/dead/discard", data=huge).status_code == 403
    for method in ("PUT", "DELETE", "PATCH"):
        assert raw(app(store, actions=True), "/dead/discard", method=method)[0] == 403
    bad = c.post("/dead/discard", data={**form, "key": "9" * 40})
    assert bad.status_code == 400  # an absurd seq: a 400, not a 500
    assert [getattr(d.item, "seq", None) for d in store.dead_letters()] == [seq]


@pytest.mark.slow
def test_a_dropped_stream_leaves_no_listener_nor_watch(store: LibsqlStore) -> None:
    asgi: Any = app(store)
    hub = asgi.close_streams.__self__

    async def main() -> bytes:
        streams = [asyncio.create_task(live_for(asgi, 1.0)) for _ in range(3)]
        await asyncio.sleep(0.5)
        assert hub._listeners == 3 and len(hub._tasks) == 1
        await asyncio.to_thread(put, store, "b")
        bodies = await asyncio.gather(*streams)
        await asyncio.sleep(0.3)
        # The watch outlives the last page for a while (a page opened next finds it warm),
        # and ends with the application.
        assert hub._listeners == 0 and len(hub._tasks) == 1 and hub._idle is not None
        await hub.stop()
        return bodies[0]

    body = asyncio.run(main())
    assert b"event: change" in body
    assert hub._listeners == 0 and hub._tasks == [] and hub._idle is None
    assert store.database_key not in wakeup._waiters
    assert store.database_key not in wakeup._watches


def test_a_database_behind_head_is_shown_so_and_not_migrated(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    with LibsqlStore(db) as s:
        put(s, "x")
    old = MIGRATIONS[-2].revision
    alembic_steps((db, "downgrade", old))
    c = Client(app(str(db)))
    page = c.get("/")
    assert page.status_code == 200 and "behind head" in page.text
    assert in_child(db, "SELECT version_num FROM alembic_version") == old


@pytest.mark.slow
def test_fleet_errors_carry_no_token_and_a_hung_database_times_out(tmp_path: Path) -> None:
    with LibsqlStore(tmp_path / "a.db") as s:
        put(s, "a-1")
    (tmp_path / "junk.db").write_bytes(b"not a database " * 100)
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    databases = {
        "a": str(tmp_path / "a.db"),
        "gone": "http://127.0.0.1:9?authToken=SECRET-TOKEN-42",
        "junk": str(tmp_path / "junk.db"),
        "hung": f"http://127.0.0.1:{hung.getsockname()[1]}/?authToken=PASSWORD-42",
    }
    try:
        with Fleet(databases, timeout=1.0) as fleet:
            c = Client(app(fleet))
            started = time.monotonic()
            page = c.get("/")
            assert time.monotonic() - started < 10
            assert page.status_code == 200 and page.text.count('class="error"') == 3
            for path in ("/", "/dead", "/timers", "/executions", "/executions/a-1"):
                text = c.get(path).text
                assert "SECRET-TOKEN-42" not in text and "PASSWORD-42" not in text, path
    finally:
        hung.close()


def test_an_async_fleet_is_a_source(tmp_path: Path) -> None:
    with LibsqlStore(tmp_path / "a.db") as s:
        put(s, "a-1")

    async def main() -> None:
        fleet = AsyncFleet({"a": str(tmp_path / "a.db")})
        transport = httpx.ASGITransport(app=app(fleet))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            for path in ("/", "/executions", "/executions/a-1", "/dead", "/timers"):
                assert (await c.get(path)).status_code == 200, path
        await fleet.close()

    asyncio.run(main())


def test_invalid_cursors_are_400_on_a_store_and_a_fleet(tmp_path: Path) -> None:
    with LibsqlStore(tmp_path / "a.db") as s:
        put(s, "a-1")
    with Fleet({"a": str(tmp_path / "a.db")}) as fleet:
        for source in (str(tmp_path / "a.db"), fleet):
            c = Client(app(source))
            for cursor in ("x", "e30=", "W10=", "bnVsbA==", "1" * 5000, "%00"):
                answer = c.get("/executions", params={"cursor": cursor})
                assert answer.status_code == 400, cursor
                assert len(answer.text) < 20_000


@pytest.mark.slow
def test_a_stream_is_told_at_once_of_a_change_since_its_page_and_of_nothing_else(
    store: LibsqlStore,
) -> None:
    """A page's stream opens a moment after its render: a commit in between is told as soon
    as it opens (the page was rendered at `since`; a reconnection says its Last-Event-ID),
    and with none, nothing is (no page fetches itself twice)."""
    asgi: Any = app(store)
    hub = asgi.close_streams.__self__

    async def main() -> tuple[bytes, bytes, bytes]:
        warm = asyncio.create_task(live_for(asgi, 4.0))  # another page keeps the watch on
        await asyncio.sleep(0.5)
        rendered = hub.version
        quiet = await live_for(asgi, 0.7, query=f"since={hub.boot}-{rendered}".encode())
        await asyncio.to_thread(put, store, "late")
        await asyncio.sleep(0.3)
        assert hub.version > rendered
        told = await live_for(asgi, 0.3, query=f"since={hub.boot}-{rendered}".encode())
        again = await live_for(asgi, 0.3, last=f"{hub.boot}-{hub.version}", query=b"since=0")
        await warm
        await hub.stop()
        return quiet, told, again

    quiet, told, again = asyncio.run(main())
    assert b"event: change" not in quiet
    assert b"event: change" in told
    assert b"event: change" not in again  # Last-Event-ID wins over the page's since
