"""``tailrace check``, ``migrate``, ``fork``, and versions in ``runs`` and ``show`` (V5).

A deploy in miniature: runs of a graph wait on a gate, a new version of the
graph adds a step after it; ``check`` and ``migrate`` say which runs can move
and ``migrate --apply`` moves them; a version that turned the gate into a
task is refused, naming the gate. On SQLite, and on Postgres when available.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import fixtures
from tests.cli.test_cli import flat, invoke

V1 = """
    import tailrace as tr

    graph = tr.Graph("deploy")

    @graph.task()
    async def prep(x):
        return {"draft": x}

    @graph.gate()
    async def review(draft):
        return {"ask": draft}

    @graph.task()
    async def ship(answer):
        return {"shipped": answer}

    graph.chain("prep", "review", "ship")
"""
V2 = (
    V1
    + """
    @graph.task()
    async def notify(shipped):
        return "notified"

    graph.add_edge("ship", "notify")
"""
)
BROKEN = V1.replace("@graph.gate()", "@graph.task()")


def _dbs() -> list[str]:
    return ["sqlite", "postgres"] if fixtures.POSTGRES_DSN else ["sqlite"]


@pytest.fixture(params=_dbs())
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "runs.db")
        return
    schema = fixtures.new_schema("tailrace_cli_versions")
    dsn = fixtures.POSTGRES_DSN or ""
    yield f"{dsn}{'&' if '?' in dsn else '?'}schema={schema}"
    fixtures.drop_schema_sync(schema)


def graphs(tmp_path: Path) -> dict[str, Path]:
    files = {}
    for name, source in (("v1", V1), ("v2", V2), ("broken", BROKEN)):
        files[name] = tmp_path / f"{name}.py"
        files[name].write_text(textwrap.dedent(source))
    return files


def test_v5_check_migrate_and_fork_from_the_command_line(db: str, tmp_path: Path) -> None:
    files = graphs(tmp_path)
    for run_id in ("r1", "r2"):
        started = invoke("run", f"{files['v1']}:graph", "--db", db, "--run-id", run_id)
        assert started.exit_code == 0, started.output
        assert "suspended" in started.output

    checked = invoke("check", "r1", "--graphs", files["v2"], "--db", db)
    assert checked.exit_code == 0, checked.output
    assert "compatible" in checked.output
    refused = invoke("check", "r1", "--graphs", files["broken"], "--db", db)
    assert refused.exit_code == 1
    assert "'review': its kind changed from gate to task" in refused.output
    stuck = invoke("migrate", "--graphs", files["broken"], "--db", db)
    assert "2 incompatible" in stuck.output and "r1" in stuck.output and "r2" in stuck.output

    dry = invoke("migrate", "--graphs", files["v2"], "--db", db)
    assert dry.exit_code == 0, dry.output
    assert "2 live runs checked (dry run): 2 compatible" in dry.output
    assert "r1" not in dry.output  # runs that can move are counted, not listed
    assert "r1" in invoke("migrate", "--graphs", files["v2"], "--db", db, "--all").output
    v1 = fixtures.load_module("cli_v1", files["v1"]).graph.fingerprint()
    v2 = fixtures.load_module("cli_v2", files["v2"]).graph.fingerprint()
    assert flat(invoke("runs", "--db", db, "--graph", "deploy").output).count(v1) == 2
    applied = invoke("migrate", "--graphs", files["v2"], "--db", db, "--apply")
    assert applied.exit_code == 0, applied.output
    assert "2 live runs migrated: 2 moved" in applied.output
    listed = flat(invoke("runs", "--db", db, "--graph", "deploy").output)
    assert listed.count(v2) == 2 and v1 not in listed
    assert invoke("runs", "--db", db, "--graph", "other").output.count("r1") == 0

    answered = invoke("questions", "--db", db)
    assert answered.exit_code == 0, answered.output
    forked = invoke("fork", "r1", "--at", "ship", "--input", '"yes"', "--graphs", files["v2"],
                    "--db", db, "--fork-id", "f1")  # fmt: skip
    assert forked.exit_code == 0, forked.output
    assert '"notified"' in forked.output
    assert "forked from run r1 at node ship" in forked.output
    shown = invoke("show", "f1", "--db", db)
    assert "forked from run r1 at node ship" in shown.output
    assert "r1atship" in flat(invoke("runs", "--db", db, "--graph", "deploy").output)
    assert "forked" not in invoke("runs", "--db", db).output  # one graph's view only

    bad = invoke("fork", "r1", "--at", "nowhere", "--graphs", files["v2"], "--db", db)
    assert bad.exit_code == 1 and "no such node" in bad.output
    other = invoke("check", "r1", "--graphs", files["v2"].with_name("none.py"), "--db", db)
    assert other.exit_code != 0


@pytest.fixture
def _imports_kept(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Undo what loading graph files does to this process: its folders on ``sys.path``, the
    neighbour modules they import."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name in ("v1", "v2", "broken"):
            del sys.modules[name]


@pytest.mark.usefixtures("_imports_kept")
def test_two_graphs_of_one_name_in_a_file_are_named_not_guessed(tmp_path: Path) -> None:
    """A file that defines two versions of one graph: check, migrate and fork name both and
    run nothing; ``FILE:GRAPH`` picks one. The same graph under two names is one graph."""
    db = str(tmp_path / "runs.db")
    files = graphs(tmp_path)
    both = tmp_path / "both.py"
    both.write_text(
        "from v2 import graph\nfrom broken import graph as broken\nalias = graph\n"
    )  # its neighbours import, as under ``python both.py``
    started = invoke("run", f"{files['v1']}:graph", "--db", db, "--run-id", "r1")
    assert started.exit_code == 0, started.output
    for args in (
        ("check", "r1"),
        ("migrate", "--apply"),
        ("fork", "r1", "--at", "ship", "--fork-id", "f1"),
    ):
        refused = invoke(*args, "--graphs", both, "--db", db)
        assert refused.exit_code != 0, refused.output
        said = flat(refused.output)
        assert flat(f"2 graphs are named 'deploy' ({both}:graph, {both}:broken)") in said, said
        assert "alias" not in said  # one graph under two names
    assert "r1" in invoke("runs", "--db", db, "--graph", "deploy").output
    assert "f1" not in invoke("runs", "--db", db).output  # no fork was made
    moved = invoke("migrate", "--apply", "--graphs", f"{both}:graph", "--db", db)
    assert moved.exit_code == 0, moved.output
    assert "1 moved" in moved.output
