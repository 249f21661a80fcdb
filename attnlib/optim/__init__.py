"""Optimization: one training API over one loop.

* :class:`TrainConfig` (and :class:`PromptConfig`, :class:`ChainConfig`): a run's settings, one frozen
  dataclass validated when built;
* :func:`fit`: the one entry point, ``fit(objective, config, init)``; the presets :func:`train`
  (one sequence, regime (i)), :func:`train_population` (the infinite-data limit),
  :func:`train_prompts` and :func:`run_chain` (context length ``n``, regime (ii)) build the objective and
  the start and call it; :func:`run_chains` advances several chains of one configuration in lockstep
  (``attnlib.optim.lockstep``: one kernel call and one batched update per step for all of them);
* objectives (``attnlib.optim.objectives``), step rules and the method registry
  (``attnlib.optim.steps``), the loop with its record, divergence guard and hooks
  (``attnlib.optim.loop``), step-size grids (``attnlib.optim.grid``), and the practitioners'
  optimizers (``attnlib.optim.optimizers``, which registers its methods when imported).

The renormalization after each update is :class:`attnlib.geometry.Renormalization`, applied by the loop only.
"""

from .api import ChainResult, fit, run_chain, train, train_population, train_prompts
from .config import ChainConfig, PromptConfig, TrainConfig
from .grid import GridCache, best_of_grid
from .lockstep import run_chains
from .loop import DivergenceError, DivergenceGuard, History, IterateAverage, Recorder, Snapshots, run
from .objectives import Objective, PromptObjective, empirical_objective, population_objective
from .steps import METHODS, GradientStep, Method, SGDStep, Step, TorchOptimizerStep, register_method

__all__ = [
    "TrainConfig",
    "PromptConfig",
    "ChainConfig",
    "fit",
    "train",
    "train_population",
    "train_prompts",
    "run_chain",
    "run_chains",
    "ChainResult",
    "Objective",
    "empirical_objective",
    "population_objective",
    "PromptObjective",
    "Step",
    "GradientStep",
    "SGDStep",
    "TorchOptimizerStep",
    "Method",
    "METHODS",
    "register_method",
    "History",
    "DivergenceError",
    "DivergenceGuard",
    "Recorder",
    "IterateAverage",
    "Snapshots",
    "run",
    "best_of_grid",
    "GridCache",
]

from . import optimizers  # noqa: E402,F401  (registers the practitioners' optimizers as methods)
