"""State changes through the dashboard: the token, first answer wins, resumes, read-only mode."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.testclient import TestClient

import tailrace as tr
from tailrace.stores import QuestionRow, QuestionStatus, RunRecord
from tailrace.ui._app import _same_page
from tests.ui.support import TOKEN, Factory, dashboard, resumer_of, scenarios


def suspended(factory: Factory, run_id: str = "gated", graph: tr.Graph | None = None) -> str:
    """Run the approval graph (or ``graph``) until its gate asks; returns the question id."""

    async def run() -> str:
        async with scenarios.opened(factory) as store:
            result = await tr.Engine(store=store).run(
                graph or scenarios.approval, "v2", run_id=run_id
            )
            assert result.status == "suspended"
            return str(result.questions[0].question_id)

    return asyncio.run(run())


def question(factory: Factory, question_id: str) -> QuestionRow:
    async def read() -> QuestionRow:
        async with scenarios.opened(factory) as store:
            return await store.get_question(question_id)

    return asyncio.run(read())


def run_record(factory: Factory, run_id: str) -> tuple[RunRecord, Any]:
    async def read() -> tuple[RunRecord, Any]:
        async with scenarios.opened(factory) as store:
            results = {r.node_id: r.value_json for r in await store.results(run_id)}
            return await store.get_run(run_id), results

    return asyncio.run(read())


def finish_resume(client: TestClient, run_id: str) -> None:
    """Wait, in the app's own loop, until the resume it started in the background ends."""
    client.portal.call(resumer_of(client).wait, run_id)  # type: ignore[union-attr]


def answer(client: TestClient, question_id: str, value: str, **form: str) -> Any:
    return client.post(f"/answer/{question_id}", data={"answer": value, **form})


def test_an_answer_without_the_token_is_refused_and_changes_nothing(sqlite_db: Factory) -> None:
    qid = suspended(sqlite_db)
    with dashboard(sqlite_db) as client:
        missing = answer(client, qid, '"yes"')
        wrong = answer(client, qid, '"yes"', token=TOKEN + "x")
        client.cookies.set("tailrace_token", TOKEN)  # the cookie alone never authorises (CSRF)
        only_cookie = client.post(f"/answer/{qid}", data={"answer": '"yes"'})
        by_get = client.get(f"/answer/{qid}")
    assert [r.status_code for r in (missing, wrong, only_cookie)] == [403, 403, 403]
    assert "Nothing was changed" in missing.text
    assert by_get.status_code == 405  # a change is a POST, never a GET
    assert question(sqlite_db, qid).status is QuestionStatus.OPEN


def test_an_answer_with_the_token_is_recorded_and_its_run_resumes_to_completion(
    any_db: Factory,
) -> None:
    qid = suspended(any_db)
    with dashboard(any_db) as client:
        response = answer(client, qid, '{"ok": true}', token=TOKEN, by="alice")
        assert response.status_code == 303
        assert response.headers["location"] == f"/runs/gated?answered={qid}"
        assert "tailrace_token=" in response.headers["set-cookie"]
        assert "httponly" in response.headers["set-cookie"].lower()
        finish_resume(client, "gated")
        page = client.get("/runs/gated?answered=" + qid).text
    record, results = run_record(any_db, "gated")
    assert record.status.value == "completed"
    assert results["ship"] == '{"shipped":{"ok":true}}'
    row = question(any_db, qid)
    assert (row.status, row.answered_by) == (QuestionStatus.APPLIED, "alice")
    assert f"Your answer to question {qid} was recorded." in page
    assert "resumed here: the run is completed" in page


def test_the_second_answer_loses_and_is_told_who_won(any_db: Factory) -> None:
    qid = suspended(any_db)
    with dashboard(any_db) as client:
        assert answer(client, qid, '"ship it"', token=TOKEN, by="alice").status_code == 303
        late = answer(client, qid, '"hold it"', token=TOKEN, by="bob")
        finish_resume(client, "gated")
    assert late.status_code == 409
    assert "Too late: the first answer won." in late.text
    assert 'by <b class="who">alice</b>' in late.text and "ship it" in late.text
    assert "hold it" not in late.text
    assert question(any_db, qid).answer_json == '"ship it"'


def test_an_answer_that_is_not_json_is_refused_unless_sent_as_plain_text(
    sqlite_db: Factory,
) -> None:
    qid = suspended(sqlite_db)
    with dashboard(sqlite_db) as client:
        bad = answer(client, qid, "yes please", token=TOKEN)
        assert bad.status_code == 400 and "not JSON" in bad.text
        assert question(sqlite_db, qid).status is QuestionStatus.OPEN
        raw = answer(client, qid, "yes <b>please</b>", token=TOKEN, raw="on")
        finish_resume(client, "gated")
    assert raw.status_code == 303
    assert question(sqlite_db, qid).answer_json == '"yes <b>please</b>"'


