"""The pictures' geometry: graph layout and shapes, the Gantt, the reward curve (pure)."""

from __future__ import annotations

import json

from tailrace._attempts import Attempt, Outcome
from tailrace.stores import ArtifactVersion, EventRow, NodeRow
from tailrace.ui._curve import reward_curve, version_rows
from tailrace.ui._gantt import LABEL_W, TRACK_W, gantt
from tailrace.ui._layout import layout, nodes_from_events, shape_from_store, shape_of_graph
from tailrace.ui._security import script_json, token_matches
from tests.ui.support import scenarios


def row(node_id: str, status: str = "completed", visits: int = 1, data: object = None) -> NodeRow:
    return NodeRow(node_id=node_id, status=status, visits=visits, data_json=json.dumps(data or {}))


def test_layout_puts_each_node_right_of_its_inputs_and_loops_back_below() -> None:
    drawing = layout(shape_of_graph(scenarios.research), {"plan": row("plan")})
    x = {n.id: n.x for n in drawing.nodes}
    assert x["plan"] < x["search"] == x["papers"] == x["issues"] < x["merge"] < x["write"]
    assert x["write"] < x["review"] < x["publish"]
    back = [(e.source, e.target) for e in drawing.edges if e.back]
    assert back == [("review", "write")]  # the loop's closing edge, drawn dashed
    assert {e.label for e in drawing.edges if e.source == "review"} == {"again", "done"}
    status = {n.id: n.status for n in drawing.nodes}
    assert status["plan"] == "completed" and status["publish"] == "not-reached"
    assert drawing.complete
    for n in drawing.nodes:  # every box inside the canvas
        assert n.x >= 0 and n.x + n.w <= drawing.width and n.y + n.h <= drawing.height


def test_a_fan_out_is_stacked_in_definition_order() -> None:
    drawing = layout(shape_of_graph(scenarios.research), {})
    y = {n.id: n.y for n in drawing.nodes}
    assert y["search"] < y["papers"] < y["issues"]


def test_the_stored_shape_holds_nodes_that_ran_and_the_edges_decisions_name() -> None:
    events = [
        EventRow(seq=1, type="node_started", node_id="a", visit=1, attempt=1, ts=0.0, data_json="{}"),
        EventRow(seq=2, type="node_started", node_id="b", visit=1, attempt=1, ts=0.1, data_json="{}"),
        EventRow(seq=3, type="aggregate_fired", node_id="m", visit=1, attempt=None, ts=0.2,
                 data_json=json.dumps({"sources": ["a", "b"]})),
        EventRow(seq=4, type="node_late_input", node_id="m", visit=1, attempt=None, ts=0.3,
                 data_json=json.dumps({"source": "c", "reason": "fired"})),
    ]  # fmt: skip
    shape = shape_from_store(
        {"a": row("a"), "m": row("m", data={"inputs": [["a", 1, "x", None]]})}, events
    )
    assert [n.id for n in shape.nodes] == ["a", "b", "m", "c"]
    assert {(e.source, e.target) for e in shape.edges} == {("a", "m"), ("b", "m"), ("c", "m")}
    assert {n.id: n.kind for n in shape.nodes}["m"] == "aggregate"
    assert not shape.complete


def started(structure: object, seq: int = 1) -> EventRow:
    data = json.dumps({"graph": "g", "structure": structure})
    return EventRow(seq=seq, type="run_started", node_id=None, visit=None, attempt=None, ts=0.0,
                    data_json=data)  # fmt: skip


def test_the_structure_a_run_stored_draws_its_graph_whole_without_its_code() -> None:
    structure = scenarios.research.structure()
    shape = shape_from_store({}, [started(structure)])
    assert shape.complete
    assert [n.id for n in shape.nodes] == list(scenarios.research.nodes)
    assert {(e.source, e.target, e.route) for e in shape.edges} == {
        (e.source, e.target, e.route) for e in scenarios.research.edges
    }
    assert shape == shape_of_graph(scenarios.research)


def test_a_node_the_records_name_beyond_the_stored_structure_is_drawn_too() -> None:
    later = EventRow(seq=2, type="node_started", node_id="added", visit=1, attempt=1, ts=0.1,
                     data_json="{}")  # fmt: skip
    shape = shape_from_store({}, [started({"nodes": [["a", "task"]], "edges": []}), later])
    assert [n.id for n in shape.nodes] == ["a", "added"]


