"""The console (`harel-store ui`) driven in a real browser: Debian's Chromium through
Playwright, the console a real ``harel-store ui`` process, the database written by this
process (another process than the console's), on a local file, on sqld and on a fleet.

One Chromium for the module, a fresh context (cookies, storage) for each test. No Playwright
browser is downloaded: the system's Chromium is used (`.ci/run` installs Debian's). With
``HAREL_UI_SCREENSHOTS=DIR`` the screenshot test also writes the documentation's pictures
into DIR (``HAREL_UI_SCREENSHOTS=docs/img``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, Execution, LibsqlStore, TimerOp
from harel_store.fleet import rendezvous

pytestmark = pytest.mark.slow

CLI = Path(sys.executable).with_name("harel-store")
CHROMIUM = os.environ.get("HAREL_CHROMIUM", "/usr/bin/chromium")
# No network beyond loopback here: without these, Chromium keeps trying to reach Google.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVING = re.compile(r"serving (http://127\.0\.0\.1:(\d+)/)\n")
LIVE_WITHIN = 1500  # ms: the contract says 1 s after the commit; some room on 2 busy cores
IMG = '<img src=x onerror="window.pwned=1">'
SCRIPT = "<script>window.pwned=2</script>"
VIEWPORT = {"width": 1100, "height": 700}
SHOTS = ("overview", "executions", "execution", "dead")


# --- the console, a process of its own ---


class Console:
    """One ``harel-store ui`` process listening on a free loopback port."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url  # http://127.0.0.1:PORT/
        self.log = log

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


def _environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HAREL_UI_TOKEN", "HAREL_AUTH_TOKEN")}
    env.update(extra)
    return env


def _start(
    tmp_path: Path,
    before: list[str],
    after: list[str],
    env: dict[str, str],
    cwd: Path | None = None,
    timeout: float = 30,
) -> Console:
    log = tmp_path / f"console-{time.monotonic_ns()}.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [str(CLI), *before, "ui", "--listen", "127.0.0.1:0", *after],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            cwd=cwd,
            bufsize=0,
        )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    try:
        while b"\n" not in seen:  # never a blocking readline: a console that hangs fails here
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no serving line within {timeout} s: {seen!r}")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    proc.wait(timeout=5)
                    raise AssertionError(
                        f"the console exited ({proc.returncode}) before serving: {seen!r}"
                        f"\n{log.read_text(errors='replace')}"
                    )
                seen += chunk
        match = SERVING.fullmatch(seen.decode())
        assert match, f"expected exactly one line 'serving http://127.0.0.1:PORT/': {seen!r}"
        assert int(match.group(2)) > 0
    except BaseException:
        _stop(proc)
        raise
    return Console(proc, match.group(1), log)


def _stop(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM, then SIGKILL if it lingers; its status if it stopped on the SIGTERM."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            return None
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Console]]:
    """``serve(*after, before=(...), cwd=None, **env)``: ``harel-store *before ui --listen
    127.0.0.1:0 *after`` started now, stopped (SIGTERM, then SIGKILL) after the test, once
    its pages are closed (`context` is set up after this, so torn down before)."""
    started: list[Console] = []

    def start(
        *after: str, before: tuple[str, ...] = (), cwd: Path | None = None, **env: str
    ) -> Console:
        console = _start(tmp_path, list(before), list(after), _environment(**env), cwd)
        started.append(console)
        return console

    yield start
    statuses = [(c, _stop(c.proc)) for c in started]
    for console, status in statuses:  # SIGTERM: status 0 and no traceback (the contract)
        assert status == 0, f"status {status} on SIGTERM:\n{console.stderr()}"
        assert "Traceback" not in console.stderr(), console.stderr()


# --- the browser ---


@contextlib.contextmanager
def launched() -> Iterator[Any]:
    """Debian's Chromium under Playwright, closed after (with Playwright's loop)."""
    if not Path(CHROMIUM).exists():
        # Not a skip: CI can run these (.ci/run installs it), and a skip would hide that.
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (as .ci/run does)")
    from playwright.sync_api import sync_playwright

    driver = sync_playwright().start()
    try:
        chromium = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
    finally:
        driver.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launched() as chromium:
        yield chromium


@pytest.fixture
def context(browser: Any, serve: Any) -> Iterator[Any]:
    """A fresh browser context (no cookie, no storage), closed before the consoles stop."""
    ctx = browser.new_context(viewport=VIEWPORT)
    ctx.set_default_timeout(10_000)
    try:
        yield ctx
    finally:
        ctx.close()


