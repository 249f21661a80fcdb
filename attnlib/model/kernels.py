r"""The loss and its gradient for the book's layer, computed from moments (CPU kernel, no autograd).

For one sequence (or prompt) ``X`` (n x d) with targets ``Y`` (n x k), queries ``q_i`` (the tokens,
or a subset of them) and weights ``p_ij = softmax_j(q_i^T B x_j)``, write

.. math:: o_i = \sum_j p_{ij} x_j, \qquad M_i = \sum_j p_{ij} x_j x_j^\top, \qquad
          r_i = A o_i - y_i, \qquad g_i = A^\top r_i / N .

Then the empirical loss ``L = 1/(2N) sum_i ||r_i||^2`` (N queries) has the exact gradient

.. math:: \partial L / \partial A = \sum_i r_i o_i^\top / N, \qquad
          \partial L / \partial B = \sum_i q_i \big((M_i - o_i o_i^\top) g_i\big)^\top ,

because ``d o_i / d s_ij = p_ij (x_j - o_i)`` and ``d s_ij / d B = q_i x_j^T``. So one pass over the
pairs that accumulates the zeroth, first and second moments of the weights (one exponential per
pair, no backward pass, no key or value gradients) gives the loss and the gradient; the rest is
(N x d) arithmetic. The pass is a numba kernel generated for each ``d <= 8`` (the ``1 + d + d (d + 1) / 2``
accumulators live in registers; 512-bit vectors where the CPU has AVX-512), parallel over prompts and
blocks of queries with the thread count of :mod:`attnlib.runtime` (torch's intra-op count: one place
for threads); per query it also forms ``r_i`` and ``h_i = (M_i - o_i o_i^T) A^T r_i``, so ``M_i``
never leaves it (:func:`moments` returns ``o_i`` and ``M_i`` themselves, for inspection). Its softmax is
stabilized by the shift ``c_i = ||B^T q_i|| max_j ||x_j|| >= max_j s_ij`` (Cauchy-Schwarz), so no
exponent is positive; where this shift is so far above the true maximum that every weight
underflows (``sum_j exp(s_ij - c_i)`` below 1e-200 in float64, 1e-20 in float32; very large
scores), the query is redone with the exact maximum. Per query everything is in the input dtype;
the sums over queries (loss, gradient) are accumulated in float64. In float32, ``M_i - o_i o_i^T``
(the weighted covariance of the keys) loses relative accuracy ``~ eps |M_i| / |M_i - o_i o_i^T|``
when attention is nearly hard (a few keys carry all the weight); for the book's softmax scales
(``nu <= 1``) the float32 loss and gradient agree with float64 to about 1e-7 relative (16 prompts,
n = 1024; ``tests/test_kernels.py`` asks 2e-5).

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
for a new ``(d, dtype, serial or parallel)`` compiles for a few seconds; later processes load the
cache (``benchmarks/kernel_benchmark.py`` measures both).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
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
_BLOCK = 16  # queries per parallel work item
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


def _accumulate_lines(d: int, dot: str, dot_x, acc) -> list:
    """Per query: the softmax-weighted sums ``Z, o, M`` over the keys (one exponential per pair), normalized."""
    pairs = [(a, c) for a in range(d) for c in range(a, d)]
    body = [
        "            c = np.sqrt(" + " + ".join(f"q{c} * q{c}" for c in range(d)) + ") * xmax[b]",
        "            for attempt in range(2):",
        "                " + " = ".join(acc) + " = z",
        "                for j in range(n):",
    ]
    body += [f"                    y{c} = x{c}[j]" for c in range(d)]
    body += [f"                    e = exp_nonpos({dot} - c)", "                    Z += e"]
    body += [f"                    a{a} = e * y{a}" for a in range(d)]
    body += [f"                    o{a} += a{a}" for a in range(d)]
    body += [f"                    m{a}{c} += a{a} * y{c}" for a, c in pairs]
    body += [
        "                if Z >= tiny:",
        "                    break",
        "                c = " + dot_x(0),  # every weight underflowed: shift by the exact maximum, redo
        "                for j in range(1, n):",
        "                    v = " + dot_x("j"),
        "                    if v > c:",
        "                        c = v",
        "            inv = 1 / Z",
    ]
    body += [f"            {name} *= inv" for name in acc[1:]]
    return body + [f"            out[b, i, {t}] = {name}" for t, name in enumerate(acc[1:])]


def _gradient_lines(d: int) -> list:
    """Per query: ``r = A o - y``, ``g = A^T r``, ``h = (M - o o^T) g`` (the loss's 1/N is applied by the caller)."""
    body = [f"            g{a} = z" for a in range(d)]
    body += [
        "            for kk in range(k):",
        "                r = " + " + ".join(f"A[g, kk, {a}] * o{a}" for a in range(d)) + " - Yq[b, i, kk]",
        "                R[b, i, kk] = r",
    ]
    body += [f"                g{a} += A[g, kk, {a}] * r" for a in range(d)]
    body += ["            og = " + " + ".join(f"o{a} * g{a}" for a in range(d))]
    sym = lambda a, c: f"m{min(a, c)}{max(a, c)}"  # noqa: E731
    return body + [
        f"            H[b, i, {a}] = " + " + ".join(f"{sym(a, c)} * g{c}" for c in range(d)) + f" - o{a} * og"
        for a in range(d)
    ]


def _kernel_source(d: int) -> str:
    """numba source of the moment kernel for tokens of dimension ``d`` (two functions: serial and parallel)."""
    pairs = [(a, c) for a in range(d) for c in range(a, d)]
    dot = " + ".join(f"q{c} * y{c}" for c in range(d))
    dot_x = lambda j: " + ".join(f"q{c} * x{c}[{j}]" for c in range(d))  # noqa: E731
    acc = ["Z"] + [f"o{a}" for a in range(d)] + [f"m{a}{c}" for a, c in pairs]
    body = [
        "    P = XT.shape[0]",
        "    n = XT.shape[2]",
        "    m = QB.shape[1]",
        "    k = A.shape[1]",
        "    z = QB[0, 0, 0] - QB[0, 0, 0]  # a zero of the input dtype (QB is finite)",
        "    nblk = (m + block - 1) // block",
        "    for item in prange(P * nblk):",
        "        b = item // nblk",
        "        g = b // pg  # the parameter group (chain) of prompt b",
        "        i0 = (item % nblk) * block",
        "        i1 = min(m, i0 + block)",
    ]
    body += [f"        x{c} = XT[b, {c}]" for c in range(d)]
    body += ["        for i in range(i0, i1):"]
    body += [f"            q{c} = QB[b, i, {c}]" for c in range(d)]
    body += _accumulate_lines(d, dot, dot_x, acc) + _gradient_lines(d) + ["    return out"]
    text = "\n".join(body)
    head = [
        f'"""Generated by attnlib.model.kernels for d = {d}; do not edit (regenerated when it differs)."""',
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
            f"def {name}(XT, QB, xmax, A, Yq, out, R, H, block, tiny, pg):",
            text,
            "",
        ]
    return "\n".join(head + funcs)


def _exp_hash() -> str:
    path = Path(__file__).with_name("_numba_exp.py")
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


_LOADED: Dict[int, object] = {}


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


def _kernel_module(d: int):
    """The generated module for ``d`` (written to :func:`cache_dir` when missing or different)."""
    if d in _LOADED:
        return _LOADED[d]
    if not _LOADED:
        _configure_numba()
    src = _kernel_source(d)
    try:
        path = _write_source(cache_dir(), d, src)
    except OSError:  # a read-only home (some containers): a private folder in the temporary directory
        path = _write_source(Path(tempfile.gettempdir()) / f"attnlib-kernels-{os.getuid()}", d, src)
    spec = importlib.util.spec_from_file_location(f"attnlib_moments_d{d}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # numba's cache rebuilds the kernel's environment by importing it by name
    spec.loader.exec_module(mod)
    _LOADED[d] = mod
    return mod


def _write_source(folder: Path, d: int, src: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"attnlib_moments_d{d}.py"
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


def _run_kernel(B, X, Q, A=None, Yq=None):
    """The moment pass: ``(O, Mpacked, R, H)``, numpy arrays in ``X``'s dtype (``R``, ``H`` need ``A``, ``Yq``).

    ``A`` (k, d) and ``B`` (d, d) for every prompt, or per group: ``A`` (G, k, d), ``B`` (G, d, d), the
    P prompts split into G consecutive groups of P / G (the chains of :func:`attnlib.optim.run_chains`).
    """
    P, n, d = X.shape
    m = Q.shape[1]
    mod = _kernel_module(d)
    G = B.shape[0] if B.dim() == 3 else 1
    XT = X.transpose(1, 2).contiguous().numpy()
    if B.dim() == 3:
        QB = (Q.reshape(G, (P // G) * m, d) @ B).reshape(P, m, d).contiguous().numpy()
    else:
        QB = (Q @ B).contiguous().numpy()
    xmax = X.norm(dim=2).amax(dim=1).contiguous().numpy()
    if A is None:
        A_np, Y_np = np.zeros((G, 0, d), dtype=XT.dtype), np.zeros((P, m, 0), dtype=XT.dtype)
    else:
        A_np, Y_np = A.reshape(G, -1, d).contiguous().numpy(), Yq.contiguous().numpy()
    k = A_np.shape[1]
    out = np.empty((P, m, d + d * (d + 1) // 2), dtype=XT.dtype)
    R = np.empty((P, m, k), dtype=XT.dtype)
    H = np.empty((P, m, d), dtype=XT.dtype)
    threads = _threads()
    args = (XT, QB, xmax, A_np, Y_np, out, R, H, _BLOCK, _TINY[X.dtype], P // G)
    if threads > 1:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        mod.moments_parallel(*args)
    else:
        mod.moments_serial(*args)
    return out[:, :, :d], out[:, :, d:], R, H


def _moments(B, X, Q):
    d = X.shape[2]
    O, Mp, _, _ = _run_kernel(B, X, Q)
    Mp = torch.from_numpy(np.ascontiguousarray(Mp))
    iu = torch.triu_indices(d, d)
    M = Mp.new_empty(*Mp.shape[:2], d, d)
    M[:, :, iu[0], iu[1]] = Mp
    M[:, :, iu[1], iu[0]] = Mp
    return torch.from_numpy(np.ascontiguousarray(O)), M


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


def _loss_and_grad(A, B, X3, Y3, Q3, out_dtype=None):
    """``(loss, gA, gB)``; with per-group ``A`` (G, k, d), ``B`` (G, d, d): one per group, shapes (G,), (G, k, d),
    (G, d, d)."""
    O, _, R, H = _run_kernel(B, X3, Q3, A, Y3)
    f8 = torch.float64
    d, k = X3.shape[2], A.shape[-2]
    P, N = Q3.shape[0], Q3.shape[1]
    G = A.shape[0] if A.dim() == 3 else 1
    scale = 1.0 / (N * (P // G))
    O = torch.from_numpy(np.ascontiguousarray(O).reshape(G, -1, d)).to(f8)
    R = torch.from_numpy(R.reshape(G, -1, k)).to(f8)
    H = torch.from_numpy(H.reshape(G, -1, d)).to(f8)
    Qf = Q3.reshape(G, -1, d).to(f8)
    if A.dim() == 2:  # one parameter set (kept as 2-d products: the committed numbers' round-off)
        O, R, H, Qf = O[0], R[0], H[0], Qf[0]
        loss = (0.5 * scale) * (R * R).sum()
    else:
        loss = (0.5 * scale) * (R * R).sum(dim=(1, 2))
    gA = (R.mT @ O) * scale
    gB = (Qf.mT @ H) * scale
    dt = X3.dtype if out_dtype is None else out_dtype
    return loss.to(dt), gA.to(dt), gB.to(dt)


class _KernelLoss(torch.autograd.Function):
    """The loss, with the gradient in ``A`` and ``B`` saved from the same pass."""

    @staticmethod
    def forward(ctx, A, B, X3, Y3, Q3):
        dt = X3.dtype
        loss, gA, gB = _loss_and_grad(A.detach().to(dt), B.detach().to(dt), X3, Y3, Q3, out_dtype=A.dtype)
        ctx.save_for_backward(gA, gB.to(B.dtype))
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        gA, gB = ctx.saved_tensors
        if gA.dim() == 3:  # per group: one loss per group
            grad = grad[:, None, None]
        return grad * gA, grad * gB, None, None, None


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
    return _KernelLoss.apply(A, B, X3, Y3, Q3)


def _kernel_loss_unchecked(A, B, X3, Y3, Q3=None) -> torch.Tensor:
    """:func:`kernel_loss` on already validated (P, n, d) tokens, (P, m, k) targets and (P, m, d) queries.

    For callers that validated their data once (the regime-(ii) objective's own prompts): no checks here.
    With per-group parameters ``A`` (G, k, d), ``B`` (G, d, d) (G chains, the P prompts in G consecutive
    groups of P / G): the G losses, shape (G,), each differentiable in its own ``A[g]``, ``B[g]``.
    """
    return _KernelLoss.apply(A, B, X3, Y3, X3 if Q3 is None else Q3)
