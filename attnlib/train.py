r"""Training: Algorithm 1 (structure-aware gradient descent) and the baselines.

``method="structured"`` is Algorithm 1 of the book:

1. spectral initialisation (``init="spectral"``);
2. descent on the regularized objective ``Qhat = Lhat + Rhat`` (``regularize``);
3. the covariance preconditioner ``A <- A - lr gA Sigmahat^{-1}``,
   ``B <- B - lr Sigmahat^{-1} gB Sigmahat^{-1}`` (``precondition``), i.e. plain
   gradient descent in the coordinates ``(At, C)``;
4. a renormalisation step after each update (``renormalize``, see
   :func:`attnlib.geometry.renormalize`): by default ``"balance"``, which
   replaces ``(At, C)`` by the closest balanced factorization of the current
   product ``At C``. It keeps the population loss, bounds the softmax scale by
   ``||C||_F^2 = ||At C||_*`` and removes the components of ``C`` that the
   product does not see. The iterates are then balanced, so the regularizer's
   gradient vanishes at them: with ``"balance"`` every step the regularizer is
   inert, and it does the balancing (more slowly) when the renormalisation is
   switched off or set to ``"scale"``.

Each component can be switched off on its own. ``"gd"``, ``"sgd"`` (minibatches
of queries, all ``n`` keys) and ``"adam"`` are the baselines; they default to
all components off but accept the same switches (except the preconditioner
for Adam). :func:`train` works on one sample ``(X, Y)``; :func:`train_population`
runs the same algorithms on the closed-form population objective.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from ._validate import check_matrix, check_nonneg_float, check_positive_int, resolve_device, resolve_dtype
from .attention import empirical_loss
from .geometry import distance_to_manifold, regularizer, renormalize as _renormalize
from .init import random_init, spectral_init
from .task import Task, check_samples, empirical_task, make_generator

__all__ = ["train", "train_population", "best_of_grid", "History", "DivergenceError", "METHODS"]

METHODS = ("structured", "gd", "sgd", "adam")


class DivergenceError(FloatingPointError):
    """Raised when the objective or the parameters stop being finite (step size too large)."""


@dataclass
class History:
    """Record of one training run.

    Lists have one entry per recorded iterate (``steps`` holds the iteration
    numbers, starting at 0 = the initialisation). ``objective`` is the
    (regularized) training objective, ``loss`` its unregularized part,
    ``grad_norm`` the Euclidean norm of the objective's gradient, ``time`` the
    cumulative wall time of the updates in seconds. ``excess`` (population
    ``L - L*``) and ``dist`` (``dist_P`` to the manifold) are filled when a
    task is known. ``A`` and ``B`` are the final parameters (after a divergence
    with ``on_divergence="stop"``: the last finite iterate, and ``diverged`` is set).
    """

    method: str
    config: Dict[str, object]
    steps: List[int] = field(default_factory=list)
    objective: List[float] = field(default_factory=list)
    loss: List[float] = field(default_factory=list)
    grad_norm: List[float] = field(default_factory=list)
    time: List[float] = field(default_factory=list)
    excess: List[float] = field(default_factory=list)
    dist: List[float] = field(default_factory=list)
    A: Optional[torch.Tensor] = None
    B: Optional[torch.Tensor] = None
    diverged: bool = False

    def __len__(self) -> int:
        return len(self.steps)

    def as_arrays(self) -> Dict[str, np.ndarray]:
        """The recorded series as numpy arrays (empty series are left out)."""
        keys = ("steps", "objective", "loss", "grad_norm", "time", "excess", "dist")
        return {k: np.asarray(getattr(self, k)) for k in keys if len(getattr(self, k))}

    def steps_to(self, tol: float, series: str = "excess") -> Optional[int]:
        """First recorded iteration at which ``series`` is ``<= tol`` (``None`` if never)."""
        vals = getattr(self, series)
        for s, v in zip(self.steps, vals):
            if v <= tol:
                return s
        return None


def _resolve_flags(method, regularize, precondition, renormalize):
    if method not in METHODS:
        raise ValueError(f"method: expected one of {METHODS}, got {method!r}")
    structured = method == "structured"
    regularize = structured if regularize is None else bool(regularize)
    precondition = structured if precondition is None else bool(precondition)
    if renormalize is None:
        renormalize = "balance" if structured else None
    elif renormalize is True:
        renormalize = "balance"
    elif renormalize is False:
        renormalize = None
    if renormalize not in (None, "scale", "balance"):
        raise ValueError(f"renormalize: expected None, True, False, 'scale' or 'balance', got {renormalize!r}")
    if method == "adam" and precondition:
        raise ValueError("precondition: the covariance preconditioner is not defined for method='adam'")
    return regularize, precondition, renormalize


def _initial_params(init, d, k, *, spectral: Callable[[], Tuple[torch.Tensor, torch.Tensor]],
                    init_scale, seed, dtype, device):
    if isinstance(init, str):
        if init == "spectral":
            A, B = spectral()
        elif init == "random":
            A, B = random_init(d, k, scale=init_scale, seed=seed, dtype=dtype, device=device)
        else:
            raise ValueError(f"init: expected 'spectral', 'random' or a pair (A, B), got {init!r}")
    elif isinstance(init, (tuple, list)) and len(init) == 2:
        A = check_matrix(init[0], "init[0] (A)", (k, d))
        B = check_matrix(init[1], "init[1] (B)", (d, d))
    else:
        raise ValueError(f"init: expected 'spectral', 'random' or a pair (A, B), got {type(init).__name__}")
    return (A.detach().to(device=device, dtype=dtype).clone(),
            B.detach().to(device=device, dtype=dtype).clone())


def _run(*, loss_fn, geom: Optional[Task], n_queries: Optional[int], A, B, steps, lr, method,
         lam, regularize, precondition, renormalize, batch_size, seed, task, record_every,
         progress, on_divergence, config) -> History:
    """Shared optimisation loop (``loss_fn(A, B, idx)``: training loss, ``idx`` rows or None)."""
    hist = History(method=method, config=config)
    A = A.clone().requires_grad_(True)
    B = B.clone().requires_grad_(True)
    if precondition:
        S_inv = torch.linalg.inv(geom.Sigma)
    opt = torch.optim.Adam([A, B], lr=lr) if method == "adam" else None
    gen = make_generator(seed, name="seed") if method == "sgd" else None
    eval_task = task.to(dtype=A.dtype, device=A.device) if task is not None else None
    overflow = float(torch.finfo(A.dtype).max) ** 0.5

    def objective(idx):
        loss = loss_fn(A, B, idx)
        reg = regularizer(A, B, geom, lam) if regularize else loss.new_zeros(())
        return loss, loss + reg

    def check_finite(val, t):
        ok = bool(torch.isfinite(val)) and bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all())
        if not ok:
            hist.diverged = True
            if on_divergence == "raise":
                raise DivergenceError(
                    f"training diverged at step {t} (method={method!r}, lr={lr}): the objective or the "
                    f"parameters are no longer finite; lower lr")
        return ok

    def record(t, loss, obj, gnorm, elapsed):
        """Append one row; False (divergence) if the population excess is no longer finite."""
        if eval_task is not None:
            with torch.no_grad():
                ex = float(eval_task.excess_risk(A, B))
                # The finite-n loss stays bounded when B blows up (hard attention); the population excess
                # does not. Past sqrt(finfo.max) the next matrix products overflow: call it a divergence.
                if not ex <= overflow:
                    return check_finite(torch.tensor(float("inf")), t)
                hist.excess.append(ex)
                hist.dist.append(float(distance_to_manifold(A, B, eval_task)))
        hist.steps.append(t)
        hist.loss.append(float(loss))
        hist.objective.append(float(obj))
        hist.grad_norm.append(float(gnorm) if gnorm is not None else float("nan"))
        hist.time.append(elapsed)
        return True

    elapsed = 0.0
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, desc=method, leave=False)
    else:
        bar = None
    for t in range(steps + 1):
        rec = (t % record_every == 0) or t == steps
        gA = gB = gnorm = None
        if method == "sgd":
            if rec:  # full objective for the record; not part of the timed update
                with torch.no_grad():
                    full_loss, full_obj = objective(None)
        else:
            t0 = time.perf_counter()
            full_loss, full_obj = objective(None)
            gA, gB = torch.autograd.grad(full_obj, (A, B))
            gnorm = torch.sqrt(torch.sum(gA * gA) + torch.sum(gB * gB))
            elapsed += time.perf_counter() - t0
        if rec:
            if not check_finite(full_obj.detach(), t):
                break
            if not record(t, full_loss.detach(), full_obj.detach(), gnorm, elapsed):
                break
        if t == steps:
            break
        t0 = time.perf_counter()
        last_A, last_B = A.detach().clone(), B.detach().clone()
        if method == "sgd":
            idx = torch.randperm(n_queries, generator=gen)[:batch_size].to(A.device)
            _, obj = objective(idx)
            gA, gB = torch.autograd.grad(obj, (A, B))
        with torch.no_grad():
            if method == "adam":
                A.grad, B.grad = gA, gB
                opt.step()
            else:
                if precondition:
                    gA = gA @ S_inv
                    gB = S_inv @ gB @ S_inv
                A -= lr * gA
                B -= lr * gB
            finite = bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all())
            if finite and renormalize is not None:
                A_new, B_new = _renormalize(A, B, geom, renormalize)
                A.copy_(A_new)
                B.copy_(B_new)
                finite = bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all())
        elapsed += time.perf_counter() - t0
        if not finite:
            check_finite(A.detach().sum() + B.detach().sum(), t + 1)  # raises unless on_divergence="stop"
            with torch.no_grad():  # keep the last finite iterate, never return NaN parameters
                A.copy_(last_A)
                B.copy_(last_B)
            break
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    hist.A, hist.B = A.detach(), B.detach()
    return hist


def _common_checks(steps, lr, lam, record_every, on_divergence):
    steps = check_positive_int(steps, "steps", minimum=0)
    lr = check_nonneg_float(lr, "lr", positive=True)
    lam = check_nonneg_float(lam, "lam")
    record_every = check_positive_int(record_every, "record_every")
    if on_divergence not in ("raise", "stop"):
        raise ValueError(f"on_divergence: expected 'raise' or 'stop', got {on_divergence!r}")
    return steps, lr, lam, record_every


def train(X, Y, *, steps: int, lr: float, method: str = "structured",
          init: Union[str, Tuple[torch.Tensor, torch.Tensor]] = "spectral",
          lam: float = 1.0, regularize: Optional[bool] = None, precondition: Optional[bool] = None,
          renormalize: Union[None, bool, str] = None, batch_size: Optional[int] = None,
          init_scale: float = 1e-2, seed: int = 0, task: Optional[Task] = None,
          record_every: int = 1, progress: bool = False, on_divergence: str = "raise",
          dtype=None, device=None) -> History:
    """Train the attention layer on one sequence ``(X, Y)`` (shapes (n, d), (n, k)).

    Parameters
    ----------
    steps, lr : number of updates and step size.
    method : ``"structured"`` (Algorithm 1), ``"gd"``, ``"sgd"`` or ``"adam"``.
    init : ``"spectral"`` (:func:`~attnlib.init.spectral_init`), ``"random"``
        (:func:`~attnlib.init.random_init` with ``init_scale`` and ``seed``) or a pair ``(A, B)``.
    lam : weight of the balancing regularizer.
    regularize, precondition, renormalize : switch each structured component on
        (``True``) or off (``False``); ``None`` (the default) means on for
        ``"structured"`` and off otherwise. ``renormalize`` also takes the mode,
        ``"balance"`` (what ``True`` and the structured default mean) or ``"scale"``.
    batch_size : queries per SGD step (default ``max(1, n // 8)``).
    seed : seeds the random initialisation and the SGD minibatches.
    task : if given, the population excess risk and ``dist_P`` are recorded at every step.
    record_every : record every this many steps (the last step is always recorded).
    progress : show a tqdm progress bar.
    on_divergence : ``"raise"`` (:class:`DivergenceError`) or ``"stop"`` (``History.diverged``).
    dtype, device : move ``X``, ``Y`` there first (default: keep theirs).

    The regularizer, preconditioner and renormalisation use ``Sigmahat = X^T X / n``.
    """
    X, Y = check_samples(X, Y)
    if dtype is not None or device is not None:
        X = X.to(dtype=resolve_dtype(dtype) if dtype is not None else X.dtype,
                 device=resolve_device(device) if device is not None else X.device)
        Y = Y.to(X)
    steps, lr, lam, record_every = _common_checks(steps, lr, lam, record_every, on_divergence)
    regularize, precondition, renormalize = _resolve_flags(method, regularize, precondition, renormalize)
    n, d = X.shape
    k = Y.shape[1]
    if task is not None and (not isinstance(task, Task) or task.d != d or task.k != k):
        raise ValueError(f"task: expected an attnlib.Task with d = {d}, k = {k}")
    geom = None
    if regularize or precondition or renormalize:
        if n < d:
            raise ValueError(f"X: the structured components need n >= d (Sigmahat invertible), got n = {n}, d = {d}")
        geom = empirical_task(X, Y)
    if method == "sgd":
        batch_size = max(1, n // 8) if batch_size is None else check_positive_int(batch_size, "batch_size")
        if batch_size > n:
            raise ValueError(f"batch_size: expected at most n = {n}, got {batch_size}")
    A, B = _initial_params(init, d, k, spectral=lambda: spectral_init(X, Y), init_scale=init_scale,
                           seed=seed, dtype=X.dtype, device=X.device)
    config = dict(n=n, d=d, k=k, steps=steps, lr=lr, method=method,
                  init=init if isinstance(init, str) else "given", lam=lam, regularize=regularize,
                  precondition=precondition, renormalize=renormalize, batch_size=batch_size,
                  init_scale=init_scale, seed=seed, objective="empirical")

    def loss_fn(A_, B_, idx):
        return empirical_loss(A_, B_, X, Y, queries=idx)

    return _run(loss_fn=loss_fn, geom=geom, n_queries=n, A=A, B=B, steps=steps, lr=lr, method=method,
                lam=lam, regularize=regularize, precondition=precondition, renormalize=renormalize,
                batch_size=batch_size, seed=seed, task=task, record_every=record_every,
                progress=progress, on_divergence=on_divergence, config=config)


def train_population(task: Task, *, steps: int, lr: float, method: str = "structured",
                     init: Union[str, Tuple[torch.Tensor, torch.Tensor]] = "random",
                     lam: float = 1.0, regularize: Optional[bool] = None,
                     precondition: Optional[bool] = None, renormalize: Union[None, bool, str] = None,
                     init_scale: float = 1e-2, seed: int = 0, record_every: int = 1,
                     progress: bool = False, on_divergence: str = "raise") -> History:
    """Run the same algorithms on the closed-form population objective ``Q = L + R`` (no samples).

    The components use the true ``Sigma``; ``init="spectral"`` is the
    infinite-data spectral initialisation (exactly on the manifold), so the
    default here is ``"random"``. ``method="sgd"`` is not defined without
    samples. ``excess`` and ``dist`` are always recorded.
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    if method == "sgd":
        raise ValueError("method: 'sgd' needs samples (minibatches of queries); use train(X, Y, ...)")
    steps, lr, lam, record_every = _common_checks(steps, lr, lam, record_every, on_divergence)
    regularize, precondition, renormalize = _resolve_flags(method, regularize, precondition, renormalize)

    def spectral():
        from .geometry import manifold_point
        U, s, V = task.svd
        return manifold_point(task, V)

    A, B = _initial_params(init, task.d, task.k, spectral=spectral, init_scale=init_scale, seed=seed,
                           dtype=task.dtype, device=task.device)
    config = dict(d=task.d, k=task.k, steps=steps, lr=lr, method=method,
                  init=init if isinstance(init, str) else "given", lam=lam, regularize=regularize,
                  precondition=precondition, renormalize=renormalize, init_scale=init_scale,
                  seed=seed, objective="population")

    def loss_fn(A_, B_, idx):
        return task.population_loss(A_, B_)

    return _run(loss_fn=loss_fn, geom=task, n_queries=None, A=A, B=B, steps=steps, lr=lr, method=method,
                lam=lam, regularize=regularize, precondition=precondition, renormalize=renormalize,
                batch_size=None, seed=seed, task=task, record_every=record_every, progress=progress,
                on_divergence=on_divergence, config=config)


def best_of_grid(run: Callable[..., History], lrs, *, score: Optional[Callable[[History], Optional[float]]] = None
                 ) -> Optional[History]:
    """Run ``run(lr=lr, on_divergence="stop")`` for each step size in ``lrs`` and return the best History.

    ``score(h)`` ranks runs (lower is better; ``None`` disqualifies a run); the
    default is the final training objective. Diverged runs are disqualified.
    Returns ``None`` if no run qualifies. This is the documented step-size
    selection of the book's comparisons: every method gets the same criterion.
    """
    if score is None:
        def score(h):
            return h.objective[-1]
    best, best_score = None, None
    for lr in lrs:
        h = run(lr=lr, on_divergence="stop")
        if h.diverged:
            continue
        s = score(h)
        if s is not None and (best_score is None or s < best_score):
            best, best_score = h, s
    return best
