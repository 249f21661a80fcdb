r"""Chains in lockstep: ``C`` independent regime-(ii) chains of one configuration, advanced together.

:func:`run_chains` is :func:`attnlib.optim.run_chain` for ``C`` seeds at once; the chains may differ in
their renormalization (``renormalize``, ``nu_cap``: the prompts sweep's four scales at one ``n`` run as one
lockstep). Every step draws each chain's prompts from that chain's own generator into buffers kept
between steps (so chain ``c`` sees exactly, bit for bit, the prompts that
``run_chain(task, n, config, seed=seeds[c])`` sees), then evaluates all ``C x P`` prompts in **one**
call of the moment kernel with each chain's own ``(A, B)`` (per-group parameters,
:func:`attnlib.model.kernels._loss_and_grad`), which returns per chain the attention loss, the control
variate's limit loss and their gradients from the same pass. The rest of the step (the gradient of the
estimate assembled from those sums: the population term and the limit loss through ``G = A Sigma B^T``, the
regularizer in closed form; the preconditioned structured update; the renormalization) is small ``d x d``
algebra in many operations. With float64 parameters on the CPU it is **one compiled call** for all chains
(:mod:`attnlib.optim._fused`, :class:`_Fused`); otherwise, and as the reference, it is batched over the
chains with torch (no Python loop per chain, no autograd graph;
:meth:`attnlib.geometry.Renormalization.stacked_each`: one batched call for chains that balance, cap or
fix, whatever their bounds). Either way Python and launch overhead is paid once per step, not once per
chain and step (``benchmarks/kernel_benchmark.py`` measures it). On CUDA, or without the control variate,
the estimate is batched SDPA (or the kernel) and one autograd pass. Each chain's record (``History``, every
``record_every`` steps), its iterate average and its :class:`~attnlib.optim.ChainResult` equal those of
the sequential chain to round-off (``tests/test_lockstep.py`` asks 1e-12 relative). ``History.time`` is
the lockstep's wall time divided by ``C``.

Scope: the structured method (preconditioned gradient steps, any renormalization, the regularizer if
configured), the control-variate or plain estimate, either engine and attention dtype. Divergence is the
sequential loop's business: if any chain's objective or iterate stops being finite (or the kernel's
softmax sums underflow), the chains are rerun one by one with :func:`~attnlib.optim.run_chain`, whose
divergence policy then applies, and the results are those chains' (exactly the sequential ones).
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .._validate import check_positive_int
from ..geometry import Renormalization, _stacked_distance, manifold_point
from ..model import kernels as _kernels
from ..model.finite_n import softmax_scale
from ..model.kernels import _kernel_loss_unchecked, _loss_and_grad, resolve_engine
from ..model.prompts import sample_prompts
from ..model.task import Task, check_task
from ..rng import make_generator
from . import _fused
from .api import ChainResult, _start, run_chain
from .config import ChainConfig, make_config
from .loop import History

__all__ = ["run_chains"]


class _Diverged(Exception):
    """A chain stopped being finite: the lockstep hands over to the sequential chains."""


class _Stacked:
    """The regime-(ii) estimate of ``C`` chains on their own prompts (``PromptObjective``, batched)."""

    def __init__(self, task: Task, n: int, cfg: ChainConfig, seeds: Sequence[int]):
        self.task, self.n, self.P, self.cfg = task, n, cfg.prompts, cfg
        self.gens = [make_generator(int(s)) for s in seeds]
        self.adt = task.dtype if cfg.attention_dtype is None else cfg.attention_dtype
        self.lam = cfg.lam if cfg.use_regularizer else 0.0
        probe = torch.empty(0, task.d, dtype=self.adt, device=task.device)
        self.kernel = resolve_engine(cfg.engine, probe) == "kernel"  # decided once, not at every step
        # the step after the kernel pass compiled (attnlib.optim._fused): float64 parameters on the CPU
        self.fused = self.kernel and cfg.control_variate and task.dtype == torch.float64 and task.device.type == "cpu"
        self.calls = 0
        self._buf = None

    def draw(self):
        """Every chain's prompts, ``X`` (C, P, n, d) and ``Y`` (C, P, n, k), from its own generator (those of
        :func:`~attnlib.model.prompts.sample_prompts`); a float64 CPU task draws into buffers kept between steps."""
        self.calls += 1
        task, n, P, C = self.task, self.n, self.P, len(self.gens)
        if task.dtype != torch.float64 or task.device.type != "cpu":
            pairs = [sample_prompts(task, n, P, generator=g) for g in self.gens]
            return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])
        if self._buf is None:
            self._buf = (
                torch.empty(C, P * n, task.d, dtype=torch.float64),
                torch.empty(C, P * n, task.k, dtype=torch.float64),
            )
        X, Y = self._buf
        for c, g in enumerate(self.gens):
            task.sample(P * n, generator=g, out=(X[c], Y[c]))
        return X.view(C, P, n, task.d), Y.view(C, P, n, task.k)

    def attention(self, A, B, X, Y) -> torch.Tensor:
        """``mean_b Lhat_n(X_b)`` per chain, shape (C,): ``X`` (C, P, n, d), ``Y`` (C, P, n, k)."""
        C, P, n, d = X.shape
        Xa, Ya = X.to(self.adt).reshape(C * P, n, d), Y.to(self.adt).reshape(C * P, n, -1)
        if self.kernel:
            return _kernel_loss_unchecked(A, B, Xa, Ya).to(A.dtype)
        Aa, Ba = A.to(Xa.dtype), B.to(Xa.dtype)
        q = (Xa.reshape(C, P * n, d) @ Ba).reshape(C * P, 1, n, d)
        kv = Xa[:, None]
        out = F.scaled_dot_product_attention(q, kv, kv, scale=1.0)[:, 0].reshape(C, P * n, d) @ Aa.mT
        losses = 0.5 * ((out.reshape(C, P, n, -1) - Ya.reshape(C, P, n, -1)) ** 2).sum(dim=(2, 3)) / n
        return losses.mean(dim=1).to(A.dtype)

    def __call__(self, A, B):
        """``(loss, objective, (dA, dB))``, the first two of shape (C,), on fresh prompts of every chain.

        With the moment kernel and the control variate, the gradient is assembled from the pass's own sums
        (no autograd graph): ``d att`` from the kernel, ``d (L - lim)`` through ``G = A Sigma B^T`` as
        ``W B Sigma`` and ``W^T A Sigma`` with ``W = E Sigma - d lim / dG``, and the regularizer's ``lam A S D S``,
        ``-lam S B S D S`` (``D = A^T A - B^T S B``); otherwise autograd of the same estimate.
        """
        X, Y = self.draw()
        S = self.task.Sigma
        if not (self.kernel and self.cfg.control_variate):
            loss, obj = self._estimate(A, B, X, Y)
            return loss.detach(), obj.detach(), torch.autograd.grad(obj.sum(), (A, B))
        with torch.no_grad():
            C, P, n, d = X.shape
            Xf, Yf = X.reshape(C * P, n, d), Y.reshape(C * P, n, -1)
            G = A @ S @ B.mT
            att, gA, gB, lim, gG = _loss_and_grad(A, B, Xf, Yf, Xf, out_dtype=A.dtype, Gm=G, adt=self.adt)
            E = G - self.task.M
            ES = E @ S
            loss = 0.5 * torch.sum(ES * E, dim=(1, 2)) + self.task.bayes_risk + (att - lim)
            dG = ES - gG
            gA = gA + dG @ B @ S
            gB = gB + dG.mT @ A @ S
            if not self.lam:
                return loss, loss, (gA, gB)
            D = A.mT @ A - B.mT @ S @ B
            DS = D @ S
            SDS = S @ DS
            reg = 0.25 * self.lam * torch.sum(DS * DS.mT, dim=(1, 2))
            return loss, loss + reg, (gA + self.lam * (A @ SDS), gB - self.lam * (S @ B @ SDS))

    def _estimate(self, A, B, X, Y):
        """``(loss, objective)`` as tensors of shape (C,) that autograd differentiates."""
        att = self.attention(A, B, X, Y)
        if self.cfg.control_variate:
            S = self.task.Sigma
            G = A @ S @ B.mT
            C, P, n, d = X.shape
            out = (X.reshape(C, P * n, d) @ G.mT).reshape(C, P, n, -1)
            lim = (0.5 * ((out - Y) ** 2).sum(dim=(2, 3)) / n).mean(dim=1)
            E = G - self.task.M
            pop = 0.5 * torch.sum((E @ S) * E, dim=(1, 2)) + self.task.bayes_risk
            loss = pop + (att - lim)
        else:
            loss = att
        if not self.lam:
            return loss, loss
        S = self.task.Sigma
        DS = (A.mT @ A - B.mT @ S @ B) @ S
        return loss, loss + 0.25 * self.lam * torch.sum(DS * DS.mT, dim=(1, 2))


def _config(config, options) -> ChainConfig:
    cfg = make_config(ChainConfig, config, options)
    if cfg.method != "structured" or not cfg.use_preconditioner:
        raise ValueError(
            f"method: run_chains runs the structured method with its preconditioner, got {cfg.method!r}"
            f" (precondition={cfg.use_preconditioner}); use run_chain for the others"
        )
    return cfg


#: the fields in which the chains of one lockstep may differ (besides the seed)
PER_CHAIN = ("seed", "renormalize", "nu_cap")


def _configs(config, options, seeds) -> List[ChainConfig]:
    """One validated configuration per seed: ``config`` (one ``ChainConfig``, or a sequence of them, one per seed,
    that differ at most in ``renormalize`` and ``nu_cap``) with ``options`` and each chain's seed."""
    if isinstance(config, (list, tuple)):
        if len(config) != len(seeds):
            raise ValueError(f"config: expected one ChainConfig per seed ({len(seeds)}), got {len(config)}")
        cfgs = [_config(c, {**options, "seed": s}) for c, s in zip(config, seeds)]
        common = lambda c: {k: v for k, v in dataclasses.asdict(c).items() if k not in PER_CHAIN}  # noqa: E731
        for c in cfgs[1:]:
            diff = sorted(k for k, v in common(c).items() if common(cfgs[0])[k] != v)
            if diff:
                raise ValueError(
                    f"config: the chains of one lockstep may differ only in {PER_CHAIN}, not in {diff[0]!r}"
                )
        return cfgs
    cfg = _config(config, {**options, "seed": seeds[0]})
    return [dataclasses.replace(cfg, seed=s) for s in seeds]


