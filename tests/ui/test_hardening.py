"""The dashboard beyond loopback, honest times and bars, and the first day's small things."""

from __future__ import annotations

import asyncio
import re
import sys

import pytest
from starlette.testclient import TestClient
from tailrace_tests_ui_support import TOKEN, Factory, dashboard  # loaded by conftest.py

import tailrace as tr
from tailrace.stores import RunStatus
from tailrace.ui._security import TOKEN_COOKIE

scenarios = sys.modules["tailrace_tests_ui_scenarios"]
HOSTILE_HOSTS = ("127.0.0.1", "localhost", "127.0.0.1:8765", "evil.example", "[::1]")


def gated(factory: Factory, run_id: str = "secret-run") -> str:
    """A run suspended on its gate; returns its question id."""

    async def run() -> str:
        async with scenarios.opened(factory) as store:
            result = await tr.Engine(store=store).run(scenarios.approval, "v9", run_id=run_id)
            return str(result.questions[0].question_id)

    return asyncio.run(run())


def status_of(factory: Factory, run_id: str) -> RunStatus:
    async def read() -> RunStatus:
        async with scenarios.opened(factory) as store:
            return (await store.get_run(run_id)).status

    return asyncio.run(read())


def beyond_loopback(factory: Factory) -> object:
    """The app as ``tailrace ui --host 0.0.0.0`` makes it: any Host, reading needs the token."""
    return dashboard(factory, allowed_hosts=("*",), reading_needs_token=True)


def log_in(client: TestClient, token: str = TOKEN, after: str = "/runs") -> object:
    return client.post("/login", data={"token": token, "next": after})


# -- reading beyond loopback needs the token ------------------------------------------------------


@pytest.mark.parametrize("host", HOSTILE_HOSTS)
def test_beyond_loopback_no_page_or_stream_is_read_without_logging_in(
    sqlite_db: Factory, host: str
) -> None:
    qid = gated(sqlite_db)
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        client.headers["host"] = host
        answers = {
            path: client.get(path)
            for path in (
                "/runs",
                "/runs/secret-run",
                "/runs/no-such-run",
                f"/questions/{qid}",
                "/questions?tab=all",
                "/queues",
                "/evolution",
                "/stream/runs/secret-run",
            )
        }
        css = client.get("/static/app.css")
    assert css.status_code == 200  # the login page needs its stylesheet
    for path, response in answers.items():
        assert response.status_code == 401, path
        shown = re.sub(r'name="next" value="[^"]*"', "", response.text)  # the asker's own path
        assert "secret-run" not in shown and qid not in shown and "v9" not in shown, path
        assert "test.db" not in shown, path  # not even the store's name
        if not path.startswith("/stream/"):
            assert 'action="/login"' in response.text and 'name="token"' in response.text
            assert "set-cookie" not in response.headers


def test_logging_in_with_a_form_post_sets_a_strict_http_only_cookie_and_reading_works(
    sqlite_db: Factory,
) -> None:
    gated(sqlite_db)
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        client.headers["host"] = "dash.example:8765"
        form = client.get("/login?next=/runs/secret-run")
        wrong = log_in(client, "guess", "/runs/secret-run")
        still_out = client.get("/runs")
        right = log_in(client, TOKEN, "/runs/secret-run")
        page = client.get("/runs/secret-run")
        with client.stream("GET", "/stream/runs/secret-run") as stream:
            first = next(stream.iter_lines())
            kind = stream.headers["content-type"]
    assert form.status_code == 200 and 'value="/runs/secret-run"' in form.text
    assert wrong.status_code == 401 and 'action="/login"' in wrong.text
    assert "That is not the token" in wrong.text and "guess" not in wrong.text
    assert TOKEN not in wrong.text and "set-cookie" not in wrong.headers
    assert still_out.status_code == 401
    assert right.status_code == 303 and right.headers["location"] == "/runs/secret-run"
    cookie = right.headers["set-cookie"].lower()
    assert f"{TOKEN_COOKIE}=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
    assert TOKEN not in right.headers["location"]
    assert page.status_code == 200 and "secret-run" in page.text
    assert kind.startswith("text/event-stream") and first.startswith("event: ")


def test_a_token_in_the_address_never_logs_in_and_leaves_the_address(sqlite_db: Factory) -> None:
    gated(sqlite_db)
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        sent = client.get(f"/runs/secret-run?token={TOKEN}&x=1")
        after = client.get("/runs")
    assert sent.status_code == 303 and TOKEN not in sent.headers["location"]
    assert sent.headers["location"].startswith("/login?next=")
    assert "set-cookie" not in sent.headers and after.status_code == 401
    with dashboard(sqlite_db) as client:  # on loopback too: the login form takes the token
        sent = client.get(f"/questions?token={TOKEN}")
    assert sent.status_code == 303 and TOKEN not in sent.headers["location"]
    assert "set-cookie" not in sent.headers


def test_the_login_goes_on_only_to_pages_of_this_site(sqlite_db: Factory) -> None:
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        places = [
            log_in(client, TOKEN, target).headers["location"]
            for target in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "")
        ]
    assert places == ["/runs"] * 4


def test_on_loopback_reading_stays_open(sqlite_db: Factory) -> None:
    gated(sqlite_db)
    with dashboard(sqlite_db) as client:
        page = client.get("/runs/secret-run")
    assert page.status_code == 200 and "secret-run" in page.text


def test_beyond_loopback_a_change_still_needs_the_token_and_a_refusal_shows_nothing(
    sqlite_db: Factory,
) -> None:
    qid = gated(sqlite_db)
    with beyond_loopback(sqlite_db) as client:  # type: ignore[attr-defined]
        refused = client.post(f"/answer/{qid}", data={"answer": '"yes"', "token": "guess"})
        client.cookies.set(TOKEN_COOKIE, TOKEN)
        also_refused = client.post(f"/answer/{qid}", data={"answer": '"yes"'})
        client.cookies.clear()
        cancelled = client.post(
            "/cancel/runs/secret-run", headers={"x-tailrace-token": TOKEN}, follow_redirects=False
        )
    assert refused.status_code == 403 and "secret-run" not in refused.text
    assert also_refused.status_code == 403  # the cookie alone never authorises a change (CSRF)
    assert cancelled.status_code == 303
    assert status_of(sqlite_db, "secret-run") is RunStatus.CANCELLED
