"""The README documents every public method, and the async twin mirrors the sync store."""

from __future__ import annotations

import inspect
from pathlib import Path

from harel_store import AsyncLibsqlStore, LibsqlStore

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def public_methods(cls: type) -> set[str]:
    return {n for n, v in vars(cls).items() if not n.startswith("_") and callable(v)} | {
        n
        for c in cls.__mro__[1:-1]
        for n, v in vars(c).items()
        if not n.startswith("_") and callable(v)
    }


def test_every_public_method_is_in_the_readme() -> None:
    missing = sorted(m for m in public_methods(LibsqlStore) if f"`{m}(" not in README)
    assert missing == []


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
