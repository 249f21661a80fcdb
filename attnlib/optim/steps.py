"""Step rules, and the registry of training methods built from them.

A step rule (:class:`Step`) is what changes between methods: :func:`attnlib.optim.run` calls,
at every iteration,

* ``evaluate(objective, A, B, record)`` -> ``(loss, objective value, gradients or None)``, the
  full objective at the current iterate (a rule may skip it when ``record`` is False and return
  ``None`` values); ``timed`` says whether this evaluation counts in ``History.time``;
* ``update(objective, A, B, grads)``: change ``A``, ``B`` in place.

Rules: :class:`GradientStep` (plain, covariance-preconditioned, and scaled to the balanced
coordinates after a capped renormalization), :class:`SGDStep` (minibatches of queries),
:class:`TorchOptimizerStep` (any ``torch.optim.Optimizer``: Adam, AdamW, Muon, Shampoo, ...).
A method is a name in :data:`METHODS` mapped to a :class:`Method`, a factory for its step rule
plus which structured components it uses by default; adding a method is one
:func:`register_method` call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from ..rng import make_generator

__all__ = ["Step", "GradientStep", "SGDStep", "TorchOptimizerStep", "Method", "METHODS", "register_method"]


class Step:
    """A step rule (see the module docstring); the default ``evaluate`` is the full objective and its gradient."""

    timed = True

    def evaluate(self, objective, A, B, record: bool):
        loss, obj = objective(A, B)
        gA, gB = torch.autograd.grad(obj, (A, B))
        return loss, obj, (gA, gB)

    def update(self, objective, A, B, grads) -> None:  # pragma: no cover - interface
        raise NotImplementedError


class GradientStep(Step):
    r"""``(A, B) <- (A, B) - lr g``; ``g`` preconditioned by ``Sigma^{-1}`` when ``precondition`` is given.

    ``precondition``: ``Sigma^{-1}`` (``A <- A - lr gA Sigma^{-1}``, ``B <- B - lr Sigma^{-1} gB Sigma^{-1}``:
    plain gradient descent in the coordinates ``(At, C)``) or ``None``. ``rescale(A, B)``: optional
    ``gamma^2`` of the iterate (:meth:`attnlib.geometry.Renormalization.gamma2`); the ``A`` block's step is
    multiplied by ``gamma^2`` and the ``B`` block's divided by it, i.e. the step is taken in the balanced
    coordinates ``(At / gamma, gamma C)`` (after a ``"cap"`` or ``"fix"`` renormalization).
    """

    def __init__(self, lr: float, precondition: Optional[torch.Tensor] = None, rescale: Optional[Callable] = None):
        self.lr, self.S_inv, self.rescale = lr, precondition, rescale

    def direction(self, gA, gB):
        if self.S_inv is not None:
            return gA @ self.S_inv, self.S_inv @ gB @ self.S_inv
        return gA, gB

    def update(self, objective, A, B, grads) -> None:
        gamma2 = None if self.rescale is None else self.rescale(A.detach(), B.detach())
        gA, gB = self.direction(*grads)
        with torch.no_grad():
            if gamma2 is None:
                A -= self.lr * gA
                B -= self.lr * gB
            else:
                A -= (self.lr * gamma2) * gA
                B -= (self.lr / gamma2) * gB


class SGDStep(GradientStep):
    """Gradient steps on minibatches of ``batch_size`` queries (all keys), drawn from ``generator``.

    The full objective is evaluated only for the record, without gradient and
    outside the timed update.
    """

    timed = False

    def __init__(self, lr: float, batch_size: int, n_queries: int, generator: torch.Generator, precondition=None):
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


class TorchOptimizerStep(Step):
    """A step rule around a ``torch.optim.Optimizer`` over ``[A, B]``.

    ``make(params, lr)`` builds the optimizer at the first update; ``schedule(t)`` (optional)
    multiplies the step size of update ``t``. The gradient of the full objective that the loop
    computed is handed to the optimizer as ``.grad`` (a copy: some optimizers change it in place).
    """

    def __init__(self, lr: float, make: Callable, schedule: Optional[Callable[[int], float]] = None):
        self.lr, self.make, self.schedule = lr, make, schedule
        self.opt: Optional[torch.optim.Optimizer] = None
        self.t = 0

    def update(self, objective, A, B, grads) -> None:
        if self.opt is None:
            self.opt = self.make([A, B], self.lr)
        if self.schedule is not None:
            for group in self.opt.param_groups:
                group["lr"] = self.lr * self.schedule(self.t)
        with torch.no_grad():
            A.grad, B.grad = grads[0].clone(), grads[1].clone()
            self.opt.step()
        A.grad = B.grad = None
        self.t += 1


@dataclass(frozen=True)
class Method:
    """A training method: a factory for its step rule and its default components.

    ``make_step(lr, context)`` returns a :class:`Step`; ``context`` holds ``precondition``
    (``Sigma^{-1}`` or ``None``), ``rescale`` (``gamma^2`` of an iterate after a capped
    renormalization, or ``None``), ``batch_size``, ``n_queries`` and ``seed``. ``structured`` says
    whether regularizer, preconditioner and renormalization are on by default; ``needs_samples``
    that it cannot run on the population objective; ``preconditionable`` whether the covariance
    preconditioner is defined for it.
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
        raise ValueError(f"method: expected an attnlib.optim.Method, got {type(method).__name__}")
    METHODS[method.name] = method
    return method


def _sgd(lr, c):
    return SGDStep(lr, c["batch_size"], c["n_queries"], make_generator(c["seed"], name="seed"), c["precondition"])


def _adam(params, lr):
    return torch.optim.Adam(params, lr=lr)


register_method(Method("structured", lambda lr, c: GradientStep(lr, c["precondition"], c["rescale"]), structured=True))
register_method(Method("gd", lambda lr, c: GradientStep(lr, c["precondition"])))
register_method(Method("sgd", _sgd, needs_samples=True))
register_method(Method("adam", lambda lr, c: TorchOptimizerStep(lr, _adam), preconditionable=False))
