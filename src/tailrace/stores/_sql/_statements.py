"""Schema, migrations and SQL shared by the SQLite and Postgres stores.

Written once in the common dialect: ``?`` placeholders (Postgres swaps in
``%s``), and a ``/*WITHOUT ROWID*/`` comment that SQLite turns into the clause.
The question compare-and-sets are single ``UPDATE ... WHERE`` statements whose
conditions mirror :func:`~tailrace.stores._rules.can_apply` and
:func:`~tailrace.stores._rules.can_supersede`, so the database itself decides
which of several racing writers wins (Q2, Q3). Artifact commits insert the
next version under the ``artifact_versions`` primary key, which decides alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .._records import (
    TERMINAL_STATUSES,
    ArtifactVersion,
    ChunkRow,
    EventRow,
    Harvest,
    NewRun,
    QuestionRow,
    QuestionStatus,
    RunRecord,
    RunStatus,
    Submission,
)
from .._rules import EMPTY_STATE_JSON, parse_question_status, parse_status, printable_text

# --- runs, node states, results, frozen inputs, events --------------------------

RUN_FIELDS = (
    "run_id", "graph_name", "graph_ref", "fingerprint", "status", "input_json", "state_json",
    "error", "created_at", "updated_at", "finished_at", "nodes_done", "lease_owner",
    "lease_expires", "lease_token", "format_version", "queue_name", "priority", "partition_key",
    "dedup_key", "cost", "estimate", "queued_at", "started_at", "cancel_requested_at",
    "forked_from", "forked_at", "recoveries", "not_before", "parent_run_id", "deadline",
)  # fmt: skip
RUN_COLUMNS = ", ".join(RUN_FIELDS)
EVENT_FIELDS = ("seq", "type", "node_id", "visit", "attempt", "ts", "data_json")
EVENT_COLUMNS = ", ".join(EVENT_FIELDS)

#: Where a run comes from: a fork's origin (V4), a child's parent (R1), its deadline (R6).
_ORIGIN_FIELDS = ("forked_from", "forked_at", "parent_run_id", "deadline")
#: The columns a run is created with: those of migration 1, its queue (an inline child
#: of a run on a queue, R4) and its origin (others default).
_CREATED_FIELDS = (
    *RUN_FIELDS[: RUN_FIELDS.index("format_version") + 1],
    "queue_name",
    *_ORIGIN_FIELDS,
)
#: The columns of a run submitted to a queue: those of migration 5, its recoveries
#: (W3), when it may start (W4) and its origin.
_QUEUED_FIELDS = (
    *RUN_FIELDS[: RUN_FIELDS.index("cancel_requested_at") + 1],
    "recoveries",
    "not_before",
    *_ORIGIN_FIELDS,
)
#: A new run (``_rules.new_run_record`` is the row it writes, queued or not).
INSERT_RUN = (
    f"INSERT INTO runs ({', '.join(_CREATED_FIELDS)}) "
    f"VALUES ({', '.join('?' * len(_CREATED_FIELDS))})"
)
#: A run submitted to a queue (migration 5 added the queue's columns).
INSERT_QUEUED_RUN = (
    f"INSERT INTO runs ({', '.join(_QUEUED_FIELDS)}) "
    f"VALUES ({', '.join('?' * len(_QUEUED_FIELDS))})"
)
UPSERT_NODE = (
    "INSERT INTO node_states (run_id, node_id, status, visits, data_json) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id, node_id) DO UPDATE SET status = excluded.status, "
    "visits = excluded.visits, data_json = excluded.data_json"
)
INSERT_RESULT = "INSERT INTO results (run_id, node_id, visit, value_json) VALUES (?, ?, ?, ?)"
INSERT_FROZEN = (
    "INSERT INTO frozen_inputs (run_id, node_id, activation, payload_json) VALUES (?, ?, ?, ?)"
)
ITEM_FIELDS = (
    "node_id", "visit", "item", "status", "seq", "attempts", "value_json", "error", "retry_due",
)  # fmt: skip
ITEM_COLUMNS = ", ".join(ITEM_FIELDS)
UPSERT_ITEM = (
    f"INSERT INTO map_items (run_id, {ITEM_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id, node_id, visit, item) DO UPDATE SET status = excluded.status, "
    "seq = excluded.seq, attempts = excluded.attempts, value_json = excluded.value_json, "
    "error = excluded.error, retry_due = excluded.retry_due"
)
CHECKPOINT_FIELDS = ("node_id", "visit", "item", "attempt", "value_json", "saved_at")
CHECKPOINT_COLUMNS = ", ".join(CHECKPOINT_FIELDS)
UPSERT_CHECKPOINT = (
    f"INSERT INTO checkpoints (run_id, {CHECKPOINT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (run_id, node_id, visit, item) DO UPDATE SET attempt = excluded.attempt, "
    "value_json = excluded.value_json, saved_at = excluded.saved_at"
)
SELECT_CHECKPOINTS = (
    f"SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE run_id = ? ORDER BY node_id, visit, item"
)
PARKED_FIELDS = (
    "park_id", "graph_name", "node_id", "run_id", "visit", "item", "value_json",
    "checkpoint_json", "parked_at", "status", "claimed_by", "claimed_at", "parks",
)  # fmt: skip
PARKED_COLUMNS = ", ".join(PARKED_FIELDS)
#: A row parked again (its attempt saved on its way out) updates the checkpoint while unclaimed.
INSERT_PARKED = (
    f"INSERT INTO parked_items ({PARKED_COLUMNS}) VALUES ({', '.join('?' * len(PARKED_FIELDS))}) "
    "ON CONFLICT (park_id) DO UPDATE SET checkpoint_json = excluded.checkpoint_json "
    "WHERE parked_items.status = 'parked'"
)
SELECT_PARKED = f"SELECT {PARKED_COLUMNS} FROM parked_items"
#: P4: claim up to ``limit`` parked items of a node (oldest first) for one map
#: visit; a row another claimer took meanwhile no longer matches ``status =
#: 'parked'``, and Postgres skips rows another claimer holds locked (``/*SKIP
#: LOCKED*/``). The rows are picked once, in a CTE: a locking subquery in the
#: UPDATE's WHERE is run again per row on Postgres, which ignored the LIMIT.
#: Values: graph_name, node_id, limit, claimed_by, claimed_at.
CLAIM_PARKED = (
    "WITH picked AS (SELECT park_id FROM parked_items "
    "WHERE graph_name = ? AND node_id = ? AND status = 'parked' "
    "ORDER BY parked_at, park_id LIMIT ? /*SKIP LOCKED*/) "
    "UPDATE parked_items SET status = 'claimed', claimed_by = ?, claimed_at = ? "
    "WHERE status = 'parked' AND park_id IN (SELECT park_id FROM picked)"
)
#: P4: a claimed item goes back to ``parked`` (its place in parked order is its
#: ``parked_at``, unchanged), if ``claimant`` still holds it.
UNCLAIM_PARKED = (
    "UPDATE parked_items SET status = 'parked', claimed_by = NULL, claimed_at = NULL "
    "WHERE park_id = ? AND claimed_by = ? AND status = 'claimed'"
)
DROP_PARKED = "UPDATE parked_items SET status = 'dropped' WHERE park_id = ? AND status = 'parked'"
SELECT_ITEMS = (
    f"SELECT {ITEM_COLUMNS} FROM map_items WHERE run_id = ? ORDER BY node_id, visit, item"
)
INSERT_EVENT = f"INSERT INTO events (run_id, {EVENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
CHUNK_FIELDS = (
    "seq", "stream", "node_id", "visit", "item", "attempt", "hedge", "kind", "data_json", "ts",
)  # fmt: skip
CHUNK_COLUMNS = ", ".join(CHUNK_FIELDS)
INSERT_CHUNK = (
    f"INSERT INTO stream_chunks (run_id, {CHUNK_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
#: Values: run_id, after, limit: a run's stream rows past a cursor, in order (S3).
SELECT_CHUNKS = (
    f"SELECT {CHUNK_COLUMNS} FROM stream_chunks WHERE run_id = ? AND seq > ? ORDER BY seq LIMIT ?"
)
#: Values: run_id, limit, run_id, run_id, chars. The tail of each of the run's first
#: ``limit`` streams, then how many chunks its stream holds: the rows that what follows
#: them in their stream holds at most ``chars`` characters of (``_rules.stream_tails``).
#: Only seq, stream, kind and lengths are windowed; the rows kept are read by key.
SELECT_STREAM_TAILS = (
    "WITH firsts AS (SELECT DISTINCT stream FROM stream_chunks WHERE run_id = ? "
    "ORDER BY stream LIMIT ?), sized AS (SELECT seq, SUM(COALESCE(LENGTH(data_json), 0)) "
    "OVER (PARTITION BY stream ORDER BY seq DESC ROWS BETWEEN UNBOUNDED PRECEDING "
    "AND 1 PRECEDING) AS later, SUM(CASE WHEN kind = 'chunk' THEN 1 ELSE 0 END) "
    "OVER (PARTITION BY stream) AS chunks FROM stream_chunks "
    "WHERE run_id = ? AND stream IN (SELECT stream FROM firsts)) "
    f"SELECT {', '.join('c.' + f for f in CHUNK_FIELDS)}, s.chunks FROM sized s "
    "JOIN stream_chunks c ON c.run_id = ? AND c.seq = s.seq "
    "WHERE COALESCE(s.later, 0) <= ? ORDER BY c.seq"
)
#: Values: run_id. One row: the run's last stream row seq, 0 when it has none.
LAST_CHUNK_SEQ = "SELECT COALESCE(MAX(seq), 0) FROM stream_chunks WHERE run_id = ?"
#: Values: run_id. The first chunk of each of the run's streams with no terminal mark (S2).
SELECT_OPEN_STREAMS = (
    f"SELECT {CHUNK_COLUMNS} FROM stream_chunks c WHERE c.run_id = ? AND c.seq = c.stream "
    "AND NOT EXISTS (SELECT 1 FROM stream_chunks m WHERE m.run_id = c.run_id "
    "AND m.stream = c.stream AND m.kind <> 'chunk') ORDER BY c.seq"
)
#: Values: finished_before. The stream rows of runs that ended before a time (retention).
PRUNE_STREAMS = (
    "DELETE FROM stream_chunks WHERE run_id IN (SELECT run_id FROM runs "
    "WHERE status IN ('completed', 'failed', 'cancelled') AND finished_at IS NOT NULL "
    "AND finished_at < ?)"
)
#: A harvest applied to its run; the two flags (both whether the harvest ends the run) let
#: go of its lease in the same write (a run's end needs no release of its own).
#: ``_rules.committed_record`` is the same decision.
UPDATE_RUN = (
    "UPDATE runs SET state_json = ?, status = ?, error = ?, updated_at = ?, "
    "finished_at = COALESCE(?, finished_at), nodes_done = nodes_done + ?, output_json = ?, "
    "lease_owner = CASE WHEN ? THEN NULL ELSE lease_owner END, "
    "lease_expires = CASE WHEN ? THEN NULL ELSE lease_expires END "
    "WHERE run_id = ?"
)
#: Values: the run ids. The stored outputs of those that completed with one (R1).
SELECT_OUTPUTS = (
    "SELECT run_id, output_json FROM runs WHERE run_id IN ({ids}) "
    "AND status = 'completed' AND output_json IS NOT NULL"
)
#: Values: now, limit. Running runs nobody holds (``_rules.lease_lapsed``).
EXPIRED_LEASES = (
    "SELECT run_id FROM runs WHERE status = 'running' AND (lease_owner IS NULL "
    "OR lease_expires IS NULL OR lease_expires < ?) "
    "ORDER BY COALESCE(lease_expires, 0), run_id LIMIT ?"
)

#: Marks a migration statement only Postgres runs (SQLite has nothing like it).
POSTGRES_ONLY = "/*POSTGRES*/ "

#: Numbered migrations, applied in order and recorded in ``schema_migrations`` (D4).
MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE runs (
                run_id TEXT PRIMARY KEY, graph_name TEXT NOT NULL, graph_ref TEXT,
                fingerprint TEXT NOT NULL, status TEXT NOT NULL, input_json TEXT NOT NULL,
                state_json TEXT NOT NULL, error TEXT, created_at DOUBLE PRECISION NOT NULL,
                updated_at DOUBLE PRECISION NOT NULL, finished_at DOUBLE PRECISION,
                nodes_done BIGINT NOT NULL DEFAULT 0, lease_owner TEXT,
                lease_expires DOUBLE PRECISION, lease_token BIGINT NOT NULL DEFAULT 0,
                format_version INTEGER NOT NULL)""",
            "CREATE INDEX runs_by_created ON runs (created_at, run_id)",
            "CREATE INDEX runs_by_status ON runs (status, lease_expires)",
            """CREATE TABLE node_states (
                run_id TEXT NOT NULL, node_id TEXT NOT NULL, status TEXT NOT NULL,
                visits INTEGER NOT NULL, data_json TEXT NOT NULL,
                PRIMARY KEY (run_id, node_id)) /*WITHOUT ROWID*/""",
            """CREATE TABLE results (
                run_id TEXT NOT NULL, node_id TEXT NOT NULL, visit INTEGER NOT NULL,
                value_json TEXT NOT NULL, PRIMARY KEY (run_id, node_id, visit)) /*WITHOUT ROWID*/""",
            """CREATE TABLE frozen_inputs (
                run_id TEXT NOT NULL, node_id TEXT NOT NULL, activation INTEGER NOT NULL,
                payload_json TEXT NOT NULL,
                PRIMARY KEY (run_id, node_id, activation)) /*WITHOUT ROWID*/""",
            """CREATE TABLE events (
                run_id TEXT NOT NULL, seq BIGINT NOT NULL, type TEXT NOT NULL, node_id TEXT,
                visit INTEGER, attempt INTEGER, ts DOUBLE PRECISION NOT NULL,
                data_json TEXT NOT NULL, PRIMARY KEY (run_id, seq)) /*WITHOUT ROWID*/""",
        ),
    ),
    (
        2,
        (
            # No foreign key to runs: ``run_id`` may name a LangGraph thread.
            """CREATE TABLE questions (
                question_id TEXT PRIMARY KEY, run_id TEXT NOT NULL, node_id TEXT NOT NULL,
                visit INTEGER NOT NULL, turn INTEGER NOT NULL, prompt_json TEXT NOT NULL,
                poller TEXT, deadline DOUBLE PRECISION, status TEXT NOT NULL CHECK (status IN
                    ('open', 'answered', 'applied', 'superseded', 'expired')),
                answer_json TEXT, answered_by TEXT, created_at DOUBLE PRECISION NOT NULL,
                answered_at DOUBLE PRECISION, applied_at DOUBLE PRECISION)""",
            "CREATE INDEX questions_by_status ON questions (status)",
            "CREATE INDEX questions_by_run ON questions (run_id)",
        ),
    ),
    (
        3,
        (
            # The primary key is the evolve ledger's compare-and-set: of writers
            # racing to store the same next version, exactly one insert succeeds.
            """CREATE TABLE artifact_versions (
                artifact_id TEXT NOT NULL, version INTEGER NOT NULL CHECK (version >= 1),
                entries_json TEXT NOT NULL, meta_json TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (artifact_id, version)) /*WITHOUT ROWID*/""",
        ),
    ),
    (
        4,
        (
            # Answers a daemon could not apply back off instead of blocking the
            # sweep: the reason, the count, the next try.
            "ALTER TABLE questions ADD COLUMN apply_error TEXT",
            "ALTER TABLE questions ADD COLUMN apply_attempts INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE questions ADD COLUMN retry_at DOUBLE PRECISION",
        ),
    ),
    (
        5,
        (
            # Run queues: a run submitted to a queue waits ``queued``
            # until a worker claims it; the store is the coordinator.
            "ALTER TABLE runs ADD COLUMN queue_name TEXT",
            "ALTER TABLE runs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE runs ADD COLUMN partition_key TEXT",
            "ALTER TABLE runs ADD COLUMN dedup_key TEXT",
            "ALTER TABLE runs ADD COLUMN cost DOUBLE PRECISION",
            "ALTER TABLE runs ADD COLUMN estimate DOUBLE PRECISION",
            "ALTER TABLE runs ADD COLUMN queued_at DOUBLE PRECISION",
            "ALTER TABLE runs ADD COLUMN started_at DOUBLE PRECISION",
            "ALTER TABLE runs ADD COLUMN cancel_requested_at DOUBLE PRECISION",
            # Claim candidates and per-queue counts.
            "CREATE INDEX runs_by_queue ON runs (queue_name, status, queued_at, run_id) "
            "WHERE queue_name IS NOT NULL",
            # The rate limit: runs claimed within a window.
            "CREATE INDEX runs_by_start ON runs (queue_name, started_at) "
            "WHERE started_at IS NOT NULL",
            "CREATE INDEX runs_by_partition ON runs (queue_name, partition_key, status) "
            "WHERE partition_key IS NOT NULL",
            # A dedup key is held while its run is live: the index refuses a second one.
            "CREATE UNIQUE INDEX runs_by_dedup ON runs (queue_name, dedup_key) "
            "WHERE dedup_key IS NOT NULL AND status IN ('queued', 'running', 'suspended')",
            # The runs of a worker that died, and the durations an lpt queue estimates from.
            "CREATE INDEX runs_by_owner ON runs (lease_owner) WHERE lease_owner IS NOT NULL",
            "CREATE INDEX runs_by_fingerprint ON runs (fingerprint, finished_at) "
            "WHERE started_at IS NOT NULL AND status = 'completed'",
            """CREATE TABLE queues (
                name TEXT PRIMARY KEY, concurrency INTEGER, worker_concurrency INTEGER,
                rate_limit INTEGER, rate_period DOUBLE PRECISION NOT NULL,
                ordering TEXT NOT NULL CHECK (ordering IN ('fifo', 'priority', 'lpt')),
                declared_at DOUBLE PRECISION NOT NULL)""",
            """CREATE TABLE workers (
                worker_id TEXT PRIMARY KEY, queues_json TEXT NOT NULL, concurrency INTEGER NOT NULL,
                started_at DOUBLE PRECISION NOT NULL, seen_at DOUBLE PRECISION NOT NULL,
                running INTEGER NOT NULL DEFAULT 0)""",
            # What SQLite watchers read when ``PRAGMA data_version`` moves: which
            # kind of change happened (Postgres sends NOTIFY instead).
            "CREATE TABLE signals (kind TEXT PRIMARY KEY, n BIGINT NOT NULL)",
            "INSERT INTO signals (kind, n) VALUES ('submit', 0), ('answer', 0), "
            "('release', 0), ('cancel', 0)",
        ),
    ),
    (
        6,
        (
            # One row per item of a map node's visit that ended or backs off (M6).
            """CREATE TABLE map_items (
                run_id TEXT NOT NULL, node_id TEXT NOT NULL, visit INTEGER NOT NULL,
                item INTEGER NOT NULL, status TEXT NOT NULL, seq BIGINT NOT NULL,
                attempts INTEGER NOT NULL, value_json TEXT, error TEXT,
                retry_due DOUBLE PRECISION,
                PRIMARY KEY (run_id, node_id, visit, item)) /*WITHOUT ROWID*/""",
        ),
    ),
    (
        7,
        (
            # Versions and forks (V1-V5): a fork's origin, and each graph
            # version's structure, kept once, so that a changed graph can be
            # checked against what a run did without the old code.
            "ALTER TABLE runs ADD COLUMN forked_from TEXT",
            "ALTER TABLE runs ADD COLUMN forked_at TEXT",
            "CREATE INDEX runs_by_graph ON runs (graph_name, status)",
            """CREATE TABLE graph_shapes (
                graph_name TEXT NOT NULL, fingerprint TEXT NOT NULL, shape_json TEXT NOT NULL,
                created_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (graph_name, fingerprint)) /*WITHOUT ROWID*/""",
        ),
    ),
    (
        8,
        (
            # The latest checkpoint of each node visit (or map item) that saved one (P1).
            """CREATE TABLE checkpoints (
                run_id TEXT NOT NULL, node_id TEXT NOT NULL, visit INTEGER NOT NULL,
                item INTEGER NOT NULL, attempt INTEGER NOT NULL, value_json TEXT NOT NULL,
                saved_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (run_id, node_id, visit, item)) /*WITHOUT ROWID*/""",
            # Stragglers parked by late="park" (P3), claimed once by a map (P4).
            """CREATE TABLE parked_items (
                park_id TEXT PRIMARY KEY, graph_name TEXT NOT NULL, node_id TEXT NOT NULL,
                run_id TEXT NOT NULL, visit INTEGER NOT NULL, item INTEGER NOT NULL,
                value_json TEXT NOT NULL, checkpoint_json TEXT,
                parked_at DOUBLE PRECISION NOT NULL, status TEXT NOT NULL CHECK (status IN
                    ('parked', 'claimed', 'dropped')),
                claimed_by TEXT, claimed_at DOUBLE PRECISION)""",
            "CREATE INDEX parked_by_node ON parked_items (graph_name, node_id, status, parked_at)",
        ),
    ),
    (
        9,
        (
            # Partitions: a concurrency and a rate limit per partition key, and
            # a pause of the whole queue (a declaration leaves it as it is).
            "ALTER TABLE queues ADD COLUMN partition_concurrency INTEGER NOT NULL DEFAULT 1",
            "ALTER TABLE queues ADD COLUMN partition_rate_limit INTEGER",
            "ALTER TABLE queues ADD COLUMN paused_at DOUBLE PRECISION",
            # When a partition last started a run (fair turns), and its rate window.
            "CREATE INDEX runs_by_partition_start ON runs (queue_name, partition_key, started_at) "
            "WHERE partition_key IS NOT NULL AND started_at IS NOT NULL",
        ),
    ),
    (
        10,
        (
            # Dead letters (W3): how many times a running run was taken over
            # from an owner that held it (it died, or its lease expired).
            "ALTER TABLE runs ADD COLUMN recoveries INTEGER NOT NULL DEFAULT 0",
        ),
    ),
    (
        11,
        (
            # Delayed runs and schedules (W4): a queued run is claimed only from
            # ``not_before``; a schedule's ``last_tick`` is the compare-and-set
            # that makes one worker of the fleet submit each tick.
            "ALTER TABLE runs ADD COLUMN not_before DOUBLE PRECISION",
            """CREATE TABLE schedules (
                name TEXT PRIMARY KEY, cron TEXT NOT NULL, graph_name TEXT NOT NULL,
                graph_ref TEXT, fingerprint TEXT NOT NULL, input_json TEXT NOT NULL,
                queue TEXT NOT NULL, declared_at DOUBLE PRECISION NOT NULL,
                last_tick DOUBLE PRECISION)""",
        ),
    ),
    (
        12,
        (
            # The graphs workers can drive, so a run can be submitted by name alone.
            """CREATE TABLE graphs (
                name TEXT NOT NULL, fingerprint TEXT NOT NULL, graph_ref TEXT,
                registered_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (name, fingerprint))""",
        ),
    ),
    (
        13,
        (
            # Idle cost: a heartbeat finds stopped workers with one indexed query
            # (their last report plus the silence after which they count gone), and
            # queue and schedule changes are notified rather than polled.
            "ALTER TABLE workers ADD COLUMN dead_after DOUBLE PRECISION NOT NULL DEFAULT 60",
            "CREATE INDEX workers_by_expiry ON workers ((seen_at + dead_after))",
            # The workers of one host that are late: a few rows, however many report.
            "ALTER TABLE workers ADD COLUMN host TEXT",
            "CREATE INDEX workers_by_host ON workers (host, seen_at)",
            "INSERT INTO signals (kind, n) VALUES ('config', 0)",
        ),
    ),
    (
        14,
        (
            # Streams (S1-S3): the chunks of each attempt and its terminal mark,
            # by run and cursor; ``stream`` groups an attempt's rows.
            """CREATE TABLE stream_chunks (
                run_id TEXT NOT NULL, seq BIGINT NOT NULL, stream BIGINT NOT NULL,
                node_id TEXT NOT NULL, visit INTEGER NOT NULL, item INTEGER,
                attempt INTEGER NOT NULL, hedge INTEGER NOT NULL,
                kind TEXT NOT NULL CHECK (kind IN ('chunk', 'accepted', 'discarded')),
                data_json TEXT, ts DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (run_id, seq)) /*WITHOUT ROWID*/""",
            "CREATE INDEX stream_chunks_by_stream ON stream_chunks (run_id, stream)",
            "INSERT INTO signals (kind, n) VALUES ('stream', 0)",
        ),
    ),
    (
        15,
        (
            # Child runs (R1-R4): a child names its parent; a parent's children are
            # found by one indexed query. Run deadlines (R6), found by a sweep.
            "ALTER TABLE runs ADD COLUMN parent_run_id TEXT",
            "ALTER TABLE runs ADD COLUMN deadline DOUBLE PRECISION",
            "CREATE INDEX runs_by_parent ON runs (parent_run_id) WHERE parent_run_id IS NOT NULL",
            "CREATE INDEX runs_by_deadline ON runs (deadline) WHERE deadline IS NOT NULL",
        ),
    ),
    (
        16,
        (
            # Idle cost: the scans for stopped workers (the fleet's) and late ones (a
            # host's) are taken in turns, one heartbeat per scope and interval, so a
            # heartbeat reads O(1) rows however large the fleet (``worker_scans``).
            """CREATE TABLE worker_scans (
                scope TEXT PRIMARY KEY, due_at DOUBLE PRECISION NOT NULL)""",
        ),
    ),
    (
        17,
        (
            # A parent suspended on its children wakes once enough of them completed
            # to move it on (R4): one wake-up, not one per child.
            "ALTER TABLE runs ADD COLUMN wake_after INTEGER",
        ),
    ),
    (
        18,
        (
            # A completed child run's output (R1), written by its final commit: its
            # parent reads its children's outputs in one query (``outputs``), not each
            # child's node and result rows.
            "ALTER TABLE runs ADD COLUMN output_json TEXT",
        ),
    ),
    (
        19,
        (
            # The items a run parked (P3), read by run (``list_parked(run_id=...)``): the
            # run page reads its own, not every item of its graph's nodes.
            "CREATE INDEX IF NOT EXISTS parked_by_run ON parked_items (run_id)",
        ),
    ),
    (
        20,
        (
            # How many times an item has been parked (P5): one parked that often runs to
            # completion the next time a map takes it, so no item starves.
            "ALTER TABLE parked_items ADD COLUMN parks INTEGER NOT NULL DEFAULT 1",
        ),
    ),
    (
        21,
        (
            # The graph versions each worker drives (``register_worker_graphs``): a child
            # run goes back to its queue while a live worker of it can drive it (R3).
            """CREATE TABLE IF NOT EXISTS worker_graphs (
                worker_id TEXT NOT NULL, graph_name TEXT NOT NULL, fingerprint TEXT NOT NULL,
                registered_at DOUBLE PRECISION NOT NULL,
                PRIMARY KEY (worker_id, graph_name, fingerprint)) /*WITHOUT ROWID*/""",
        ),
    ),
    (
        22,
        (
            # Claims that do not scan the backlog: each index holds the queued runs in
            # the order a claim reads them, so a claim reads a few entries per partition
            # and a window of unkeyed runs, however many are queued. A partition's runs
            # in line (``in_line_at``: submit time, or ``not_before`` when later), in
            # partition order (a skip scan walks it).
            "CREATE INDEX IF NOT EXISTS runs_in_line ON runs (queue_name, partition_key, "
            "(CASE WHEN not_before > queued_at THEN not_before ELSE queued_at END), run_id) "
            "WHERE status = 'queued' AND partition_key IS NOT NULL",
            # Unkeyed runs not delayed, in the queue's order: fifo and priority, then lpt.
            "CREATE INDEX IF NOT EXISTS runs_loose ON runs "
            "(queue_name, priority DESC, queued_at, run_id) "
            "WHERE status = 'queued' AND partition_key IS NULL AND not_before IS NULL",
            "CREATE INDEX IF NOT EXISTS runs_loose_lpt ON runs "
            "(queue_name, priority DESC, (COALESCE(estimate, 0)) DESC, queued_at, run_id) "
            "WHERE status = 'queued' AND partition_key IS NULL AND not_before IS NULL",
            # Unkeyed delayed runs, by when they come due.
            "CREATE INDEX IF NOT EXISTS runs_delayed ON runs (queue_name, "
            "(CASE WHEN not_before > queued_at THEN not_before ELSE queued_at END), run_id) "
            "WHERE status = 'queued' AND partition_key IS NULL AND not_before IS NOT NULL",
            # A partition's live runs, counted per claim: its finished runs are not in it
            # (the index it replaces held every run of every partition).
            "CREATE INDEX IF NOT EXISTS runs_live_by_partition ON runs "
            "(queue_name, partition_key) "
            "WHERE partition_key IS NOT NULL AND status IN ('running', 'suspended')",
            "DROP INDEX IF EXISTS runs_by_partition",
        ),
    ),
    (
        23,
        (
            # Liveness without writes (W7): a worker is alive while its store session is
            # (a Postgres session holding an advisory lock, a SQLite process holding a
            # lock file); each session watches the next one in ``session`` order. A
            # heartbeat rewrites ``seen_at``: no index may cover it (Postgres then
            # updates the row in place), and no heartbeat scans for silent workers.
            # ``worker_scans`` stays: the previous release's heartbeat reads it, and its
            # workers pulse through a rolling deploy (without these indexes, its scans
            # of the workers only read more rows).
            "DROP INDEX IF EXISTS workers_by_expiry",
            "DROP INDEX IF EXISTS workers_by_host",
            # Room on each page for a report's new version beside the old one.
            POSTGRES_ONLY + "ALTER TABLE workers SET (fillfactor = 50)",
            "ALTER TABLE workers ADD COLUMN session TEXT",
            "CREATE INDEX workers_by_session ON workers (session)",
            "INSERT INTO signals (kind, n) VALUES ('ring', 0)",
            # What a heartbeat finds due, one index entry each: a queue's next delayed
            # run, the next deadline of a run nobody drives (finished runs left out).
            "CREATE INDEX runs_by_not_before ON runs (queue_name, not_before) "
            "WHERE status = 'queued' AND not_before IS NOT NULL",
            "DROP INDEX IF EXISTS runs_by_deadline",
            "CREATE INDEX runs_by_deadline ON runs (deadline) "
            "WHERE deadline IS NOT NULL AND status IN ('queued', 'suspended')",
        ),
    ),
)

