"""``--executor`` on ``tailrace run`` and ``tailrace worker``: named, checked, closed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_cli import invoke

GRAPH = """
import tailrace as tr

graph = tr.Graph("remote")

@graph.task(executor="ray")
async def crunch(x):
    return x * 2
"""


@pytest.mark.parametrize("command", ["run", "worker"])
@pytest.mark.parametrize("spec", ["spark", "ray=a", "dask=host:1"])
def test_an_executor_that_is_not_ray_is_a_usage_error_naming_the_option(
    tmp_path: Path, command: str, spec: str
) -> None:
    twice = spec == "ray=a"  # ray, named twice
    args = ["--executor", "ray", "--executor", spec] if twice else ["--executor", spec]
    target = [f"{tmp_path / 'g.py'}:graph"] if command == "run" else []
    (tmp_path / "g.py").write_text(GRAPH)
    result = invoke(command, *target, "--db", tmp_path / "runs.db", *args)
    assert result.exit_code == 2, result.output
    assert "--executor" in result.output


def test_a_graph_on_ray_without_the_executor_says_which_option_gives_it(tmp_path: Path) -> None:
    (tmp_path / "g.py").write_text(GRAPH)
    result = invoke("run", f"{tmp_path / 'g.py'}:graph", "--db", tmp_path / "runs.db", "-i", "2")
    assert result.exit_code != 0
    assert "executor 'ray'" in result.output
