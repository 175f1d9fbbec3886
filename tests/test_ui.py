"""The console's pages and guards, over HTTP in this process (Starlette's test client): what
each page shows, escaping, keyset pages, 404s, read-only, CSRF, the Host check, the token and
its login, a prefix mount, a fleet with a database that does not answer. The browser and the
live updates: tests/test_ui_browser.py."""

from __future__ import annotations

import asyncio
import html
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from harel_store import AsyncLibsqlStore, Event, Execution, Fleet, LibsqlStore, TimerOp
from harel_store.ui import app

HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'


class Client:
    """An HTTP client of an ASGI app in this process, on a loop of its own (the app's
    store calls run in its threads, as under a server)."""

    def __init__(self, asgi: Any, base_url: str = "http://127.0.0.1") -> None:
        self._loop = asyncio.new_event_loop()
        transport = httpx.ASGITransport(app=asgi)
        self._client = httpx.AsyncClient(transport=transport, base_url=base_url)
        self.cookies = self._client.cookies
        OPEN.append(self)

    def get(self, url: str, **options: Any) -> httpx.Response:
        return self._loop.run_until_complete(self._client.get(url, **options))

    def post(self, url: str, *, follow_redirects: bool = True, **options: Any) -> httpx.Response:
        request = self._client.post(url, follow_redirects=follow_redirects, **options)
        return self._loop.run_until_complete(request)

    def close(self) -> None:
        self._loop.run_until_complete(self._client.aclose())
        self._loop.close()


OPEN: list[Client] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while OPEN:
        OPEN.pop().close()


def client(source: Any, **options: Any) -> Client:
    return Client(app(source, **options))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LibsqlStore]:
    with LibsqlStore(tmp_path / "ui.db") as s:
        yield s


def put(store: LibsqlStore, id: str, **fields: Any) -> Execution:
    exe = Execution(id=id, definition_id=fields.pop("definition_id", "order"), **fields)
    store.commit(exe, [])
    return exe


def dead_entry(store: LibsqlStore, target: str = "t") -> int:
    """An outbox entry made a dead letter (one attempt, failed); its seq."""
    (seq,) = store.commit(put(store, f"src-{target}"), [(target, Event(name="go"))])
    claimed = store.claim_outbox("w", max_attempts=1)
    store.fail("w", claimed, error="boom <b>")
    assert store.claim_outbox("w", max_attempts=1) == []
    assert [d.item.seq for d in store.dead_letters()] == [seq]
    return seq


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "no csrf field on the page"
    return found.group(1)


def test_overview_counts_and_schema(store: LibsqlStore) -> None:
    put(store, "a")
    put(store, "b", status="failed")
    store.commit(put(store, "c"), [("a", Event(name="go"))], timers=[TimerOp.schedule("p", 1.0)])
    page = client(store).get("/")
    assert page.status_code == 200
    text = page.text
    assert 'status-failed">1<' in text and 'status-running">2<' in text
    assert "at head" in text
    assert "most overdue" in text  # the timer at 1.0 is long overdue
    assert page.headers["cache-control"] == "no-store"


def test_every_stored_text_is_escaped(store: LibsqlStore) -> None:
    exe = put(store, f"x{HOSTILE}", definition_id=HOSTILE, context={"note": HOSTILE})
    store.commit(exe, [], trace={"event": HOSTILE, "transition": HOSTILE})
    c = client(store)
    listing = c.get("/executions").text
    page = c.get(f"/executions/{exe.id}").text
    for text in (listing, page):
        assert "<script>window.pwned" not in text and "<img src=x" not in text
        assert html.escape(HOSTILE, quote=False) in text or "&lt;img src=x" in text


def test_the_listing_pages_newest_first_with_a_next_link(store: LibsqlStore) -> None:
    for n in range(120):
        put(store, f"e{n:03}")
    c = client(store)
    ids: list[str] = []
    url: str | None = "/executions"
    pages = 0
    while url is not None:
        text = c.get(url).text
        pages += 1
        ids += re.findall(r'href="/executions/(e\d+)"', text)
        after = re.search(r'<a class="next" href="([^"]+)">Next</a>', text)
        url = html.unescape(after.group(1)) if after else None
    assert pages == 3 and len(ids) == 120 and set(ids) == {f"e{n:03}" for n in range(120)}
    assert ids[0] == "e119"  # newest first


