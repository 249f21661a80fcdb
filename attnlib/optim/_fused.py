r"""The lockstep's step after the moment kernel, compiled (numba): estimate, gradient, update, renormalization.

:func:`attnlib.optim.run_chains` evaluates all chains' prompts in one pass of the moment kernel. What follows
it per chain is small (``k x d`` and ``d x d`` matrices) but many operations: the sums of the kernel's work
items, the regime-(ii) estimate with the control variate and its gradient, the regularizer, the preconditioned
structured update (balanced coordinates after "cap"/"fix") and the renormalization (an SVD of the product and
a Procrustes polar factor). As ~150 batched torch calls on tiny tensors that cost about 1.5 ms per step
whatever the number of chains (``benchmarks/kernel_benchmark.py``: 5-6% of a float32 step at n = 256 with
24 chains); here it is one call. The formulas are those of the torch path (:class:`attnlib.optim.lockstep._Stacked`,
:meth:`attnlib.geometry.Renormalization.stacked_each`), which stays the reference: ``tests/test_fused.py``
compares one step of every renormalization, and ``tests/test_lockstep.py`` whole chains with the sequential
ones. The SVDs are one-sided Jacobi (Hestenes) on matrices with at most ``d`` rows and ``k`` columns: numba's
``np.linalg`` needs SciPy, which the book does not install.

Status codes: 0 done; 1 not finite (the objective, the iterate before or after the update): the lockstep hands
over to the sequential chains; 2 a case the torch path decides (a polar factor that is not unique, ``k > d``):
the caller renormalizes that step with torch.
"""

from __future__ import annotations

import numpy as np

from ..model import kernels as _kernels

#: renormalization codes of :func:`step` (the lockstep's ``_Renorms`` maps its modes to them)
MODES = {None: 0, "balance": 1, "cap": 2, "fix": 3, "equalize": 4}

_STEP = None


def compiled():
    """The compiled :func:`_step` (numba compiles it at the first call, then reads numba's cache)."""
    global _STEP
    if _STEP is None:
        import numba

        _kernels._configure_numba()  # the same CPU features as the moment kernel (before numba compiles)
        opts = dict(cache=True, nogil=True, fastmath=False, error_model="numpy")
        jit = lambda f: numba.njit(**opts)(f)  # noqa: E731
        g = globals()
        for name in (
            "_mm",
            "_mTm",
            "_mmT",
            "_frob",
            "_axpy",
            "_scale",
            "_inner",
            "_cols",
            "_finite",
            "_jacobi",
            "_balance",
            "_grad",
            "_update",
        ):
            g[name] = jit(_PY[name])
        _STEP = jit(_PY["_step"])
    return _STEP


def _mm(a, b):
    """``a @ b``."""
    m, p = a.shape
    q = b.shape[1]
    out = np.zeros((m, q))
    for i in range(m):
        for t in range(p):
            v = a[i, t]
            for j in range(q):
                out[i, j] += v * b[t, j]
    return out


def _mTm(a, b):
    """``a^T @ b``."""
    return _mm(np.ascontiguousarray(a.T), b)


def _mmT(a, b):
    """``a @ b^T``."""
    return _mm(a, np.ascontiguousarray(b.T))


def _frob(a):
    s = 0.0
    for v in a.ravel():
        s += v * v
    return np.sqrt(s)