class _Renorms:
    """The chains' renormalizations: one :class:`~attnlib.geometry.Renormalization` per distinct ``(mode, nu_cap)``,
    applied batched (:meth:`~attnlib.geometry.Renormalization.stacked_each`, or per renormalization on its chains)."""

    def __init__(self, task: Task, cfgs: Sequence[ChainConfig]):
        keys = [(c.renormalization, c.nu_cap if c.renormalization in ("cap", "fix") else None) for c in cfgs]
        by_key = {key: (Renormalization(key[0], task, key[1]) if key[0] else None) for key in dict.fromkeys(keys)}
        self.of_chain = [by_key[key] for key in keys]
        self.groups = [
            (ren, torch.tensor([i for i, k in enumerate(keys) if k == key], dtype=torch.long, device=task.device))
            for key, ren in by_key.items()
        ]
        self._capfix = torch.tensor(
            [r is not None and r.mode in ("cap", "fix") for r in self.of_chain], device=task.device
        )

    def gamma2(self, A, B) -> Optional[torch.Tensor]:
        """Per chain, the balanced-coordinates factor of "cap"/"fix" (1 for the others), shape (C, 1, 1); None if
        no chain has one."""
        if not bool(self._capfix.any()):
            return None
        ren = next(r for r in self.of_chain if r is not None and r.mode in ("cap", "fix"))
        out = ren.stacked_gamma2(A, B)  # the same Sigma for every chain: one batched call, then 1 where no cap/fix
        return torch.where(self._capfix, out, 1.0)[:, None, None]

    def apply(self, A, B) -> None:
        """Renormalize every chain in place: one batched call where every chain balances, caps or fixes, else one
        per renormalization ("equalize", or none) on its chains."""
        if all(r is not None and r.mode in ("balance", "cap", "fix") for r in self.of_chain):
            A_new, B_new = Renormalization.stacked_each(self.of_chain, A, B)
            A.copy_(A_new)
            B.copy_(B_new)
            return
        for ren, idx in self.groups:
            if ren is not None:
                A_new, B_new = ren.stacked(A[idx], B[idx])
                A.index_copy_(0, idx, A_new)
                B.index_copy_(0, idx, B_new)


