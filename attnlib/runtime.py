"""How many CPU threads torch uses: decided here, and only here.

torch's default intra-op thread count is the number of cores it sees, which
is wrong twice over on small machines: containers (Binder, CI runners) often
show many cores but grant one through the cgroup CPU quota, and on a busy
2-core machine two threads that spin-wait for each other collapse (measured:
one structured training step at n = 1024 took 38 ms with one thread and
760 ms with two while another CPU-bound process ran; see
``benchmarks/contention.py``). The book's problems are small (d <= 8), so
intra-op parallelism gains little even on an idle machine.

Policy, applied once per process when the first attnlib module that computes
with torch is imported (``attnlib._validate`` calls :func:`configure_threads`):

* ``ATTNLIB_NUM_THREADS=<int>``: exactly that many threads (capped at the CPUs granted);
* ``ATTNLIB_NUM_THREADS=auto``: as many threads as CPUs are granted
  (:func:`granted_cpus`), for large experiments on a machine of one's own;
* unset (the default): one thread, the right choice for the book's sizes.

:func:`configure_threads` applies a policy at run time; :func:`thread_info`
reports what is in force.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Union

import torch

__all__ = ["ENV_VAR", "granted_cpus", "threads_from_env", "configure_threads", "thread_info"]

ENV_VAR = "ATTNLIB_NUM_THREADS"
_DEFAULT_THREADS = 1


def _cgroup_quota(root: str = "/sys/fs/cgroup") -> Optional[float]:
    """CPUs allowed by the cgroup CPU quota (v2 ``cpu.max`` or v1 ``cfs_quota_us``); None if unlimited."""
    try:
        with open(os.path.join(root, "cpu.max")) as fh:  # cgroup v2: "max 100000" or "200000 100000"
            quota, period = fh.read().split()[:2]
        if quota != "max" and float(period) > 0:
            return float(quota) / float(period)
        return None
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as fh:
            quota = float(fh.read().strip())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as fh:
            period = float(fh.read().strip())
        if quota > 0 and period > 0:
            return quota / period
    except (OSError, ValueError):
        pass
    return None


def granted_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The number of CPUs this process may actually use.

    The smaller of the CPU affinity mask (``os.sched_getaffinity``; the core
    count where that is not available) and the cgroup CPU quota rounded up;
    at least 1.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def threads_from_env(value: Optional[str] = None, *, granted: Optional[int] = None) -> int:
    """The thread count the policy gives for the environment value ``value`` (default: read ``ATTNLIB_NUM_THREADS``).

    Raises ``ValueError`` naming ``ATTNLIB_NUM_THREADS`` for anything but a positive integer or ``auto``.
    """
    if value is None:
        value = os.environ.get(ENV_VAR)
    granted = granted_cpus() if granted is None else int(granted)
    if value is None or value.strip() == "":
        return min(_DEFAULT_THREADS, granted)
    value = value.strip().lower()
    if value == "auto":
        return granted
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV_VAR}: expected a positive integer or 'auto', got {value!r}")
    return min(n, granted)


def configure_threads(threads: Union[None, int, str] = None) -> int:
    """Set torch's intra-op thread count by the policy above and return it.

    ``threads``: ``None`` reads ``ATTNLIB_NUM_THREADS``; an integer or ``"auto"``
    is interpreted like that variable. Inter-op threads are set to 1 when
    torch still allows it (before any parallel work has run).
    """
    n = threads_from_env(None if threads is None else str(threads))
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only allowed once, before inter-op work started
        pass
    return n


def thread_info() -> dict:
    """What is in force: ``{"torch_threads", "granted_cpus", "env"}``."""
    return {"torch_threads": torch.get_num_threads(), "granted_cpus": granted_cpus(), "env": os.environ.get(ENV_VAR)}
