"""The configuration of a training run: one frozen dataclass, validated once, when it is built.

:class:`TrainConfig` holds everything the loop needs to know about a run (method, step size and
count, the structured components, the start, recording and divergence policy);
:class:`PromptConfig` adds the regime-(ii) objective's options (prompts per step, control variate,
engine, attention dtype) and :class:`ChainConfig` the defaults and burn-in of the book's regime-(ii)
chains. Unknown or ill-typed fields raise ``ValueError`` naming the field. The structured
components default to on for ``method="structured"`` and off otherwise; the resolved switches are
the properties :attr:`~TrainConfig.use_regularizer`, :attr:`~TrainConfig.use_preconditioner` and
:attr:`~TrainConfig.renormalization`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from .._validate import check_nonneg_float, check_positive_int, resolve_dtype
from ..geometry import RENORMALIZATIONS, _check_nu_cap
from ..model.kernels import ENGINES
from .steps import METHODS

__all__ = ["TrainConfig", "PromptConfig", "ChainConfig", "make_config"]


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run.

    Parameters
    ----------
    steps, lr : number of updates and step size.
    method : a name in ``attnlib.optim.METHODS``: ``"structured"`` (Algorithm 1), ``"gd"``, ``"sgd"``,
        ``"adam"``, and those :mod:`attnlib.optim.optimizers` registers (``"adamw"``, ``"muon"``, ...).
    init : ``"spectral"``, ``"random"`` (scale ``init_std``, seed ``seed``), a pair ``(A, B)`` (parameters of
        the layer on the raw tokens), or ``None``: the objective's default start (spectral on a sample,
        random on the population, the balanced minimum ``W = V`` in regime (ii)).
    lam, regularize : the balancing regularizer's weight, and whether it is on.
    precondition : the covariance preconditioner ``Sigma^{-1}``.
    renormalize : ``"balance"``, ``"cap"``, ``"fix"``, ``"equalize"`` (:class:`attnlib.geometry.Renormalization`),
        ``True`` (= ``"balance"``) or ``False``; ``nu_cap``: the softmax-scale bound of ``"cap"``/``"fix"``.
        ``regularize``, ``precondition``, ``renormalize`` left at ``None`` mean on (``"balance"``) for
        ``"structured"`` and off otherwise; the regularizer stays off under ``"cap"``/``"fix"`` (it pulls
        towards the balanced point the renormalization moves away from).
    whiten : train on the whitened tokens and map back (the fair baseline for the preconditioner).
    batch_size : queries per SGD step (default ``max(1, n // 8)``).
    seed : seeds the random start, the SGD minibatches and the regime-(ii) prompts.
    record_every : record every this many steps (the last step is always recorded).
    on_divergence : ``"raise"`` (:class:`~attnlib.optim.DivergenceError`) or ``"stop"`` (``History.diverged``).
    progress : show a tqdm progress bar.
    """

    steps: int
    lr: float
    method: str = "structured"
    init: Union[None, str, Tuple[torch.Tensor, torch.Tensor]] = None
    init_std: float = 1e-2
    lam: float = 1.0
    regularize: Optional[bool] = None
    precondition: Optional[bool] = None
    renormalize: Union[None, bool, str] = None
    nu_cap: Optional[float] = None
    whiten: bool = False
    batch_size: Optional[int] = None
    seed: int = 0
    record_every: int = 1
    on_divergence: str = "raise"
    progress: bool = False

    def __post_init__(self):
        put = object.__setattr__.__get__(self)
        put("steps", check_positive_int(self.steps, "steps", minimum=0))
        put("lr", check_nonneg_float(self.lr, "lr", positive=True))
        put("lam", check_nonneg_float(self.lam, "lam"))
        put("init_std", check_nonneg_float(self.init_std, "init_std"))
        put("record_every", check_positive_int(self.record_every, "record_every"))
        if self.seed is not None:
            put("seed", check_positive_int(self.seed, "seed", minimum=0))
        if self.batch_size is not None:
            put("batch_size", check_positive_int(self.batch_size, "batch_size"))
        if self.on_divergence not in ("raise", "stop"):
            raise ValueError(f"on_divergence: expected 'raise' or 'stop', got {self.on_divergence!r}")
        if self.method not in METHODS:
            raise ValueError(f"method: expected one of {tuple(METHODS)}, got {self.method!r}")
        if isinstance(self.init, str) and self.init not in ("spectral", "random"):
            raise ValueError(f"init: expected 'spectral', 'random', None or a pair (A, B), got {self.init!r}")
        if not (self.init is None or isinstance(self.init, str) or _is_pair(self.init)):
            raise ValueError(f"init: expected 'spectral', 'random', None or (A, B), got a {type(self.init).__name__}")
        mode = self.renormalize
        if not (mode is None or isinstance(mode, bool) or mode in RENORMALIZATIONS):
            raise ValueError(f"renormalize: expected one of {RENORMALIZATIONS}, True, False or None, got {mode!r}")
        _check_nu_cap(self.renormalization or "balance", self.nu_cap)
        if self.use_preconditioner and not METHODS[self.method].preconditionable:
            raise ValueError(f"precondition: the covariance preconditioner is not defined for method={self.method!r}")

    @property
    def structured(self) -> bool:
        """Whether the method's structured components are on by default."""
        return METHODS[self.method].structured

    @property
    def renormalization(self) -> Optional[str]:
        """The renormalization mode after each update (``None``: none)."""
        if self.renormalize is None:
            return "balance" if self.structured else None
        if isinstance(self.renormalize, bool):
            return "balance" if self.renormalize else None
        return self.renormalize

    @property
    def use_regularizer(self) -> bool:
        if self.regularize is None:
            return self.structured and self.renormalization not in ("cap", "fix")
        return bool(self.regularize)

    @property
    def use_preconditioner(self) -> bool:
        return self.structured if self.precondition is None else bool(self.precondition)

    def summary(self) -> dict:
        """The run's settings with the switches resolved (``History.config``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(
            init=self.init if self.init is None or isinstance(self.init, str) else "given",
            regularize=self.use_regularizer,
            precondition=self.use_preconditioner,
            renormalize=self.renormalization,
        )
        if "attention_dtype" in out and out["attention_dtype"] is not None:
            out["attention_dtype"] = str(out["attention_dtype"]).replace("torch.", "")
        return out


@dataclass(frozen=True, kw_only=True)
class PromptConfig(TrainConfig):
    """A run on the regime-(ii) objective ``L_n``: :class:`TrainConfig` plus the objective's options.

    ``prompts``: fresh prompts per step; ``seed``: seeds the prompts (required unless a generator is given:
    independent chains need different seeds); ``control_variate``, ``engine``, ``attention_dtype``: as in
    :class:`~attnlib.optim.PromptObjective`. No regularizer by default.
    """

    prompts: int
    seed: Optional[int] = None
    regularize: Optional[bool] = False
    control_variate: bool = True
    engine: str = "auto"
    attention_dtype: Optional[object] = None

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "prompts", check_positive_int(self.prompts, "prompts"))
        if self.engine not in ENGINES:
            raise ValueError(f"engine: expected one of {ENGINES}, got {self.engine!r}")
        if self.attention_dtype is not None:
            try:
                object.__setattr__(self, "attention_dtype", resolve_dtype(self.attention_dtype))
            except ValueError as err:
                raise ValueError(f"attention_dtype: {str(err).split(': ', 1)[1]}") from None


@dataclass(frozen=True, kw_only=True)
class ChainConfig(PromptConfig):
    """A chain of the book's regime-(ii) experiments: the structured method from the minimum set, with
    the renormalization applied to the start too, iterate averaging after ``burn_in`` steps, a record every
    ``record_every = 10`` steps, step size 0.5."""

    burn_in: int
    lr: float = 0.5
    renormalize: Union[None, bool, str] = "balance"
    record_every: int = 10

    def __post_init__(self):
        super().__post_init__()
        burn_in = check_positive_int(self.burn_in, "burn_in", minimum=0)
        if burn_in >= self.steps:
            raise ValueError(f"burn_in: expected fewer than steps = {self.steps} burn-in steps, got {burn_in}")
        object.__setattr__(self, "burn_in", burn_in)


def _is_pair(init) -> bool:
    return isinstance(init, (tuple, list)) and len(init) == 2


def make_config(cls, config=None, options=None):
    """``config`` (an instance of ``cls``) with ``options`` replaced, or ``cls(**options)``; one-line errors."""
    options = dict(options or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ValueError(f"{unknown[0]}: not a field of {cls.__name__} (expected one of {sorted(names)})")
    if config is None:
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in options]
        if missing:
            raise ValueError(f"{missing[0]}: required by {cls.__name__}")
        return cls(**options)
    if not isinstance(config, cls):
        raise ValueError(f"config: expected an attnlib.optim.{cls.__name__}, got {type(config).__name__}")
    return dataclasses.replace(config, **options)
