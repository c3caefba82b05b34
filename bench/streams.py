"""Streams benchmark: chunk latency to readers, and what streaming costs the run (S1-S3).

Run as::

    python bench/streams.py [--quick] [--postgres DSN]

Workload: a map of ``attempts`` items (default 100), each streaming a chunk
every ``1 / per_attempt`` seconds for ``seconds`` (default 100 chunks/s per
attempt: about 10k chunks/s over the run), the items' first chunks spread
evenly over one period (independent agents do not tick together). Every
chunk carries the clock at its ``stream`` call.

- ``asyncio timer lateness``: the baseline, in the same run: how late bare
  asyncio timers fire at the same rate and spread, with no tailrace at all
  (an in-process reader cannot see a chunk before the loop gets to it).
- ``in-process listener``: ``Engine.on_chunk`` in the driving process, called
  as each chunk is published, measures chunk -> listener latency with
  ``time.perf_counter`` (the budget's line).
- ``in-process reader``: ``Engine.stream`` in the driving process, fed by the
  hub as chunks are published and woken by the event loop: no sooner than
  the loop gets to it (compare the baseline).
- ``other process (sqlite|postgres)``: a reader in a subprocess opens the same
  store and reads ``Engine.stream`` (woken by ``data_version`` on SQLite and
  ``LISTEN/NOTIFY`` on Postgres); latency by ``time.time`` on the same host.
- ``run rate``: the same run with and without the ``stream`` calls (SQLite,
  durable ``"async"``): turns/s and the ratio; and a hot case with no sleeps
  (items that only stream), the worst case, reported as it is.

- ``dbos other process (sqlite|postgres)``, with ``--dbos`` (``pip install
  dbos``): the peer on the same shape. One DBOS process runs ``attempts``
  async workflows, each ``DBOS.write_stream_async`` of the same chunks at the
  same pace (the clock as the value); a ``DBOSClient`` in another process reads
  every workflow's stream with ``read_stream_async`` (``LISTEN/NOTIFY`` on
  Postgres; on SQLite it polls, here every 10 ms, DBOS's default being 1 s).

Each reader attaches before the items start streaming. Postgres rows need
``--postgres`` or ``TAILRACE_TEST_POSTGRES_DSN``. Nothing here asserts; the
``targets`` section reports PASS/MISS against DESIGN.md's budget.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tailrace as tr
from tailrace import current_node
from tailrace.stores import RunStore, open_store

READER = """
    import asyncio, json, sys, time
    import tailrace as tr
    from tailrace.stores import open_store

    url, run_id, ready, out = sys.argv[1:5]

    async def main():
        store = open_store(url)
        await store.open()
        try:
            engine = tr.Engine(store=store)
            lags = []
            open(ready, "w").close()
            async for chunk in engine.stream(run_id):
                if not chunk.terminal:
                    lags.append(time.time() - chunk.value)
            json.dump(lags, open(out, "w"))
        finally:
            await store.close()

    asyncio.run(main())
"""


DBOS_WRITER = """
    import asyncio, os, sys, time
    from dbos import DBOS, SetWorkflowID

    url, n, turns, pause, prefix, started, go, done = sys.argv[1:9]
    n, turns, pause = int(n), int(turns), float(pause)
    DBOS(config={"name": "streams-bench", "system_database_url": url,
                 "notification_listener_polling_interval_sec": 0.01})

    @DBOS.workflow()
    async def agent(i: int) -> int:
        while not os.path.exists(go):
            await asyncio.sleep(0.005)
        await asyncio.sleep(pause * i / n)  # spread over one period, as tailrace's items
        for _ in range(turns):
            await DBOS.write_stream_async("out", time.time())
            await asyncio.sleep(pause)
        await DBOS.close_stream_async("out")
        return turns

    async def main():
        DBOS.launch()
        handles = []
        for i in range(n):
            with SetWorkflowID(f"{prefix}-{i}"):
                handles.append(await DBOS.start_workflow_async(agent, i))
        open(started, "w").close()
        for handle in handles:
            await handle.get_result()
        open(done, "w").close()

    asyncio.run(main())
    DBOS.destroy()
"""

DBOS_READER = """
    import asyncio, json, sys, time
    from dbos import DBOSClient

    url, n, prefix, ready, out = sys.argv[1:6]
    client = DBOSClient(system_database_url=url)

    async def main():
        lags = []

        async def read(i):
            async for value in client.read_stream_async(
                f"{prefix}-{i}", "out", polling_interval_sec=0.01
            ):
                lags.append(time.time() - value)

        readers = [asyncio.ensure_future(read(i)) for i in range(int(n))]
        await asyncio.sleep(0.5)  # every reader's first look done
        open(ready, "w").close()
        await asyncio.gather(*readers)
        json.dump(lags, open(out, "w"))

    asyncio.run(main())
    client.destroy()
