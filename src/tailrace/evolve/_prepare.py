"""Starting an evolution: validate and split the tasks, open the ledger, score the head.

Both loops begin with :func:`prepare` and end with :meth:`Evolution.close`
(and closing the store :func:`prepare` made, if it made one).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from ..core import Engine
from ..executors import Executor
from ..graph import Graph
from ..stores import MemoryStore, RunStore
from ._audit import AuditScheduler
from ._core import Evolution
from ._ledger import Ledger
from ._model import (
    MIN_HELD_OUT,
    Artifact,
    HeldOutTooSmall,
    ProposeFn,
    RewardFn,
    RunFn,
    Task,
    split_tasks,
)
from ._options import Settings


async def prepare(
    tasks: Sequence[Task],
    reward: RewardFn,
    *,
    run: RunFn | Graph,
    propose: ProposeFn,
    artifact: Artifact | Mapping[str, str] | None,
    store: RunStore | None,
    artifact_id: str,
    settings: Settings,
    audit: AuditScheduler | None,
    engine: Engine | None,
    executor: Executor | None = None,
) -> tuple[Evolution, RunStore | None]:
    """Validate, split, open the ledger and score the head; returns the evolution and a store to close.

    The evolution's usage meter is installed in the caller's context (so the
    initial scoring is metered too); :meth:`Evolution.close` removes it.
    """
    train, held_out = split_tasks(tasks, settings.held_out_frac, settings.shuffle_seed)
    if len(held_out) < MIN_HELD_OUT:
        warnings.warn(
            f"the held-out set has {len(held_out)} tasks, fewer than the minimum of "
            f"{MIN_HELD_OUT}: its verdicts mean little (add tasks or raise held_out_frac)",
            HeldOutTooSmall,
            stacklevel=3,
        )
    template = artifact if isinstance(artifact, Artifact) else Artifact(entries=artifact or {})
    owned: RunStore | None = None
    if store is None:
        store = owned = MemoryStore()
    await store.open()
    evolution: Evolution | None = None
    try:
        evolution = Evolution(
            train=train,
            held_out=held_out,
            reward=reward,
            run=run,
            propose=propose,
            ledger=Ledger(store, artifact_id, template),
            settings=settings,
            audit=audit if audit is not None else AuditScheduler(),
            engine=engine,
            executor=executor,
        )
        evolution.install()
        await evolution.start()
    except BaseException:
        if evolution is not None:
            evolution.close()
        if owned is not None:
            await owned.close()
        raise
    return evolution, owned
