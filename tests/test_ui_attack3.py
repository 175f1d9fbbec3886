"""A third hostile review of the console (harel_store.ui), after test_ui_attack and
test_ui_attack2: what the documentation claims against what it does, the browser side
(console.js: a live swap, a stream that breaks, no JavaScript, Back), the listing's semantics
across live changes, and operations (uvicorn, a prefix, odd tokens, a taken port, idle cost).
Each defect found is fixed, and its test is here with the checks that held."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, LibsqlStore, TimerOp
from harel_store.models import TraceStep
from harel_store.ui import app
from harel_store.ui.web import LIVE_GAP, timeline
from tests import test_ui_browser
from tests.test_ui import Client, _close_clients, dead_entry, put  # noqa: F401
from tests.test_ui_attack import live_for, raw
from tests.test_ui_attack2 import hub_of
from tests.test_ui_browser import _stop, watch_live

UI = [sys.executable, "-m", "harel_store", "ui"]
serve = test_ui_browser.serve  # `harel-store ui` processes, stopped (SIGTERM: status 0)
FORM = [(b"content-type", b"application/x-www-form-urlencoded")]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LibsqlStore]:
    with LibsqlStore(tmp_path / "ui.db") as s:
        yield s


@pytest.fixture
def browser() -> Iterator[Any]:
    """Chromium for one test (test_ui_browser's is the module's: its Playwright loop, left
    running in this thread, would break this module's in-process clients)."""
    with test_ui_browser.launched() as chromium:
        yield chromium


context = test_ui_browser.context  # a fresh context a test, over this module's browser


def ids_on(page: str) -> list[str]:
    return re.findall(r'<td><a href="/executions/([^"]+)">', page)


def next_of(page: str) -> str | None:
    found = re.search(r'class="next" href="([^"]+)"', page)
    return found.group(1).replace("&amp;", "&") if found else None


def update(store: LibsqlStore, id: str, **fields: Any) -> None:
    exe = store.load(id)
    assert exe is not None
    store.commit(exe.model_copy(update=fields), [])


def port_of(url: str) -> int:
    return int(url.rstrip("/").rsplit(":", 1)[1])


# --- defects: guards ----------------------------------------------------------------------


def test_a_non_ascii_session_cookie_is_a_401_not_a_crash(store: LibsqlStore) -> None:
    cookie = [(b"cookie", "harel_ui_session=\xe9t\xe9".encode("latin-1"))]
    assert raw(app(store, token="tok"), "/", headers=cookie)[0] == 401


def test_a_non_ascii_csrf_field_is_a_403_not_a_crash(store: LibsqlStore) -> None:
    seq = dead_entry(store)
    body = f"csrf=%C3%A9&db=&kind=outbox&key={seq}".encode()
    asgi = app(store, actions=True)
    assert raw(asgi, "/dead/discard", method="POST", headers=FORM, body=body)[0] == 403
    assert len(store.dead_letters()) == 1


def test_a_non_ascii_token_passes_as_a_bearer_header(store: LibsqlStore) -> None:
    token = "h\u00e9llo w\u00f6rld"
    asgi = app(store, token=token)
    # The login form takes it (UTF-8 form); a script's header, as curl sends it, does not.
    body = b"password=h%C3%A9llo+w%C3%B6rld&next=/"
    assert raw(asgi, "/login", method="POST", headers=FORM, body=body)[0] == 303
    bearer = [(b"authorization", f"Bearer {token}".encode())]
    assert raw(asgi, "/", headers=bearer)[0] == 200


# --- defects: the live stream ------------------------------------------------------------


@pytest.mark.slow
def test_a_page_reconnecting_to_a_restarted_console_is_told_what_changed(tmp_path: Path) -> None:
    # Two console processes one after the other (two stores, two apps). A page of the first
    # was told event N; the second console's counter is at N when the page reconnects saying
    # Last-Event-ID N: it is told of a change ("while-down" was committed since), the id
    # naming the console that gave it.
    db = tmp_path / "ui.db"
    writer = LibsqlStore(db)

    async def main() -> bytes:
        with LibsqlStore(db) as first:
            before = app(first)
            await live_for(before, 0.6, during=asyncio.to_thread(put, writer, "seen"))
            boot = hub_of(before).boot
        await asyncio.to_thread(put, writer, "while-down")
        with LibsqlStore(db) as second:
            console = app(second)
            hub = hub_of(console)
            assert hub.boot != boot
            other = asyncio.create_task(live_for(console, 1.5))  # the watch runs
            await asyncio.sleep(0.9)
            # The page was told, by the first console, the number the second has reached.
            again = await live_for(console, 0.5, last=f"{boot}-{hub.version}")
            await other
            return again

    try:
        again = asyncio.run(main())
    finally:
        writer.close()
    assert b"event: change" in again, again


@pytest.mark.slow
def test_a_long_burst_of_commits_is_told_at_most_five_times_a_second_and_to_its_end(
    store: LibsqlStore,
) -> None:
    # The docs: "at most one every 0.2 s, however many commits". A burst longer than that is
    # followed (a page is not frozen while a long burst runs), never faster, and its last
    # commit is told.
    console = app(store)
    hub = hub_of(console)
    at: list[int] = []

    def burst() -> None:
        for n in range(30):  # a commit every 30 ms for 0.9 s
            put(store, f"b{n}")
            time.sleep(0.03)

    took: list[float] = []

    async def during() -> None:
        await asyncio.sleep(0.6)  # a watch just started may bring one change of its own
        at.append(hub.version)
        start = time.monotonic()
        await asyncio.to_thread(burst)
        took.append(time.monotonic() - start)  # 0.9 s, more on busy cores
        await asyncio.sleep(0.5)  # the burst's last change, told
        at.append(hub.version)

    told = asyncio.run(live_for(console, 2.2, during=during()))
    after = [int(i.split(b"-")[-1]) for i in re.findall(rb"^id: (\S+)$", told, re.M)]
    after = [n for n in after if n > at[0]]
    most = int(took[0] / LIVE_GAP) + 2  # one per 0.2 s at most, the last included
    assert 2 <= len(after) <= most, (took, told)
    assert after[-1] == at[1], told


@pytest.mark.slow
def test_a_console_served_by_uvicorn_as_the_docs_say_stops_with_a_page_open(
    store: LibsqlStore,
) -> None:
    # uvicorn stopping waits for every response to end, and a page's stream ends only after
    # 30 s: the docs say to serve it with --timeout-graceful-shutdown, which cuts them.
    import uvicorn

    console = app(store)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    config = uvicorn.Config(console, log_config=None, lifespan="on", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    page = None
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        page = socket.create_connection(("127.0.0.1", port))
        page.sendall(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        page.settimeout(5)
        head = b""
        while b"retry:" not in head:  # the headers may come first on their own
            chunk = page.recv(4096)
            assert chunk, head
            head += chunk
        server.should_exit = True
        thread.join(5.0)
        assert not thread.is_alive(), "uvicorn still waits for the page's stream"
    finally:
        server.force_exit = True
        thread.join(5)
        if page is not None:
            page.close()
        listener.close()


# --- defects: documentation ----------------------------------------------------------------


def test_the_docs_mount_example_serves_when_run_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (Path(__file__).parent.parent / "docs/how-to/console.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    monkeypatch.chdir(tmp_path)
    scope: dict[str, Any] = {}
    exec(compile(code, "console.md", "exec"), scope)  # "uvicorn module:website" imports it
    page = Client(scope["website"]).get("/ops/console/")
    assert page.status_code == 200
    assert "is closed" not in page.text, "every page shows: the store ... is closed"


def test_ui_help_offers_no_option_that_ui_refuses(tmp_path: Path) -> None:
    db = tmp_path / "r.db"
    LibsqlStore(db).close()
    refused = subprocess.run(
        [*UI, "--url", str(db), "--sync-url", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "ui reads --url itself" in refused.stderr  # held
    help = subprocess.run(
        [sys.executable, "-m", "harel_store", "ui", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "--sync-url" not in help


# --- defects: semantics ----------------------------------------------------------------------


def test_every_child_of_an_execution_is_reachable(store: LibsqlStore) -> None:
    put(store, "mom")
    for n in range(60):
        put(store, f"kid{n:02}", parent_id="mom")
    c = Client(app(store))
    page = c.get("/executions/mom").text
    (cell,) = re.findall(r"<tr><th>children</th>(.*?)</tr>", page, re.S)
    found = set(re.findall(r'href="/executions/(kid\d+)"', cell))
    for href in re.findall(r'href="([^"]+)"', cell):  # a "more" link, if any, followed
        if not href.startswith("/executions/kid"):
            found |= set(re.findall(r"kid\d\d", c.get(href.replace("&amp;", "&")).text))
    assert len(found) == 60, f"{len(found)} of 60 children reachable"


def test_an_execution_page_says_when_its_pending_outbox_is_cut(store: LibsqlStore) -> None:
    put(store, "x")
    src = put(store, "src")
    store.commit(src, [("x", Event(name=f"go{n}")) for n in range(60)])
    page = Client(app(store)).get("/executions/x").text
    section = page.split("Outbox entries to it")[1].split("<h3>")[0]
    assert section.count('class="event-name"') == 50
    assert "shown" in section, "50 of 60 entries shown, and nothing says there are more"


def test_a_purged_parent_is_no_dead_link(store: LibsqlStore) -> None:
    put(store, "mom")
    put(store, "kid", parent_id="mom")
    assert store.purge("mom", 1)
    c = Client(app(store))
    page = c.get("/executions/kid").text
    (cell,) = re.findall(r"<tr><th>parent</th>(.*?)</tr>", page)
    for href in re.findall(r'href="([^"]+)"', cell):
        assert c.get(href).status_code == 200, f"the parent link {href} is a 404"


def test_the_timeline_does_not_hide_a_step_recorded_out_of_order() -> None:
    steps = [
        TraceStep(1, 100.0, {"event": "a"}),
        TraceStep(2, 95.0, {"event": "b"}),  # another writer's clock, 5 s behind
        TraceStep(3, 100.0, {"event": "c"}),
    ]
    rows = timeline(steps)["rows"]
    assert [r["index"] for r in rows] == [1, 2, 3]
    assert rows[2]["y"] > rows[1]["y"] > rows[0]["y"]  # held: equal times still apart
    assert rows[1]["offset"] != "+0 ms", "5 s before the first step, shown as +0 ms"


# --- defects: the browser ----------------------------------------------------------------


def wait_swapped(page: Any, before: int) -> None:
    page.wait_for_function(f"Number(document.body.dataset.refreshed || 0) > {before}")


@pytest.mark.slow
def test_a_live_swap_keeps_the_readers_place(tmp_path: Path, serve: Any, context: Any) -> None:
    db = tmp_path / "ui.db"
    with LibsqlStore(db) as store:
        exe = put(store, "x", context={"note": "n" * 400})
        store.commit(exe, [], trace={"event": "go", "transition": "a"})
        console = serve("--url", str(db))
        page = context.new_page()
        page.set_viewport_size({"width": 900, "height": 300})
        page.goto(console.url + "executions/x")
        before = watch_live(page)
        page.evaluate("document.querySelector('details').open = true")
        page.evaluate(
            "(() => { const r = document.createRange();"
            " r.selectNodeContents(document.querySelector('pre.record'));"
            " getSelection().removeAllRanges(); getSelection().addRange(r); })()"
        )
        page.evaluate("window.scrollTo(0, 200)")
        selected = page.evaluate("getSelection().toString().length")
        assert selected > 400
        put(store, "elsewhere")  # any commit: every open page is swapped
        wait_swapped(page, before)
        place = page.evaluate(
            "[scrollY, document.querySelector('details').open, getSelection().toString().length]"
        )
        assert place[0] == 200  # held: the scroll position
        assert place[1:] == [True, selected], place


@pytest.mark.slow
def test_a_live_swap_keeps_an_unsent_filter(tmp_path: Path, serve: Any, context: Any) -> None:
    db = tmp_path / "ui.db"
    with LibsqlStore(db) as store:
        put(store, "x")
        console = serve("--url", str(db))
        page = context.new_page()
        page.goto(console.url + "executions")
        before = watch_live(page)
        page.fill("input[name=definition]", "ord")
        page.check("input[name=roots]")
        page.click("h1")  # the reader looks away from the form (at the table)
        put(store, "y")
        wait_swapped(page, before)
        assert page.input_value("input[name=definition]") == "ord"
        assert page.is_checked("input[name=roots]")


@pytest.mark.slow
def test_with_a_token_an_open_page_survives_a_restart(
    tmp_path: Path, serve: Any, context: Any
) -> None:
    # The session cookie is signed with a key drawn per process: the restarted console
    # answers the page's stream with 401, and EventSource gives up (the docs: "a page whose
    # stream breaks (the server restarted ...) reconnects by itself").
    db = tmp_path / "ui.db"
    with LibsqlStore(db) as store:
        put(store, "x")
        console = serve("--url", str(db), HAREL_UI_TOKEN="tok")
        page = context.new_page()
        page.goto(console.url + "executions")
        page.fill("input[name=password]", "tok")
        page.click("button[type=submit]")
        watch_live(page)
        assert _stop(console.proc) == 0
        put(store, "while-down")
        serve(
            "--url", str(db), "--listen", f"127.0.0.1:{port_of(console.url)}", HAREL_UI_TOKEN="tok"
        )
        page.locator("main#content").get_by_role("link", name="while-down").wait_for(timeout=4000)


# --- what held -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_restarted_console_on_the_same_port_is_caught_up_and_back_is_live(
    tmp_path: Path, serve: Any, context: Any
) -> None:
    db = tmp_path / "ui.db"
    with LibsqlStore(db) as store:
        put(store, "x")
        console = serve("--url", str(db))
        page = context.new_page()
        page.goto(console.url + "executions")
        watch_live(page)
        assert _stop(console.proc) == 0
        page.wait_for_selector("#live:not(.on)")  # the mark says it is not live
        put(store, "while-down")
        again = serve("--url", str(db), "--listen", f"127.0.0.1:{port_of(console.url)}")
        content = page.locator("main#content")
        content.get_by_role("link", name="while-down").wait_for(timeout=5000)
        page.wait_for_selector("#live.on")
        assert page.evaluate("window.marker") == "kept"  # caught up without a reload
        # Back and Forward: the page it comes back to is live again.
        page.goto(again.url + "dead")
        page.go_back()
        watch_live(page)
        put(store, "after-back")
        content.get_by_role("link", name="after-back").wait_for(timeout=1500)


@pytest.mark.slow
def test_without_javascript_filters_next_and_revive_work(
    tmp_path: Path, serve: Any, browser: Any
) -> None:
    db = tmp_path / "ui.db"
    with LibsqlStore(db) as store:
        for n in range(55):
            put(store, f"e{n:02}")
        put(store, "other", definition_id="billing")
        dead_entry(store)
        console = serve("--url", str(db), "--actions")
        ctx = browser.new_context(java_script_enabled=False)
        try:
            page = ctx.new_page()
            page.goto(console.url + "executions")
            page.fill("input[name=definition]", "order")
            page.select_option("select[name=status]", "running")
            page.check("input[name=roots]")
            page.click("button:text('Filter')")
            assert "definition=order" in page.url and "status=running" in page.url
            first = page.locator("tbody tr").count()
            page.click("a.next")  # the filters kept through Next
            assert "definition=order" in page.url and "roots=1" in page.url
            assert first + page.locator("tbody tr").count() == 56  # 55 + dead_entry's src
            page.goto(console.url + "dead")
            page.click("button:text('Revive')")
            assert page.url.endswith("/dead?done=revived")
            assert store.dead_letters() == []
        finally:
            ctx.close()


def test_the_overview_agrees_with_status_json(tmp_path: Path) -> None:
    db = tmp_path / "ui.db"
    with LibsqlStore(db) as store:
        dead_entry(store)
        put(store, "f", status="failed")
        exe = put(store, "p")
        timers = [TimerOp.schedule("a", 1.0), TimerOp.schedule("b", 4e9)]
        store.commit(exe, [("q", Event(name="go"))], timers=timers)
        store.claim_due_timers("w", time.time(), max_attempts=5)
        page = Client(app(store)).get("/").text
    status = json.loads(
        subprocess.run(
            [sys.executable, "-m", "harel_store", "status", "--json", "--url", str(db)],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    for name, n in status["executions"].items():
        assert f'status-{name}">{n}<' in page
    cells = re.findall(r"<tr><th>(outbox|spawns|timers due)</th>((?:<td[^>]*>\d+</td>)+)", page)
    shown = {k: [int(v) for v in re.findall(r">(\d+)<", row)] for k, row in cells}
    dead = status["dead_letters"]
    assert shown["outbox"] == [status["pending_outbox"], status["claimed_outbox"], dead["outbox"]]
    assert shown["spawns"] == [status["pending_spawns"], status["claimed_spawns"], dead["spawn"]]
    assert shown["timers due"] == [status["timers_due"], status["claimed_timers"], dead["timer"]]
    assert f"timers scheduled: {status['timers_future']}" in page


def test_roots_with_status_and_a_definition_filter_together(store: LibsqlStore) -> None:
    put(store, "root-run")
    put(store, "root-failed", status="failed")
    put(store, "kid-run", parent_id="root-run")
    put(store, "other-run", definition_id="billing")
    page = Client(app(store)).get("/executions?status=running&roots=1&definition=order").text
    assert ids_on(page) == ["root-run"]


@pytest.mark.slow
def test_uvicorn_root_path_keeps_links_login_and_stream_under_the_prefix(
    store: LibsqlStore,
) -> None:
    import httpx
    import uvicorn

    put(store, "x")
    console = app(store, token="tok")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    config = uvicorn.Config(console, log_config=None, root_path="/ops", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with httpx.Client(base_url=base) as c:  # a proxy that strips /ops
            assert 'action="/ops/login"' in c.get("/executions").text
            login = c.post("/login", data={"password": "tok", "next": "/ops/executions"})
            assert login.headers["location"] == "/ops/executions"
            assert "Path=/ops/" in login.headers["set-cookie"]
            bearer = {"authorization": "Bearer tok"}  # (the cookie is the browser's, under /ops/)
            page = c.get("/executions", headers=bearer)
            assert 'data-root="/ops"' in page.text and 'href="/ops/executions/x"' in page.text
            with c.stream("GET", "/live", headers=bearer) as live:
                assert live.status_code == 200
    finally:
        hub_of(console).close()
        server.should_exit = True
        thread.join(5)
        listener.close()


def test_a_taken_port_is_one_line_and_status_1(tmp_path: Path) -> None:
    db = tmp_path / "ui.db"
    LibsqlStore(db).close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [*UI, "--url", str(db), "--listen", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Address already in use" in done.stderr


@pytest.mark.slow
def test_ten_idle_pages_cost_no_cpu(tmp_path: Path, serve: Any) -> None:
    db = tmp_path / "ui.db"
    LibsqlStore(db).close()
    console = serve("--url", str(db))
    pages = []
    try:
        for _ in range(10):
            page = socket.create_connection(("127.0.0.1", port_of(console.url)))
            page.sendall(b"GET /live?since=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            pages.append(page)
        # Each page told its first change (since=0): its stream and the console's watch are
        # up, not still starting when the CPU is measured (a loaded machine took over 1 s).
        for page in pages:
            page.settimeout(60)
            got = b""
            while b"event: change" not in got:
                chunk = page.recv(4096)
                assert chunk, got
                got += chunk
        time.sleep(1.0)

        def cpu() -> float:
            fields = Path(f"/proc/{console.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

        spent = cpu()
        time.sleep(3.0)
        assert cpu() - spent < 0.1  # measured 0.01 s over 5 s
    finally:
        for page in pages:
            page.close()


@pytest.mark.slow
def test_page_loads_do_not_grow_memory(store: LibsqlStore) -> None:
    import gc
    import tracemalloc

    for n in range(60):
        put(store, f"e{n:02}", parent_id="e00" if n else None)
    c = Client(app(store))
    paths = ["/", "/executions", "/executions/e00", "/dead", "/timers"]
    for n in range(50):
        c.get(paths[n % 5])
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for n in range(250):
            c.get(paths[n % 5])
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "lineno"))
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, grown  # measured: 42 KB over 1,000 loads