"""


def dbos_other_process(
    url: str, attempts: int, turns: int, pause: float, workdir: Path
) -> dict[str, float]:
    """Chunk -> DBOS ``read_stream`` reader in another process latency, same shape."""
    tag = uuid.uuid4().hex[:8]
    writer, reader = workdir / "dbos_writer.py", workdir / "dbos_reader.py"
    writer.write_text(textwrap.dedent(DBOS_WRITER))
    reader.write_text(textwrap.dedent(DBOS_READER))
    started, go, done, ready, out = (
        workdir / f"dbos-{tag}.{name}" for name in ("started", "go", "done", "ready", "json")
    )
    prefix = f"agent-{tag}"
    log = (workdir / f"dbos-{tag}.log").open("wb")  # DBOS logs at INFO: kept out of the table
    w = subprocess.Popen(
        [sys.executable, str(writer), url, str(attempts), str(turns), str(pause), prefix,
         str(started), str(go), str(done)], stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    r = None
    try:
        _wait_file(started, w, log.name)
        r = subprocess.Popen([sys.executable, str(reader), url, str(attempts), prefix,
                              str(ready), str(out)], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        _wait_file(ready, r, log.name)
        began = time.perf_counter()
        go.touch()
        _wait_file(done, w, log.name, within=600.0)
        elapsed = time.perf_counter() - began
        r.wait(60)
        w.wait(60)
    finally:
        for proc in (w, r):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        log.close()
    return _summary(json.loads(out.read_text()), elapsed)


def _wait_file(path: Path, proc: subprocess.Popen[bytes], log: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        if proc.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-600:]
            raise RuntimeError(
                f"{proc.args[1]} exited ({proc.returncode}) before {path.name}: {tail}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path.name} did not appear within {within:g} s")
        time.sleep(0.01)


def _dbos_database(dsn: str, name: str) -> str:
    """A database of its own for DBOS (it creates it), on the server ``dsn`` names."""
    import psycopg.conninfo

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    host, user = info.get("host", "localhost"), info.get("user", "postgres")
    if host.startswith("/"):
        return f"postgresql://{user}@/{name}?host={host}"
    return f"postgresql://{user}@{host}:{info.get('port', '5432')}/{name}"


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def streaming_map(
    attempts: int, turns: int, pause: float, go: asyncio.Event, *, clock: Any, stream: bool
) -> tr.Graph:
    async def each(i: int) -> int:
        await go.wait()
        if pause:  # arrivals spread evenly over the pause, as independent agents' would be
            await asyncio.sleep(pause * i / attempts)
        ctx = current_node()
        assert ctx is not None
        for _ in range(turns):
            if stream:
                ctx.stream(clock())
            if pause:
                await asyncio.sleep(pause)
        return i

    g = tr.Graph("streams_bench")
    g.add_node("each", each, "map", max_items=max(attempts, 1))
    return g


async def _until(condition: Any, guard: float = 60.0) -> None:
    deadline = time.monotonic() + guard
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark setup hung")
        await asyncio.sleep(0.005)


async def _exists(store: RunStore, run_id: str) -> bool:
    try:
        await store.get_run(run_id)
    except tr.RunNotFound:
        return False
    return True


async def in_process(
    url: str, attempts: int, turns: int, pause: float
) -> tuple[dict[str, float], dict[str, float]]:
    """Chunk -> in-process latency (seconds) at the workload's rate: to a listener
    (``Engine.on_chunk``) and to a reader (``Engine.stream``), in the same run."""
    go = asyncio.Event()
    graph = streaming_map(attempts, turns, pause, go, clock=time.perf_counter, stream=True)
    store = open_store(url)
    await store.open()
    try:
        engine = tr.Engine(store=store)
        run_id = f"inproc-{uuid.uuid4().hex[:8]}"
        run = asyncio.ensure_future(engine.run(graph, list(range(attempts)), run_id=run_id))
        await _until(lambda: _exists(store, run_id))
        lags: list[float] = []
        heard: list[float] = []

        def hear(chunk: tr.Chunk) -> None:
            if not chunk.terminal:
                heard.append(time.perf_counter() - chunk.value)

        async def read() -> None:
            async for chunk in engine.stream(run_id):
                if not chunk.terminal:
                    lags.append(time.perf_counter() - chunk.value)

        reader = asyncio.ensure_future(read())
        await asyncio.sleep(0.2)  # attached before anything streams
        with engine.on_chunk(run_id, hear):
            started = time.perf_counter()
            go.set()
            await run
            elapsed = time.perf_counter() - started
        await reader
    finally:
        await store.close()
    return _summary(heard, elapsed), _summary(lags, elapsed)


async def other_process(
    url: str, attempts: int, turns: int, pause: float, workdir: Path
) -> dict[str, float]:
    """Chunk -> reader in another process latency (seconds), same store ``url``."""
    go = asyncio.Event()
    graph = streaming_map(attempts, turns, pause, go, clock=time.time, stream=True)
    script = workdir / "reader.py"
    script.write_text(textwrap.dedent(READER))
    run_id = f"cross-{uuid.uuid4().hex[:8]}"
    ready, out = workdir / f"{run_id}.ready", workdir / f"{run_id}.json"
    store = open_store(url)
    await store.open()
    try:
        engine = tr.Engine(store=store)
        run = asyncio.ensure_future(engine.run(graph, list(range(attempts)), run_id=run_id))
        await _until(lambda: _exists(store, run_id))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        reader = subprocess.Popen(  # noqa: ASYNC220 (a child we wait on off the loop)
            [sys.executable, str(script), url, run_id, str(ready), str(out)], env=env
        )

        async def attached() -> bool:
            return ready.exists()

        await _until(attached)
        await asyncio.sleep(0.3)  # its first read done, waiting on the feed
        started = time.perf_counter()
        go.set()
        await run
        elapsed = time.perf_counter() - started
        await asyncio.to_thread(reader.wait, 60)
    finally:
        await store.close()
    return _summary(json.loads(out.read_text()), elapsed)


async def timer_lateness(attempts: int, turns: int, pause: float) -> dict[str, float]:
    """The baseline: how late bare asyncio timers fire at the workload's rate (no tailrace).

    A chunk reaches an in-process reader no sooner than the event loop gets to
    it; this is the loop's own jitter on this machine, in the same run.
    """
    late: list[float] = []

    async def tick(i: int) -> None:
        await asyncio.sleep(pause * i / attempts)
        for _ in range(turns):
            before = time.perf_counter()
            await asyncio.sleep(pause)
            late.append(time.perf_counter() - before - pause)

    started = time.perf_counter()
    await asyncio.gather(*(tick(i) for i in range(attempts)))
    return _summary(late, time.perf_counter() - started)


def _summary(lags: Sequence[float], elapsed: float) -> dict[str, float]:
    return {
        "chunks": float(len(lags)),
        "rate": len(lags) / elapsed if elapsed else float("nan"),
        "p50": quantile(lags, 0.50),
        "p90": quantile(lags, 0.90),
        "p99": quantile(lags, 0.99),
        "max": max(lags) if lags else float("nan"),
    }


async def run_rate(url: str, attempts: int, turns: int, pause: float, stream: bool) -> float:
    """Turns per second of the workload's run (chunks published or not)."""
    go = asyncio.Event()
    go.set()
    graph = streaming_map(attempts, turns, pause, go, clock=time.time, stream=stream)
    store = open_store(url)
    await store.open()
    try:
        started = time.perf_counter()
        await tr.Engine(store=store).run(graph, list(range(attempts)))
        return attempts * turns / (time.perf_counter() - started)
    finally:
        await store.close()


