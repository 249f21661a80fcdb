"""attnlib: the companion library of the book on softmax self-attention as a matrix factorization.

Softmax self-attention trained on linear regression: the finite-n layer and
its infinite-data limit, the closed-form population loss, its
matrix-factorization geometry, and structure-aware gradient descent
(spectral initialization, balancing regularizer, covariance preconditioner,
renormalization). Every function validates its inputs and raises
``ValueError`` naming the offending argument.

Convention: parameters first, then data or task (``attention(A, B, X)``,
``empirical_loss(A, B, X, Y)``, ``hessian(A, B, task)``); wherever the token
covariance is needed, a matrix ``Sigma`` or a :class:`~attnlib.model.task.Task` is accepted.

The names below are loaded lazily, on first use: ``import attnlib`` itself
imports neither torch nor the course tools (:mod:`attnlib.course`), so tools
that only need the package (``python -m attnlib.course list``) start fast.
torch's thread count is set once, when the first module that computes with
torch is imported (:mod:`attnlib.runtime`; override with the environment
variable ``ATTNLIB_NUM_THREADS``).
"""

import importlib
import importlib.metadata

# the one version number is pyproject.toml's; an uninstalled checkout reports "0+unknown"
try:
    __version__ = importlib.metadata.version("attnlib")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
    __version__ = "0+unknown"

#: public name -> the submodule that defines it
_EXPORTS = {
    "Task": "model.task",
    "empirical_task": "model.task",
    "as_covariance": "model.task",
    "make_generator": "rng",
    "derive_seed": "rng",
    "attention": "model.layer",
    "attention_reference": "model.layer",
    "attention_weights": "model.layer",
    "attention_limit": "model.layer",
    "empirical_loss": "model.layer",
    "effective_sample_size": "model.finite_n",
    "limit_error_prediction": "model.finite_n",
    "finite_n_error": "model.finite_n",
    "heldout_loss": "model.finite_n",
    "softmax_scale": "model.finite_n",
    "HEAVY_TAIL_THRESHOLD": "model.finite_n",
    "orbit_to_scale": "geometry",
    "query_averaged_error": "model.finite_n",
    "to_factor": "geometry",
    "from_factor": "geometry",
    "regularizer": "geometry",
    "p_norm": "geometry",
    "p_inner": "geometry",
    "manifold_point": "geometry",
    "random_manifold_point": "geometry",
    "perturb": "geometry",
    "project_to_manifold": "geometry",
    "distance_to_manifold": "geometry",
    "renormalize": "geometry",
    "apply_symmetry": "geometry",
    "stationary_point": "analysis.landscape",
    "hessian": "analysis.landscape",
    "classify_hessian": "analysis.landscape",
    "landscape_slice": "analysis.landscape",
    "one_point_ratios": "analysis.landscape",
    "sample_one_point_ratios": "analysis.landscape",
    "orbit_tangent_part": "analysis.landscape",
    "spectral_init": "optim.init",
    "random_init": "optim.init",
    "orbit_distance": "geometry",
    "Renormalization": "geometry",
    "RENORMALIZATIONS": "geometry",
    "TrainConfig": "optim",
    "fit": "optim",
    "train": "optim",
    "train_population": "optim",
    "train_prompts": "optim",
    "run_chain": "optim",
    "run_chains": "optim",
    "best_of_grid": "optim",
    "GridCache": "optim",
    "History": "optim",
    "DivergenceError": "optim",
    "METHODS": "optim",
    "Method": "optim",
    "register_method": "optim",
    "fit_power_law": "analysis.stats",
    "fit_geometric_rate": "analysis.stats",
    "PowerLawFit": "analysis.stats",
    "sym_sqrt": "linalg",
    "sym_inv_sqrt": "linalg",
    "polar_factor": "linalg",
    "numerical_rank": "linalg",
    "configure_threads": "runtime",
    "granted_cpus": "runtime",
    "thread_info": "runtime",
}
_SUBMODULES = {
    "analysis",
    "course",
    "experiments",
    "geometry",
    "linalg",
    "model",
    "optim",
    "plotting",
    "rng",
    "runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'attnlib' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS) | _SUBMODULES)
