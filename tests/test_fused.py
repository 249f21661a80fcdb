"""The lockstep's compiled step (attnlib.optim._fused) against the torch path it replaces.

One step, the same prompts on both sides: the estimate, the objective, the gradient, and the updated and
renormalized iterates of every renormalization (with and without the regularizer). Both sides compute the same
formulas in float64; the compiled side sums in a different order and takes its SVDs by one-sided Jacobi, so the
results agree to a few 1e-16 relative; we ask 1e-12 of the largest entry (a wrong sign, factor or
transposition moves them by 1e-3 or more). Whole chains are compared with the sequential ones in
tests/test_lockstep.py.
"""

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib import experiments as ex
from attnlib.optim import _fused
from attnlib.optim import lockstep as LS

pytest.importorskip("numba")

TOL = 1e-12
MIX = [("balance", None), ("cap", 0.25), ("fix", 0.7), ("equalize", None), (False, None), ("cap", 0.05)]


@pytest.fixture(scope="module")
def task():
    return ex.make_task(0.0)


def _close(x, y, what):
    x, y = np.asarray(x), np.asarray(y)
    assert np.abs(x - y).max() <= TOL * max(np.abs(x).max(), 1e-300), what


def _iterates(task, cfgs, seed):
    """Starts of the chains moved off the manifold, so that every renormalization has work to do."""
    renorms = LS._Renorms(task, cfgs)
    A, B = LS._starts(task, cfgs, renorms)
    g = torch.Generator().manual_seed(seed)
    A = A + 0.1 * torch.randn(A.shape, generator=g, dtype=A.dtype)
    B = B + 0.1 * torch.randn(B.shape, generator=g, dtype=B.dtype)
    return A.contiguous(), B.contiguous(), renorms


@pytest.mark.parametrize("lam", [0.0, 0.5])
@pytest.mark.parametrize("adt", [torch.float64, torch.float32])
def test_one_compiled_step_equals_the_torch_step(task, lam, adt):
    base = dict(steps=3, burn_in=1, prompts=3, lr=0.5, engine="kernel", attention_dtype=adt,
                regularize=bool(lam), lam=lam or 1.0)  # fmt: skip
    cfgs = [al.optim.ChainConfig(**base, renormalize=m, nu_cap=cap, seed=0) for m, cap in MIX]
    A, B, renorms = _iterates(task, cfgs, 4)
    est = LS._Stacked(task, 20, cfgs[0], [al.derive_seed(c, "fused") for c in range(len(cfgs))])
    assert est.fused
    X, Y = est.draw()
    X, Y = X.clone(), Y.clone()
    est.draw = lambda: (X, Y)
    S_inv = torch.linalg.inv(task.Sigma)
    est.fused = False  # the torch path
    loss, obj, (gA, gB) = est(A, B)
    A1, B1 = A.clone(), B.clone()
    LS._update(A1, B1, (gA, gB), cfgs[0], S_inv, renorms)

    fused = LS._Fused(task, cfgs, S_inv)
    assert fused(est, A, B, A @ task.Sigma @ B.mT, True) == 0
    for name, x, y in (("loss", loss, fused.loss), ("objective", obj, fused.obj), ("gA", gA, fused.gA),
                       ("gB", gB, fused.gB), ("A", A1, fused.next[0]), ("B", B1, fused.next[1]),
                       ("G", A1 @ task.Sigma @ B1.mT, fused.next[2])):  # fmt: skip
        _close(x, y, name)
    assert not torch.equal(A1, A)  # the premise: the step moved the iterates
    # without the update: the same estimate and gradient, the iterates' buffers untouched
    fused.next[0].zero_()
    assert fused(est, A, B, A @ task.Sigma @ B.mT, False) == 0
    _close(gB, fused.gB, "gB")
    assert not fused.next[0].any()


def test_a_non_finite_iterate_is_status_1(task):
    cfgs = [al.optim.ChainConfig(steps=3, burn_in=1, prompts=2, lr=0.5, engine="kernel", seed=0)] * 2
    A, B, _ = _iterates(task, cfgs, 5)
    est = LS._Stacked(task, 8, cfgs[0], [1, 2])
    fused = LS._Fused(task, cfgs, torch.linalg.inv(task.Sigma))
    fused.consts = (*fused.consts[:7], 1e300, *fused.consts[8:])  # a step size that overflows
    assert fused(est, A, B, A @ task.Sigma @ B.mT, True) == 1


def _svd_cases():
    g = np.random.default_rng(0)
    yield g.standard_normal((4, 2))
    yield g.standard_normal((8, 8))
    yield g.standard_normal((5, 1))
    yield np.outer(g.standard_normal(4), g.standard_normal(3))  # rank 1
    yield np.diag([3.0, 3.0, 1e-9])  # a repeated and a tiny singular value
    yield np.zeros((4, 2))


@pytest.mark.parametrize("X", list(_svd_cases()), ids=lambda X: f"{X.shape}")
def test_jacobi_svd(X):
    _fused.compiled()
    Q, s, J = _fused._jacobi(X)
    ref = np.linalg.svd(X, compute_uv=False)
    assert np.allclose(s, ref, rtol=0, atol=1e-14 * max(ref.max(), 1.0))
    assert np.all(np.diff(s) <= 0)
    assert np.allclose(Q @ np.diag(s) @ J.T, X, rtol=0, atol=1e-14 * max(np.abs(X).max(), 1.0))
    assert np.allclose(J.T @ J, np.eye(X.shape[1]), atol=1e-14)
    live = s > 0
    assert np.allclose(Q[:, live].T @ Q[:, live], np.eye(int(live.sum())), atol=1e-13)


def test_the_cases_the_torch_path_decides(task):
    """k > d (and a polar factor that is not unique) are status 2; the lockstep then renormalizes that step with
    torch (here forced at every step) and still equals the sequential chains."""
    _fused.compiled()
    At, C = np.ones((3, 2)), np.ones((2, 2))
    assert _fused._balance(At, C)[3] == 2
    cfg = dict(steps=6, burn_in=2, prompts=3, lr=0.5, renormalize="cap", nu_cap=0.25)
    seeds = [3, 4]
    seq = [al.run_chain(task, 16, seed=s, **cfg) for s in seeds]
    real = LS._Fused.__call__

    def torch_decides(self, *a):
        real(self, *a)
        self.status[:] = np.maximum(self.status, 2)
        return int(self.status.max())

    LS._Fused.__call__ = torch_decides
    try:
        lock = al.run_chains(task, 16, seeds, **cfg)
    finally:
        LS._Fused.__call__ = real
    for a, b in zip(seq, lock):
        assert np.abs(a.R - b.R).max() <= TOL * np.abs(a.R).max()
        _close(a.history.objective, b.history.objective, "objective")