def _starts(task: Task, cfgs: Sequence[ChainConfig], renorms: _Renorms):
    """Each chain's start, as :func:`~attnlib.optim.run_chain` builds it, stacked: (C, k, d), (C, d, d)."""
    As, Bs = [], []
    for c, ren in zip(cfgs, renorms.of_chain):
        A, B = _start(c, task.d, task.k, "spectral", lambda: manifold_point(task, task.svd[2]), task.Sigma)
        if ren is not None:
            A, B = ren(A, B)
        As.append(A)
        Bs.append(B)
    return torch.stack(As), torch.stack(Bs)


class _Record:
    """Every chain's :class:`~attnlib.optim.History` and iterate average (the Recorder and IterateAverage, batched)."""

    def __init__(self, task: Task, cfgs: Sequence[ChainConfig], n: int):
        info = dict(n=n, objective="expected loss L_n")
        cfg = cfgs[0]
        self.hists = [History(method=c.method, config={**c.summary(), **info}) for c in cfgs]
        C = len(cfgs)
        self.task, self.burn_in, self.C = task, cfg.burn_in, C
        self.overflow = float(torch.finfo(task.dtype).max) ** 0.5
        self.G_sum = torch.zeros(C, *task.M.shape, dtype=task.dtype, device=task.device)
        self.loss_sum = [0.0] * C
        self.count = 0

    def record(self, t, A, B, loss, obj, grads, elapsed) -> None:
        with torch.no_grad():
            E = A @ self.task.Sigma @ B.mT - self.task.M
            excess = (0.5 * torch.sum((E @ self.task.Sigma) * E, dim=(1, 2))).tolist()
            if not all(e <= self.overflow for e in excess):
                raise _Diverged
            dist = _stacked_distance(A, B, self.task).tolist()
            gn = torch.sqrt(torch.sum(grads[0] ** 2, dim=(1, 2)) + torch.sum(grads[1] ** 2, dim=(1, 2))).tolist()
        for c, (h, lo, ob) in enumerate(zip(self.hists, loss.tolist(), obj.tolist())):
            h.excess.append(excess[c])
            h.dist.append(dist[c])
            h.steps.append(t)
            h.loss.append(lo)
            h.objective.append(ob)
            h.grad_norm.append(gn[c])
            h.time.append(elapsed / self.C)

    def average(self, t, A, B, loss, G=None) -> None:
        """Add step ``t``'s limit maps (``G = A Sigma B^T`` where the caller has them) and losses after the burn-in."""
        if t >= self.burn_in:
            with torch.no_grad():
                self.G_sum += A.detach() @ self.task.Sigma @ B.detach().mT if G is None else G
            self.loss_sum = [s + v for s, v in zip(self.loss_sum, loss.tolist())]
            self.count += 1


