r"""Training: Algorithm 1 (structure-aware gradient descent) and the baselines, behind one loop.

``method="structured"`` is Algorithm 1 of the book:

1. spectral initialization (``init="spectral"``);
2. descent on the regularized objective ``Qhat = Lhat + Rhat`` (``regularize``);
3. the covariance preconditioner ``A <- A - lr gA Sigmahat^{-1}``,
   ``B <- B - lr Sigmahat^{-1} gB Sigmahat^{-1}`` (``precondition``), i.e. plain
   gradient descent in the coordinates ``(At, C)``;
4. a renormalization step after each update (``renormalize``, see
   :func:`attnlib.geometry.renormalize`): by default ``"balance"``, which
   replaces ``(At, C)`` by the closest balanced factorization of the current
   product ``P = At C``. It keeps the population loss, removes the components
   of ``C`` that the product does not see, and yields the factorization of
   least total norm ``(||At||_F^2 + ||C||_F^2) / 2 = ||P||_*`` (nuclear norm), whose
   softmax scale ``lambda_max(C^T C) = s_1(P)`` is fixed by the product. (It does
   not minimize ``||C||_F^2`` by itself: ``(t At, C / t)`` makes that arbitrarily
   small.) The iterates are then balanced, so the regularizer's gradient
   vanishes at them: with ``"balance"`` every step and a balanced start the
   regularizer is inert; it does the balancing (more slowly) when the
   renormalization is switched off (``False``) or set to ``"scale"``, which
   only equalizes ``||At||_F`` and ``||C||_F``.

The structured method is affine-equivariant: training on ``X G`` (any invertible
``G``) and mapping back with ``(A G^T, G B G^T)`` gives the same iterates as
training on ``X``; with ``G = Sigmahat^{-1/2}`` the preconditioned step is plain
gradient descent on whitened tokens (chapter 5 of the book proves it; the tests
check it).

Architecture. One loop (:func:`run`) drives a *step rule* (:class:`Step`)
on an :class:`Objective`; a :class:`DivergenceGuard` is the single place that
decides what a non-finite or overflowing iterate means, and a
:class:`Recorder` the single place that writes the :class:`History`. A
method is a name in :data:`~attnlib.train.METHODS` mapped to a :class:`Method` (a factory
for its step rule plus which structured components it uses by default), so
adding a method is registering one step rule (:func:`register_method`).

``"gd"``, ``"sgd"`` (minibatches of queries, all ``n`` keys) and ``"adam"``
are the baselines; they default to all components off but accept the same
switches (except the preconditioner for Adam). ``whiten=True`` trains on the
whitened tokens ``X Sigmahat^{-1/2}`` and maps the parameters back, the fair
baseline for the preconditioner. :func:`train` works on one sample ``(X, Y)``;
:func:`train_population` runs the same algorithms on the closed-form
population objective.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from ._validate import (
    check_matrix,
    check_nonneg_float,
    check_positive_int,
    check_samples,
    resolve_device,
    resolve_dtype,
)
from .attention import empirical_loss
from .geometry import distance_to_manifold, manifold_point, regularizer
from .geometry import renormalize as _renormalize
from .init import random_init, spectral_init
from .linalg import sym_inv_sqrt
from .rng import make_generator
from .task import Task, empirical_task

__all__ = [
    "train",
    "train_population",
    "run",
    "best_of_grid",
    "GridCache",
    "History",
    "DivergenceError",
    "METHODS",
    "Method",
    "register_method",
    "Objective",
    "Step",
    "GradientStep",
    "SGDStep",
    "AdamStep",
    "DivergenceGuard",
    "Recorder",
]


class DivergenceError(FloatingPointError):
    """Raised when the objective or the parameters stop being finite (step size too large)."""


@dataclass
class History:
    """Record of one training run.

    Lists have one entry per recorded iterate (``steps`` holds the iteration
    numbers, starting at 0 = the initialization). ``objective`` is the
    (regularized) training objective, ``loss`` its unregularized part,
    ``grad_norm`` the Euclidean norm of the objective's gradient (NaN where the
    step rule does not compute the full gradient), ``time`` the cumulative wall
    time of the updates in seconds. ``excess`` (population ``L - L*``) and
    ``dist`` (``dist_P`` to the manifold) are filled when a task is known.
    ``A`` and ``B`` are the final parameters (after a divergence with
    ``on_divergence="stop"``: the last finite iterate, and ``diverged`` is set).
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


# ----------------------------------------------------------------------------- the objective


