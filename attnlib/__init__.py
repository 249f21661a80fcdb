"""attnlib: the companion library of the book *Softmax self-attention, trained to its global optimum*.

Softmax self-attention trained on linear regression: the finite-n layer and
its infinite-data limit, the closed-form population loss, its
matrix-factorization geometry, and structure-aware gradient descent
(spectral initialisation, balancing regularizer, covariance preconditioner,
renormalisation). Every function validates its inputs and raises
``ValueError`` naming the offending argument.
"""
from .attention import (attention, attention_limit, attention_reference, attention_weights,
                        effective_sample_size, empirical_loss, finite_n_error, test_loss,
                        limit_error_prediction)
from .geometry import (distance_to_manifold, one_point_ratios, orbit_tangent_part, sample_one_point_ratios, from_factor, manifold_point, p_inner, p_norm,
                       perturb, project_to_manifold, random_manifold_point, regularizer, renormalize, to_factor)
from . import exercises
from .fits import PowerLawFit, fit_geometric_rate, fit_power_law
from .init import random_init, spectral_init
from .landscape import act, classify_hessian, hessian, landscape_slice, stationary_point
from .linalg import numerical_rank, polar_factor, sym_inv_sqrt, sym_sqrt
from .task import Task, empirical_task, make_generator
from .train import METHODS, DivergenceError, History, best_of_grid, train, train_population

__version__ = "0.1.0"

__all__ = [
    "Task", "empirical_task", "make_generator",
    "attention", "attention_reference", "attention_weights", "attention_limit", "empirical_loss",
    "effective_sample_size", "limit_error_prediction", "finite_n_error", "test_loss",
    "fit_power_law", "fit_geometric_rate", "PowerLawFit",
    "act", "stationary_point", "hessian", "classify_hessian", "landscape_slice",
    "to_factor", "from_factor", "regularizer", "p_norm", "p_inner", "manifold_point",
    "random_manifold_point", "perturb", "one_point_ratios", "sample_one_point_ratios", "orbit_tangent_part", "project_to_manifold", "distance_to_manifold", "renormalize",
    "spectral_init", "random_init",
    "sym_sqrt", "sym_inv_sqrt", "polar_factor", "numerical_rank",
    "train", "train_population", "best_of_grid", "History", "DivergenceError", "METHODS",
]
