"""Load what the user named on the command line: graphs, ``--graphs`` sets, pollers.

Whoever types ``tailrace run path.py:graph`` chose to execute that file, so the
command line loads files; a reference read back from a store is never executed
as a file (trust model, docs/trust.md; ``resume`` and ``serve`` take ``--graphs``
instead). Every failure is a :class:`typer.BadParameter` (a usage error, exit
code 2) that names the spec as the user typed it, never an internal module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import typer

from ..graph import Graph, load_file_module
from ._render import visible


def _bad(message: str, hint: str) -> typer.BadParameter:
    return typer.BadParameter(visible(message), param_hint=hint)


def is_file_spec(module: str) -> bool:
    """Whether the module part of a spec names a Python file rather than a module."""
    return module.endswith(".py")


def _import(module: str, spec: str, hint: str) -> Any:
    """The module named ``module`` (a file path or a dotted name), as the user typed it."""
    if is_file_spec(module) and not Path(module).is_file():
        raise _bad(f"cannot load {spec!r}: no such file {module}", hint)
    try:
        if is_file_spec(module):
            return _import_file(Path(module).resolve())
        return importlib.import_module(module)
    except ImportError as exc:  # a missing module, or a missing import inside the file
        raise _bad(f"cannot load {spec!r}: {exc}", hint) from exc
    except Exception as exc:  # the user's module raised while it was imported
        raise _bad(
            f"cannot load {spec!r}: {module} raised {type(exc).__name__}: {exc}", hint
        ) from exc


def _import_file(path: Path) -> Any:
    """Import the file at ``path`` as ``python FILE`` runs it: its folder first on ``sys.path``,
    so the modules beside it import (``from flow_v1 import draft``)."""
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return load_file_module(str(path))


def _attribute(module_obj: Any, module: str, attr_path: str, spec: str, hint: str) -> Any:
    obj = module_obj
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            where = module if obj is module_obj else f"{module}:{attr_path}"
            raise _bad(f"cannot load {spec!r}: {where} has no attribute {part!r}", hint)
        obj = getattr(obj, part)
    return obj


def _valid(graph: Graph, spec: str, hint: str) -> Graph:
    try:
        graph.validate()
    except ValueError as exc:  # GraphError (G1)
        raise _bad(f"{spec!r} is not a valid graph: {exc}", hint) from exc
    return graph


def load_object(spec: str, *, hint: str, form: str) -> tuple[Any, str]:
    """Load ``MODULE_OR_FILE:ATTRIBUTE``; returns the object and a reference to it.

    ``hint`` names the parameter in errors; ``form`` is the spec's shape as
    the help shows it. A file's reference holds its absolute path.
    """
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise _bad(f"{spec!r} is not {form}", hint)
    obj = _attribute(_import(module, spec, hint), module, attr, spec, hint)
    ref_module = str(Path(module).resolve()) if is_file_spec(module) else module
    return obj, f"{ref_module}:{attr}"


def load_graph(spec: str) -> tuple[Graph, str]:
    """Load the graph ``MODULE_OR_FILE:GRAPH`` named on the command line; returns it and its reference."""
    graph, ref = load_object(spec, hint="GRAPH", form="MODULE_OR_FILE:GRAPH")
    if not isinstance(graph, Graph):
        raise _bad(f"{spec!r} is a {type(graph).__name__}, not a tailrace Graph", "GRAPH")
    return _valid(graph, spec, "GRAPH"), ref


def load_graphs(specs: list[str] | None) -> list[Graph]:
    """The graphs ``--graphs`` names: each spec is ``FILE_OR_MODULE`` (its module-level
    graphs) or ``FILE_OR_MODULE:GRAPH`` (that one)."""
    return [graph for graph, _ in load_named_graphs(specs)]


def load_named_graphs(specs: list[str] | None) -> list[tuple[Graph, str]]:
    """The graphs ``--graphs`` names (see :func:`load_graphs`), each with where it was found
    (``SPEC:ATTRIBUTE`` as the user would type it), each graph once."""
    graphs: list[tuple[Graph, str]] = []
    for spec in specs or []:
        module, sep, attr = spec.rpartition(":")
        if sep and module and attr:
            found = [(load_object(spec, hint="--graphs", form="FILE_OR_MODULE[:GRAPH]")[0], spec)]
        else:
            module_obj = _import(spec, spec, "--graphs")
            found = [
                (v, f"{spec}:{k}") for k, v in vars(module_obj).items() if isinstance(v, Graph)
            ]
            if not found:
                raise _bad(f"{spec} defines no tailrace Graph at module level", "--graphs")
        for graph, where in found:
            if not isinstance(graph, Graph):
                raise _bad(
                    f"{spec!r} is a {type(graph).__name__}, not a tailrace Graph", "--graphs"
                )
            if not any(graph is seen for seen, _ in graphs):  # one graph, several names
                graphs.append((_valid(graph, spec, "--graphs"), where))
    return graphs


def one_graph_named(graphs: Sequence[tuple[Graph, str]], name: str) -> Graph | None:
    """The graph named ``name`` among ``graphs`` (see :func:`load_named_graphs`), None if none;
    a usage error naming each when there are several, since only one can be meant."""
    found = [(graph, where) for graph, where in graphs if graph.name == name]
    if len(found) > 1:
        places = ", ".join(where for _, where in found)
        raise _bad(
            f"{len(found)} graphs are named {name!r} ({places}): name the one to use, "
            f"e.g. --graphs {found[0][1]}",
            "--graphs",
        )
    return found[0][0] if found else None


def load_pollers(specs: list[str] | None) -> dict[str, Any]:
    """``NAME=MODULE_OR_FILE:CALLABLE`` specs of ``--poller``, as a name -> callable map."""
    pollers: dict[str, Any] = {}
    for spec in specs or []:
        name, sep, ref = spec.partition("=")
        if not sep or not name:
            raise _bad(f"{spec!r} is not NAME=MODULE_OR_FILE:CALLABLE", "--poller")
        poller, _ = load_object(ref, hint="--poller", form="MODULE_OR_FILE:CALLABLE")
        if not callable(poller):
            raise _bad(f"{ref!r} is a {type(poller).__name__}, not callable", "--poller")
        pollers[name] = poller
    return pollers