@pytest.fixture
def page(context: Any) -> Any:
    return context.new_page()


def go(page: Any, url: str, status: int = 200) -> Any:
    response = page.goto(url)
    assert response is not None and response.status == status, (url, response and response.status)
    return response


def watch_live(page: Any) -> int:
    """Wait until the page's stream is open and quiet, mark the window (a reload would lose
    the mark), and return how many times its content was swapped so far."""
    page.wait_for_selector("#live.on")
    page.wait_for_timeout(400)  # a stream just opened may bring one change of its own
    page.evaluate("window.marker = 'kept'")
    return refreshed(page)


def refreshed(page: Any) -> int:
    return int(page.evaluate("Number(document.body.dataset.refreshed || 0)"))


def swapped_in_place(page: Any, before: int) -> None:
    """The content was swapped at least once since ``before``, without a reload."""
    assert refreshed(page) > before
    assert page.evaluate("window.marker") == "kept", "the page was reloaded"


def write(store: LibsqlStore, exe: Execution, **kwargs: Any) -> Execution:
    store.commit(exe, kwargs.pop("emits", []), **kwargs)
    return exe


# --- live updates ---


def check_live(page: Any, console: Console, store: LibsqlStore) -> None:
    """An open listing shows an execution another process commits, and an open execution
    page shows its next step, each within LIVE_WITHIN ms, in place."""
    write(store, Execution(id="first", definition_id="order"))
    go(page, console.url + "executions")
    assert page.locator("main#content").get_by_role("link", name="first").count() == 1
    assert page.locator("main#content").get_by_role("link", name="second").count() == 0
    before = watch_live(page)

    write(store, Execution(id="second", definition_id="order"))
    page.locator("main#content").get_by_role("link", name="second").wait_for(timeout=LIVE_WITHIN)
    swapped_in_place(page, before)

    # An execution's page follows it: its status, version and trace move.
    page.locator("main#content").get_by_role("link", name="second").click()
    page.wait_for_url(console.url + "executions/second")
    assert page.locator(".facts td.status-running").inner_text() == "running"
    before = watch_live(page)
    exe = store.load("second")
    assert exe is not None
    exe.status, exe.outcome = "finished", "shipped"
    write(store, exe, trace={"event": "ship", "transition": "placed -> shipped"})
    page.locator(".facts td.status-finished").wait_for(timeout=LIVE_WITHIN)
    assert page.locator(".facts td.status-finished").inner_text() == "finished (shipped)"
    assert page.locator("svg.timeline text.moved").text_content() == "placed -> shipped"
    swapped_in_place(page, before)


def test_live_update_from_another_process_on_a_file(tmp_path: Path, serve: Any, page: Any) -> None:
    db = tmp_path / "state.db"
    store = LibsqlStore(db)
    try:
        console = serve("--url", str(db))
        check_live(page, console, store)
    finally:
        store.close()


@pytest.mark.sqld
def test_live_update_from_another_process_on_sqld(server: Any, serve: Any, page: Any) -> None:
    store = LibsqlStore(server.url, auth_token=server.token)  # the fixture migrated it, emptied
    try:
        console = serve("--url", server.url, HAREL_AUTH_TOKEN=server.token)
        check_live(page, console, store)
        assert server.token not in page.content()
    finally:
        store.close()


@pytest.mark.slow
def test_a_commit_between_render_and_stream_is_shown(
    tmp_path: Path, serve: Any, context: Any
) -> None:
    db = tmp_path / "state.db"
    store = LibsqlStore(db)
    try:
        write(store, Execution(id="first", definition_id="order"))
        console = serve("--url", str(db))
        other = context.new_page()  # another tab of the console, live
        go(other, console.url)
        watch_live(other)

        page = context.new_page()

        def commit_then_load(route: Any, request: Any) -> None:
            # The page is rendered; its script (and so its stream) is not there yet.
            write(store, Execution(id="late", definition_id="order"))
            time.sleep(0.3)  # the commit heard by the console
            route.continue_()

        page.route("**/static/console.js", commit_then_load)
        go(page, console.url + "executions")
        page.wait_for_selector("#live.on")
        assert store.load("late") is not None
        page.locator("main#content").get_by_role("link", name="late").wait_for(timeout=LIVE_WITHIN)
    finally:
        store.close()


# --- actions ---


