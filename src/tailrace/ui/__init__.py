"""``tailrace ui``: a web dashboard over a run store (needs the ``web`` extra).

Server-rendered pages (Starlette, Jinja2 with autoescape), a little plain
JavaScript for live updates over server-sent events, no build step:

- runs: filter by status, graph, queue and parent run, counts, newest first, paginated;
- a run: its graph as SVG with each node's status, a Gantt of every attempt
  (retries, stragglers, hedges, attempts cut by a crash), late inputs, the
  event log, updated live while it runs; its parent, its child runs and the
  tree of its descendants;
- questions: open, answered, expired and stuck; answer from the page (first
  answer wins) and the run resumes in the dashboard's process;
- queues: depth, running, start rate and workers; cancel a run from its page;
- versions: a run's graph version, whether it can move to each other version
  the dashboard holds, and "fork from here" on each node that ran;
- evolution: an artifact's versions and held-out reward per version.

Reading needs nothing; every change (answer, resume, cancel, fork) is a POST
carrying the token; the dashboard binds 127.0.0.1 unless told otherwise. See
``docs/ui.md``.
"""

from ._app import create_app as create_app
from ._config import UiConfig as UiConfig
from ._security import new_token as new_token

__all__ = ["UiConfig", "create_app", "new_token"]
