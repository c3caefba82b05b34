"""Graphs: nodes, edges, builders, validation (G1), topology (G2), JSON form (G3), references.

The floor every other floor builds on; it imports nothing of tailrace but
``_errors``. The public names (``Graph``, ``Node``, ...) are re-exported by
:mod:`tailrace`; the others are for the floors above (the engine, the
executors, the dashboard, the command line).
"""

from ._codec import GRAPH_FORMAT as GRAPH_FORMAT
from ._graph import Graph as Graph
from ._graph import max_parks_of as max_parks_of
from ._node import EXIT as EXIT
from ._node import ITEM_ERRORS as ITEM_ERRORS
from ._node import LATE_POLICIES as LATE_POLICIES
from ._node import MAX_ITEMS as MAX_ITEMS
from ._node import MAX_PARKS as MAX_PARKS
from ._node import NODE_OPTIONS as NODE_OPTIONS
from ._node import Edge as Edge
from ._node import Handler as Handler
from ._node import Node as Node
from ._node import NodeKind as NodeKind
from ._node import RetryPolicy as RetryPolicy
from ._references import FILE_MODULE_PREFIX as FILE_MODULE_PREFIX
from ._references import callable_reference as callable_reference
from ._references import file_modules as file_modules
from ._references import guess_reference as guess_reference
from ._references import is_async_callable as is_async_callable
from ._references import is_file_reference as is_file_reference
from ._references import load_file_module as load_file_module
from ._references import resolve_reference as resolve_reference
from ._topology import OutEdge as OutEdge
from ._topology import Topology as Topology
from ._topology import graph_shape as graph_shape
from ._topology import shape_json as shape_json

__all__ = [
    "EXIT",
    "FILE_MODULE_PREFIX",
    "GRAPH_FORMAT",
    "ITEM_ERRORS",
    "LATE_POLICIES",
    "MAX_ITEMS",
    "MAX_PARKS",
    "NODE_OPTIONS",
    "Edge",
    "Graph",
    "Handler",
    "Node",
    "NodeKind",
    "OutEdge",
    "RetryPolicy",
    "Topology",
    "callable_reference",
    "file_modules",
    "graph_shape",
    "guess_reference",
    "is_async_callable",
    "is_file_reference",
    "load_file_module",
    "max_parks_of",
    "resolve_reference",
    "shape_json",
]
