"""Makes ``tests/_stores.py`` importable as ``_stores`` in every test module.

``tests/`` is not a package and the suite imports in ``importlib`` mode, so a
test module cannot import a file beside it; pytest imports this conftest
before any test module below it, and registers the shared helpers here once.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if "_stores" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "_stores", Path(__file__).with_name("_stores.py")
    )
    assert _spec is not None and _spec.loader is not None
    sys.modules["_stores"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["_stores"])
