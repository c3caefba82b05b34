"""Where ``sqlite3`` errors become ours: the SQLite store's one mapping (CONVENTIONS 3).

Every site that turns a driver error into a tailrace error goes through
:func:`mapped_errors` (or :func:`store_error`, for the writer thread, which
hands errors to callers' futures instead of raising them). The message starts
with what the call was about (``run 'r1'``, ``SQLite store 'x.db'``), so an
operator sees which run or file failed, and the driver's error is the cause.
Errors of our own (``LeaseLost``, ``RunExists``, ...) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

from ..._errors import StoreError


def store_error(exc: BaseException, context: str, doing: str = "") -> StoreError:
    """``StoreError("{context}: {doing}{exc}")`` caused by ``exc``."""
    error = StoreError(f"{context}: {doing}{exc}")
    error.__cause__ = exc
    return error


def mapped(exc: Exception, context: str) -> Exception:
    """``exc`` as the caller should see it: a driver error mapped, any other unchanged."""
    return store_error(exc, context) if isinstance(exc, sqlite3.Error) else exc


@contextlib.contextmanager
def mapped_errors(context: str, doing: str = "") -> Iterator[None]:
    """Raise a ``sqlite3.Error`` from the block as :func:`store_error` ``from`` it."""
    try:
        yield
    except sqlite3.Error as exc:
        raise store_error(exc, context, doing) from exc
