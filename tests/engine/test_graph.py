"""Graph definition: validation (G1), in-loop edge classification (G2), JSON round trip (G3)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import tailrace as tr
from tests import fixtures

# -- module-level handlers, so that ``module:qualname`` references resolve (G3) --


def h_task(x):
    """Identity task."""
    return x


async def h_async(x):
    """Async identity task."""
    return x


def h_route(x):
    """A switch handler."""
    return "go"


def h_merge(xs):
    """An aggregate handler."""
    return list(xs)


def h_other(x):
    """Another task."""
    return x


def h_cost(x):
    """A cost function."""
    return 1.0


class CallableHandler:
    """A handler object; referenced by its class."""

    def __call__(self, x):
        return x


class Handlers:
    """Handlers nested in a class: their qualname has a dot."""

    @staticmethod
    def nested(x):
        return x


def noop(x):
    return x


# ---------------------------------------------------------------------------
# G1: validation, naming the culprit
# ---------------------------------------------------------------------------


def test_g1_duplicate_node_id_names_the_node():
    g = tr.Graph("g")
    g.add_node("twin", noop)
    with pytest.raises(tr.GraphError, match="twin"):
        g.add_node("twin", noop)


def test_g1_duplicate_node_id_via_decorator():
    g = tr.Graph("g")

    @g.task()
    def same(x):
        return x

    with pytest.raises(tr.GraphError, match="same"):

        @g.task(name="same")
        def other(x):
            return x


@pytest.mark.parametrize(
    ("source", "target", "culprit"), [("ghost", "a", "ghost"), ("a", "phantom", "phantom")]
)
def test_g1_unknown_endpoint_names_the_edge_and_node(source, target, culprit):
    g = tr.Graph("g")
    g.add_node("a", noop)
    with pytest.raises(tr.GraphError) as info:
        g.add_edge(source, target)
    message = str(info.value)
    assert culprit in message
    assert source in message and target in message


def test_g1_switch_edge_without_route_names_the_switch():
    g = tr.Graph("g")
    g.add_node("sw", h_route, tr.NodeKind.SWITCH)
    g.add_node("after", noop)
    with pytest.raises(tr.GraphError, match="sw") as info:
        g.add_edge("sw", "after")
    assert "after" in str(info.value)


def test_g1_switch_self_loop_names_the_switch():
    g = tr.Graph("g")
    g.add_node("spin", h_route, tr.NodeKind.SWITCH)
    with pytest.raises(tr.GraphError, match="spin"):
        g.add_edge("spin", "spin", route="again")


def test_g1_route_on_an_edge_not_leaving_a_switch():
    g = tr.Graph("g")
    g.add_node("plain", noop)
    g.add_node("next", noop)
    with pytest.raises(tr.GraphError, match="plain"):
        g.add_edge("plain", "next", route="r")


def test_g1_switch_without_outgoing_edges_names_it():
    g = tr.Graph("g")
    g.add_node("start", noop)
    g.add_node("deadend", h_route, tr.NodeKind.SWITCH)
    g.add_edge("start", "deadend")
    with pytest.raises(tr.GraphError, match="deadend"):
        g.compile()


@pytest.mark.parametrize("required", [0, 3, -1])
def test_g1_aggregate_required_outside_fan_in_names_the_aggregate(required):
    g = tr.Graph("g")
    g.add_node("a", noop)
    g.add_node("b", noop)
    g.add_node("merge", h_merge, tr.NodeKind.AGGREGATE, required=required)
    g.add_edge("a", "merge")
    g.add_edge("b", "merge")
    with pytest.raises(tr.GraphError, match="merge") as info:
        g.compile()
    assert str(required) in str(info.value)


def test_g1_aggregate_without_inputs_is_rejected():
    g = tr.Graph("g")
    g.add_node("start", noop)
    g.add_node("lonely", h_merge, tr.NodeKind.AGGREGATE)
    with pytest.raises(tr.GraphError, match="lonely"):
        g.compile()


@pytest.mark.parametrize("required", [1, 2])
def test_g1_aggregate_required_inside_fan_in_is_accepted(required):
    g = tr.Graph("g")
    g.add_node("a", noop)
    g.add_node("b", noop)
    g.add_node("merge", h_merge, tr.NodeKind.AGGREGATE, required=required)
    g.add_edge("a", "merge")
    g.add_edge("b", "merge")
    g.compile()


def test_g1_plain_node_with_several_forward_in_edges_names_it():
    g = tr.Graph("g")
    g.add_node("a", noop)
    g.add_node("b", noop)
    g.add_node("join", noop)
    g.add_edge("a", "join")
    g.add_edge("b", "join")
    with pytest.raises(tr.GraphError, match="join"):
        g.compile()


def test_g1_switch_with_several_forward_in_edges_names_it():
    g = tr.Graph("g")
    g.add_node("a", noop)
    g.add_node("b", noop)
    g.add_node("choose", h_route, tr.NodeKind.SWITCH)
    g.add_node("out", noop)
    g.add_edge("a", "choose")
    g.add_edge("b", "choose")
    g.add_edge("choose", "out", route="go")
    with pytest.raises(tr.GraphError, match="choose"):
        g.compile()


def test_g1_any_of_node_with_several_forward_in_edges_is_accepted():
    g = tr.Graph("g")
    g.add_node("a", noop)
    g.add_node("b", noop)
    g.add_node("join", noop, any_of=True)
    g.add_edge("a", "join")
    g.add_edge("b", "join")
    g.compile()


def test_g1_in_loop_edges_do_not_count_as_forward_in_edges():
    # 'head' has one edge from outside the loop and one back-edge: no aggregate needed.
    g = tr.Graph("g")
    g.add_node("start", noop)
    g.add_node("head", noop)
    g.add_node("check", h_route, tr.NodeKind.SWITCH)
    g.add_node("done", noop)
    g.chain("start", "head", "check")
    g.add_edge("check", "head", route="again")
    g.add_edge("check", "done", route=tr.EXIT)
    g.compile()


def test_g1_no_entry_node():
    g = tr.Graph("g")
    g.add_node("ping", noop)
    g.add_node("pong", noop)
    g.add_edge("ping", "pong")
    g.add_edge("pong", "ping")
    with pytest.raises(tr.GraphError, match="entry"):
        g.compile()


def test_g1_empty_graph_has_no_entry_node():
    with pytest.raises(tr.GraphError, match="entry"):
        tr.Graph("empty").compile()


def test_g1_self_loop_node_is_still_an_entry():
    g = tr.Graph("g")
    g.add_node("spin", noop)
    g.add_edge("spin", "spin")
    assert g.compile().in_loop("spin", "spin")


def test_g1_loop_with_no_way_in_names_its_members():
    g = tr.Graph("g")
    g.add_node("start", noop)
    g.add_node("island_a", noop)
    g.add_node("island_b", noop)
    g.add_edge("island_a", "island_b")
    g.add_edge("island_b", "island_a")
    with pytest.raises(tr.GraphError) as info:
        g.compile()
    assert "island_a" in str(info.value)
    assert "island_b" in str(info.value)


def test_g1_node_options_are_checked_at_add_node():
    g = tr.Graph("g")
    with pytest.raises(tr.GraphError, match="bad_kind"):
        g.add_node("bad_kind", noop, "teleport")
    with pytest.raises(tr.GraphError, match="not_callable"):
        g.add_node("not_callable", 42)  # type: ignore[arg-type]
    with pytest.raises(tr.GraphError, match="visits"):
        g.add_node("visits", noop, max_visits=0)
    with pytest.raises(tr.GraphError, match="quorum_on_task"):
        g.add_node("quorum_on_task", noop, required=1)
    with pytest.raises(tr.GraphError, match="any_agg"):
        g.add_node("any_agg", h_merge, tr.NodeKind.AGGREGATE, any_of=True)
    with pytest.raises(tr.GraphError, match="zero_timeout"):
        g.add_node("zero_timeout", noop, timeout=0)
    assert g.nodes == {}


def test_g1_graph_error_is_a_value_error():
    assert issubclass(tr.GraphError, ValueError)
    assert issubclass(tr.GraphError, tr.TailraceError)


async def test_g1_engine_run_validates_the_graph():
    g = tr.Graph("g")
    g.add_node("a", noop)
    g.add_node("b", noop)
    g.add_node("join", noop)
    g.add_edge("a", "join")
    g.add_edge("b", "join")
    with pytest.raises(tr.GraphError, match="join"):
        await tr.Engine().run(g, 1)


def test_g1_validate_and_compile_agree():
    g = tr.Graph("g")
    g.add_node("a", noop)
    g.validate()
    assert g.compile() is g.compile()
    g.add_node("b", noop)  # a change invalidates the cached topology
    g.add_node("join", noop)
    g.add_edge("a", "join")
    g.add_edge("b", "join")
    with pytest.raises(tr.GraphError, match="join"):
        g.validate()


# ---------------------------------------------------------------------------
# G2: in-loop edges are exactly those inside one strongly connected component
# ---------------------------------------------------------------------------


def _graph(name, nodes, edges, *, aggregates=(), any_of=(), switches=()):
    g = tr.Graph(name)
    for node in nodes:
        if node in aggregates:
            g.add_node(node, h_merge, tr.NodeKind.AGGREGATE)
        elif node in switches:
            g.add_node(node, h_route, tr.NodeKind.SWITCH)
        else:
            g.add_node(node, noop, any_of=node in any_of)
    for edge in edges:
        source, target, *route = edge
        g.add_edge(source, target, route=route[0] if route else None)
    return g


def _classify(g):
    topo = g.compile()
    return {(e.source, e.target): topo.in_loop(e.source, e.target) for e in g.edges}


def test_g2_dag_has_no_in_loop_edges():
    g = _graph("dag", "sabcd", ["sa", "sb", "ac", "bc", "cd"], aggregates="c")
    assert not any(_classify(g).values())


def test_g2_self_edge_is_in_loop():
    g = _graph("self", ["s", "n", "after"], [("s", "n"), ("n", "n"), ("n", "after")])
    assert _classify(g) == {("s", "n"): False, ("n", "n"): True, ("n", "after"): False}


def test_g2_nested_loops():
    # outer: a -> b -> c -> d -> a ; inner: b -> c -> b ; d -> out leaves both.
    edges = [
        ("s", "a"),
        ("a", "b"),
        ("b", "c"),
        ("c", "b"),
        ("c", "d"),
        ("d", "a"),
        ("d", "out"),
    ]
    g = _graph("nested", ["s", "a", "b", "c", "d", "out"], edges)
    classified = _classify(g)
    assert classified.pop(("s", "a")) is False
    assert classified.pop(("d", "out")) is False
    assert all(classified.values()), classified


def test_g2_loops_sharing_a_node():
    # x -> y -> x and x -> z -> x share x; y -> w is a way out.
    edges = [("s", "x"), ("x", "y"), ("y", "x"), ("x", "z"), ("z", "x"), ("y", "w")]
    g = _graph("shared", ["s", "x", "y", "z", "w"], edges)
    assert _classify(g) == {
        ("s", "x"): False,
        ("x", "y"): True,
        ("y", "x"): True,
        ("x", "z"): True,
        ("z", "x"): True,
        ("y", "w"): False,
    }


def test_g2_two_loops_in_sequence_are_separate_components():
    edges = [("s", "p"), ("p", "q"), ("q", "p"), ("q", "r"), ("r", "t"), ("t", "r")]
    g = _graph("sequence", ["s", "p", "q", "r", "t"], edges, any_of="r")
    assert _classify(g) == {
        ("s", "p"): False,
        ("p", "q"): True,
        ("q", "p"): True,
        ("q", "r"): False,
        ("r", "t"): True,
        ("t", "r"): True,
    }


def test_g2_fan_out_and_merge_inside_a_loop():
    edges = [
        ("s", "a"),
        ("a", "b"),
        ("a", "c"),
        ("b", "d"),
        ("c", "d"),
        ("d", "sw"),
        ("sw", "a", "again"),
        ("sw", "done", tr.EXIT),
    ]
    g = _graph(
        "fanloop", ["s", "a", "b", "c", "d", "sw", "done"], edges, aggregates="d", switches=["sw"]
    )
    classified = _classify(g)
    assert classified.pop(("s", "a")) is False
    assert classified.pop(("sw", "done")) is False
    assert all(classified.values()), classified


def test_g2_in_loop_is_false_for_missing_edge():
    g = _graph("pair", ["a", "b"], [("a", "b")])
    assert g.compile().in_loop("a", "b") is False
    assert g.compile().in_loop("b", "a") is False


def test_g2_long_cycle_is_classified_without_recursion():
    # Iterative SCC: a cycle far deeper than the recursion limit.
    n = sys.getrecursionlimit() * 3
    g = tr.Graph("ring")
    g.add_node("entry", noop)
    names = [f"n{i}" for i in range(n)]
    for name in names:
        g.add_node(name, noop)
    g.add_edge("entry", names[0])
    for a, b in itertools.pairwise(names):
        g.add_edge(a, b)
    g.add_edge(names[-1], names[0])
    topo = g.compile()
    assert topo.in_loop(names[-1], names[0])
    assert topo.in_loop(names[0], names[1])
    assert not topo.in_loop("entry", names[0])


# ---------------------------------------------------------------------------
# G3: to_dict / from_dict round trip
# ---------------------------------------------------------------------------


def _rich_graph():
    g = tr.Graph("rich")
    g.add_node("start", h_task, priority=3, timeout=2.5)
    g.add_node(
        "fetch",
        h_async,
        retry=tr.RetryPolicy(
            attempts=4,
            backoff=0.5,
            multiplier=3.0,
            max_backoff=9.0,
            retry_on=(ValueError, TimeoutError),
        ),
        cost=h_cost,
        estimate_key="fetchers",
    )
    g.add_node("other", h_other, cost=2.0)
    g.add_node("merge", h_merge, tr.NodeKind.AGGREGATE, required=1)
    g.add_node("nested", Handlers.nested)
    g.add_node("check", h_route, tr.NodeKind.SWITCH, max_visits=5)
    g.add_node("any", h_task, any_of=True)
    g.add_node("done", h_task)
    g.add_edge("start", "fetch")
    g.add_edge("start", "other")
    g.add_edge("fetch", "merge")
    g.add_edge("other", "merge")
    g.add_edge("merge", "nested")
    g.add_edge("nested", "check")
    g.add_edge("check", "nested", route="again")
    g.add_edge("check", "any", route="go")
    g.add_edge("check", "done", route=tr.EXIT)
    g.add_edge("start", "any")
    return g


def test_g3_round_trip_is_identical():
    g = _rich_graph()
    data = g.to_dict()
    rebuilt = tr.Graph.from_dict(data)
    assert rebuilt.to_dict() == data
    assert rebuilt.to_json() == g.to_json()
    assert rebuilt.fingerprint() == g.fingerprint()
    # through actual JSON text too
    again = tr.Graph.from_dict(json.loads(g.to_json()))
    assert again.to_json() == g.to_json()
    assert again.to_dict() == data


def test_g3_handlers_resolve_by_reference():
    g = _rich_graph()
    rebuilt = tr.Graph.from_dict(g.to_dict())
    assert rebuilt.nodes["start"].handler is h_task
    assert rebuilt.nodes["fetch"].handler is h_async
    assert rebuilt.nodes["nested"].handler is Handlers.nested
    assert rebuilt.nodes["fetch"].cost is h_cost
    assert rebuilt.nodes["merge"].kind is tr.NodeKind.AGGREGATE
    assert rebuilt.nodes["merge"].required == 1
    assert list(rebuilt.nodes) == list(g.nodes)
    assert rebuilt.edges == g.edges


def test_g3_retry_policy_round_trip():
    policy = tr.RetryPolicy(
        attempts=4,
        backoff=0.5,
        multiplier=3.0,
        max_backoff=9.0,
        retry_on=(ValueError, TimeoutError),
    )
    data = policy.to_dict()
    assert data["retry_on"] == ["builtins:ValueError", "builtins:TimeoutError"]
    assert tr.RetryPolicy.from_dict(json.loads(json.dumps(data))) == policy
    rebuilt = tr.Graph.from_dict(_rich_graph().to_dict())
    assert rebuilt.nodes["fetch"].retry == policy


def test_g3_handlers_mapping_by_node_id_and_by_reference():
    g = tr.Graph("mapped")

    def local(x):
        return x

    g.add_node("first", local)
    g.add_node("second", h_task)
    g.chain("first", "second")
    data = g.to_dict()
    assert "<locals>" in data["nodes"][0]["handler"]
    with pytest.raises(tr.GraphError, match="first"):
        tr.Graph.from_dict(data)

    def replacement(x):
        return x

    by_id = tr.Graph.from_dict(data, {"first": replacement})
    assert by_id.nodes["first"].handler is replacement
    assert by_id.nodes["second"].handler is h_task
    by_ref = tr.Graph.from_dict(data, {data["nodes"][0]["handler"]: replacement})
    assert by_ref.nodes["first"].handler is replacement


def test_g3_lambda_handler_cannot_be_resolved_names_the_node():
    g = tr.Graph("lam")
    g.add_node("anon", lambda x: x)
    with pytest.raises(tr.GraphError, match="anon"):
        tr.Graph.from_dict(g.to_dict())


def test_g3_unknown_format_is_refused():
    data = _rich_graph().to_dict()
    data["format"] = 999
    with pytest.raises(tr.UnsupportedFormat, match="999"):
        tr.Graph.from_dict(data)


def test_g3_to_dict_validates():
    g = tr.Graph("bad")
    g.add_node("a", noop)
    g.add_node("b", noop)
    g.add_node("join", noop)
    g.add_edge("a", "join")
    g.add_edge("b", "join")
    with pytest.raises(tr.GraphError, match="join"):
        g.to_dict()


def test_g3_json_text_is_canonical():
    text = _rich_graph().to_json()
    assert text == json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def test_g3_decorators_build_the_same_graph_as_add_node():
    g1 = tr.Graph("same")
    g1.add_node("h_task", h_task)
    g1.add_node("h_route", h_route, tr.NodeKind.SWITCH)
    g1.add_node("h_merge", h_merge, tr.NodeKind.AGGREGATE, required=1)
    g1.add_edge("h_task", "h_route")
    g1.add_edge("h_route", "h_merge", route="go")

    g2 = tr.Graph("same")
    g2.task()(h_task)
    g2.switch()(h_route)
    g2.aggregate(required=1)(h_merge)
    g2.chain("h_task")
    g2.add_edge("h_task", "h_route")
    g2.add_edge("h_route", "h_merge", route="go")
    assert g1.to_json() == g2.to_json()


def test_g3_rebuilt_graph_runs_like_the_original():
    g = tr.Graph("runs")
    g.add_node("start", h_task)
    g.add_node("fetch", h_async)
    g.add_node("nested", Handlers.nested)
    g.add_node("merge", h_merge, tr.NodeKind.AGGREGATE)
    g.add_edge("start", "fetch")
    g.add_edge("start", "nested")
    g.add_edge("fetch", "merge")
    g.add_edge("nested", "merge")
    rebuilt = tr.Graph.from_dict(json.loads(g.to_json()))
    assert (
        tr.run(rebuilt, 5).results
        == tr.run(g, 5).results
        == {
            "start": 5,
            "fetch": 5,
            "nested": 5,
            "merge": [5, 5],
        }
    )


def test_g3_callable_object_handler_is_not_silently_replaced_by_its_class():
    """An instance is referenced as ``module:Class``; from_dict must not hand back the class.

    Either to_dict refuses the handler (naming the node), or the rebuilt graph
    behaves like the original.
    """
    g = tr.Graph("object")
    g.add_node("obj", CallableHandler())
    try:
        data = g.to_dict()
    except tr.GraphError as exc:
        assert "obj" in str(exc)
        return
    rebuilt = tr.Graph.from_dict(data)
    assert tr.run(rebuilt, 5).results == tr.run(g, 5).results == {"obj": 5}


# ---------------------------------------------------------------------------
# G1 for serialised input: a malformed document is a GraphError naming the field
# ---------------------------------------------------------------------------


def _doc():
    """A valid document with every kind of field, as JSON text would give it."""
    return json.loads(_rich_graph().to_json())


def _node(data, node_id):
    return next(n for n in data["nodes"] if n["id"] == node_id)


def _edit(path, value=KeyError):
    """A function applying one edit at ``path`` (``KeyError``: delete the key)."""

    def apply(data):
        *parents, last = path
        target = data
        for part in parents:
            target = target[part]
        if value is KeyError:
            del target[last]
        else:
            target[last] = value

    return apply


def _at_node(node_id, *path, value=KeyError):
    """Like :func:`_edit`, inside the node named ``node_id``."""

    def apply(data):
        _edit(path, value)(_node(data, node_id))

    return apply


MALFORMED = [
    # (what, edit, words the message must contain)
    ("missing name", _edit(["name"]), ["'name'"]),
    ("missing nodes", _edit(["nodes"]), ["'nodes'"]),
    ("missing edges", _edit(["edges"]), ["'edges'"]),
    ("missing format", _edit(["format"]), ["'format'"]),
    ("missing node id", _edit(["nodes", 0, "id"]), ["nodes[0]", "'id'"]),
    ("missing kind", _at_node("fetch", "kind"), ["'fetch'", "'kind'"]),
    ("missing handler", _at_node("fetch", "handler"), ["'fetch'", "'handler'"]),
    ("missing source", _edit(["edges", 0, "source"]), ["edges[0]", "'source'"]),
    ("missing target", _edit(["edges", 1, "target"]), ["edges[1]", "'target'"]),
    ("missing retry field", _at_node("fetch", "retry", "attempts"), ["'fetch'", "attempts"]),
    ("missing cost ref", _at_node("fetch", "cost", "ref"), ["'fetch'", "'ref'"]),
    ("nodes is a number", _edit(["nodes"], 5), ["'nodes'"]),
    ("name is a number", _edit(["name"], 5), ["'name'"]),
    ("name is null", _edit(["name"], None), ["'name'"]),
    ("name is empty", _edit(["name"], ""), ["name"]),
    ("format is text", _edit(["format"], "1"), ["'format'"]),
    ("format is true", _edit(["format"], True), ["'format'"]),
    ("nodes is an object", _edit(["nodes"], {}), ["'nodes'"]),
    ("node is a number", _edit(["nodes", 0], 3), ["nodes[0]"]),
    ("node id is a number", _edit(["nodes", 0, "id"], 3), ["nodes[0]", "'id'"]),
    ("kind is a list", _at_node("fetch", "kind", value=[]), ["'fetch'", "'kind'"]),
    ("kind is unknown", _at_node("fetch", "kind", value="teleport"), ["'fetch'", "teleport"]),
    ("handler is a list", _at_node("fetch", "handler", value=[]), ["'fetch'", "'handler'"]),
    ("handler is no reference", _at_node("fetch", "handler", value="nope"), ["'fetch'", "nope"]),
    (
        "handler is missing",
        _at_node("fetch", "handler", value="no_such_mod_zz:f"),
        ["'fetch'", "no_such_mod_zz"],
    ),
    ("handler not callable", _at_node("fetch", "handler", value="math:pi"), ["'fetch'", "math:pi"]),
    ("priority is text", _at_node("start", "priority", value="high"), ["'start'", "priority"]),
    ("max_visits is text", _at_node("check", "max_visits", value="5"), ["'check'", "max_visits"]),
    ("timeout is a list", _at_node("start", "timeout", value=[1]), ["'start'", "timeout"]),
    ("any_of is text", _at_node("any", "any_of", value="yes"), ["'any'", "any_of"]),
    ("required is text", _at_node("merge", "required", value="1"), ["'merge'", "required"]),
    ("retry is text", _at_node("fetch", "retry", value="x"), ["'fetch'", "'retry'"]),
    (
        "attempts is text",
        _at_node("fetch", "retry", "attempts", value="3"),
        ["'fetch'", "attempts"],
    ),
    (
        "retry_on is text",
        _at_node("fetch", "retry", "retry_on", value="builtins:ValueError"),
        ["'fetch'", "retry_on"],
    ),
    (
        "retry_on names a function",
        _at_node("fetch", "retry", "retry_on", value=["os:getcwd"]),
        ["'fetch'", "retry", "os:getcwd"],
    ),
    ("cost is text", _at_node("other", "cost", value="2"), ["'other'", "cost"]),
    ("cost ref is a number", _at_node("fetch", "cost", "ref", value=3), ["'fetch'", "'ref'"]),
    ("edge source is null", _edit(["edges", 0, "source"], None), ["edges[0]", "'source'"]),
    ("edge route is a number", _edit(["edges", 0, "route"], 3), ["'route'"]),
    ("edge to nowhere", _edit(["edges", 0, "target"], "ghost"), ["ghost"]),
    ("unknown top-level field", _edit(["extra"], 1), ["'extra'"]),
    ("unknown node option", _at_node("start", "prio", value=3), ["'start'", "'prio'"]),
    ("unknown edge field", _edit(["edges", 0, "weight"], 1), ["'weight'"]),
    ("unknown retry field", _at_node("fetch", "retry", "jitter", value=1), ["'fetch'", "jitter"]),
    ("unknown cost field", _at_node("fetch", "cost", "extra", value=1), ["'fetch'", "'extra'"]),
]


@pytest.mark.parametrize(
    ("edit", "words"), [pytest.param(e, w, id=what) for what, e, w in MALFORMED]
)
def test_g1_malformed_document_is_a_graph_error_naming_the_field(edit, words):
    data = _doc()
    edit(data)
    with pytest.raises(tr.GraphError) as info:
        tr.Graph.from_dict(data)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("data", [None, [], "graph", 3])
def test_g1_a_document_that_is_not_an_object_is_a_graph_error(data):
    with pytest.raises(tr.GraphError, match="graph document"):
        tr.Graph.from_dict(data)


def test_g1_explicit_nulls_mean_defaults_as_to_dict_writes_them():
    data = _doc()
    _node(data, "done")["priority"] = None
    _node(data, "done")["timeout"] = None
    assert tr.Graph.from_dict(data).to_dict() == _doc()


def test_g1_handlers_mapping_values_must_be_callable():
    with pytest.raises(tr.GraphError, match=r"'start'.*not callable"):
        tr.Graph.from_dict(_doc(), {"start": 42})


def test_g1_cost_by_reference_is_not_replaced_by_the_node_ids_handler():
    def replacement(x):
        return x

    rebuilt = tr.Graph.from_dict(_doc(), {"fetch": replacement})
    assert rebuilt.nodes["fetch"].handler is replacement
    assert rebuilt.nodes["fetch"].cost is h_cost


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("priority", "high"),
        ("priority", None),
        ("priority", float("nan")),
        ("priority", True),
        ("max_visits", "3"),
        ("max_visits", 1.5),
        ("max_visits", 0),
        ("timeout", "1"),
        ("timeout", float("inf")),
        ("timeout", -1),
        ("cost", "cheap"),
        ("cost", -1.0),
        ("any_of", "yes"),
        ("hedge", 1),
        ("retry", 3),
        ("estimate_key", 7),
        ("estimate_key", ""),
    ],
)
def test_g1_a_node_option_of_the_wrong_type_fails_at_build_time(option, value):
    g = tr.Graph("g")
    with pytest.raises(tr.GraphError) as info:
        g.add_node("culprit", noop, **{option: value})
    assert "culprit" in str(info.value) and option in str(info.value)
    assert g.nodes == {}


@pytest.mark.parametrize(
    ("option", "value"),
    [("required", "2"), ("required", 1.0)],
)
def test_g1_aggregate_quorum_of_the_wrong_type_fails_at_build_time(option, value):
    with pytest.raises(tr.GraphError, match=r"merge.*required"):
        tr.Graph("g").add_node("merge", h_merge, tr.NodeKind.AGGREGATE, **{option: value})


@pytest.mark.parametrize(
    ("option", "value"), [("poller", 5), ("poller", ""), ("deadline", "soon"), ("deadline", 0)]
)
def test_g1_gate_options_of_the_wrong_type_fail_at_build_time(option, value):
    with pytest.raises(tr.GraphError, match=f"gate.*{option}"):
        tr.Graph("g").add_node("gate", noop, tr.NodeKind.GATE, **{option: value})


def test_g1_priority_high_fails_before_any_run():
    g = tr.Graph("g")
    with pytest.raises(tr.GraphError, match=r"'work'.*priority"):

        @g.task(priority="high")
        def work(x):
            return x

    assert g.nodes == {}


def test_g1_decorator_with_an_unknown_option_names_node_and_option():
    g = tr.Graph("g")
    with pytest.raises(tr.GraphError, match=r"'work'.*'prio'"):

        @g.task(prio=3)
        def work(x):
            return x


@pytest.mark.parametrize("name", [None, "", 3, b"g"])
def test_g1_graph_name_must_be_a_non_empty_string(name):
    with pytest.raises(tr.GraphError, match="graph name"):
        tr.Graph(name)


@pytest.mark.parametrize(
    ("source", "target", "route"), [(["a"], "b", None), ("a", None, None), ("a", "b", 3)]
)
def test_g1_edge_endpoints_and_route_must_be_strings(source, target, route):
    g = tr.Graph("g")
    g.add_node("a", noop)
    g.add_node("b", noop)
    with pytest.raises(tr.GraphError, match="must be a string"):
        g.add_edge(source, target, route=route)


# -- fuzzing from_dict: it only ever succeeds or raises GraphError ---------------------

REFERENCES = [
    f"{__name__}:h_task",
    f"{__name__}:h_merge",
    "builtins:ValueError",
    "builtins:int",
    "os:getcwd",
    "math:pi",
    "tailrace:Graph",
    "zz_tailrace_fuzz_missing:x",
    "/nonexistent/dir/graph.py:graph",
    "graph.py:x",
    ".relative:x",
    "a:b:c",
    ":",
    "",
]
FIELDS = [
    "format",
    "name",
    "nodes",
    "edges",
    "id",
    "kind",
    "handler",
    "source",
    "target",
    "route",
    "ref",
    "retry",
    "attempts",
    "backoff",
    "multiplier",
    "max_backoff",
    "retry_on",
    "required",
    "max_visits",
    "priority",
    "any_of",
    "timeout",
    "cost",
    "estimate_key",
    "hedge",
    "poller",
    "deadline",
]


def _json_values():
    from hypothesis import strategies as st

    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats()
        | st.sampled_from(REFERENCES + [k.value for k in tr.NodeKind] + ["start", "fetch"])
        | st.text(max_size=6)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner, max_size=3)
        ),
        max_leaves=8,
    )


def _mutate(data, draw):
    """Apply one random edit somewhere in ``data``: delete, replace or add."""
    from hypothesis import strategies as st

    target = data
    while True:
        children = list(target.items()) if isinstance(target, dict) else list(enumerate(target))
        containers = [(k, v) for k, v in children if isinstance(v, dict | list) and v]
        if not containers or draw(st.integers(0, 4)) == 0:  # mostly go deep
            break
        target = draw(st.sampled_from(containers))[1]
    action = draw(st.sampled_from(["delete", "replace", "add"]))
    keys = list(target) if isinstance(target, dict) else list(range(len(target)))
    if action == "add" or not keys:
        value = draw(_json_values())
        if isinstance(target, dict):
            target[draw(st.sampled_from(FIELDS) | st.text(max_size=4))] = value
        else:
            target.append(value)
    elif action == "delete":
        del target[draw(st.sampled_from(keys))]
    else:
        target[draw(st.sampled_from(keys))] = draw(_json_values())


def _check_only_graph_errors(data):
    fmt = data.get("format") if isinstance(data, dict) else None
    try:
        graph = tr.Graph.from_dict(data)
    except tr.UnsupportedFormat:
        # D4: only a well-formed version number we do not know.
        assert isinstance(fmt, int) and not isinstance(fmt, bool) and fmt != 1
        return
    except tr.GraphError:
        return
    # G3 holds for whatever it accepted.
    again = tr.Graph.from_dict(json.loads(graph.to_json()))
    assert again.to_json() == graph.to_json()


@pytest.mark.slow
def test_g1_fuzz_mutated_documents_only_ever_raise_graph_error():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        doc = _doc()
        for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
            _mutate(doc, data.draw)
        _check_only_graph_errors(doc)

    check()


def test_g1_fuzz_arbitrary_documents_only_ever_raise_graph_error():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    documents = (
        st.fixed_dictionaries(
            {"format": st.just(1)},
            optional={
                "name": _json_values(),
                "nodes": st.lists(_json_values(), max_size=3),
                "edges": st.lists(_json_values(), max_size=3),
            },
        )
        | _json_values()
    )

    @settings(max_examples=300, deadline=None)
    @given(documents)
    def check(doc):
        _check_only_graph_errors(doc)

    check()


@pytest.mark.parametrize("kind", ["task", "map"])
def test_g1_a_generator_function_as_handler_is_refused_naming_the_node(kind: str) -> None:
    def items(x: int) -> Iterator[int]:
        yield x

    async def chunks(x: int) -> AsyncIterator[int]:
        yield x

    for handler in (items, chunks):
        g = tr.Graph("gen")
        with pytest.raises(tr.GraphError, match=r"node 'n'.*is a generator function"):
            g.add_node("n", handler, kind)


VERSIONED_FILE = """
import tailrace as tr

