"""The runs one engine drives now: one driver per run within one owner (D6).

An engine drives a run under :meth:`Drivers.driving`, which refuses a second
driver of the same run (:class:`~tailrace.LeaseHeld`), marks the run driven
for the stream hub (S3), and forgets what was said about the run when the
drive ends. A cancel or preempt asked of a run whose loop does not exist yet
(it is still starting) is kept and handed to the loop once it does. Letting
go of a run sets an event that :meth:`Drivers.let_go` awaits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .._errors import LeaseHeld
from ._streams import StreamHub

if TYPE_CHECKING:
    from ._loop import RunLoop


class Drivers:
    """The runs driven here, their loops, and the requests that wait for a loop to exist.

    ``stream_hub`` learns which runs are driven here, so its readers see
    chunks before they are durable and are woken when a drive ends.
    """

    __slots__ = (
        "_cancel_pending",
        "_letting_go",
        "_loops",
        "_preempt_pending",
        "durability",
        "hub",
    )

    def __init__(self, stream_hub: StreamHub) -> None:
        self.hub = stream_hub
        #: Each run driven now, with the event set when this engine lets go of it (made on demand).
        self._letting_go: dict[str, asyncio.Event | None] = {}
        self._loops: dict[str, RunLoop] = {}
        self._preempt_pending: set[str] = set()
        #: Runs asked to cancel while starting, before their loop existed.
        self._cancel_pending: set[str] = set()
        #: Per-run durability overrides, while the run is driven here.
        self.durability: dict[str, str] = {}

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._letting_go

    def drives(self, run_id: str) -> bool:
        """Whether ``run_id`` is driven here now."""
        return run_id in self._letting_go

    @contextlib.contextmanager
    def driving(self, run_id: str) -> Iterator[None]:
        """Hold ``run_id`` as driven here while the body runs; :class:`LeaseHeld` if it is already."""
        if run_id in self._letting_go:
            raise LeaseHeld(f"run {run_id!r} is being driven by this engine already")
        self._letting_go[run_id] = None
        try:
            with self.hub.driving(run_id):
                yield
        finally:
            let_go = self._letting_go.pop(run_id, None)
            self._loops.pop(run_id, None)
            self._preempt_pending.discard(run_id)
            self._cancel_pending.discard(run_id)
            self.durability.pop(run_id, None)
            if let_go is not None:
                let_go.set()

    async def let_go(self, run_id: str, within: float) -> None:
        """Wait, at most ``within`` seconds, until this engine lets go of ``run_id`` (R4).

        A parent that suspended on its children may be queued again, and
        claimed by this very worker, before its previous drive here returned:
        that drive is in its last step, so waiting for it beats refusing the
        claim (which would leave the run leased until its lease expired).
        """
        if run_id not in self._letting_go:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while run_id in self._letting_go:
                    event = self._letting_go[run_id]
                    if event is None:
                        event = self._letting_go[run_id] = asyncio.Event()
                    await event.wait()

    def attach(self, run_id: str, loop: RunLoop) -> None:
        """``loop`` drives ``run_id`` now: it hears the preempt or cancel asked while it started."""
        self._loops[run_id] = loop
        if run_id in self._preempt_pending:
            self._preempt_pending.discard(run_id)
            loop.preempt()
        if run_id in self._cancel_pending:
            self._cancel_pending.discard(run_id)
            loop.request_cancel()

    def request_cancel(self, run_id: str) -> bool:
        """Ask the loop of ``run_id`` to end cancelled (or its loop, once it exists); False if
        ``run_id`` is not driven here."""
        loop = self._loops.get(run_id)
        if loop is None:
            if run_id not in self._letting_go:
                return False
            self._cancel_pending.add(run_id)  # starting: it ends cancelled once its loop exists
            return True
        loop.request_cancel()
        return True

    def preempt(self, run_id: str) -> bool:
        """Ask the loop of ``run_id`` to stop at its next turn boundaries (or its loop, once it
        exists); False if ``run_id`` is not driven here."""
        loop = self._loops.get(run_id)
        if loop is None:
            if run_id not in self._letting_go:
                return False
            self._preempt_pending.add(run_id)  # starting: preempt once its loop exists
            return True
        loop.preempt()
        return True
