"""attnlib: the companion library of the book *Softmax self-attention, trained to its global optimum*.

Softmax self-attention trained on linear regression: the finite-n layer and
its infinite-data limit, the closed-form population loss, its
matrix-factorization geometry, and structure-aware gradient descent
(spectral initialisation, balancing regularizer, covariance preconditioner,
renormalisation). Every function validates its inputs and raises
``ValueError`` naming the offending argument.

Convention: parameters first, then data or task (``attention(A, B, X)``,
``empirical_loss(A, B, X, Y)``, ``hessian(A, B, task)``); wherever the token
covariance is needed, a matrix ``Sigma`` or a :class:`~attnlib.task.Task` is accepted.

Importing attnlib sets torch's thread count once (:mod:`attnlib.runtime`;
override with the environment variable ``ATTNLIB_NUM_THREADS``). The course
tools (:mod:`attnlib.course`) are a separate subpackage that this import does
not load.
"""

from .runtime import configure_threads as _configure_threads

_configure_threads()

from .attention import attention, attention_limit, attention_reference, attention_weights, empirical_loss  # noqa: E402
from .finite_n import (  # noqa: E402
    HEAVY_TAIL_THRESHOLD,
    effective_sample_size,
    finite_n_error,
    heldout_loss,
    limit_error_prediction,
    orbit_to_scale,
    query_averaged_error,
    softmax_scale,
)
from .fits import PowerLawFit, fit_geometric_rate, fit_power_law  # noqa: E402
from .geometry import (  # noqa: E402
    distance_to_manifold,
    from_factor,
    manifold_point,
    p_inner,
    p_norm,
    perturb,
    project_to_manifold,
    random_manifold_point,
    regularizer,
    renormalize,
    to_factor,
)
from .init import random_init, spectral_init  # noqa: E402
from .landscape import (  # noqa: E402
    apply_symmetry,
    classify_hessian,
    hessian,
    landscape_slice,
    one_point_ratios,
    orbit_tangent_part,
    sample_one_point_ratios,
    stationary_point,
)
from .linalg import numerical_rank, polar_factor, sym_inv_sqrt, sym_sqrt  # noqa: E402
from .rng import derive_seed, make_generator  # noqa: E402
from .runtime import configure_threads, granted_cpus, thread_info  # noqa: E402
from .task import Task, as_covariance, empirical_task  # noqa: E402
from .train import METHODS, DivergenceError, History, Method, best_of_grid, register_method, train, train_population  # noqa: E402

__version__ = "0.2.0"

__all__ = [
    # data and task
    "Task",
    "empirical_task",
    "as_covariance",
    "make_generator",
    "derive_seed",
    # the layer
    "attention",
    "attention_reference",
    "attention_weights",
    "attention_limit",
    "empirical_loss",
    # the finite-n layer around its limit
    "effective_sample_size",
    "limit_error_prediction",
    "finite_n_error",
    "heldout_loss",
    "softmax_scale",
    "HEAVY_TAIL_THRESHOLD",
    "orbit_to_scale",
    "query_averaged_error",
    # geometry
    "to_factor",
    "from_factor",
    "regularizer",
    "p_norm",
    "p_inner",
    "manifold_point",
    "random_manifold_point",
    "perturb",
    "project_to_manifold",
    "distance_to_manifold",
    "renormalize",
    # landscape and diagnostics
    "apply_symmetry",
    "stationary_point",
    "hessian",
    "classify_hessian",
    "landscape_slice",
    "one_point_ratios",
    "sample_one_point_ratios",
    "orbit_tangent_part",
    # initialisation and training
    "spectral_init",
    "random_init",
    "train",
    "train_population",
    "best_of_grid",
    "History",
    "DivergenceError",
    "METHODS",
    "Method",
    "register_method",
    # fits
    "fit_power_law",
    "fit_geometric_rate",
    "PowerLawFit",
    # linear algebra, runtime
    "sym_sqrt",
    "sym_inv_sqrt",
    "polar_factor",
    "numerical_rank",
    "configure_threads",
    "granted_cpus",
    "thread_info",
]
