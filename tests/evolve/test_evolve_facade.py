"""tailrace.evolve's facade: __all__ sorted and complete; public callables document every parameter."""

from __future__ import annotations

import dataclasses
import inspect
import re
import types

import tailrace.evolve as ev


def _isort_key(name: str) -> tuple[int, str]:
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2), name


def test_all_is_sorted_and_equals_the_public_names():
    assert list(ev.__all__) == sorted(ev.__all__, key=_isort_key)
    public = {
        n
        for n, v in vars(ev).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and n != "annotations"
    }
    assert public == set(ev.__all__)


def _callables():
    for name in ev.__all__:
        obj = getattr(ev, name)
        if inspect.isfunction(obj):
            yield name, obj, ""
        elif inspect.isclass(obj):
            doc = inspect.getdoc(obj) or ""
            init = obj.__dict__.get("__init__")
            if inspect.isfunction(init) and not dataclasses.is_dataclass(obj):
                yield f"{name}.__init__", init, doc
            for attr, raw in obj.__dict__.items():
                if attr.startswith("_"):
                    continue
                fn = raw.__func__ if isinstance(raw, staticmethod | classmethod) else raw
                if inspect.isfunction(fn):
                    yield f"{name}.{attr}", fn, ""


def test_public_callables_document_every_parameter():
    missing = {}
    for qualname, fn, extra in _callables():
        doc = (inspect.getdoc(fn) or "") + "\n" + extra
        assert doc.strip(), f"{qualname} has no docstring"
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.name not in ("self", "cls")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            and not re.search(rf"\b{re.escape(p.name)}\b", doc)
        ]
        if params:
            missing[qualname] = params
    assert not missing, missing


def test_record_classes_document_their_fields():
    for name in ev.__all__:
        obj = getattr(ev, name)
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
            doc = inspect.getdoc(obj) or ""
            undocumented = [
                f.name for f in dataclasses.fields(obj) if not re.search(rf"\b{f.name}\b", doc)
            ]
            assert not undocumented, (name, undocumented)
