"""tailrace: a durable, concurrent runtime for long-tailed agent workloads.

The public API is re-exported here; implementation lives in private modules.
"""

from ._codec import Codec as Codec
from ._codec import JsonCodec as JsonCodec
from ._context import NodeContext as NodeContext
from ._context import current_node as current_node
from ._errors import AlreadyAnswered as AlreadyAnswered
from ._errors import CorruptRecord as CorruptRecord
from ._errors import DuplicateRun as DuplicateRun
from ._errors import EncodeError as EncodeError
from ._errors import ExecutorLost as ExecutorLost
from ._errors import GraphError as GraphError
from ._errors import GraphMismatch as GraphMismatch
from ._errors import Incompatibility as Incompatibility
from ._errors import LeaseError as LeaseError
from ._errors import LeaseHeld as LeaseHeld
from ._errors import LeaseLapsed as LeaseLapsed
from ._errors import LeaseLost as LeaseLost
from ._errors import MapError as MapError
from ._errors import NotResumable as NotResumable
from ._errors import QuestionError as QuestionError
from ._errors import QuestionNotFound as QuestionNotFound
from ._errors import QueueNotEmpty as QueueNotEmpty
from ._errors import RouteError as RouteError
from ._errors import RunError as RunError
from ._errors import RunExists as RunExists
from ._errors import RunFailed as RunFailed
from ._errors import RunNotFound as RunNotFound
from ._errors import StaleVersion as StaleVersion
from ._errors import StallError as StallError
from ._errors import StoreError as StoreError
from ._errors import StreamLimit as StreamLimit
from ._errors import TailraceError as TailraceError
from ._errors import UnsupportedFormat as UnsupportedFormat
from ._events import Event as Event
from ._events import EventBus as EventBus
from ._events import EventType as EventType
from .core import AdmissionPolicy as AdmissionPolicy
from .core import Chunk as Chunk
from .core import ChunkKind as ChunkKind
from .core import Compatibility as Compatibility
from .core import Engine as Engine
from .core import Instrument as Instrument
from .core import Instruments as Instruments
from .core import LateInput as LateInput
from .core import MigrationReport as MigrationReport
from .core import MoveOutcome as MoveOutcome
from .core import NodeReport as NodeReport
from .core import NodeStatus as NodeStatus
from .core import RunCall as RunCall
from .core import RunMove as RunMove
from .core import RunResult as RunResult
from .core import run as run
from .gates import GateTimeout as GateTimeout
from .graph import EXIT as EXIT
from .graph import Edge as Edge
from .graph import Graph as Graph
from .graph import Node as Node
from .graph import NodeKind as NodeKind
from .graph import RetryPolicy as RetryPolicy
from .stores import QuestionRow as QuestionRow
from .stores import QuestionStatus as QuestionStatus
from .stores import Queue as Queue
from .workers import Schedule as Schedule
from .workers import Worker as Worker
from .workers import WorkerStats as WorkerStats

__version__ = "0.1.0"

__all__ = [
    "EXIT",
    "AdmissionPolicy",
    "AlreadyAnswered",
    "Chunk",
    "ChunkKind",
    "Codec",
    "Compatibility",
    "CorruptRecord",
    "DuplicateRun",
    "Edge",
    "EncodeError",
    "Engine",
    "Event",
    "EventBus",
    "EventType",
    "ExecutorLost",
    "GateTimeout",
    "Graph",
    "GraphError",
    "GraphMismatch",
    "Incompatibility",
    "Instrument",
    "Instruments",
    "JsonCodec",
    "LateInput",
    "LeaseError",
    "LeaseHeld",
    "LeaseLapsed",
    "LeaseLost",
    "MapError",
    "MigrationReport",
    "MoveOutcome",
    "Node",
    "NodeContext",
    "NodeKind",
    "NodeReport",
    "NodeStatus",
    "NotResumable",
    "QuestionError",
    "QuestionNotFound",
    "QuestionRow",
    "QuestionStatus",
    "Queue",
    "QueueNotEmpty",
    "RetryPolicy",
    "RouteError",
    "RunCall",
    "RunError",
    "RunExists",
    "RunFailed",
    "RunMove",
    "RunNotFound",
    "RunResult",
    "Schedule",
    "StaleVersion",
    "StallError",
    "StoreError",
    "StreamLimit",
    "TailraceError",
    "UnsupportedFormat",
    "Worker",
    "WorkerStats",
    "current_node",
    "run",
]
