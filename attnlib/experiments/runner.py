"""A resumable sweep runner that fans runs out over Dask (``distributed``); only the driver writes.

A :class:`Sweep` is a list of run specifications (plain dicts, each with a unique ``"run"``
id) and a module-level function ``func(spec) -> list of row dicts``. :func:`attnlib.experiments.runner.run_sweep`

* reads the output CSV, keeps every *complete* run exactly once (each row carries its run id
  and the number of rows of its run, ``nrows``), drops a torn last line or a partial run left by
  a crash, and rewrites the file atomically if it had to drop anything;
* submits the missing runs (largest ``cost`` first) to a Dask cluster: ``workers=N`` starts a
  local cluster of ``N`` single-threaded worker processes that listen on loopback only (their
  HTTP endpoints too, on free ports), ``scheduler=ADDRESS``
  connects to an existing one, ``client=`` uses a given ``distributed.Client``, and
  ``workers=0`` runs in this process without Dask;
* appends each finished run's rows in one write, flushed and fsynced, as results arrive. A
  worker that dies has its runs rescheduled by Dask; a driver that dies loses only the runs not
  yet written, and the next call computes exactly those;
* where the sweep has a ``batch`` function and a ``group`` key (the regime-(ii) chain sweeps: the
  chains of one configuration, :func:`attnlib.optim.run_chains`), computes the missing runs of one group
  together, at most ``max_group`` per call, ``batch(specs) -> one list of rows per spec``; each run is
  still written as its own block, so files, resumption and the reader are unchanged (a group that is half
  done computes only its missing runs).

Rows are tidy: the spec's fields, then the function's columns, then ``run``, ``nrows``,
``cpu_s`` and ``wall_s`` (process CPU time and wall time of the run on its worker).
:func:`read_sweep` is the one reader of such files: the complete runs, values typed by column,
optionally as a pandas DataFrame.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["Sweep", "run_sweep", "read_sweep", "clean_sweep_file", "execute_run", "execute_batch", "BOOKKEEPING"]

#: Columns the runner adds to every row.
BOOKKEEPING = ("run", "nrows", "cpu_s", "wall_s")


@dataclass
class Sweep:
    """A named set of runs.

    ``specs``: one dict per run, JSON-like values, each with a unique ``"run"`` id; optional
    ``"cost"`` (relative, for scheduling; not written). ``func``: a module-level function (so
    that workers can import it) mapping a spec to a non-empty list of row dicts with keys
    ``columns``. ``spec_columns``: the spec fields written to every row. ``batch`` and ``group``
    (optional, both or neither; module level): ``batch(specs)`` computes the runs of specs with one
    ``group(spec)`` key together and returns, per spec, what ``func(spec)`` returns (equal to round-off);
    ``max_group`` bounds the specs per call.
    """

    name: str
    func: Callable[[dict], List[dict]]
    specs: List[dict]
    spec_columns: Sequence[str]
    columns: Sequence[str]
    meta: Dict[str, object] = field(default_factory=dict)
    batch: Optional[Callable[[List[dict]], List[List[dict]]]] = None
    group: Optional[Callable[[dict], str]] = None
    max_group: int = 16

    def __post_init__(self):
        ids = [s.get("run") for s in self.specs]
        if any(not isinstance(i, str) or not i for i in ids):
            raise ValueError("specs: every spec needs a non-empty string 'run' id")
        if len(set(ids)) != len(ids):
            raise ValueError("specs: run ids must be unique")
        clash = set(self.spec_columns) & set(self.columns)
        if clash or set(BOOKKEEPING) & (set(self.spec_columns) | set(self.columns)):
            raise ValueError(f"columns: names must be unique and not in {BOOKKEEPING}, clash {sorted(clash)}")
        if (self.batch is None) != (self.group is None):
            raise ValueError("batch, group: give both (runs computed together by group) or neither")
        if isinstance(self.max_group, bool) or not isinstance(self.max_group, int) or self.max_group < 1:
            raise ValueError(f"max_group: expected an integer >= 1, got {self.max_group!r}")

    @property
    def header(self) -> List[str]:
        return list(self.spec_columns) + list(self.columns) + list(BOOKKEEPING)


def execute_run(func: Callable[[dict], List[dict]], spec: dict) -> List[dict]:
    """Run one spec and attach the bookkeeping columns (executed on the worker)."""
    c0, w0 = time.process_time(), time.perf_counter()
    rows = func(spec)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if not rows:
        raise ValueError(f"func: run {spec['run']!r} returned no rows")
    return [dict(r, run=spec["run"], nrows=len(rows), cpu_s=cpu, wall_s=wall) for r in rows]


def execute_batch(batch: Callable[[List[dict]], List[List[dict]]], specs: List[dict]) -> List[List[dict]]:
    """Run specs together (``batch``) and attach each run's bookkeeping; ``cpu_s`` and ``wall_s`` are the
    call's times divided by the number of runs (executed on the worker)."""
    c0, w0 = time.process_time(), time.perf_counter()
    results = batch(specs)
    cpu, wall = (time.process_time() - c0) / len(specs), (time.perf_counter() - w0) / len(specs)
    if len(results) != len(specs) or any(not rows for rows in results):
        raise ValueError(f"batch: expected a non-empty list of rows for each of the {len(specs)} runs")
    return [
        [dict(r, run=spec["run"], nrows=len(rows), cpu_s=cpu, wall_s=wall) for r in rows]
        for spec, rows in zip(specs, results)
    ]