SCHEMA_VERSION = MIGRATIONS[-1][0]
#: Keep a graph version's structure the first time a run of it is stored.
INSERT_SHAPE = (
    "INSERT INTO graph_shapes (graph_name, fingerprint, shape_json, created_at) "
    "VALUES (?, ?, ?, ?) ON CONFLICT (graph_name, fingerprint) DO NOTHING"
)
SELECT_FRONTIERS = (
    "SELECT n.run_id, n.node_id FROM node_states n JOIN runs r ON r.run_id = n.run_id "
    "WHERE r.graph_name = ? AND r.status IN ('running', 'suspended') ORDER BY n.run_id"
)
#: Values: now, run_id, now. A suspended run that waits on child runs goes back to
#: its queue when one of them ends (R4): only a queued run nobody holds (``_rules.can_wake``).
WAKE_SUSPENDED = (
    "UPDATE runs SET status = 'queued', lease_owner = NULL, lease_expires = NULL, "
    "wake_after = NULL, updated_at = ? WHERE run_id = ? AND status = 'suspended' AND queue_name IS NOT NULL "
    "AND (lease_owner IS NULL OR lease_expires IS NULL OR lease_expires < ?)"
)
#: Values: run_id. A run suspending on its children lets go of its lease in that commit.
RELEASE_SUSPENDED = "UPDATE runs SET lease_owner = NULL, lease_expires = NULL WHERE run_id = ?"
#: The statuses of some runs (``ids``: their placeholders).
SELECT_STATUSES = "SELECT run_id, status FROM runs WHERE run_id IN ({ids})"
#: Values: wake_after, run_id. How many child completions a suspending run waits for.
SET_WAKE_AFTER = "UPDATE runs SET wake_after = ? WHERE run_id = ?"
#: Values: completed, run_id. A child of this run ended: its row is locked (whatever
#: its status) and, when the child completed and the run is suspended, one fewer
#: completion is left to wait for. Returns the status and the completions left.
CHILD_ENDED = (
    "UPDATE runs SET wake_after = CASE WHEN ? AND status = 'suspended' "
    "THEN wake_after - 1 ELSE wake_after END WHERE run_id = ? RETURNING status, wake_after"
)
#: Values: now, limit. Runs past their deadline that nobody drives (R6).
OVERDUE_RUNS = (
    "SELECT run_id FROM runs WHERE deadline IS NOT NULL AND deadline <= ? "
    "AND status IN ('queued', 'suspended') ORDER BY deadline, run_id LIMIT ?"
)
SELECT_SHAPE = "SELECT shape_json FROM graph_shapes WHERE graph_name = ? AND fingerprint = ?"
#: Move a run onto another version of its graph (V2), fenced by its lease (D6).
SELECT_FOR_MOVE = "SELECT status, fingerprint, lease_owner, lease_token FROM runs WHERE run_id = ?"
MOVE_RUN = "UPDATE runs SET fingerprint = ?, graph_ref = ?, updated_at = ? WHERE run_id = ?"
CREATE_MIGRATIONS_TABLE = (
    "CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, "
    "applied_at DOUBLE PRECISION NOT NULL)"
)


