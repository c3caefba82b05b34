"""A run's graph version on its page, the versions it can move to, and "fork from here" (V1, V4).

Real runs on real SQLite files (and Postgres when configured), the app under TestClient with its lifespan
running: the page shows the run's version and, for each other version the
dashboard was handed, whether the run can move to it and why not; the fork
POST is token-guarded, refuses what it cannot fork before writing anything,
and drives the fork in the background (a fork cancelled by the dashboard's
shutdown is left resumable).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

import tailrace as tr
from tailrace.stores import RunStatus, RunStore
from tailrace.ui._links import fork_url, run_url
from tests.ui.support import TOKEN, Factory, dashboard, resumer_of, scenarios

GUARD = scenarios.GUARD


def deploy(version: int) -> tr.Graph:
    """``prep -> review (a gate) -> ship``; version 2 adds ``notify``, version 3 makes review a task."""
    g = tr.Graph("deploy")
    g.add_node("prep", scenarios.only)
    g.add_node("review", scenarios.only, tr.NodeKind.TASK if version == 3 else tr.NodeKind.GATE)
    g.add_node("ship", scenarios.only)
    g.chain("prep", "review", "ship")
    if version == 2:
        g.add_node("notify", scenarios.only)
        g.add_edge("ship", "notify")
    return g


class Chain:
    """``a -> b -> c`` counting its calls; ``c`` can be held until released."""

    def __init__(self, name: str = "chain", c_id: str = "c") -> None:
        self.calls: dict[str, int] = {"a": 0, "b": 0, c_id: 0}
        self.hold = False
        self.c_started = threading.Event()
        self.graph = tr.Graph(name)
        for node_id in ("a", "b"):
            self.graph.add_node(node_id, self._step(node_id))
        self.graph.add_node(c_id, self._last(c_id))
        self.graph.chain("a", "b", c_id)

    def _step(self, node_id: str) -> Any:
        async def step(x: Any) -> Any:
            self.calls[node_id] += 1
            return [*x, node_id] if isinstance(x, list) else [x, node_id]

        return step

    def _last(self, node_id: str) -> Any:
        async def last(x: Any) -> Any:
            self.calls[node_id] += 1
            self.c_started.set()
            if self.hold:
                await asyncio.Event().wait()  # until cancelled
            return [*x, node_id]

        return last


def run_on(factory: Factory, work: Any) -> Any:
    async def main() -> Any:
        async with asyncio.timeout(GUARD), scenarios.opened(factory) as store:
            return await work(store)

    return asyncio.run(main())


def all_runs(factory: Factory) -> list[tr.RunRecord]:
    async def work(store: RunStore) -> list[tr.RunRecord]:
        return list(await store.list_runs())

    result: list[tr.RunRecord] = run_on(factory, work)
    return result


def suspended_deploy(factory: Factory) -> str:
    async def work(store: RunStore) -> None:
        result = await tr.Engine(store=store).run(deploy(1), "v1", run_id="d1")
        assert result.status is RunStatus.SUSPENDED

    run_on(factory, work)
    return "d1"


def completed_chain(factory: Factory, chain: Chain, run_id: str = "c1") -> str:
    async def work(store: RunStore) -> None:
        result = await tr.Engine(store=store).run(chain.graph, "in", run_id=run_id)
        assert result.status is RunStatus.COMPLETED

    run_on(factory, work)
    return run_id


def wait_for(client: TestClient, run_id: str) -> None:
    client.portal.call(resumer_of(client).wait, run_id)  # type: ignore[union-attr]


def fork_id_of(response: Any) -> str:
    assert response.status_code == 303, response.text
    location = response.headers["location"]
    assert location.startswith("/runs/")
    return str(location.removeprefix("/runs/"))


# -- the version and the other versions ------------------------------------------------------------


def test_the_page_shows_the_version_and_whether_each_other_version_can_take_the_run(
    any_db: Factory,
) -> None:
    sqlite_db = any_db  # SQLite, and Postgres when a server is configured
    run_id = suspended_deploy(sqlite_db)
    v1, v2, v3 = deploy(1), deploy(2), deploy(3)
    with dashboard(sqlite_db, graphs=[v1, v2, v3]) as client:
        page = client.get(run_url(run_id))
    assert page.status_code == 200
    html = page.text
    assert f'title="fingerprint {v1.fingerprint()}">{v1.fingerprint()[:8]}</code>' in html
    table = html[
        html.index('id="other-versions"') : html.index("</table>", html.index("other-versions"))
    ]
    ok = table[table.index(v2.fingerprint()[:8]) : table.index(v3.fingerprint()[:8])]
    assert "compatible" in ok and "incompatible" not in ok
    bad = table[table.index(v3.fingerprint()[:8]) :]
    assert "incompatible" in bad
    assert '<span class="mono">review</span>: its kind changed from gate to task' in bad
    # The page only read: the run is where it was, on its version.
    (record,) = all_runs(sqlite_db)
    assert record.fingerprint == v1.fingerprint() and record.status is RunStatus.SUSPENDED


def test_a_dashboard_without_other_versions_says_so(sqlite_db: Factory) -> None:
    run_id = suspended_deploy(sqlite_db)
    with dashboard(sqlite_db, graphs=[deploy(1)]) as client:
        html = client.get(run_url(run_id)).text
    assert "No other version of this graph is held by this dashboard" in html
    assert 'id="other-versions"' not in html


# -- forks -----------------------------------------------------------------------------------------


def test_a_fork_without_the_token_is_refused_and_writes_nothing(sqlite_db: Factory) -> None:
    chain = Chain()
    run_id = completed_chain(sqlite_db, chain)
    with dashboard(sqlite_db, graphs=[chain.graph]) as client:
        page = client.get(run_url(run_id)).text
        assert page.count("Fork from here</button>") == 3
        missing = client.post(fork_url(run_id), data={"at": "b"})
        wrong = client.post(fork_url(run_id), data={"at": "b", "token": "not-it"})
        client.cookies.set("tailrace_token", TOKEN)  # the cookie alone never authorises
        cookie_only = client.post(fork_url(run_id), data={"at": "b"})
    for refused in (missing, wrong, cookie_only):
        assert refused.status_code == 403 and "Nothing was changed" in refused.text
    assert [r.run_id for r in all_runs(sqlite_db)] == [run_id]
    assert chain.calls == {"a": 1, "b": 1, "c": 1}


def test_a_read_only_dashboard_offers_no_fork_and_refuses_one(sqlite_db: Factory) -> None:
    chain = Chain()
    run_id = completed_chain(sqlite_db, chain)
    with dashboard(sqlite_db, graphs=[chain.graph], read_only=True) as client:
        page = client.get(run_url(run_id)).text
        refused = client.post(
            fork_url(run_id), data={"at": "b"}, headers={"x-tailrace-token": TOKEN}
        )
    assert "Fork from here</button>" not in page and "read-only: <code>tailrace fork</code>" in page
    assert refused.status_code == 403 and "read-only" in refused.text
    assert [r.run_id for r in all_runs(sqlite_db)] == [run_id]


def test_a_fork_with_the_token_reuses_upstream_results_and_completes(any_db: Factory) -> None:
    sqlite_db = any_db  # SQLite, and Postgres when a server is configured
    chain = Chain()
    run_id = completed_chain(sqlite_db, chain)
    with dashboard(sqlite_db, graphs=[chain.graph]) as client:
        response = client.post(fork_url(run_id), data={"at": "b", "token": TOKEN})
        fork_id = fork_id_of(response)
        assert "tailrace_token" in response.headers.get("set-cookie", "")
        wait_for(client, fork_id)
        page = client.get(run_url(fork_id))
        source = client.get(run_url(run_id)).text
    assert chain.calls == {"a": 1, "b": 2, "c": 2}  # a reused, b and c run again
    runs = {r.run_id: r for r in all_runs(sqlite_db)}
    fork = runs[fork_id]
    assert fork.status is RunStatus.COMPLETED
    assert (fork.forked_from, fork.forked_at) == (run_id, "b")
    assert runs[run_id].status is RunStatus.COMPLETED  # the source is unchanged

    async def results(store: RunStore) -> Any:
        return await store.results(fork_id)

    values = {r.node_id: json.loads(r.value_json) for r in run_on(sqlite_db, results)}
    assert values == {"a": ["in", "a"], "b": ["in", "a", "b"], "c": ["in", "a", "b", "c"]}
    assert page.status_code == 200
    assert (
        f'<a class="mono" href="{run_url(run_id)}">{run_id}</a> at <span class="mono">b</span>'
        in page.text
    )
    assert (
        f"forked here from run &#39;{run_id}&#39; at node &#39;b&#39;: the run is completed"
        in page.text
    )
    assert "forked from" not in source.split('id="run-header"')[1].split("</section>")[0]


def test_a_fork_by_header_token_works_for_a_script(sqlite_db: Factory) -> None:
    chain = Chain()
    run_id = completed_chain(sqlite_db, chain)
    with dashboard(sqlite_db, graphs=[chain.graph]) as client:
        fork_id = fork_id_of(
            client.post(fork_url(run_id), data={"at": "a"}, headers={"x-tailrace-token": TOKEN})
        )
        wait_for(client, fork_id)
    assert chain.calls == {"a": 2, "b": 2, "c": 2}  # at the first node: nothing to reuse
    assert {r.run_id: r.status for r in all_runs(sqlite_db)}[fork_id] is RunStatus.COMPLETED


def test_what_cannot_be_forked_is_refused_naming_it_and_nothing_is_written(
    sqlite_db: Factory,
) -> None:
    chain = Chain()
    run_id = completed_chain(sqlite_db, chain)
    gated = suspended_deploy(sqlite_db)
    local = scenarios.local_graph()  # no module reference can find it

    async def local_run(store: RunStore) -> None:
        await tr.Engine(store=store).run(local, 1, run_id="l1")

    run_on(sqlite_db, local_run)
    before = sorted(r.run_id for r in all_runs(sqlite_db))
    with dashboard(sqlite_db, graphs=[chain.graph, deploy(1)]) as client:
        unknown_node = client.post(fork_url(run_id), data={"at": "nope", "token": TOKEN})
        no_node = client.post(fork_url(run_id), data={"token": TOKEN})
        never_ran = client.post(fork_url(gated), data={"at": "ship", "token": TOKEN})
        unknown_run = client.post(fork_url("no-such-run"), data={"at": "a", "token": TOKEN})
        not_held = client.post(fork_url("l1"), data={"at": "a", "token": TOKEN})
        local_page = client.get(run_url("l1")).text
        gated_page = client.get(run_url(gated)).text
    assert unknown_node.status_code == 404
    assert (
        "Nothing was written: graph &#39;chain&#39; has no node &#39;nope&#39;" in unknown_node.text
    )
    assert no_node.status_code == 400 and "the form&#39;s at field" in no_node.text
    assert never_ran.status_code == 409 and "node &#39;ship&#39; never ran" in never_ran.text
    assert unknown_run.status_code == 404 and "no-such-run" in unknown_run.text
    assert not_held.status_code == 409
    assert "does not hold the graph of run &#39;l1&#39;" in not_held.text
    assert "No fork can start here" in local_page and "Fork from here</button>" not in local_page
    assert gated_page.count("Fork from here</button>") == 2  # prep and review ran; ship did not
    assert sorted(r.run_id for r in all_runs(sqlite_db)) == before


HOSTILE = "<script>alert(1)</script>\"'&"


def test_hostile_run_and_node_ids_are_text(sqlite_db: Factory) -> None:
    node = f"c{HOSTILE}"
    chain = Chain(name=f"chain{HOSTILE}", c_id=node)
    run_id = completed_chain(sqlite_db, chain, run_id=f"r/{HOSTILE}?#")
    with dashboard(sqlite_db, graphs=[chain.graph]) as client:
        page = client.get(run_url(run_id)).text
        fork_id = fork_id_of(client.post(fork_url(run_id), data={"at": node, "token": TOKEN}))
        wait_for(client, fork_id)
        fork_page = client.get(run_url(fork_id)).text
        bad = client.post(fork_url(run_id), data={"at": f"x{HOSTILE}", "token": TOKEN})
    for html in (page, fork_page, bad.text):
        assert "<script>alert(1)" not in html
    assert 'value="c&lt;script&gt;alert(1)&lt;/script&gt;&#34;&#39;&amp;"' in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in fork_page
    assert bad.status_code == 404 and "x&lt;script&gt;alert(1)&lt;/script&gt;" in bad.text
    assert chain.calls[node] == 2 and chain.calls["b"] == 1  # the fork ran from the hostile node
    fork = {r.run_id: r for r in all_runs(sqlite_db)}[fork_id]
    assert (fork.forked_from, fork.forked_at, fork.status) == (run_id, node, RunStatus.COMPLETED)


# -- faults ----------------------------------------------------------------------------------------


@pytest.fixture
def held_chain() -> Iterator[Chain]:
    chain = Chain()
    yield chain
    chain.hold = False


def test_a_fork_cut_by_the_dashboard_shutting_down_is_left_resumable(
    sqlite_db: Factory, held_chain: Chain
) -> None:
    chain = held_chain
    run_id = completed_chain(sqlite_db, chain)
    chain.c_started.clear()  # the source run's c set it
    chain.hold = True
    with dashboard(sqlite_db, graphs=[chain.graph]) as client:
        fork_id = fork_id_of(client.post(fork_url(run_id), data={"at": "b", "token": TOKEN}))
        assert chain.c_started.wait(GUARD), "the fork never reached c"
        page = client.get(run_url(fork_id))
        assert page.status_code == 200 and resumer_of(client).running(fork_id)
    # Leaving the block shut the app down: the fork's task was cancelled mid-c.
    fork = {r.run_id: r for r in all_runs(sqlite_db)}[fork_id]
    assert fork.status is RunStatus.RUNNING and fork.lease_owner is None  # released, not held
    assert (fork.forked_from, fork.forked_at) == (run_id, "b")
    assert chain.calls == {"a": 1, "b": 2, "c": 2}
    chain.hold = False

    async def resume(store: RunStore) -> tr.RunResult:
        engine = tr.Engine(store=store)
        engine.register(chain.graph)
        return await engine.resume(fork_id)

    result = run_on(sqlite_db, resume)
    assert result.status is RunStatus.COMPLETED
    assert chain.calls == {"a": 1, "b": 2, "c": 3}  # only what was in flight ran again
    assert result.results["c"] == ["in", "a", "b", "c"]


def test_a_fork_whose_store_write_fails_is_reported_on_its_page(sqlite_db: Factory) -> None:
    chain = Chain()
    run_id = completed_chain(sqlite_db, chain)
    with dashboard(sqlite_db, graphs=[chain.graph]) as client:
        state = client.app.state.ui  # type: ignore[attr-defined]
        taken = "taken-id"

        async def occupy(store: RunStore) -> None:  # a run with the fork's id exists already
            await tr.Engine(store=store).run(chain.graph, "other", run_id=taken)

        client.portal.call(occupy, state.writer)
        note = client.portal.call(_start, state, run_id, taken, chain.graph)
        assert note.state == "forking"
        wait_for(client, taken)
        page = client.get(run_url(taken)).text
    assert "the fork of run &#39;c1&#39; at node &#39;b&#39; failed" in page
    runs = {r.run_id: r for r in all_runs(sqlite_db)}
    assert runs[taken].forked_from is None  # the run that held the id is untouched
    assert set(runs) == {run_id, taken}


async def _start(state: Any, run_id: str, fork_id: str, graph: tr.Graph) -> Any:
    return state.resumer.fork(run_id, at="b", fork_id=fork_id, graph=graph)


def test_a_fork_that_fails_before_its_first_row_says_so_on_its_page(sqlite_db: Factory) -> None:
    gated = suspended_deploy(sqlite_db)
    with dashboard(sqlite_db, graphs=[deploy(1)]) as client:
        state = client.app.state.ui  # type: ignore[attr-defined]

        async def start() -> Any:  # past the page's checks: ship never ran, so no payload
            return state.resumer.fork(gated, at="ship", fork_id="f-ship", graph=deploy(1))

        client.portal.call(start)
        wait_for(client, "f-ship")
        page = client.get(run_url("f-ship"))
        other = client.get(run_url("never-started"))
    assert page.status_code == 404 and "The fork was not created" in page.text
    assert "node &#39;ship&#39; never ran" in page.text
    assert other.status_code == 404 and "No such run" in other.text
    assert [r.run_id for r in all_runs(sqlite_db)] == [gated]
