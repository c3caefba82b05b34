"""The SQLite store's session tokens (W7): lock files the kernel drops with the process.

The processes sharing a SQLite file share a host. A session's token is a
file in ``<database>-sessions/`` held with ``flock(LOCK_EX)`` for as long as
the session lasts: the kernel drops the lock the moment the process dies,
however it dies. A lock file rather than the process id: no process table is
read (``/proc`` or its absence), a pid reused by another process can never
pass for the dead one, and processes in other pid namespaces (containers
sharing the database's volume) see each other's locks as the database's own
locks do.

A watcher probes the next session's file with ``flock(LOCK_SH | LOCK_NB)``
every :data:`~tailrace.stores._presence.PROBE` seconds: a system call, no
database read. A session makes its file before its rows exist and, leaving,
removes its rows before its file (a session that could not remove its rows
leaves its file, unlocked, for the burier to remove). So a file missing for
a session that has rows is not proof of death but a file this process cannot
see (the database opened through a hard link, or a lock directory removed by
hand): that session is left to its leases. The directory is found from the
database's resolved path, so symbolic links and relative paths agree. Where ``fcntl`` is missing (Windows), sessions are refused
and leases stay the only way a dead worker's runs are found (D6).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from ..._errors import StoreError
from .._fork import forget, parent_only
from .._presence import PROBE, WAIT, Outlived

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


def sessions_dir(path: str) -> Path:
    """Where the lock files of the sessions on database ``path`` live: next to the file
    the path names once symbolic links and relative parts are resolved, so every
    process that opens the database through a path of its own finds the same ones."""
    return Path(f"{os.path.realpath(path)}-sessions")


class _Held:
    """A session's lock file, held open and locked."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self._path = path
        parent_only(fd)  # a forked child must not keep the session alive

    async def lost(self) -> str:
        await asyncio.Event().wait()  # the lock lasts as long as the process
        raise AssertionError("unreachable")  # pragma: no cover

    async def release(self, *, rows_left: bool) -> None:
        if not rows_left:  # else the burier finds it free, and removes it
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
        forget(self._fd)
        os.close(self._fd)


class FileTokens:
    """Sessions' lock files next to the SQLite database ``path``."""

    def __init__(self, path: str, where: str) -> None:
        self._dir = sessions_dir(path)
        self._where = where

    def _file(self, session: str) -> Path:
        return self._dir / f"{hashlib.sha256(session.encode()).hexdigest()[:32]}.lock"

    async def hold(self, session: str) -> _Held:
        if fcntl is None:  # pragma: no cover - not POSIX
            raise StoreError(f"{self._where}: sessions need fcntl (a POSIX system)")
        path = self._file(session)
        try:
            self._dir.mkdir(exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StoreError(f"{self._where}: cannot hold session {session!r}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise StoreError(f"{self._where}: session {session!r} is held: {exc}") from exc
        return _Held(fd, path)

    @contextlib.asynccontextmanager
    async def outlive(self, session: str) -> AsyncIterator[Outlived]:
        fd: int | None = None
        try:
            with self._mapped(f"watching session {session!r}"):
                fd, outlived = await self._wait(session)
            yield outlived
        finally:
            if fd is not None:
                os.close(fd)

    async def _wait(self, session: str) -> tuple[int | None, Outlived]:
        """Wait until ``session``'s lock file is free (then held shared on the fd returned),
        missing, or waited on for :data:`WAIT` seconds."""
        path = self._file(session)
        fd: int | None = None
        deadline = time.monotonic() + WAIT
        outlived = Outlived.FREE
        try:
            while True:
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY)
                    except FileNotFoundError:
                        # Made before the session's rows, removed after them: gone
                        # while they last, it is not where this process looks.
                        outlived = Outlived.UNSEEN
                        break
                if self._free(fd):
                    break
                if time.monotonic() > deadline:
                    outlived = Outlived.WAITED_OUT
                    break
                outlived = Outlived.ENDED  # held when first tried: it ends while watched
                await asyncio.sleep(PROBE)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return fd, outlived

    async def buried(self, session: str) -> None:
        """Remove the lock file of ``session``, which is buried."""
        where = f"removing the lock file of session {session!r}"
        with self._mapped(where), contextlib.suppress(FileNotFoundError):
            self._file(session).unlink()

    @contextlib.contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        """An ``OSError`` (a lock directory this process may not read) as a ``StoreError``."""
        try:
            yield
        except OSError as exc:
            raise StoreError(f"{self._where}: {what} in {self._dir}: {exc}") from exc

    async def grace(self, *, after_burial: bool) -> float:
        """None: a lock file's ``flock`` is never lost while its process lives."""
        return 0.0

    @staticmethod
    def _free(fd: int) -> bool:
        """Whether the lock on ``fd``'s file is free (then this process holds it shared)."""
        assert fcntl is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    async def close(self) -> None:
        """Nothing is held open between two watches."""
