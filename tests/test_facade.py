"""The public facade: ``__all__`` is sorted, complete and resolvable; public callables document their parameters.

``__all__`` is sorted the way ``ruff``'s RUF022 (isort-style) sorts it:
SCREAMING_CASE constants first, then CamelCase classes, then everything
else, each group alphabetically.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import types

import pytest

import tailrace

FACADES = [
    "tailrace",
    "tailrace.tail",
    "tailrace.stores",
    "tailrace.gates",
    "tailrace.evolve",
    "tailrace.executors",
    "tailrace.workers",
    "tailrace.integrations.openai",
]


def _isort_key(name: str) -> tuple[int, str]:
    if name.isupper():
        group = 0
    elif name[:1].isupper():
        group = 1
    else:
        group = 2
    return group, name


def _public_names(module: types.ModuleType) -> set[str]:
    """Names the module really defines for users: not private, not modules, not ``annotations``."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }


def _facade(name: str) -> types.ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:  # pragma: no cover - a subpackage not written yet
        pytest.skip(f"{name} is not present")


@pytest.mark.parametrize("module_name", FACADES)
def test_all_is_sorted(module_name):
    module = _facade(module_name)
    names = list(module.__all__)
    assert names == sorted(names, key=_isort_key)
    assert len(names) == len(set(names)), "duplicates in __all__"


@pytest.mark.parametrize("module_name", FACADES)
def test_all_equals_the_public_names(module_name):
    module = _facade(module_name)
    exported = set(module.__all__)
    defined = _public_names(module)
    lazy = {name for name in exported - defined if hasattr(module, "__getattr__")}
    missing_from_all = defined - exported
    not_defined = exported - defined - lazy
    assert not missing_from_all, (
        f"{module_name} defines public names missing from __all__: {sorted(missing_from_all)}"
    )
    assert not not_defined, (
        f"{module_name}.__all__ lists names it does not define: {sorted(not_defined)}"
    )


@pytest.mark.parametrize("module_name", FACADES)
def test_every_name_in_all_resolves(module_name):
    module = _facade(module_name)
    for name in module.__all__:
        assert getattr(module, name) is not None, name


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from tailrace import *", namespace)
    namespace.pop("__builtins__")
    assert set(namespace) == set(tailrace.__all__)


def test_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", tailrace.__version__)


# ---------------------------------------------------------------------------
# docstrings mention every parameter
# ---------------------------------------------------------------------------

SKIPPED_KINDS = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _documented_params(fn, extra_doc: str = "") -> list[str]:
    """Parameters of ``fn`` its docstring (plus ``extra_doc``) does not mention."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return []
    doc = (inspect.getdoc(fn) or "") + "\n" + extra_doc
    missing = []
    for param in signature.parameters.values():
        if param.name in ("self", "cls") or param.kind in SKIPPED_KINDS:
            continue
        if not re.search(rf"\b{re.escape(param.name)}\b", doc):
            missing.append(param.name)
    return missing


def _public_callables():
    """(qualified name, callable, extra documentation) for everything exported that takes parameters."""
    for name in tailrace.__all__:
        obj = getattr(tailrace, name)
        if inspect.isfunction(obj):
            yield f"tailrace.{name}", obj, ""
            continue
        if not inspect.isclass(obj):
            continue
        class_doc = inspect.getdoc(obj) or ""
        init = obj.__dict__.get("__init__")
        if inspect.isfunction(init) and not dataclasses.is_dataclass(obj):
            yield f"tailrace.{name}.__init__", init, class_doc
        for attr, raw in obj.__dict__.items():
            if attr.startswith("_"):
                continue
            if isinstance(raw, (staticmethod, classmethod)):
                yield f"tailrace.{name}.{attr}", raw.__func__, ""
            elif inspect.isfunction(raw):
                yield f"tailrace.{name}.{attr}", raw, ""


def test_public_callables_have_docstrings():
    undocumented = [
        qualname for qualname, fn, extra in _public_callables() if not (inspect.getdoc(fn) or extra)
    ]
    assert not undocumented, f"public callables without a docstring: {undocumented}"


def test_docstrings_mention_every_parameter():
    violations = {}
    for qualname, fn, extra in _public_callables():
        missing = _documented_params(fn, extra)
        if missing:
            violations[qualname] = missing
    assert not violations, "docstrings that do not mention these parameters:\n" + "\n".join(
        f"  {qualname}: {', '.join(missing)}" for qualname, missing in sorted(violations.items())
    )


def test_the_docstring_check_sees_the_api():
    seen = {qualname for qualname, _, _ in _public_callables()}
    for expected in (
        "tailrace.run",
        "tailrace.Graph.add_node",
        "tailrace.Engine.run",
        "tailrace.Engine.__init__",
    ):
        assert expected in seen
