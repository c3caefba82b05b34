"""JSON payload codec (D5): pluggable, never pickle.

A codec turns handler results and inputs into text for the store and back.
The default is strict JSON: ``NaN`` and objects the ``json`` module does not
know are refused, so what is stored always reads back equal.

>>> codec = JsonCodec()
>>> codec.decode(codec.encode({"a": [1, 2.5, None]}))
{'a': [1, 2.5, None]}
"""

from __future__ import annotations

import json
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Codec(Protocol):
    """Encodes payloads to text and back; ``encode`` raises ``TypeError``/``ValueError`` when it cannot."""

    def encode(self, value: Any) -> str:
        """Return ``value`` as text."""
        ...

    def decode(self, text: str) -> Any:
        """Return the value ``text`` encodes."""
        ...


class JsonCodec:
    """Strict JSON: compact separators, no NaN/Infinity, no custom objects.

    ``default`` may convert objects json does not know (it is passed to
    ``json.dumps``); ``object_hook`` the reverse, passed to ``json.loads``.
    """

    __slots__ = ("_dumps_kwargs", "_object_hook")

    def __init__(self, *, default: Any = None, object_hook: Any = None) -> None:
        self._dumps_kwargs: dict[str, Any] = {
            "separators": (",", ":"),
            "allow_nan": False,
            "ensure_ascii": False,
        }
        if default is not None:
            self._dumps_kwargs["default"] = default
        self._object_hook = object_hook

    def encode(self, value: Any) -> str:
        """Return ``value`` as compact JSON; raises ``TypeError``/``ValueError`` if it is not JSON."""
        return json.dumps(value, **self._dumps_kwargs)

    def decode(self, text: str) -> Any:
        """Return the value ``text`` encodes."""
        return json.loads(text, object_hook=self._object_hook)


DEFAULT_CODEC = JsonCodec()
