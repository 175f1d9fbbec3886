"""One definition per store operation: the sync store runs it, the async twin awaits it.

An operation is written once, as a method of `harel_store.store.Store` that checks its
arguments and yields its reads and writes (a plan, `harel_store.batch`), with its docstring::

    @operation
    def load(self, execution_id: str) -> Plan[Execution | None]:
        \"\"\"The execution stored under ``execution_id``, or None.\"\"\"
        check_id(execution_id, "execution_id")
        ...

``store.load(id)`` runs the plan on the store's connection and returns its result. The
async twin declares ``load = awaitable(Store.load)``, and ``await twin.load(id)`` drives the
same plan (natively on a remote primary, on a worker thread elsewhere).

Type checkers see each face's real signature: `operation` and `awaitable` are generic over the
plan's parameters (a ``ParamSpec``) and result, and their ``__get__`` gives ``Callable[P, T]``
on a store and ``Callable[P, Coroutine[..., T]]`` on the twin. At run time, once the class is
built, each is replaced by a plain function with the plan's signature (its result unwrapped
from ``Plan[...]``) and docstring: ``inspect``, ``help()``, the API reference and a call see an
ordinary method, at the cost of a hand-written one. The plan itself stays reachable as the
function's ``plan`` (``Store.commit.plan(store, ...)``, to run it inside another plan).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Coroutine, Generator
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    TypeVar,
    get_args,
    get_origin,
    overload,
)

from harel_store.batch import Plan, Request

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S")


class operation(Generic[S, P, T]):
    """A store operation: ``store.name(*args)`` runs ``plan(store, *args)`` on its connection
    (``store._run``) and returns its result."""

    def __init__(self, plan: Callable[Concatenate[S, P], Plan[T]]) -> None:
        _result(plan)  # at once: a TypeError in __set_name__ is wrapped on Python < 3.12
        self.plan = plan

    def __set_name__(self, owner: type, name: str) -> None:
        plan = self.plan

        def run(store: Any, /, *args: Any, **kwargs: Any) -> Any:
            return store._run(plan(store, *args, **kwargs))

        setattr(owner, name, _dressed(run, plan, owner, name, plan.__doc__))

    if TYPE_CHECKING:

        @overload
        def __get__(self, obj: None, owner: type) -> operation[S, P, T]: ...
        @overload
        def __get__(self, obj: object, owner: type | None = None) -> Callable[P, T]: ...
        def __get__(self, obj: object, owner: type | None = None) -> Any: ...


class awaitable(Generic[P, T]):
    """The async twin's face of an `operation`: ``await twin.name(*args)`` drives
    ``plan(twin._s, *args)`` (``twin._run``), ``twin._s`` being the sync store it wraps."""

    def __init__(self, op: operation[Any, P, T]) -> None:
        self.plan = op.plan

    def __set_name__(self, owner: type, name: str) -> None:
        plan = self.plan

        async def run(twin: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await twin._run(plan(twin._s, *args, **kwargs))

        doc = f"Async version of `LibsqlStore.{name}`."
        setattr(owner, name, _dressed(run, plan, owner, name, doc))

    if TYPE_CHECKING:

        @overload
        def __get__(self, obj: None, owner: type) -> awaitable[P, T]: ...
        @overload
        def __get__(
            self, obj: object, owner: type | None = None
        ) -> Callable[P, Coroutine[Any, Any, T]]: ...
        def __get__(self, obj: object, owner: type | None = None) -> Any: ...


def _dressed(
    run: Callable[..., Any], plan: Callable[..., Any], owner: type, name: str, doc: str | None
) -> Callable[..., Any]:
    """``run`` made to look like the method the plan stands for: its name, docstring and
    signature, the return annotation ``Plan[T]`` read as ``T``."""
    result = _result(plan)
    run.__name__ = name
    run.__qualname__ = f"{owner.__qualname__}.{name}"
    run.__module__ = owner.__module__
    run.__doc__ = doc
    signature = inspect.signature(plan).replace(return_annotation=result)
    run.__signature__ = signature  # type: ignore[attr-defined]
    run.__annotations__ = {**plan.__annotations__, "return": result}
    run.__wrapped__ = plan  # type: ignore[attr-defined]  # typing.get_type_hints' globals
    run.plan = plan  # type: ignore[attr-defined]
    return run


def _result(plan: Callable[..., Any]) -> Any:
    """What the plan's ``Plan[T]`` return annotation says it returns: ``T`` as written (a
    string, under ``from __future__ import annotations``), or the type itself."""
    result = inspect.signature(plan).return_annotation
    if isinstance(result, str):
        found = re.fullmatch(r"Plan\[(.*)\]", result)
        if found is not None:
            return found[1]
    elif get_origin(result) is Generator and get_args(result)[:1] == (Request,):
        return get_args(result)[-1]
    raise TypeError(f"{plan.__qualname__}: a plan returns Plan[T], not {result!r}")
