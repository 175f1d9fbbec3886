"""`Lazy`: a module imported when a name of it is first asked for.

The sync store's modules hold async code paths beside their sync ones, and a process that
never runs a loop never needs ``asyncio``: without its import a whole ``harel-store status``
run takes 4.3 % fewer instructions (callgrind: 919 M against 960 M). Such a module imports
``asyncio`` from here (type checkers see the real module): every use, ``asyncio.X``,
imports it if no one has and reads ``X`` from it. Nothing is copied, so a monkeypatch of
the real module is seen (patch the real module: the stand-in takes no attributes).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any


class Lazy:
    __slots__ = ("_module", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if attr in Lazy.__slots__:  # not set yet (a copy made without __init__)
            raise AttributeError(attr)
        module = self._module
        if module is None:
            # import_module, not sys.modules: a module another thread is importing is
            # waited for, never read half made.
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


if TYPE_CHECKING:
    import asyncio as asyncio  # re-exported: what type checkers see
else:
    asyncio = Lazy("asyncio")
