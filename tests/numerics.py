"""What "equal to the reference" means for values computed two ways (one helper for every test).

Every test that compares floats computed two ways (tfshard against one device, NumPy,
`model.predict`, a stream against the in-memory call) calls `assert_close`; exact arithmetic
(integers, copies, gathers, `x * 3` of small integers) stays `np.testing.assert_array_equal`.

The tolerance knows two things:

- **The dtype.** float32 and complex64: DESIGN.md's relative error 1e-5. oneDNN's kernels and
  the number of threads reorder float32 sums on CPUs, and a different batch split picks other
  kernels (static shapes, other blockings), so two ways differ in the last bits. float64 and
  complex128: 1e-12. float16 and bfloat16: four roundings of the dtype (`rounding.EPSILON`);
  `rounding.assert_rounded` is the stricter check of a reduction against NumPy.
- **The device kind.** On a GPU that runs float32 matmuls and convolutions in TF32 (Ampere,
  Hopper: TensorFlow's default) float32 is good to about 1e-3 of the magnitudes summed (README,
  "Numerics on GPUs"): `TF32_RTOL`.

The absolute tolerance is the relative one times the magnitude of the values (the largest
`|want|`, or `scale=` when the terms summed are larger than the result): a sum that cancels to
near 0 keeps the absolute error of its terms, which no relative tolerance of that element
bounds. An element near 0 is therefore judged against the array's magnitude, not its own.
tests/README.md has this rule beside the others every test meets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import rounding
import tensorflow as tf

# DESIGN.md: "Results equal the same function run on one device (float32: relative error
# < 1e-5)". Keys are NumPy's dtype names (ml_dtypes' "bfloat16" included).
RTOL = {
    "float16": 4 * rounding.EPSILON["float16"],
    "bfloat16": 4 * rounding.EPSILON["bfloat16"],
    "float32": 1e-5,
    "complex64": 1e-5,
    "float64": 1e-12,
    "complex128": 1e-12,
}
# float32 on a GPU running TF32: the H100 runs of 2026-11-24 and -27 differed by up to 1.4e-3
# of the magnitudes (8.4e-4 on results of order 1).
TF32_RTOL = 2e-3
_TF32_DTYPES = ("float32", "complex64")


def tf32_applies(devices: str | Iterable[Any] | None = None) -> bool:
    """True when one of `devices` is a GPU and TensorFlow runs float32 there in TF32.

    Args:
        devices: the devices that computed either side of the comparison (names, specs or
            `tf.config.LogicalDevice`s); None for every device of this process, which is
            right when a side ran on TensorFlow's default device (GPU:0 where there is one:
            an eager reference, `model.predict`).
    """
    if devices is None:
        devices = tf.config.list_logical_devices()
    elif isinstance(devices, str | tf.DeviceSpec | tf.config.LogicalDevice):
        devices = [devices]
    on_gpu = any(_device_type(d) == "GPU" for d in devices)
    return on_gpu and bool(tf.config.experimental.tensor_float_32_execution_enabled())


def _device_type(device: Any) -> str | None:
    if isinstance(device, tf.config.LogicalDevice):
        return device.device_type
    if isinstance(device, tf.DeviceSpec):
        return device.device_type
    return tf.DeviceSpec.from_string(str(device)).device_type


def tolerance(
    dtype: Any = "float32",
    devices: str | Iterable[Any] | None = None,
    scale: float = 1.0,
) -> dict[str, float]:
    """`rtol` and `atol` for `np.testing.assert_allclose` of two ways of computing `dtype`.

    Args:
        dtype: the values' dtype (a name, NumPy or TensorFlow dtype).
        devices: the devices that computed either side; None: every device of this process
            (see `tf32_applies`).
        scale: the magnitude of the values (or of the terms summed into them); the absolute
            tolerance is the relative one times it.

    Returns:
        ``{"rtol": r, "atol": r * scale}``; both 0 for a dtype whose arithmetic is exact.
    """
    name = tf.as_dtype(dtype).name
    rtol = RTOL.get(name, 0.0)
    if name in _TF32_DTYPES and tf32_applies(devices):
        rtol = TF32_RTOL
    return {"rtol": rtol, "atol": rtol * float(scale)}


def assert_close(
    got: Any,
    want: Any,
    devices: str | Iterable[Any] | None = None,
    *,
    scale: float | None = None,
    err_msg: str = "",
) -> None:
    """Asserts that `got` equals the reference `want` within what two ways of computing differ.

    Integers, booleans and strings must be equal. Floats get `tolerance(dtype, devices, scale)`
    for the less precise dtype of the two (float32 results against a float64 NumPy reference
    are float32's), with `scale` the largest finite ``|want|`` unless given.

    Python floats are float64: give arrays of the dtype computed (``np.float32(losses)``).

    Args:
        got: what tfshard computed (an array, a tensor, or what converts to one).
        want: the reference, computed another way (a scalar broadcasts, as in NumPy).
        devices: the devices that computed either side (pass the function's ``f.devices``
            plus the reference's device); None: every device of this process, for a side
            that ran on TensorFlow's default device.
        scale: the magnitude the absolute tolerance is relative to, where the terms summed
            are larger than the result (a cancelling sum); default the largest ``|want|``.
        err_msg: shown with a failure.
    """
    got, want = np.asarray(got), np.asarray(want)
    dtypes = [x.dtype.name for x in (got, want) if x.dtype.name in RTOL]
    if not dtypes:
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
        return
    dtype = max(dtypes, key=RTOL.get)
    if dtype not in ("complex64", "complex128"):
        got, want = got.astype(np.float64), want.astype(np.float64)  # float16, bfloat16 too
    if scale is None:
        finite = np.abs(want[np.isfinite(want)])
        scale = float(finite.max()) if finite.size else 0.0
    np.testing.assert_allclose(
        got, want, err_msg=err_msg, equal_nan=True, **tolerance(dtype, devices, scale)
    )