def dead_letters(store: LibsqlStore, *targets: str) -> None:
    """One dead outbox entry to each of ``targets``."""
    write(
        store,
        Execution(id="sender", definition_id="mailer"),
        emits=[(t, Event(name="deliver")) for t in targets],
    )
    items = store.claim_outbox("relay", max_attempts=1)
    assert len(items) == len(targets)
    store.fail("relay", items, error="boom: connection refused")
    assert store.claim_outbox("relay", max_attempts=1) == []
    assert sorted(d.item.target_id for d in store.dead_letters()) == sorted(targets)


def row_of(page: Any, target: str) -> Any:
    return page.locator("main#content tr", has=page.get_by_role("link", name=target, exact=True))


def test_revive_and_discard_with_actions_none_without(
    tmp_path: Path, serve: Any, page: Any
) -> None:
    db = tmp_path / "state.db"
    store = LibsqlStore(db)
    try:
        dead_letters(store, "to-revive", "to-discard")

        # Without --actions: the dead letters are shown, with no button, and a POST is refused.
        reader = serve("--url", str(db))
        go(page, reader.url + "dead")
        assert row_of(page, "to-revive").count() == 1
        assert "boom: connection refused" in row_of(page, "to-revive").inner_text()
        assert page.get_by_role("button", name="Revive").count() == 0
        assert page.get_by_role("button", name="Discard").count() == 0
        assert "read-only" in page.locator("header .where").inner_text()
        (letter,) = [d for d in store.dead_letters() if d.item.target_id == "to-revive"]
        form = {"db": "db", "kind": "outbox", "key": str(letter.item.seq), "page": "dead"}
        assert page.request.post(reader.url + "dead/revive", form=form).status == 403
        assert len(store.dead_letters()) == 2

        acting = serve("--url", str(db), "--actions")
        go(page, acting.url + "dead")
        assert page.get_by_role("button", name="Revive", exact=True).count() == 2
        assert page.get_by_role("button", name="Discard", exact=True).count() == 2

        row_of(page, "to-revive").get_by_role("button", name="Revive", exact=True).click()
        page.wait_for_url(acting.url + "dead?done=revived")
        assert page.locator(".notice").inner_text() == "Revived: claimable at once."
        assert row_of(page, "to-revive").count() == 0
        assert row_of(page, "to-discard").count() == 1
        assert [d.item.target_id for d in store.dead_letters()] == ["to-discard"]
        (pending,) = store.outbox_view(target="to-revive")
        assert (pending.attempts, pending.claimed_by) == (0, None)
        claimed = store.claim_outbox("relay-2", max_attempts=5)
        assert [e.target_id for e in claimed] == ["to-revive"]
        store.ack(claimed)

        row_of(page, "to-discard").get_by_role("button", name="Discard", exact=True).click()
        page.wait_for_url(acting.url + "dead?done=discarded")
        assert page.locator(".notice").inner_text() == "Discarded."
        assert row_of(page, "to-discard").count() == 0
        assert page.locator("main#content .empty").inner_text() == "no dead letter"
        assert store.dead_letters() == []
        assert store.claim_outbox("relay-3", max_attempts=5) == []
        assert store.stats(time.time()).dead_outbox == 0
    finally:
        store.close()


# --- escaping ---


def test_stored_markup_is_shown_as_text_never_run(tmp_path: Path, serve: Any, page: Any) -> None:
    hostile = f"x{IMG}{SCRIPT}"
    db = tmp_path / "state.db"
    store = LibsqlStore(db)
    try:
        exe = Execution(
            id=hostile, definition_id=f"d{IMG}", context={"note": f"{IMG} and {SCRIPT}"}
        )
        write(store, exe, trace={"event": IMG, "transition": SCRIPT})
        console = serve("--url", str(db))

        go(page, console.url + "executions")
        page.wait_for_load_state("load")
        link = page.locator("main#content").get_by_role("link", name=hostile, exact=True)
        assert link.inner_text() == hostile
        assert page.locator("main#content td", has_text=f"d{IMG}").count() == 1
        assert page.locator("main#content img, main#content script").count() == 0
        page.wait_for_timeout(200)  # an injected image's onerror would have run by now
        assert page.evaluate("typeof window.pwned") == "undefined"

        link.click()
        page.wait_for_load_state("load")
        assert page.locator("main#content h1").inner_text() == hostile
        assert page.title() == f"{hostile} · harel-store"
        assert page.locator("svg.timeline text.event").text_content() == f"#0 {IMG}"
        assert page.locator("svg.timeline text.moved").text_content() == SCRIPT
        record = page.locator("pre.record").inner_text()
        assert json.dumps({"note": f"{IMG} and {SCRIPT}"})[1:-1] in record, record
        assert page.locator("main#content img, main#content script").count() == 0
        page.wait_for_timeout(200)
        assert page.evaluate("typeof window.pwned") == "undefined"

        # Content swapped in live is escaped as well (a parsed image would load and fire).
        before = watch_live(page)
        write(store, exe, trace={"event": SCRIPT, "transition": IMG})
        page.locator("svg.timeline text.event").nth(1).wait_for(timeout=LIVE_WITHIN)
        swapped_in_place(page, before)
        assert page.locator("svg.timeline text.event").nth(1).text_content() == f"#1 {SCRIPT}"
        assert page.locator("main#content img, main#content script").count() == 0
        page.wait_for_timeout(200)
        assert page.evaluate("typeof window.pwned") == "undefined"
    finally:
        store.close()


