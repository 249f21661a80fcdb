"""The moment kernel (attnlib.model.kernels): loss and gradient against SDPA + autograd and the materializing reference.

Tolerances. float64: both sides sum n <= 400 terms of size O(1) in float64 (unit round-off
1.1e-16), so they agree to a few 1e-16 per term in the worst case: we ask 1e-12 relative to the
largest entry (a bug in any term moves the result by O(1/n) >= 1e-3). float32: the kernel sums in
float32 (eps 1.2e-7) over n terms with 16 partial sums per vector, so its distance to the float64
reference is O(sqrt(n) eps) ~ 1e-6; we ask 2e-5 relative, and check that torch's own float32 path is
at the same distance.
"""

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.model import kernels as K
from attnlib.model import prompts as pr

pytest.importorskip("numba")

F64, F32 = torch.float64, torch.float32


def _inputs(d, k=2, n=200, P=None, scale=1.0, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    shape = (n, d) if P is None else (P, n, d)
    X = torch.randn(*shape, generator=g, dtype=F64)
    if P is not None:  # prompts of different content: each its own spread
        X = X * torch.linspace(0.5, 2.0, P, dtype=F64)[:, None, None]
    Y = X @ torch.randn(d, k, generator=g, dtype=F64) + 0.1 * torch.randn(*shape[:-1], k, generator=g, dtype=F64)
    A = torch.randn(k, d, generator=g, dtype=F64)
    B = scale * torch.randn(d, d, generator=g, dtype=F64) / d**0.5
    return A.to(dtype), B.to(dtype), X.to(dtype), Y.to(dtype)


def _reference(A, B, X, Y, queries=None):
    """Loss and gradient by autograd through the materializing layer, in float64."""
    A, B = A.double().clone().requires_grad_(), B.double().clone().requires_grad_()
    X, Y = X.double(), Y.double()
    if X.dim() == 3:
        losses = [al.empirical_loss(A, B, X[b], Y[b], fused=False) for b in range(X.shape[0])]
        loss = torch.stack(losses).mean()
    else:
        loss = al.empirical_loss(A, B, X, Y, queries=queries, fused=False)
    gA, gB = torch.autograd.grad(loss, (A, B))
    return loss.detach(), gA, gB


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def _assert_close(got, ref, tol):
    for name, a, b in zip(("loss", "dL/dA", "dL/dB"), got, ref):
        assert _rel(a, b) < tol, (name, _rel(a, b))


def test_exponential_accuracy():
    from attnlib.model._numba_exp import exp_array

    x = np.linspace(-700.0, 0.0, 200001)
    e = exp_array(x)
    assert np.max(np.abs(e - np.exp(x)) / np.exp(x)) < 4e-14
    near = np.linspace(-1.0, 0.0, 10001)
    assert np.max(np.abs(exp_array(near) - np.exp(near)) / np.exp(near)) < 2e-15
    x32 = np.linspace(-87.0, 0.0, 100001).astype(np.float32)
    ref = np.exp(x32.astype(np.float64))
    assert np.max(np.abs(exp_array(x32).astype(np.float64) - ref) / ref) < 4 * np.finfo(np.float32).eps
    assert exp_array(np.array([-1e4, -800.0]))[0] < 1e-300  # clamped: a weight zero to the sums' precision


@pytest.mark.parametrize("d", [1, 3, 4, 8])
def test_single_sequence_float64_matches_reference(d):
    A, B, X, Y = _inputs(d, n=150, seed=d)
    got = K.loss_and_grad(A, B, X, Y)
    _assert_close(got, _reference(A, B, X, Y), 1e-12)
    assert all(t.dtype == F64 for t in got)


@pytest.mark.parametrize("d", [1, 4, 8])
def test_single_sequence_float32_matches_reference(d):
    A, B, X, Y = _inputs(d, n=400, seed=10 + d, dtype=F32)
    ref = _reference(A, B, X, Y)
    got = K.loss_and_grad(A, B, X, Y)
    assert all(t.dtype == F32 for t in got)
    _assert_close(got, ref, 2e-5)
    # torch's own float32 path is no closer to float64 than the kernel (same order of error)
    A_, B_ = A.clone().requires_grad_(), B.clone().requires_grad_()
    loss = al.empirical_loss(A_, B_, X, Y)
    torch32 = (loss.detach(), *torch.autograd.grad(loss, (A_, B_)))
    _assert_close(torch32, ref, 2e-5)


def test_batched_prompts_match_the_per_prompt_reference():
    for dtype, tol in ((F64, 1e-12), (F32, 2e-5)):
        A, B, X, Y = _inputs(4, n=64, P=5, seed=3, dtype=dtype)
        got = K.loss_and_grad(A, B, X, Y)
        _assert_close(got, _reference(A, B, X, Y), tol)
        # and the mean of the per-prompt SDPA losses (what the regime-(ii) objective used)
        assert float(got[0]) == pytest.approx(float(pr.prompt_losses(A, B, X, Y).mean()), rel=10 * tol)


def test_queries_subset_and_duplicates():
    A, B, X, Y = _inputs(4, n=120, seed=4)
    idx = torch.tensor([0, 7, 7, 119, 50])
    got = K.loss_and_grad(A, B, X, Y, queries=idx)
    _assert_close(got, _reference(A, B, X, Y, queries=idx), 1e-12)


def test_one_token():
    """n = 1: the weight is 1, o = x, M = x x^T, so M - o o^T = 0 and dL/dB = 0 exactly."""
    A, B, X, Y = _inputs(3, n=1, seed=5)
    loss, gA, gB = K.loss_and_grad(A, B, X, Y)
    ref = _reference(A, B, X, Y)
    assert float(loss) == pytest.approx(float(ref[0]), rel=1e-14)
    assert torch.allclose(gA, ref[1], rtol=1e-14, atol=0)
    assert float(gB.abs().max()) < 1e-15 and float(ref[2].abs().max()) < 1e-15


@pytest.mark.parametrize("dtype", [F64, F32])
def test_large_scores(dtype):
    """Scores in the hundreds (near-hard attention) and a shift that underflows every weight.

    The Cauchy-Schwarz shift ||B^T q|| max ||x_j|| is 1e5 above the largest score here (one token of
    norm 100 orthogonal to the query direction), so the kernel must redo the query with the exact
    maximum; the reference subtracts the row maximum too.
    """
    A, B, X, Y = _inputs(4, n=100, scale=60.0, seed=6, dtype=dtype)
    ref = _reference(A, B, X, Y)
    tol = 1e-11 if dtype == F64 else 2e-4  # scores ~ 1e2: relative error of a weight ~ eps * |score|
    _assert_close(K.loss_and_grad(A, B, X, Y), ref, tol)
    X2 = torch.zeros(6, 2, dtype=dtype)
    X2[:5, 0] = torch.linspace(0.5, 1.0, 5, dtype=dtype)
    X2[5, 1] = 100.0
    B2 = torch.tensor([[1000.0, 0.0], [0.0, 0.0]], dtype=dtype)
    A2 = torch.tensor([[1.0, 0.5]], dtype=dtype)
    Y2 = torch.ones(6, 1, dtype=dtype)
    got = K.loss_and_grad(A2, B2, X2, Y2)
    ref2 = _reference(A2, B2, X2, Y2)
    assert all(bool(torch.isfinite(t).all()) for t in got)
    _assert_close(got, ref2, 1e-12 if dtype == F64 else 1e-6)


def test_autograd_wrapper_and_engines_agree():
    A, B, X, Y = _inputs(4, n=90, seed=7)
    idx = torch.tensor([3, 1, 4, 1, 5])
    for q in (None, idx):
        vals = {}
        for engine in ("sdpa", "kernel", "auto"):
            A_, B_ = A.clone().requires_grad_(), B.clone().requires_grad_()
            loss = al.empirical_loss(A_, B_, X, Y, queries=q, engine=engine)
            vals[engine] = (loss.detach(), *torch.autograd.grad(3.0 * loss, (A_, B_)))
        _assert_close(vals["kernel"], vals["sdpa"], 1e-12)
        _assert_close(vals["auto"], vals["kernel"], 0.0 + 1e-300)
    A_ = A.clone().requires_grad_()
    g = torch.autograd.grad(K.kernel_loss(A_, B, X, Y), A_, create_graph=True)[0]
    with pytest.raises(RuntimeError):  # once differentiable: no Hessians through the kernel
        torch.autograd.grad(g.sum(), A_)


def test_prompt_objective_engines_and_float32_attention():
    task = al.Task.random(4, 2, cond=10.0, signal=1.0, seed=0)
    A, B, _ = al.random_manifold_point(task, seed=1)
    A, B = al.perturb(A, B, task, 0.3, seed=2)
    X, Y = pr.sample_prompts(task, 48, 6, seed=3)
    grads = {}
    for engine, adt in (("sdpa", None), ("kernel", None), ("auto", None), ("kernel", "float32"), ("sdpa", "float32")):
        obj = al.optim.PromptObjective(task, 48, 6, al.make_generator(0), engine=engine, attention_dtype=adt)
        A_, B_ = A.clone().requires_grad_(), B.clone().requires_grad_()
        est = obj.estimate(A_, B_, X, Y)
        assert est.dtype == F64
        grads[engine, adt] = (est.detach(), *torch.autograd.grad(est, (A_, B_)))
    _assert_close(grads["kernel", None], grads["sdpa", None], 1e-12)
    _assert_close(grads["auto", None], grads["kernel", None], 1e-300)
    _assert_close(grads["kernel", "float32"], grads["sdpa", None], 2e-5)
    _assert_close(grads["sdpa", "float32"], grads["sdpa", None], 2e-5)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("threads", [1, 2])
def test_per_group_parameters_equal_one_call_per_group(dtype, threads):
    """G chains' prompts in one pass, each group of P / G prompts with its own (A, B): the losses and gradients of
    separate calls, bit for bit (the same per-query arithmetic; the sums over queries run per group), and the
    reference to the usual tolerance; the autograd wrapper returns one loss per group."""
    G, P, n = 3, 2, 40
    g = torch.Generator().manual_seed(11)
    _, _, X, Y = _inputs(4, n=n, P=G * P, seed=12, dtype=dtype)
    A = torch.randn(G, 2, 4, generator=g, dtype=F64).to(dtype)
    B = (torch.randn(G, 4, 4, generator=g, dtype=F64) / 2).to(dtype)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        loss, gA, gB = K._loss_and_grad(A, B, X, Y, X)
        Ar, Br = A.clone().requires_grad_(), B.clone().requires_grad_()
        losses = K._kernel_loss_unchecked(Ar, Br, X, Y)
        wA, wB = torch.autograd.grad(losses.sum(), (Ar, Br))
        for c in range(G):
            sl = slice(c * P, (c + 1) * P)
            one = K.loss_and_grad(A[c], B[c], X[sl], Y[sl])
            for a, b in zip((loss[c], gA[c], gB[c]), one):
                assert torch.equal(a, b)
            assert torch.equal(losses[c].detach(), one[0]) and torch.equal(wA[c], one[1]) and torch.equal(wB[c], one[2])
            _assert_close(one, _reference(A[c], B[c], X[sl], Y[sl]), 1e-12 if dtype == F64 else 2e-5)
    finally:
        torch.set_num_threads(old)
    assert losses.shape == (G,)


def test_chain_with_the_kernel_equals_the_sdpa_chain():
    task = al.Task.random(3, 2, cond=5.0, signal=1.0, seed=2)
    kw = dict(steps=12, burn_in=4, prompts=8, seed=3)
    a = al.run_chain(task, 32, engine="sdpa", **kw)
    b = al.run_chain(task, 32, engine="kernel", **kw)
    assert np.max(np.abs(a.R - b.R)) < 1e-12 * np.max(np.abs(a.R))
    assert b.naive_excess == pytest.approx(a.naive_excess, rel=1e-10)


def test_parallel_path_matches_serial():
    A, B, X, Y = _inputs(4, n=70, P=3, seed=8)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = K.loss_and_grad(A, B, X, Y)
        torch.set_num_threads(2)
        parallel = K.loss_and_grad(A, B, X, Y)
    finally:
        torch.set_num_threads(old)
    _assert_close(parallel, serial, 1e-14)


def test_moments():
    A, B, X, Y = _inputs(3, n=40, P=2, seed=9)
    O, M = K.moments(B, X)
    W = torch.softmax((X @ B) @ X.transpose(1, 2), dim=-1)
    assert torch.allclose(O, W @ X, rtol=0, atol=1e-13)
    assert torch.allclose(M, torch.einsum("bij,bja,bjc->biac", W, X, X), rtol=0, atol=1e-13)


def test_engine_resolution_and_bad_input():
    A, B, X, Y = _inputs(4, n=10, seed=11)
    assert K.resolve_engine("auto", X) == "kernel" and K.resolve_engine("sdpa", X) == "sdpa"
    assert K.resolve_engine("auto", torch.zeros(5, 9, dtype=F64)) == "sdpa"  # d > MAX_D
    with pytest.raises(ValueError, match="engine"):
        K.resolve_engine("fast", X)
    with pytest.raises(ValueError, match="engine"):
        al.empirical_loss(torch.zeros(2, 9), torch.zeros(9, 9), torch.zeros(5, 9), torch.zeros(5, 2), engine="kernel")
    with pytest.raises(ValueError, match="engine"):
        al.optim.PromptObjective(al.Task.random(2, 1, seed=0), 4, 2, al.make_generator(0), engine="numba")
    with pytest.raises(ValueError, match="attention_dtype"):
        al.optim.PromptObjective(al.Task.random(2, 1, seed=0), 4, 2, al.make_generator(0), attention_dtype="int8")
    with pytest.raises(ValueError, match="^X"):
        K.kernel_loss(A, B, X.clone().requires_grad_(), Y)
    with pytest.raises(ValueError, match="^Y"):
        al.empirical_loss(A, B, X, Y.clone().requires_grad_(), engine="kernel")
    Yg, Xg = Y.clone().requires_grad_(), X.clone().requires_grad_()
    for Xa, Ya in ((X, Yg), (Xg, Y)):  # "auto" falls back to SDPA where the data need a gradient
        loss = al.empirical_loss(A, B, Xa, Ya, engine="auto")
        assert loss.requires_grad
        assert float(loss.detach()) == pytest.approx(float(al.empirical_loss(A, B, X, Y)), rel=1e-12)
    with pytest.raises(ValueError, match="^Y"):
        K.loss_and_grad(A, B, X, Y[:5])
    with pytest.raises(ValueError, match="^A"):
        K.loss_and_grad(A[:, :3], B, X, Y)
    with pytest.raises(ValueError, match="^B"):
        K.loss_and_grad(A, B[:3], X, Y)
    with pytest.raises(ValueError, match="^queries"):
        K.loss_and_grad(A, B, X, Y, queries=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="^queries"):
        K.loss_and_grad(A, B, X, Y, queries=torch.tensor([0.0]))
    with pytest.raises(ValueError, match="^queries"):
        K.loss_and_grad(A, B, X[None], Y[None], queries=torch.tensor([0]))
    with pytest.raises(ValueError, match="^X"):
        K.loss_and_grad(A, B, X.to(torch.float16), Y.to(torch.float16))
    with pytest.raises(ValueError, match="^X"):
        K.moments(B, torch.zeros(0, 3, 4, dtype=F64))
    with pytest.raises(ValueError, match="^X"):
        K.loss_and_grad(A, B, torch.full((10, 4), float("nan"), dtype=F64), Y)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNLIB_KERNEL_CACHE", str(tmp_path / "k"))
    assert K.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("ATTNLIB_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert K.cache_dir() == tmp_path / "attnlib" / "kernels"


@pytest.mark.cuda
def test_cuda_uses_sdpa_and_agrees_with_the_cpu_kernel():
    A, B, X, Y = _inputs(4, n=256, P=4, seed=12)
    cpu = K.loss_and_grad(A, B, X, Y)
    Xc, Yc = X.cuda(), Y.cuda()
    assert K.resolve_engine("auto", Xc) == "sdpa"
    with pytest.raises(ValueError, match="engine"):
        K.resolve_engine("kernel", Xc)
    task = al.Task.random(4, 2, cond=10.0, signal=1.0, seed=0).to(device="cuda")
    obj = al.optim.PromptObjective(task, 256, 4, al.make_generator(0))  # prompts are drawn on the CPU, then moved
    A_, B_ = A.cuda().requires_grad_(), B.cuda().requires_grad_()
    loss = obj.attention_loss(A_, B_, Xc, Yc)
    gpu = (loss.detach(), *torch.autograd.grad(loss, (A_, B_)))
    _assert_close(tuple(t.cpu() for t in gpu), cpu, 1e-10)


@pytest.mark.parametrize("adt", [F64, F32])
def test_control_variate_from_the_same_pass(adt):
    """The regime-(ii) pair (attention loss, limit loss) and their gradients from one pass equal the SDPA
    attention losses and ``limit_losses`` with autograd (float64 prompts; float32 keys to the float32 tolerance);
    per-group parameters give each group's pair."""
    task = al.Task.random(4, 2, cond=10.0, signal=1.0, seed=0)
    G_, P, n = 2, 3, 50
    X, Y = pr.sample_prompts(task, n, G_ * P, seed=3)
    g = torch.Generator().manual_seed(4)
    A = torch.randn(G_, 2, 4, generator=g, dtype=F64).requires_grad_()
    B = (torch.randn(G_, 4, 4, generator=g, dtype=F64) / 3).requires_grad_()
    Gm = A @ task.Sigma @ B.mT
    att, lim = K._kernel_losses_cv(A, B, Gm, X, Y, adt=adt)
    got = torch.autograd.grad((2.0 * att - 3.0 * lim).sum(), (A, B))
    ref_att, ref_lim = [], []
    for c in range(G_):
        sl = slice(c * P, (c + 1) * P)
        ref_att.append(pr.prompt_losses(A[c], B[c], X[sl], Y[sl]).mean())
        ref_lim.append(pr.limit_losses(A[c], B[c], task.Sigma, X[sl], Y[sl]).mean())
    ref_att, ref_lim = torch.stack(ref_att), torch.stack(ref_lim)
    ref = torch.autograd.grad((2.0 * ref_att - 3.0 * ref_lim).sum(), (A, B))
    tol = 1e-12 if adt == F64 else 2e-5
    assert _rel(att.detach(), ref_att.detach()) < tol and _rel(lim.detach(), ref_lim.detach()) < 1e-12
    assert _rel(got[0], ref[0]) < tol and _rel(got[1], ref[1]) < tol
    assert att.shape == lim.shape == (G_,)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_whole_prompt_items_match_query_blocks(dtype):
    """From ``_WHOLE_MIN`` prompts on, each work item is a whole prompt that transposes its own keys; the
    result equals one call per prompt (query blocks, keys transposed outside) and the reference."""
    P = K._WHOLE_MIN
    A, B, X, Y = _inputs(4, n=90, P=P, seed=21, dtype=dtype)
    got = K.loss_and_grad(A, B, X, Y)
    per = [K.loss_and_grad(A, B, X[b], Y[b]) for b in range(P)]
    mean = [torch.stack([p[i] for p in per]).mean(dim=0) for i in range(3)]
    tol = 1e-13 if dtype == F64 else 1e-6
    _assert_close(got, mean, tol)
    _assert_close(got, _reference(A, B, X, Y), 1e-12 if dtype == F64 else 2e-5)
