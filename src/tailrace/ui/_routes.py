"""The dashboard's endpoints: pages that read, POSTs that change state, the live stream.

Reading needs nothing on loopback and the login cookie beyond it (the app's
read guard); every state change (answer, resume, cancel, fork) is a POST that must
carry the token (``_security``) and is refused in read-only mode.
"""

from __future__ import annotations

import functools
import json
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse

from .._errors import AlreadyAnswered, EncodeError, RunNotFound
from ..stores import TERMINAL_STATUSES, QuestionStatus
from ._config import UiState
from ._fleet import fleet_view
from ._links import artifact_url, run_url, stream_url
from ._pages import Auth, Pages
from ._security import TOKEN_COOKIE, TOKEN_FIELD, TOKEN_HEADER, local_path, token_matches
from ._stream import parse_shown, run_updates, shown_param, steady_parts
from ._versions import forkable, versions_view
from ._views import (
    RUN_FILTERS,
    Tab,
    artifact_view,
    inbox,
    question_view,
    run_view,
    runs_page,
)


def ui_state(request: Request) -> UiState:
    """The state the app's lifespan opened."""
    state: UiState = request.app.state.ui
    return state


def pages_of(request: Request) -> Pages:
    """The app's templates."""
    pages: Pages = request.app.state.pages
    return pages


def auth_of(request: Request) -> Auth:
    """May this viewer change state, and does their browser already hold the token?"""
    config = ui_state(request).config
    if config.read_only:
        return Auth(can_change=False, token=None)
    held = token_matches(config.token, request.cookies.get(TOKEN_COOKIE))
    return Auth(can_change=True, token=config.token if held else None)


def can_read(request: Request) -> bool:
    """Whether this viewer may read: always on loopback, with the login cookie beyond it."""
    config = ui_state(request).config
    if not config.reading_needs_token:
        return True
    return token_matches(config.token, request.cookies.get(TOKEN_COOKIE))


def path_id(request: Request, name: str) -> str:
    """The id in the path; 400 for text no store can key on (NUL, lone surrogates)."""
    value: str = request.path_params[name]
    if not _keyable(value):
        raise HTTPException(400, f"{name.replace('_', ' ')} {value!r} is not a valid id")
    return value


def query_name(request: Request, name: str) -> str | None:
    """A name filter from the query string (None if absent); 400 for text no store can key on."""
    value = request.query_params.get(name) or None
    if value is not None and not _keyable(value):
        raise HTTPException(400, f"{name} {value!r} is not a valid name")
    return value


def _keyable(value: str) -> bool:
    return "\x00" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)


async def page(request: Request, name: str, *, section: str, status_code: int = 200,
               **context: Any) -> Response:  # fmt: skip
    """Render ``name`` with what every page shows (open questions count, the viewer's auth)."""
    state = ui_state(request)
    if not can_read(request):  # a refused POST from a stranger shows nothing of the store
        return pages_of(request).page(name, status_code=status_code, locked=True, **context)
    open_count = (await state.reader.question_counts()).get(QuestionStatus.OPEN, 0)
    return pages_of(request).page(
        name, status_code=status_code, section=section, open_questions=open_count,
        auth=auth_of(request), **context,
    )  # fmt: skip


def see_other(target: str, token: str) -> Response:
    """A 303 to ``target`` that remembers in this browser that it holds the token.

    The cookie fills forms in; it never authorises a change.
    """
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(TOKEN_COOKIE, token, httponly=True, samesite="strict", path="/")
    return response


async def refused(request: Request, form: FormData) -> Response | None:
    """The response refusing this state change, or None when it may go ahead."""
    config = ui_state(request).config
    if config.read_only:
        return await page(request, "error.html", section="", status_code=403,
                          heading="Read-only", back=None,
                          message="This dashboard was started with --read-only: it changes nothing.")  # fmt: skip
    given = request.headers.get(TOKEN_HEADER) or form.get(TOKEN_FIELD)
    if not isinstance(given, str) or not token_matches(config.token, given):
        return await page(request, "error.html", section="", status_code=403,
                          heading="Refused: the token is missing or wrong", back=request.headers.get("referer"),
                          message="A change needs the token `tailrace ui` printed when it started "
                          "(the form's token field, or the X-Tailrace-Token header). Nothing was changed.")  # fmt: skip
    return None