def _row(name: str, s: dict[str, float]) -> str:
    return (
        f"| {name} | {int(s['chunks'])} | {s['rate']:.0f} | {s['p50'] * 1e3:.2f} | "
        f"{s['p90'] * 1e3:.2f} | {s['p99'] * 1e3:.2f} | {s['max'] * 1e3:.2f} |"
    )


async def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a shorter run")
    parser.add_argument("--attempts", type=int, default=100)
    parser.add_argument("--per-attempt", type=float, default=100.0, help="chunks/s per attempt")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--postgres", default=os.environ.get("TAILRACE_TEST_POSTGRES_DSN"))
    parser.add_argument("--dbos", action="store_true", help="DBOS read_stream, side by side")
    parser.add_argument("--dbos-seconds", type=float, default=1.0,
                        help="seconds of DBOS's run (the same pace; it falls behind it)")  # fmt: skip
    args = parser.parse_args(argv)
    seconds = args.seconds or (1.0 if args.quick else 3.0)
    pause = 1.0 / args.per_attempt
    turns = max(1, int(seconds * args.per_attempt))
    attempts = args.attempts
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cpus; {attempts} attempts x "
          f"{turns} chunks, one every {pause * 1e3:.1f} ms (target {attempts / pause:.0f} chunks/s); "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        sqlite_url = str(workdir / "streams.db")
        rows = [("asyncio timer lateness (baseline)", await timer_lateness(attempts, turns, pause))]
        listener, reader = await in_process(sqlite_url, attempts, turns, pause)
        rows.append(("in-process listener (sqlite)", listener))
        rows.append(("in-process reader (sqlite)", reader))
        rows.append(
            (
                "other process (sqlite)",
                await other_process(str(workdir / "cross.db"), attempts, turns, pause, workdir),
            )
        )
        if args.postgres:
            sep = "&" if "?" in args.postgres else "?"
            pg_url = f"{args.postgres}{sep}schema=streams_{uuid.uuid4().hex[:8]}"
            rows.append(
                ("other process (postgres)", await other_process(pg_url, attempts, turns, pause, workdir))
            )  # fmt: skip
            await _drop_schema(args.postgres, pg_url.rsplit("schema=", 1)[1])
        else:
            print("(no Postgres DSN: its row is skipped)")
        if args.dbos:
            dbos_turns = max(1, min(turns, int(args.dbos_seconds * args.per_attempt)))
            rows += await dbos_rows(args.postgres, attempts, dbos_turns, pause, workdir)

        print("\n| reader | chunks | chunks/s | p50 ms | p90 ms | p99 ms | max ms |")
        print("|---|---|---|---|---|---|---|")
        for name, summary in rows:
            print(_row(name, summary))

        rates = {}
        for label, paused in (("paced", pause), ("hot", 0.0)):
            n, t = (attempts, turns) if paused else (2000, 2)
            base = statistics.median(
                [await run_rate(str(workdir / f"r{label}{i}.db"), n, t, paused, False) for i in range(3)]
            )  # fmt: skip
            streamed = statistics.median(
                [await run_rate(str(workdir / f"s{label}{i}.db"), n, t, paused, True) for i in range(3)]
            )  # fmt: skip
            rates[label] = (base, streamed)
        print("\n| run (sqlite, async) | turns/s without | turns/s with stream | with / without |")
        print("|---|---|---|---|")
        for label, (base, streamed) in rates.items():
            what = f"{attempts} attempts, paced" if label == "paced" else "2000 items x 2, no sleep"
            print(f"| {what} | {base:.0f} | {streamed:.0f} | {streamed / base:.3f} |")

    print("\ntargets (DESIGN.md):")
    budgets = {"in-process listener (sqlite)": 1.0, "other process (sqlite)": 20.0}
    budgets["other process (postgres)"] = 50.0
    for name, summary in rows[1:]:
        if name not in budgets:
            continue  # the reader: a loop turn after the chunk, reported against the baseline
        p99 = summary["p99"] * 1e3
        verdict = "PASS" if p99 < budgets[name] else "MISS"
        print(f"  {name}: p99 {p99:.2f} ms < {budgets[name]:g} ms: {verdict}")
    base_p99 = rows[0][1]["p99"] * 1e3
    print(f"  (the event loop's own p99 lateness in this run: {base_p99:.2f} ms)")
    base, streamed = rates["paced"]
    verdict = "PASS" if streamed / base >= 0.9 else "MISS"
    print(f"  run rate with streaming >= 0.9 x without: {streamed / base:.3f}: {verdict}")


async def dbos_rows(
    dsn: str | None, attempts: int, turns: int, pause: float, workdir: Path
) -> list[tuple[str, dict[str, float]]]:
    """DBOS's rows (SQLite, and Postgres when ``dsn`` is given); a failure is said, not hidden."""
    targets = [("sqlite", f"sqlite:///{workdir}/dbos-streams.sqlite", None)]
    if dsn:
        name = f"dbos_streams_{uuid.uuid4().hex[:8]}"
        targets.append(("postgres", _dbos_database(dsn, name), name))
    rows = []
    for kind, url, database in targets:
        try:
            summary = await asyncio.to_thread(
                dbos_other_process, url, attempts, turns, pause, workdir
            )
            rows.append((f"dbos other process ({kind}, {turns} chunks each)", summary))
        except Exception as exc:  # report why, keep tailrace's rows
            print(f"(DBOS on {kind} failed: {str(exc)[-300:]})")
        finally:
            if database is not None and dsn:
                await _drop_database(dsn, database)
    return rows


async def _drop_database(dsn: str, name: str) -> None:
    import psycopg

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def _drop_schema(dsn: str, schema: str) -> None:
    import psycopg  # the postgres extra, optional

    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