@dataclass
class Objective:
    """What is minimized: ``loss(A, B, idx)`` plus, optionally, the balancing regularizer.

    ``loss(A, B, idx)`` is the training loss (``idx``: a LongTensor of query
    rows for a minibatch, or ``None`` for the full objective); ``geometry`` is
    the task whose covariance the structured components use (``Sigmahat`` for a
    sample, ``Sigma`` on the population); ``n_queries`` the number of query rows
    a minibatch can draw from (``None``: no minibatches).
    """

    loss: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
    geometry: Optional[Task] = None
    lam: float = 0.0
    regularize: bool = False
    n_queries: Optional[int] = None

    def __call__(self, A, B, idx=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(loss, objective)``, both 0-dim tensors."""
        loss = self.loss(A, B, idx)
        if self.regularize:
            return loss, loss + regularizer(A, B, self.geometry, self.lam)
        return loss, loss


# ----------------------------------------------------------------------------- step rules


class Step:
    """A step rule. :func:`run` calls, at every iteration ``t``:

    * ``evaluate(objective, A, B, record)`` -> ``(loss, objective value, (gA, gB) or None)``,
      the full objective at the current iterate (its gradient where the rule
      needs it; for ``record=False`` a rule may skip the evaluation and return ``None``
      for the values); ``timed`` says whether this evaluation is part of the
      update's cost (``History.time``);
    * ``update(objective, A, B, grads)``: change ``A``, ``B`` in place (under ``no_grad``
      where gradients are not needed).
    """

    timed = True

    def evaluate(self, objective: Objective, A, B, record: bool):
        loss, obj = objective(A, B)
        gA, gB = torch.autograd.grad(obj, (A, B))
        return loss, obj, (gA, gB)

    def update(self, objective: Objective, A, B, grads) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class GradientStep(Step):
    """``(A, B) <- (A, B) - lr * g``, with ``g`` preconditioned by ``Sigma^{-1}`` when ``precondition``."""

    def __init__(self, lr: float, precondition: Optional[torch.Tensor] = None):
        self.lr = lr
        self.S_inv = precondition

    def direction(self, gA, gB):
        if self.S_inv is not None:
            return gA @ self.S_inv, self.S_inv @ gB @ self.S_inv
        return gA, gB

    def update(self, objective, A, B, grads) -> None:
        gA, gB = self.direction(*grads)
        with torch.no_grad():
            A -= self.lr * gA
            B -= self.lr * gB


class SGDStep(GradientStep):
    """Gradient steps on minibatches of ``batch_size`` queries (all keys), drawn from ``generator``.

    The full objective is evaluated only for the record, without gradient and
    outside the timed update.
    """

    timed = False

    def __init__(
        self,
        lr: float,
        batch_size: int,
        n_queries: int,
        generator: torch.Generator,
        precondition: Optional[torch.Tensor] = None,
    ):
        super().__init__(lr, precondition)
        self.batch_size, self.n_queries, self.gen = batch_size, n_queries, generator

    def evaluate(self, objective, A, B, record):
        if not record:
            return None, None, None
        with torch.no_grad():
            loss, obj = objective(A, B)
        return loss, obj, None

    def update(self, objective, A, B, grads) -> None:
        idx = torch.randperm(self.n_queries, generator=self.gen)[: self.batch_size].to(A.device)
        _, obj = objective(A, B, idx)
        super().update(objective, A, B, torch.autograd.grad(obj, (A, B)))


class AdamStep(Step):
    """One ``torch.optim.Adam`` step on the full objective's gradient."""

    def __init__(self, lr: float):
        self.lr = lr
        self.opt = None

    def update(self, objective, A, B, grads) -> None:
        if self.opt is None:
            self.opt = torch.optim.Adam([A, B], lr=self.lr)
        with torch.no_grad():
            A.grad, B.grad = grads
            self.opt.step()


@dataclass(frozen=True)
class Method:
    """A training method: a factory for its step rule and its default components.

    ``make_step(lr, context)`` returns a :class:`Step`; ``context`` holds
    ``precondition`` (``Sigma^{-1}`` or ``None``), ``batch_size``, ``n_queries``
    and ``seed``. ``structured`` says whether regularizer, preconditioner and
    renormalization are on by default; ``needs_samples`` that it cannot run
    on the population objective; ``preconditionable`` whether the
    covariance preconditioner is defined for it.
    """

    name: str
    make_step: Callable[[float, dict], Step]
    structured: bool = False
    needs_samples: bool = False
    preconditionable: bool = True


#: The registered training methods, by name (see :func:`register_method`).
METHODS: Dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Add a training method under ``method.name`` (replacing one of the same name)."""
    if not isinstance(method, Method):
        raise ValueError(f"method: expected an attnlib.train.Method, got {type(method).__name__}")
    METHODS[method.name] = method
    return method


register_method(Method("structured", lambda lr, c: GradientStep(lr, c["precondition"]), structured=True))
register_method(Method("gd", lambda lr, c: GradientStep(lr, c["precondition"])))
register_method(
    Method(
        "sgd",
        lambda lr, c: SGDStep(
            lr, c["batch_size"], c["n_queries"], make_generator(c["seed"], name="seed"), c["precondition"]
        ),
        needs_samples=True,
    )
)
register_method(Method("adam", lambda lr, c: AdamStep(lr), preconditionable=False))


# ----------------------------------------------------------------------------- guard and recorder


class DivergenceGuard:
    """The one place that decides what a non-finite or overflowing iterate means.

    ``on_divergence="raise"`` raises :class:`DivergenceError`; ``"stop"``
    sets ``History.diverged`` and lets the loop end with the last finite iterate.
    A population excess beyond ``sqrt(finfo.max)`` also counts as divergence:
    the finite-n loss stays bounded when ``B`` blows up (hard attention), the
    population excess does not, and the next matrix products would overflow.
    """

    def __init__(self, on_divergence: str, method: str, lr: float, dtype: torch.dtype):
        self.on_divergence, self.method, self.lr = on_divergence, method, lr
        self.overflow = float(torch.finfo(dtype).max) ** 0.5
        self.diverged = False

    def ok(self, t: int, *values) -> bool:
        """True if every tensor/number in ``values`` is finite (numbers also ``<= overflow``)."""
        for v in values:
            if isinstance(v, torch.Tensor):
                good = bool(torch.isfinite(v).all())
            else:
                good = v <= self.overflow  # False for NaN and inf
            if not good:
                self.diverged = True
                if self.on_divergence == "raise":
                    raise DivergenceError(
                        f"training diverged at step {t} (method={self.method!r}, lr={self.lr}): the objective "
                        f"or the parameters are no longer finite; lower lr"
                    )
                return False
        return True


class Recorder:
    """The one place that writes a :class:`History` row (and its population diagnostics).

    ``to_original(A, B)`` maps the trained parameters to those of the layer on
    raw tokens (identity unless the tokens were whitened).
    """

    def __init__(
        self,
        history: History,
        task: Optional[Task],
        guard: DivergenceGuard,
        to_original: Callable = lambda A, B: (A, B),
    ):
        self.h, self.guard, self.to_original = history, guard, to_original
        self.task = task

    def record(self, t, A, B, loss, obj, grads, elapsed) -> bool:
        """Append one row; False if the loop must stop (divergence with ``on_divergence="stop"``)."""
        if not self.guard.ok(t, obj.detach(), A.detach(), B.detach()):
            return False
        excess = dist = None
        if self.task is not None:
            with torch.no_grad():
                Ao, Bo = self.to_original(A.detach(), B.detach())
                excess = float(self.task.excess_risk(Ao, Bo))
                if not self.guard.ok(t, excess):
                    return False
                dist = float(distance_to_manifold(Ao, Bo, self.task))
        h = self.h
        if excess is not None:
            h.excess.append(excess)
            h.dist.append(dist)
        h.steps.append(t)
        h.loss.append(float(loss.detach()))
        h.objective.append(float(obj.detach()))
        if grads is None:
            h.grad_norm.append(float("nan"))
        else:
            gA, gB = grads
            h.grad_norm.append(float(torch.sqrt(torch.sum(gA * gA) + torch.sum(gB * gB))))
        h.time.append(elapsed)
        return True


# ----------------------------------------------------------------------------- the loop


def run(
    objective: Objective,
    step: Step,
    A,
    B,
    *,
    steps: int,
    renormalize: Optional[str] = None,
    recorder: Recorder,
    guard: DivergenceGuard,
    record_every: int = 1,
    progress: bool = False,
    desc: str = "train",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The training loop shared by every method; returns the final ``(A, B)`` (detached).

    Iteration ``t = 0..steps``: evaluate (and record every ``record_every``
    steps and at the last one), then, unless ``t == steps``, update with
    ``step``, renormalize (mode ``renormalize`` with ``objective.geometry``),
    and check the new iterate with ``guard``; on divergence the last finite
    iterate is kept.
    """
    A = A.clone().requires_grad_(True)
    B = B.clone().requires_grad_(True)
    elapsed = 0.0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=steps, desc=desc, leave=False)
    for t in range(steps + 1):
        rec = (t % record_every == 0) or t == steps
        t0 = time.perf_counter()
        loss, obj, grads = step.evaluate(objective, A, B, rec)
        if step.timed:
            elapsed += time.perf_counter() - t0
        if rec and not recorder.record(t, A, B, loss, obj, grads, elapsed):
            break
        if t == steps:
            break
        t0 = time.perf_counter()
        last_A, last_B = A.detach().clone(), B.detach().clone()
        step.update(objective, A, B, grads)
        with torch.no_grad():
            finite = bool(torch.isfinite(A).all()) and bool(torch.isfinite(B).all())
            if finite and renormalize is not None:
                A_new, B_new = _renormalize(A, B, objective.geometry, renormalize)
                A.copy_(A_new)
                B.copy_(B_new)
        elapsed += time.perf_counter() - t0
        if not guard.ok(t + 1, A.detach(), B.detach()):
            with torch.no_grad():  # keep the last finite iterate, never return NaN parameters
                A.copy_(last_A)
                B.copy_(last_B)
            break
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return A.detach(), B.detach()