#: A state change's handler: given the request, the id in its path, its form and the app's state.
Change = Callable[[Request, str, FormData, UiState], Awaitable[Response]]
#: What a route calls.
Endpoint = Callable[[Request], Awaitable[Response]]


def changes_state(name: str) -> Callable[[Change], Endpoint]:
    """Guard a state change's handler: the id in the path ``name``, then the token, then it.

    A bad id is a 400 first; then :func:`refused` answers a change without
    the token (or in read-only mode) before the handler reads the store.
    """

    def guard(handler: Change) -> Endpoint:
        @functools.wraps(handler)
        async def endpoint(request: Request) -> Response:
            key = path_id(request, name)
            form = await request.form()
            refusal = await refused(request, form)
            if refusal is not None:
                return refusal
            return await handler(request, key, form, ui_state(request))

        return endpoint

    return guard


# -- logging in ----------------------------------------------------------------------------


async def login(request: Request) -> Response:
    """The login form; its POST of the right token sets the cookie and goes on to ``next``.

    A wrong token gets the form again (401) and says nothing more; the
    token never appears in an address.
    """
    config = ui_state(request).config
    pages = pages_of(request)
    if request.method != "POST":
        target = local_path(request.query_params.get("next"))
        return pages.page("login.html", locked=not can_read(request), next=target, problem=None)
    form = await request.form()
    target = local_path(_text_field(form, "next"))
    if token_matches(config.token, _text_field(form, TOKEN_FIELD)):
        return see_other(target, config.token)
    return pages.page("login.html", status_code=401, locked=not can_read(request), next=target,
                      problem="That is not the token. Nothing was changed.")  # fmt: skip


def _text_field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


# -- pages -------------------------------------------------------------------------------


async def runs(request: Request) -> Response:
    """The runs list: filter by status, graph, queue and parent run, newest first, paginated;
    ``children=hide`` leaves child runs out."""
    status = request.query_params.get("status") or None
    if status is not None and status not in RUN_FILTERS:
        raise HTTPException(400, f"unknown status {status!r}; one of {', '.join(RUN_FILTERS)}")
    children = request.query_params.get("children") or "show"
    if children not in ("show", "hide"):
        raise HTTPException(400, f"children {children[:20]!r} is not 'show' or 'hide'")
    try:
        number = int(request.query_params.get("page", "1"))
    except ValueError:
        number = 1
    state = ui_state(request)
    view = await runs_page(
        state.reader, status=status, graph=query_name(request, "graph"),
        queue=query_name(request, "queue"), page=number,
        page_size=state.config.page_size, now=time.time(), parent=query_name(request, "parent"),
        hide_children=children == "hide", catalog=state.catalog,
    )  # fmt: skip
    return await page(request, "runs.html", section="runs", view=view)


