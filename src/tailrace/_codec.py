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
import re
from typing import Any, Protocol, runtime_checkable

from ._values import revive

#: A lone surrogate: valid in a Python str, not in UTF-8, so no database takes it.
_SURROGATE = re.compile("[\ud800-\udfff]")


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

    __slots__ = ("_decoder", "_encoder")

    def __init__(self, *, default: Any = None, object_hook: Any = None) -> None:
        # One prebuilt encoder: json.dumps with options builds a new one per call.
        self._encoder = json.JSONEncoder(
            separators=(",", ":"), allow_nan=False, ensure_ascii=False, default=default
        )
        self._decoder = json.JSONDecoder(object_hook=object_hook)

    def encode(self, value: Any) -> str:
        """Return ``value`` as compact JSON; raises ``TypeError``/``ValueError`` if it is not JSON.

        Refused as well, because no store could keep them (D5): nesting deeper
        than Python's recursion limit, and strings with lone surrogates.

        >>> JsonCodec().encode("\\ud800")
        Traceback (most recent call last):
        ...
        ValueError: a string holds a lone surrogate ('\\ud800' at offset 1): not valid UTF-8
        """
        try:
            text = self._encoder.encode(value)
        except RecursionError:
            raise ValueError("the value is nested too deeply to encode") from None
        if not text.isascii():
            bad = _SURROGATE.search(text)
            if bad is not None:
                raise ValueError(
                    f"a string holds a lone surrogate ({bad.group()!r} at offset "
                    f"{bad.start()}): not valid UTF-8"
                )
        return text

    def decode(self, text: str) -> Any:
        """Return the value ``text`` encodes; ``ValueError`` if it is not JSON."""
        try:
            return self._decoder.decode(text)
        except RecursionError:
            raise ValueError("the stored value is nested too deeply to decode") from None


def _revive(data: dict[str, Any]) -> Any:
    if "$tailrace" in data:
        return revive(data)
    return data


#: Strict JSON that also restores tailrace's own markers (a ``GateTimeout``).
DEFAULT_CODEC = JsonCodec(object_hook=_revive)
