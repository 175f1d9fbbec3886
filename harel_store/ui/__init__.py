"""The console: see, follow and repair the engine's databases in a browser.

``harel_store.ui.app(source, actions=False, token=None)`` is an ASGI application over
``source``: a store (`LibsqlStore`, `SqliteStore`), an `AsyncLibsqlStore`, a `Fleet` or
`AsyncFleet`, a database as ``--url`` takes it, or a mapping of names to such databases (a
fleet file's). A database given by URL is opened by the console: checked, never migrated, a
local file for reading only unless ``actions``; its token from ``HAREL_AUTH_TOKEN``.
Serve it with any ASGI server, or mount it under a prefix of
your own application: every link and form honours the ASGI ``root_path``.
``harel-store ui`` serves it with uvicorn. Needs the ``ui`` extra (Starlette, Jinja2,
uvicorn): ``pip install 'harel-store[ui]'``.

The pages are rendered on the server and readable without JavaScript; with it, an open page
updates in place when the database changes (server-sent events, pushed by the store's
wake-up; no poll of the database while nothing changes). Read-only unless ``actions``;
``token``: every request needs it (``Authorization: Bearer``, or the session cookie its
login form sets). ``hosts``: more names the console is reached by (a reverse proxy's),
besides this host's names and addresses: a request for any other ``Host`` is refused (DNS
rebinding).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from harel_store.ui.source import Source

__all__ = ["app"]


def app(
    source: Source,
    *,
    actions: bool = False,
    token: str | None = None,
    hosts: Iterable[str] = (),
) -> ASGIApp:
    """The console over ``source`` as an ASGI application (see the module docstring)."""
    try:
        from harel_store.ui.source import Databases
        from harel_store.ui.web import make_app
    except ImportError as exc:  # pragma: no cover - the extra is installed in the tests
        raise ImportError(
            f"the console needs the ui extra: pip install 'harel-store[ui]' ({exc})"
        ) from None
    if not isinstance(actions, bool):
        raise TypeError(f"actions must be a bool, not {type(actions).__name__}")
    if token is not None and (not isinstance(token, str) or not token):
        raise ValueError("token must be a non-empty string, or None")
    if isinstance(hosts, str):
        raise TypeError("hosts must be an iterable of host names, not a string")
    from harel_store.connection.url import token_from_env

    opened = isinstance(source, (str, os.PathLike, Mapping))
    auth = token_from_env() if opened else ""
    databases = Databases(source, auth_token=auth, writes=actions)
    return make_app(databases, actions=actions, token=token, hosts=hosts)
