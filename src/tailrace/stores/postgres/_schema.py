"""Postgres schema: version checks and numbered migrations under an advisory lock (D4)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import psycopg
from psycopg import sql

from ..._errors import StoreError, UnsupportedFormat
from .._sql._statements import CREATE_MIGRATIONS_TABLE, MIGRATIONS, SCHEMA_VERSION

#: First key of the advisory lock that serialises migrations ("tr").
_MIGRATION_LOCK = 0x7472


@dataclasses.dataclass(frozen=True, slots=True)
class PostgresSchema:
    """Opening a schema: read its version, migrate only when needed, never when read-only.

    ``name`` is the schema; ``where`` names the store in error messages.
    """

    name: str
    read_only: bool
    where: str

    async def prepare(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Check the schema version; migrate only when needed, and never when read-only (D4)."""
        current = await self._recorded_version(conn)
        if current is not None and current > SCHEMA_VERSION:
            raise self._newer_schema(current)
        if self.read_only:
            if current is None:
                raise StoreError(
                    f"{self.where}: no tailrace tables in this database and schema "
                    "(opened read-only, so none were created)"
                )
            if current < SCHEMA_VERSION:
                raise StoreError(
                    f"{self.where}: schema version {current} is older than this tailrace's "
                    f"({SCHEMA_VERSION}); open it once without read_only to migrate it"
                )
            return
        if current != SCHEMA_VERSION:
            await self._migrate(conn)

    def _newer_schema(self, current: int) -> UnsupportedFormat:
        return UnsupportedFormat(
            f"{self.where}: database schema version {current} is newer than this tailrace "
            f"supports ({SCHEMA_VERSION}); upgrade tailrace. Nothing was written."
        )

    async def _migrate(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Apply pending migrations in one transaction, under an advisory lock (D4)."""
        async with conn.transaction():
            await conn.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (_MIGRATION_LOCK, self.name)
            )
            current = await self._recorded_version(conn)  # again: another process may have won
            if current is not None and current > SCHEMA_VERSION:
                raise self._newer_schema(current)
            if current is None:
                await self._create_schema(conn)
                await conn.execute(CREATE_MIGRATIONS_TABLE)
                current = 0
            for version, statements in MIGRATIONS:
                if version > current:
                    for statement in statements:
                        await conn.execute(statement)
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, applied_at) VALUES (%s, %s)",
                        (version, time.time()),
                    )

    async def _recorded_version(self, conn: psycopg.AsyncConnection[Any]) -> int | None:
        cur = await conn.execute(
            "SELECT 1 FROM pg_tables WHERE schemaname = %s AND tablename = 'schema_migrations'",
            (self.name,),
        )
        if await cur.fetchone() is None:
            return None
        cur = await conn.execute("SELECT MAX(version) FROM schema_migrations")
        row = await cur.fetchone()
        return int(row[0]) if row is not None and row[0] is not None else 0

    async def _create_schema(self, conn: psycopg.AsyncConnection[Any]) -> None:
        cur = await conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (self.name,))
        if await cur.fetchone() is None:  # CREATE needs a privilege an existing schema does not
            await conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(self.name)))
