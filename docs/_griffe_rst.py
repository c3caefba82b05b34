"""A griffe extension: tailrace's reST-flavoured docstrings, rendered as Markdown.

The docstrings in ``src/`` are written for ``help()`` and doctest: Sphinx roles
(``:class:`~tailrace.gates.Server```), ``>>>`` examples and ``::`` literal
blocks. Markdown would show the roles verbatim, read ``>>>`` as nested quotes
and ``[True, False]`` in an example's output as a link. This extension rewrites
each docstring once the package is loaded, before mkdocstrings parses it:

- a role becomes an optional cross-reference: a link when its target is on a
  page of the reference, plain code otherwise (private helpers are not
  documented, and a docstring may name them);
- a run of ``>>>`` lines and their output becomes a ``pycon`` code block;
- a paragraph ending in ``::`` introduces a ``python`` code block.

The docs build runs it (``mkdocs.yml``); the source stays as it is.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`<>]+)`")


class RstToMarkdown(griffe.Extension):
    """Rewrite every docstring of the loaded package (see the module docstring)."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Rewrite ``obj``'s own docstring; ``loader`` and ``kwargs`` are griffe's."""
        if obj.is_alias or obj.docstring is None:
            return
        text = literal_blocks(doctest_blocks(obj.docstring.value))
        obj.docstring.value = ROLE.sub(lambda m: _reference(obj, m), text)


def _reference(obj: griffe.Object, match: re.Match[str]) -> str:
    """An optional autorefs link for one role; its title is the short or full name as code."""
    short, target = match.group(1) == "~", match.group(2).strip().rstrip("()")
    title = target.rsplit(".", 1)[-1] if short else target
    identifier = _resolve(obj, target)
    return (
        f'<autoref identifier="{html.escape(identifier)}" optional>'
        f"<code>{html.escape(title)}</code></autoref>"
    )


def _resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as seen from ``obj``; ``target`` itself when it does not resolve."""
    if target.startswith("tailrace"):
        return target
    head, _, rest = target.partition(".")
    scope: griffe.Object | None = obj if obj.is_class or obj.is_module else obj.parent
    while scope is not None:
        try:
            base = scope.resolve(head)
        except griffe.NameResolutionError:
            scope = scope.parent
            continue
        return f"{base}.{rest}" if rest else base
    return target


def doctest_blocks(text: str) -> str:
    """Fence each run of ``>>>`` lines, with the output lines after it, as ``pycon``."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.lstrip().startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        block: list[str] = []
        while i < len(lines) and lines[i].strip():
            block.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if out and out[-1].strip():
            out.append("")
        out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```", ""]
    return "\n".join(out)


def literal_blocks(text: str) -> str:
    """Turn reST ``paragraph::`` + indented block into ``paragraph:`` + a fenced python block."""
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if not line.rstrip().endswith("::"):
            continue
        out[-1] = line.rstrip()[:-1]
        base = len(line) - len(line.lstrip())
        j = i
        while j < len(lines) and not lines[j].strip():
            j += 1
        block: list[str] = []
        while j < len(lines) and (
            not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) > base
        ):
            block.append(lines[j])
            j += 1
        while block and not block[-1].strip():
            block.pop()
        if not block:
            continue
        cut = min(len(b) - len(b.lstrip()) for b in block if b.strip())
        pad = " " * base
        lang = "text" if any(c in "".join(block) for c in "├└│") else "python"
        out += ["", f"{pad}```{lang}", *(pad + b[cut:] for b in block), f"{pad}```", ""]
        i = j
    return "\n".join(out)
