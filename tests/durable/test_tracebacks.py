"""A failed attempt stores a bounded traceback with its event, as data, on every store."""

from __future__ import annotations

import json

import pytest

from tailrace import Engine, Graph, RetryPolicy
from tailrace.core._inflight import TRACEBACK_CHARS
from tests import fixtures

store = fixtures.each_store


def failing(message: str, *, depth: int = 0, retries: int = 1) -> Graph:
    g = Graph("failing")

    def dig(n: int) -> None:
        if n:
            dig(n - 1)
        raise LookupError(message)

    @g.task(retry=RetryPolicy(attempts=retries) if retries > 1 else None)
    async def boom(x: object) -> None:
        dig(depth)

    return g


async def test_a_failed_node_stores_its_traceback_with_file_and_line(store) -> None:
    with pytest.raises(LookupError):
        await Engine(store=store).run(failing("missing", retries=2), 1, run_id="r")
    events = await store.events("r")
    retried = [json.loads(e.data_json) for e in events if e.type == "node_retrying"]
    failed = [json.loads(e.data_json) for e in events if e.type == "node_failed"]
    assert len(retried) == 1 and len(failed) == 1
    for data in (*retried, failed[0]):
        assert data["error"] == "LookupError: missing"
        text = data["traceback"]
        assert text.startswith("Traceback (most recent call last):")
        assert (
            __file__ in text and "in dig" in text and text.rstrip().endswith("LookupError: missing")
        )


async def test_hostile_text_in_a_traceback_is_stored_literally(store) -> None:
    hostile = "[bold red]x[/] <script>alert(1)</script> \x1b[31m \x00 \ud800"
    with pytest.raises(LookupError):
        await Engine(store=store).run(failing(hostile), 1, run_id="r")
    [data] = [json.loads(e.data_json) for e in await store.events("r") if e.type == "node_failed"]
    text = data["traceback"]
    assert "[bold red]x[/] <script>alert(1)</script> \x1b[31m" in text
    assert "\x00" not in text and "\\x00" in text and "\\ud800" in text


async def test_a_huge_traceback_is_cut_to_its_innermost_end(store) -> None:
    with pytest.raises(LookupError):
        await Engine(store=store).run(failing("x" * 50_000 + " the end", depth=5), 1, run_id="r")
    [data] = [json.loads(e.data_json) for e in await store.events("r") if e.type == "node_failed"]
    text = data["traceback"]
    assert len(text) <= TRACEBACK_CHARS + 4 and text.startswith("...\n")
    assert text.rstrip().endswith("x the end")
