"""The run page's live updates: server-sent events polled from the store.

The stream reads the run's events after the last one it has, whether
stream rows came after the last one shown, and whether its child runs
changed, every ``poll_interval`` (~200 ms), so it sees what any process
commits, this one or another on the same database. When something changed
it sends one ``update``: the page's parts that changed, re-rendered by the
same macros as the page (escaped), and the new event-log rows to append; the
page's script swaps them in without a reload. The parts holding forms (its
actions, its versions and forks) are sent only when they differ from what the
page shows, which the page names in its stream's address. A finished run gets
a last update and ``end``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from ..stores import TERMINAL_STATUSES, EventRow, RunStore
from ._accounts import Generations
from ._config import UiState
from ._pages import Auth, Pages
from ._versions import VersionsView, versions_view
from ._views import RunView, event_lines, run_view

#: A live run's running bars grow: refresh its parts at least this often (seconds).
LIVE_REFRESH = 1.0
#: A comment this often keeps proxies from closing an idle stream (seconds).
KEEP_ALIVE = 15.0


def sse(event: str, data: Any, *, event_id: int | None = None) -> str:
    """One server-sent event; ``data`` as JSON on one line (ASCII, so no line separator)."""
    head = f"event: {event}\n" + (f"id: {event_id}\n" if event_id is not None else "")
    return f"{head}data: {json.dumps(data)}\n\n"


#: Parts holding forms, sent only when what they offer differs from what the page shows: a
#: button replaced under the pointer misses its click. The page names what it shows by a
#: digest of each, in its stream's address (``shown``), so a page rendered before its run
#: changed (a fork that ended before its page's stream began) still gets them.
STEADY = ("run-actions", "run-versions")


def digest(html: str) -> str:
    """A short digest of a rendered part (what a page says it shows)."""
    return hashlib.sha256(html.encode()).hexdigest()[:16]


def shown_param(parts: Mapping[str, str]) -> str:
    """The ``shown`` value of a stream address: the digests of the page's steady parts."""
    return ".".join(digest(parts[k]) for k in STEADY)


def parse_shown(text: str | None) -> dict[str, str] | None:
    """The digests a stream address says its page shows, by part; None when it says nothing
    readable (then the page is taken to show what the stream first renders)."""
    values = (text or "").split(".")
    if len(values) != len(STEADY) or not all(_HEX.fullmatch(v) for v in values):
        return None
    return dict(zip(STEADY, values, strict=True))


_HEX = re.compile(r"[0-9a-f]{16}")


def steady_parts(pages: Pages, view: RunView, versions: VersionsView, auth: Auth) -> dict[str, str]:
    """The page's parts that hold forms (:data:`STEADY`), by element id."""
    return {
        "run-actions": pages.part("_run.html", "actions", view, auth),
        "run-versions": pages.part("_run.html", "versions", view, versions, auth),
    }


def render_parts(
    pages: Pages, view: RunView, versions: VersionsView, state: UiState, auth: Auth
) -> dict[str, str]:
    """The page's live parts, by element id (a panel of the page is one macro of ``_run.html``
    and one entry here)."""
    note = state.resumer.notes.get(view.run_id) if state.resumer else None
    return {
        "run-header": pages.part("_run.html", "header", view, note, auth),
        "run-questions": pages.part("_run.html", "questions", view, auth),
        "run-graph": pages.part("_run.html", "graph_card", view),
        "run-children": pages.part("_run.html", "children", view),
        "run-gantt": pages.part("_run.html", "gantt", view.gantt),
        "run-maps": pages.part("_run.html", "maps", view),
        "run-tail": pages.part("_run.html", "tail", view),
        "run-parked": pages.part("_run.html", "parked", view),
        "run-late": pages.part("_run.html", "late", view),
        "run-nodes": pages.part("_run.html", "nodes", view),
        "run-streams": pages.part("_run.html", "streams", view),
        "run-drivers": pages.part("_run.html", "drivers", view),
        **steady_parts(pages, view, versions, auth),
    }


