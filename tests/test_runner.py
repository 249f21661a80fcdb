"""The sweep runner: only the driver writes, resume after a crash, and the Dask path with a worker killed mid-sweep."""

import math
import os
import signal
import sys
import time

import cloudpickle
import pytest

from attnlib.experiments import runner as rn


def _toy(spec):
    """A run: three rows, slow enough that several are in flight when a worker dies."""
    time.sleep(float(spec.get("sleep", 0.0)))
    return [dict(i=i, value=spec["x"] * 10 + i, pid=os.getpid()) for i in range(3)]


cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import the test module


def _sweep(n=8, sleep=0.0):
    specs = [dict(run=f"x={x}", x=x, sleep=sleep, cost=x) for x in range(n)]
    return rn.Sweep("toy", _toy, specs, spec_columns=("x",), columns=("i", "value", "pid"))


def _check_complete(path, n):
    rows = rn.read_sweep(path)
    keys = [(r["run"], r["i"]) for r in rows]
    assert len(keys) == len(set(keys)) == 3 * n  # every run exactly once, every row once
    assert sorted({r["run"] for r in rows}) == sorted(f"x={x}" for x in range(n))
    assert all(r["value"] == r["x"] * 10 + r["i"] and r["nrows"] == 3 for r in rows)
    return rows


def test_serial_run_and_resume_after_a_crash(tmp_path):
    out = str(tmp_path / "toy.csv")
    info = rn.run_sweep(_sweep(), out, progress=False, max_runs=3)  # the driver "dies" after 3 runs
    assert info["runs"] == 3 and info["skipped"] == 0
    # a crash in the middle of a write: a partial run and a torn line at the end of the file
    with open(out, "a") as fh:
        fh.write("7,0,70,1,x=7,3,0.0,0.0\n7,1,7")
    info = rn.run_sweep(_sweep(), out, progress=False)
    assert info["runs"] == 5 and info["skipped"] == 3
    _check_complete(out, 8)
    again = rn.run_sweep(_sweep(), out, progress=False)
    assert again["runs"] == 0 and again["skipped"] == 8


def test_clean_sweep_file_drops_repeated_and_partial_runs(tmp_path):
    out = str(tmp_path / "dup.csv")
    rn.run_sweep(_sweep(2), out, progress=False)
    lines = open(out).read().splitlines()
    with open(out, "a") as fh:
        fh.write("\n".join(lines[1:4]) + "\n")  # run x=1 (first in cost order) written twice
        fh.write(lines[1] + "\n")  # and a partial third copy
    assert rn.clean_sweep_file(out) == {"runs": 2, "rewritten": 1}
    _check_complete(out, 2)
    assert rn.clean_sweep_file(out) == {"runs": 2, "rewritten": 0}


def test_other_files_and_bad_arguments(tmp_path):
    out = tmp_path / "other.csv"
    out.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="columns"):
        rn.run_sweep(_sweep(), str(out), progress=False)
    with pytest.raises(ValueError, match="workers"):
        rn.run_sweep(_sweep(), str(tmp_path / "x.csv"), workers=-1)
    with pytest.raises(ValueError, match="at most one"):
        rn.run_sweep(_sweep(), str(tmp_path / "x.csv"), workers=2, scheduler="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="unique"):
        rn.Sweep("bad", _toy, [dict(run="a"), dict(run="a")], ("x",), ("i",))


@pytest.mark.slow
def test_dask_local_cluster_survives_a_killed_worker(tmp_path):
    """2 workers on loopback; one is killed (SIGKILL) after the first result; the nanny restarts it,
    Dask reschedules its runs, and the CSV ends with every run exactly once."""
    from distributed import Client, LocalCluster

    out = str(tmp_path / "dask.csv")
    n = 10
    with (
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            host="127.0.0.1",
            dashboard_address="127.0.0.1:0",
            worker_dashboard_address="127.0.0.1:0",
        ) as cluster,
        Client(cluster) as client,
    ):
        assert all(addr.startswith("tcp://127.0.0.1:") for addr in client.scheduler_info()["workers"])
        pids = client.run(os.getpid)
        killed = []

        def kill_once(spec, rows):
            if not killed:
                victim = next(p for p in pids.values() if p != rows[0]["pid"])  # the worker still busy
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)

        info = rn.run_sweep(_sweep(n, sleep=1.0), out, client=client, progress=False, on_result=kill_once)
        assert killed and info["runs"] == n
        rows = _check_complete(out, n)
        assert killed[0] not in {r["pid"] for r in rows[3:]}  # its unfinished runs were computed elsewhere
        # the same sweep through the scheduler address: nothing left to do
        again = rn.run_sweep(_sweep(n), out, scheduler=cluster.scheduler_address, progress=False)
        assert again["runs"] == 0 and again["skipped"] == n


