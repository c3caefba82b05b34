"""The scripted domains of these tests hold out a few tasks on purpose: their warning is expected.

``tests/evolve/test_hardening.py`` checks the warning itself with ``pytest.warns``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

from tailrace.evolve import HeldOutTooSmall


@pytest.fixture(autouse=True)
def _small_held_out_sets_are_deliberate() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=HeldOutTooSmall)
        yield