def _tasks(sweep: Sweep, todo: List[dict]) -> List[List[dict]]:
    """The units of work: one spec each, or (with ``sweep.batch``) the specs of a group, ``max_group`` at a time,
    in the order of each group's first spec."""
    if sweep.batch is None:
        return [[s] for s in todo]
    groups: Dict[str, List[dict]] = {}
    for s in todo:
        groups.setdefault(sweep.group(s), []).append(s)
    m = sweep.max_group
    return [g[i : i + m] for g in groups.values() for i in range(0, len(g), m)]


def _execute(func, batch, specs: List[dict]) -> List[List[dict]]:
    """One unit of :func:`_tasks`: ``execute_run`` of its one spec, or ``execute_batch`` of its specs."""
    if batch is None:
        return [execute_run(func, specs[0])]
    return execute_batch(batch, specs)


def _fmt(v) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _parse_blocks(path: str, header: Optional[List[str]]):
    """Complete runs of a sweep CSV, in file order, plus whether anything had to be dropped."""
    with open(path, newline="") as fh:
        text = fh.read()
    dropped = False
    if text and not text.endswith("\n"):  # torn last line
        text = text[: text.rfind("\n") + 1]
        dropped = True
    reader = csv.reader(io.StringIO(text))
    try:
        file_header = next(reader)
    except StopIteration:
        return None, {}, [], dropped or bool(text)
    if header is not None and file_header != header:
        raise ValueError(f"out: {path} has columns {file_header}, expected {header} (another sweep's file?)")
    if "run" not in file_header or "nrows" not in file_header:
        raise ValueError(f"path: {path} is not a sweep CSV (expected the columns 'run' and 'nrows')")
    i_run, i_n = file_header.index("run"), file_header.index("nrows")
    blocks: Dict[str, List[List[str]]] = {}
    order: List[str] = []
    current, cur_rows = None, []

    def close():
        nonlocal dropped
        if current is None:
            return
        want = int(cur_rows[0][i_n])
        if len(cur_rows) == want and current not in blocks:
            blocks[current] = cur_rows
            order.append(current)
        else:
            dropped = True

    for row in reader:
        if len(row) != len(file_header):
            dropped = True
            continue
        if row[i_run] != current:
            close()
            current, cur_rows = row[i_run], []
        cur_rows.append(row)
    close()
    return file_header, blocks, order, dropped


