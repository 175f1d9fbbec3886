"""The one database-URL grammar: what `LibsqlStore`, `AsyncLibsqlStore`, the CLI and Alembic
(``-x url=``) accept, how a database is shown, and how Alembic is told about it.

=============================================  ===============================================
form                                           the database
=============================================  ===============================================
``state.db``, ``:memory:``, a ``Path``         that file (a ``Path`` is always a path)
``file:state.db``, ``file:///abs/state.db``    that file (a URI option is refused)
``sqlite+libsql:///rel.db``, ``////abs.db``    that file; ``sqlite+libsql://`` is ``:memory:``
``http://host:port``, ``https://host``         a remote primary
``libsql://host[:port]``                       over TLS (https); ``?tls=0``: plain http
``ws://``, ``wss://``                          http, https: sqld serves Hrana over HTTP there
``sqlite+libsql://host:port?secure=true``      https; ``secure=false`` or none: http
=============================================  ===============================================

``authToken=`` in a remote URL's query is its token (it wins over an ``auth_token``
argument and the environment); it is never shown. Any other query parameter is refused.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import SplitResult, quote, unquote, urlsplit

__all__ = [
    "DATABASE_ENV",
    "DEFAULT_DATABASE",
    "TOKEN_ENV",
    "DatabaseURL",
    "alembic_url",
    "check_database",
    "database_from_env",
    "is_remote",
    "migration_hint",
    "parse_database",
    "server_key",
    "show",
    "token_from_env",
]

DEFAULT_DATABASE = "harel.db"
DATABASE_ENV = ("HAREL_DATABASE_URL", "TURSO_DATABASE_URL")  # the first one set wins
TOKEN_ENV = ("HAREL_AUTH_TOKEN", "TURSO_AUTH_TOKEN")

# A remote scheme: whether it means TLS, and the query parameter that may say otherwise
# (Turso's clients read ``tls=0``; sqlalchemy-libsql reads ``secure=``, default false).
_REMOTE = {
    "http": (False, None),
    "https": (True, None),
    "ws": (False, None),
    "wss": (True, None),
    "libsql": (True, "tls"),
    "sqlite+libsql": (False, "secure"),
}
_FLAGS = {
    "tls": {"1": True, "0": False},
    "secure": {"true": True, "1": True, "false": False, "0": False},
}
_FILE_SCHEMES = ("sqlite+libsql", "sqlite")  # SQLAlchemy's: sqlite:///rel, sqlite:////abs
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):")
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")
_TOKEN = re.compile(r"[?&]authToken=")
_KNOWN = "a path, file:, http(s)://, libsql://, ws(s):// or sqlite+libsql://"


@dataclass(frozen=True)
class DatabaseURL:
    """A database as the store opens it: ``local`` (a path or ``:memory:``) or ``remote``
    (an ``http(s)://`` URL with no query), its token, and ``where``: how messages show it.
    Neither ``repr`` nor ``where`` ever holds the token."""

    local: str | None
    remote: str | None
    where: str
    auth_token: str = field(default="", repr=False)


def check_database(database: object) -> str:
    """A database argument: a path or a URL, never None or a number made into a file name."""
    if not isinstance(database, (str, os.PathLike)):
        raise TypeError(f"database must be a path or a URL, not {type(database).__name__}")
    text = os.fspath(database)
    if not isinstance(text, str):
        raise TypeError("database must be a path or a URL, not bytes")
    if not text:
        raise ValueError("database must not be empty (a path, a URL or ':memory:')")
    if "\x00" in text:
        raise ValueError("database must not contain a NUL character")
    return text


def parse_database(database: str | os.PathLike[str], auth_token: str = "") -> DatabaseURL:
    """Read ``database`` by the grammar above. Raises TypeError or ValueError (naming what
    is wrong, never a token) for anything it cannot open as meant."""
    text = check_database(database)
    if not isinstance(auth_token, str):
        raise TypeError(f"auth_token must be a string, not {type(auth_token).__name__}")
    match = _SCHEME.match(text)
    if isinstance(database, os.PathLike):
        return DatabaseURL(text, None, text)
    if match and match[1].lower() == "file":
        return _file(text)
    if not match or not text[match.end() :].startswith("//"):  # a colon is a name's: "a:b.db"
        if _TOKEN.search(text):  # a '?' is part of a path's name, but not this one
            _refuse_options({"authToken": ""}, show(text))
        return DatabaseURL(text, None, text)
    scheme = match[1].lower()
    where = show(text)
    if scheme not in _REMOTE and scheme not in _FILE_SCHEMES:
        raise ValueError(f"{where}: unknown scheme {scheme}:// (use {_KNOWN})")
    parts = urlsplit(text)
    if scheme in _FILE_SCHEMES and not parts.netloc:
        return _sqlalchemy_file(text, where)
    if scheme not in _REMOTE:
        raise ValueError(f"{where}: {scheme}:// names a file; for a server use {_KNOWN}")
    if "@" in text[match.end() :]:  # a user part, maybe with /, ? or # in its password
        raise ValueError(
            f"{where}: a database URL takes no user name or password; "
            "give the token as ?authToken= or auth_token"
        )
    return _remote(scheme, parts, where, auth_token)


def _options(query: str, where: str) -> dict[str, str]:
    """A query's parameters; a bare part (no ``=``) is refused without repeating it."""
    options: dict[str, str] = {}
    for part in query.split("&") if query else ():
        key, equals, value = part.partition("=")
        if not equals:
            raise ValueError(f"{where}: each query parameter must be name=value")
        key = unquote(key)
        if key in options:
            raise ValueError(f"{where}: query parameter {key!r} is given twice")
        options[key] = unquote(value)
    return options


def _refuse_options(options: dict[str, str], where: str) -> None:
    """A local file takes no option: libsql opens it by its path alone."""
    if "authToken" in options:
        raise ValueError(f"{where} is a local file: an authToken means nothing to it")
    if options:
        names = ", ".join(sorted(options))
        raise ValueError(
            f"{where}: libsql opens a file by its path and cannot honour URI options ({names}); "
            "give a plain path"
        )


def _file(text: str) -> DatabaseURL:
    """A ``file:`` URI, as SQLite reads one, made a plain path."""
    where = show(text)
    parts = urlsplit(text)
    _refuse_options(_options(parts.query, where), where)
    if parts.fragment:
        raise ValueError(f"{where}: a file: URI takes no #fragment")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{where}: a file: URI names a file on this machine (file:///path)")
    path = _no_nul(unquote(parts.path), where)
    if not path:
        raise ValueError(f"{where}: a file: URI with no path")
    return DatabaseURL(path, None, path)


def _no_nul(path: str, where: str) -> str:
    """A decoded path, refused where it holds a NUL (``%00``), as a plain path is."""
    if "\x00" in path:
        raise ValueError(f"{where}: the path must not contain a NUL character (%00)")
    return path


def _sqlalchemy_file(text: str, where: str) -> DatabaseURL:
    """``sqlite+libsql:///rel.db``, ``sqlite+libsql:////abs.db``, ``sqlite+libsql://``."""
    rest, _, query = text.split("://", 1)[1].partition("?")
    _refuse_options(_options(query, where), where)
    if "#" in rest:
        raise ValueError(f"{where}: a database URL takes no #fragment")
    path = _no_nul(unquote(rest[1:]), where) or ":memory:"  # as SQLAlchemy: in memory
    return DatabaseURL(path, None, path)


def _remote(scheme: str, parts: SplitResult, where: str, auth_token: str) -> DatabaseURL:
    if "@" in parts.netloc:
        raise ValueError(
            f"{where}: a database URL takes no user name or password; "
            "give the token as ?authToken= or auth_token"
        )
    if parts.fragment:
        raise ValueError(f"{where}: a database URL takes no #fragment")
    if not parts.hostname:
        raise ValueError(f"{where}: the URL names no host")
    try:
        parts.port  # noqa: B018 (it raises on a bad port)
    except ValueError:
        raise ValueError(f"{where}: the port must be a number from 0 to 65535") from None
    tls, flag = _REMOTE[scheme]
    token = auth_token
    for key, value in _options(parts.query, where).items():
        if key == "authToken":
            if not value:
                raise ValueError(f"{where}: authToken= is empty")
            token = value
        elif key == flag:
            if value.lower() not in _FLAGS[flag]:
                choices = " or ".join(_FLAGS[flag])
                raise ValueError(f"{where}: {flag} must be {choices}")
            tls = _FLAGS[flag][value.lower()]
        else:
            takes = "authToken" + (f" and {flag}" if flag else "")
            raise ValueError(f"{where}: unknown query parameter {key!r} (it takes {takes})")
    remote = f"{'https' if tls else 'http'}://{parts.netloc}{parts.path}"
    return DatabaseURL(None, remote, where, token)


def server_key(remote: str) -> str:
    """What tells a server's database apart in the process (`DatabaseURL.remote` in, no
    secret out): one text for every spelling of one URL, whatever the case of its scheme and
    host, a port that is the scheme's default, trailing slashes, or an IPv6 address's form."""
    parts = urlsplit(remote)
    scheme = parts.scheme.lower()
    host = parts.hostname or ""
    with contextlib.suppress(ValueError):
        host = ipaddress.ip_address(host).compressed
    netloc = f"[{host}]" if ":" in host else host
    port = parts.port
    if port is not None and port != {"http": 80, "https": 443}.get(scheme):
        netloc = f"{netloc}:{port}"
    return f"{scheme}://{netloc}{parts.path.rstrip('/')}"


def is_remote(database: str | os.PathLike[str]) -> bool:
    """Whether ``database`` names a server (ValueError if it is no database at all)."""
    return parse_database(database).remote is not None


def show(database: str | os.PathLike[str]) -> str:
    """The database fit for messages: a URL (whatever its scheme) without its user info,
    fragment or query, any of which may carry a token; ``tls=`` and ``secure=`` stay, as
    they change what the URL means (``scheme://...`` where an ``@`` after a ``?``, a ``#``
    or a backslash leaves it unclear where a secret ends). A path is shown as it is, up to a
    token in it."""
    text = os.fspath(database) if isinstance(database, os.PathLike) else str(database)
    if isinstance(database, os.PathLike) or not ("://" in text or text[:5].lower() == "file:"):
        return text.partition("?")[0] if _TOKEN.search(text) else text
    scheme, _, rest = text.partition("://")
    if "@" in rest and not rest.startswith("/"):  # a host's URL, not a file's (:///path)
        # A user part, whose password may hold /, ? or #: nothing before the @ is shown.
        before, _, after = rest.rpartition("@")
        if any(mark in before for mark in "#?\\") or _TOKEN.search(before):
            # The @ may as well be inside a token or a fragment: then what follows it is
            # no host but a piece of the secret. Show neither side.
            return f"{scheme}://..."
        text = f"{scheme}://{after}"
    base, _, query = text.split("#", 1)[0].partition("?")
    kept = [
        part
        for part in query.split("&")
        if (pair := part.lower().partition("="))[0] in _FLAGS and pair[2] in _FLAGS[pair[0]]
    ]
    return _USERINFO.sub(r"\1", base) + ("?" + "&".join(kept) if kept else "")


def database_from_env(url: str | None = None, default: str = DEFAULT_DATABASE) -> str:
    """The database to use: ``url``, else ``$HAREL_DATABASE_URL``, else
    ``$TURSO_DATABASE_URL``, else ``default``. An empty ``url`` is an error, not a reason
    to fall back (``--url ""`` from a script whose variable was unset)."""
    if url is not None and not url.strip():
        raise ValueError("the database URL is empty: give a path or a URL")
    return url or next((os.environ[n] for n in DATABASE_ENV if os.environ.get(n)), default)


def token_from_env() -> str:
    """The auth token: ``$HAREL_AUTH_TOKEN``, else ``$TURSO_AUTH_TOKEN``, else none."""
    return next((os.environ[n] for n in TOKEN_ENV if os.environ.get(n)), "")


def alembic_url(database: str | os.PathLike[str] | DatabaseURL) -> str:
    """The database as a sqlalchemy-libsql URL, for Alembic: ``sqlite+libsql:///path`` or
    ``sqlite+libsql://host:port?secure=true|false``. It never holds the token (give it in
    ``connect_args``: sqlalchemy-libsql 0.2.0 does not send an ``authToken=``)."""
    db = database if isinstance(database, DatabaseURL) else parse_database(database)
    if db.remote is None:
        path = str(db.local)
        return "sqlite+libsql://" if path == ":memory:" else f"sqlite+libsql:///{quote(path)}"
    parts = urlsplit(db.remote)
    secure = "true" if parts.scheme == "https" else "false"
    return f"sqlite+libsql://{parts.netloc}{parts.path.rstrip('/')}?secure={secure}"


def migration_hint(database: str | Path | DatabaseURL) -> str:
    """The Alembic command that brings ``database`` to head (never with a token in it)."""
    return f"alembic -x {shlex.quote('url=' + alembic_url(database))} upgrade head"