def at_most(k):
    return lambda n: min(n, k)

kid = tr.Graph("kid")
kid.add_node("one", lambda x: x)

made = {"__name__": "made"}  # a function with no source at hand, a set among its constants
exec("def quota(n):\\n    return 2 if str(n) in {'1', '2', '3', '4', '5'} else 1", made)

graph = tr.Graph("versioned")
graph.add_node("items", lambda x: list(range(x)))
graph.add_node("each", lambda x: x, "map", required=at_most(3))
graph.add_node("half", lambda xs: xs, "map", required=lambda n: n // 2)
graph.add_node("kid", kid)
graph.add_node("made", lambda xs: xs, "map", required=made["quota"])
graph.chain("items", "each", "half", "kid", "made")
"""


def test_every_process_agrees_on_a_fingerprint_with_code_and_child_graphs_in_it(
    tmp_path: Path,
) -> None:
    """A fingerprint with a callable ``required`` and a child graph in it is the same in every
    process that loads the same file, whatever its hash seed (V1, V3)."""
    path = tmp_path / "versioned_graph.py"
    path.write_text(VERSIONED_FILE)
    module = fixtures.load_module("versioned_graph", path)
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import versioned_graph; "
        "print(versioned_graph.graph.fingerprint())"
    )
    seen = set()
    for seed in ("0", "1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path)],
            env=env, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        seen.add(out.stdout.strip())
    assert seen == {module.graph.fingerprint()}


def test_a_required_function_with_no_source_is_versioned_by_its_code() -> None:
    def versioned(body: str) -> tr.Graph:
        made: dict[str, Any] = {"__name__": "made"}
        exec(f"def quota(n):\n    return {body}", made)  # no source file to read
        g = tr.Graph("made")
        g.add_node("each", h_task, "map", required=made["quota"])
        return g

    assert versioned("n").fingerprint() == versioned("n").fingerprint()
    assert versioned("n").fingerprint() != versioned("1").fingerprint()
    assert versioned("n // 2").fingerprint() != versioned("n // 3").fingerprint()
