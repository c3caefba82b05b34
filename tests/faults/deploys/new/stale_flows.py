"""The new deploy of module ``stale_flows`` (see ``deploys/old/stale_flows.py``)."""

from __future__ import annotations

import tailrace as tr
from tests.faults.stale_work import jobs, work

stale_kid = tr.Graph("stale_kid")
stale_kid.add_node("work", work)

stale_family = tr.Graph("stale_family")
stale_family.add_node("plan", jobs)
stale_family.add_node("each", stale_kid, "map", queue="kids")
stale_family.add_edge("plan", "each")
