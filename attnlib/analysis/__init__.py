"""Analysis: every fit and estimator, and the theory of the algorithm's iteration.

* :mod:`attnlib.analysis.stats`: log-log fits, geometric rates, exponents with coverage-checked
  intervals, the U-statistic excess of independent chains;
* :mod:`attnlib.analysis.landscape`: symmetries, stationary points, Hessians and slices of the loss;
* :mod:`attnlib.analysis.fixedpoint`: regime (i), Algorithm 1 as a differentiable map, its stable
  fixed point (Newton) and Jacobian spectrum;
* :mod:`attnlib.analysis.theory`: regime (ii), the first-order theory (ours): ``D_1``, the chains'
  displacement, ``c_2`` and its best softmax scale.

These modules import the model, the geometry and the optimization packages, never the experiments.
"""

import importlib

_SUBMODULES = {'landscape', 'theory', 'fixedpoint', 'stats'}


def __getattr__(name):
    """The submodules, imported on first use (``attnlib.analysis.stats``)."""
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