def record_from_row(row: Sequence[Any]) -> RunRecord:
    """Decode ``row``, a ``runs`` row selected with :data:`RUN_COLUMNS`."""
    fields = dict(zip(RUN_FIELDS, row, strict=True))
    fields["status"] = parse_status(row[0], row[4])
    return RunRecord(**fields)


def chunk_from_row(row: Sequence[Any]) -> ChunkRow:
    """Decode ``row``, a ``stream_chunks`` row selected with :data:`CHUNK_COLUMNS`."""
    return ChunkRow._make(row)


def event_from_row(row: Sequence[Any]) -> EventRow:
    """Decode ``row``, an ``events`` row selected with :data:`EVENT_COLUMNS`."""
    return EventRow(**dict(zip(EVENT_FIELDS, row, strict=True)))


def _created(run: NewRun, status: RunStatus) -> tuple[object, ...]:
    """Values of the columns of migration 1 of ``run``'s fresh row, with ``status``."""
    state, at = EMPTY_STATE_JSON, run.created_at
    return (
        run.run_id, run.graph_name, run.graph_ref, run.fingerprint, status.value,
        run.input_json, state, None, at, at, None, 0, None, None, 0, run.format_version,
    )  # fmt: skip


def _origin(run: NewRun) -> tuple[object, ...]:
    return (run.forked_from, run.forked_at, run.parent_run_id, run.deadline)


