"""Cross-references to a name by any of its paths: the package documents each public
object once, under the name a program imports it by (``trio_supervisor.Key``), while
type hints and docstrings name it where it is defined (``trio_supervisor.model.Key``),
or unqualified from a module that re-exports it (``SessionLostError`` in
``trio_supervisor.client``).

When the Python domain finds no object of that name, this resolver imports the name as
written (and as the context of the reference qualifies it), and links to the documented
name of the same object. A name that is neither documented nor importable stays
unresolved, and the nitpicky build fails on it, as it should.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from docutils.nodes import Element
from sphinx.addnodes import pending_xref
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment

_MISSING = object()
# The documented objects by identity, made once per build (its environment).
_BY_ID: dict[int, dict[int, str]] = {}


def _import(dotted: str) -> Any:
    """The object a dotted name names, importing its module; ``_MISSING`` if none."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # a module that fails to import names nothing here
            return _MISSING
        for part in parts[cut:]:
            try:
                found = inspect.getattr_static(found, part)
            except AttributeError:
                return _MISSING
        return found
    return _MISSING


def _identifiable(obj: Any) -> bool:
    """Whether an object is one thing wherever it is reached from (a class, a function,
    a descriptor), so that its identity says which documented name it is. Values (an
    int, a tuple) are not: two constants may be equal objects."""
    return (
        inspect.isclass(obj)
        or inspect.isroutine(obj)
        or inspect.ismodule(obj)
        or isinstance(obj, property | staticmethod | classmethod)
        or inspect.isdatadescriptor(obj)
    )


def _documented(env: BuildEnvironment) -> dict[int, str]:
    """Every documented object of the Python domain, by its identity."""
    domain = env.get_domain("py")
    by_id: dict[int, str] = {}
    for name, _, _, _, _, _ in domain.get_objects():
        obj = _import(name)
        if obj is not _MISSING and _identifiable(obj):
            by_id.setdefault(id(obj), name)
    return by_id


def _candidates(node: pending_xref) -> list[str]:
    """The names a reference may mean: as written, then qualified by its context (the
    class and module it was written in, and the module that class is defined in)."""
    target = node["reftarget"].lstrip(".~")
    module, cls = node.get("py:module"), node.get("py:class")
    names = [target]
    scopes = []
    if module and cls:
        scopes.append(f"{module}.{cls}")
    if module:
        scopes.append(module)
    if module and cls:
        owner = _import(f"{module}.{cls}")
        defined = getattr(owner, "__module__", None)
        if isinstance(defined, str):
            scopes += [f"{defined}.{cls}", defined]
    names += [f"{scope}.{target}" for scope in scopes]
    return names


def resolve(
    app: Sphinx, env: BuildEnvironment, node: pending_xref, contnode: Element
) -> Element | None:
    """Resolve a Python reference the domain could not, by its object's documented name."""
    if node.get("refdomain") != "py" or not node["reftarget"]:
        return None
    domain = env.get_domain("py")
    documented = {name for name, *_ in domain.get_objects()}
    cache = _BY_ID.get(id(env))
    if cache is None:  # the first missing reference: every page was read by now
        cache = _BY_ID[id(env)] = _documented(env)
    for name in _candidates(node):
        if name in documented:
            found = name
        else:
            obj = _import(name)
            if obj is _MISSING or not _identifiable(obj):
                continue
            found = cache.get(id(obj))
            if found is None:
                continue
        fromdoc = node.get("refdoc", "")
        resolved = domain.resolve_xref(
            env, fromdoc, app.builder, node["reftype"], found, node, contnode
        )
        if resolved is None:  # a :class: role naming a function, say: any role will do
            found_any = domain.resolve_any_xref(env, fromdoc, app.builder, found, node, contnode)
            resolved = found_any[0][1] if found_any else None
        if resolved is not None:
            return resolved
    return None


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("missing-reference", resolve)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