def test_filters_and_a_bad_filter(store: LibsqlStore) -> None:
    put(store, "a", definition_id="order")
    put(store, "b", definition_id="refund", status="failed")
    put(store, "a.c", definition_id="order", parent_id="a")
    c = client(store)
    text = c.get("/executions?definition=order&roots=1").text
    assert re.findall(r'href="/executions/([^"]+)"', text) == ["a"]
    text = c.get("/executions?status=failed").text
    assert re.findall(r'href="/executions/([^"]+)"', text) == ["b"]
    bad = c.get("/executions?status=nope")
    assert bad.status_code == 400 and "nope" in bad.text
    assert c.get("/executions?cursor=garbage").status_code == 400


def test_an_execution_page_links_parent_children_and_shows_pending(store: LibsqlStore) -> None:
    parent = put(store, "p")
    child = put(store, "p.c", parent_id="p")
    store.commit(
        child,
        [("p", Event(name="done"))],
        timers=[TimerOp.schedule("child.remind", 4_000_000_000.0)],
        trace={"event": "start", "transition": "a -> b"},
    )
    store.commit(child, [], trace={"event": "next", "transition": "b -> c"})
    c = client(store)
    page = c.get("/executions/p.c").text
    assert '<a href="/executions/p">p</a>' in page
    assert "child.remind" in page and "<svg" in page and "#1 next" in page
    assert page.count('<circle cx="120"') == 2
    parent_page = c.get("/executions/p").text
    assert '<a href="/executions/p.c">p.c</a>' in parent_page
    # The outbox entry to p: its event, and its source as a link.
    assert '<td class="event-name">done</td><td><a href="/executions/p.c">' in parent_page
    assert parent.version == 1


def test_an_unknown_execution_or_page_is_404(store: LibsqlStore) -> None:
    c = client(store)
    missing = c.get("/executions/nobody%3Cb%3E")
    assert missing.status_code == 404 and "nobody&lt;b&gt;" in missing.text
    assert c.get("/nowhere").status_code == 404


def test_read_only_refuses_every_post_and_writes_nothing(store: LibsqlStore) -> None:
    seq = dead_entry(store)
    c = client(store)
    page = c.get("/dead").text
    assert "Revive" not in page and "boom &lt;b&gt;" in page
    for action in ("/dead/revive", "/dead/discard", "/executions", "/"):
        answer = c.post(action, data={"db": "", "kind": "outbox", "key": str(seq)})
        assert answer.status_code == 403
    assert [d.item.seq for d in store.dead_letters()] == [seq]