def _finite(*tensors) -> None:
    if not all(bool(torch.isfinite(x).all()) for x in tensors):
        raise _Diverged


def _update(A, B, grads, cfg: ChainConfig, S_inv, renorms: _Renorms) -> None:
    """The structured step of every chain (preconditioned; balanced coordinates after "cap"/"fix"), renormalized."""
    gA, gB = grads[0] @ S_inv, S_inv @ grads[1] @ S_inv
    with torch.no_grad():
        gamma2 = renorms.gamma2(A.detach(), B.detach())
        if gamma2 is not None:
            A -= (cfg.lr * gamma2) * gA
            B -= (cfg.lr / gamma2) * gB
        else:
            A -= cfg.lr * gA
            B -= cfg.lr * gB
        _finite(A, B)
        renorms.apply(A, B)
        _finite(A, B)


class _Fused:
    """The compiled step after the kernel pass (:mod:`attnlib.optim._fused`) with its constants and output
    buffers: every chain's estimate, gradient, update and renormalization in one call."""

    def __init__(self, task: Task, cfgs: Sequence[ChainConfig], S_inv: torch.Tensor):
        cfg, C, k, d = cfgs[0], len(cfgs), task.k, task.d
        self.fn = _fused.compiled()
        f8 = lambda t: t.detach().to(torch.float64).contiguous().numpy()  # noqa: E731
        lam = cfg.lam if cfg.use_regularizer else 0.0
        modes = np.array([_fused.MODES[c.renormalization] for c in cfgs], dtype=np.int64)
        caps = np.array([c.nu_cap if c.renormalization in ("cap", "fix") else 1.0 for c in cfgs], dtype=np.float64)
        self.consts = (f8(task.Sigma), f8(task.M), float(task.bayes_risk), float(lam), f8(S_inv),
                       f8(task.Sigma_sqrt), f8(task.Sigma_inv_sqrt), float(cfg.lr), modes, caps)  # fmt: skip
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
        self.loss, self.obj, self.gA, self.gB = z(C), z(C), z(C, k, d), z(C, d, d)
        self.status = np.zeros(C, dtype=np.int64)
        self.next = (z(C, k, d), z(C, d, d), z(C, k, d))  # A, B and G of the next step

    def __call__(self, estimate: _Stacked, A, B, G, update: bool) -> int:
        """One step at ``(A, B)`` (``G = A Sigma B^T``): draw every chain's prompts, run the kernel pass, fill the
        outputs (with ``update``, the next iterates in ``self.next``); returns the largest status."""
        C, P, n = A.shape[0], estimate.P, estimate.n
        X, Y = estimate.draw()
        Xf, Yf = X.reshape(C * P, n, A.shape[2]), Y.reshape(C * P, n, A.shape[1])
        fn, args = _kernels._prepare(B, Xf, Xf, A, Yf, G, False, estimate.adt)
        fn(*args)
        items = args[7]  # the work items' sums, consecutive rows per chain
        An, Bn, Gn = (t.numpy() for t in self.next)
        outs = (self.loss.numpy(), self.obj.numpy(), self.gA.numpy(), self.gB.numpy(), Gn, An, Bn, self.status)
        self.fn(items, items.shape[0] // C, float(n * P), A.numpy(), B.numpy(), self.consts, update, outs)
        return int(self.status.max())


def _fused_loop(task: Task, cfgs, estimate: _Stacked, rec: _Record, renorms: _Renorms, A, B, S_inv):
    """The lockstep loop with the compiled step (:class:`_Fused`); leaves the last iterates in ``A``, ``B``."""
    cfg, fused, elapsed = cfgs[0], _Fused(task, cfgs, S_inv), 0.0
    G = A @ task.Sigma @ B.mT
    for t in range(cfg.steps + 1):
        t0 = time.perf_counter()
        status = fused(estimate, A, B, G, t < cfg.steps)
        elapsed += time.perf_counter() - t0
        if status == 1:
            raise _Diverged
        grads = (fused.gA, fused.gB)
        if (t % cfg.record_every == 0) or t == cfg.steps:
            rec.record(t, A, B, fused.loss, fused.obj, grads, elapsed)
        rec.average(t, A, B, fused.loss, G)
        if t == cfg.steps:
            break
        t0 = time.perf_counter()
        if status == 2:  # a renormalization the torch path decides (attnlib.optim._fused)
            _update(A, B, grads, cfg, S_inv, renorms)
            G = A @ task.Sigma @ B.mT
        else:
            An, Bn, Gn = fused.next
            fused.next = (A, B, G)
            A, B, G = An, Bn, Gn
        elapsed += time.perf_counter() - t0
    return A, B


def _lockstep(task: Task, n: int, cfgs: Sequence[ChainConfig]) -> List[ChainResult]:
    """The loop of :func:`attnlib.optim.run` for every chain at once (raises ``_Diverged``)."""
    cfg = cfgs[0]  # the fields the chains share
    renorms = _Renorms(task, cfgs)
    A0, B0 = _starts(task, cfgs, renorms)
    seeds = [c.seed for c in cfgs]
    estimate, rec = _Stacked(task, n, cfg, seeds), _Record(task, cfgs, n)
    S_inv, elapsed = torch.linalg.inv(task.Sigma), 0.0
    if estimate.fused:
        A, B = _fused_loop(task, cfgs, estimate, rec, renorms, A0.contiguous(), B0.contiguous(), S_inv)
        return _results(task, rec, A, B, estimate.calls)
    A, B = A0.requires_grad_(True), B0.requires_grad_(True)
    for t in range(cfg.steps + 1):
        t0 = time.perf_counter()
        loss, obj, grads = estimate(A, B)
        elapsed += time.perf_counter() - t0
        _finite(obj, A.detach(), B.detach())
        if (t % cfg.record_every == 0) or t == cfg.steps:
            rec.record(t, A.detach(), B.detach(), loss, obj, grads, elapsed)
        rec.average(t, A, B, loss)
        if t == cfg.steps:
            break
        t0 = time.perf_counter()
        _update(A, B, grads, cfg, S_inv, renorms)
        elapsed += time.perf_counter() - t0
    return _results(task, rec, A.detach(), B.detach(), estimate.calls)


def _results(task: Task, rec: _Record, A, B, calls: int) -> List[ChainResult]:
    out = []
    for c, h in enumerate(rec.hists):
        h.A, h.B = A[c].clone(), B[c].clone()
        R = rec.G_sum[c] / rec.count - task.M
        out.append(
            ChainResult(
                R=R.cpu().numpy(),
                naive_excess=0.5 * float(torch.sum((R @ task.Sigma) * R)),
                test_excess=rec.loss_sum[c] / rec.count - task.bayes_risk,
                nu=softmax_scale(h.A, h.B, task),
                history=h,
                batches=calls,
            )
        )
    return out


def run_chains(task: Task, n: int, seeds: Sequence[int], config=None, /, **options):
    """``[run_chain(task, n, config, seed=s) for s in seeds]``, computed in lockstep (see the module docstring).

    ``seeds``: one per chain (distinct, e.g. ``derive_seed``); ``config``: a :class:`ChainConfig` for every
    chain, or a sequence of them, one per seed, that differ at most in ``renormalize`` and ``nu_cap`` (chains of
    different renormalizations share the kernel pass; each group of equal renormalization is renormalized
    batched); its fields as keywords apply to every chain; ``seed`` is ignored. The structured method only.
    Chains with the regularizer after a "cap" or "fix" renormalization run one by one (``run_chain``): in
    lockstep they do not yet reproduce the sequential chains.
    Returns one :class:`~attnlib.optim.ChainResult` per seed, in order, equal to the sequential chains' to
    round-off.
    """
    task, n = check_task(task), check_positive_int(n, "n")
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds: expected at least one seed")
    cfgs = _configs(config, options, seeds)
    if any(c.use_regularizer and c.renormalization in ("cap", "fix") for c in cfgs):
        # the regularizer after a capped renormalization: the lockstep does not reproduce the sequential chains
        # (found 2026-12-01, not yet understood), so these chains run one by one
        return [run_chain(task, n, c) for c in cfgs]
    try:
        return _lockstep(task, n, cfgs)
    except (_Diverged, ZeroDivisionError):
        return [run_chain(task, n, c) for c in cfgs]
