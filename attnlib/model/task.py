r"""The regression task: Gaussian tokens, a linear teacher, and the closed-form population loss.

Model (see the book's chapter on the population loss):

* tokens ``x_i ~ N(0, Sigma)`` in ``R^d``;
* targets ``y_i = M x_i + eps_i`` with ``M`` of shape (k, d) and ``eps_i ~ N(0, sigma^2 I_k)``;
* in the infinite-data limit the attention layer with parameters ``(A, B)`` computes
  ``q -> A Sigma B^T q``, so the population loss is

  .. math:: L(A, B) = L^* + \tfrac12 \| (A \Sigma B^\top - M) \Sigma^{1/2} \|_F^2,
            \qquad L^* = k \sigma^2 / 2 .
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Optional, Tuple, Union

import torch

from .._validate import (
    check_matrix,
    check_nonneg_float,
    check_positive_int,
    check_samples,
    check_spd,
    resolve_device,
    resolve_dtype,
)
from ..linalg import numerical_rank, sym_inv_sqrt, sym_sqrt
from ..rng import make_generator

__all__ = ["Task", "empirical_task", "as_covariance", "SigmaLike", "check_task"]


class Task:
    """A linear-regression task for softmax self-attention.

    Parameters
    ----------
    Sigma : (d, d) symmetric positive definite token covariance.
    M : (k, d) teacher matrix.
    noise_std : standard deviation ``sigma`` of the label noise.
    dtype, device : where the task's tensors live (default: float64 on CPU, or
        the dtype/device of ``Sigma`` when it is a tensor).
    """

    def __init__(self, Sigma, M, noise_std: float = 0.0, *, dtype=None, device=None):
        if dtype is None and not isinstance(Sigma, torch.Tensor):
            dtype = torch.float64
        Sigma = check_spd(Sigma, "Sigma", dtype=dtype, device=device)
        d = Sigma.shape[0]
        M = check_matrix(M, "M", (None, d), dtype=Sigma.dtype, device=Sigma.device)
        if M.shape[0] < 1:
            raise ValueError(f"M: expected at least one row (k >= 1), got shape {tuple(M.shape)}")
        self.Sigma = Sigma
        self.M = M
        self.noise_std = check_nonneg_float(noise_std, "noise_std")

    # ------------------------------------------------------------------ construction
    @classmethod
    def random(
        cls,
        d: int,
        k: int,
        *,
        cond: float = 1.0,
        signal: float = 1.0,
        rank: Optional[int] = None,
        noise_std: float = 0.0,
        seed: Optional[int] = None,
    ) -> "Task":
        r"""A random task with prescribed conditioning and signal strength.

        ``Sigma = Q diag(lambda) Q^T`` with a Haar-random orthogonal ``Q`` and
        eigenvalues ``lambda_i = cond^{t_i}``, ``t_i`` evenly spaced in
        ``[-1/2, 1/2]`` (so ``det Sigma = 1`` and ``cond(Sigma) = cond``).
        The factorization target ``T = M Sigma^{1/2}`` is a Gaussian matrix of the
        given ``rank`` (default ``min(k, d)``) rescaled to ``||T||_F = signal``,
        and ``M = T Sigma^{-1/2}``. The same seed gives the same ``T`` for every
        ``cond``, so tasks that differ only in ``cond`` have the same
        factorization problem in the coordinates ``(At, C)``. The task is float64 on the CPU; ``.to(dtype,
        device)`` moves it.
        """
        d = check_positive_int(d, "d")
        k = check_positive_int(k, "k")
        cond = check_nonneg_float(cond, "cond", positive=True)
        if cond < 1:
            raise ValueError(f"cond: expected a condition number >= 1, got {cond!r}")
        signal = check_nonneg_float(signal, "signal", positive=True)
        if rank is None:
            rank = min(k, d)
        rank = check_positive_int(rank, "rank")
        if rank > min(k, d):
            raise ValueError(f"rank: expected 1 <= rank <= min(k, d) = {min(k, d)}, got {rank}")
        g = make_generator(seed)
        f64 = torch.float64
        Q, R = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=f64))
        Q = Q * torch.sign(torch.diagonal(R))  # Haar measure
        t = torch.linspace(-0.5, 0.5, d, dtype=f64) if d > 1 else torch.zeros(1, dtype=f64)
        eigs = torch.tensor(cond, dtype=f64) ** t
        Sigma = (Q * eigs) @ Q.T
        Sigma = 0.5 * (Sigma + Sigma.T)
        T = torch.randn(k, rank, generator=g, dtype=f64) @ torch.randn(rank, d, generator=g, dtype=f64)
        T = T * (signal / torch.linalg.norm(T))
        M = T @ sym_inv_sqrt(Sigma)
        return cls(Sigma, M, noise_std)

    def to(self, dtype=None, device=None) -> "Task":
        """A copy of the task with tensors in ``dtype`` on ``device``."""
        dtype = self.dtype if dtype is None else resolve_dtype(dtype)
        device = self.device if device is None else resolve_device(device)
        return Task(self.Sigma.to(dtype=dtype, device=device), self.M.to(dtype=dtype, device=device), self.noise_std)

    # ------------------------------------------------------------------ basic facts
    @property
    def d(self) -> int:
        return self.Sigma.shape[0]

    @property
    def k(self) -> int:
        return self.M.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.Sigma.dtype

    @property
    def device(self) -> torch.device:
        return self.Sigma.device

    @cached_property
    def Sigma_sqrt(self) -> torch.Tensor:
        """``Sigma^{1/2}`` (symmetric)."""
        return sym_sqrt(self.Sigma)

    @cached_property
    def Sigma_inv_sqrt(self) -> torch.Tensor:
        """``Sigma^{-1/2}`` (symmetric)."""
        return sym_inv_sqrt(self.Sigma)

    @cached_property
    def T(self) -> torch.Tensor:
        """The factorization target ``T = M Sigma^{1/2}`` (k x d)."""
        return self.M @ self.Sigma_sqrt

    @cached_property
    def rank(self) -> int:
        """Numerical rank ``r`` of ``T``."""
        return numerical_rank(self.T)

    @cached_property
    def svd(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Thin SVD of ``T`` truncated to its rank: ``(U (k x r), s (r,), V (d x r))``."""
        U, s, Vh = torch.linalg.svd(self.T, full_matrices=False)
        r = self.rank
        return U[:, :r], s[:r], Vh[:r].T

    @property
    def cond(self) -> float:
        """Condition number of ``Sigma``."""
        ev = torch.linalg.eigvalsh(self.Sigma)
        return float(ev[-1] / ev[0])

    @property
    def bayes_risk(self) -> float:
        """``L* = k sigma^2 / 2``: the smallest achievable population loss."""
        return 0.5 * self.k * self.noise_std**2

    def __repr__(self) -> str:
        return (
            f"Task(d={self.d}, k={self.k}, rank={self.rank}, cond={self.cond:.3g}, "
            f"signal={float(torch.linalg.norm(self.T)):.3g}, noise_std={self.noise_std:g}, "
            f"dtype={self.dtype}, device={self.device})"
        )

    # ------------------------------------------------------------------ data
    def sample(
        self,
        n: int,
        *,
        seed: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Draw one sequence of ``n`` tokens: ``X`` of shape (n, d) and ``Y`` of shape (n, k).

        ``X = Z Sigma^{1/2}`` with standard Gaussian ``Z``; ``Y = X M^T + sigma E``.
        Draws are made on the CPU in float64 from the given seed or generator,
        then moved to the task's dtype and device, so the same seed gives the
        same sample on every device. ``out``: two contiguous float64 CPU tensors of shapes (n, d) and
        (n, k) to write the sample into (the same values, no new tensors; for a float64 CPU task only).
        """
        n = check_positive_int(n, "n")
        g = make_generator(seed, generator)
        f64 = torch.float64
        Z = torch.randn(n, self.d, generator=g, dtype=f64)
        E = torch.randn(n, self.k, generator=g, dtype=f64)
        S_half = self.Sigma_sqrt.to(device="cpu", dtype=f64)
        if out is not None:
            X, Y = out
            ok = self.dtype == f64 and self.device.type == "cpu"
            for t, shape in ((X, (n, self.d)), (Y, (n, self.k))):
                ok = ok and tuple(t.shape) == shape and t.dtype == f64 and t.device.type == "cpu" and t.is_contiguous()
            if not ok:
                raise ValueError(f"out: expected contiguous float64 CPU tensors of shapes {(n, self.d)}, {(n, self.k)} "
                                 "and a float64 CPU task")  # fmt: skip
            torch.matmul(Z, S_half, out=X)
            torch.matmul(X, self.M.T, out=Y)
            Y += E.mul_(self.noise_std)  # the same two roundings as below
            return X, Y
        X = Z @ S_half
        Y = X @ self.M.to(device="cpu", dtype=f64).T + self.noise_std * E
        return X.to(self.device, self.dtype), Y.to(self.device, self.dtype)

    # ------------------------------------------------------------------ population loss
    def _check_params(self, A, B) -> Tuple[torch.Tensor, torch.Tensor]:
        A = check_matrix(A, "A", (self.k, self.d)).to(dtype=self.dtype, device=self.device)
        B = check_matrix(B, "B", (self.d, self.d)).to(dtype=self.dtype, device=self.device)
        return A, B

    def residual(self, A, B) -> torch.Tensor:
        """``E = A Sigma B^T - M`` (k x d): the error of the limiting linear map."""
        A, B = self._check_params(A, B)
        return A @ self.Sigma @ B.T - self.M

    def excess_risk(self, A, B) -> torch.Tensor:
        r"""``L(A, B) - L* = 1/2 ||(A Sigma B^T - M) Sigma^{1/2}||_F^2`` (a 0-dim tensor, differentiable)."""
        E = self.residual(A, B)
        return 0.5 * torch.sum((E @ self.Sigma) * E)

    def population_loss(self, A, B) -> torch.Tensor:
        r"""``L(A, B) = L* + 1/2 ||(A Sigma B^T - M) Sigma^{1/2}||_F^2`` (a 0-dim tensor, differentiable)."""
        return self.excess_risk(A, B) + self.bayes_risk

    def population_grad(self, A, B) -> Tuple[torch.Tensor, torch.Tensor]:
        """Closed-form gradients ``(E Sigma B Sigma, Sigma E^T A Sigma)`` with ``E = A Sigma B^T - M``."""
        A, B = self._check_params(A, B)
        E = A @ self.Sigma @ B.T - self.M
        S = self.Sigma
        return E @ S @ B @ S, S @ E.T @ A @ S


def empirical_task(X, Y, *, ridge: float = 0.0) -> Task:
    r"""The task seen through one sample: ``Sigmahat = X^T X / n`` and the least-squares ``Mhat``.

    ``Mhat = Y^T X (X^T X + n ridge I)^{-1}``; with ``ridge = 0`` this needs
    ``n >= d`` and a full-rank ``X``. The noise level is estimated from the
    residuals, ``sigma^2 = ||Y - X Mhat^T||^2 / (k (n - d))`` (0 when ``n == d``).
    The spectral initialization is a point of this task's manifold of minima.
    """
    X, Y = check_samples(X, Y)
    n, d = X.shape
    k = Y.shape[1]
    ridge = check_nonneg_float(ridge, "ridge")
    if ridge == 0 and n < d:
        raise ValueError(f"X: need n >= d samples for least squares (n = {n}, d = {d}); pass ridge > 0")
    G = X.T @ X
    Sigma_hat = G / n
    try:
        M_hat = torch.linalg.solve(G + n * ridge * torch.eye(d, dtype=X.dtype, device=X.device), X.T @ Y).T
    except RuntimeError as exc:  # singular
        raise ValueError("X: X^T X is singular; the tokens do not span R^d (pass ridge > 0)") from exc
    if n > d:
        resid = Y - X @ M_hat.T
        noise = math.sqrt(float(torch.sum(resid**2)) / (k * (n - d)))
    else:
        noise = 0.0
    try:
        return Task(Sigma_hat, M_hat, noise)
    except ValueError as exc:
        raise ValueError(f"X: the empirical covariance is not positive definite ({exc})") from exc


SigmaLike = Union[torch.Tensor, Task]


def as_covariance(Sigma: SigmaLike, name: str = "Sigma") -> torch.Tensor:
    """The covariance matrix of ``Sigma``: a :class:`Task` (its ``Sigma``) or an SPD matrix (validated).

    Every function of attnlib that needs the token covariance accepts either
    form through this helper.
    """
    if isinstance(Sigma, Task):
        return Sigma.Sigma
    return check_spd(Sigma, name)


def check_task(task, name: str = "task") -> Task:
    """``task`` if it is a :class:`Task`, else a ``ValueError`` naming the argument."""
    if not isinstance(task, Task):
        raise ValueError(f"{name}: expected an attnlib.Task, got {type(task).__name__}")
    return task
