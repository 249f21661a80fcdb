"""attnlib.optim: one config, one entry point, the methods, ablation switches, population runs, preconditioning."""

import numpy as np
import pytest
import torch

import attnlib as al
from attnlib.optim import METHODS, GradientStep, Method, register_method


@pytest.fixture(scope="module")
def data():
    task = al.Task.random(4, 2, cond=10.0, signal=0.8, noise_std=0.1, seed=0)
    X, Y = task.sample(512, seed=1)
    return task, X, Y


@pytest.mark.parametrize("method,lr", [("structured", 0.5), ("gd", 0.05), ("sgd", 0.05), ("adam", 1e-3)])
def test_every_method_runs_and_records(data, method, lr):
    task, X, Y = data
    h = al.train(X, Y, steps=6, lr=lr, method=method, task=task, record_every=2)
    assert h.steps == [0, 2, 4, 6]
    for series in (h.objective, h.loss, h.time, h.excess, h.dist):
        assert len(series) == 4 and np.all(np.isfinite(series))
    assert h.A.shape == (2, 4) and h.B.shape == (4, 4)
    assert h.config["method"] == method
    arrays = h.as_arrays()
    assert arrays["excess"].shape == (4,)


def test_structured_decreases_the_regularized_objective(data):
    task, X, Y = data
    A, B = al.random_init(4, 2, std=0.5, seed=3)
    h = al.train(X, Y, steps=40, lr=0.3, init=(A, B), task=task)
    assert h.objective[-1] < 0.5 * h.objective[0]
    assert h.config["regularize"] and h.config["precondition"] and h.config["renormalize"] == "balance"


def test_component_switches_change_the_iterates(data):
    task, X, Y = data
    init = al.random_init(4, 2, std=0.5, seed=3)
    base = al.train(X, Y, steps=5, lr=0.2, init=init)
    assert base.config["renormalize"] == "balance"
    for kw in ({"precondition": False}, {"renormalize": False}, {"renormalize": "equalize"}):
        other = al.train(X, Y, steps=5, lr=0.2, init=init, **kw)
        assert not torch.allclose(other.A, base.A), kw
    # from a balanced start (spectral) with balancing renormalization every iterate is balanced,
    # where the regularizer's gradient vanishes: switching it off changes nothing
    spec = al.train(X, Y, steps=5, lr=0.2)
    no_reg = al.train(X, Y, steps=5, lr=0.2, regularize=False)
    assert torch.allclose(no_reg.A, spec.A, atol=1e-10) and torch.allclose(no_reg.B, spec.B, atol=1e-10)
    # without it the regularizer matters
    a = al.train(X, Y, steps=5, lr=0.2, init=init, renormalize=False)
    b = al.train(X, Y, steps=5, lr=0.2, init=init, renormalize=False, regularize=False)
    assert not torch.allclose(a.A, b.A)
    gd_with_all = al.train(
        X, Y, steps=5, lr=0.2, method="gd", init=init, regularize=True, precondition=True, renormalize="balance"
    )
    assert torch.allclose(gd_with_all.A, base.A) and torch.allclose(gd_with_all.B, base.B)


def test_balancing_renormalisation_keeps_iterates_on_the_balanced_set(data):
    task = data[0]
    A, B, _ = al.random_manifold_point(task, seed=1)
    init = al.perturb(*al.apply_symmetry(A, B, 3 * torch.eye(4, dtype=torch.float64), task), task, 0.1, seed=2)
    h = al.train_population(task, steps=300, lr=0.3, init=init)
    assert h.excess[-1] < 1e-12 and h.dist[-1] < 1e-8
    off = al.train_population(task, steps=300, lr=0.3, init=init, renormalize=False, regularize=False)
    assert off.dist[-1] > 0.1  # converges to an unbalanced minimum