def test_actions_need_the_pages_csrf_token(store: LibsqlStore) -> None:
    seq = dead_entry(store)
    c = client(store, actions=True)
    page = c.get("/dead").text
    assert ">Revive</button>" in page and ">Discard</button>" in page
    token = csrf_of(page)
    form = {"page": "dead", "db": "", "kind": "outbox", "key": str(seq)}
    assert c.post("/dead/revive", data=form).status_code == 403  # no token
    assert c.post("/dead/revive", data={**form, "csrf": "0" * 64}).status_code == 403
    other = client(store, actions=True)  # another console's token is no token here
    assert other.post("/dead/revive", data={**form, "csrf": token}).status_code == 403
    assert [d.item.seq for d in store.dead_letters()] == [seq]
    done = c.post("/dead/revive", data={**form, "csrf": token}, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"] == "/dead?done=revived"
    assert store.dead_letters() == []
    assert [e.seq for e in store.claim_outbox("w2")] == [seq]  # claimable at once


def test_discard_removes_a_dead_timer_by_its_key(store: LibsqlStore) -> None:
    exe = put(store, "t1")
    store.commit(exe, [], timers=[TimerOp.schedule("a/b", 1.0)])
    claimed = store.claim_due_timers("w", 2.0, max_attempts=1)
    store.fail("w", claimed, error="x")
    store.claim_due_timers("w", 2.0, max_attempts=1)
    assert [d.kind for d in store.dead_letters()] == ["timer"]
    c = client(store, actions=True)
    page = c.get("/dead").text
    key = html.unescape(re.findall(r'name="key" value="([^"]+)"', page)[0])
    form = {"page": "dead", "db": "", "kind": "timer", "key": key, "csrf": csrf_of(page)}
    assert c.post("/dead/discard", data=form, follow_redirects=False).status_code == 303
    assert store.dead_letters() == []
    again = c.post("/dead/discard", data=form, follow_redirects=False)
    assert again.headers["location"] == "/dead?done=gone"
    bad = c.post("/dead/discard", data={**form, "key": "[1, 2]"})
    assert bad.status_code == 400


def test_a_foreign_host_is_400(store: LibsqlStore) -> None:
    c = Client(app(store), "http://evil.example")
    assert c.get("/").status_code == 400
    assert client(store).get("/", headers={"host": "localhost:8765"}).status_code == 200
    allowed = Client(app(store, hosts=["console.example"]), "http://console.example")
    assert allowed.get("/").status_code == 200


@pytest.mark.slow
def test_a_token_guards_every_request_and_the_login_sets_a_session(store: LibsqlStore) -> None:
    put(store, "a")
    c = client(store, token="s3cret-token")
    first = c.get("/executions?status=running")
    assert first.status_code == 401 and 'type="password"' in first.text
    assert "s3cret-token" not in first.text
    assert c.get("/live").status_code == 401
    bearer = c.get("/executions", headers={"authorization": "Bearer s3cret-token"})
    assert bearer.status_code == 200 and "s3cret-token" not in bearer.text
    wrong = c.post("/login", data={"password": "nope", "next": "/executions"})
    assert wrong.status_code == 401 and "not the token" in wrong.text
    evil = c.post(
        "/login",
        data={"password": "s3cret-token", "next": "//evil.example/"},
        follow_redirects=False,
    )
    assert evil.headers["location"] == "/"  # never another site
    c.cookies.clear()
    ok = c.post(
        "/login",
        data={"password": "s3cret-token", "next": "/executions?status=running"},
        follow_redirects=False,
    )
    assert ok.status_code == 303 and ok.headers["location"] == "/executions?status=running"
    cookie = ok.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie.replace("Strict", "strict")
    assert "s3cret-token" not in cookie
    assert c.get("/executions").status_code == 200  # the cookie now
    # The static files carry no secret and are served to the login page.
    assert client(store, token="t").get("/static/console.css").status_code == 200


def test_mounted_under_a_prefix_every_link_and_form_keeps_it(store: LibsqlStore) -> None:
    put(store, "a")
    dead_entry(store)
    outer = Starlette(routes=[Mount("/ops/console", app=app(store, actions=True))])
    c = Client(outer)
    for path in ("/", "/executions", "/executions/a", "/dead"):
        text = c.get(f"/ops/console{path}").text
        links = re.findall(r'(?:href|action|src)="(/[^"]*)"', text)
        assert links and all(link.startswith("/ops/console/") for link in links), links
        assert 'data-root="/ops/console"' in text


def test_a_fleet_shows_every_database_and_one_that_fails_its_error(tmp_path: Path) -> None:
    for name in ("a", "b"):
        with LibsqlStore(tmp_path / f"{name}.db") as s:
            put(s, f"{name}-1")
    databases = {"a": str(tmp_path / "a.db"), "b": str(tmp_path / "b.db")}
    databases["gone"] = "http://127.0.0.1:9"  # nothing listens there
    with Fleet(databases, timeout=2.0) as fleet:
        c = client(fleet)
        page = c.get("/")
        assert page.status_code == 200
        cards = re.findall(r'<section class="card( failed)?" data-database="(\w+)"', page.text)
        assert cards == [("", "a"), ("", "b"), (" failed", "gone")]
        assert page.text.count('status-running">1<') == 2
        dead = c.get("/dead")
        assert dead.status_code == 200 and dead.text.count('class="error"') == 1
        one = Fleet({"a": databases["a"], "b": databases["b"]})
        listing = client(one).get("/executions").text
        assert sorted(re.findall(r'href="/executions/([^"]+)"', listing)) == ["a-1", "b-1"]
        assert "<th>database</th>" in listing
        assert client(one).get("/executions/b-1").status_code == 200
        one.close()


def test_an_async_store_is_a_source(tmp_path: Path) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(tmp_path / "a.db")
        await store.commit(Execution(id="x", definition_id="d"), [])
        transport = httpx.ASGITransport(app=app(store))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            assert (await c.get("/executions/x")).status_code == 200
            assert "x" in (await c.get("/executions")).text
        await store.close()

    asyncio.run(main())


def test_a_url_source_is_never_migrated_and_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no database"):
        app(str(tmp_path / "missing.db"))
    assert not (tmp_path / "missing.db").exists()
    with pytest.raises(ValueError, match="memory"):
        app(":memory:")
    with pytest.raises(TypeError):
        app(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        app(str(tmp_path / "x.db"), token="")
