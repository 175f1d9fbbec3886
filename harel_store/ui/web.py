"""The console's web application: pages rendered on the server (Starlette, Jinja2 with every
value escaped), kept live in the browser by server-sent events that the store's wake-up
pushes, and the guards in front of it all (`Guard`: the Host check, the token, read-only
unless actions are on, a CSRF token per page)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import re
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, quote, urlencode

from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from harel_store.errors import StoreError
from harel_store.models import STATUSES
from harel_store.sql import HEAD
from harel_store.ui.source import Databases, one_line

PAGE = 50  # rows of a listing page
TIMERS = 100  # armed timers shown, soonest first
DEAD = 100  # dead letters shown, oldest first
CHILDREN = 50  # children shown on an execution's page
LINGER = 60.0  # seconds the watches outlive the last open page
LIVE_GAP = 0.2  # seconds at least between two change events to one page, however many commits
HEARTBEAT = 15.0
# A stream ends after this long (the browser reconnects at once, saying the last change it
# was told): a server stopping, which waits for its responses to end, waits no longer.
STREAM_FOR = 30.0  # seconds between two keep-alive comments of a quiet stream
NOT_LIVE_POLL = 1.0  # a database whose changes cannot be heard is looked at this often
REOPEN = 5.0  # seconds before a database that could not be watched is tried again
MAX_FORM = 16 * 1024  # bytes a posted form may have
COOKIE = "harel_ui_session"
LOGIN_PAUSE = 1.0  # seconds a wrong token waits before its answer
TRACE = 200  # trace steps drawn: the latest
LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def _local_names() -> set[str]:
    """This host's names and addresses, its interfaces' included (a request naming any of
    them is not a rebinding)."""
    names = set(LOOPBACK)
    with contextlib.suppress(OSError):
        host = socket.gethostname()
        names |= {host.lower(), socket.getfqdn(host).lower()}
        for *_, address in socket.getaddrinfo(host, None):
            names.add(str(address[0]).lower())
    return names | _interface_addresses()


def _interface_addresses() -> set[str]:
    """The IPv4 address of each network interface (SIOCGIFADDR) and every IPv6 address
    (/proc/net/if_inet6), where Linux tells them; nothing elsewhere."""
    found: set[str] = set()
    with contextlib.suppress(OSError, ImportError):
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for _, name in socket.if_nameindex():
                with contextlib.suppress(OSError):
                    request = struct.pack("256s", name.encode()[:15])
                    answer = fcntl.ioctl(probe.fileno(), 0x8915, request)  # SIOCGIFADDR
                    found.add(socket.inet_ntoa(answer[20:24]))
    with contextlib.suppress(OSError, ValueError), open("/proc/net/if_inet6") as table:
        for line in table:
            raw = bytes.fromhex(line.split()[0])
            found.add(socket.inet_ntop(socket.AF_INET6, raw))
    return found


def host_of(header: str) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:80`` is ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else ""
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Hub:
    """Whether anything changed: one wake-up subscription a database while any page
    listens, and `LINGER` seconds after the last one left (so that going from page to page
    does not start the watch again each time); none otherwise: the console costs nothing
    while no page is open. Each change bumps `version`, which every page is rendered with:
    its stream is told at once of a change since (or since the last event it was told,
    when it reconnects). A watch just started bumps it too: what changed before was not
    seen."""

    def __init__(self, databases: Databases) -> None:
        self._databases = databases
        self.version = 0
        # Which process counts: a version told by another (a restarted console) says nothing.
        self.boot = secrets.token_hex(4)
        self._event = asyncio.Event()
        self._listeners = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._marks: dict[str, Any] = {}  # a database without a watch: its newest execution
        self.closed = False  # the server is stopping: every stream ends
        self._closing = asyncio.Event()
        self._idle: asyncio.Task[None] | None = None  # stops the watches, LINGER s on

    def close(self) -> None:
        """End every live stream (from any thread): a server stopping waits for them."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._close)

    def _close(self) -> None:
        self.closed = True
        self._closing.set()
        self._bump()

    @contextlib.asynccontextmanager
    async def listening(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # served again, on another loop: what was bound is gone
            self._loop, self._event, self._closing = loop, asyncio.Event(), asyncio.Event()
            self._tasks, self._idle, self._listeners = [], None, 0
        self._listeners += 1
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._watch(n)) for n in self._databases.names]
        try:
            yield
        finally:
            self._listeners -= 1
            if self._listeners == 0 and self._idle is None:
                self._idle = asyncio.create_task(self._stop_later())

    async def stop(self) -> None:
        """End the streams and the watches (the application shuts down)."""
        self._close()
        tasks, self._tasks = self._tasks, []
        if self._idle is not None:
            tasks.append(self._idle)
            self._idle = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _stop_later(self) -> None:
        """The watches stopped `LINGER` seconds after the last page left (at once when the
        server stops), unless a page comes back meanwhile."""
        if not self.closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), LINGER)
        if self._listeners:
            return
        tasks, self._tasks, self._idle = self._tasks, [], None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _bump(self) -> None:
        self.version += 1
        event, self._event = self._event, asyncio.Event()
        event.set()

    async def changed(self, seen: int, timeout: float) -> bool:
        """Whether `version` moved past ``seen`` within ``timeout`` seconds."""
        if self.version != seen:
            return True
        event = self._event
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def _watch(self, name: str) -> None:
        while True:
            try:
                waiter = await self._databases.waiter(name)
            except (StoreError, OSError, ValueError):
                await asyncio.sleep(REOPEN)  # unreachable, or behind head: shown on the page
                continue
            try:
                while True:
                    # Heard (a file's commits, a server's notifications, or this process's
                    # own writes alone): wait for them. Else look, as a relay would, at its
                    # poll: one cheap read for every open page, a change only if it moved.
                    heard = waiter.live or waiter.alone
                    if await waiter.await_signal(3600.0 if heard else NOT_LIVE_POLL):
                        if waiter.take():
                            self._bump()
                    elif not heard and self._listeners and await self._moved(name):
                        self._bump()
            finally:
                waiter.close()

    async def _moved(self, name: str) -> bool:
        """Whether database ``name`` changed since the last look (one read: the counts of
        the overview, and its newest execution; a page's own change shows in one of them)."""
        try:
            stats = await self._databases.call(name, "stats", time.time())
            newest = await self._databases.call(name, "list_executions", limit=1, newest_first=True)
        except (StoreError, OSError):
            return False
        top = newest.items[0] if newest.items else None
        mark = (
            stats._replace(now=0.0),
            None if top is None else (top.id, top.version, top.updated_at),
        )
        moved = name in self._marks and self._marks[name] != mark
        self._marks[name] = mark
        return moved