def test_preconditioned_gd_is_gd_on_whitened_tokens(data):
    """Affine equivariance: the preconditioned step is plain GD on X Sigmahat^(-1/2) (same Y)."""
    task, X, Y = data
    init = al.random_init(4, 2, std=0.5, seed=3)
    pre = al.train(X, Y, steps=10, lr=0.2, method="gd", init=init, precondition=True, task=task)
    white = al.train(X, Y, steps=10, lr=0.2, method="gd", init=init, whiten=True, task=task)
    plain = al.train(X, Y, steps=10, lr=0.2, method="gd", init=init, task=task)
    assert torch.allclose(white.A, pre.A, atol=1e-10) and torch.allclose(white.B, pre.B, atol=1e-10)
    assert np.allclose(white.excess, pre.excess, rtol=1e-8)
    assert not torch.allclose(plain.A, pre.A, atol=1e-6)
    assert white.config["whiten"] and not pre.config["whiten"]


def test_a_new_method_is_one_registered_step(data):
    """Adding a method is registering a step rule; the loop, guard and recorder are shared."""
    task, X, Y = data

    class HalfStep(GradientStep):
        def update(self, objective, A, B, grads):
            super().update(objective, A, B, tuple(0.5 * g for g in grads))

    register_method(Method("half-gd", lambda lr, c: HalfStep(lr, c["precondition"])))
    try:
        init = al.random_init(4, 2, std=0.5, seed=3)
        half = al.train(X, Y, steps=6, lr=0.2, method="half-gd", init=init, task=task)
        gd = al.train(X, Y, steps=6, lr=0.1, method="gd", init=init, task=task)
        assert torch.allclose(half.A, gd.A, atol=1e-12) and half.excess == pytest.approx(gd.excess)
        with pytest.raises(al.DivergenceError):
            al.train(X, Y, steps=50, lr=1e6, method="half-gd", init=init, task=task)
    finally:
        METHODS.pop("half-gd")
    with pytest.raises(ValueError, match="method: expected one of"):
        al.train(X, Y, steps=1, lr=0.1, method="half-gd")


def test_sgd_is_reproducible_from_its_seed(data):
    task, X, Y = data
    h1 = al.train(X, Y, steps=5, lr=0.05, method="sgd", seed=4, batch_size=32)
    h2 = al.train(X, Y, steps=5, lr=0.05, method="sgd", seed=4, batch_size=32)
    h3 = al.train(X, Y, steps=5, lr=0.05, method="sgd", seed=5, batch_size=32)
    assert torch.equal(h1.A, h2.A) and torch.equal(h1.B, h2.B)
    assert not torch.equal(h1.A, h3.A)


def test_random_init_is_seeded(data):
    task, X, Y = data
    h1 = al.train(X, Y, steps=0, lr=0.1, init="random", seed=1, init_std=0.1)
    h2 = al.train(X, Y, steps=0, lr=0.1, init="random", seed=1, init_std=0.1)
    assert torch.equal(h1.A, h2.A)
    assert float(h1.A.abs().max()) < 1.0


def test_divergence_raises_or_stops(data):
    task, X, Y = data
    init = al.random_init(4, 2, std=1.0, seed=0)
    with pytest.raises(al.DivergenceError, match="lower lr"):
        al.train_population(task, steps=200, lr=1e4, method="gd", init=init)
    h = al.train_population(task, steps=200, lr=1e4, method="gd", init=init, on_divergence="stop")
    assert h.diverged and len(h) < 201
    assert torch.isfinite(h.A).all() and torch.isfinite(h.B).all()  # the last finite iterate
    h = al.train_population(task, steps=200, lr=1e4, init=init, renormalize="equalize", on_divergence="stop")
    assert h.diverged and torch.isfinite(h.A).all()


def test_float32_training(data):
    task, X, Y = data
    h = al.train(X, Y, steps=5, lr=0.5, dtype=torch.float32, task=task)
    assert h.A.dtype == torch.float32 and np.all(np.isfinite(h.excess))


def _near(task, radius=0.1, seed=0):
    A, B, _ = al.random_manifold_point(task, seed=seed)
    return al.perturb(A, B, task, radius, seed=seed + 1)


