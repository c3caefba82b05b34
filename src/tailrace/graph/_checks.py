"""Checks of values that come from users or documents: field presence and types, option values.

Each raises :class:`~tailrace.GraphError` naming the field (G1); ``_show`` cuts a
hostile value short so that a message never grows huge.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import GraphError
from ._references import resolve_reference

_TYPE_WORDS = {str: "a string", list: "a list", int: "an integer"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float: NaN would break orderings, infinities are not JSON."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _is_resources(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and k != "" and _is_number(v) and v >= 0 for k, v in value.items()
    )


def _is_json_object(value: Any) -> bool:
    """A mapping with string keys that strict JSON can encode (G3: it round-trips)."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        return False
    try:
        json.dumps(dict(value), allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def _json_copy(value: Mapping[str, Any]) -> dict[str, Any]:
    """A deep copy as JSON reads it back, so later changes to the caller's mapping do not leak in."""
    copied: dict[str, Any] = json.loads(json.dumps(dict(value), allow_nan=False))
    return copied


def _exception_class(ref: Any, allow_files: bool) -> type[BaseException]:
    where = f"retry_on entry {_show(ref)}"
    if not isinstance(ref, str):
        raise GraphError(f"{where} must be a 'module:Class' reference string")
    found = _resolve(ref, allow_files, where)
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        raise GraphError(f"{where} is not an exception class (it names {_show(found)})")
    return found


def _resolve(ref: str, allow_files: bool, where: str) -> Any:
    try:
        return resolve_reference(ref, allow_files=allow_files)
    except GraphError as exc:
        raise GraphError(f"{where}: {exc}") from exc
    except Exception as exc:  # ImportError, AttributeError, or the module failing to import
        raise GraphError(f"{where}: cannot resolve {ref!r}: {type(exc).__name__}: {exc}") from exc


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise GraphError(f"{where} must be an object, got {_show(value)}")
    return value


def _present(doc: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in doc:
        raise GraphError(f"{where}: missing field {name!r}")
    return doc[name]


def _field(doc: Mapping[str, Any], name: str, kind: type, where: str) -> Any:
    value = _present(doc, name, where)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise GraphError(f"{where}: field {name!r} must be {_TYPE_WORDS[kind]}, got {_show(value)}")
    return value


def _refuse_unknown(doc: Mapping[Any, Any], known: frozenset[str], where: str) -> None:
    for key in doc:
        if key not in known:
            raise GraphError(f"{where}: unknown field {_show(key)}")


def _show(value: Any) -> str:
    """``repr`` cut short: a hostile document must not make the message huge."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
