"""The store contract suite's fixture, ``backend``, parametrised over every store (huey-style).

Defined in :mod:`tests.fixtures`; registered here for ``tests/stores/``.
"""

from tests.fixtures import backend as backend
from tests.fixtures import pg_backend as pg_backend
from tests.fixtures import store as store