def test_preconditioned_descent_is_insensitive_to_conditioning():
    """Population objective, start at P-distance 0.1 from the manifold, target excess 1e-10.

    Preconditioned descent needs the same number of steps for cond(Sigma) in
    {1, 10, 100, 1000} (it is plain GD in (At, C), where the problem does not see
    Sigma); plain GD with its best step from a grid degrades and, at cond 1000,
    does not get there within 2000 steps.
    """
    counts, gd_best = [], []
    for cond in (1, 10, 100, 1000):
        task = al.Task.random(6, 3, cond=cond, signal=1.0, seed=0)
        init = _near(task)
        h = al.train_population(task, steps=400, lr=0.5, init=init)
        counts.append(h.steps_to(1e-10))
        g = al.best_of_grid(
            lambda **kw: al.train_population(task, steps=2000, method="gd", init=init, record_every=10, **kw),
            (0.01, 0.03, 0.1, 0.3, 1.0),
            score=lambda h: h.steps_to(1e-10),
        )
        gd_best.append(None if g is None else g.steps_to(1e-10))
    assert all(c is not None for c in counts), counts
    assert max(counts) <= 1.1 * min(counts), counts
    assert gd_best[0] is not None and gd_best[0] <= 3 * counts[0], gd_best
    assert gd_best[-1] is None or gd_best[-1] > 5 * gd_best[0], gd_best
    # geometric decay: log-excess is close to linear in the step count
    task = al.Task.random(6, 3, cond=100, signal=1.0, seed=0)
    h = al.train_population(task, steps=120, lr=0.5, init=_near(task))
    ex = np.log(np.array(h.excess[20:100]))
    slope, icpt = np.polyfit(np.arange(20, 100), ex, 1)
    assert slope < 0
    assert np.max(np.abs(ex - (slope * np.arange(20, 100) + icpt))) < 1.0


def test_population_spectral_init_is_on_the_manifold(data):
    task = data[0]
    h = al.train_population(task, steps=0, lr=0.1, init="spectral")
    assert h.dist[0] < 1e-12 and h.excess[0] < 1e-24


@pytest.mark.cuda
def test_train_on_cuda(data):
    task, X, Y = data
    h = al.train(X, Y, steps=3, lr=0.5, device="cuda", task=task)
    assert h.A.device.type == "cuda"


def test_best_of_grid_picks_the_lowest_score_and_skips_divergence(data):
    task = data[0]
    init = al.random_init(4, 2, std=1.0, seed=0)
    run = lambda **kw: al.train_population(task, steps=50, method="gd", init=init, **kw)
    best = al.best_of_grid(run, [1e-3, 1e-2, 1e4])
    assert best.config["lr"] == 1e-2 and not best.diverged
    assert al.best_of_grid(run, [1e4]) is None
    assert al.best_of_grid(run, [1e-3, 1e-2], score=lambda h: -h.objective[-1]).config["lr"] == 1e-3


def _tokens_task(task, G):
    """The task of the transformed tokens x -> G^T x (same labels)."""
    return al.Task(G.T @ task.Sigma @ G, task.M @ torch.linalg.inv(G).T, task.noise_std)


@pytest.mark.parametrize("renormalize", ["balance", "equalize", False])
def test_structured_method_is_affine_equivariant(data, renormalize):
    """Training on X G and mapping back with (A G^T, G B G^T) gives the iterates of training on X."""
    task, X, Y = data
    G = torch.randn(4, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64) + 2 * torch.eye(4)
    kw = dict(steps=8, lr=0.3, renormalize=renormalize, record_every=1)
    raw = al.train(X, Y, task=task, **kw)
    moved = al.train(X @ G, Y, task=_tokens_task(task, G), **kw)
    white = al.train(X, Y, task=task, whiten=True, **kw)
    A, B = moved.A @ G.T, G @ moved.B @ G.T
    assert torch.allclose(A, raw.A, atol=1e-10) and torch.allclose(B, raw.B, atol=1e-10)
    assert np.allclose(moved.excess, raw.excess, rtol=1e-8, atol=1e-14)
    assert torch.allclose(white.A, raw.A, atol=1e-10) and np.allclose(white.excess, raw.excess, rtol=1e-8)
    # plain gradient descent is not equivariant under a general invertible G
    gd = al.train(X, Y, method="gd", task=task, **kw)
    gd_moved = al.train(X @ G, Y, method="gd", task=_tokens_task(task, G), **kw)
    assert not np.allclose(gd_moved.excess, gd.excess, rtol=1e-3)


