"""An operation is written once (`harel_store.operation`): both faces are real methods with
its signature, and a type checker sees the parameters and result of each."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from harel_store import AsyncLibsqlStore, LibsqlStore
from harel_store.batch import Plan
from harel_store.operation import awaitable, operation

ROOT = Path(__file__).resolve().parent.parent


def test_both_faces_are_plain_methods_with_the_plans_signature_and_result() -> None:
    sync, twin = LibsqlStore.claim_outbox, AsyncLibsqlStore.claim_outbox
    assert inspect.isfunction(sync) and not inspect.iscoroutinefunction(sync)
    assert inspect.iscoroutinefunction(twin)
    for face in (sync, twin):
        signature = inspect.signature(face)
        assert list(signature.parameters) == ["self", "worker", "limit", "lease", "max_attempts"]
        assert signature.return_annotation == "list[OutboxEntry]"
    assert sync.__doc__ is not None and sync.__doc__.startswith("Claim up to ``limit``")
    assert twin.__doc__ == "Async version of `LibsqlStore.claim_outbox`."
    assert sync.__qualname__ == "Queues.claim_outbox"
    assert twin.__qualname__ == "AsyncLibsqlStore.claim_outbox"


def test_a_plan_must_say_what_it_returns() -> None:
    with pytest.raises(TypeError, match=r"Broken.count: a plan returns Plan\[T\], not 'int'"):

        class Broken:
            @operation
            def count(self) -> int:  # type: ignore[arg-type]
                return 1


def test_an_operation_runs_its_plan_on_the_store_and_awaits_it_on_the_twin() -> None:
    class Tiny:
        def _run(self, plan: Plan[int]) -> int:
            try:
                next(plan)
            except StopIteration as done:
                return int(done.value)
            raise AssertionError("a plan with no request")

        @operation
        def double(self, n: int) -> Plan[int]:
            return 2 * n
            yield  # a generator

    class Twin:
        _s = Tiny()

        async def _run(self, plan: Plan[int]) -> int:
            return self._s._run(plan)

        double = awaitable(Tiny.double)

    import asyncio

    assert Tiny().double(4) == 8
    assert asyncio.run(Twin().double(n=5)) == 10


SNIPPET = """
    from harel_store import AsyncLibsqlStore, Execution, LibsqlStore

    def sync_face(store: LibsqlStore, exe: Execution) -> None:
        reveal_type(store.commit(exe, []))
        reveal_type(store.claim_outbox("w", limit=3))
        store.load(3)
        store.commit(exe, [], bogus=1)

    async def async_face(twin: AsyncLibsqlStore) -> None:
        reveal_type(await twin.load_for_event("a", "b"))
        reveal_type(twin.purge_finished)
        twin.load("a", "b")
"""


@pytest.fixture
def snippet(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "uses_the_store.py"
    path.write_text(textwrap.dedent(SNIPPET))
    yield path


@pytest.mark.slow
def test_a_type_checker_sees_each_faces_real_signature_and_result(snippet: Path) -> None:
    # In a process of its own: mypy run in this one leaves its recursion limit (2**14), its
    # gc thresholds and an environment variable set for every later test of the worker.
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--no-incremental",
            "--config-file",
            str(ROOT / "pyproject.toml"),
            str(snippet),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out, err = run.stdout, run.stderr
    assert err == ""
    lines = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(str(snippet))]
    assert lines == [
        'note: Revealed type is "list[int]"',
        'note: Revealed type is "list[tuple[int, str | None, harel_store.models.Event, '
        'fallback=harel_store.models.OutboxEntry]]"',
        'error: Argument 1 has incompatible type "int"; expected "str"  [arg-type]',
        'error: Unexpected keyword argument "bogus"  [call-arg]',
        'note: Revealed type is "tuple[harel_store.models.Execution | None, bool]"',
        'note: Revealed type is "def (before: float, *, limit: int =) -> '
        'typing.Coroutine[Any, Any, int]"',
        "error: Too many arguments  [call-arg]",
        'error: Value of type "Coroutine[Any, Any, Execution | None]" must be used  '
        "[unused-coroutine]",
        "note: Are you missing an await?",
    ]


def test_the_api_reference_shows_each_face_as_the_method_it_is() -> None:
    """What mkdocstrings renders: Griffe reads the source, where an operation's plan returns
    ``Plan[T]`` and the twin's operations are attributes; docs/operations.py (the extension
    mkdocs.yml loads) shows both as the methods they are at run time."""
    import griffe

    extension = griffe.load_extensions(f"{ROOT / 'docs' / 'operations.py'}:Operations")
    package = griffe.load("harel_store", search_paths=[str(ROOT)], extensions=extension)
    sync = package["store.Store"].all_members["claim_outbox"]
    twin = package["aio.AsyncLibsqlStore"].members["claim_outbox"]
    for face in (sync, twin):
        assert face.is_function
        assert [p.name for p in face.parameters] == [
            "self",
            "worker",
            "limit",
            "lease",
            "max_attempts",
        ]
        assert str(face.returns) == "list[OutboxEntry]"
    assert "async" in twin.labels and "async" not in sync.labels
    assert twin.docstring.value.startswith("Async version of [`LibsqlStore.claim_outbox`]")