# ----------------------------------------------------------------------------- front ends


def _resolve_flags(method, regularize, precondition, renormalize) -> Tuple[Method, bool, bool, Optional[str]]:
    if method not in METHODS:
        raise ValueError(f"method: expected one of {tuple(METHODS)}, got {method!r}")
    spec = METHODS[method]
    regularize = spec.structured if regularize is None else bool(regularize)
    precondition = spec.structured if precondition is None else bool(precondition)
    if renormalize is None:
        renormalize = "balance" if spec.structured else None
    elif renormalize is True:
        renormalize = "balance"
    elif renormalize is False:
        renormalize = None
    if renormalize not in (None, "scale", "balance"):
        raise ValueError(f"renormalize: expected None, True, False, 'scale' or 'balance', got {renormalize!r}")
    if precondition and not spec.preconditionable:
        raise ValueError(f"precondition: the covariance preconditioner is not defined for method={method!r}")
    return spec, regularize, precondition, renormalize


def _initial_params(
    init, d, k, *, spectral: Callable[[], Tuple[torch.Tensor, torch.Tensor]], init_scale, seed, dtype, device
):
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
    return (A.detach().to(device=device, dtype=dtype).clone(), B.detach().to(device=device, dtype=dtype).clone())


def _common_checks(steps, lr, lam, record_every, on_divergence):
    steps = check_positive_int(steps, "steps", minimum=0)
    lr = check_nonneg_float(lr, "lr", positive=True)
    lam = check_nonneg_float(lam, "lam")
    record_every = check_positive_int(record_every, "record_every")
    if on_divergence not in ("raise", "stop"):
        raise ValueError(f"on_divergence: expected 'raise' or 'stop', got {on_divergence!r}")
    return steps, lr, lam, record_every


