"""A vectorizable exponential for numba kernels (imported by :mod:`attnlib.model.kernels` only when numba is installed).

:func:`exp_nonpos` (inside compiled code; :func:`exp_array` for a whole array) is our own
exponential: Cody-Waite range reduction ``x = k ln 2 + r``, a polynomial for ``exp(r)`` (Taylor to
degree 12 in float64, Cephes' ``expf`` polynomial in float32) and ``2^k`` built from its bits,
branch-free so that LLVM vectorizes the loop. ``k`` is rounded by adding ``1.5 2^52 + 1023``
(float32: ``1.5 2^23 + 127``): the sum's last mantissa bits are then ``k + 1023``, so one subtraction
gives ``k`` and one shift gives the bits of ``2^k`` (no floor, no float-to-integer conversion; two
vector instructions fewer per exponential than rounding with ``floor``). The polynomial is evaluated by
Estrin's scheme (powers ``r^2, r^4, r^8``, then pairs): three more multiplications than Horner's rule,
but a dependency chain of 4 operations instead of 12 in float64 (3 instead of 7 in float32), and that chain
is what limits the kernel's loop (measured: the kernel 10% faster in float64). numba has no vector ``exp``
without Intel's SVML, which the registry's llvmlite does not use. Arguments are clamped at -700 (float32: -87): a
smaller argument gives a weight below ``e^-700`` (``e^-87``) of the largest one, zero to the
precision of the sums. Measured relative error (``tests/test_kernels.py``): below 1e-15 for
arguments in [-1, 0] and 3e-14 over [-700, 0] in float64 (the compiler's fast-math reassociation
merges the two halves of ``ln 2``, so the error grows with ``|x|``), 3e-7 in float32.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

__all__ = ["exp_nonpos", "exp_array"]


def _bitcast(table, doc):
    """An intrinsic that reinterprets the bits of its one argument: ``table`` maps each argument type accepted to
    the numba and LLVM types of the result."""

    def typer(typingctx, x):
        for src, dst, llty in table:
            if x == src:

                def codegen(context, builder, signature, args):
                    return builder.bitcast(args[0], llty)

                return dst(src), codegen
        return None

    typer.__doc__ = doc
    return intrinsic(typer)


_bits_to_float = _bitcast(
    ((types.int64, types.float64, ir.DoubleType()), (types.int32, types.float32, ir.FloatType())),
    "Reinterpret the bits of an int64 (int32) as a float64 (float32).",
)
_float_to_bits = _bitcast(
    ((types.float64, types.int64, ir.IntType(64)), (types.float32, types.int32, ir.IntType(32))),
    "Reinterpret the bits of a float64 (float32) as an int64 (int32).",
)


@intrinsic
def _exact_sub(typingctx, a, b):
    """``a - b`` that fast-math may not reassociate (its one flag, ``nnan``, keeps numba's fast-math pass away, and
    without ``reassoc`` LLVM cannot fold ``(t + S) - S`` to ``t``: the rounding trick below needs that subtraction)."""
    if a != b or a not in (types.float64, types.float32):
        return None

    def codegen(context, builder, signature, args):
        return builder.fsub(args[0], args[1], flags=("nnan",))

    return a(a, b), codegen


def exp_nonpos(x):  # pragma: no cover - replaced in compiled code by the overload below
    """``exp(x)`` for a float32 or float64 scalar ``x <= 0`` inside numba-compiled code."""
    raise NotImplementedError


@overload(exp_nonpos, inline="always")
def _exp_nonpos_impl(x):
    if x == types.float64:

        def impl64(x):
            x = max(x, -700.0)
            # t = 1.5 2^52 + 1023 + round(x / ln 2): its last mantissa bits hold k + 1023, the exponent of 2^k
            t = x * 1.4426950408889634 + 6755399441056767.0
            k = _exact_sub(t, 6755399441056767.0)
            r = x - k * 0.6931471803691238  # ln 2, high part (exact product for |k| < 2^21)
            r = r - k * 1.9082149292705877e-10  # ln 2, low part
            # exp(r), |r| <= 0.347: Taylor to degree 12, by Estrin's scheme
            r2 = r * r
            r4 = r2 * r2
            r8 = r4 * r4
            a0 = 1.0 + r
            a1 = 0.5 + r * 0.16666666666666666
            a2 = 0.041666666666666664 + r * 0.008333333333333333
            a3 = 0.001388888888888889 + r * 0.0001984126984126984
            a4 = 2.48015873015873e-05 + r * 2.7557319223985893e-06
            a5 = 2.755731922398589e-07 + r * 2.505210838544172e-08
            b0 = a0 + r2 * a1
            b1 = a2 + r2 * a3
            b2 = a4 + r2 * a5
            c0 = b0 + r4 * b1
            c1 = b2 + r4 * 2.08767569878681e-09
            p = c0 + r8 * c1
            return p * _bits_to_float(_float_to_bits(t) << np.int64(52))

        return impl64
    if x == types.float32:

        def impl32(x):
            x = max(x, np.float32(-87.0))
            t = x * np.float32(1.442695) + np.float32(12583039.0)  # 1.5 2^23 + 127 + round(x / ln 2)
            k = _exact_sub(t, np.float32(12583039.0))
            r = x - k * np.float32(0.693359375)  # ln 2, high part (9 bits)
            r = r - k * np.float32(-2.12194440e-4)  # ln 2, low part
            r2 = r * r
            r4 = r2 * r2
            a0 = np.float32(1.0) + r
            a1 = np.float32(5.0000001201e-1) + r * np.float32(1.6666665459e-1)
            a2 = np.float32(4.1665795894e-2) + r * np.float32(8.3334519073e-3)
            a3 = np.float32(1.3981999507e-3) + r * np.float32(1.9875691500e-4)
            b0 = a0 + r2 * a1
            b1 = a2 + r2 * a3
            p = b0 + r4 * b1
            return p * _bits_to_float(np.int32(_float_to_bits(t) << np.int32(23)))

        return impl32
    return None


@njit(cache=True, fastmath=True)
def exp_array(x):
    """``exp(x)`` elementwise for a 1-d float32 or float64 array of arguments ``<= 0`` (for tests)."""
    out = np.empty_like(x)
    for j in range(x.shape[0]):
        out[j] = exp_nonpos(x[j])
    return out
