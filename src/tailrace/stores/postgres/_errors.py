"""Where ``psycopg`` errors become ours: the Postgres store's one mapping (CONVENTIONS 3).

A call's transaction is re-run after a :func:`transient` failure (see
``_connections``); any other driver error is a :func:`refusal`: a
``ValueError`` naming the text Postgres could not store, or a
:class:`~tailrace.StoreError` whose message starts with what the call was
about (``run 'r1'``, ``question 'q1'``). Opening and closing map their errors
with :func:`mapped_errors`. The driver's error is always the cause; errors of
our own pass through unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import psycopg
import psycopg_pool

from ..._errors import StoreError
from .._sql._base import Texts

#: SQLSTATEs (besides class 08, connection exceptions) after which re-running the
#: whole transaction on a fresh connection is right: admin shutdown, crash
#: shutdown, "cannot connect now", serialization failure, deadlock, and a statement
#: cancelled by `statement_timeout` (its transaction was rolled back: a lock held
#: elsewhere outlasted it, and may be gone on the next attempt).
_RETRIED_SQLSTATES = frozenset({"57014", "57P01", "57P02", "57P03", "40001", "40P01"})


class InDoubt(Exception):
    """An earlier attempt's transaction is still in progress on the server: ask again later."""


@contextlib.contextmanager
def mapped_errors(context: str, doing: str = "") -> Iterator[None]:
    """Raise a ``psycopg.Error`` from the block as ``StoreError("{context}: {doing}{exc}")`` from it."""
    try:
        yield
    except psycopg.Error as exc:
        raise StoreError(f"{context}: {doing}{exc}") from exc


def transient(exc: BaseException) -> bool:
    """Whether re-running the whole transaction on a fresh connection may succeed after ``exc``.

    Connection exceptions (no SQLSTATE: the client lost the connection; or
    class 08), a shutting-down or starting-up server, serialization failures
    and deadlocks. Not a pool that is closed or has too many waiters, nor an
    error in the statement or the data.
    """
    if isinstance(exc, InDoubt):
        return True
    if isinstance(exc, psycopg_pool.PoolClosed | psycopg_pool.TooManyRequests):
        return False
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _RETRIED_SQLSTATES


def refusal(context: str, exc: BaseException, texts: Texts | None) -> Exception:
    """Our error for ``exc``, a failure a retry cannot cure; a refused text is named."""
    text_refused = isinstance(exc, UnicodeEncodeError) or (
        isinstance(exc, psycopg.DataError) and "NUL" in str(exc)
    )
    if text_refused:
        problem = bad_text(texts() if texts is not None else ())
        if problem is not None:
            return ValueError(f"{context}: {problem}; nothing was written")
        return ValueError(
            f"{context}: Postgres cannot store this text ({exc}); nothing was written"
        )
    return StoreError(f"{context}: {exc}")


def bad_text(texts: Iterable[tuple[str, str | None]]) -> str | None:
    """What is wrong with the first of ``texts`` Postgres cannot store as text, naming it."""
    for field, value in texts:
        if value is None:
            continue
        if "\x00" in value:
            at = value.index("\x00")
            return f"{field} contains a NUL character (\\x00) at {at}, which Postgres cannot store"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (
                f"{field} contains a lone surrogate {value[exc.start]!r} at {exc.start}, "
                "which is not valid Unicode"
            )
    return None