# --- the token ---


def test_token_login_then_live(tmp_path: Path, serve: Any, page: Any, context: Any) -> None:
    token = "ui-token-" + "s3cret" * 4
    db = tmp_path / "state.db"
    store = LibsqlStore(db)
    try:
        write(store, Execution(id="first", definition_id="order"))
        console = serve("--url", str(db), HAREL_UI_TOKEN=token)
        wanted = console.url + "executions?definition=order"

        go(page, wanted, 401)
        assert page.locator("main#content h1").inner_text() == "Sign in"
        assert page.locator("form.login input[type=password][name=password]").count() == 1
        assert page.locator("main#content").get_by_role("link", name="first").count() == 0
        assert page.locator("main#content .error").count() == 0

        page.fill("input[name=password]", token + "x")
        with page.expect_response(lambda r: r.url.endswith("/login")) as wrong:
            page.click("form.login button[type=submit]")
        assert wrong.value.status == 401
        page.wait_for_load_state("load")
        assert page.locator("main#content .error").inner_text() == "That is not the token."
        assert context.cookies() == []
        assert token not in page.content()

        page.fill("input[name=password]", token)
        page.click("form.login button[type=submit]")
        page.wait_for_url(wanted)
        assert page.locator("main#content h1").inner_text() == "Executions"
        assert page.locator("main#content").get_by_role("link", name="first").count() == 1
        (cookie,) = context.cookies()
        assert cookie["httpOnly"] is True
        assert cookie["sameSite"] == "Strict"
        assert cookie["value"] and token not in cookie["value"]
        assert page.evaluate("document.cookie") == ""  # HttpOnly: out of the page's reach

        # The stream is let in by the cookie: the page is still live.
        before = watch_live(page)
        write(store, Execution(id="second", definition_id="order"))
        page.locator("main#content").get_by_role("link", name="second").wait_for(
            timeout=LIVE_WITHIN
        )
        swapped_in_place(page, before)

        # A context without the cookie is still asked for the token.
        other = context.browser.new_context()
        try:
            assert other.new_page().goto(console.url).status == 401
        finally:
            other.close()
    finally:
        store.close()


# --- a fleet ---


def ids_for(names: list[str]) -> dict[str, str]:
    """An execution id living in each database of a fleet of ``names`` (its default route)."""
    found: dict[str, str] = {}
    n = 0
    while len(found) < len(names):
        candidate = f"order-{n}"
        found.setdefault(rendezvous(names, candidate), candidate)
        n += 1
    return found


def test_a_fleet_in_one_console(tmp_path: Path, serve: Any, page: Any) -> None:
    names = ["east", "west"]
    ids = ids_for(names)
    fleet = tmp_path / "fleet.txt"
    fleet.write_text("".join(f"{n} {tmp_path / n}.db\n" for n in names))
    for name in names:
        store = LibsqlStore(tmp_path / f"{name}.db")
        try:
            write(store, Execution(id=ids[name], definition_id=f"order-{name}"))
            if name == "west":
                write(store, Execution(id=f"{ids[name]}.child", definition_id="x", status="failed"))
        finally:
            store.close()
    console = serve(before=("--fleet", str(fleet)))

    go(page, console.url)
    cards = page.locator("main#content section.card")
    assert cards.count() == 2
    for name in names:
        card = page.locator(f"main#content section.card[data-database={name}]")
        assert card.locator("h2").inner_text() == name
        assert card.locator(".error").count() == 0
        assert "at head" in card.locator(".schema").inner_text()
    east_running = page.locator("section.card[data-database=east] td.status-running")
    west_failed = page.locator("section.card[data-database=west] td.status-failed")
    assert east_running.inner_text() == "1"
    assert west_failed.inner_text() == "1"

    go(page, console.url + "executions")
    rows = page.locator("main#content table.list tbody tr")
    assert rows.count() == 3
    shown = {tuple(rows.nth(i).locator("td").all_inner_texts()[:3]) for i in range(rows.count())}
    assert shown == {
        ("east", ids["east"], "order-east"),
        ("west", ids["west"], "order-west"),
        ("west", f"{ids['west']}.child", "x"),
    }
    page.locator("main#content").get_by_role("link", name=ids["east"], exact=True).click()
    page.wait_for_url(re.compile(r".*/executions/order-\d+$"))
    assert page.locator("main#content h1").inner_text() == ids["east"]


