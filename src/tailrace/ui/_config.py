"""What a dashboard is told when it starts, and what it holds while it runs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

from ..core import Engine
from ..graph import Graph
from ..stores import RunStore
from ._catalog import GraphCatalog
from ._resumer import Resumer, ThreadDriver
from ._security import LOOPBACK_HOSTS

#: Makes an unopened store on the dashboard's database; the argument is ``read_only``.
StoreFactory = Callable[[bool], RunStore]
#: Opens a driver of LangGraph threads over the dashboard's writable store (``--langgraph``).
DriverFactory = Callable[[RunStore], AbstractAsyncContextManager[ThreadDriver]]


@dataclass(frozen=True, slots=True, kw_only=True)
class UiConfig:
    """How a dashboard reads, what it may change, and who it answers.

    Args:
        store: makes an unopened store on the database, read-only when its
            argument is true (``lambda ro: open_store(url, read_only=ro)``).
            Pages read through a read-only store; answers and resumes go
            through a second, writable one.
        token: the secret every state change must carry (a POST form field
            ``token`` or the ``X-Tailrace-Token`` header).
        location: the store as shown in the page header (no password).
        read_only: hide and refuse every state change; open no writable store.
        graphs: graphs to draw and resume runs of, matched by fingerprint
            (``--graphs``); module references are imported too, stored file
            references never (trust model).
        drivers: open the drivers whose LangGraph threads the dashboard resumes
            (``--langgraph``); each is given the writable store and opened for
            as long as the app serves (not at all when ``read_only``). Their
            names must differ.
        artifacts: evolve-ledger artifact ids the evolution page lists.
        allowed_hosts: ``Host`` headers served (a DNS-rebinding guard);
            ``("*",)`` serves any.
        reading_needs_token: whether reading (pages and live streams) needs
            the login cookie too; ``tailrace ui`` sets it when it listens
            beyond loopback. Changes need the token either way.
        poll_interval: seconds between the live stream's reads of new events.
        page_size: runs per page of the runs list.
        lease_ttl: lease lifetime of runs the dashboard resumes (D6).
    """

    store: StoreFactory
    token: str
    location: str = ""
    read_only: bool = False
    graphs: Sequence[Graph] = ()
    drivers: Sequence[DriverFactory] = ()
    artifacts: Sequence[str] = ()
    allowed_hosts: Sequence[str] = LOOPBACK_HOSTS
    reading_needs_token: bool = False
    poll_interval: float = 0.2
    page_size: int = 25
    lease_ttl: float = 30.0

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("token must be a non-empty string")
        if not 0 < self.poll_interval <= 60:
            raise ValueError(f"poll_interval must be in (0, 60] seconds, got {self.poll_interval}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")


@dataclass(slots=True, kw_only=True)
class UiState:
    """What the app holds while it serves: stores, the engine and its background resumes."""

    config: UiConfig
    reader: RunStore
    catalog: GraphCatalog
    engine: Engine | None = None
    resumer: Resumer | None = None
    writer: RunStore | None = field(default=None)


@contextlib.asynccontextmanager
async def serving(config: UiConfig) -> AsyncIterator[UiState]:
    """Open the stores (the writable one first: it creates a fresh database), yield, close.

    Leaving cancels the resumes still running (their leases are released, the
    runs stay resumable) before the stores close.
    """
    async with contextlib.AsyncExitStack() as stack:
        writer: RunStore | None = None
        if not config.read_only:
            writer = config.store(False)
            await stack.enter_async_context(writer)
        reader = config.store(True)
        if reader is not writer:
            await stack.enter_async_context(reader)
        state = UiState(config=config, reader=reader, catalog=GraphCatalog(config.graphs))
        if writer is not None:
            state.writer = writer
            state.engine = Engine(store=writer, lease_ttl=config.lease_ttl)
            state.engine.register(*config.graphs)
            drivers = [
                await stack.enter_async_context(opening(writer)) for opening in config.drivers
            ]
            names = [d.name for d in drivers]
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"LangGraph drivers named twice: {', '.join(twice)}")
            state.resumer = await stack.enter_async_context(Resumer(state.engine, drivers))
        yield state
