"""The Starlette app: routes, guards, error pages and the lifespan that owns the stores."""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._errors import QuestionNotFound, RunNotFound, StoreError
from . import _routes as r
from ._config import UiConfig, serving
from ._links import login_url
from ._pages import Pages
from ._security import LOGIN_PATH, SECURITY_HEADERS, TOKEN_COOKIE, local_path, token_matches

STATIC = Path(__file__).parent / "static"


class SecurityHeaders:
    """Adds :data:`~tailrace.ui._security.SECURITY_HEADERS` to every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


class ReadGuard:
    """Who may read: everyone on loopback; beyond it only a browser holding the login cookie.

    Static files and the login page are open to all. A POST goes on to its
    route, whose token guard decides (a script sends the token in a header,
    with no cookie). An address carrying ``?token=`` never logs anyone in:
    it redirects to the login page without the token, so a token pasted into
    an address leaves the address bar at once.
    """

    def __init__(self, app: ASGIApp, *, token: str, pages: Pages, required: bool) -> None:
        self.app = app
        self.token = token
        self.pages = pages
        self.required = required

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path == LOGIN_PATH or path.startswith("/static/"):
            await self.app(scope, receive, send)
            return
        conn = HTTPConnection(scope)
        reading = scope["method"] in ("GET", "HEAD")
        response: Response
        if reading and "token" in conn.query_params:
            rest = [(k, v) for k, v in conn.query_params.multi_items() if k != "token"]
            page = _same_page(scope) + (f"?{urllib.parse.urlencode(rest)}" if rest else "")
            response = RedirectResponse(login_url(page), 303)
        elif not self.required or scope["method"] == "POST" or self._holds_token(conn):
            await self.app(scope, receive, send)
            return
        elif path.startswith("/stream/"):
            response = PlainTextResponse("log in first", status_code=401)
        else:
            page = _same_page(scope) + (f"?{conn.url.query}" if conn.url.query else "")
            response = self.pages.page("login.html", status_code=401, locked=True,
                                       next=local_path(page), problem=None)  # fmt: skip
        await response(scope, receive, send)

    def _holds_token(self, conn: HTTPConnection) -> bool:
        return token_matches(self.token, conn.cookies.get(TOKEN_COOKIE))


def _same_page(scope: Scope) -> str:
    """This request's path as it was sent (ids stay percent-encoded), never another host's."""
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes) else urllib.parse.quote(scope["path"])
    return "/" + path.lstrip("/")  # "//host/..." would leave this site


def _error_page(status: int, heading: str) -> object:
    async def handler(request: Request, exc: Exception) -> Response:
        message = exc.detail if isinstance(exc, HTTPException) else str(exc)
        return r.pages_of(request).page(
            "error.html", status_code=status, heading=heading, message=message, back="/runs"
        )

    return handler


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    heading = {400: "Bad request", 404: "Not found"}.get(exc.status_code, "Error")
    return r.pages_of(request).page(
        "error.html", status_code=exc.status_code, heading=heading, message=str(exc.detail),
        back="/runs",
    )  # fmt: skip


def create_app(config: UiConfig) -> Starlette:
    """The dashboard as an ASGI app; its lifespan opens the stores and owns background resumes.

    Args:
        config: the store, the token and what the dashboard may do.

    Serve it with uvicorn (``tailrace ui`` does), or drive it with Starlette's
    ``TestClient`` in a ``with`` block so the lifespan runs.
    """
    pages = Pages(location=config.location, read_only=config.read_only)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with serving(config) as state:
            app.state.ui = state
            yield

    routes = [
        Route("/", lambda request: RedirectResponse("/runs", 303), name="home"),
        Route(LOGIN_PATH, r.login, methods=["GET", "POST"], name="login"),
        Route("/runs", r.runs, name="runs"),
        Route("/runs/{run_id:path}", r.run, name="run"),
        Route("/stream/runs/{run_id:path}", r.stream, name="stream"),
        Route("/resume/runs/{run_id:path}", r.resume, methods=["POST"], name="resume"),
        Route("/cancel/runs/{run_id:path}", r.cancel, methods=["POST"], name="cancel"),
        Route("/fork/runs/{run_id:path}", r.fork, methods=["POST"], name="fork"),
        Route("/queues", r.queues, name="queues"),
        Route("/questions", r.questions, name="questions"),
        Route("/questions/{question_id:path}", r.question, name="question"),
        Route("/answer/{question_id:path}", r.answer, methods=["POST"], name="answer"),
        Route("/evolution", r.evolution, name="evolution"),
        Route("/evolution/{artifact_id:path}", r.artifact, name="artifact"),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    middleware = [
        Middleware(SecurityHeaders),
        Middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts)),
        Middleware(ReadGuard, token=config.token, pages=pages, required=config.reading_needs_token),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={
            HTTPException: _http_error,
            RunNotFound: _error_page(404, "No such run"),  # type: ignore[dict-item]
            QuestionNotFound: _error_page(404, "No such question"),  # type: ignore[dict-item]
            StoreError: _error_page(503, "The store failed"),  # type: ignore[dict-item]
        },
    )
    app.state.pages = pages
    return app