def new_run_params(run: NewRun) -> tuple[object, ...]:
    """Values of the fresh ``runs`` row for ``run``, for :data:`INSERT_RUN` (status ``running``)."""
    return (*_created(run, RunStatus.RUNNING), run.queue_name, *_origin(run))


def shape_params(run: NewRun) -> tuple[object, ...] | None:
    """Values for :data:`INSERT_SHAPE` from ``run``, or None when it carries no shape."""
    if run.shape_json is None:
        return None
    return (run.graph_name, run.fingerprint, run.shape_json, run.created_at)


def queued_run_params(run: NewRun, submission: Submission) -> tuple[object, ...]:
    """Values of the ``runs`` row of ``run`` submitted as ``submission``, for :data:`INSERT_QUEUED_RUN`."""
    q = submission
    return (
        *_created(run, RunStatus.QUEUED), q.queue, q.priority, q.partition, q.dedup_key, q.cost,
        q.estimate, run.created_at, None, None, 0, q.not_before, *_origin(run),
    )  # fmt: skip


def harvest_rows(run_id: str, harvest: Harvest) -> Iterator[tuple[str, tuple[object, ...], str]]:
    """Append-only rows of ``harvest`` for run ``run_id``: ``(insert, values, what it is)``."""
    for r in harvest.results:
        what = f"run {run_id!r}: result of node {r.node_id!r} visit {r.visit}"
        yield INSERT_RESULT, (run_id, r.node_id, r.visit, r.value_json), what
    for f in harvest.frozen:
        what = f"run {run_id!r}: frozen input of node {f.node_id!r} activation {f.activation}"
        yield INSERT_FROZEN, (run_id, f.node_id, f.activation, f.payload_json), what
    for e in harvest.events:
        values = (run_id, e.seq, e.type, e.node_id, e.visit, e.attempt, e.ts, e.data_json)
        yield INSERT_EVENT, values, f"run {run_id!r}: event seq {e.seq}"
    for q in harvest.questions:
        yield INSERT_QUESTION, question_params(q), f"run {run_id!r}: question {q.question_id!r}"
    for parked in harvest.parked:
        yield INSERT_PARKED, tuple(parked), f"run {run_id!r}: parked item {parked.park_id!r}"
    for c in harvest.chunks:
        yield INSERT_CHUNK, (run_id, *c), f"run {run_id!r}: stream row seq {c.seq}"


