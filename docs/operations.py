"""A Griffe extension for the API reference: each store operation as the method it is.

A store operation is written once, as a plan decorated with `harel_store.operation.operation`
(``def load(...) -> Plan[Execution | None]``), and the async twin declares
``load = awaitable(Store.load)``. At run time both are methods with the plan's signature and
its result unwrapped; Griffe reads the source, so this extension tells it the same: the
plan's ``Plan[T]`` shown as ``T``, and each twin attribute made an async method with the
operation's parameters. Loaded by mkdocs.yml (mkdocstrings' ``extensions``).
"""

from __future__ import annotations

from typing import Any

import griffe


class Operations(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "harel_store":
            return
        operations: dict[str, griffe.Function] = {}
        for module in pkg.modules.values():
            for cls in module.classes.values():
                if cls.is_alias:
                    continue
                for function in cls.functions.values():
                    if function.is_alias:
                        continue
                    if any(str(d.value).endswith("operation") for d in function.decorators):
                        returns = function.returns
                        if not isinstance(returns, griffe.ExprSubscript):
                            raise TypeError(f"{function.path}: a plan returns Plan[T]")
                        function.returns = returns.slice
                        operations[function.name] = function
        twin = pkg["aio"]["AsyncLibsqlStore"]
        for name, attribute in list(twin.attributes.items()):
            if not str(attribute.value).startswith("awaitable("):
                continue
            plan = operations[name]
            method = griffe.Function(
                name,
                lineno=attribute.lineno,
                endlineno=attribute.endlineno,
                parameters=griffe.Parameters(
                    *(
                        griffe.Parameter(
                            p.name, annotation=p.annotation, kind=p.kind, default=p.default
                        )
                        for p in plan.parameters
                    )
                ),
                returns=plan.returns,
                docstring=griffe.Docstring(
                    f"Async version of [`LibsqlStore.{name}`][harel_store.LibsqlStore.{name}].",
                    parent=twin,
                ),
            )
            method.labels.add("async")
            twin.del_member(name)
            twin.set_member(name, method)
