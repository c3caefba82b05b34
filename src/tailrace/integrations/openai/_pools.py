"""The httpx clients one model client sends through, each holding a bounded number of requests.

httpcore's connection pool looks at every connection it holds each time a
request starts or ends, so one pool streaming thousands of generations at
once spends time in the square of their number (measured: two thirds of a
client's CPU at 5,120 streams). The requests are spread instead over as many
clients as they need, each holding at most ``size`` at once: a request starts
on the client that most recently had room (its idle connections are reused)
and a new client is made only when every one is full, so each start and end
costs O(``size``) whatever the number of streams.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


@dataclass(slots=True, eq=False)
class _Pool:
    client: httpx.AsyncClient
    load: int = 0
    closed: bool = False


class Pools:
    """Clients made by ``make`` on demand, each serving at most ``size`` requests at once.

    Args:
        make: Makes one more client (same timeouts, headers and transport settings).
        size: Requests one client serves at once; None: one client serves them all
            (a transport of the caller's, whose pool is its own).
    """

    def __init__(self, make: Callable[[], httpx.AsyncClient], size: int | None) -> None:
        if size is not None and size < 1:
            raise ValueError(f"a pool serves at least one request at once, not {size}")
        self._make, self._size = make, size
        self._pools: list[_Pool] = []
        #: The pools with room, the one that had room most recently last.
        self._room: list[_Pool] = []

    @property
    def clients(self) -> int:
        """How many clients were made so far."""
        return len(self._pools)

    @contextmanager
    def client(self) -> Iterator[httpx.AsyncClient]:
        """A client with room for one more request, counted as serving it while the block runs."""
        if not self._room:
            self._room.append(_Pool(self._make()))
            self._pools.append(self._room[-1])
        pool = self._room[-1]
        pool.load += 1
        if self._full(pool):
            self._room.pop()
        try:
            yield pool.client
        finally:
            full = self._full(pool)
            pool.load -= 1
            if full and not pool.closed:
                self._room.append(pool)

    def _full(self, pool: _Pool) -> bool:
        return self._size is not None and pool.load >= self._size

    async def aclose(self) -> None:
        """Close every client's connections."""
        pools, self._pools, self._room = self._pools, [], []
        for pool in pools:
            pool.closed = True
            await pool.client.aclose()
