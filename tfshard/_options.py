"""The options of one parallelized function: one frozen value, validated once.

`parallelize` validates what it was given into an `Options`, which is passed
whole, never copied field by field; a variant (a method's per-instance
function) is ``dataclasses.replace(options, ...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tfshard import _plan, collect, pinning
from tfshard._arguments import check_flag, integer
from tfshard._autograph import keras_of, tf_function_of
from tfshard.errors import ArgumentError, DeviceError
from tfshard.replicas import Replicas

# What None means for the flags that take it (`check_flag`'s none=).
_PER_SAMPLE_NONE = "False for a Keras layer or model, True for anything else"
_JIT_COMPILE_NONE = (
    "what the function is, a Keras model's own model.jit_compile, False for anything else; "
    "True compiles each shard with XLA"
)


@dataclasses.dataclass(frozen=True)
class Options:
    """What `parallelize` was asked for (see its Args), validated.

    Attributes:
      devices: the device specs as given, or None for every GPU (else CPU);
        resolved when the function first runs.
      weights: integer weights (`_plan.integer_weights`), or None (an even
        split, or ``weights="auto"``'s until measured).
      given_weights: the weights as given (what `ShardedFunction.weights`
        shows), or None.
      balanced: ``weights="auto"``: weights measured on the function
        (`tfshard._balance`).
      per_sample: vectorise over rows, or call on each shard.
      reduce: the reduction record, or None to gather.
      output_device: the output device's spec as given, or None (the first device).
      broadcast: argument names or positions passed whole to every shard, as
        given (`tfshard._arguments.Arguments` checks them against the function).
      ragged: stack per-sample outputs as ragged tensors.
      jit_compile: compile each shard with XLA (True), not (False), or None
        for what the function is (`for_function` decides, when it first runs).
      allow_duplicate_devices: let two shards share a device.
      max_rows: the most rows a shard's function takes at once: one int for
        every device, one per device (None: no limit there), or None.
    """

    devices: tuple[pinning.DeviceSpecLike, ...] | None = None
    weights: tuple[int, ...] | None = None
    given_weights: tuple[float, ...] | None = None
    balanced: bool = False
    per_sample: bool = True
    reduce: collect.Reduction | None = None
    output_device: pinning.DeviceSpecLike | None = None
    broadcast: Any = ()
    ragged: bool = False
    jit_compile: bool | None = None
    allow_duplicate_devices: bool = False
    max_rows: int | tuple[int | None, ...] | None = None

    @classmethod
    def validated(
        cls,
        *,
        devices: Any,
        weights: Sequence[float] | str | None,
        per_sample: bool,
        reduce: str | None,
        output_device: pinning.DeviceSpecLike | None,
        broadcast: Sequence[str | int],
        ragged: bool,
        jit_compile: bool | None,
        allow_duplicate_devices: bool,
        max_rows: int | Sequence[int | None] | None = None,
    ) -> Options:
        """`parallelize`'s arguments checked, as one value; ArgumentError names a bad one.

        The flags take a bool or a NumPy bool (`check_flag`), never another
        value's truth (``per_sample="False"`` is refused, not read as True).
        """
        for name, value, none in (
            ("per_sample", per_sample, _PER_SAMPLE_NONE),
            ("ragged", ragged, ""),
            ("allow_duplicate_devices", allow_duplicate_devices, ""),
            ("jit_compile", jit_compile, _JIT_COMPILE_NONE),
        ):
            check_flag(value, name, "parallelize", none=none)
        op = collect.reduction(reduce)
        if ragged and op is not None:
            raise ArgumentError(
                f"ragged=True with reduce={reduce!r}: ragged outputs have no common shape "
                "to reduce; drop one of them"
            )
        if ragged and not per_sample:
            raise ArgumentError(
                "ragged=True needs per_sample=True: with per_sample=False the function "
                "returns its shard's rows itself (return a tf.RaggedTensor to get one)"
            )
        specs = _device_specs(devices)
        if output_device is not None:  # 0 is GPU 0, as everywhere: None alone is the default
            output_device = _device(output_device, "output_device")
        balanced = isinstance(weights, str) and weights == "auto"
        if isinstance(weights, str) and not balanced:
            raise ArgumentError(
                f"weights={weights!r}: pass one number per device (relative speeds, e.g. "
                "[3, 1]), or weights='auto' to measure them on the function"
            )
        integer = None if balanced else _plan.integer_weights(weights)
        if specs is not None and integer is not None and len(specs) != len(integer):
            raise ArgumentError(
                f"weights has {len(integer)} entries but devices has {len(specs)}; "
                "give one weight per device"
            )
        limits = _max_rows(max_rows)
        if specs is not None and isinstance(limits, tuple) and len(specs) != len(limits):
            raise ArgumentError(
                f"max_rows has {len(limits)} entries but devices has {len(specs)}; give "
                "one per device (None for no limit there), or one int for every device"
            )
        return cls(
            devices=specs,
            weights=integer,
            given_weights=None if integer is None else tuple(_number(w) for w in weights),
            balanced=balanced,
            max_rows=limits,
            per_sample=bool(per_sample),
            reduce=op,
            output_device=output_device,
            broadcast=broadcast,
            ragged=bool(ragged),
            jit_compile=None if jit_compile is None else bool(jit_compile),
            allow_duplicate_devices=bool(allow_duplicate_devices),
        )

    def resolve(self) -> tuple[tuple[str, ...], str]:
        """The canonical devices and output device (resolved now: context maps apply)."""
        if self.devices is None:
            devices = tuple(pinning.list_devices("GPU") or pinning.list_devices("CPU"))
        else:
            devices = tuple(pinning.resolve_device(d) for d in self.devices)
        if not self.allow_duplicate_devices and len(set(devices)) != len(devices):
            seen: dict[str, int] = {}
            for i, name in enumerate(devices):
                if name in seen:
                    specs = self.devices or devices
                    raise ArgumentError(
                        f"devices[{seen[name]}]={specs[seen[name]]!r} and "
                        f"devices[{i}]={specs[i]!r} are both {name}; two shards "
                        "on one device run one after the other. Remove one, or pass "
                        "allow_duplicate_devices=True if that is what you want (e.g. a "
                        "context map that aliases two names to one card)"
                    )
                seen[name] = i
        if self.weights is not None and len(self.weights) != len(devices):
            raise ArgumentError(
                f"weights has {len(self.weights)} entries but there are {len(devices)} "
                f"devices ({', '.join(devices)}); give one weight per device"
            )
        if isinstance(self.max_rows, tuple) and len(self.max_rows) != len(devices):
            raise ArgumentError(
                f"max_rows has {len(self.max_rows)} entries but there are {len(devices)} "
                f"devices ({', '.join(devices)}); give one per device (None for no limit "
                "there), or one int for every device"
            )
        if self.output_device is None:
            return devices, devices[0]
        try:
            return devices, pinning.resolve_device(self.output_device)
        except DeviceError as error:
            raise DeviceError(f"output_device={self.output_device!r}: {error}") from None

    def for_function(self, fn: Any, devices: Sequence[str]) -> Options:
        """These options with `jit_compile` decided for `fn` on `devices` (always a bool).

        As given when given. For a Keras model, the model's own ``model.jit_compile``
        (what `predict` reads), where XLA can run it on `devices`: built, and every
        shard reading its weights on its own device (XLA cannot read a variable on
        another device). For a `tf.function`, its own ``jit_compile``: tfshard
        calls its Python function (`tfshard._autograph.autographed`), so the
        shards are compiled as the `tf.function` would have compiled itself,
        where XLA can compile tfshard's code around it (not with ``ragged=True``,
        whose `tf.map_fn` stacks rows in a list XLA has no kernel for).
        Anything else: False.
        """
        if self.jit_compile is not None:
            return self
        compiles = _model_compiles(fn, devices) or (_function_compiles(fn) and not self.ragged)
        return dataclasses.replace(self, jit_compile=compiles)

    def limits(self, count: int) -> tuple[int | None, ...] | None:
        """`max_rows` as one entry per device (None: no limit there), or None for none."""
        if self.max_rows is None:
            return None
        if isinstance(self.max_rows, int):
            return (self.max_rows,) * count
        return self.max_rows if any(m is not None for m in self.max_rows) else None


def _function_compiles(fn: Any) -> bool:
    """Whether `fn` is a `tf.function` made with ``jit_compile=True`` (`tf_function_of`)."""
    function = tf_function_of(fn)
    # TF has no public way to read a tf.function's jit_compile short of tracing it
    # on arguments: this reads `function_spec.jit_compile`, an undocumented attribute
    # of TF 2.21's PolymorphicFunction (None: not set, no XLA). test_parallel's
    # test_a_tf_function_made_with_jit_compile_has_each_shard_compiled fails if it goes.
    spec = getattr(function, "function_spec", None)
    return bool(getattr(spec, "jit_compile", None))


def _model_compiles(fn: Any, devices: Sequence[str]) -> bool:
    """A Keras model's own ``jit_compile`` where XLA can run it on `devices`, else False."""
    keras = keras_of(fn)
    if keras is None or not isinstance(fn, keras.Model) or not fn.built:
        return False
    if not bool(getattr(fn, "jit_compile", False)):  # Keras resolves "auto" here
        return False
    replicas = Replicas.find(devices)
    for variable in fn.variables:
        if replicas is not None and replicas.holds(variable):
            continue
        # A Keras 3 variable holds its tf.Variable as .value; tf_keras's are tf.Variables.
        home = variable.device if isinstance(variable, tf.Variable) else variable.value.device
        if not all(pinning.same_device(home, d) for d in devices):
            return False
    return True


