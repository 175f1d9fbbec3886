"""A server that answers wrongly (a proxy, a load balancer, a broken build), and a store's
lifecycle against a remote primary: every trouble is a `StoreError` (`OutcomeUnknown` for a
write of unknown fate), `exe.version` says what is stored, and no token is ever shown.

The store runs against the session's real sqld; a stand-in for its HTTP client passes each
request to the real one and bends the answer."""

from __future__ import annotations

import json
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harel_store import (
    DefinitionRecord,
    Event,
    Execution,
    LibsqlStore,
    OutcomeUnknown,
    StoreError,
)
from harel_store.connection import http
from harel_store.errors import scrub
from tests.proxy import Proxy
from tests.sqld import SqldServer

pytestmark = pytest.mark.sqld

Bend = Callable[[dict[str, Any]], Any]  # the real reply's JSON -> the body to send instead


@pytest.fixture
def store(server: SqldServer) -> Iterator[Any]:
    with LibsqlStore(server.url, auth_token=server.token) as s:
        yield s


class Bent:
    """The store's client, but each answer is passed through ``bend`` while it is set."""

    def __init__(self, real: http.Client) -> None:
        self.real = real
        self.bend: Bend | None = None
        self.status = 200
        # The request's JSON -> an answer in the server's stead, or None to send it on.
        self.intercept: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None

    def post(self, path: str, body: bytes) -> http.Response:
        if self.intercept is not None and (instead := self.intercept(json.loads(body))):
            return http.Response(200, {}, json.dumps(instead).encode())
        answer = self.real.post(path, body)
        if self.bend is None:
            return answer
        bent = self.bend(json.loads(answer.body))
        data = bent if isinstance(bent, bytes) else json.dumps(bent).encode()
        return http.Response(self.status, {}, data)


@pytest.fixture
def bent(store: LibsqlStore) -> Iterator[Bent]:
    conn: Any = store._conn
    real = conn._client
    conn._client = stand_in = Bent(real)
    yield stand_in
    conn._client = real


def first_result(change: Callable[[dict[str, Any]], None]) -> Bend:
    def bend(reply: dict[str, Any]) -> dict[str, Any]:
        change(reply["results"][0])
        return reply

    return bend


def raises_cleanly(call: Callable[[], Any], kind: type[StoreError], token: str) -> StoreError:
    with pytest.raises(StoreError) as info:
        call()
    assert type(info.value) is kind, repr(info.value)
    assert token[:8] not in "".join(traceback.format_exception(info.value))
    return info.value


def committed(store: LibsqlStore, exe: Execution) -> Callable[[], Any]:
    return lambda: store.commit(exe, [(None, Event(name="go"))])


@pytest.mark.parametrize(
    "error",
    ["boom", None, 7, ["a"], {"message": 7}, {"message": "m", "code": 9}, {"code": "X"}],
)
def test_an_error_that_is_not_an_error_object(
    store: LibsqlStore, bent: Bent, server: SqldServer, error: Any
) -> None:
    store.save(Execution(id="e", definition_id="d"))
    exe = store.load("e")
    assert exe is not None

    def as_error(result: dict[str, Any]) -> None:
        result.clear()
        result.update({"type": "error", "error": error})

    bent.bend = first_result(as_error)
    raises_cleanly(lambda: store.load("e"), StoreError, server.token)  # never None
    raises_cleanly(committed(store, exe), OutcomeUnknown, server.token)
    assert exe.version == 1
    bent.bend = None
    assert store.load("e").version == 2  # type: ignore[union-attr]  # it had landed


def test_a_reply_nested_too_deep_for_the_parser(
    store: LibsqlStore, bent: Bent, server: SqldServer
) -> None:
    exe = Execution(id="deep", definition_id="d")
    bent.bend = lambda reply: b'{"results":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    raises_cleanly(lambda: store.load("deep"), StoreError, server.token)
    raises_cleanly(committed(store, exe), OutcomeUnknown, server.token)
    assert exe.version == 0


def test_an_undecodable_answer_to_a_write_is_an_unknown_outcome(
    store: LibsqlStore, bent: Bent, server: SqldServer
) -> None:
    """A gzip header on a plain body: the write was sent, and maybe landed."""
    exe = Execution(id="gz", definition_id="d")
    bent.bend = lambda reply: b"\x1f\x8b\x08\x00" + json.dumps(reply).encode()
    error = raises_cleanly(committed(store, exe), OutcomeUnknown, server.token)
    assert "not a Hrana pipeline result" in str(error) and "may or may not" in str(error)
    assert exe.version == 0
    bent.bend = None
    assert store.load("gz").version == 1  # type: ignore[union-attr]  # it had landed


@pytest.mark.parametrize(
    "cell",
    [
        {"type": "integer", "value": "seven"},
        {"type": "integer", "value": 7},
        {"type": "float", "value": "7.5"},
        {"type": "text", "value": 7},
        {"type": "blob", "base64": "!!"},
        {"type": "weird", "value": "x"},
        "bare",
    ],
)
def test_a_cell_that_is_not_the_type_it_declares(
    store: LibsqlStore, bent: Bent, server: SqldServer, cell: Any
) -> None:
    store.save(Execution(id="c", definition_id="d"))

    def bend_cells(result: dict[str, Any]) -> None:
        rows = result["response"]["result"]["rows"]
        rows[0][0] = cell

    bent.bend = first_result(bend_cells)
    raises_cleanly(lambda: store.load("c"), StoreError, server.token)