def test_population_whitening_is_preconditioning(data):
    """GD on the population of whitened tokens = preconditioned GD; the whitened Adam baseline runs too."""
    task = data[0]
    init = al.perturb(*al.random_manifold_point(task, seed=1)[:2], task, 0.3, seed=2)
    pre = al.train_population(task, steps=20, lr=0.3, method="gd", precondition=True, init=init)
    white = al.train_population(task, steps=20, lr=0.3, method="gd", whiten=True, init=init)
    plain = al.train_population(task, steps=20, lr=0.3, method="gd", init=init)
    assert torch.allclose(white.A, pre.A, atol=1e-12) and torch.allclose(white.B, pre.B, atol=1e-12)
    assert np.allclose(white.excess, pre.excess, rtol=1e-9, atol=1e-15) and white.config["whiten"]
    assert not np.allclose(plain.excess, pre.excess, rtol=1e-3)
    adam = al.train_population(task, steps=20, lr=1e-2, method="adam", whiten=True, init=init)
    assert adam.excess[-1] < adam.excess[0] and adam.A.shape == (2, 4)


def test_diverging_structured_run_is_flagged_not_reset(data):
    """A product that overflows must end the run as diverged (it used to be re-factored to zero silently)."""
    task, X, Y = data
    h = al.train(X, Y, steps=100, lr=50.0, task=task, on_divergence="stop")
    assert h.diverged and torch.isfinite(h.A).all() and len(h) < 101
    with pytest.raises(al.DivergenceError):
        al.train(X, Y, steps=100, lr=50.0, task=task)


def test_grid_cache_stores_replays_and_detects_stale_files(data, tmp_path, monkeypatch):
    from attnlib.optim import GridCache

    task = data[0]
    init = al.random_init(4, 2, std=1.0, seed=0)
    calls = []

    def run(**kw):
        calls.append(kw["lr"])
        return al.train_population(task, steps=30, method="gd", init=init, **kw)

    path = tmp_path / "grids.json"
    monkeypatch.delenv("ATTNLIB_REFRESH_GRIDS", raising=False)
    cache = GridCache(path)
    grid = [1e-3, 1e-2, 0.1, 1e4]
    h = cache.best("gd", run, grid)
    assert calls == grid and path.exists()
    assert h.config["lr"] == al.best_of_grid(run, grid).config["lr"] == cache.selected("gd")
    assert cache.scores("gd")[1e4] is None  # diverged
    assert cache.position("gd") == "interior"
    calls.clear()
    again = GridCache(path).best("gd", run, grid)  # a new session replays the selected step only
    assert calls == [h.config["lr"]] and again.objective[-1] == h.objective[-1]
    assert GridCache(path).verify("gd", run) < 1e-12
    # a stored score the code no longer reproduces raises
    stale = GridCache(path)
    stale.entries["gd"]["scores"][grid.index(h.config["lr"])] *= 2
    with pytest.raises(RuntimeError, match="no longer matches"):
        stale.best("gd", run, grid)
    calls.clear()
    assert GridCache(path).best("gd", run, [1e-3, 1e-2]).config["lr"] == 1e-2  # a changed grid is run again
    assert calls == [1e-3, 1e-2]
    # refresh (here through the environment) re-runs each grid it is asked for, once per session, and
    # keeps the file's other grids (a chapter's pages share one file and refresh one after the other)
    monkeypatch.setenv("ATTNLIB_REFRESH_GRIDS", "1")
    fresh = GridCache(path)
    assert fresh.refresh
    calls.clear()
    fresh.best("gd", run, [1e-3, 1e-2])  # stored with this grid, and still run again
    assert calls == [1e-3, 1e-2] and fresh.computed == ["gd"]
    calls.clear()
    fresh.best("gd", run, [1e-3, 1e-2])  # the second request in the same session replays
    assert calls == [1e-2]
    GridCache(path).best("other", run, [1e-3])  # another page's session, refreshing its own grid
    assert set(GridCache(path).entries) == {"gd", "other"}
    with pytest.raises(ValueError, match="key"):
        fresh.scores("missing")
    with pytest.raises(ValueError, match="lrs"):
        fresh.best("x", run, [])