# --- screenshots for the docs ---


def png_size(data: bytes) -> tuple[int, int]:
    """The width and height of a PNG, after checking its signature and header chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert kind == b"IHDR" and length == 13
    header = data[16:29]
    assert struct.unpack(">I", data[29:33])[0] == zlib.crc32(b"IHDR" + header)
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82", "truncated PNG"
    width, height = struct.unpack(">II", header[:8])
    return width, height


def demo_database(store: LibsqlStore) -> None:
    """A small, plausible database: orders in every status, one with a trace of several
    steps, a child, pending work, timers and two dead letters."""
    now = time.time()
    for n, status in enumerate(["finished", "finished", "failed", "cancelled", "running"]):
        exe = Execution(id=f"order-{1040 + n}", definition_id="order", context={"n": n})
        write(store, exe)
        if status != "running":
            exe.status = status
            exe.outcome = {"finished": "delivered", "failed": "card declined"}.get(status)
            write(store, exe)
    steps = [
        ("placed", "idle -> placed", "placed"),
        ("paid", "placed -> paid", "paid"),
        ("packed", "paid -> packing", "packing"),
        ("picked", "packing -> packed", "packed"),
        ("shipped", "packed -> shipping", "shipping"),
    ]
    exe = Execution(id="order-1045", definition_id="order", context={"items": 3, "total": 84.5})
    for k, (event, transition, state) in enumerate(steps):
        exe.active_path = f"main.{state}"
        emits = [("order-1045.invoice", Event(name="invoice"))] if k == 4 else []
        timers = [TimerOp.schedule("main.shipping.late", now + 2 * 86400)] if k == 4 else []
        spawns = [("order-1045.invoice", "invoice", {"order": "order-1045"})] if k == 1 else []
        store.commit(
            exe,
            emits,
            timers=timers,
            spawns=spawns,
            trace={"event": event, "transition": transition},
        )
        time.sleep(0.02 * (k + 1))  # the timeline spaces the steps by their gaps
    write(
        store, Execution(id="order-1045.invoice", definition_id="invoice", parent_id="order-1045")
    )
    write(
        store,
        Execution(id="order-1046", definition_id="order"),
        emits=[("payments", Event(name="charge")), ("mailer", Event(name="receipt"))],
    )
    errors = {"payments": "503 Service Unavailable", "mailer": "SMTP 421: try again later"}
    for entry in store.claim_outbox("relay", max_attempts=1):
        if entry.target_id in errors:
            store.fail("relay", [entry], error=errors[entry.target_id])
    store.claim_outbox("relay", max_attempts=1)
    assert len(store.dead_letters()) == 2
    late = store.load("order-1044")
    assert late is not None
    write(store, late, timers=[TimerOp.schedule("main.waiting.reminder", now - 95)])


def test_screenshots(tmp_path: Path, serve: Any, page: Any) -> None:
    store = LibsqlStore(tmp_path / "shop.db")
    try:
        demo_database(store)
    finally:
        store.close()
    console = serve("--url", "shop.db", "--actions", cwd=tmp_path)  # shown as "shop.db"
    pages = dict(zip(SHOTS, ("", "executions", "executions/order-1045", "dead"), strict=True))
    shots: dict[str, bytes] = {}
    for name, path in pages.items():
        go(page, console.url + path)
        page.wait_for_selector("#live.on")  # the live mark lit, as a user sees it
        shots[name] = page.screenshot(path=str(tmp_path / f"console-{name}.png"), full_page=False)
    assert page.get_by_role("button", name="Revive", exact=True).count() == 2
    for name, data in shots.items():
        assert (tmp_path / f"console-{name}.png").read_bytes() == data
        assert png_size(data) == (VIEWPORT["width"], VIEWPORT["height"])
        assert 10_000 < len(data) < 150_000, (name, len(data))
    target = os.environ.get("HAREL_UI_SCREENSHOTS")
    if target:
        out = Path(target)
        out.mkdir(parents=True, exist_ok=True)
        for name, data in shots.items():
            (out / f"console-{name}.png").write_bytes(data)
