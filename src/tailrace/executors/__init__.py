"""Where a handler attempt runs: in the driving process (default) or on Ray.

The seam and its contract are in :mod:`tailrace.executors._base`
(:class:`Executor`); :class:`RayExecutor` needs the ``ray`` extra
(``pip install 'tailrace[ray]'``) and imports Ray only when it connects.
"""

from ._base import AttemptContext as AttemptContext
from ._base import Executor as Executor
from ._base import LocalExecutor as LocalExecutor

__all__ = ["AttemptContext", "Executor", "LocalExecutor"]
