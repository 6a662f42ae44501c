"""Input validation shared by the NumPy implementations.

Every public function checks its arguments here, so that a student who passes the wrong thing gets one
sentence that says what was expected instead of a broadcasting error from deep inside NumPy.
"""

from __future__ import annotations

import numbers

import numpy as np

FLOAT_DTYPES = (np.float16, np.float32, np.float64)


def as_float_array(x, name: str, *, allowed=FLOAT_DTYPES) -> np.ndarray:
    """Return ``x`` as an ndarray of a real floating dtype, or raise TypeError saying what was expected."""
    if not isinstance(x, np.ndarray):
        if hasattr(x, "__cuda_array_interface__"):
            raise TypeError(f"{name} is a GPU array; these functions expect NumPy arrays (use .get() first)")
        x = np.asarray(x)
    if x.dtype.kind not in "f" or x.dtype.type not in allowed:
        names = ", ".join(np.dtype(t).name for t in allowed)
        raise TypeError(f"{name} must be a real floating-point array ({names}); got dtype {x.dtype}")
    return x


def check_qkv(Q, K, V, *, allowed=FLOAT_DTYPES, allow_gqa: bool = False):
    """Validate attention inputs Q (..., n, d), K (..., m, d), V (..., m, dv).

    Returns the three arrays (as ndarrays). With ``allow_gqa``, K and V may have fewer heads (axis -3) than Q
    when that number divides Q's; they are then repeated so that every query head has its key/value head.
    """
    Q = as_float_array(Q, "Q", allowed=allowed)
    K = as_float_array(K, "K", allowed=allowed)
    V = as_float_array(V, "V", allowed=allowed)
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., rows, head_dim); got shape {x.shape}")
    if not (Q.ndim == K.ndim == V.ndim):
        raise ValueError(f"Q, K and V must have the same number of dimensions; got {Q.shape}, {K.shape}, {V.shape}")
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"Q and K must have the same head dimension (last axis); got {Q.shape[-1]} and {K.shape[-1]}")
    if K.shape[:-1] != V.shape[:-1]:
        raise ValueError(
            f"K and V must have the same shape except the last axis (..., m, :); got {K.shape} and {V.shape}"
        )
    for name, x in (("Q", Q), ("K", K)):
        if 0 in x.shape:
            raise ValueError(f"{name} has an empty axis (shape {x.shape}); attention needs n >= 1, m >= 1 and d >= 1")
    if Q.shape[:-2] != K.shape[:-2]:
        gqa = (
            allow_gqa
            and Q.ndim >= 3
            and Q.shape[:-3] == K.shape[:-3]
            and Q.shape[-3] % K.shape[-3] == 0
        )
        if not gqa:
            what = "equal (or K/V heads dividing Q heads, axis -3)" if allow_gqa else "equal"
            raise ValueError(f"leading (batch/head) axes of Q and K/V must be {what}; got {Q.shape} and {K.shape}")
        group = Q.shape[-3] // K.shape[-3]
        K = np.repeat(K, group, axis=-3)
        V = np.repeat(V, group, axis=-3)
    return Q, K, V


def check_block(value, name: str) -> int:
    """A block size must be a positive integer."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return int(value)


def check_scale(scale, d: int) -> float:
    """Default softmax scale is 1/sqrt(d), as in the paper."""
    if scale is None:
        return 1.0 / float(np.sqrt(d))
    if not isinstance(scale, numbers.Real) or not np.isfinite(scale):
        raise TypeError(f"scale must be a finite real number or None; got {scale!r}")
    return float(scale)


def causal_offset(n: int, m: int) -> int:
    """Query i may see keys j <= i + (m - n): the last query is aligned with the last key."""
    return m - n