def test_the_token_header_authorises_a_change_too(sqlite_db: Factory) -> None:
    qid = suspended(sqlite_db)
    with dashboard(sqlite_db) as client:
        response = client.post(
            f"/answer/{qid}", data={"answer": '"yes"'}, headers={"x-tailrace-token": TOKEN}
        )
        finish_resume(client, "gated")
    assert response.status_code == 303


def test_read_only_mode_hides_and_refuses_every_change(sqlite_db: Factory) -> None:
    qid = suspended(sqlite_db)
    with dashboard(sqlite_db, read_only=True) as client:
        inbox = client.get("/questions").text
        refused = answer(client, qid, '"yes"', token=TOKEN)
        login = client.get("/runs")
    assert 'class="answer-form"' not in inbox and f"tailrace answer {qid} VALUE" in inbox
    assert refused.status_code == 403 and "--read-only" in refused.text
    assert "read-only" in login.text
    assert question(sqlite_db, qid).status is QuestionStatus.OPEN


def test_the_login_form_logs_the_browser_in_and_forms_carry_the_token(
    sqlite_db: Factory,
) -> None:
    qid = suspended(sqlite_db)
    with dashboard(sqlite_db) as client:
        assert 'type="password" name="token"' in client.get("/questions").text
        login = client.post("/login", data={"token": TOKEN, "next": "/questions?tab=open"})
        assert login.status_code == 303 and login.headers["location"] == "/questions?tab=open"
        filled = client.get("/questions").text  # the cookie is sent back now
        client.cookies.clear()
        wrong = client.post("/login", data={"token": "guess", "next": "/questions"})
        encoded = client.get(f"/runs/a%2Fb?token={TOKEN}")
    assert f'<input type="hidden" name="token" value="{TOKEN}">' in filled
    assert wrong.status_code == 401 and 'value="' + TOKEN not in wrong.text
    assert encoded.headers["location"] == "/login?next=%2Fruns%2Fa%252Fb"  # one path segment
    # A path sent as "//host/x" redirects within this site, never to that host.
    assert (
        _same_page({"raw_path": b"//evil.example/x", "path": "//evil.example/x"})
        == "/evil.example/x"
    )
    assert qid in filled


def test_a_run_whose_graph_the_dashboard_cannot_load_keeps_the_answer_for_serve(
    sqlite_db: Factory,
) -> None:
    graph = scenarios.local_gate_graph()
    qid = suspended(sqlite_db, "local", graph)
    with dashboard(sqlite_db) as client:
        assert answer(client, qid, '"go"', token=TOKEN).status_code == 303
        finish_resume(client, "local")
        page = client.get("/runs/local").text
    assert "cannot load the run&#39;s graph" in page and "tailrace serve --graphs" in page
    assert question(sqlite_db, qid).status is QuestionStatus.ANSWERED  # kept for a daemon to apply
    with dashboard(sqlite_db, graphs=[graph]) as client:  # told the graph: it resumes it
        assert client.post("/resume/runs/local", data={"token": TOKEN}).status_code == 303
        finish_resume(client, "local")
    assert run_record(sqlite_db, "local")[0].status.value == "completed"


def test_resume_here_continues_an_orphaned_run_and_needs_the_token(sqlite_db: Factory) -> None:
    async def orphan() -> None:
        async with scenarios.opened(sqlite_db) as store:
            await scenarios.cut_and_resume(store, "orphan", resume=False)

    asyncio.run(orphan())
    with dashboard(sqlite_db) as client:
        assert client.post("/resume/runs/orphan").status_code == 403
        assert run_record(sqlite_db, "orphan")[0].status.value == "running"
        done = client.post("/resume/runs/orphan", data={"token": TOKEN})
        finish_resume(client, "orphan")
        page = client.get("/runs/orphan").text
        unknown = client.post("/resume/runs/nope", data={"token": TOKEN})
    assert done.status_code == 303 and done.headers["location"] == "/runs/orphan"
    assert run_record(sqlite_db, "orphan")[0].status.value == "completed"
    assert "o-cut" in page and 'id="run-status">completed<' in page
    assert unknown.status_code == 404


@pytest.mark.parametrize("field", ["answer", "by"])
def test_stored_answers_and_names_come_back_as_text(sqlite_db: Factory, field: str) -> None:
    qid = suspended(sqlite_db)
    hostile = "<script>window.__pwned = 1</script>"
    form = {"answer": '"ok"', "by": "alice", "token": TOKEN} | {field: hostile}
    with dashboard(sqlite_db) as client:
        client.post(f"/answer/{qid}", data={**form, "raw": "on"} if field == "answer" else form)
        finish_resume(client, "gated")
        page = client.get(f"/questions/{qid}").text
    assert hostile not in page and "&lt;script&gt;window.__pwned = 1&lt;/script&gt;" in page
