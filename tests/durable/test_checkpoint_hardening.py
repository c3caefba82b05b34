"""Checkpoints at the edges of attempts (P1, P2): tries that are no longer current, hedges,
saves on the way out of a cancellation, and checkpoints a handler waits to be durable.

Each test runs on every store; the crash cases (a real process SIGKILLed) are in
``tests/faults/test_checkpoint_faults.py``.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import tailrace as tr
from tailrace import current_node
from tailrace.stores import RunStore
from tests import fixtures

each_store = fixtures.each_store
GUARD = fixtures.HANG_GUARD
