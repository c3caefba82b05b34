"""Text fit to show: the characters a terminal or a page would act on, spelled out.

User and store text (stream chunks, run ids, outputs) is data. A terminal obeys
escape sequences (``\\x1b[31m``) and BEL; a browser drops NUL and lets a
bidirectional override reorder what follows (``invoice\\u202egnp.exe`` shows as
``invoiceexe.png``). So every output that shows such text (the command line,
the dashboard) spells these characters as escapes first, with these functions
(CONVENTIONS 15).

>>> visible("a\\x1b[31mb\\u202e")
'a\\\\x1b[31mb\\\\u202e'
>>> visible_json('"\\x85"')
'"\\\\u0085"'
"""

from __future__ import annotations

import re

#: What a terminal or a page acts on instead of showing: C0 and C1 controls (but
#: newline and tab), DEL, lone surrogates (not even encodable), bidirectional controls.
UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)


def _spell(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def visible(value: object) -> str:
    """``str(value)`` with every character a terminal or a page would act on spelled as an escape."""
    return UNSAFE.sub(_spell, str(value))


def visible_json(dumped: str) -> str:
    """JSON text with those characters as ``\\uXXXX``: still valid JSON, meaning the same.

    They can occur only inside strings, where ``\\uXXXX`` is the same character.
    """
    return UNSAFE.sub(_json_escape, dumped)
