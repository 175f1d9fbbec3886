"""`Lazy`: a module imported when a name of it is first asked for.

The sync store's modules hold async code paths beside their sync ones, and a process that
never runs a loop never needs ``asyncio``: its import is 3.7 % of the instructions of a
whole ``harel-store status`` run (callgrind: 925 M against 960 M with it). Such a module
names ``asyncio = Lazy("asyncio")`` (the real module under ``TYPE_CHECKING``): every use,
``asyncio.X``, imports it if no one has and reads ``X`` from it. Nothing is copied, so a
test's monkeypatch of the real module is seen.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any


class Lazy:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        module = sys.modules.get(self._name) or importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"
