r"""One entry point, :func:`fit`, and the presets that build its objective and start.

:func:`fit` runs a :class:`~attnlib.optim.TrainConfig` on an :class:`~attnlib.optim.Objective`
from a start ``(A, B)``: it builds the step rule of the config's method (with the covariance
preconditioner and, after a capped renormalization, the balanced-coordinate scaling), the
:class:`~attnlib.geometry.Renormalization`, the divergence guard and the recorder, and drives the
one loop :func:`~attnlib.optim.run`. The presets are the three settings of the book:

* :func:`train`: one sequence ``(X, Y)`` (regime (i); also whitened tokens);
* :func:`train_population`: the closed-form population objective (the infinite-data limit);
* :func:`train_prompts` and :func:`run_chain`: the expected loss ``L_n`` over fresh prompts of
  context length ``n`` (regime (ii)); a chain is the structured method with iterate averaging.

Each preset takes a config object or its fields as keywords (``train(X, Y, steps=80, lr=0.5)``).

``method="structured"`` is Algorithm 1 of the book: spectral initialization, descent on the
regularized objective ``Qhat = Lhat + Rhat``, the covariance preconditioner
``A <- A - lr gA Sigmahat^{-1}``, ``B <- B - lr Sigmahat^{-1} gB Sigmahat^{-1}`` (plain gradient
descent in the coordinates ``(At, C)``), and a renormalization after each update (``"balance"``:
the closest balanced factorization of the product, whose softmax scale ``lambda_max(C^T C) = s_1(P)``
is fixed by the product; at balanced iterates the regularizer's gradient vanishes, so it does the
balancing only when the renormalization is off or ``"equalize"``). The structured method is
affine-equivariant: training on ``X G`` and mapping back with ``(A G^T, G B G^T)`` gives the same
iterates; with ``G = Sigmahat^{-1/2}`` the preconditioned step is plain gradient descent on
whitened tokens (chapter 5 proves it; the tests check it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .._validate import check_matrix, check_positive_int, check_samples, resolve_device, resolve_dtype
from ..geometry import Renormalization, manifold_point
from ..linalg import sym_inv_sqrt
from ..model.finite_n import softmax_scale
from ..model.task import Task, check_task
from ..rng import make_generator
from .config import ChainConfig, PromptConfig, TrainConfig, make_config
from .init import random_init, spectral_init
from .loop import DivergenceGuard, History, IterateAverage, Recorder, run
from .objectives import Objective, PromptObjective, empirical_objective, population_objective
from .steps import METHODS

__all__ = ["fit", "train", "train_population", "train_prompts", "run_chain", "ChainResult"]


def _identity(A, B):
    return A, B


def fit(
    objective: Objective,
    config: TrainConfig,
    init,
    *,
    task: Optional[Task] = None,
    to_original: Callable = _identity,
    hooks: Sequence[Callable] = (),
    info: Optional[dict] = None,
) -> History:
    """Train from ``init = (A, B)`` (validated, in the objective's dtype) on ``objective`` with ``config``.

    ``task``: record the population excess and ``dist_P`` of ``to_original(A, B)``; ``hooks``: callables
    ``hook(t, A, B, loss, recorded)`` (:class:`~attnlib.optim.IterateAverage`, :class:`~attnlib.optim.Snapshots`);
    ``info``: extra entries for ``History.config``. Returns the :class:`~attnlib.optim.History`, whose
    ``step_rule`` is the step rule used.
    """
    A, B = init
    geom = objective.geometry
    mode = config.renormalization
    if (config.use_preconditioner or mode) and geom is None:
        raise ValueError("objective: the preconditioner and the renormalization need the objective's geometry")
    renorm = Renormalization(mode, geom, config.nu_cap) if mode else None
    context = dict(
        precondition=torch.linalg.inv(geom.Sigma) if config.use_preconditioner else None,
        rescale=renorm.gamma2 if mode in ("cap", "fix") else None,
        batch_size=config.batch_size,
        n_queries=objective.n_queries,
        seed=config.seed,
    )
    step = METHODS[config.method].make_step(config.lr, context)
    hist = History(method=config.method, config={**config.summary(), **(info or {})})
    guard = DivergenceGuard(config.on_divergence, config.method, config.lr, A.dtype)
    eval_task = task.to(dtype=A.dtype, device=A.device) if task is not None else None
    recorder = Recorder(hist, eval_task, guard, to_original)
    A, B = run(objective, step, (A, B), config, recorder, renormalization=renorm, hooks=hooks)
    hist.A, hist.B = to_original(A, B)
    hist.diverged, hist.step_rule = guard.diverged, step
    return hist


def _start(config: TrainConfig, d: int, k: int, default: str, spectral: Callable, like: torch.Tensor):
    init = default if config.init is None else config.init
    if init == "spectral":
        A, B = spectral()
    elif init == "random":
        A, B = random_init(d, k, std=config.init_std, seed=config.seed, dtype=like.dtype, device=like.device)
    else:
        A = check_matrix(init[0], "init[0] (A)", (k, d))
        B = check_matrix(init[1], "init[1] (B)", (d, d))
    return A.detach().to(like).clone(), B.detach().to(like).clone()


def _whitening(W: torch.Tensor, Winv: torch.Tensor):
    """``(to_whitened, to_original)``: the same layer seen on whitened tokens ``X W`` and back."""
    return (lambda A, B: (A @ Winv, Winv @ B @ Winv)), (lambda A, B: (A @ W, W @ B @ W))


def train(X, Y, config: Optional[TrainConfig] = None, /, *, task=None, hooks=(), dtype=None, device=None, **options):
    """Train the layer on one sequence ``(X, Y)`` (shapes (n, d), (n, k)): regime (i).

    ``config`` (a :class:`~attnlib.optim.TrainConfig`) and/or its fields as keywords; ``init`` defaults to
    the spectral initialization. The structured components use ``Sigmahat = X^T X / n`` of the tokens
    trained on (``whiten=True``: the whitened tokens ``X Sigmahat^{-1/2}``, same ``Y``; the history and
    the returned parameters are those of the equivalent layer on the raw tokens). ``task``: record the
    population excess and ``dist_P``; ``hooks``: see :func:`fit`; ``dtype``, ``device``: move ``X``, ``Y``
    there first.
    """
    cfg = make_config(TrainConfig, config, options)
    X, Y = check_samples(X, Y)
    if dtype is not None or device is not None:
        X = X.to(dtype=resolve_dtype(dtype) if dtype is not None else X.dtype,
                 device=resolve_device(device) if device is not None else X.device)  # fmt: skip
        Y = Y.to(X)
    (n, d), k = X.shape, Y.shape[1]
    if task is not None and (not isinstance(task, Task) or task.d != d or task.k != k):
        raise ValueError(f"task: expected an attnlib.Task with d = {d}, k = {k}")
    structured = cfg.use_regularizer or cfg.use_preconditioner or cfg.renormalization or cfg.whiten
    if structured and n < d:
        raise ValueError(f"X: the structured components and whitening need n >= d (Sigmahat invertible), got {n} < {d}")
    batch = None
    if METHODS[cfg.method].needs_samples:
        batch = max(1, n // 8) if cfg.batch_size is None else cfg.batch_size
        if batch > n:
            raise ValueError(f"batch_size: expected at most n = {n}, got {batch}")
    A, B = _start(cfg, d, k, "spectral", lambda: spectral_init(X, Y), X)
    to_original = _identity
    if cfg.whiten:
        W = sym_inv_sqrt(X.T @ X / n)  # Sigmahat^{-1/2}
        to_whitened, to_original = _whitening(W, torch.linalg.inv(W))
        X, (A, B) = X @ W, to_whitened(A, B)
    needs_geometry = bool(cfg.use_regularizer or cfg.use_preconditioner or cfg.renormalization)
    objective = empirical_objective(X, Y, geometry=needs_geometry)
    objective = objective.with_regularizer(cfg.lam if cfg.use_regularizer else 0.0)
    cfg = dataclasses.replace(cfg, batch_size=batch)
    info = dict(n=n, d=d, k=k, objective="empirical")
    return fit(objective, cfg, (A, B), task=task, to_original=to_original, hooks=hooks, info=info)


def train_population(task: Task, config: Optional[TrainConfig] = None, /, *, hooks=(), **options) -> History:
    """Run the same algorithms on the closed-form population objective ``Q = L + R`` (no samples).

    ``config`` and/or its fields as keywords. The components use the true ``Sigma``; ``init`` defaults
    to ``"random"`` (``"spectral"`` is the infinite-data spectral initialization, exactly on the
    manifold). Methods that need samples (``"sgd"``) are not defined here. ``excess`` and ``dist`` are
    always recorded. ``whiten=True`` trains on the population of whitened tokens
    ``Sigma^{-1/2} x ~ N(0, I)``, i.e. on the task ``(I, M Sigma^{1/2})``, and maps the parameters back:
    the whitened parameters are exactly ``(At, C^T)``, so plain gradient descent there is preconditioned
    descent.
    """
    task = check_task(task)
    cfg = make_config(TrainConfig, config, options)
    if METHODS[cfg.method].needs_samples:
        raise ValueError(f"method: {cfg.method!r} needs samples (minibatches of queries); use train(X, Y, ...)")
    A, B = _start(cfg, task.d, task.k, "random", lambda: manifold_point(task, task.svd[2]), task.Sigma)
    to_original, train_task = _identity, task
    if cfg.whiten:
        eye = torch.eye(task.d, dtype=task.dtype, device=task.device)
        train_task = Task(eye, task.M @ task.Sigma_sqrt, task.noise_std)
        to_whitened, to_original = _whitening(task.Sigma_inv_sqrt, task.Sigma_sqrt)
        A, B = to_whitened(A, B)
    objective = population_objective(train_task).with_regularizer(cfg.lam if cfg.use_regularizer else 0.0)
    info = dict(d=task.d, k=task.k, objective="population")
    return fit(objective, cfg, (A, B), task=task, to_original=to_original, hooks=hooks, info=info)


def _prompt_objective(task: Task, n: int, cfg: PromptConfig, generator) -> PromptObjective:
    gen = make_generator(cfg.seed, generator)
    return PromptObjective(task, n, cfg.prompts, gen, cfg.control_variate, engine=cfg.engine,
                           attention_dtype=cfg.attention_dtype)  # fmt: skip


def train_prompts(task: Task, n: int, config: Optional[PromptConfig] = None, /, *, generator=None, **options):
    r"""Train ``(A, B)`` on the regime-(ii) objective ``L_n`` with any registered method (a :class:`PromptConfig`).

    Every update draws ``prompts`` fresh prompts of ``n`` tokens (:class:`~attnlib.optim.PromptObjective`,
    seeded with ``seed`` or drawn from ``generator``); ``"structured"`` uses the ``Sigma^{-1}``
    preconditioner and the renormalization with the true ``Sigma``, which infinitely many prompts reveal.
    ``init`` defaults to the balanced minimum ``W = V``. ``History.loss`` is the training loss (the
    estimate of ``L_n`` on that step's prompts), ``excess`` the population excess of the limit map. A
    run whose parameters blow up so far that the moment kernel's softmax sums underflow
    (``ZeroDivisionError``) counts as diverged.
    """
    task, n = check_task(task), check_positive_int(n, "n")
    cfg = make_config(PromptConfig, config, options)
    loss = _prompt_objective(task, n, cfg, generator)
    A, B = _start(cfg, task.d, task.k, "spectral", lambda: manifold_point(task, task.svd[2]), task.Sigma)
    info = dict(n=n, objective="expected loss L_n")
    try:
        return fit(loss.objective(), cfg, (A, B), task=task, info=info)
    except ZeroDivisionError as exc:  # the moment kernel's softmax sum underflows once the parameters blow up
        if cfg.on_divergence == "raise":
            raise FloatingPointError(f"{cfg.method} diverged on L_n (lr = {cfg.lr:g}): {exc}") from exc
        return History(method=cfg.method, config={**cfg.summary(), **info}, A=A, B=B, diverged=True)


@dataclass
class ChainResult:
    """One chain of :func:`run_chain`.

    ``R``: the averaged residual ``mean_m A_m Sigma B_m^T - M`` over the steps after the burn-in
    (k x d numpy array); ``naive_excess``: ``1/2 ||R Sigma^{1/2}||^2`` (biased upwards by the
    Monte Carlo noise; :func:`attnlib.analysis.stats.excess_ustat` removes it); ``test_excess``: mean over the same
    steps of the estimates of ``L_n - L*`` (what a user of the layer at length ``n`` sees,
    minus the Bayes risk); ``nu``: the softmax scale ``lambda_max(C^T C)`` at the last iterate;
    ``history``: the loop's record (every ``record_every`` steps); ``batches``: prompt batches drawn.
    """

    R: np.ndarray
    naive_excess: float
    test_excess: float
    nu: float
    history: History
    batches: int


def run_chain(task: Task, n: int, config: Optional[ChainConfig] = None, /, *, generator=None, hooks=(), **options):
    """The structured algorithm on the expected loss ``L_n`` (regime (ii)), one chain (a :class:`ChainConfig`).

    Start: ``init = (A, B)`` or, by default, the balanced minimum ``W = V`` of ``task``
    (:func:`attnlib.geometry.manifold_point`), renormalized like every iterate. Each of ``steps`` updates
    draws ``prompts`` fresh prompts (seeded with ``seed``, or from ``generator``; the seeds of independent
    chains must differ, e.g. ``derive_seed``). The limit map ``A Sigma B^T`` is averaged over iterates
    ``burn_in .. steps`` (:class:`~attnlib.optim.IterateAverage`). Returns a :class:`ChainResult`.
    """
    task, n = check_task(task), check_positive_int(n, "n")
    cfg = make_config(ChainConfig, config, options)
    loss = _prompt_objective(task, n, cfg, generator)
    A, B = _start(cfg, task.d, task.k, "spectral", lambda: manifold_point(task, task.svd[2]), task.Sigma)
    if cfg.renormalization:
        A, B = Renormalization(cfg.renormalization, task, cfg.nu_cap)(A, B)
    avg = IterateAverage(task, cfg.burn_in)
    info = dict(n=n, objective="expected loss L_n")
    hist = fit(loss.objective(), cfg, (A, B), task=task, hooks=(avg, *hooks), info=info)
    R = avg.G_sum / avg.count - task.M
    return ChainResult(
        R=R.cpu().numpy(),
        naive_excess=0.5 * float(torch.sum((R @ task.Sigma) * R)),
        test_excess=avg.loss_sum / avg.count - task.bayes_risk,
        nu=softmax_scale(hist.A, hist.B, task),
        history=hist,
        batches=loss.calls,
    )
