"""Every URL the dashboard links to, built in one place.

Ids are arbitrary text (a run id may hold ``/``, ``?`` or ``#``), so each is
percent-encoded whole and sits last in its path, after a prefix that says
what it is: ``/runs/ID``, ``/stream/runs/ID``, ``/answer/ID``...
"""

from __future__ import annotations

import urllib.parse

__all__ = [
    "answer_url",
    "artifact_url",
    "cancel_url",
    "fork_url",
    "inbox_url",
    "login_url",
    "question_url",
    "resume_url",
    "run_url",
    "runs_url",
    "static_url",
    "stream_url",
]


def _quoted(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _query(**params: object) -> str:
    kept = {k: str(v) for k, v in params.items() if v is not None and v != ""}
    return "?" + urllib.parse.urlencode(kept) if kept else ""


def runs_url(
    status: str | None = None,
    graph: str | None = None,
    page: int = 1,
    queue: str | None = None,
    parent: str | None = None,
    hide_children: bool = False,
) -> str:
    """The runs list, filtered by ``status``, ``graph``, ``queue`` and ``parent`` run, at ``page``;
    child runs left out with ``hide_children``."""
    return "/runs" + _query(
        status=status, graph=graph, queue=queue, parent=parent,
        children="hide" if hide_children else None, page=page if page > 1 else None,
    )  # fmt: skip


def run_url(run_id: str) -> str:
    """A run's page."""
    return "/runs/" + _quoted(run_id)


def stream_url(run_id: str, after: int, shown: str | None = None) -> str:
    """A run's server-sent events, starting after event ``after``, for a page whose steady
    parts have the digests ``shown`` (``tailrace.ui._stream.shown_param``)."""
    return "/stream/runs/" + _quoted(run_id) + _query(after=after, shown=shown)


def resume_url(run_id: str) -> str:
    """Where a resume of ``run_id`` is POSTed."""
    return "/resume/runs/" + _quoted(run_id)


def cancel_url(run_id: str) -> str:
    """Where a cancel of ``run_id`` is POSTed."""
    return "/cancel/runs/" + _quoted(run_id)


def fork_url(run_id: str) -> str:
    """Where a fork of ``run_id`` is POSTed (the node it starts from is the form's ``at``)."""
    return "/fork/runs/" + _quoted(run_id)


def inbox_url(tab: str | None = None, page: int = 1) -> str:
    """The questions inbox at ``tab``, page ``page``."""
    return "/questions" + _query(tab=tab, page=None if page == 1 else str(page))


def login_url(after: str | None = None) -> str:
    """The login page; ``after`` is the page to go on to once logged in."""
    return "/login" + _query(next=None if after in (None, "/runs") else after)


def question_url(question_id: str) -> str:
    """A question's page."""
    return "/questions/" + _quoted(question_id)


def answer_url(question_id: str) -> str:
    """Where an answer to ``question_id`` is POSTed."""
    return "/answer/" + _quoted(question_id)


def artifact_url(artifact_id: str) -> str:
    """An artifact's evolution page."""
    return "/evolution/" + _quoted(artifact_id)


def static_url(path: str) -> str:
    """A packaged static file (CSS, JavaScript, icon)."""
    return "/static/" + path
