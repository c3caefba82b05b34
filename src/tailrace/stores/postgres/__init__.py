"""The Postgres store (psycopg 3 and its pool); the facade imports it only when first used."""

import psycopg  # noqa: F401  # the postgres extra: without it, importing this package fails here

from ._store import PostgresStore as PostgresStore

__all__ = ["PostgresStore"]
