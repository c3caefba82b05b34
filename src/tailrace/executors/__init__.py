"""Where a handler attempt runs: in the driving process (default) or on Ray.

The seam and its contract are in :mod:`tailrace.executors._base`
(:class:`Executor`). :class:`RayExecutor` needs the ``ray`` extra
(``pip install 'tailrace[ray]'``) and imports Ray only when it connects.
A worker lost mid-attempt raises :class:`ExecutorLost`, which the node's
``RetryPolicy`` retries like any failed try.
"""

from .._errors import ExecutorLost as ExecutorLost
from ._base import AttemptContext as AttemptContext
from ._base import Executor as Executor
from ._base import LocalExecutor as LocalExecutor
from ._ray import RayExecutor as RayExecutor

__all__ = ["AttemptContext", "Executor", "ExecutorLost", "LocalExecutor", "RayExecutor"]
