"""Every public name of the package has a docstring a reference can be built from (issue 53).

The public names are what the public modules export (their ``__all__``, or for a package
face without one, the names it re-exports from public modules), and the public methods
and properties of the public classes, wherever in the package's classes they are
defined. Each needs a docstring; each callable that takes arguments needs an ``Args:``
section (a class may say ``Attributes:`` instead, as its fields are its arguments); a
constant needs a ``#:`` comment above it or a string below it, which Sphinx's autodoc
reads as its docstring.

An implementation of a protocol's method may instead say ``Implements
:meth:`Protocol.method```: its arguments are the protocol's, documented there once.
"""

from __future__ import annotations

import ast
import enum
import importlib
import importlib.util
import inspect
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PUBLIC_MODULES = (
    "trio_supervisor",
    "trio_supervisor.abc",
    "trio_supervisor.model",
    "trio_supervisor.errors",
    "trio_supervisor.codec",
    "trio_supervisor.retention",
    "trio_supervisor.realtime",
    "trio_supervisor.stores",
    "trio_supervisor.stores.memory",
    "trio_supervisor.stores.sqlite",
    "trio_supervisor.stores.postgres",
    "trio_supervisor.executions",
    "trio_supervisor.executions.subprocess",
    "trio_supervisor.executions.inprocess",
    "trio_supervisor.client",
    "trio_supervisor.testing",
    "trio_supervisor.service",
)

# Names of the service's inner modules that an embedder of the runner meets (and the
# reference documents): what ``run_runner`` and ``RunnerConfig.check`` raise, and the
# ceilings ``create_app`` takes.
EMBEDDER_NAMES = (
    "trio_supervisor.service.config.ConfigError",
    "trio_supervisor.service.runner.StartupError",
    "trio_supervisor.service.tenants.Ceilings",
)

# Callables that take arguments but need no Args section, each with its reason. Kept by
# what they are, not listed one by one, so that a new one of the same kind needs nothing.
EXEMPT_FROM_ARGS: dict[str, Callable[[str, Any], bool]] = {
    # Their arguments are pytest fixtures, which the kit's own docstring names.
    "a contract kit's tests": lambda qualname, obj: (
        qualname.split(".")[-1].startswith("test_")
        and getattr(obj, "__module__", "") == "trio_supervisor.testing.contracts"
    ),
    # Their arguments are drawn by Hypothesis from the strategies the rule declares;
    # nobody calls them.
    "a state machine's rules": lambda qualname, obj: any(
        hasattr(obj, mark)
        for mark in (
            "hypothesis_stateful_rule",
            "hypothesis_stateful_initialize_rule",
            "hypothesis_stateful_invariant",
        )
    ),
}

ARGS = re.compile(r"^\s*(Args|Attributes):\s*$", re.MULTILINE)
IMPLEMENTS = re.compile(r"Implements\s+:meth:`~?([\w.]+)`")


def _private(module: str) -> bool:
    return any(part.startswith("_") for part in module.split("."))


