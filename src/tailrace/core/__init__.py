"""Driving runs: the engine, the run loop and its collaborators (like trio's ``_core``).

This floor never imports the floors above it (gates, workers, the dashboard,
evolution, integrations, the command line); they import what they need from
here. The public names are re-exported by :mod:`tailrace`.
"""

from ._admission import AdmissionPolicy as AdmissionPolicy
from ._children import tree_questions as tree_questions
from ._engine import Engine as Engine
from ._engine import cancel_undriven as cancel_undriven
from ._engine import run as run
from ._instruments import Instrument as Instrument
from ._instruments import Instruments as Instruments
from ._instruments import RunCall as RunCall
from ._lease import acquire_lease as acquire_lease
from ._lease import make_owner as make_owner
from ._lease import mark_failed as mark_failed
from ._lease import owner_is_dead as owner_is_dead
from ._outcome import NodeReport as NodeReport
from ._outcome import RunResult as RunResult
from ._restore import find_graph as find_graph
from ._state import LateInput as LateInput
from ._state import NodeStatus as NodeStatus
from ._streams import MAX_STREAM_CHUNKS as MAX_STREAM_CHUNKS
from ._streams import Chunk as Chunk
from ._streams import ChunkKind as ChunkKind
from ._streams import StreamBound as StreamBound
from ._streams import StreamCursor as StreamCursor
from ._streams import StreamTags as StreamTags
from ._stretches import Stretch as Stretch
from ._stretches import stretches_of as stretches_of
from ._versions import Compatibility as Compatibility
from ._versions import MigrationReport as MigrationReport
from ._versions import MoveOutcome as MoveOutcome
from ._versions import RunMove as RunMove
from ._versions import check_stored as check_stored

__all__ = [
    "MAX_STREAM_CHUNKS",
    "AdmissionPolicy",
    "Chunk",
    "ChunkKind",
    "Compatibility",
    "Engine",
    "Instrument",
    "Instruments",
    "LateInput",
    "MigrationReport",
    "MoveOutcome",
    "NodeReport",
    "NodeStatus",
    "RunCall",
    "RunMove",
    "RunResult",
    "StreamBound",
    "StreamCursor",
    "StreamTags",
    "Stretch",
    "acquire_lease",
    "cancel_undriven",
    "check_stored",
    "find_graph",
    "make_owner",
    "mark_failed",
    "owner_is_dead",
    "run",
    "stretches_of",
    "tree_questions",
]