async def run(request: Request) -> Response:
    """A run: its graph, every attempt, late inputs, questions and event log; live.

    A fork this dashboard is creating has a page before its first row is
    written: what its note says, until the run is there.
    """
    run_id = path_id(request, "run_id")
    state = ui_state(request)
    note = state.resumer.notes.get(run_id) if state.resumer else None
    try:
        stored = await state.reader.load_run(run_id)
    except RunNotFound:
        if note is None or state.resumer is None or run_id not in state.resumer.forks:
            raise
        creating = note.state == "forking"
        return await page(request, "forking.html", section="runs", status_code=202 if creating else 404,
                          run_id=run_id, note=note, creating=creating)  # fmt: skip
    view = await run_view(state.reader, state.catalog, run_id, now=time.time(), stored=stored)
    found = await state.catalog.find(stored.run)
    versions = await versions_view(state.reader, state.catalog, stored, found)
    finished = view.status in {s.value for s in TERMINAL_STATUSES}
    shown = shown_param(steady_parts(pages_of(request), view, versions, auth_of(request)))
    data = {"run_id": run_id,
            "stream": None if finished else stream_url(run_id, view.last_seq, shown=shown)}  # fmt: skip
    answered = request.query_params.get("answered")
    cancelled = request.query_params.get("cancelled")
    flash = f"Your answer to question {answered} was recorded." if answered else None
    if cancelled:  # the status pill says what the store says; the flash only what was asked
        flash = "You asked to cancel this run."
    return await page(request, "run.html", section="runs", v=view, note=note, flash=flash,
                      versions=versions, page_data=data)  # fmt: skip