def _device_specs(devices: Any) -> tuple[Any, ...] | None:
    """`devices` as a tuple of specs, each checked for its type (`_device`): one device or a
    sequence of them; None for every GPU. Bytes are refused, as `pinning.resolve_device`
    refuses them, not read as a sequence of ints (GPU indices)."""
    if devices is None:
        return None
    if integer(devices) is not None or isinstance(
        devices, bool | str | tf.config.LogicalDevice | tf.DeviceSpec
    ):
        return (_device(devices, "devices"),)
    if isinstance(devices, bytes | bytearray) or not isinstance(devices, Sequence | np.ndarray):
        raise ArgumentError(
            f"devices={devices!r} is of type {type(devices).__name__}: pass a list of devices "
            "(ints for GPU indices, names such as 'GPU:1' or 'cpu' as str), one device, or "
            "None for every GPU (else every CPU device)"
        )
    if len(devices) == 0:
        raise ArgumentError(
            "devices=[]: give at least one device, or devices=None for every "
            "GPU (else every CPU device)"
        )
    return tuple(_device(d, f"devices[{i}]") for i, d in enumerate(devices))


def _device(spec: Any, where: str) -> pinning.DeviceSpecLike:
    """One device spec of `where` checked for its type (`pinning.resolve_device` resolves it
    when the function first runs); else ArgumentError."""
    number = integer(spec)  # a NumPy integer is the GPU index it holds; a bool is none
    if number is not None:
        return number
    if isinstance(spec, str | tf.config.LogicalDevice | tf.DeviceSpec):
        return spec
    default = "; None (the default) for the first device" if where == "output_device" else ""
    raise ArgumentError(
        f"{where}={spec!r} is of type {type(spec).__name__}, not a device: pass an int (GPU "
        "index), a name such as 'GPU:1' or 'cpu', a context name, a tf.config.LogicalDevice or a "
        f"tf.DeviceSpec{default}"
    )


def _max_rows(max_rows: Any) -> int | tuple[int | None, ...] | None:
    """`max_rows` validated: None, an int >= 1, or one int >= 1 (or None) per device."""
    if max_rows is None:
        return None
    if _is_count(max_rows):
        return int(max_rows)
    if isinstance(max_rows, np.ndarray) and max_rows.ndim == 1:
        max_rows = list(max_rows)  # one per device, as a list of them is
    if isinstance(max_rows, str | bytes) or not isinstance(max_rows, Sequence):
        raise ArgumentError(
            f"max_rows={max_rows!r}: the most rows a shard's function takes at once, an "
            "int >= 1, or one per device (None for no limit there)"
        )
    for i, limit in enumerate(max_rows):
        if limit is not None and not _is_count(limit):
            raise ArgumentError(
                f"max_rows[{i}]={limit!r}: each entry is an int >= 1, or None for no limit "
                "on that device"
            )
    return tuple(None if m is None else int(m) for m in max_rows)


def _number(value: Any) -> float:
    """A weight as a Python number (a NumPy scalar's value), as `f.weights` shows it."""
    return value.item() if isinstance(value, np.generic) else value


def _is_count(value: Any) -> bool:
    number = integer(value)
    return number is not None and number >= 1