def append_only_rows(run_id: str, harvest: Harvest) -> list[tuple[str, list[tuple[object, ...]]]]:
    """The frozen inputs and questions of ``harvest`` grouped by statement, as whole rows.

    (Results and events are row tuples already: a store binds them as they are.)
    """
    groups: list[tuple[str, list[tuple[object, ...]]]] = []
    if harvest.frozen:
        groups.append(
            (
                INSERT_FROZEN,
                [(run_id, f.node_id, f.activation, f.payload_json) for f in harvest.frozen],
            )
        )
    if harvest.questions:
        groups.append((INSERT_QUESTION, [question_params(q) for q in harvest.questions]))
    if harvest.parked:
        groups.append((INSERT_PARKED, [tuple(r) for r in harvest.parked]))
    return groups


def checkpoint_params(run_id: str, harvest: Harvest) -> list[tuple[object, ...]]:
    """Values for :data:`UPSERT_CHECKPOINT`, one tuple per checkpoint row of ``harvest``."""
    return [(run_id, *row) for row in harvest.checkpoints]


def item_params(run_id: str, harvest: Harvest) -> list[tuple[object, ...]]:
    """Values for :data:`UPSERT_ITEM`, one tuple per item row of ``harvest`` in run ``run_id``."""
    return [(run_id, *row) for row in harvest.items]