def _exported(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    found = []
    for name in dir(module):
        obj = getattr(module, name)
        home = getattr(obj, "__module__", None)
        if (
            not name.startswith("_")
            and not isinstance(obj, types.ModuleType)
            and isinstance(home, str)
            and home.startswith("trio_supervisor")
            and not _private(home)
        ):
            found.append(name)
    return found


def _own_init(cls: type) -> Callable[..., Any] | None:
    """The class's constructor when the class itself defines it (attrs generates one)."""
    init = vars(cls).get("__init__")
    return init if callable(init) else None


def _parameters(function: Callable[..., Any]) -> list[str]:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    return [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls")
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """Public methods and properties of ``cls`` defined by the package's classes."""
    seen: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("trio_supervisor"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            member = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
            if inspect.isfunction(member) or isinstance(member, property):
                yield name, member


def _implemented(docstring: str, name: str) -> bool:
    """Whether ``docstring`` points at a documented protocol method of the same name."""
    match = IMPLEMENTS.search(docstring)
    if match is None or match.group(1).split(".")[-1] != name:
        return False
    class_path, _, method = match.group(1).rpartition(".")
    module_name, _, class_name = class_path.rpartition(".")
    target = getattr(getattr(importlib.import_module(module_name), class_name), method)
    return bool(ARGS.search(inspect.getdoc(target) or ""))


def _data_documented(module_name: str, name: str) -> bool:
    """Whether the assignment of ``name`` (followed through imports) has a doc comment."""
    module = importlib.import_module(module_name)
    path = Path(module.__file__ or "")
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    for body in _bodies(tree):
        for index, node in enumerate(body):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, ast.AnnAssign)
                else []
            )
            if any(isinstance(target, ast.Name) and target.id == name for target in targets):
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                below = body[index + 1] if index + 1 < len(body) else None
                return above.startswith("#:") or (
                    isinstance(below, ast.Expr)
                    and isinstance(below.value, ast.Constant)
                    and isinstance(below.value.value, str)
                )
            if isinstance(node, ast.ImportFrom) and any(
                (alias.asname or alias.name) == name for alias in node.names
            ):
                original = next(a.name for a in node.names if (a.asname or a.name) == name)
                package = (
                    module_name if path.name == "__init__.py" else module_name.rpartition(".")[0]
                )
                source_module = importlib.util.resolve_name(
                    "." * node.level + (node.module or ""), package
                )
                return _data_documented(source_module, original)
    return False


def _bodies(tree: ast.Module) -> Iterator[list[ast.stmt]]:
    yield tree.body
    for node in tree.body:
        if isinstance(node, ast.If):  # if TYPE_CHECKING: imports
            yield node.body


def _listed() -> Iterator[tuple[str, str]]:
    for module_name in PUBLIC_MODULES:
        for name in _exported(importlib.import_module(module_name)):
            yield module_name, name
    for qualname in EMBEDDER_NAMES:
        module_name, _, name = qualname.rpartition(".")
        yield module_name, name


def public_names() -> Iterator[tuple[str, Any]]:
    """Every public name once, with its object (None for a constant)."""
    seen: set[object] = set()
    for module_name, name in _listed():
        module = importlib.import_module(module_name)
        obj = getattr(module, name)
        qualname = f"{module_name}.{name}"
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if obj in seen:
                continue
            seen.add(obj)
            yield qualname, obj
            if inspect.isclass(obj):
                for member_name, member in _members(obj):
                    yield f"{qualname}.{member_name}", member
        else:
            yield qualname, None


def problems() -> list[str]:
    found = []
    for qualname, obj in public_names():
        if obj is None:
            module_name, _, name = qualname.rpartition(".")
            if not _data_documented(module_name, name):
                found.append(f"{qualname}: a constant without a #: comment")
            continue
        target = obj.fget if isinstance(obj, property) else obj
        docstring = inspect.getdoc(target) or ""
        if not docstring.strip():
            found.append(f"{qualname}: no docstring")
            continue
        if isinstance(obj, property):
            continue
        if inspect.isclass(obj):
            if issubclass(obj, enum.Enum):
                continue
            init = _own_init(obj)
            parameters = _parameters(init) if init is not None else []
            if init is not None and init.__doc__ is not None:
                docstring += "\n" + (inspect.getdoc(init) or "")
        else:
            parameters = _parameters(obj)
        if not parameters or ARGS.search(docstring):
            continue
        if _implemented(docstring, qualname.rpartition(".")[2]):
            continue
        if any(exempt(qualname, obj) for exempt in EXEMPT_FROM_ARGS.values()):
            continue
        found.append(f"{qualname}: takes {', '.join(parameters)} but has no Args section")
    return found


def test_every_public_name_has_a_docstring_with_its_arguments() -> None:
    names = list(public_names())
    assert len(names) > 400, "the public names were not found: has the package's face moved?"
    found = problems()
    assert found == [], f"{len(found)} public names fall short:\n" + "\n".join(found)