def clean_sweep_file(path: str, header: Optional[List[str]] = None) -> Dict[str, int]:
    """Drop torn lines, partial runs and repeated runs from a sweep CSV (atomic rewrite).

    Returns ``{"runs": complete runs kept, "rewritten": 0 or 1}``.
    """
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return {"runs": 0, "rewritten": 0}
    file_header, blocks, order, dropped = _parse_blocks(path, header)
    if not dropped:
        return {"runs": len(order), "rewritten": 0}
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        if file_header is not None:
            w.writerow(file_header)
            for r in order:
                w.writerows(blocks[r])
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return {"runs": len(order), "rewritten": 1}


_INT = re.compile(r"[+-]?\d+")


def _column_type(values: List[str]):
    """The type of one CSV column: ``int`` if every entry is an integer literal, else ``float`` if every
    entry is a number or empty (empty reads as NaN), else ``str``."""
    if values and all(_INT.fullmatch(v) for v in values):
        return int
    try:
        for v in values:
            if v != "":
                float(v)
    except ValueError:
        return str
    return float


def _typed(kind, v: str):
    if kind is float:
        return float(v) if v != "" else math.nan
    return kind(v)


def read_sweep(path: str, *, frame: bool = False):
    """The rows of the complete runs of a sweep CSV, with typed values; the one reader of the book's sweeps.

    A partial or repeated run (a crash in the middle of a write) and a torn last line are left out,
    as :func:`attnlib.experiments.runner.run_sweep` would drop them. Values are typed by column: ``run`` is
    always a string; a column of integer literals reads as ``int`` (flags written as 0/1 too); a column of numbers,
    some of them possibly empty, as ``float`` with ``nan`` for the empty ones; any other column as
    ``str``. Returns a list of dicts in file order, or with ``frame=True`` a ``pandas.DataFrame``
    with the file's columns.
    """
    if not os.path.exists(path):
        raise ValueError(f"path: {path} does not exist")
    file_header, blocks, order, _ = _parse_blocks(path, None)
    if file_header is None:
        raise ValueError(f"path: {path} is not a sweep CSV (expected the columns 'run' and 'nrows')")
    raw = [row for r in order for row in blocks[r]]
    kinds = [str if k == "run" else _column_type([row[j] for row in raw]) for j, k in enumerate(file_header)]
    rows = [{k: _typed(t, v) for k, t, v in zip(file_header, kinds, row)} for row in raw]
    if frame:
        import pandas as pd

        return pd.DataFrame(rows, columns=file_header)
    return rows


def _write_block(fh, header, rows) -> None:
    buf = io.StringIO()
    w = csv.writer(buf)
    for r in rows:
        w.writerow([_fmt(r.get(c, "")) for c in header])
    fh.write(buf.getvalue())
    fh.flush()
    os.fsync(fh.fileno())


def _check_reach(sweep, workers, scheduler, client) -> None:
    if not isinstance(sweep, Sweep):
        raise ValueError(f"sweep: expected an attnlib.experiments.runner.Sweep, got {type(sweep).__name__}")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers: expected an integer >= 0, got {workers!r}")
    if sum(x is not None and x is not False for x in (scheduler, client)) + (workers > 0) > 1:
        raise ValueError("workers, scheduler, client: give at most one way to reach a cluster")


