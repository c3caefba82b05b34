"""The in-memory store: every rule of the contract under one lock."""

from ._store import MemoryStore as MemoryStore

__all__ = ["MemoryStore"]