def node_params(run_id: str, harvest: Harvest) -> list[tuple[object, ...]]:
    """Values for :data:`UPSERT_NODE`, one tuple per node row of ``harvest`` in run ``run_id``."""
    return [(run_id, n.node_id, n.status, n.visits, n.data_json) for n in harvest.nodes]


def stored_error(error: str | None) -> str | None:
    """A run's ``error`` as stored: NUL and lone surrogates escaped (see ``printable_text``)."""
    return None if error is None else printable_text(error)


def run_update_params(run_id: str, harvest: Harvest, now: float) -> tuple[object, ...]:
    """Values for :data:`UPDATE_RUN` applying ``harvest`` to run ``run_id`` at time ``now``."""
    ends = harvest.status in TERMINAL_STATUSES
    return (
        harvest.state_json, harvest.status.value, stored_error(harvest.error), now,
        harvest.finished_at,
        harvest.nodes_done_delta, harvest.output_json, ends, ends, run_id,
    )  # fmt: skip


# --- questions (Q2-Q5) ----------------------------------------------------------

QUESTION_FIELDS = (
    "question_id", "run_id", "node_id", "visit", "turn", "prompt_json", "poller", "deadline",
    "status", "answer_json", "answered_by", "created_at", "answered_at", "applied_at",
    "apply_error", "apply_attempts", "retry_at",
)  # fmt: skip
QUESTION_COLUMNS = ", ".join(QUESTION_FIELDS)
_QUESTION_VALUES = ", ".join("?" * len(QUESTION_FIELDS))
INSERT_QUESTION = f"INSERT INTO questions ({QUESTION_COLUMNS}) VALUES ({_QUESTION_VALUES})"
SELECT_QUESTION = f"SELECT {QUESTION_COLUMNS} FROM questions WHERE question_id = ?"
#: What a failed compare-and-set reports: the question's state now (no row: not found).
QUESTION_STATE = "SELECT status, applied_at FROM questions WHERE question_id = ?"
#: The run of a question, and its status (what a refused answer is told).
QUESTION_RUN = (
    "SELECT r.run_id, r.status FROM questions q JOIN runs r ON r.run_id = q.run_id"
    " WHERE q.question_id = ?"
)
#: Q2: first answer wins. Values: status, answer_json, answered_by, answered_at, question_id.
ANSWER_QUESTION = (
    "UPDATE questions SET status = ?, answer_json = ?, answered_by = ?, answered_at = ? "
    f"WHERE question_id = ? AND status = 'open' RETURNING {QUESTION_COLUMNS}"
)
#: The answer is there and was not applied yet (``can_apply``).
_APPLICABLE = "(status = 'answered' OR (status = 'expired' AND applied_at IS NULL))"
#: Q3: apply exactly once. Values: applied_at, question_id; exactly one row changes or none.
APPLY_QUESTION = (
    "UPDATE questions SET applied_at = ?, "
    "status = CASE status WHEN 'answered' THEN 'applied' ELSE status END "
    f"WHERE question_id = ? AND {_APPLICABLE}"
)
#: Values: question_id; no row changes when the question is already final (``can_supersede``).
SUPERSEDE_QUESTION = (
    "UPDATE questions SET status = 'superseded' WHERE question_id = ? "
    "AND (status IN ('open', 'answered') OR (status = 'expired' AND applied_at IS NULL))"
)
#: Q4, with backoff: values: now, limit. Fresh answers first by
#: ``answered_at``, then deferred ones by ``retry_at`` (the order of
#: ``_rules.due_order``), so deferred answers never hide a fresh one.
DUE_ANSWERS = (
    f"SELECT {QUESTION_COLUMNS} FROM questions WHERE {_APPLICABLE} "
    "AND (retry_at IS NULL OR retry_at <= ?) "
    "ORDER BY CASE WHEN retry_at IS NULL THEN 0 ELSE 1 END, "
    "COALESCE(retry_at, answered_at, 0), question_id LIMIT ?"
)
#: Values: apply_error, retry_at, question_id. Changes the row only while its
#: answer is still unapplied (``can_apply``); no row changes otherwise.
DEFER_ANSWER = (
    "UPDATE questions SET apply_error = ?, apply_attempts = apply_attempts + 1, retry_at = ? "
    f"WHERE question_id = ? AND {_APPLICABLE}"
)