def _axpy(x, alpha, y):
    """``x + alpha y`` (2-d)."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = x[i, j] + alpha * y[i, j]
    return out


def _scale(x, alpha):
    """``alpha x`` (2-d)."""
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = alpha * x[i, j]
    return out


def _inner(x, y, transpose):
    """``sum(x * y)``, or with ``transpose`` ``sum(x * y^T)`` (square)."""
    t = 0.0
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            t += x[i, j] * (y[j, i] if transpose else y[i, j])
    return t


def _cols(U, s, r):
    """``U[:, :r] * sqrt(s[:r])``."""
    out = np.empty((U.shape[0], r))
    for j in range(r):
        h = np.sqrt(s[j])
        for i in range(U.shape[0]):
            out[i, j] = U[i, j] * h
    return out


def _finite(a):
    for v in a.ravel():
        if not np.isfinite(v):
            return False
    return True


def _jacobi(X):
    """Thin SVD of ``X`` (m x r, m >= r) by one-sided Jacobi: ``(Q, s, J)`` with ``X = Q diag(s) J^T``, ``s``
    descending, ``Q`` (m x r) with orthonormal columns where ``s > 0`` (zero columns elsewhere), ``J`` orthogonal."""
    m, r = X.shape
    Y = X.copy()
    J = np.eye(r)
    eps = 2.220446049250313e-16
    for _sweep in range(60):
        rotated = False
        for p in range(r - 1):
            for q in range(p + 1, r):
                alpha = beta = gamma = 0.0
                for i in range(m):
                    alpha += Y[i, p] * Y[i, p]
                    beta += Y[i, q] * Y[i, q]
                    gamma += Y[i, p] * Y[i, q]
                if gamma == 0.0 or abs(gamma) <= eps * np.sqrt(alpha * beta):
                    continue
                rotated = True
                zeta = (beta - alpha) / (2.0 * gamma)
                t = (1.0 if zeta >= 0 else -1.0) / (abs(zeta) + np.sqrt(1.0 + zeta * zeta))
                c = 1.0 / np.sqrt(1.0 + t * t)
                s = c * t
                for i in range(m):
                    yp = Y[i, p]
                    yq = Y[i, q]
                    Y[i, p] = c * yp - s * yq
                    Y[i, q] = s * yp + c * yq
                for i in range(r):
                    jp = J[i, p]
                    jq = J[i, q]
                    J[i, p] = c * jp - s * jq
                    J[i, q] = s * jp + c * jq
        if not rotated:
            break
    norms = np.zeros(r)
    for j in range(r):
        t = 0.0
        for i in range(m):
            t += Y[i, j] * Y[i, j]
        norms[j] = np.sqrt(t)
    Q, s, Jo = np.zeros((m, r)), np.zeros(r), np.zeros((r, r))
    taken = np.zeros(r, dtype=np.bool_)
    for jj in range(r):  # the columns by decreasing norm (the first of equal norms first)
        j = -1
        for i in range(r):
            if not taken[i] and (j < 0 or norms[i] > norms[j]):
                j = i
        taken[j] = True
        s[jj] = norms[j]
        for i in range(r):
            Jo[i, jj] = J[i, j]
        if norms[j] > 0:
            for i in range(m):
                Q[i, jj] = Y[i, j] / norms[j]
    return Q, s, Jo


def _balance(At, C):
    """The closest balanced factorization ``(At_b, C_b)`` of ``P = At C`` (:func:`attnlib.geometry._balance` in
    the coordinates of ``Sigma``) and ``s_1(P)``; status 2 where the torch path must decide (see the module)."""
    k, d = At.shape
    P = _mm(At, C)
    if k > d:
        return At, C, 0.0, 2
    V, s, U = _jacobi(P.T.copy())  # P^T = V diag(s) U^T, so P = U diag(s) V^T
    if s[0] == 0.0:
        return np.zeros_like(At), np.zeros_like(C), 0.0, 0
    rtol = max(k, d) * 2.220446049250313e-16 * 100
    r = 0
    for j in range(k):
        if s[j] > rtol * s[0]:
            r += 1
    US, VS = _cols(U, s, r), _cols(V, s, r)
    N = _axpy(_mTm(At, US), 1.0, _mm(C, VS))  # d x r
    Qn, sn, Jn = _jacobi(N)
    if sn[r - 1] <= 1e-13 * sn[0]:  # the polar factor is not unique: the torch path picks one
        return At, C, 0.0, 2
    W = _mmT(Qn, Jn)  # d x r
    return _mmT(US, W), _mmT(W, VS), s[0], 0


def _grad(sums, a, b, consts):
    """``(loss, objective, gA, gB)`` of one chain from its kernel sums (already divided by its queries)."""
    Sig, M, bayes, lam = consts[0], consts[1], consts[2], consts[3]
    k, d = a.shape
    kd = k * d
    att = 0.5 * sums[0]
    gA = sums[1 : 1 + kd].copy().reshape(k, d)
    gB = sums[1 + kd : 1 + kd + d * d].copy().reshape(d, d)
    lim = 0.5 * sums[1 + kd + d * d]
    gG = sums[2 + kd + d * d : 2 + 2 * kd + d * d].copy().reshape(k, d)
    G = _mmT(_mm(a, Sig), b)
    E = _axpy(G, -1.0, M)
    ES = _mm(E, Sig)
    loss = 0.5 * _inner(ES, E, False) + bayes + (att - lim)
    dG = _axpy(ES, -1.0, gG)
    gA = _axpy(gA, 1.0, _mm(_mm(dG, b), Sig))
    gB = _axpy(gB, 1.0, _mm(_mTm(dG, a), Sig))
    obj = loss
    if lam != 0.0:
        D = _axpy(_mTm(a, a), -1.0, _mm(_mTm(b, Sig), b))
        DS = _mm(D, Sig)
        SDS = _mm(Sig, DS)
        obj = loss + 0.25 * lam * _inner(DS, DS, True)
        gA = _axpy(gA, lam, _mm(a, SDS))
        gB = _axpy(gB, -lam, _mm(_mm(Sig, b), SDS))
    return loss, obj, gA, gB


def _update(a, b, gA, gB, consts, c):
    """The structured step of chain ``c`` and its renormalization: ``(a_new, b_new, status)``."""
    Sinv, Rh, Rih, lr, mode, cap = consts[4], consts[5], consts[6], consts[7], consts[8][c], consts[9][c]
    At, C = _mm(a, Rh), _mm(_mmT(Rh, b), Rh)  # A Rh, Rh B^T Rh
    g2 = 1.0
    if mode == 2 or mode == 3:
        na, nc = _frob(At), _frob(C)
        if na > 0 and nc > 0:
            g2 = na / nc
    a_new = _axpy(a, -(lr * g2), _mm(gA, Sinv))
    b_new = _axpy(b, -(lr / g2), _mm(_mm(Sinv, gB), Sinv))
    if not (_finite(a_new) and _finite(b_new)):
        return a_new, b_new, 1
    if mode == 0:
        return a_new, b_new, 0
    At, C = _mm(a_new, Rh), _mm(_mmT(Rh, b_new), Rh)
    if mode == 4:
        na, nc = _frob(At), _frob(C)
        if na == 0.0 or nc == 0.0:
            return a_new, b_new, 0
        c = np.sqrt(na / nc)
        return _scale(a_new, 1.0 / c), _scale(b_new, c), 0
    if not _finite(_mm(At, C)):
        return a_new, b_new, 1
    At_b, C_b, nu, status = _balance(At, C)
    if status != 0:
        return a_new, b_new, status
    gamma = 1.0
    if mode != 1 and nu != 0.0:
        gamma2 = nu / cap
        if mode == 2 and gamma2 < 1.0:
            gamma2 = 1.0
        gamma = np.sqrt(gamma2)
    a_out = _mm(_scale(At_b, gamma), Rih)
    b_out = _mm(_mmT(Rih, _scale(C_b, 1.0 / gamma)), Rih)  # Rih (C_b / gamma)^T Rih
    if not (_finite(a_out) and _finite(b_out)):
        return a_out, b_out, 1
    return a_out, b_out, 0


def _step(items, rows, scale, A, B, consts, update, outs):
    """One lockstep step of every chain after the kernel pass.

    ``items`` (C * rows, stats): the kernel's work-item sums, ``rows`` consecutive rows per chain, divided by
    ``scale`` (the chain's queries); ``A`` (C, k, d), ``B`` (C, d, d) the iterates; ``consts``: ``(Sigma, M,
    bayes_risk, lam, Sigma^-1, Sigma^1/2, Sigma^-1/2, lr, modes, caps)`` (a code of :data:`MODES` and the bound
    ``nu_cap``, 1 if none, per chain). Writes ``outs = (loss, obj, gA, gB, G_next, A_new, B_new, status)``: the
    estimate and objective (C,), the gradient of the objective at ``A``, ``B`` and, with ``update``, the
    renormalized next iterates and their limit maps ``G_next = A_new Sigma B_new^T``; ``status`` (C,) per chain
    (see the module).
    """
    loss, obj, gA, gB, G_next, A_new, B_new, status = outs
    Sig = consts[0]
    width = items.shape[1]
    for c in range(A.shape[0]):
        sums = np.zeros(width)
        for i in range(c * rows, (c + 1) * rows):
            sums += items[i]
        sums /= scale
        lo, ob, ga, gb = _grad(sums, A[c], B[c], consts)
        loss[c] = lo
        obj[c] = ob
        gA[c] = ga
        gB[c] = gb
        status[c] = 0
        if not (np.isfinite(ob) and _finite(A[c]) and _finite(B[c])):
            status[c] = 1
            continue
        if update:
            a_new, b_new, st = _update(A[c], B[c], ga, gb, consts, c)
            status[c] = st
            A_new[c] = a_new
            B_new[c] = b_new
            G_next[c] = _mmT(_mm(a_new, Sig), b_new)


_PY = {
    f.__name__: f
    for f in (_mm, _mTm, _mmT, _frob, _axpy, _scale, _inner, _cols, _finite, _jacobi, _balance, _grad, _update, _step)
}
