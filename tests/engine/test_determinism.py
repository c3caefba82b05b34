"""E2: results and per-node event order do not depend on PYTHONHASHSEED.

A mixed graph (first-k and full aggregates, any_of, switches, a loop with a
fan-out and a first-k merge inside) runs in ten subprocesses, one per hash
seed. Handlers are all async (sync ones would run in worker threads, whose
timing no test controls) and deterministic: each yields to the loop a fixed,
node- and visit-dependent number of times, so the interleaving is a function
of the engine alone. Every process prints the same JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import asyncio
    import json
    import sys

    import tailrace as tr

    def build():
        g = tr.Graph("determinism")

        def task(name, n_yields, fn=None, **options):

            async def handler(x):
                ctx = tr.current_node()
                for _ in range((n_yields + ctx.visit) % 4):
                    await asyncio.sleep(0)
                return fn(x, ctx) if fn else [name, ctx.visit, x]

            g.add_node(name, handler, **options)

        def switch(name, choose):
            async def handler(x):
                return choose(x, tr.current_node())

            g.add_node(name, handler, tr.NodeKind.SWITCH)

        task("start", 0, lambda x, ctx: x)
        workers = ["w_alpha", "w_beta", "w_gamma", "w_delta", "w_epsilon"]
        for i, name in enumerate(workers):
            task(name, 3 - i % 3, lambda x, ctx, name=name: [name, x])
            g.add_edge("start", name)
        task("first_two", 1, kind=tr.NodeKind.AGGREGATE, required=2)
        task("all_pair", 2, kind=tr.NodeKind.AGGREGATE)
        task("any_late", 1, any_of=True)
        for name in workers:
            g.add_edge(name, "first_two")
        g.add_edge("w_alpha", "all_pair")
        g.add_edge("w_beta", "all_pair")
        for name in workers[2:]:
            g.add_edge(name, "any_late")
        switch("route", lambda x, ctx: ["left", "both", "right"][len(json.dumps(x)) % 3])
        g.add_edge("first_two", "route")
        task("left", 2)
        task("right", 1)
        task("both_a", 0)
        task("both_b", 3)
        g.add_edge("route", "left", route="left")
        g.add_edge("route", "right", route="right")
        g.add_edge("route", "both_a", route="both")
        g.add_edge("route", "both_b", route="both")
        task("gather", 0, any_of=True)
        for name in ("left", "right", "both_a", "both_b"):
            g.add_edge(name, "gather")
        # loop: body -> (b1, b2) -> merge(required=1) -> check -> body | end
        task("body", 1)
        task("b_one", 2)
        task("b_two", 0)
        task("loop_merge", 1, kind=tr.NodeKind.AGGREGATE, required=1)
        switch("check", lambda x, ctx: "again" if ctx.visit < 4 else "done")
        task("end", 0)
        g.add_edge("gather", "body")
        g.add_edge("body", "b_one")
        g.add_edge("body", "b_two")
        g.add_edge("b_one", "loop_merge")
        g.add_edge("b_two", "loop_merge")
        g.add_edge("loop_merge", "check")
        g.add_edge("check", "body", route="again")
        g.add_edge("check", "end", route=tr.EXIT)
        task("tail", 0)
        g.add_edge("all_pair", "tail")
        # a map after the loop: first 5 of 12 items, the others recorded late (M7)
        task("spread", 1, lambda x, ctx: [f"item-{i}" for i in range(12)])
        g.add_edge("end", "spread")

        async def item(x):
            ctx = tr.current_node()
            for _ in range((ctx.item * 5) % 7):
                await asyncio.sleep(0)
            return [x, ctx.item]

        g.add_node("fan_map", item, tr.NodeKind.MAP, required=5)
        g.add_edge("spread", "fan_map")
        return g

    async def main():
        engine = tr.Engine()
        events = []
        engine.bus.subscribe(events.append)
        result = await engine.run(build(), ["seed-independent", 1], run_id="fixed")
        per_node = {}
        for e in events:
            if e.node_id is not None:
                per_node.setdefault(e.node_id, []).append(
                    [e.type.value, e.visit, e.attempt, e.data.get("item")]
                )
        out = {
            "status": result.status,
            "results": result.results,
            "visits": result.visits,
            "late": [
                [i.node_id, i.source_id, i.activation, i.reason, i.item] for i in result.late_inputs
            ],
            "per_node_events": per_node,
            "event_order": [[e.type.value, e.node_id, e.visit, e.data.get("item")] for e in events],
        }
        print(json.dumps(out, sort_keys=True))

    asyncio.run(main())
    """
)


@pytest.mark.slow
def test_e2_same_output_under_every_hash_seed(tmp_path):
    script = tmp_path / "determinism_run.py"
    script.write_text(SCRIPT)
    procs = []
    for seed in range(10):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp_path,
            )
        )
    outputs = []
    for seed, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"PYTHONHASHSEED={seed} failed:\n{stderr}"
        outputs.append(stdout)
    first = json.loads(outputs[0])
    # the graph exercised what it is meant to
    assert first["status"] == "completed"
    assert first["visits"]["body"] == 4
    assert first["visits"]["loop_merge"] == 4
    assert first["results"]["route"] == "both"  # a multi-match switch
    assert first["visits"]["both_a"] == first["visits"]["both_b"] == 1
    assert any(node == "gather" for node, *_ in first["late"])
    assert first["late"], "expected stragglers behind the first-k merges"
    assert any(node == "first_two" for node, *_ in first["late"])
    assert any(node == "loop_merge" for node, *_ in first["late"])
    assert any(node == "any_late" for node, *_ in first["late"])
    assert len(first["results"]["fan_map"]) == 5  # first-k over a map's items (M3, M7)
    assert sum(1 for node, *_ in first["late"] if node == "fan_map") == 7
    for seed, text in enumerate(outputs[1:], start=1):
        assert json.loads(text) == first, f"PYTHONHASHSEED={seed} differs from PYTHONHASHSEED=0"
        assert text == outputs[0]