def question_params(q: QuestionRow) -> tuple[object, ...]:
    """Values of ``q`` in :data:`QUESTION_COLUMNS` order."""
    return (
        q.question_id, q.run_id, q.node_id, q.visit, q.turn, q.prompt_json, q.poller, q.deadline,
        q.status.value, q.answer_json, q.answered_by, q.created_at, q.answered_at, q.applied_at,
        q.apply_error, q.apply_attempts, q.retry_at,
    )  # fmt: skip


def question_from_row(row: Sequence[Any]) -> QuestionRow:
    """Decode ``row``, a ``questions`` row selected with :data:`QUESTION_COLUMNS`."""
    fields = dict(zip(QUESTION_FIELDS, row, strict=True))
    fields["status"] = parse_question_status(row[0], row[8])
    return QuestionRow(**fields)


#: Questions per stored status (``question_counts``).
QUESTION_COUNTS = "SELECT status, COUNT(*) FROM questions GROUP BY status"


def question_counts_from(rows: Sequence[Sequence[Any]]) -> dict[QuestionStatus, int]:
    """``question_counts`` from :data:`QUESTION_COUNTS` rows (an unknown status is left out)."""
    counts: dict[QuestionStatus, int] = {}
    for status, n in rows:
        try:
            counts[QuestionStatus(status)] = int(n)
        except ValueError:
            continue  # a row written by hand: its questions say so when read
    return counts


