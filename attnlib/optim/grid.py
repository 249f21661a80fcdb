"""Step-size selection: every method gets its best step size from a grid, by one criterion.

:func:`attnlib.optim.best_of_grid` runs a grid and returns the best run; :class:`GridCache` stores a grid's
scores in a JSON file so that a chapter re-runs only the selected step (and checks it).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from .._validate import check_nonneg_float, check_positive_int
from .loop import History

__all__ = ["best_of_grid", "GridCache", "grid_search", "log_excess_score"]


def _score_grid(run, lrs, score):
    """Run every step size; returns ``(best History or None, [score or None per step size])``."""
    best, best_score, scores = None, None, []
    for lr in lrs:
        h = run(lr=lr, on_divergence="stop")
        s = None if h.diverged else score(h)
        s = None if s is None else float(s)
        scores.append(s)
        if s is not None and (best_score is None or s < best_score):
            best, best_score = h, s
    return best, scores


def _final_objective(h: History) -> float:
    return h.objective[-1]


def _check_grid(lrs) -> List[float]:
    try:
        grid = [float(lr) for lr in lrs]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"lrs: expected a sequence of positive step sizes, got {lrs!r}") from exc
    if not grid or any(not np.isfinite(lr) or lr <= 0 for lr in grid):
        raise ValueError(f"lrs: expected a non-empty sequence of positive step sizes, got {lrs!r}")
    return grid


def best_of_grid(
    run: Callable[..., History], lrs, *, score: Optional[Callable[[History], Optional[float]]] = None
) -> Optional[History]:
    """Run ``run(lr=lr, on_divergence="stop")`` for each step size in ``lrs`` and return the best History.

    ``score(h)`` ranks runs (lower is better; ``None`` disqualifies a run); the
    default is the final training objective. Diverged runs are disqualified.
    Returns ``None`` if no run qualifies (ties: the first step size in ``lrs``).
    This is the documented step-size selection of the book's comparisons: every
    method gets the same criterion. :class:`GridCache` stores the scores of a grid
    so that a chapter re-runs only the selected step.
    """
    _check_grid(lrs)
    return _score_grid(run, lrs, _final_objective if score is None else score)[0]


class GridCache:
    """Step-size grids run once, stored in a JSON file, and replayed by re-running only the selected step.

    A fair comparison gives every method its best step size from a grid wide
    enough that the best step is interior; that costs one run per grid point.
    ``best(key, run, lrs, score=..., criterion=...)`` does what :func:`attnlib.optim.best_of_grid`
    does and stores, under ``key``, the grid, every step size's score (``None``:
    diverged or disqualified), the selected step size and the name of the
    criterion. When the file already holds ``key`` with the same grid and
    criterion, only the selected step size is run again and its score is
    compared with the stored one (relative tolerance ``rtol``): a file that no
    longer matches the code raises ``RuntimeError`` instead of silently
    selecting from other results. Some runs amplify round-off (gradient descent
    leaving a saddle: a change of a few units in the last place of the step size
    moves the score in its third digit, so another CPU's arithmetic does too).
    A replayed score outside ``rtol`` is therefore accepted when it lies within
    ``AMPLIFICATION`` times the spread that the ``PROBES`` (step sizes perturbed
    by a few units in the last place) produce on this machine; such keys are
    listed in ``amplified`` with the stored score, the new one and the spread.
    For a run that does not amplify round-off the spread is itself round-off,
    so a real change in the code is still caught. A missing ``key`` (or a changed grid or
    criterion) runs the whole grid and updates the file.

    ``refresh=True`` re-runs every grid requested in this session (once) and
    keeps the file's other entries, so that several notebooks sharing one file
    (a chapter's pages) can each refresh their own grids; ``refresh=None`` (default) reads the environment
    variable ``ATTNLIB_REFRESH_GRIDS`` (``"1"``: refresh). ``position(key)``
    says whether the selected step is ``"interior"`` or at the ``"lowest"`` or
    ``"highest"`` end of its grid; ``verify(key, run)`` re-runs a whole stored
    grid and returns the largest relative deviation of its scores (a spot check).
    """

    def __init__(self, path, *, refresh: Optional[bool] = None, rtol: float = 1e-6):
        import os

        self.path = os.fspath(path)
        if refresh is None:
            refresh = os.environ.get("ATTNLIB_REFRESH_GRIDS", "") == "1"
        self.refresh = bool(refresh)
        self.rtol = check_nonneg_float(rtol, "rtol", positive=True)
        self.entries: Dict[str, dict] = {}
        if os.path.exists(self.path):
            import json

            with open(self.path) as fh:
                data = json.load(fh)
            if not isinstance(data, dict):
                raise ValueError(f"path: expected a JSON object of grid entries in {self.path!r}")
            self.entries = data
        self.replayed: List[str] = []
        self.amplified: Dict[str, dict] = {}
        self.computed: List[str] = []

    def save(self) -> None:
        """Write the entries to ``path`` (sorted keys, one entry per block)."""
        import json
        import os

        if os.path.dirname(self.path):
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w") as fh:
            json.dump(self.entries, fh, indent=1, sort_keys=True)
            fh.write("\n")

    def _entry(self, key: str) -> dict:
        if key not in self.entries:
            raise ValueError(f"key: no grid stored under {key!r} in {self.path!r}")
        return self.entries[key]

    def best(
        self,
        key: str,
        run: Callable[..., History],
        lrs,
        *,
        score: Optional[Callable[[History], Optional[float]]] = None,
        criterion: str = "final training objective",
    ) -> Optional[History]:
        """The History of the selected step size of ``run`` on the grid ``lrs`` (``None`` if every run failed)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key: expected a non-empty string, got {key!r}")
        grid = _check_grid(lrs)
        score = _final_objective if score is None else score
        e = None if self.refresh and key not in self.computed else self.entries.get(key)
        if e is not None and e.get("grid") == grid and e.get("criterion") == criterion:
            self.replayed.append(key)
            if e["lr"] is None:
                return None
            h = run(lr=e["lr"], on_divergence="stop")
            s = None if h.diverged else score(h)
            stored = e["scores"][grid.index(e["lr"])]
            if s is not None and not np.isclose(float(s), stored, rtol=self.rtol, atol=0.0):
                spread = self._roundoff_spread(run, e["lr"], float(s), score)
                if abs(float(s) - stored) <= self.AMPLIFICATION * spread:
                    self.amplified[key] = dict(stored=stored, now=float(s), spread=spread)
                    return h
            if s is None or not np.isclose(float(s), stored, rtol=self.rtol, atol=0.0):
                raise RuntimeError(
                    f"{self.path}: the stored grid {key!r} no longer matches the code (score at lr = {e['lr']}: "
                    f"stored {stored!r}, now {s!r}); rerun with refresh=True or ATTNLIB_REFRESH_GRIDS=1"
                )
            return h
        best, scores = _score_grid(run, grid, score)
        self.entries[key] = dict(
            grid=grid, scores=scores, lr=None if best is None else best.config["lr"], criterion=criterion
        )
        self.computed.append(key)
        self.save()
        return best

    #: relative perturbations of the step size, a few units in the last place, that probe a run's round-off
    #: sensitivity; and how far beyond their spread a replayed score may lie and still count as round-off
    PROBES = (1e-15, -1e-15, 3e-15, -3e-15)
    AMPLIFICATION = 5.0

    @classmethod
    def _roundoff_spread(cls, run, lr, s, score) -> float:
        """How far round-off moves this run's score: the largest change under the step-size probes."""
        spread = 0.0
        for delta in cls.PROBES:
            h = run(lr=lr * (1.0 + delta), on_divergence="stop")
            if h.diverged or score(h) is None:
                return float("inf")
            spread = max(spread, abs(float(score(h)) - s))
        return spread

    def scores(self, key: str) -> Dict[float, Optional[float]]:
        """``{step size: score}`` of a stored grid (``None``: diverged or disqualified)."""
        e = self._entry(key)
        return dict(zip(e["grid"], e["scores"]))

    def selected(self, key: str) -> Optional[float]:
        """The selected step size of a stored grid."""
        return self._entry(key)["lr"]

    def position(self, key: str) -> str:
        """``"interior"``, ``"lowest"`` or ``"highest"``: where the selected step lies in its (sorted) grid."""
        e = self._entry(key)
        if e["lr"] is None:
            raise ValueError(f"key: every run of the grid {key!r} failed; no step size was selected")
        grid = sorted(e["grid"])
        if e["lr"] == grid[0]:
            return "lowest"
        if e["lr"] == grid[-1]:
            return "highest"
        return "interior"

    def verify(
        self, key: str, run: Callable[..., History], *, score: Optional[Callable[[History], Optional[float]]] = None
    ) -> float:
        """Re-run the whole stored grid ``key``; the largest relative deviation from the stored scores.

        A run that diverges (or is disqualified) where the stored one did not, or the
        other way round, counts as ``inf``.
        """
        e = self._entry(key)
        _, scores = _score_grid(run, e["grid"], _final_objective if score is None else score)
        dev = 0.0
        for new, old in zip(scores, e["scores"]):
            if (new is None) != (old is None):
                return float("inf")
            if new is not None:
                dev = max(dev, abs(new - old) / max(abs(old), 1e-300))
        return dev


def grid_search(
    run: Callable[..., History],
    lrs: Sequence[float],
    *,
    score: Optional[Callable[[History], float]] = None,
    extend: int = 4,
) -> Dict[str, object]:
    """Run ``run(lr=lr, on_divergence="stop")`` on the log grid ``lrs`` and select the best step.

    Diverged runs are disqualified. While the selected step is the lowest or the highest of the
    grid, the grid is extended by one point beyond that end (same log spacing), at most ``extend``
    times (when every run diverged: towards smaller steps). Returns ``dict(best=History or None,
    lrs=[...], scores=[... or None], lr=selected,
    position="interior"|"lowest"|"highest")``.
    """
    score = log_excess_score if score is None else score
    grid = sorted(float(x) for x in lrs)
    if len(grid) < 3 or any(not math.isfinite(x) or x <= 0 for x in grid):
        raise ValueError(f"lrs: expected at least 3 positive step sizes, got {lrs!r}")
    ratio = grid[1] / grid[0]
    extend = check_positive_int(extend, "extend", minimum=0)
    results: Dict[float, Optional[History]] = {}
    scores: Dict[float, Optional[float]] = {}

    def ev(lr):
        h = run(lr=lr, on_divergence="stop")
        results[lr] = None if h.diverged else h
        scores[lr] = None if h.diverged else float(score(h))

    for lr in grid:
        ev(lr)
    for _ in range(extend):
        ok = {lr: s for lr, s in scores.items() if s is not None}
        lo, hi = min(scores), max(scores)
        lr_best = min(ok, key=lambda x: (ok[x], x)) if ok else lo  # all diverged: smaller steps
        if lr_best == lo:
            ev(lo / ratio)
        elif lr_best == hi:
            ev(hi * ratio)
        else:
            break
    ok = {lr: s for lr, s in scores.items() if s is not None}
    lrs_sorted = sorted(scores)
    if not ok:
        return dict(best=None, lrs=lrs_sorted, scores=[None] * len(lrs_sorted), lr=None, position="none")
    lr_best = min(ok, key=lambda x: (ok[x], x))
    pos = "lowest" if lr_best == lrs_sorted[0] else "highest" if lr_best == lrs_sorted[-1] else "interior"
    return dict(best=results[lr_best], lrs=lrs_sorted, scores=[scores[x] for x in lrs_sorted], lr=lr_best, position=pos)


def log_excess_score(h: History, floor: float = 1e-16) -> float:
    """Mean of ``log10(max(excess, floor))`` over the recorded steps (lower is better; the step-size criterion).

    It rewards reaching a small excess early and staying there: a run that stalls at a floor, or
    leaves a tight excess again, scores worse than one that keeps converging.
    """
    e = np.maximum(np.asarray(h.excess, dtype=float), floor)
    return float(np.mean(np.log10(e)))