def _done_runs(out: str, header: List[str]) -> set:
    """Clean ``out`` and return the ids of its complete runs (a new file gets the header)."""
    if os.path.dirname(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
    if os.path.exists(out) and os.path.getsize(out) > 0:
        clean_sweep_file(out, header)
        return set(_parse_blocks(out, header)[1])
    with open(out, "w", newline="") as fh:
        csv.writer(fh).writerow(header)
    return set()


class _Emitter:
    """Writes each finished run's rows (spec fields first) and counts them; the driver's only writer."""

    def __init__(self, fh, sweep: Sweep, total: int, progress: bool, on_result, max_runs):
        self.fh, self.sweep, self.on_result = fh, sweep, on_result
        self.max_runs = None if max_runs is None else int(max_runs)
        self.written, self.cpu = 0, 0.0
        self.bar = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=sweep.name)

    @property
    def full(self) -> bool:
        return self.max_runs is not None and self.written >= self.max_runs

    def __call__(self, spec: dict, rows: List[dict]) -> None:
        fixed = {c: spec.get(c, "") for c in self.sweep.spec_columns}
        _write_block(self.fh, self.sweep.header, [{**fixed, **r} for r in rows])
        self.written += 1
        self.cpu += float(rows[0]["cpu_s"])
        if self.bar is not None:
            self.bar.update(1)
        if self.on_result is not None:
            self.on_result(spec, rows)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_on_cluster(sweep: Sweep, todo: List[dict], emit: _Emitter, *, workers, scheduler, client) -> None:
    """Submit ``todo`` to a Dask cluster (a local one of ``workers`` processes, ``scheduler`` or ``client``)
    and emit the results as they arrive."""
    from distributed import Client, LocalCluster, as_completed

    cluster = own_client = None
    try:
        if client is None:
            if scheduler is not None:
                own_client = Client(scheduler)
            else:
                cluster = LocalCluster(
                    n_workers=workers,
                    threads_per_worker=1,
                    processes=True,
                    host="127.0.0.1",
                    dashboard_address="127.0.0.1:0",
                    worker_dashboard_address="127.0.0.1:0",
                )
                own_client = Client(cluster)
            client = own_client
        by_key, futures = {}, []
        for specs in _tasks(sweep, todo):
            key = f"{sweep.name}-{specs[0]['run']}"
            fut = client.submit(_execute, sweep.func, sweep.batch, specs, key=key, pure=False)
            by_key[fut.key] = specs
            futures.append(fut)
        for fut in as_completed(futures):
            for spec, rows in zip(by_key[fut.key], fut.result()):
                if emit.full:
                    break
                emit(spec, rows)
            if emit.full:
                break
        for fut in futures:
            fut.cancel()
    finally:
        if own_client is not None:
            own_client.close()
        if cluster is not None:
            cluster.close()


def run_sweep(
    sweep: Sweep,
    out: str,
    *,
    workers: int = 0,
    scheduler: Optional[str] = None,
    client=None,
    progress: bool = True,
    max_runs: Optional[int] = None,
    on_result: Optional[Callable[[dict, List[dict]], None]] = None,
) -> Dict[str, float]:
    """Run (or resume) ``sweep``, appending to the CSV ``out``; see the module docstring.

    ``max_runs`` stops after writing that many new runs (the rest stay for a later call);
    ``on_result(spec, rows)`` is called after each run is written (tests use it to kill a
    worker mid-sweep). Returns ``{"runs": written, "skipped": already present, "wall_s": s,
    "cpu_s": summed CPU time of the new runs}``.
    """
    _check_reach(sweep, workers, scheduler, client)
    done = _done_runs(out, sweep.header)
    todo = sorted((s for s in sweep.specs if s["run"] not in done), key=lambda s: -float(s.get("cost", 0.0)))
    t0 = time.perf_counter()
    with open(out, "a", newline="") as fh:
        emit = _Emitter(fh, sweep, len(todo), progress, on_result, max_runs)
        try:
            if workers == 0 and scheduler is None and client is None:
                for specs in _tasks(sweep, todo):
                    if emit.full:
                        break
                    for spec, rows in zip(specs, _execute(sweep.func, sweep.batch, specs)):
                        if not emit.full:
                            emit(spec, rows)
            else:
                _run_on_cluster(sweep, todo, emit, workers=workers, scheduler=scheduler, client=client)
        finally:
            emit.close()
    return {"runs": emit.written, "skipped": len(done), "wall_s": time.perf_counter() - t0, "cpu_s": emit.cpu}
