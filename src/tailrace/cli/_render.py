"""Escape at the edge: everything the CLI prints that came from a user or a store.

Run ids, node ids, graph names and references, prompts, answers, outputs and
error messages are data. Rich would read ``[red]`` or ``[/INST]`` in a plain
string as markup (restyling the text, swallowing it, or raising
``MarkupError``), and a terminal obeys escape sequences (``\\x1b[31m``) and
bidirectional overrides. So every such string reaches the console through
:func:`text` (or a table built by :func:`table_of`): a :class:`rich.text.Text`
is never parsed as markup, and :func:`visible` first spells out the characters
a terminal would act on (CONVENTIONS 15).

>>> visible("a\\x1b[31mb")
'a\\\\x1b[31mb'
>>> text("[red]x[/red]").plain
'[red]x[/red]'
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from rich.highlighter import JSONHighlighter
from rich.table import Column, Table
from rich.text import Text

from .._visible import visible as visible
from .._visible import visible_json
from ..core import RunResult
from ..stores import QuestionRow, QuestionStatus

Part = str | tuple[str, str]


def text(*parts: Part) -> Text:
    """A line shown literally: each part is a string, or ``(string, style)``.

    The style of a part is ours; its string is data and is never read as markup.
    """
    out = Text()
    for part in parts:
        if isinstance(part, tuple):
            out.append(visible(part[0]), style=part[1])
        else:
            out.append(visible(part))
    return out


def json_text(value: Any, *, indent: int | None = 2) -> Text:
    """``value`` as highlighted JSON text; unicode as it is, unsafe characters as ``\\uXXXX``.

    The result is still valid JSON: the characters escaped can only occur
    inside strings, where ``\\uXXXX`` means the same character.
    """
    separators = None if indent is not None else (", ", ": ")
    dumped = json.dumps(
        value, indent=indent, ensure_ascii=False, default=repr, separators=separators
    )
    shown = JSONHighlighter()(visible_json(dumped))
    shown.no_wrap = indent is not None
    return shown


def stored_json(encoded: str | None) -> Text:
    """A stored JSON payload (a prompt, an answer) on one line, shown literally."""
    if encoded is None:
        return Text("")
    try:
        return json_text(json.loads(encoded), indent=None)
    except ValueError:  # not ours to judge here: show the stored text as it is
        return text(encoded)


def table_of(
    headers: Sequence[str | Column], rows: Iterable[Sequence[str | Text]], **options: Any
) -> Table:
    """A table whose cells are shown literally (a ``str`` cell is data, never markup)."""
    table = Table(*headers, **options)
    for row in rows:
        table.add_row(*(cell if isinstance(cell, Text) else text(cell) for cell in row))
    return table


def node_table(result: RunResult) -> Table:
    """Status, visits, attempts and time spent per node."""
    return table_of(
        ("node", "status", "visits", "attempts", "duration"),
        (
            (
                node_id,
                report.status,
                str(report.visits),
                str(report.attempts),
                f"{report.duration * 1000:.1f} ms",
            )
            for node_id, report in result.nodes.items()
        ),
    )


def is_stuck(q: QuestionRow) -> bool:
    """An answer a daemon tried to apply and could not, still unapplied (Q4)."""
    unapplied = q.status is QuestionStatus.ANSWERED or (
        q.status is QuestionStatus.EXPIRED and q.applied_at is None
    )
    return unapplied and q.apply_error is not None


def question_status(q: QuestionRow) -> Text:
    """The question's status; an answer serve could not apply is ``stuck`` with the reason."""
    if not is_stuck(q):
        return text(q.status.value)
    tries = f"{q.apply_attempts} attempt{'s' if q.apply_attempts != 1 else ''}"
    return text(("stuck", "red"), f" ({q.status.value}, {tries}): {q.apply_error}")


def question_table(rows: Sequence[QuestionRow], *, title: str | None = None) -> Table:
    """Questions: id, run, gate, turn, status, prompt and answer."""
    return table_of(
        (Column("question", no_wrap=True), "run", "gate", "turn", "status", "prompt", "answer"),
        (
            (
                q.question_id,
                q.run_id,
                q.node_id,
                str(q.turn),
                question_status(q),
                stored_json(q.prompt_json),
                stored_json(q.answer_json),
            )
            for q in rows
        ),
        title=title,
    )