class Guard:
    """In front of the pages: a ``Host`` that names no address of this host is 400 (DNS
    rebinding); with a token, a request without it (a Bearer header, or the session cookie
    that the login form sets) is 401; a POST other than the login is 403 unless actions are
    on, and then unless it carries the CSRF token of its page."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        actions: bool,
        secret: bytes,
        hosts: Iterable[str],
        render: Callable[[Scope, str, dict[str, Any], int], Response],
    ) -> None:
        self.app = app
        self.token = token
        self.actions = actions
        self.secret = secret
        self.hosts = _local_names() | {host_of(h) for h in hosts}
        # Derived from the token (not the process's key): a session outlives a restart of the
        # console, and is not the token.
        self.session = hmac.new(
            (token or "").encode(), b"harel-store ui session", hashlib.sha256
        ).hexdigest()
        self.render = render
        self.close_streams: Callable[[], None] = lambda: None  # (make_app: the Hub's)

    def sign(self, what: str) -> str:
        return hmac.new(self.secret, what.encode(), hashlib.sha256).hexdigest()

    def csrf(self, page: str) -> str:
        """The CSRF token of the page ``page`` (its forms carry it; its actions need it)."""
        return self.sign(f"csrf:{page}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        if host_of(request.headers.get("host", "")) not in self.hosts:
            response: Response = Response("bad Host\n", 400, media_type="text/plain")
            await response(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # a mount's path may or may not carry its prefix
            path = path[len(root) :] or "/"
        if self.token is not None:
            if request.method == "POST" and path == "/login":
                await (await self._login(request))(scope, receive, send)
                return
            if not self._authorized(request) and not path.startswith("/static/"):
                await self._login_page(request, "", 401)(scope, receive, send)
                return
        if request.method not in ("GET", "HEAD"):
            if request.method != "POST" or not self.actions:
                await self.render(scope, "refused.html", {"why": "read-only"}, 403)(
                    scope, receive, send
                )
                return
            form = await read_form(request)
            expected = self.csrf(path.strip("/").split("/")[0])  # the page acted from
            given = (form or {}).get("csrf", "").encode("utf-8", "surrogateescape")
            if form is None or not hmac.compare_digest(given, expected.encode()):
                await self.render(scope, "refused.html", {"why": "csrf"}, 403)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _authorized(self, request: Request) -> bool:
        assert self.token is not None
        given = request.headers.get("authorization", "")
        # Header values come decoded as latin-1: their bytes, as the client sent them.
        sent = given[7:].encode("latin-1", "replace")
        if given[:7].lower() == "bearer " and hmac.compare_digest(sent, self.token.encode()):
            return True
        cookie = request.cookies.get(COOKIE, "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(cookie, self.session.encode())

    def _login_page(self, request: Request, error: str, status: int) -> Response:
        wanted = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return self.render(request.scope, "login.html", {"next": wanted, "error": error}, status)

    async def _login(self, request: Request) -> Response:
        assert self.token is not None
        form = await read_form(request) or {}
        root = request.scope.get("root_path", "")
        password = form.get("password", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(password, self.token.encode()):
            await asyncio.sleep(LOGIN_PAUSE)  # a guess a second, at most, per connection
            return self.render(
                request.scope, "login.html", {"next": form.get("next", ""), "error": "1"}, 401
            )
        wanted = form.get("next", "")
        # Only a path of this console: never another site (an open redirect).
        if not wanted.startswith(f"{root}/") or wanted.startswith("//") or "\\" in wanted:
            wanted = f"{root}/"
        response = RedirectResponse(wanted, 303)
        response.set_cookie(COOKIE, self.session, httponly=True, samesite="strict", path=f"{root}/")
        return response


async def read_form(request: Request) -> dict[str, str] | None:
    """A posted form (application/x-www-form-urlencoded, up to `MAX_FORM` bytes), the last
    value of each field; None if it is not one."""
    if "harel_form" in request.scope:
        return dict(request.scope["harel_form"])
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return None
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM:
            return None
    try:
        fields = parse_qs(body.decode("utf-8"), keep_blank_values=True, strict_parsing=False)
    except (UnicodeDecodeError, ValueError):
        return None
    form = {name: values[-1] for name, values in fields.items()}
    request.scope["harel_form"] = form
    return form


# --- how values are shown ---


def when(epoch: float | None) -> str:
    if epoch is None or not math.isfinite(epoch):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(epoch)) + f".{int(epoch % 1 * 1000):03d}Z"


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(seconds, 0.0)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.0f} ms"


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)


def timeline(steps: list[Any]) -> dict[str, Any]:
    """The trace steps laid out as a picture: one dot a step down a line, its distance from
    the previous one growing with the time between them, each with its event and what it
    moved to."""
    rows: list[dict[str, Any]] = []
    y = 24.0
    first = next((s.recorded_at for s in steps if s.recorded_at is not None), None)
    previous = first
    for step in steps:
        at = step.recorded_at
        gap = 0.0 if at is None or previous is None else max(at - previous, 0.0)
        if rows:
            y += 30.0 + min(math.log10(1.0 + gap * 1000.0) * 12.0, 60.0)
        entry = step.entry if isinstance(step.entry, dict) else {}
        event = entry.get("event", entry.get("name", ""))
        moved = entry.get("transition", entry.get("to", entry.get("state", "")))
        rows.append(
            {
                "index": step.index,
                "y": round(y, 1),
                "offset": "" if at is None or first is None else offset(at - first),
                "event": str(event)[:80],
                "moved": str(moved)[:80],
                "json": pretty(step.entry),
            }
        )
        previous = at if at is not None else previous
    return {"rows": rows, "height": round(y + 24.0, 1)}


def offset(seconds: float) -> str:
    """A step's time from the first one's, signed (another writer's clock may be behind)."""
    return f"+{age(seconds)}" if seconds >= 0 else f"-{age(-seconds)} (before the first)"


def make_app(
    databases: Databases,
    *,
    actions: bool,
    token: str | None,
    hosts: Iterable[str] = (),
) -> ASGIApp:
    """The console over ``databases`` (see `harel_store.ui.app`)."""
    env = Environment(
        loader=PackageLoader("harel_store.ui", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
    )
    env.filters.update(
        when=when,
        age=age,
        pretty=pretty,
        q=lambda s: quote(str(s), safe=""),
        exe_url=exe_url,
        dead_key=lambda view: json.dumps(list(view.key)) if view.kind == "timer" else str(view.key),
    )
    static = {
        name: resources.files("harel_store.ui").joinpath(f"static/{name}").read_bytes()
        for name in ("console.css", "console.js")
    }
    hub = Hub(databases)
    secret = secrets.token_bytes(32)
    guard: Guard

    def render(scope: Scope, template: str, context: dict[str, Any], status: int = 200) -> Response:
        full = {"root": scope.get("root_path", ""), "label": databases.label, **context}
        response = HTMLResponse(env.get_template(template).render(full), status)
        response.headers["cache-control"] = "no-store"
        return response

    def page(
        request: Request, template: str, name: str, status: int = 200, **context: Any
    ) -> Response:
        root = request.scope.get("root_path", "")
        full = {
            "root": root,
            "page": name,
            "csrf": guard.csrf(name),
            "actions": actions,
            "fleet": databases.fleet,
            "label": databases.label,
            "names": databases.names,
            "now": time.time(),
            "version": f"{hub.boot}-{hub.version}",
            **context,
        }
        return render(request.scope, template, full, status)

    async def each(method: str, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        """``method`` on every database at once: its result, or its error, by name."""

        async def one(name: str) -> dict[str, Any]:
            try:
                return {"name": name, "value": await databases.call(name, method, *args, **kwargs)}
            except (StoreError, OSError) as exc:
                return {"name": name, "error": one_line(exc)}

        return list(await asyncio.gather(*(one(n) for n in databases.names)))

    async def overview(request: Request) -> Response:
        now = time.time()
        rows = await each("stats", now)
        for row in rows:
            stats = row.get("value")
            if stats is not None:
                row["executions"] = {s: stats.executions.get(s, 0) for s in STATUSES}
                row["executions"].update(stats.executions)
                row["oldest"] = min(
                    (t for t in (stats.oldest_outbox_at, stats.oldest_spawn_at) if t is not None),
                    default=None,
                )
                soonest = stats.soonest_timer_at
                row["overdue"] = (
                    stats.now - soonest if soonest is not None and soonest < stats.now else None
                )
        return page(request, "overview.html", "overview", databases=rows, head=HEAD)

    async def executions(request: Request) -> Response:
        q = request.query_params
        if "id" in q:  # an id a path cannot carry ("." and ".."): see `exe_url`
            return await execution(request)
        filters = {
            "definition": q.get("definition", ""),
            "status": q.get("status", ""),
            "roots": q.get("roots", "") in ("1", "on", "true"),
        }
        options: dict[str, Any] = {
            "definition_id": filters["definition"] or None,
            "status": filters["status"] or None,
            "roots_only": filters["roots"],
            "limit": PAGE,
            "cursor": q.get("cursor") or None,
            "newest_first": True,
        }
        try:
            listing, failed = await databases.list_executions(**options)
        except (ValueError, TypeError) as exc:
            return page(request, "error.html", "executions", 400, error=one_line(exc))
        except (StoreError, OSError) as exc:
            return page(request, "error.html", "executions", 503, error=one_line(exc))
        after = None
        if listing.next_cursor is not None:
            kept = {"definition": filters["definition"], "status": filters["status"]}
            kept = {k: v for k, v in kept.items() if v}
            if filters["roots"]:
                kept["roots"] = "1"
            after = urlencode({**kept, "cursor": listing.next_cursor})
        rows = [(databases.route(s.id) if databases.fleet else "", s) for s in listing.items]
        return page(
            request,
            "executions.html",
            "executions",
            rows=rows,
            filters=filters,
            statuses=STATUSES,
            after=after,
            failed=failed,
        )

    async def execution(request: Request) -> Response:
        execution_id = request.path_params.get("id", request.query_params.get("id", ""))
        children_after = request.query_params.get("children_after") or None
        try:
            name = databases.route(execution_id)
            exe = await databases.call(name, "load", execution_id)
            if exe is None:
                return page(request, "missing.html", "execution", 404, id=execution_id)
            steps, children, outbox, spawns, timers = await asyncio.gather(
                databases.call(name, "trace_view", execution_id, limit=TRACE),
                databases.call(
                    name, "children_of", execution_id, limit=CHILDREN + 1, after=children_after
                ),
                databases.call(name, "outbox_view", target=execution_id, limit=PAGE + 1),
                databases.call(name, "spawns_view", parent=execution_id, limit=PAGE + 1),
                databases.call(name, "timers_of", execution_id, limit=PAGE + 1),
            )
        except (ValueError, TypeError) as exc:
            return page(request, "error.html", "execution", 400, error=one_line(exc))
        except (StoreError, OSError) as exc:
            return page(request, "error.html", "execution", 503, error=one_line(exc))
        parent_gone = False
        if exe.parent_id is not None:  # purged meanwhile: no link to a 404
            try:
                where = databases.route(exe.parent_id)
                parent_gone = await databases.call(where, "load", exe.parent_id) is None
            except (ValueError, TypeError, StoreError, OSError):
                parent_gone = False
        record = exe.model_dump(mode="json")
        return page(
            request,
            "execution.html",
            "execution",
            db=name,
            exe=exe,
            record=pretty(record),
            timeline=timeline(steps),
            children=children[:CHILDREN],
            children_after=children_after,
            next_children=(
                child_page(execution_id, children[CHILDREN - 1].id)
                if len(children) > CHILDREN
                else None
            ),
            outbox=outbox[:PAGE],
            spawns=spawns[:PAGE],
            parent_gone=parent_gone,
            more_outbox=len(outbox) > PAGE,
            more_spawns=len(spawns) > PAGE,
            timers=timers[:PAGE],
            more_timers=len(timers) > PAGE,
            more_steps=len(steps) >= TRACE,
        )

    async def dead(request: Request) -> Response:
        rows = await each("dead_view", limit=DEAD)
        done = request.query_params.get("done", "")
        return page(request, "dead.html", "dead", databases=rows, done=done, limit=DEAD)

    async def dead_action(request: Request) -> Response:
        form = await read_form(request) or {}
        root = request.scope.get("root_path", "")
        name, kind, key = form.get("db", ""), form.get("kind", ""), form.get("key", "")
        if name not in databases.names or kind not in ("outbox", "spawn", "timer"):
            return page(request, "error.html", "dead", 400, error="no such dead letter")
        try:
            parsed = dead_key(kind, key)
            if request.url.path.endswith("/revive"):
                revived = await databases.call(name, "revive_dead_letter", kind, parsed)
                done = "revived" if revived else "gone"
            else:
                gone = await databases.call(name, "discard_dead_letter", kind, parsed)
                done = "discarded" if gone else "gone"
        except (ValueError, TypeError) as exc:
            return page(request, "error.html", "dead", 400, error=one_line(exc))
        except (StoreError, OSError) as exc:
            return page(request, "error.html", "dead", 503, error=one_line(exc))
        return RedirectResponse(f"{root}/dead?done={done}", 303)

    async def timers(request: Request) -> Response:
        rows = await each("timers_view", limit=TIMERS)
        return page(request, "timers.html", "timers", databases=rows, limit=TIMERS)

    async def live(request: Request) -> Response:
        async def stream() -> AsyncIterator[bytes]:
            async with hub.listening():
                yield b"retry: 1000\n\n"
                # What the page was rendered at (or told last, on a reconnection): a change
                # since then is told at once.
                told = request.headers.get("last-event-id") or request.query_params.get("since")
                seen = hub.version
                if told:  # ours, or another process's (a restart): then a change, maybe
                    mark = re.fullmatch(r"([0-9a-f]{8})-([0-9]{1,18})", told)
                    ours = mark is not None and mark.group(1) == hub.boot
                    seen = int(mark.group(2)) if mark is not None and ours else -1
                ends = time.monotonic() + STREAM_FOR
                while not hub.closed and time.monotonic() < ends:
                    quiet = min(HEARTBEAT, max(ends - time.monotonic(), 0.0))
                    if await hub.changed(seen, quiet):
                        if hub.closed:
                            break
                        seen = hub.version
                        told = f"{hub.boot}-{seen}"
                        yield f"event: change\nid: {told}\ndata: {told}\n\n".encode()
                        await asyncio.sleep(LIVE_GAP)  # a burst: one refresh per gap, its last told
                    elif time.monotonic() < ends:
                        yield b": quiet\n\n"

        headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    def static_file(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in static:
            return Response("not found\n", 404, media_type="text/plain")
        kind = "text/css" if name.endswith(".css") else "text/javascript"
        return Response(static[name], media_type=kind, headers={"cache-control": "max-age=300"})

    async def not_found(request: Request, exc: Exception) -> Response:
        return page(request, "missing.html", "", 404, id=None, stranger=True)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await hub.stop()
        await databases.close()

    inner = Starlette(
        routes=[
            Route("/", overview),
            Route("/executions", executions),
            Route("/executions/{id:path}", execution),
            Route("/dead", dead),
            Route("/dead/revive", dead_action, methods=["POST"]),
            Route("/dead/discard", dead_action, methods=["POST"]),
            Route("/timers", timers),
            Route("/live", live),
            Route("/static/{name}", static_file),
        ],
        exception_handlers={404: not_found},
        lifespan=lifespan,
    )
    guard = Guard(inner, token=token, actions=actions, secret=secret, hosts=hosts, render=render)
    guard.close_streams = hub.close
    return guard


def exe_url(execution_id: str) -> str:
    """The path of an execution's page under the console's root: ``executions/ID`` (the id
    quoted whole), or ``executions?id=ID`` for an id a path segment cannot be ("." and "..",
    which every URL parser resolves away)."""
    quoted = quote(str(execution_id), safe="")
    if quoted in (".", ".."):
        return f"/executions?id={quoted}"
    return f"/executions/{quoted}"


def child_page(execution_id: str, after: str) -> str:
    """The path of an execution's page showing its children after ``after`` (by id)."""
    path = exe_url(execution_id)
    return path + ("&" if "?" in path else "?") + urlencode({"children_after": after})


def dead_key(kind: str, key: str) -> int | tuple[str, str]:
    """A dead letter's key as a form carries it: a seq, or a timer's JSON [id, path]."""
    if kind != "timer":
        return int(key)
    pair = json.loads(key)
    if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
        raise ValueError("a timer's key is [execution_id, path]")
    return pair[0], pair[1]