async def stream(request: Request) -> Response:
    """Server-sent events with the run page's changes."""
    run_id = path_id(request, "run_id")
    state = ui_state(request)
    await state.reader.get_run(run_id)  # 404 before a stream starts
    try:
        after = int(request.headers.get("last-event-id") or request.query_params.get("after", "0"))
    except ValueError:
        after = 0
    shown = parse_shown(request.query_params.get("shown"))
    updates = run_updates(state, pages_of(request), run_id, after, auth_of(request), shown)
    return StreamingResponse(
        updates,
        media_type="text/event-stream",
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


async def queues(request: Request) -> Response:
    """Queues (depth, running, start rate, workers) and the workers serving them."""
    view = await fleet_view(ui_state(request).reader, time.time())
    return await page(request, "queues.html", section="queues", view=view)


async def questions(request: Request) -> Response:
    """The inbox: open, answered, expired, stuck, superseded, all."""
    name = request.query_params.get("tab") or Tab.OPEN.value
    try:
        tab = Tab(name)
    except ValueError:
        raise HTTPException(400, f"unknown tab {name!r}; one of {', '.join(Tab)}") from None
    page_number = request.query_params.get("page") or "1"
    if not page_number.isdecimal() or len(page_number) > 9:
        raise HTTPException(400, f"page {page_number[:20]!r} is not a page number")
    view = await inbox(ui_state(request).reader, tab, page=int(page_number))
    return await page(request, "questions.html", section="questions", view=view,
                      tabs=[t.value for t in Tab])  # fmt: skip


async def question(request: Request) -> Response:
    """One question, with its answer or a form to answer it."""
    row = await ui_state(request).reader.get_question(path_id(request, "question_id"))
    return await page(request, "question.html", section="questions", q=question_view(row),
                      lost=False, problem=None)  # fmt: skip


async def evolution(request: Request) -> Response:
    """Artifacts named with ``--artifact``, and a lookup by id."""
    wanted = request.query_params.get("artifact")
    if wanted:
        return RedirectResponse(artifact_url(wanted.strip()), status_code=303)
    state = ui_state(request)
    views = [await artifact_view(state.reader, a) for a in state.config.artifacts]
    return await page(request, "evolution.html", section="evolution", artifacts=views)


async def artifact(request: Request) -> Response:
    """An artifact's versions and held-out reward per version."""
    view = await artifact_view(ui_state(request).reader, path_id(request, "artifact_id"))
    return await page(request, "artifact.html", section="evolution", a=view)


# -- state changes -------------------------------------------------------------------------


def _answer_value(form: FormData) -> Any:
    """The answer the form carries: JSON, or plain text when ``raw`` is ticked."""
    text = form.get("answer")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the answer is empty")
    if form.get("raw"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"the answer is not JSON ({exc.msg} at character {exc.pos}); "
            'write a string in quotes ("yes") or tick "plain text"'
        ) from None


@changes_state("question_id")
async def answer(request: Request, question_id: str, form: FormData, state: UiState) -> Response:
    """Answer a question (first answer wins, Q2), then resume its run here in the background."""
    assert state.engine is not None and state.resumer is not None  # not read-only
    row = await state.reader.get_question(question_id)
    if row.poller is not None:  # docs/gates.md: a machine gate's poller answers it, not a person
        return await page(request, "question.html", section="questions", status_code=409,
                          q=question_view(row), lost=False,
                          problem=f"Nothing was recorded: the poller {row.poller!r} answers this "
                          "machine gate, not a person.")  # fmt: skip
    by = form.get("by")
    by = by.strip()[:200] if isinstance(by, str) and by.strip() else None
    try:
        await state.engine.answer(question_id, _answer_value(form), by=by, resume=False)
    except AlreadyAnswered:
        won = question_view(await state.reader.get_question(question_id))
        return await page(request, "question.html", section="questions", status_code=409,
                          q=won, lost=True, problem=None)  # fmt: skip
    except (ValueError, EncodeError) as exc:
        return await page(request, "question.html", section="questions", status_code=400,
                          q=question_view(row), lost=False,
                          problem=f"Nothing was recorded: {exc}")  # fmt: skip
    state.resumer.start(row.run_id)
    target = f"{run_url(row.run_id)}?answered={urllib.parse.quote(question_id, safe='')}"
    return see_other(target, state.config.token)


@changes_state("run_id")
async def resume(request: Request, run_id: str, form: FormData, state: UiState) -> Response:
    """Resume a run here in the background (an orphaned one, or one holding an answer)."""
    assert state.resumer is not None  # not read-only
    await state.reader.get_run(run_id)  # 404 for an unknown run
    state.resumer.start(run_id)
    return see_other(run_url(run_id), state.config.token)


@changes_state("run_id")
async def cancel(request: Request, run_id: str, form: FormData, state: UiState) -> Response:
    """Cancel a run: a queued or undriven one at once, a running one at its next harvest."""
    assert state.engine is not None  # not read-only
    await state.engine.cancel(run_id)
    target = f"{run_url(run_id)}?cancelled=1"
    return see_other(target, state.config.token)


@changes_state("run_id")
async def fork(request: Request, run_id: str, form: FormData, state: UiState) -> Response:
    """Fork a run at the node the form names (``at``), in the background; go to the fork's page.

    The fork runs the run's own version (the dashboard must hold it:
    ``--graphs`` or an importable module) from the payload the node's latest
    visit ran with (V4). A run, node or graph the fork cannot start from is
    refused before anything is written, naming it.
    """
    assert state.resumer is not None  # not read-only
    at = form.get("at")
    if not isinstance(at, str) or not at:
        raise HTTPException(400, "a fork needs the node it starts from: the form's at field")
    if not _keyable(at):
        raise HTTPException(400, f"node {at!r} is not a valid id")
    stored = await state.reader.load_run(run_id)  # 404 for an unknown run
    found = await state.catalog.find(stored.run)

    async def cannot(status: int, why: str) -> Response:
        return await page(request, "error.html", section="runs", status_code=status,
                          heading="Cannot fork", back=run_url(run_id),
                          message=f"Nothing was written: {why}")  # fmt: skip

    if found.graph is None:
        return await cannot(409, f"this dashboard does not hold the graph of run {run_id!r} "
                            f"({stored.run.graph_name!r} version {stored.run.fingerprint}): {found.reason}")  # fmt: skip
    graph = found.graph
    if at not in graph.compile().index:
        return await cannot(404, f"graph {graph.name!r} has no node {at!r}")
    if at not in forkable(graph, stored):
        return await cannot(409, f"node {at!r} never ran in run {run_id!r}, so there is no payload "
                            "to fork it with; `tailrace fork --input` gives one")  # fmt: skip
    fork_id = uuid.uuid4().hex
    state.resumer.fork(run_id, at=at, fork_id=fork_id, graph=graph)
    return see_other(run_url(fork_id), state.config.token)
