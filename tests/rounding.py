"""The reference for low-precision reductions (one helper for every test file).

NumPy in float64 over the very values the dtype holds, rounded once to the
dtype: what NumPy and JAX return for float16 (they total it in float32), and
what a reduction is right to within one rounding.
"""

from typing import Any

import numpy as np
import tensorflow as tf

# Each dtype's epsilon (its spacing at 1.0): a result one rounding off is within this
# relative tolerance, a stuck sum (4096 for 10,000) or an overflowed count (0) is not.
EPSILON = {"float16": 2.0**-10, "bfloat16": 2.0**-7}
LOW_PRECISION = tuple(EPSILON)


def values(
    rng: np.random.Generator, shape: list[int], dtype: str, low: float = 0.0, high: float = 1.0
) -> Any:
    """Uniform values in [low, high) as `dtype` holds them (a NumPy array of that dtype)."""
    return tf.cast(rng.uniform(low, high, shape), dtype).numpy()


def exact(x: Any) -> np.ndarray:
    """`x` (float16 or bfloat16 values) in float64, exactly."""
    return np.asarray(x).astype(np.float64)


def reference(op: str, x: np.ndarray) -> np.ndarray:
    """NumPy's `op` over the rows of `x` (float64); of no rows, what tf.reduce_* gives."""
    if len(x):
        return {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op](x, axis=0)
    empty = {"sum": 0.0, "mean": np.nan, "max": -np.inf, "min": np.inf}[op]
    return np.full(x.shape[1:], empty)


def assert_rounded(got: Any, want: Any, dtype: str) -> None:
    """`got` has `dtype` and equals `want` (float64) rounded to it, to one rounding."""
    got = tf.convert_to_tensor(got)
    assert got.dtype == tf.as_dtype(dtype), f"{got.dtype.name}, not {dtype}"
    rounded = tf.cast(tf.constant(want, tf.float64), dtype)
    np.testing.assert_allclose(
        exact(got.numpy()), exact(rounded.numpy()), rtol=EPSILON[dtype], atol=0
    )
