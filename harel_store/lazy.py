"""`Lazy`: a module imported when a name of it is first asked for.

The sync store's modules hold async code paths beside their sync ones, and a process that
never runs a loop never needs ``asyncio``: its import is 3.7 % of the instructions of a
whole ``harel-store status`` run (callgrind: 925 M against 960 M with it). Such a module
names ``asyncio = Lazy("asyncio")`` (the real module under ``TYPE_CHECKING``): every use,
``asyncio.X``, imports it if no one has and reads ``X`` from it. Nothing is copied, so a
monkeypatch of the real module is seen (patch the real module: the stand-in takes no
attributes).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


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
