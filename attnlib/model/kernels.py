r"""The loss and its gradient for the book's layer, computed from moments (CPU kernel, no autograd).

For one sequence (or prompt) ``X`` (n x d) with targets ``Y`` (n x k), queries ``q_i`` (the tokens,
or a subset of them) and weights ``p_ij = softmax_j(q_i^T B x_j)``, write

.. math:: o_i = \sum_j p_{ij} x_j, \qquad M_i = \sum_j p_{ij} x_j x_j^\top, \qquad
          r_i = A o_i - y_i, \qquad g_i = A^\top r_i / N .

Then the empirical loss ``L = 1/(2N) sum_i ||r_i||^2`` (N queries) has the exact gradient

.. math:: \partial L / \partial A = \sum_i r_i o_i^\top / N, \qquad
          \partial L / \partial B = \sum_i q_i \big((M_i - o_i o_i^\top) g_i\big)^\top ,

because ``d o_i / d s_ij = p_ij (x_j - o_i)`` and ``d s_ij / d B = q_i x_j^T``. The kernel never forms
``M_i``: with ``u_j = A x_j`` (k numbers per key, computed once),
``M_i A^T r_i = N_i r_i`` where ``N_i = sum_j p_ij x_j u_j^T`` (d x k), and ``o_i o_i^T A^T r_i =
o_i ((r_i + y_i) . r_i)``. So one pass over the pairs accumulates ``Z``, ``o`` and ``N``
(``1 + d + d k`` numbers: 13 at the book's d = 4, k = 2, against ``1 + d + d (d + 1) / 2 = 15`` for
``M``; per pair ``d`` fused multiply-adds for the score, one exponential, then ``1 + d + k + d k``
operations, 19 vector instructions per 8 (float64) or 16 (float32) pairs besides the exponential's,
against 23 with ``M``), and gives the loss and the gradient with no backward pass and no key or value
gradients; the rest is (N x d) arithmetic, done per query inside the kernel. The pass is a numba
kernel generated for each ``(d, k)`` with ``d <= 8`` (the accumulators live in registers; 512-bit
vectors where the CPU has AVX-512), parallel over prompts and blocks of queries with the thread count
of :mod:`attnlib.runtime` (torch's intra-op count: one place for threads). Per pair everything is in
the attention dtype (the dtype of the keys ``X``); per query, in float64, it forms ``r_i``,
``h_i = N_i r_i - o_i (A o_i . r_i)`` and adds ``||r_i||^2``, ``r_i o_i^T`` and ``q_i h_i^T`` to its
work item's sums (and, for the regime-(ii) control variate, ``rho_i = G q_i - y_i``'s ``||rho_i||^2``
and ``rho_i q_i^T`` for a given k x d map ``G``: the limit loss of the same prompts in the same pass);
the items' sums are added in float64. :func:`moments` returns ``o_i`` and ``M_i`` themselves, for
inspection (the same pass with ``A = I``, so ``N_i = M_i``).

Its softmax is stabilized by the shift ``c_i = ||B^T q_i|| max_j ||x_j|| >= max_j s_ij``
(Cauchy-Schwarz), so no exponent is positive; where this shift is so far above the true maximum that
every weight underflows (``sum_j exp(s_ij - c_i)`` below 1e-200 in float64, 1e-20 in float32; very
large scores), the query is redone with the exact maximum. In float32, ``N_i r_i - o_i (A o_i . r_i)``
(the weighted covariance of the keys applied to ``A^T r_i``) loses relative accuracy
``~ eps |M_i| / |M_i - o_i o_i^T|`` when attention is nearly hard (a few keys carry all the weight);
for the book's softmax scales (``nu <= 1``) the float32 loss and gradient agree with float64 to about
1e-7 relative (16 prompts, n = 1024; ``tests/test_kernels.py`` asks 2e-5).

Public entry points:

* :func:`loss_and_grad` ``(A, B, X, Y, queries=None) -> (loss, dL/dA, dL/dB)``: ``X`` of shape
  (n, d) (one sequence; ``queries`` a LongTensor of query rows, as in
  :func:`attnlib.model.layer.empirical_loss`) or (P, n, d) (P prompts: the mean over prompts of their
  losses, as in :class:`attnlib.optim.PromptObjective`); float32 or float64, CPU, ``d <= 8``.
* :func:`kernel_loss`: the same loss as a 0-dim tensor that autograd differentiates in ``A`` and
  ``B`` (the gradient is the one computed in the same pass; ``X``, ``Y`` are data: no gradient,
  no second derivatives). :func:`attnlib.model.layer.empirical_loss` and the regime-(ii) objective
  call it with ``engine="kernel"`` (or ``"auto"``).
* :func:`resolve_engine`: ``"auto"`` is this kernel for CPU tensors with ``d <= 8`` where numba is
  installed, else ``"sdpa"`` (torch's fused attention and autograd: the reference, and the path
  on CUDA).

Compiled code is cached on disk (numba ``cache=True``) in :func:`cache_dir`:
``$ATTNLIB_KERNEL_CACHE`` or ``~/.cache/attnlib/kernels`` (outside the repository). The first call
for a new ``(d, k, dtype, serial or parallel)`` compiles for a few seconds; later processes load the
cache (``benchmarks/kernel_benchmark.py`` measures both).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from .._validate import check_matrix

__all__ = [
    "ENGINES",
    "MAX_D",
    "available",
    "cache_dir",
    "resolve_engine",
    "moments",
    "loss_and_grad",
    "kernel_loss",
]

#: The engine names. ``"auto"`` is the kernel on CPU where it applies, else SDPA; ``"kernel"``; ``"sdpa"``.
ENGINES = ("auto", "kernel", "sdpa")
#: the largest token dimension the kernel is generated for
MAX_D = 8
_BLOCK = 64  # queries per parallel work item (each item adds its sums to one row of S)
_WHOLE_MIN = 8  # from this many prompts on, one work item per prompt (the kernel transposes the keys itself)
_TINY = {torch.float64: 1e-200, torch.float32: 1e-20}
_CACHE_ENV = "ATTNLIB_KERNEL_CACHE"


def available() -> bool:
    """Whether numba is installed (the kernel needs it; without it ``"auto"`` means ``"sdpa"``)."""
    return importlib.util.find_spec("numba") is not None


def cache_dir() -> Path:
    """Where the generated kernels and numba's compiled cache live: ``$ATTNLIB_KERNEL_CACHE`` or
    ``~/.cache/attnlib/kernels`` (``$XDG_CACHE_HOME/attnlib/kernels`` where that is set)."""
    if os.environ.get(_CACHE_ENV):
        return Path(os.environ[_CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnlib" / "kernels"


def resolve_engine(engine: str, X: torch.Tensor) -> str:
    """``"kernel"`` or ``"sdpa"`` for tokens ``X`` (last dimension d): ``engine`` itself, or for
    ``"auto"`` the kernel on CPU with ``d <= MAX_D`` where numba is installed and ``X`` needs no
    gradient. Raises ``ValueError`` naming ``engine`` for an unknown name, or for ``"kernel"`` where
    it cannot run (CUDA tensors, ``d > MAX_D``, no numba, ``X`` requiring a gradient)."""
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
    if engine == "sdpa":
        return "sdpa"
    why = _unsupported(X)
    if engine == "auto":
        return "sdpa" if why else "kernel"
    if why:
        raise ValueError(f"engine: 'kernel' cannot run here ({why}); use engine='sdpa' or 'auto'")
    return "kernel"


def _unsupported(X: torch.Tensor) -> Optional[str]:
    if X.device.type != "cpu":
        return f"tensors on {X.device.type}, the kernel is CPU-only"
    if X.dtype not in _TINY:
        return f"dtype {X.dtype}, expected float32 or float64"
    if X.shape[-1] > MAX_D:
        return f"d = {X.shape[-1]} > {MAX_D}"
    if X.requires_grad:
        return "X requires a gradient, the kernel differentiates in A and B only"
    if not available():
        return "numba is not installed"
    return None


# ----------------------------------------------------------------------------- code generation


def _stats_size(d: int, k: int) -> int:
    """Per work item, the partial sums over its queries: ``sum r^2``, ``sum r o^T`` (k x d), ``sum q h^T``
    (d x d), then for the control variate ``sum rho^2`` and ``sum rho q^T`` (k x d)."""
    return 1 + k * d + d * d + 1 + k * d


def _item_lines(d: int, k: int) -> list:
    """Per work item: its prompt, group and queries; the keys (transposed here for a whole-prompt item),
    their projections ``u_j = A x_j`` and ``max_j ||x_j||``."""
    L = [
        "    P = X.shape[0]",
        "    n = X.shape[1]",
        "    m = Q.shape[1]",
        "    z = XT.dtype.type(0)  # a zero of the attention dtype",
        "    nblk = (m + block - 1) // block",
        "    for item in prange(P * nblk):",
        "        b = item // nblk",
        "        g = b // pg  # the parameter group (chain) of prompt b",
        "        i0 = (item % nblk) * block",
        "        i1 = min(m, i0 + block)",
        "        if whole:  # the item is the whole prompt: transpose (and cast) its keys here",
        f"            xt = np.empty(({d}, n), XT.dtype)",
        "            for j in range(n):",
    ]
    L += [f"                xt[{a}, j] = X[b, j, {a}]" for a in range(d)]
    L += ["        else:", "            xt = XT[b]"]
    # the projected keys u_j = A x_j, from the keys in the attention dtype (the same loop for both kinds of item)
    L += [f"        ut = np.empty(({k}, n), XT.dtype)", "        for j in range(n):"]
    L += [f"            ut[{c}, j] = " + " + ".join(f"A[g, {c}, {a}] * xt[{a}, j]" for a in range(d)) for c in range(k)]
    L += [f"        x{a} = xt[{a}]" for a in range(d)]
    L += [f"        u{c} = ut[{c}]" for c in range(k)]
    L += [
        "        xm = z",
        "        for j in range(n):",
        "            v = " + " + ".join(f"x{a}[j] * x{a}[j]" for a in range(d)),
    ]
    L += [
        "            xm = max(xm, v)",
        "        xmax = np.sqrt(np.float64(xm))",
        f"        qv = np.empty({d + 1}, XT.dtype)",
    ]
    return L


def _query_lines(d: int, k: int) -> list:
    """Per query: ``qB``, the shift, the pass over the keys (``Z``, ``o``, ``N``; redone with the exact maximum
    where every weight underflowed), normalized; stored with ``store``."""
    ax = [(a, c) for a in range(d) for c in range(k)]
    acc = ["Z"] + [f"o{a}" for a in range(d)] + [f"n{a}_{c}" for a, c in ax]
    dot = " + ".join(f"q{a} * y{a}" for a in range(d))
    dot_x = lambda j: " + ".join(f"q{a} * x{a}[{j}]" for a in range(d))  # noqa: E731
    L = []
    L += ["        s = S[item]", "        s[:] = 0.0", "        for i in range(i0, i1):"]
    L += [f"            w{a} = Q[b, i, {a}]" for a in range(d)]
    for c in range(d):
        L += [f"            qv[{c}] = " + " + ".join(f"w{a} * B[g, {a}, {c}]" for a in range(d))]
    L += [f"            q{a} = qv[{a}]" for a in range(d)]
    L += [
        f"            qv[{d}] = np.sqrt(" + " + ".join(f"np.float64(q{a}) * q{a}" for a in range(d)) + ") * xmax",
        f"            c = qv[{d}]  # >= every score (Cauchy-Schwarz), in the attention dtype",
        "            for attempt in range(2):",
        "                " + " = ".join(acc) + " = z",
        "                for j in range(n):",
    ]
    L += [f"                    y{a} = x{a}[j]" for a in range(d)]
    L += [f"                    e = exp_nonpos({dot} - c)", "                    Z += e"]
    L += [f"                    o{a} += e * y{a}" for a in range(d)]
    L += [f"                    t{c} = e * u{c}[j]" for c in range(k)]
    L += [f"                    n{a}_{c} += t{c} * y{a}" for a, c in ax]
    L += [
        "                if Z >= tiny:",
        "                    break",
        "                c = " + dot_x(0),  # every weight underflowed: shift by the exact maximum, redo
        "                for j in range(1, n):",
        "                    c = max(c, " + dot_x("j") + ")",
        "            inv = 1 / Z",
    ]
    L += [f"            {name} *= inv" for name in acc[1:]]
    L += ["            if store:"] + [f"                out[b, i, {t}] = {name}" for t, name in enumerate(acc[1:])]
    return L


def _epilogue_lines(d: int, k: int) -> list:
    """Per query, in float64: ``r = A o - y``, ``h = N r - o (A o . r)`` and the item's sums (the control variate's
    with ``cv``)."""
    kd = k * d
    L = []
    # per query, in float64: residual, h = N r - o (A o . r), partial sums
    L += [f"            O{a} = np.float64(o{a})" for a in range(d)]
    for c in range(k):
        L += [f"            yq{c} = Yq[b, i, {c}]"]
        L += [f"            r{c} = " + " + ".join(f"A[g, {c}, {a}] * O{a}" for a in range(d)) + f" - yq{c}"]
    L += ["            ur = " + " + ".join(f"(r{c} + yq{c}) * r{c}" for c in range(k))]
    L += [f"            h{a} = " + " + ".join(f"np.float64(n{a}_{c}) * r{c}" for c in range(k)) + f" - O{a} * ur"
          for a in range(d)]  # fmt: skip
    L += ["            s[0] += " + " + ".join(f"r{c} * r{c}" for c in range(k))]
    L += [f"            s[{1 + c * d + a}] += r{c} * O{a}" for c in range(k) for a in range(d)]
    L += [f"            s[{1 + kd + a * d + e}] += w{a} * h{e}" for a in range(d) for e in range(d)]
    L += ["            if cv:"]
    for c in range(k):
        L += [f"                p{c} = " + " + ".join(f"Gm[g, {c}, {a}] * w{a}" for a in range(d)) + f" - yq{c}"]
    L += [f"                s[{1 + kd + d * d}] += " + " + ".join(f"p{c} * p{c}" for c in range(k))]
    L += [f"                s[{2 + kd + d * d + c * d + a}] += p{c} * w{a}" for c in range(k) for a in range(d)]
    return L


def _kernel_source(d: int, k: int) -> str:
    """numba source of the moment kernel for tokens of dimension ``d`` and targets of dimension ``k``
    (two functions: serial and parallel).

    A work item is a block of ``block`` queries of one prompt ``b`` (parameter group ``g = b // pg``), or with
    ``whole`` the whole prompt, whose keys the item then transposes (and casts) from ``X`` itself instead of
    reading them from ``XT``; either way it projects them, ``u_j = A x_j`` in the attention dtype, and takes
    ``max_j ||x_j||``. Per query ``i``: the shift ``c``, then one pass over the keys accumulating
    ``Z = sum_j e_j``, ``o = sum_j e_j x_j`` and ``N = sum_j e_j x_j u_j^T`` with ``e_j = exp(qB x_j - c)``,
    in the attention dtype; then, in float64,
    ``r = A o - y``, ``h = N r - o (A o . r) = (M - o o^T) A^T r`` and the item's partial sums ``S[item]``.
    """
    L = _item_lines(d, k) + _query_lines(d, k) + _epilogue_lines(d, k)
    text = "\n".join(L)
    head = [
        f'"""Generated by attnlib.model.kernels for d = {d}, k = {k}; do not edit (regenerated when it differs)."""',
        "",
        "import numpy as np",
        "from numba import njit, prange",
        "",
        "from attnlib.model._numba_exp import exp_nonpos",
        "",
        f"# exponential source hash: {_exp_hash()}",
        "",
    ]
    funcs = []
    for name, par in (("moments_serial", False), ("moments_parallel", True)):
        funcs += [
            "",
            f"@njit(cache=True, fastmath=True, nogil=True, parallel={par})",
            f"def {name}(X, XT, Q, Yq, A, B, Gm, S, out, block, tiny, pg, cv, store, whole):",
            text,
            "",
        ]
    return "\n".join(head + funcs)


def _exp_hash() -> str:
    path = Path(__file__).with_name("_numba_exp.py")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


_LOADED: Dict[Tuple[int, int], object] = {}


def _configure_numba() -> None:
    """Let LLVM use 512-bit vectors where the CPU has AVX-512.

    Its default tuning for recent Xeons prefers 256-bit vectors; for this kernel (long vector
    loops, no frequency-sensitive mix) 512 bits halve the instruction count (measured: 1.7x in
    float64 at n = 1024). Applies only before numba compiles its first function in the process, and
    only where neither ``NUMBA_CPU_NAME`` nor ``NUMBA_CPU_FEATURES`` is set (the user's choice wins).
    numba keys its cache by CPU name and features, so cached code never mixes the two settings.
    """
    from numba.core import config

    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        return
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    if features.get("avx512f", False):
        config.CPU_FEATURES = features.flatten() + ",-prefer-256-bit"


def _kernel_module(d: int, k: int):
    """The generated module for ``(d, k)`` (written to :func:`cache_dir` when missing or different)."""
    if (d, k) in _LOADED:
        return _LOADED[d, k]
    if not _LOADED:
        _configure_numba()
    src = _kernel_source(d, k)
    name = f"attnlib_moments2_d{d}_k{k}"
    try:
        path = _write_source(cache_dir(), name, src)
    except OSError:  # a read-only home (some containers): a private folder in the temporary directory
        path = _write_source(Path(tempfile.gettempdir()) / f"attnlib-kernels-{os.getuid()}", name, src)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # numba's cache rebuilds the kernel's environment by importing it by name
    spec.loader.exec_module(mod)
    _LOADED[d, k] = mod
    return mod


def _write_source(folder: Path, name: str, src: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text() != src:  # rewriting an equal file would invalidate numba's cache
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(src)
        os.replace(tmp, path)
    return path


def _threads() -> int:
    """The thread count in force (:mod:`attnlib.runtime` sets torch's; the kernel follows it)."""
    return max(1, torch.get_num_threads())


# ----------------------------------------------------------------------------- the kernel


def moments(B, X, queries=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax-weighted first and second moments for every prompt and query.

    ``X``: (P, n, d) keys (= values), float32 or float64, CPU, ``d <= 8``; ``queries``: (P, m, d)
    query tokens (default ``X``); ``B`` (d, d). Returns ``O`` (P, m, d) with ``O[b, i] = o_i`` and
    ``M`` (P, m, d, d) with ``M[b, i] = M_i``, in ``X``'s dtype.
    """
    X = check_matrix(X, "X", (None, None, None))
    if min(X.shape) < 1:
        raise ValueError(f"X: expected a non-empty (P, n, d) array, got shape {tuple(X.shape)}")
    P, n, d = X.shape
    B = check_matrix(B, "B", (d, d)).to(X)
    Q = X if queries is None else check_matrix(queries, "queries", (P, None, d)).to(X)
    why = _unsupported(X.detach())
    if why:
        raise ValueError(f"X: the moment kernel cannot run here ({why})")
    return _moments(B.detach(), X.detach(), Q.detach())


def _prepare(B, X, Q, A, Yq, Gm=None, store=False, adt=None):
    """The compiled function and its arguments for one moment pass (see :func:`_run_kernel`; the keys ``X`` are
    cast to ``adt``, default their dtype, in the copy that transposes them); the benchmark times the call alone."""
    P, n, d = X.shape
    m, k = Q.shape[1], A.shape[-2]
    G = B.shape[0] if B.dim() == 3 else 1
    f8 = torch.float64
    mod = _kernel_module(d, k)
    A8 = A.reshape(G, k, d).to(f8).contiguous()
    adt = X.dtype if adt is None else adt
    whole = P >= _WHOLE_MIN
    if whole:  # one work item per prompt: the kernel transposes and casts the keys itself
        block = max(m, 1)
        XT = torch.empty(0, 0, 0, dtype=adt)
    else:
        block = _BLOCK
        XT = _scratch("XT", (P, d, n), adt)
        XT.copy_(X.transpose(1, 2))
    Xk = X.contiguous()  # the kernel reads it in whole-prompt items only
    nblk = (m + block - 1) // block
    S = _scratch("S", (P * nblk, _stats_size(d, k)), f8).numpy()  # each item zeroes its row
    out = np.empty((P, m, d + d * k) if store else (0, 0, 0), dtype=XT.numpy().dtype)
    G8 = A8 if Gm is None else Gm.reshape(G, k, d).to(f8).contiguous()
    args = (Xk.numpy(), XT.numpy(), Q.to(f8).contiguous().numpy(), Yq.to(f8).contiguous().numpy(),
            A8.numpy(), B.reshape(G, d, d).to(f8).contiguous().numpy(), G8.numpy(), S, out, block, _TINY[adt],
            P // G, Gm is not None, store, whole)  # fmt: skip
    threads = _threads()
    if threads > 1:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        return mod.moments_parallel, args
    return mod.moments_serial, args


_SCRATCH = threading.local()


def _scratch(name: str, shape, dtype) -> torch.Tensor:
    """A buffer for one pass's transposed keys or its sums, kept (per thread) while calls keep the
    same shapes: a chain allocates them once, not at every step (fresh multi-megabyte arrays cost page faults)."""
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    t = bufs.get(name)
    if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        t = bufs[name] = torch.empty(shape, dtype=dtype)
    return t


def _run_kernel(B, X, Q, A, Yq, Gm=None, store=False, adt=None):
    """One moment pass. ``X`` (P, n, d) keys (cast to ``adt``); ``Q`` (P, m, d) query tokens and ``Yq``
    (P, m, k) their targets; ``A`` (k, d), ``B`` (d, d) for every prompt, or per group ``A`` (G, k, d),
    ``B`` (G, d, d) (the P prompts split into G consecutive groups of P / G: the chains of
    :func:`attnlib.optim.run_chains`); ``Gm`` the control variate's linear map, shaped like ``A``, or None.

    Returns ``(S, out)``: ``S`` (G, :func:`_stats_size`) float64, each group's sums over its queries
    (``sum ||r||^2``, ``sum r o^T``, ``sum q h^T``, then with ``Gm`` ``sum ||rho||^2``, ``sum rho q^T``,
    ``rho = Gm q - y``), and with ``store`` ``out`` (P, m, d + d k): ``o_i`` and ``N_i`` per query. ``adt``: the
    attention dtype the keys are cast to (default ``X``'s).
    """
    fn, args = _prepare(B, X, Q, A, Yq, Gm, store, adt)
    fn(*args)
    G = B.shape[0] if B.dim() == 3 else 1
    S, out = args[7], args[8]
    return S.reshape(G, S.shape[0] // G, -1).sum(axis=1), out


def _moments(B, X, Q):
    P, n, d = X.shape
    eye = torch.eye(d, dtype=X.dtype)
    _, out = _run_kernel(B, X, Q, eye, Q.new_zeros(P, Q.shape[1], d), store=True)
    out = torch.from_numpy(out)
    return out[:, :, :d].contiguous(), out[:, :, d:].reshape(P, Q.shape[1], d, d).contiguous()


def _as_batch(A, B, X, Y, queries):
    """Validated ``(A, B, X3, Y3, Q3)`` with a prompt axis; ``queries`` rows selected (2-d ``X`` only)."""
    if torch.is_tensor(X) and X.dim() == 3:
        X = check_matrix(X, "X", (None, None, None))
        Y = check_matrix(Y, "Y", (X.shape[0], X.shape[1], None), dtype=X.dtype, device=X.device)
        if queries is not None:
            raise ValueError("queries: only for one sequence X of shape (n, d), not for prompts (P, n, d)")
        X3, Y3 = X, Y
    else:
        X = check_matrix(X, "X", (None, None))
        Y = check_matrix(Y, "Y", (X.shape[0], None), dtype=X.dtype, device=X.device)
        X3, Y3 = X[None], Y[None]
    if min(X3.shape) < 1:
        raise ValueError(f"X: expected non-empty tokens, got shape {tuple(X.shape)}")
    d, k = X3.shape[2], Y3.shape[2]
    A = check_matrix(A, "A", (k, d))
    B = check_matrix(B, "B", (d, d))
    Q3 = X3
    if queries is not None:
        if not (isinstance(queries, torch.Tensor) and queries.dtype == torch.long and queries.dim() == 1):
            raise ValueError("queries: expected a 1-d LongTensor of row indices into X")
        if queries.numel() == 0 or int(queries.min()) < 0 or int(queries.max()) >= X3.shape[1]:
            raise ValueError(f"queries: expected row indices in 0 .. {X3.shape[1] - 1}, at least one")
        Q3, Y3 = X3[:, queries], Y3[:, queries]
    return A, B, X3, Y3, Q3


def loss_and_grad(A, B, X, Y, *, queries=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(L, dL/dA, dL/dB)`` of the empirical loss, from one moment pass (no autograd).

    ``X`` (n, d) and ``Y`` (n, k): ``L = 1/(2N) sum_i ||A o_i - y_i||^2`` over all ``N = n`` rows, or
    over the rows ``queries`` (a LongTensor; the keys are still all n tokens), exactly
    :func:`attnlib.model.layer.empirical_loss`. ``X`` (P, n, d) and ``Y`` (P, n, k): the mean over the P
    prompts of their losses (each over its own n tokens), exactly
    ``attnlib.model.prompts.prompt_losses(A, B, X, Y).mean()``. CPU, float32 or float64, ``d <= 8``;
    results in ``X``'s dtype (sums over queries accumulated in float64). ``A``, ``B`` are cast to
    ``X``'s dtype before the pass.
    """
    A, B, X3, Y3, Q3 = _as_batch(A, B, X, Y, queries)
    why = _unsupported(X3)
    if why:
        raise ValueError(f"X: the moment kernel cannot run here ({why})")
    return _loss_and_grad(A.detach().to(X3.dtype), B.detach().to(X3.dtype), X3, Y3, Q3)


def _loss_and_grad(A, B, X3, Y3, Q3, out_dtype=None, Gm=None, adt=None):
    """``(loss, gA, gB)`` (and with ``Gm`` also the control variate's ``(lim, gG)``); with per-group ``A`` (G, k, d),
    ``B`` (G, d, d): one per group, shapes (G,), (G, k, d), (G, d, d)."""
    d, k = X3.shape[2], A.shape[-2]
    P, N = Q3.shape[0], Q3.shape[1]
    G = A.shape[0] if A.dim() == 3 else 1
    S, _ = _run_kernel(B, X3, Q3, A, Y3, Gm, adt=adt)
    S = torch.from_numpy(S) / (N * (P // G))
    kd = k * d
    loss, gA, gB = 0.5 * S[:, 0], S[:, 1 : 1 + kd].reshape(G, k, d), S[:, 1 + kd : 1 + kd + d * d].reshape(G, d, d)
    res = [loss, gA, gB]
    if Gm is not None:
        res += [0.5 * S[:, 1 + kd + d * d], S[:, 2 + kd + d * d :].reshape(G, k, d)]
    dt = (X3.dtype if adt is None else adt) if out_dtype is None else out_dtype
    return tuple((t[0] if A.dim() == 2 else t).to(dt) for t in res)


class _KernelLoss(torch.autograd.Function):
    """The attention loss and, given a limit map ``Gm``, the control variate's limit loss (else zero) from one
    pass, with their gradients in ``(A, B)`` and in ``Gm`` saved from it."""

    @staticmethod
    def forward(ctx, A, B, Gm, X3, Y3, Q3, adt):
        res = _loss_and_grad(A.detach(), B.detach(), X3, Y3, Q3, out_dtype=A.dtype,
                             Gm=None if Gm is None else Gm.detach(), adt=adt)  # fmt: skip
        ctx.cv = Gm is not None
        ctx.save_for_backward(res[1], res[2].to(B.dtype), *((res[4].to(Gm.dtype),) if ctx.cv else ()))
        return res[0], (res[3].to(Gm.dtype) if ctx.cv else torch.zeros_like(res[0]))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_loss, g_lim):
        gA, gB, *gG = ctx.saved_tensors
        if gA.dim() == 3:  # per group: one loss per group
            g_loss, g_lim = g_loss[:, None, None], g_lim[:, None, None]
        return g_loss * gA, g_loss * gB, (g_lim * gG[0] if ctx.cv else None), None, None, None, None


def kernel_loss(A, B, X, Y, *, queries=None) -> torch.Tensor:
    """The loss of :func:`loss_and_grad` as a 0-dim tensor, differentiable (once) in ``A`` and ``B``.

    The moment pass runs in ``X``'s dtype; the loss and the gradient come back in ``A``'s dtype
    (so float64 parameters with float32 tokens give float32 attention with float64 sums).
    ``torch.autograd.grad(kernel_loss(A, B, X, Y), (A, B))`` returns the gradient computed in the
    same moment pass: no backward pass runs. ``X`` and ``Y`` are data (a ``ValueError`` names ``X``
    if it requires a gradient); second derivatives raise (use the SDPA path for Hessians).
    """
    A, B, X3, Y3, Q3 = _as_batch(A, B, X, Y, queries)
    why = _unsupported(X3) or ("Y requires a gradient" if Y3.requires_grad else None)
    if why:
        raise ValueError(f"X: the moment kernel cannot run here ({why})")
    return _KernelLoss.apply(A, B, None, X3, Y3, Q3, None)[0]


def _kernel_loss_unchecked(A, B, X3, Y3, Q3=None) -> torch.Tensor:
    """:func:`kernel_loss` on already validated (P, n, d) tokens, (P, m, k) targets and (P, m, d) queries.

    For callers that validated their data once (the regime-(ii) objective's own prompts): no checks here.
    With per-group parameters ``A`` (G, k, d), ``B`` (G, d, d) (G chains, the P prompts in G consecutive
    groups of P / G): the G losses, shape (G,), each differentiable in its own ``A[g]``, ``B[g]``.
    """
    return _KernelLoss.apply(A, B, None, X3, Y3, X3 if Q3 is None else Q3, None)[0]


def _kernel_losses_cv(A, B, Gm, Xf, Yf, *, adt=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """The regime-(ii) pair ``(mean_b Lhat_n(X_b), mean_b Lhat_lim(X_b))`` from one moment pass, no checks.

    ``Xf`` (P, n, d), ``Yf`` (P, n, k): the prompts and their targets in full precision; the keys are cast to
    the attention dtype ``adt`` (default ``Xf``'s), the queries, the residuals and the sums are float64;
    ``Lhat_lim(X_b) = 1/(2n) sum_i ||Gm x_i - y_i||^2`` with ``Gm = A Sigma B^T`` for the control variate
    (:func:`attnlib.model.prompts.limit_losses`). Both are differentiable (once): the first in ``A``, ``B``,
    the second in ``Gm``. Per-group ``A``, ``B``, ``Gm`` (G, ...) give two tensors of shape (G,).
    """
    return _KernelLoss.apply(A, B, Gm, Xf, Yf, Xf, adt)