@pytest.mark.slow
def test_driver_starts_its_own_local_cluster_on_loopback(tmp_path):
    import psutil

    listening = set()

    def sockets(spec, rows):  # while the cluster is up: every listening socket of the driver's children
        for p in psutil.Process().children(recursive=True):
            for con in p.net_connections(kind="inet"):
                if con.status == psutil.CONN_LISTEN:
                    listening.add(con.laddr.ip)
        for con in psutil.Process().net_connections(kind="inet"):
            if con.status == psutil.CONN_LISTEN:
                listening.add(con.laddr.ip)

    out = str(tmp_path / "own.csv")
    info = rn.run_sweep(_sweep(4), out, workers=2, progress=False, on_result=sockets)
    assert info["runs"] == 4
    _check_complete(out, 4)
    assert listening == {"127.0.0.1"}


def test_read_sweep_types_columns_and_gives_a_frame(tmp_path):
    out = tmp_path / "typed.csv"
    out.write_text(
        "label,kappa,n,flag,x,run,nrows,cpu_s,wall_s\n"
        "cap,0.25,16,1,1e-3,a,2,0.1,0.1\n"
        "balance,,32,0,2,a,2,0.1,0.1\n"
        "cap,0.5,16,1,3,b,2,0.1,0.1\n"  # b is partial: left out
    )
    rows = rn.read_sweep(str(out))
    assert len(rows) == 2 and [r["run"] for r in rows] == ["a", "a"]
    assert rows[0]["label"] == "cap" and rows[0]["kappa"] == 0.25 and math.isnan(rows[1]["kappa"])
    assert type(rows[0]["n"]) is int and type(rows[1]["flag"]) is int and type(rows[1]["x"]) is float
    assert type(rows[0]["nrows"]) is int and rows[0]["run"] == "a"
    df = rn.read_sweep(str(out), frame=True)
    assert list(df.columns) == "label,kappa,n,flag,x,run,nrows,cpu_s,wall_s".split(",")
    assert str(df["n"].dtype) == "int64" and df["kappa"].isna().tolist() == [False, True]
    with pytest.raises(ValueError, match="sweep CSV"):
        (tmp_path / "plain.csv").write_text("a,b\n1,2\n")
        rn.read_sweep(str(tmp_path / "plain.csv"))
    with pytest.raises(ValueError, match="does not exist"):
        rn.read_sweep(str(tmp_path / "missing.csv"))


def _toy_batch(specs):
    """The toy runs computed together: one list of rows per spec, as ``_toy`` gives them."""
    return [_toy(s) for s in specs]


def _batched_sweep(n=8, max_group=3):
    specs = [dict(run=f"x={x}", x=x, sleep=0.0, cost=x) for x in range(n)]
    return rn.Sweep(
        "toy", _toy, specs, spec_columns=("x",), columns=("i", "value", "pid"),
        batch=_toy_batch, group=lambda s: str(s["x"] % 2), max_group=max_group,
    )  # fmt: skip


def test_batched_runs_are_written_one_block_each_and_resume(tmp_path):
    out = str(tmp_path / "batched.csv")
    sw = _batched_sweep()
    units = rn._tasks(sw, sw.specs)
    assert sorted(len(u) for u in units) == [1, 1, 3, 3]  # two groups of 4, at most 3 per call
    assert all(len({s["x"] % 2 for s in u}) == 1 for u in units)
    info = rn.run_sweep(sw, out, progress=False, max_runs=5)  # stops inside a group
    assert info["runs"] == 5
    info = rn.run_sweep(_batched_sweep(), out, progress=False)
    assert info == dict(info, runs=3, skipped=5)
    rows = _check_complete(out, 8)
    sequential = str(tmp_path / "sequential.csv")
    rn.run_sweep(_sweep(), sequential, progress=False)
    key = lambda r: (r["run"], r["i"])  # noqa: E731
    strip = lambda r: {k: v for k, v in r.items() if k not in ("cpu_s", "wall_s", "pid")}  # noqa: E731
    assert sorted(map(strip, rows), key=key) == sorted(map(strip, rn.read_sweep(sequential)), key=key)
    info = rn.run_sweep(_batched_sweep(), str(tmp_path / "dask.csv"), workers=2, progress=False)
    assert info["runs"] == 8
    _check_complete(str(tmp_path / "dask.csv"), 8)


def test_batch_needs_a_group_and_gives_one_list_per_spec(tmp_path):
    with pytest.raises(ValueError, match="batch, group"):
        rn.Sweep("toy", _toy, [dict(run="a", x=1)], ("x",), ("i", "value", "pid"), batch=_toy_batch)
    with pytest.raises(ValueError, match="max_group"):
        rn.Sweep("toy", _toy, [dict(run="a", x=1)], ("x",), ("i", "value", "pid"), max_group=0)
    with pytest.raises(ValueError, match="batch"):
        rn.execute_batch(lambda specs: [], [dict(run="a", x=1)])
