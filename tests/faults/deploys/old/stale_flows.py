"""The previous deploy of module ``stale_flows``: its kid has one node more than the new
deploy's (``deploys/new/stale_flows.py``). A worker started with this folder on its path
drives this version only."""

from __future__ import annotations

import tailrace as tr
from tests.faults.stale_work import jobs, work

stale_kid = tr.Graph("stale_kid")
stale_kid.add_node("work", work)
stale_kid.add_node("audit", lambda value: value)  # the node the new deploy dropped
stale_kid.add_edge("work", "audit")

stale_family = tr.Graph("stale_family")
stale_family.add_node("plan", jobs)
stale_family.add_node("each", stale_kid, "map", queue="kids")
stale_family.add_edge("plan", "each")