def test_grid_cache_tells_round_off_amplification_from_a_changed_code(tmp_path, monkeypatch):
    """GD leaving the saddle amplifies round-off: ulp-sized step-size changes move its score in the third digit.

    A stored score from another CPU's arithmetic lies within that spread and is accepted (and listed in
    ``amplified``); a non-amplifying run with a stored score off by 1e-4 still raises.
    """
    from attnlib.optim import GridCache

    monkeypatch.delenv("ATTNLIB_REFRESH_GRIDS", raising=False)
    t = al.Task.random(d=6, k=3, cond=100, signal=1.0, seed=0)
    start = al.perturb(*al.stationary_point(t, []), t, 1e-2, seed=2)

    def score(h):
        return float(np.mean(np.log10(np.maximum(h.excess, 1e-12))))

    def saddle(**kw):
        return al.train_population(t, steps=300, init=start, record_every=5, method="gd", **kw)

    spread = GridCache._roundoff_spread(saddle, 0.01, score(saddle(lr=0.01)), score)
    assert spread > 1e-4  # the run really amplifies round-off (a few ulps of the step move the score)
    path = tmp_path / "g.json"
    cache = GridCache(path)
    cache.best("saddle", saddle, [0.003, 0.01, 0.03], score=score)
    lr = cache.selected("saddle")
    again = GridCache(path)
    s = again.entries["saddle"]["scores"][again.entries["saddle"]["grid"].index(lr)]
    own = GridCache._roundoff_spread(saddle, lr, s, score)
    again.entries["saddle"]["scores"][again.entries["saddle"]["grid"].index(lr)] = s + 0.5 * own
    again.best("saddle", saddle, [0.003, 0.01, 0.03], score=score)
    assert "saddle" in again.amplified
    # far outside the spread: raises
    far = GridCache(path)
    far.entries["saddle"]["scores"][far.entries["saddle"]["grid"].index(lr)] = s + 20 * own + 0.1
    with pytest.raises(RuntimeError, match="no longer matches"):
        far.best("saddle", saddle, [0.003, 0.01, 0.03], score=score)
    # a run that does not amplify round-off: a 1e-4 relative change is caught
    near = al.perturb(*al.random_manifold_point(t, seed=1)[:2], t, 0.3, seed=2)

    def calm(**kw):
        return al.train_population(t, steps=100, init=near, record_every=5, method="gd", **kw)

    cache.best("calm", calm, [0.003, 0.01, 0.03], score=score)
    stale = GridCache(path)
    k = stale.entries["calm"]["grid"].index(stale.selected("calm"))
    stale.entries["calm"]["scores"][k] *= 1 + 1e-4
    with pytest.raises(RuntimeError, match="no longer matches"):
        stale.best("calm", calm, [0.003, 0.01, 0.03], score=score)