def _execute(
    method,
    spec,
    objective,
    A,
    B,
    *,
    lr,
    steps,
    precondition,
    renormalize,
    batch_size,
    seed,
    task,
    record_every,
    progress,
    on_divergence,
    config,
    to_original=lambda A, B: (A, B),
):
    """Build step rule, guard and recorder for one run and drive :func:`run`."""
    S_inv = torch.linalg.inv(objective.geometry.Sigma) if precondition else None
    step = spec.make_step(lr, dict(precondition=S_inv, batch_size=batch_size, n_queries=objective.n_queries, seed=seed))
    hist = History(method=method, config=config)
    guard = DivergenceGuard(on_divergence, method, lr, A.dtype)
    eval_task = task.to(dtype=A.dtype, device=A.device) if task is not None else None
    recorder = Recorder(hist, eval_task, guard, to_original)
    A, B = run(
        objective,
        step,
        A,
        B,
        steps=steps,
        renormalize=renormalize,
        recorder=recorder,
        guard=guard,
        record_every=record_every,
        progress=progress,
        desc=method,
    )
    hist.A, hist.B = to_original(A, B)
    hist.diverged = guard.diverged
    return hist


def train(
    X,
    Y,
    *,
    steps: int,
    lr: float,
    method: str = "structured",
    init: Union[str, Tuple[torch.Tensor, torch.Tensor]] = "spectral",
    lam: float = 1.0,
    regularize: Optional[bool] = None,
    precondition: Optional[bool] = None,
    renormalize: Union[None, bool, str] = None,
    whiten: bool = False,
    batch_size: Optional[int] = None,
    init_scale: float = 1e-2,
    seed: int = 0,
    task: Optional[Task] = None,
    record_every: int = 1,
    progress: bool = False,
    on_divergence: str = "raise",
    dtype=None,
    device=None,
) -> History:
    """Train the attention layer on one sequence ``(X, Y)`` (shapes (n, d), (n, k)).

    Parameters
    ----------
    steps, lr : number of updates and step size.
    method : a name in :data:`~attnlib.train.METHODS`: ``"structured"`` (Algorithm 1), ``"gd"``,
        ``"sgd"`` or ``"adam"``.
    init : ``"spectral"`` (:func:`~attnlib.init.spectral_init`), ``"random"``
        (:func:`~attnlib.init.random_init` with ``init_scale`` and ``seed``) or a pair ``(A, B)``
        (parameters of the layer on the raw tokens, also with ``whiten=True``).
    lam : weight of the balancing regularizer.
    regularize, precondition, renormalize : switch each structured component on
        (``True``) or off (``False``); ``None`` (the default) means on for
        ``"structured"`` and off otherwise. ``renormalize`` also takes the mode,
        ``"balance"`` (what ``True`` and the structured default mean) or ``"scale"``.
    whiten : train on the whitened tokens ``X Sigmahat^{-1/2}`` (same ``Y``); the
        history and the returned parameters are those of the equivalent layer on the raw tokens.
    batch_size : queries per SGD step (default ``max(1, n // 8)``).
    seed : seeds the random initialization and the SGD minibatches.
    task : if given, the population excess risk and ``dist_P`` are recorded at every step.
    record_every : record every this many steps (the last step is always recorded).
    progress : show a tqdm progress bar.
    on_divergence : ``"raise"`` (:class:`DivergenceError`) or ``"stop"`` (``History.diverged``).
    dtype, device : move ``X``, ``Y`` there first (default: keep theirs).

    The regularizer, preconditioner and renormalization use ``Sigmahat = X^T X / n``
    (of the tokens trained on).
    """
    X, Y = check_samples(X, Y)
    if dtype is not None or device is not None:
        X = X.to(
            dtype=resolve_dtype(dtype) if dtype is not None else X.dtype,
            device=resolve_device(device) if device is not None else X.device,
        )
        Y = Y.to(X)
    steps, lr, lam, record_every = _common_checks(steps, lr, lam, record_every, on_divergence)
    spec, regularize, precondition, renormalize = _resolve_flags(method, regularize, precondition, renormalize)
    n, d = X.shape
    k = Y.shape[1]
    if task is not None and (not isinstance(task, Task) or task.d != d or task.k != k):
        raise ValueError(f"task: expected an attnlib.Task with d = {d}, k = {k}")
    if (regularize or precondition or renormalize or whiten) and n < d:
        raise ValueError(
            f"X: the structured components and whitening need n >= d (Sigmahat invertible), got n = {n}, d = {d}"
        )
    if spec.needs_samples:
        batch_size = max(1, n // 8) if batch_size is None else check_positive_int(batch_size, "batch_size")
        if batch_size > n:
            raise ValueError(f"batch_size: expected at most n = {n}, got {batch_size}")
    A, B = _initial_params(
        init,
        d,
        k,
        spectral=lambda: spectral_init(X, Y),
        init_scale=init_scale,
        seed=seed,
        dtype=X.dtype,
        device=X.device,
    )
    to_original = lambda A_, B_: (A_, B_)
    Xt = X
    if whiten:
        W = sym_inv_sqrt(X.T @ X / n)  # Sigmahat^{-1/2}
        Winv = torch.linalg.inv(W)
        Xt = X @ W
        A, B = A @ Winv, Winv @ B @ Winv  # the same layer, seen on whitened tokens
        to_original = lambda A_, B_: (A_ @ W, W @ B_ @ W)
    geom = empirical_task(Xt, Y) if (regularize or precondition or renormalize) else None
    objective = Objective(
        lambda A_, B_, idx: empirical_loss(A_, B_, Xt, Y, queries=idx),
        geometry=geom,
        lam=lam,
        regularize=regularize,
        n_queries=n,
    )
    config = dict(
        n=n,
        d=d,
        k=k,
        steps=steps,
        lr=lr,
        method=method,
        init=init if isinstance(init, str) else "given",
        lam=lam,
        regularize=regularize,
        precondition=precondition,
        renormalize=renormalize,
        whiten=bool(whiten),
        batch_size=batch_size,
        init_scale=init_scale,
        seed=seed,
        objective="empirical",
    )
    return _execute(
        method,
        spec,
        objective,
        A,
        B,
        lr=lr,
        steps=steps,
        precondition=precondition,
        renormalize=renormalize,
        batch_size=batch_size,
        seed=seed,
        task=task,
        record_every=record_every,
        progress=progress,
        on_divergence=on_divergence,
        config=config,
        to_original=to_original,
    )


def train_population(
    task: Task,
    *,
    steps: int,
    lr: float,
    method: str = "structured",
    init: Union[str, Tuple[torch.Tensor, torch.Tensor]] = "random",
    lam: float = 1.0,
    regularize: Optional[bool] = None,
    precondition: Optional[bool] = None,
    renormalize: Union[None, bool, str] = None,
    whiten: bool = False,
    init_scale: float = 1e-2,
    seed: int = 0,
    record_every: int = 1,
    progress: bool = False,
    on_divergence: str = "raise",
) -> History:
    """Run the same algorithms on the closed-form population objective ``Q = L + R`` (no samples).

    The components use the true ``Sigma``; ``init="spectral"`` is the
    infinite-data spectral initialization (exactly on the manifold), so the
    default here is ``"random"``. Methods that need samples (``"sgd"``) are
    not defined here. ``excess`` and ``dist`` are always recorded.

    ``whiten=True`` trains on the population of whitened tokens
    ``Sigma^{-1/2} x ~ N(0, I)``, i.e. on the task ``(I, M Sigma^{1/2})``, and maps the
    parameters back (``A = A' Sigma^{-1/2}``, ``B = Sigma^{-1/2} B' Sigma^{-1/2}``): the
    population counterpart of ``train(..., whiten=True)``. The whitened parameters are
    exactly ``(At, C^T)``, so plain gradient descent there is preconditioned descent.
    """
    if not isinstance(task, Task):
        raise ValueError(f"task: expected an attnlib.Task, got {type(task).__name__}")
    if method in METHODS and METHODS[method].needs_samples:
        raise ValueError(f"method: {method!r} needs samples (minibatches of queries); use train(X, Y, ...)")
    steps, lr, lam, record_every = _common_checks(steps, lr, lam, record_every, on_divergence)
    spec, regularize, precondition, renormalize = _resolve_flags(method, regularize, precondition, renormalize)

    def spectral():
        return manifold_point(task, task.svd[2])

    A, B = _initial_params(
        init, task.d, task.k, spectral=spectral, init_scale=init_scale, seed=seed, dtype=task.dtype, device=task.device
    )
    to_original = lambda A_, B_: (A_, B_)
    train_task = task
    if whiten:
        W, Winv = task.Sigma_inv_sqrt, task.Sigma_sqrt
        eye = torch.eye(task.d, dtype=task.dtype, device=task.device)
        train_task = Task(eye, task.M @ Winv, task.noise_std)
        A, B = A @ Winv, Winv @ B @ Winv  # the same layer, seen on whitened tokens
        to_original = lambda A_, B_: (A_ @ W, W @ B_ @ W)
    objective = Objective(
        lambda A_, B_, idx: train_task.population_loss(A_, B_), geometry=train_task, lam=lam, regularize=regularize
    )
    config = dict(
        d=task.d,
        k=task.k,
        steps=steps,
        lr=lr,
        method=method,
        init=init if isinstance(init, str) else "given",
        lam=lam,
        regularize=regularize,
        precondition=precondition,
        renormalize=renormalize,
        whiten=bool(whiten),
        init_scale=init_scale,
        seed=seed,
        objective="population",
    )
    return _execute(
        method,
        spec,
        objective,
        A,
        B,
        lr=lr,
        steps=steps,
        precondition=precondition,
        renormalize=renormalize,
        batch_size=None,
        seed=seed,
        task=task,
        record_every=record_every,
        progress=progress,
        on_divergence=on_divergence,
        config=config,
        to_original=to_original,
    )


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
    ``best(key, run, lrs, score=..., criterion=...)`` does what :func:`best_of_grid`
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

    ``refresh=True`` re-runs every grid requested in this session and rewrites
    the file from scratch; ``refresh=None`` (default) reads the environment
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
        if not self.refresh and os.path.exists(self.path):
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
        e = self.entries.get(key)
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
