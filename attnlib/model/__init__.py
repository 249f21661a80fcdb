"""The model: the layer, its data and its finite-n behaviour.

* :mod:`attnlib.model.task`: Gaussian tokens, the linear teacher, the closed-form population loss;
* :mod:`attnlib.model.layer`: softmax self-attention (fused and reference), its infinite-data limit,
  the empirical loss;
* :mod:`attnlib.model.kernels`: the loss and its gradient from one moment pass over the pairs (numba);
* :mod:`attnlib.model.finite_n`: the finite-n layer around its limit (softmax scale, heavy-tail
  threshold, query-averaged error, held-out loss);
* :mod:`attnlib.model.prompts`: regime (ii), prompts of context length ``n`` and their losses.

These modules import only the foundation (``attnlib._validate``, ``rng``, ``linalg``, ``runtime``).
"""

import importlib

_SUBMODULES = {'finite_n', 'prompts', 'kernels', 'layer', 'task'}


def __getattr__(name):
    """The submodules, imported on first use (``attnlib.model.task``)."""
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