def test_one_config_one_entry_point(data):
    """A preset is fit() on the objective it builds: the same run from a TrainConfig, from keywords, and by hand."""
    task, X, Y = data
    cfg = al.optim.TrainConfig(steps=5, lr=0.3)
    h_cfg = al.train(X, Y, cfg, task=task)
    h_kw = al.train(X, Y, steps=5, lr=0.3, task=task)
    obj = al.optim.empirical_objective(X, Y).with_regularizer(cfg.lam)
    h_fit = al.fit(obj, cfg, al.spectral_init(X, Y), task=task)
    for h in (h_kw, h_fit):
        assert h.excess == h_cfg.excess and torch.equal(h.A, h_cfg.A) and torch.equal(h.B, h_cfg.B)
    h_over = al.train(X, Y, cfg, task=task, lr=0.1)  # a config plus overrides
    assert h_over.config["lr"] == 0.1 and h_over.excess != h_cfg.excess
    assert cfg.use_regularizer and cfg.use_preconditioner and cfg.renormalization == "balance"
    capped = al.optim.TrainConfig(steps=5, lr=0.3, renormalize="cap", nu_cap=0.25)
    assert not capped.use_regularizer and capped.renormalization == "cap"
    assert al.optim.TrainConfig(steps=1, lr=1.0, method="gd").renormalization is None


def test_config_is_validated_once_with_one_line_errors(data):
    task, X, Y = data
    cases = [
        (dict(steps=5, lr=0.1, lrate=0.2), "lrate"),
        (dict(lr=0.1), "steps"),
        (dict(steps=5, lr=-1.0), "lr"),
        (dict(steps=5, lr=0.1, renormalize="scale"), "renormalize"),
        (dict(steps=5, lr=0.1, renormalize="cap"), "nu_cap"),
        (dict(steps=5, lr=0.1, nu_cap=0.2), "nu_cap"),
        (dict(steps=5, lr=0.1, on_divergence="ignore"), "on_divergence"),
        (dict(steps=5, lr=0.1, method="lbfgs"), "method"),
        (dict(steps=5, lr=0.1, init="zeros"), "init"),
    ]
    for options, name in cases:
        with pytest.raises(ValueError, match=name) as err:
            al.train(X, Y, task=task, **options)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="config"):
        al.train(X, Y, {"steps": 5})
    with pytest.raises(ValueError, match="burn_in"):
        al.run_chain(task, 8, steps=5, burn_in=5, prompts=2)


def test_hooks_are_composed_not_subclassed(data):
    task, X, Y = data
    snaps, seen = al.optim.Snapshots(), []
    h = al.train(X, Y, steps=6, lr=0.3, record_every=2, hooks=(snaps, lambda t, A, B, loss, rec: seen.append(t)))
    assert seen == list(range(7)) and len(snaps.iterates) == len(h.steps) == 4
    assert torch.equal(snaps.iterates[-1][0], h.A)


def test_sigma_is_checked_and_factorized_once_per_run_not_per_step(data, monkeypatch):
    """Validate once: the number of SPD checks and matrix square roots does not grow with the steps."""
    import attnlib._validate as validate
    import attnlib.geometry as geometry
    import attnlib.linalg as linalg
    import attnlib.model.task as task_module

    task, X, Y = data
    counts = {}

    def counted(name, f):
        def g(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return f(*a, **k)

        return g

    for mod in (linalg, geometry, task_module, validate):
        for name in ("sym_sqrt", "sym_inv_sqrt", "check_spd"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, counted(name, getattr(mod, name)))
    runs = {}
    for steps in (5, 25):
        fresh = al.Task(task.Sigma, task.M, task.noise_std)  # no square roots cached yet
        counts.clear()
        al.train(X, Y, steps=steps, lr=0.3, task=fresh)
        runs[("train", steps)] = dict(counts)
        fresh = al.Task(task.Sigma, task.M, task.noise_std)
        counts.clear()
        al.run_chain(fresh, 16, steps=steps, burn_in=1, prompts=2, seed=0, renormalize="cap", nu_cap=0.25)
        runs[("chain", steps)] = dict(counts)
    assert runs[("train", 5)] == runs[("train", 25)] and runs[("chain", 5)] == runs[("chain", 25)], runs
    assert sum(runs[("train", 25)].values()) <= 12, runs
