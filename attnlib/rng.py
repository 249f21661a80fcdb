"""Seeds and generators: every random draw in attnlib goes through :func:`make_generator`.

:func:`derive_seed` turns one user seed into independent streams for the
different draws of an experiment (the sequence, the test sequences, the
random start, ...), so that seed offsets are written once, here, instead of
as magic numbers at every call site.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch

__all__ = ["make_generator", "derive_seed", "STREAMS"]

#: Named streams of :func:`derive_seed`. Their values are part of the reproducibility contract:
#: the committed data in ``book/data`` were drawn with them.
#: ``name: (offset, seed multiplier, index multiplier)``; the seed is
#: ``offset + seed_mult * seed + index_mult * index``.
STREAMS = {
    "sequence": (10_000, 1, 1),  # the training sequence of a scaling run
    "heldout": (20_000, 97, 1),  # fresh sequences for the held-out loss (index: which sequence)
    "manifold": (0, 1, 2),  # the i-th random point of the manifold of minima (even seeds)
    "perturbation": (1, 1, 2),  # the direction that moves it (odd seeds)
}


def make_generator(
    seed: Optional[int] = None, generator: Optional[torch.Generator] = None, *, name: str = "seed"
) -> torch.Generator:
    """Return a CPU ``torch.Generator``: ``generator`` if given, else one seeded with ``seed``.

    Calling it with neither argument raises ``ValueError`` (naming ``name``),
    so that no result depends on global random state.
    """
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
        return generator
    if seed is None:
        raise ValueError(f"{name}: an explicit integer seed (or a torch.Generator) is required for reproducibility")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{name}: expected a non-negative integer, got {seed!r}")
    return torch.Generator(device="cpu").manual_seed(seed)


def derive_seed(seed: int, stream: str, index: int = 0) -> int:
    """The seed of draw ``index`` of the named ``stream`` for the user seed ``seed``.

    Streams listed in :data:`STREAMS` keep the layout the committed data were
    drawn with; any other stream name is hashed, so a new experiment gets its
    own stream without choosing offsets by hand.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed: expected a non-negative integer, got {seed!r}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index: expected a non-negative integer, got {index!r}")
    if stream in STREAMS:
        offset, seed_mult, index_mult = STREAMS[stream]
        return offset + seed_mult * seed + index_mult * index
    digest = hashlib.sha256(f"{stream}".encode()).digest()
    return (int.from_bytes(digest[:4], "little") + 1_000_003 * seed + index) % (2**63)
