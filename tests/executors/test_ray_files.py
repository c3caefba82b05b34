"""Graphs loaded from a file run on Ray: their handlers travel to the workers by value.

A file graph's module (``tailrace_file_<hash>``) exists only in the process
that loaded the file; a Ray worker cannot import it. The graph here calls a
helper function and a class of its own file, so everything it reaches must
travel too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tailrace.graph import load_file_module
from tests.cli.test_cli import invoke

pytestmark = pytest.mark.slow  # a local Ray

GRAPH = """
import os

import tailrace as tr

graph = tr.Graph("from-a-file")


class Scale:
    def __init__(self, factor):
        self.factor = factor


def scaled(x):
    return x * Scale(3).factor


@graph.task(executor="ray")
def crunch(x):
    return {"value": scaled(x), "pid": os.getpid(), "module": __name__}
"""


def test_a_graph_run_from_a_file_runs_its_handlers_on_ray_workers(
    ray_session: Any, tmp_path: Path
) -> None:
    path = tmp_path / "g.py"
    path.write_text(GRAPH)
    result = invoke(
        "run", f"{path}:graph", "--db", tmp_path / "runs.db", "-i", "7", "--executor", "ray"
    )
    assert result.exit_code == 0, result.output
    module = load_file_module(str(path))  # the CLI loaded it already: the same module
    output = json.loads(result.output[result.output.index("{") :])
    assert output["value"] == 21 and output["module"] == module.__name__
    assert output["pid"] != os.getpid()  # in a Ray worker