def test_a_stored_structure_that_does_not_read_is_not_drawn_and_the_records_are() -> None:
    ran = EventRow(seq=2, type="node_started", node_id="a", visit=1, attempt=1, ts=0.1,
                   data_json="{}")  # fmt: skip
    bad = [
        "not a structure",
        {"nodes": "a", "edges": []},
        {"nodes": [["a", "task"]], "edges": [["a", "nowhere", None]]},  # an edge to no node
        {"nodes": [["a", "task"], ["a", "gate"]], "edges": []},  # one id twice
        {"nodes": [["a", 7]], "edges": []},
        {"nodes": [["a", "task"]], "edges": [["a", "a", {"x": 1}]]},
        {"nodes": [["a", "task", "extra"]], "edges": []},
    ]
    for structure in bad:
        shape = shape_from_store({}, [started(structure), ran])
        assert not shape.complete, structure
        assert [n.id for n in shape.nodes] == ["a"], structure


def test_node_rows_from_events_give_each_node_its_last_state_and_visits() -> None:
    def event(seq: int, type: str, node: str, visit: int) -> EventRow:
        return EventRow(seq=seq, type=type, node_id=node, visit=visit, attempt=1, ts=seq,
                        data_json="{}")  # fmt: skip

    rows = nodes_from_events([
        event(1, "node_started", "review", 1), event(2, "question_opened", "review", 1),
        event(3, "node_started", "plan", 1), event(4, "node_completed", "plan", 1),
        event(5, "node_started", "plan", 2), event(6, "node_failed", "plan", 2),
    ])  # fmt: skip
    assert {n: (r.status, r.visits) for n, r in rows.items()} == {
        "review": ("waiting", 1), "plan": ("failed", 2),
    }  # fmt: skip


def attempt(label: str, start: float, end: float, outcome: Outcome, **kw: object) -> Attempt:
    node, _, visit = label.partition("#")
    return Attempt(node_id=node, visit=int(visit), attempt=1, start=start, end=end,
                   outcome=outcome, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_gantt_scales_the_run_to_the_track_and_gives_hedges_their_own_row() -> None:
    chart = gantt([
        attempt("a#1", 10.0, 12.0, Outcome.COMPLETED),
        attempt("b#1", 11.0, 14.0, Outcome.LOST, straggler_at=13.0),
        attempt("b#1", 13.0, 14.0, Outcome.COMPLETED, hedge=True),
    ])  # fmt: skip
    assert [r.full_label for r in chart.rows] == ["a#1", "b#1", "b#1 hedge"]
    first, lost, hedge = chart.bars
    assert (first.x, first.w) == (LABEL_W, TRACK_W / 2)
    assert lost.x + lost.w == LABEL_W + TRACK_W and lost.straggler_x == LABEL_W + TRACK_W * 3 / 4
    assert hedge.hedge and hedge.y > lost.y
    assert chart.counts == {"completed": 2, "lost": 1, "straggler": 1, "hedge": 1}
    assert chart.ticks[0] == (LABEL_W, "0") and chart.ticks[-1][1] == "4.0 s"
    assert "straggler after 2.0 s" in lost.title


def test_gantt_of_nothing_is_empty() -> None:
    assert gantt([]).bars == ()


def version(n: int, meta: dict[str, object]) -> ArtifactVersion:
    return ArtifactVersion(artifact_id="p", version=n, entries_json=json.dumps({"system": f"v{n}"}),
                           meta_json=json.dumps(meta), created_at=1.0)  # fmt: skip


def test_curve_plots_each_scored_version_higher_reward_higher_up() -> None:
    rows = version_rows([
        version(1, {"initial": True}),
        version(2, {"held_out": 0.5, "edit": {"set": {"system": "x"}, "note": "shorter"}, "sweep": 1}),
        version(3, {"held_out": 0.8, "rebased_onto": 2}),
    ])  # fmt: skip
    assert [r.initial for r in rows] == [True, False, False]
    assert rows[1].set_keys == ("system",) and rows[1].note == "shorter"
    curve = reward_curve(rows)
    assert curve is not None
    low, high = curve.points
    assert (low.version, high.version) == (2, 3)
    assert high.y < low.y and low.x < high.x  # SVG's y grows downwards
    assert high.rebased and not low.rebased
    assert reward_curve(rows[:1]) is None  # nothing scored: no curve


def test_undecodable_meta_is_shown_without_a_score() -> None:
    bad = ArtifactVersion(artifact_id="p", version=1, entries_json="{", meta_json="nope")
    [shown] = version_rows([bad])
    assert (shown.held_out, shown.entries) == (None, {})


def test_json_in_a_page_cannot_close_its_script_element() -> None:
    text = script_json({"x": "</script><script>alert(1)</script>", "y": "a\u2028b & 'c'"})
    assert "<" not in text and ">" not in text and "&" not in text and "'" not in text
    assert "\u2028" not in text
    assert json.loads(text) == {"x": "</script><script>alert(1)</script>", "y": "a\u2028b & 'c'"}


def test_the_token_comparison_refuses_missing_and_wrong_tokens() -> None:
    assert token_matches("s3cret", "s3cret")
    assert not token_matches("s3cret", None) and not token_matches("s3cret", "")
    assert not token_matches("s3cret", "s3cret ") and not token_matches("s3cret", "säcret")
