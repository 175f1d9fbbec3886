"""The README documents every public method, and the async twin mirrors the sync store."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
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


def test_the_python_snippet_runs_and_runs_again(tmp_path: Path) -> None:
    """A newcomer pastes it, then runs it a second time on the same file."""
    snippet = re.search(r"## Using the store\n\n```python\n(.*?)```", README, re.S)
    assert snippet is not None
    (tmp_path / "snippet.py").write_text(snippet[1] + "print(exe.version)\n")
    runs = [
        subprocess.run(
            [sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        for _ in range(2)
    ]
    assert [(r.returncode, r.stderr, r.stdout) for r in runs] == [(0, "", "2\n"), (0, "", "2\n")]
