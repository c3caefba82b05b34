"""The Postgres store's session tokens (W7): advisory locks the server drops with the connection.

A session's token is a session-level advisory lock on a 64-bit key made of
the schema and the session id, held by a connection of its own that does
nothing else: the server releases it the moment that connection ends (a
SIGKILLed process's sockets are closed by its kernel; a terminated backend;
a restart). The holder waits on the connection's socket (``notifies()``
with nothing listened to), so it learns at once when the server ended it.

A watcher waits for the next session's lock in ``SHARE`` mode on a
connection of its own: a blocking ``pg_advisory_lock_shared`` that the
server grants when the holder's connection ends, and that costs nothing
while it waits (no transaction ends, no row is read). It holds no lock of
its own while it waits: the holders never wait, so the waits can never form
a cycle. A waiting statement holds a snapshot, which holds back what vacuum
may remove: ``lock_timeout`` ends a wait after ``WAIT`` seconds (an aborted
statement, then the wait again), and ``client_connection_check_interval``
(Postgres 14 and newer) lets the server end the wait of a watcher that died.

Both connections ask for TCP keepalives and a TCP user timeout, on the
client (unless the DSN sets them) and on the server: a path that dies under
an idle holder (a NAT that forgets it) ends the connection on both ends
within seconds, so the holder learns it and takes its session back, and a
watcher's wait is bounded past its ``lock_timeout`` in case no answer ever
comes.

A session taken back after its connection ended may find its lock still
held by the server's end of that connection, when the server has not yet
seen it gone (a network cut): that backend is ours, so it is terminated.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable

import psycopg

from ..._errors import StoreError
from .._fork import forget, parent_only
from .._presence import GRACE, WAIT, Outlived, finish, ring_change
from ._connections import Conn, one_line

#: First key of the transaction-level advisory lock that makes joins and burials of
#: the ring of sessions take turns ("tw").
RING_LOCK = 0x7477
#: Seconds past ``lock_timeout`` a watcher waits for the server's answer before it takes
#: its connection for dead (the server's keepalives may not reach a half-open socket).
_SILENCE = 15.0
#: Seconds a session taken back waits for its old connection's lock to be dropped.
RETAKE = 10.0
#: A lock held by another backend, as ``pg_locks`` shows a 64-bit advisory key.
OUR_OLD_BACKEND = (
    "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
    "AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
    "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 1 "
    "AND mode = 'ExclusiveLock' AND granted AND pid <> pg_backend_pid()"
)
#: Seconds since the server started.
UPTIME = "SELECT extract(epoch FROM clock_timestamp() - pg_postmaster_start_time())::float8"
#: Settings a holder's and a watcher's connections keep, whatever the role's defaults
#: are (an idle session timeout would end a holder's session, a statement timeout a wait).
_SETTINGS = (
    ("statement_timeout", "0"),
    ("idle_in_transaction_session_timeout", "0"),
    ("idle_session_timeout", "0"),  # Postgres 14 and newer
    # The server's side of a dead path: its backend (and the lock) ends within seconds.
    ("tcp_keepalives_idle", "10"),
    ("tcp_keepalives_interval", "5"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "30000"),  # Postgres 12 and newer
)
_WATCHING = (
    ("lock_timeout", f"{int(WAIT * 1000)}"),
    ("client_connection_check_interval", "10000"),  # Postgres 14 and newer
)

__all__ = ["RING_LOCK", "PostgresTokens", "lock_ring", "ring_change", "session_key"]


def session_key(schema: str, session: str) -> int:
    """The advisory lock key of ``session`` in ``schema``'s store: 64 bits, signed."""
    digest = hashlib.sha256(f"tailrace\0{schema}\0{session}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


async def lock_ring(conn: Conn, schema: str) -> None:
    """Take the ring's turn for this transaction (joins and burials, see ``Tx.lock_ring``)."""
    await conn.execute("SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (RING_LOCK, schema))


async def _settle(conn: Conn, settings: tuple[tuple[str, str], ...]) -> None:
    for name, value in settings:
        with contextlib.suppress(psycopg.errors.UndefinedObject):  # an older server's lack
            await conn.execute("SELECT set_config(%s, %s, false)", (name, value))


async def _close(conn: Conn) -> None:
    with contextlib.suppress(psycopg.Error):
        await conn.close()


class _Held:
    """A session's lock, held by ``conn``."""

    def __init__(self, conn: Conn) -> None:
        self._conn = conn
        self._fd = conn.pgconn.socket
        parent_only(self._fd)  # a forked child must not keep the session alive

    async def lost(self) -> str:
        try:
            async for _ in self._conn.notifies():
                pass  # nothing is listened to: the wait ends only with the connection
        except psycopg.Error as exc:
            return one_line(exc)
        finally:
            forget(self._fd)  # the driver closes it: the number may soon name another
        return "the connection ended"

    async def release(self, *, rows_left: bool) -> None:
        forget(self._fd)
        with contextlib.suppress(psycopg.Error):
            await self._conn.close()  # the server drops the lock with the session


class PostgresTokens:
    """Sessions' advisory locks on ``connect``'s connections to ``schema``."""

    def __init__(self, connect: Callable[[], Awaitable[Conn]], schema: str, where: str) -> None:
        self._connect = connect
        self._schema = schema
        self._where = where
        self._watcher: Conn | None = None
        #: A wait was cut short: a lock may have been granted as it was cancelled.
        self._unsure = False
        #: The session whose wait last ran out, and on which connection: waited for again
        #: at once (no look first: one aborted statement a ``WAIT``, no commit).
        self._waited_out: tuple[str, Conn] | None = None

    async def _connection(self, what: str, settings: tuple[tuple[str, str], ...]) -> Conn:
        try:
            conn = await self._connect()
        except psycopg.Error as exc:
            raise StoreError(f"{self._where}: {what}: {one_line(exc)}") from exc
        try:
            await _settle(conn, settings)
        except BaseException as exc:  # a cancellation too: nothing is left open
            await finish(_close(conn))
            if isinstance(exc, psycopg.Error):
                raise StoreError(f"{self._where}: {what}: {one_line(exc)}") from exc
            raise
        return conn

    async def hold(self, session: str) -> _Held:
        conn = await self._connection(f"holding session {session!r}", _SETTINGS)
        try:
            if await self._take(conn, session_key(self._schema, session)):
                return _Held(conn)
        except BaseException as exc:  # a cancellation too: the lock may be held already
            await finish(_close(conn))
            if isinstance(exc, psycopg.Error):
                where = f"{self._where}: holding session {session!r}"
                raise StoreError(f"{where}: {one_line(exc)}") from exc
            raise
        await finish(_close(conn))
        raise StoreError(f"{self._where}: session {session!r} is held elsewhere after {RETAKE:g} s")

    @staticmethod
    async def _take(conn: Conn, key: int) -> bool:
        """Take the lock ``key`` on ``conn`` within :data:`RETAKE` seconds: whether it did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RETAKE
        while True:
            cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
            row = await cur.fetchone()
            if row is not None and row[0]:
                return True
            if loop.time() > deadline:
                return False
            # Held by the server's end of our own lost connection (or by a watcher
            # burying it for a moment): end the former, wait for the latter.
            await conn.execute(OUR_OLD_BACKEND, ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF))
            await asyncio.sleep(0.1)

    @contextlib.asynccontextmanager
    async def outlive(self, session: str) -> AsyncIterator[Outlived]:
        key = session_key(self._schema, session)
        conn = await self._watching()
        try:
            if self._unsure:
                await conn.execute("SELECT pg_advisory_unlock_all()")
                self._unsure = False
            again, self._waited_out = self._waited_out == (session, conn), None
            free = False
            # A wait that ran out on this connection is made again at once, without a
            # look: the lock was held a moment ago, so a grant now ends it while watched.
            if not again:
                cur = await conn.execute("SELECT pg_try_advisory_lock_shared(%s)", (key,))
                row = await cur.fetchone()
                free = row is not None and bool(row[0])
            outlived = Outlived.FREE
            if not free:
                # Bounded here too: a socket whose path died answers nothing, ever.
                async with asyncio.timeout(WAIT + _SILENCE):
                    await conn.execute("SELECT pg_advisory_lock_shared(%s)", (key,))
                outlived = Outlived.ENDED
        except psycopg.errors.LockNotAvailable:
            outlived = Outlived.WAITED_OUT  # lock_timeout: the watcher waits again
            self._waited_out = (session, conn)
        except TimeoutError as exc:  # the server never said its lock_timeout ran out
            await self.close()  # whatever it granted goes with the connection
            where = f"{self._where}: watching session {session!r}"
            raise StoreError(f"{where}: no answer in {WAIT + _SILENCE:g} s") from exc
        except asyncio.CancelledError:
            self._unsure = True
            raise
        except psycopg.Error as exc:
            await self.close()
            where = f"{self._where}: watching session {session!r}"
            raise StoreError(f"{where}: {one_line(exc)}") from exc
        try:
            yield outlived
        finally:
            if outlived is not Outlived.WAITED_OUT:
                try:
                    await conn.execute("SELECT pg_advisory_unlock_shared(%s)", (key,))
                except psycopg.Error:
                    await self.close()  # the lock goes with the connection
                except asyncio.CancelledError:
                    self._unsure = True  # the unlock may not have run: all go next time
                    raise

    async def buried(self, session: str) -> None:
        """Nothing is left of a session's lock once its connection ended."""

    async def grace(self, *, after_burial: bool) -> float:
        """:data:`GRACE`, for a session whose lock was lost with every other one (a server
        restart) to take it back; none for one found free right after the session before
        it was buried, unless the server started less than :data:`GRACE` seconds ago
        (a restart drops the watcher's connection too: the burial before it then already
        waited out a grace, or the server is that young)."""
        if not after_burial:
            return GRACE
        conn = await self._watching()
        try:
            cur = await conn.execute(UPTIME)
            row = await cur.fetchone()
        except psycopg.Error as exc:
            await self.close()
            raise StoreError(f"{self._where}: reading the server's start: {one_line(exc)}") from exc
        uptime = float(row[0]) if row is not None and row[0] is not None else 0.0
        return max(0.0, GRACE - uptime)

    async def _watching(self) -> Conn:
        if self._watcher is None or self._watcher.closed:
            self._watcher = await self._connection("watching the ring", _SETTINGS + _WATCHING)
        return self._watcher

    async def close(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            with contextlib.suppress(psycopg.Error):
                await watcher.close()
