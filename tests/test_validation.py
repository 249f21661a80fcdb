"""Every bad input raises a ValueError that names the problem."""

import math

import numpy as np
import pytest
import torch

import attnlib as al


@pytest.fixture
def ok():
    task = al.Task.random(3, 2, cond=2.0, signal=1.0, seed=0)
    X, Y = task.sample(20, seed=1)
    A, B, _ = al.random_manifold_point(task, seed=2)
    return task, X, Y, A, B


def test_sigma_not_symmetric():
    with pytest.raises(ValueError, match="Sigma: expected a symmetric matrix"):
        al.Task([[1.0, 0.5], [0.0, 1.0]], [[1.0, 0.0]])


def test_sigma_indefinite():
    with pytest.raises(ValueError, match="Sigma: expected a positive definite matrix"):
        al.Task([[1.0, 2.0], [2.0, 1.0]], [[1.0, 0.0]])


def test_sigma_not_square():
    with pytest.raises(ValueError, match="Sigma: expected a square matrix"):
        al.Task(np.ones((2, 3)), [[1.0, 0.0]])


def test_m_shape_mismatch():
    with pytest.raises(ValueError, match=r"M: expected shape \(\*, 2\)"):
        al.Task(np.eye(2), [[1.0, 0.0, 0.0]])


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_inputs(ok, bad):
    task, X, Y, A, B = ok
    Xb = X.clone()
    Xb[3, 1] = bad
    with pytest.raises(ValueError, match="X: contains NaN or infinite values"):
        al.attention(A, B, Xb)
    Ab = A.clone()
    Ab[0, 0] = bad
    with pytest.raises(ValueError, match="A: contains NaN or infinite values"):
        task.population_loss(Ab, B)
    with pytest.raises(ValueError, match="Sigma: contains NaN"):
        al.Task([[1.0, 0.0], [0.0, bad]], [[1.0, 0.0]])
    Yb = Y.clone()
    Yb[0, 0] = bad
    with pytest.raises(ValueError, match="Y: contains NaN"):
        al.train(X, Yb, steps=1, lr=0.1)


def test_shape_mismatches(ok):
    task, X, Y, A, B = ok
    with pytest.raises(ValueError, match=r"B: expected shape \(3, 3\)"):
        al.attention(A, B[:2, :2], X)
    with pytest.raises(ValueError, match=r"A: expected shape \(\*, 3\)"):
        al.attention(A[:, :2], B, X)
    with pytest.raises(ValueError, match=r"queries: expected shape \(\*, 3\)"):
        al.attention(A, B, X, queries=X[:, :2])
    with pytest.raises(ValueError, match=r"Y: expected shape \(20, \*\)"):
        al.empirical_loss(A, B, X, Y[:5])
    with pytest.raises(ValueError, match=r"A: expected shape \(2, 3\)"):
        task.excess_risk(A.T, B)
    with pytest.raises(ValueError, match="X: expected a 2-dimensional array"):
        al.attention(A, B, X[0])


def test_spectral_init_needs_n_at_least_d():
    task = al.Task.random(5, 2, seed=0)
    X, Y = task.sample(4, seed=1)
    with pytest.raises(ValueError, match="n >= d"):
        al.spectral_init(X, Y)
    with pytest.raises(ValueError, match="n >= d"):
        al.train(X, Y, steps=1, lr=0.1)


def test_unknown_method_init_and_options(ok):
    task, X, Y, A, B = ok
    with pytest.raises(ValueError, match="method: expected one of"):
        al.train(X, Y, steps=1, lr=0.1, method="newton")
    with pytest.raises(ValueError, match="init: expected 'spectral', 'random'"):
        al.train(X, Y, steps=1, lr=0.1, init="zeros")
    with pytest.raises(ValueError, match="renormalize: expected"):
        al.train(X, Y, steps=1, lr=0.1, renormalize="sometimes")
    with pytest.raises(ValueError, match="lr: expected a finite positive number"):
        al.train(X, Y, steps=1, lr=-1.0)
    with pytest.raises(ValueError, match="steps: expected an integer"):
        al.train(X, Y, steps=2.5, lr=0.1)
    with pytest.raises(ValueError, match="precondition"):
        al.train(X, Y, steps=1, lr=0.1, method="adam", precondition=True)
    with pytest.raises(ValueError, match="sgd"):
        al.train_population(task, steps=1, lr=0.1, method="sgd")
    with pytest.raises(ValueError, match="batch_size"):
        al.train(X, Y, steps=1, lr=0.1, method="sgd", batch_size=1000)
    with pytest.raises(ValueError, match="renormalize: expected one of"):
        al.renormalize(A, B, task, "shrink")


def test_task_random_arguments():
    with pytest.raises(ValueError, match="cond: expected a condition number >= 1"):
        al.Task.random(3, 2, cond=0.5, seed=0)
    with pytest.raises(ValueError, match="rank: expected 1 <= rank <= min"):
        al.Task.random(3, 2, rank=3, seed=0)
    with pytest.raises(ValueError, match="seed: an explicit integer seed"):
        al.Task.random(3, 2)
    with pytest.raises(ValueError, match="noise_std: expected a finite non-negative"):
        al.Task(np.eye(2), [[1.0, 0.0]], noise_std=-1)


def test_sampling_needs_a_seed(ok):
    task = ok[0]
    with pytest.raises(ValueError, match="seed"):
        task.sample(10)
    with pytest.raises(ValueError, match="n: expected an integer >= 1"):
        task.sample(0, seed=1)


def test_stiefel_check(ok):
    task = ok[0]
    with pytest.raises(ValueError, match="W: expected orthonormal columns"):
        al.manifold_point(task, 2 * torch.eye(3, dtype=torch.float64)[:, :2])


def test_dtype_and_device_arguments():
    with pytest.raises(ValueError, match="dtype: expected a floating torch dtype"):
        al.Task.random(3, 2, seed=0).to(dtype=torch.int64)
    with pytest.raises(ValueError, match="device: expected a torch device"):
        al.random_init(3, 2, seed=0, device="nonsense")
    t32 = al.Task.random(3, 2, seed=0).to(dtype=torch.float32)
    assert t32.Sigma.dtype == torch.float32
    X, _ = t32.sample(5, seed=0)
    assert X.dtype == torch.float32