def list_questions_query(
    status: QuestionStatus | None, run_id: str | None
) -> tuple[str, tuple[object, ...]]:
    """The query of ``list_questions`` (only ``status`` and ``run_id`` rows if given), ending in
    ``LIMIT ? OFFSET ?``."""
    where: list[str] = []
    params: list[object] = []
    if status is not None:
        where.append("status = ?")
        params.append(status.value)
    if run_id is not None:
        where.append("run_id = ?")
        params.append(run_id)
    clause = f"WHERE {' AND '.join(where)} " if where else ""
    query = (
        f"SELECT {QUESTION_COLUMNS} FROM questions {clause}"
        "ORDER BY created_at, question_id LIMIT ? OFFSET ?"
    )
    return query, tuple(params)


# --- the evolve ledger ------------------------------------------------------------

ARTIFACT_FIELDS = ("artifact_id", "version", "entries_json", "meta_json", "created_at")
ARTIFACT_COLUMNS = ", ".join(ARTIFACT_FIELDS)
#: Values: artifact_id. One row: the head version, 0 when there is none.
ARTIFACT_HEAD_VERSION = (
    "SELECT COALESCE(MAX(version), 0) FROM artifact_versions WHERE artifact_id = ?"
)
SELECT_ARTIFACT_HEAD = (
    f"SELECT {ARTIFACT_COLUMNS} FROM artifact_versions WHERE artifact_id = ? "
    "ORDER BY version DESC LIMIT 1"
)
SELECT_ARTIFACT_HISTORY = (
    f"SELECT {ARTIFACT_COLUMNS} FROM artifact_versions WHERE artifact_id = ? ORDER BY version"
)
INSERT_ARTIFACT = f"INSERT INTO artifact_versions ({ARTIFACT_COLUMNS}) VALUES (?, ?, ?, ?, ?)"


def artifact_params(version: ArtifactVersion) -> tuple[object, ...]:
    """Values of ``version`` in :data:`ARTIFACT_COLUMNS` order."""
    v = version
    return (v.artifact_id, v.version, v.entries_json, v.meta_json, v.created_at)


def artifact_from_row(row: Sequence[Any]) -> ArtifactVersion:
    """Decode ``row``, an ``artifact_versions`` row selected with :data:`ARTIFACT_COLUMNS`."""
    return ArtifactVersion(**dict(zip(ARTIFACT_FIELDS, row, strict=True)))
