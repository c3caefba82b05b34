"""References to code: naming callables for JSON forms, resolving them back (trust model).

A reference is ``package.module:attr.path``. A file reference
(``path/to/file.py:attr``) executes the file when loaded, so it is loaded only
when the caller opts in (``allow_files=True``; ``docs/trust.md``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._errors import GraphError

if TYPE_CHECKING:
    from ._graph import Graph


def callable_reference(fn: Callable[..., Any], node_id: str = "?") -> str:
    """``module:qualname`` of a callable, for JSON forms."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module is None or qualname is None:
        # A callable object: its class's name would rebuild the class, not it.
        raise GraphError(
            f"node {node_id!r}: handler {fn!r} has no importable name; use a function, "
            "or pass it to from_dict(handlers=...)"
        )
    return f"{module}:{qualname}"


def graph_reference(graph: Any, node_id: str = "?") -> str:
    """``module:attribute`` of a child graph (a node's handler that is a Graph), for JSON forms."""
    ref = guess_reference(graph)
    if ref is None:
        raise GraphError(
            f"node {node_id!r}: child graph {graph.name!r} has no importable name; define it "
            "at module level beside its handlers, or pass it to from_dict(handlers=...)"
        )
    return ref


def is_file_reference(ref: str) -> bool:
    """Whether ``ref`` names a Python file (``path/to/file.py:attr``) rather than a module."""
    module_name = ref.rpartition(":")[0]
    return module_name.endswith(".py") or "/" in module_name or "\\" in module_name


def resolve_reference(ref: str, *, allow_files: bool = False) -> Any:
    """Import ``package.module:attr.path`` and return the object.

    ``ref`` names an importable module (one on ``sys.path``) and an attribute
    path in it. A file reference, ``path/to/file.py:attr``, executes that file:
    it is loaded only when ``allow_files`` is true, which a caller sets only
    for a reference a trusted person gave it (the command line's
    ``tailrace run path.py:graph``), never for one read from a store (trust
    model, see ``docs/trust.md``). A malformed or refused reference raises
    :class:`GraphError` (a ``ValueError``); a missing module or attribute
    raises ``ImportError`` or ``AttributeError``.
    """
    if not isinstance(ref, str):
        raise GraphError(f"reference {ref!r} is not a string")
    module_name, sep, attr_path = ref.rpartition(":")
    if not sep or not attr_path or not module_name:
        raise GraphError(f"reference {ref!r} is not of the form 'module:attribute'")
    parts = attr_path.split(".")
    if "<locals>" in parts:
        raise GraphError(f"reference {ref!r} points into a function's locals")
    if not all(part.isidentifier() for part in parts):
        raise GraphError(f"reference {ref!r}: {attr_path!r} is not an attribute path")
    obj = _import_for(ref, module_name, allow_files)
    for part in parts:
        obj = getattr(obj, part)
    return obj


def _import_for(ref: str, module_name: str, allow_files: bool) -> Any:
    if is_file_reference(ref):
        if not allow_files:
            raise GraphError(
                f"reference {ref!r} names a file; loading it would execute it, so file "
                "references are loaded only when the caller opts in (allow_files=True)"
            )
        if module_name.endswith(".py"):
            return load_file_module(module_name)
    if not all(part.isidentifier() for part in module_name.split(".")):
        # Also refuses relative names ('.x'), which import_module meets with a TypeError.
        raise GraphError(f"reference {ref!r}: {module_name!r} is not an importable module name")
    return importlib.import_module(module_name)


#: Importing a file publishes its module before running it: threads must take turns.
_FILE_IMPORT_LOCK = threading.RLock()


def load_file_module(path: str) -> Any:
    """Import a Python file as a module (once per resolved path) and return it."""
    with _FILE_IMPORT_LOCK:
        return _load_file_module(path)


#: Modules loaded from files are named this prefix and a hash of the file's resolved path.
FILE_MODULE_PREFIX = "tailrace_file_"


def file_modules() -> list[ModuleType]:
    """The modules loaded from files so far, in load order.

    No other process can import them by name (their names hash a path of this
    host), so code of theirs that crosses to another process (a Ray task)
    travels by value.
    """
    with _FILE_IMPORT_LOCK:
        return [m for name, m in list(sys.modules.items()) if name.startswith(FILE_MODULE_PREFIX)]


def _load_file_module(path: str) -> Any:
    resolved = Path(path).resolve()
    name = FILE_MODULE_PREFIX + hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    if not resolved.is_file():
        raise ImportError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """True for ``async def`` functions and objects whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - we want the bound __call__
    )


def guess_reference(graph: Graph) -> str | None:
    """``module:name`` of the graph, looked up in the modules that define its handlers (and
    its child graphs' handlers).

    A graph of a file loaded by :func:`load_file_module` is named by the file
    (``/path/to/file.py:name``, as ``tailrace run path.py:graph`` names it),
    never by the module name that hashes its path.
    """
    seen: set[str] = set()
    for module_name in _handler_modules(graph, []):
        if module_name in seen or module_name == "__main__":
            continue
        seen.add(module_name)
        module = sys.modules.get(module_name)
        for attr, value in vars(module).items() if module is not None else ():
            if value is graph:
                return f"{_module_reference(module_name, module)}:{attr}"
    return None


def _handler_modules(graph: Graph, visited: list[Graph]) -> list[str]:
    """The modules of ``graph``'s handlers, then of its child graphs', each graph read once."""
    visited.append(graph)
    names = [getattr(node.handler, "__module__", None) or "" for node in graph.nodes.values()]
    for child in graph.child_graphs():
        if not any(child is g for g in visited):
            names += _handler_modules(child, visited)
    return names


def _module_reference(name: str, module: ModuleType | None) -> str:
    """How a reference names module ``name``: a file's path for a module loaded from a file."""
    path = getattr(module, "__file__", None)
    if name.startswith(FILE_MODULE_PREFIX) and path:
        return str(path)
    return name


def is_generator_callable(fn: Callable[..., Any]) -> bool:
    """True for generator functions (``def`` or ``async def`` with ``yield``), and objects whose
    ``__call__`` is one: calling them starts a generator instead of running them (G1)."""
    call = getattr(fn, "__call__", None)  # noqa: B004 - we want the bound __call__
    return any(inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f) for f in (fn, call))
