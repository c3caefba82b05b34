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
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._errors import QuestionNotFound, RunNotFound, StoreError
from . import _routes as r
from ._config import UiConfig, serving
from ._pages import Pages
from ._security import SECURITY_HEADERS, TOKEN_COOKIE, token_matches

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


class TokenLogin:
    """``GET /any/page?token=T`` (the address ``tailrace ui`` prints): remember T, drop it from the URL.

    A right token sets the cookie and redirects to the same page without it (so
    the token stays out of history and logs); a wrong one is refused.
    """

    def __init__(self, app: ASGIApp, *, token: str, pages: Pages) -> None:
        self.app = app
        self.token = token
        self.pages = pages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        query = urllib.parse.parse_qsl(scope.get("query_string", b"").decode("latin-1"))
        given = [v for k, v in query if k == "token"]
        if not given:
            await self.app(scope, receive, send)
            return
        response: Response
        if token_matches(self.token, given[0]):
            rest = urllib.parse.urlencode([(k, v) for k, v in query if k != "token"])
            response = RedirectResponse(_same_page(scope) + (f"?{rest}" if rest else ""), 303)
            response.set_cookie(TOKEN_COOKIE, self.token, httponly=True, samesite="strict")
        else:
            response = self.pages.page(
                "error.html", status_code=403, heading="Refused: wrong token", back=None,
                message="The token in this address is not the one tailrace ui printed.",
            )  # fmt: skip
        await response(scope, receive, send)


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
        Route("/runs", r.runs, name="runs"),
        Route("/runs/{run_id:path}", r.run, name="run"),
        Route("/stream/runs/{run_id:path}", r.stream, name="stream"),
        Route("/resume/runs/{run_id:path}", r.resume, methods=["POST"], name="resume"),
        Route("/cancel/runs/{run_id:path}", r.cancel, methods=["POST"], name="cancel"),
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
        Middleware(TokenLogin, token=config.token, pages=pages),
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