def test_a_server_that_refuses_every_purge_fails_the_purge_instead_of_looping(
    store: LibsqlStore, bent: Bent, server: SqldServer
) -> None:
    exe = Execution(id="p", definition_id="d", status="finished")
    store.save(exe)
    posts = 0

    def refuse(request: dict[str, Any]) -> dict[str, Any] | None:
        """The delete batch, unsent: its first guard "changed no row"."""
        nonlocal posts
        posts += 1
        batch = request["requests"][0].get("batch")
        if batch is None:
            return None
        errors: list[Any] = [None] * len(batch["steps"])
        errors[2] = {"message": "SQLite error: harel:cas-conflict", "code": None}
        result = {"step_results": [None] * len(errors), "step_errors": errors}
        results = [{"type": "ok", "response": {"type": "batch", "result": result}}]
        results.append({"type": "ok", "response": {"type": "close"}})
        return {"baton": None, "base_url": None, "results": results}

    bent.intercept = refuse
    error = raises_cleanly(lambda: store.purge_tree("p", 1), StoreError, server.token)
    assert "changed under each of 100 tries" in str(error)
    assert posts == 200  # 100 reads, 100 delete batches
    bent.intercept = None
    assert store.load("p") is not None


def test_no_form_of_the_token_survives_in_an_error(
    store: LibsqlStore, bent: Bent, server: SqldServer
) -> None:
    token = server.token
    store.save(Execution(id="t", definition_id="d"))
    # A 500 page that echoes the token where the message is cut.
    bent.status, bent.bend = 500, lambda reply: ("x" * 290 + token).encode()
    raises_cleanly(lambda: store.load("t"), StoreError, token)
    # A cell that echoes it, in the parser's complaint.
    bent.status = 200

    def echo(result: dict[str, Any]) -> None:
        result["response"]["result"]["rows"][0][0] = {"type": "integer", "value": token}

    bent.bend = first_result(echo)
    raises_cleanly(lambda: store.load("t"), StoreError, token)


def test_the_scrubber_knows_escaped_and_cut_forms() -> None:
    secret = 'ab"c/d?e+f=g\\h-long-enough'
    assert scrub(f"x {secret} y", (secret,)) == "x *** y"
    assert scrub(json.dumps({"t": secret}), (secret,)) == '{"t": "***"}'
    assert scrub("u=ab%22c%2Fd%3Fe%2Bf%3Dg%5Ch-long-enough&", (secret,)) == "u=***&"
    assert scrub('... cut here: ab"c/d?e', (secret,)) == "... cut here: ***"
    assert scrub('ends with ab"c', (secret,)) == 'ends with ab"c'  # too short to tell


# --- lifecycle ---


def test_close_while_a_read_waits_for_its_second_try(server: SqldServer) -> None:
    with Proxy(server.port or 0) as proxy:
        store = LibsqlStore(proxy.url(), auth_token=server.token)
        store.save(Execution(id="r", definition_id="d"))
        proxy.mode, proxy.delay = "drop", 0.3  # the answer is lost: the read goes again
        outcome: list[BaseException | Any] = []

        def read() -> None:
            try:
                outcome.append(store.load("r"))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=read)
        thread.start()
        time.sleep(0.1)
        store.close()
        thread.join(5)
        assert len(outcome) == 1
        assert type(outcome[0]) is StoreError and "is closed" in str(outcome[0])


def _no_rows(result: dict[str, Any]) -> None:
    """Every row of a reply's statements (a batch's steps included) taken away."""
    inner = result["response"]["result"]
    for step in inner.get("step_results") or [inner]:
        if step is not None:
            step["rows"] = []


@pytest.mark.parametrize(
    ("query", "call"),
    [
        ("load_for_event", lambda s: s.load_for_event("r", "ev")),
        ("pending_counts", lambda s: s.stats(0.0)),
        ("work_ahead", lambda s: s.peek_work(0.0)),
    ],
    ids=["load_for_event", "pending_counts", "work_ahead"],
)
def test_a_read_with_no_row_where_one_is_due_names_its_query(
    store: LibsqlStore, bent: Bent, server: SqldServer, query: str, call: Callable[[Any], Any]
) -> None:
    store.save(Execution(id="r", definition_id="d"))
    bent.bend = first_result(_no_rows)
    error = raises_cleanly(lambda: call(store), StoreError, server.token)
    assert f"no row of {query}, where one is due" in str(error)


def test_a_publish_answered_with_no_row_is_an_unknown_outcome_naming_its_query(
    store: LibsqlStore, bent: Bent, server: SqldServer
) -> None:
    record = DefinitionRecord(definition_id="d", version=1, digest="x", source={"a": 1})
    bent.bend = first_result(_no_rows)
    error = raises_cleanly(lambda: store.publish_definition(record), OutcomeUnknown, server.token)
    assert "no row of stored_definition, where one is due" in str(error)
    bent.bend = None
    assert store.publish_definition(record) == store.load_definition("d", 1)  # it had landed