async def run_updates(
    state: UiState,
    pages: Pages,
    run_id: str,
    after: int,
    auth: Auth,
    shown_digests: Mapping[str, str] | None = None,
) -> AsyncIterator[str]:
    """Server-sent events for ``run_id``'s page, which shows events up to ``after`` and the
    steady parts whose digests are ``shown_digests`` (None: what this stream first renders)."""
    reader = state.reader
    events: list[EventRow] = list(await reader.events(run_id))
    generations = Generations(run_id)  # read on from where the last update stopped
    page = await _page(state, run_id, events, generations, None)
    view, versions = page
    # What the page shows was rendered before this stream began: the first update sends every
    # part but the steady ones, which are sent only when what they offer changes.
    shown = dict(shown_digests or {})
    if shown_digests is None:
        shown = {k: digest(v) for k, v in steady_parts(pages, view, versions, auth).items()}
    sent_seq, sent_at = after, time.monotonic()
    note = _note(state, run_id)
    children = await _children_seen(reader, run_id)
    while True:
        record = await reader.get_run(run_id)  # before the events: a final status has them all
        events.extend(await reader.events(run_id, after_seq=events[-1].seq if events else 0))
        last = events[-1].seq if events else 0
        finished = record.status in TERMINAL_STATUSES
        due = view.live and time.monotonic() - sent_at >= LIVE_REFRESH
        noted = _note(state, run_id) is not note
        # Chunks are committed without events: new stream rows are a change of their own.
        streamed = bool(await reader.chunks(run_id, after=view.streams.last_seq, limit=1))
        # A child run changes without an event of its parent (one that waits suspended on it).
        seen, children = children, await _children_seen(reader, run_id)
        if last > sent_seq or due or finished or noted or streamed or children != seen:
            note = _note(state, run_id)
            moved = last > sent_seq or finished or noted  # what the versions part offers changes
            view, versions = await _page(
                state, run_id, events, generations, None if moved else versions
            )
            parts = render_parts(pages, view, versions, state, auth)
            changed = {k: v for k, v in parts.items() if shown.get(k) != digest(v)}
            fresh = [e for e in events if e.seq > sent_seq]
            if changed or fresh:
                rows = pages.part("_run.html", "event_rows", event_lines(fresh, record.created_at))
                update = {"seq": last, "status": view.status, "parts": changed, "rows": rows}
                yield sse("update", update, event_id=last)
                shown.update({k: digest(v) for k, v in changed.items()})
                sent_seq, sent_at = last, time.monotonic()
        if finished:
            yield sse("end", {"status": record.status.value})
            return
        if time.monotonic() - sent_at >= KEEP_ALIVE:
            yield ": keep-alive\n\n"
            sent_at = time.monotonic()
        await asyncio.sleep(state.config.poll_interval)


async def _page(
    state: UiState,
    run_id: str,
    events: list[EventRow],
    generations: Generations,
    versions: VersionsView | None,
) -> tuple[RunView, VersionsView]:
    """The run page's view now, and its versions part (read again unless ``versions`` is given)."""
    stored = await state.reader.load_run(run_id)
    view = await run_view(
        state.reader, state.catalog, run_id, now=time.time(), events=events, stored=stored,
        generations=generations,
    )  # fmt: skip
    if versions is None:
        found = await state.catalog.find(stored.run)
        versions = await versions_view(state.reader, state.catalog, stored, found)
    return view, versions


async def _children_seen(reader: RunStore, run_id: str) -> tuple[tuple[str, str, float], ...]:
    """What the page's child runs part shows changes with: each child's status and update time."""
    rows = await reader.list_runs(parent=run_id)
    return tuple((r.run_id, r.status.value, r.updated_at) for r in rows)


def _note(state: UiState, run_id: str) -> object:
    """The resume note of ``run_id`` (part of the header), to notice when it changes."""
    return state.resumer.notes.get(run_id) if state.resumer else None
