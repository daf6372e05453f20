"""The user's function as a trace calls it: autograph applied, methods bound weakly.

`autographed` converts Python control flow on tensors as `tf.function` would;
`WeakMethod` is what a method decorated with `parallelize` runs as, so its
per-instance cache does not keep the instance alive.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import tensorflow as tf


def autographed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with autograph applied, as `tf.function` would apply it.

    A function converts; a method (bound, or a `WeakMethod`) converts as its
    function and binds again; a callable object converts its class's
    ``__call__``, bound to it (`tf.autograph.to_graph` takes no objects). A
    Keras layer is left as it is (Keras converts its own ``call``).

    A `tf.function` (a function, a method, or a class's ``__call__``) is
    called as its Python function (``python_function``), converted with
    autograph, so tfshard's trace is its one trace and each shard's call sees
    its own `tfshard.shard_index` and `tfshard.row_index` (see
    `tf_function_of`). It is converted whatever its own ``autograph=``:
    TensorFlow has no public way to read it, so one made with
    ``autograph=False`` runs converted too (Python control flow on a tensor
    runs as TF ops, where the `tf.function` would refuse it). Where it has an
    ``input_signature``, its arguments are converted and checked as the
    `tf.function` converts and checks them (a Python number becomes a tensor
    of the spec's dtype; what the signature does not take is a `TypeError`
    naming the argument). Anything that does not convert is called as written.
    """
    if isinstance(fn, types.MethodType):
        return types.MethodType(_converted(fn.__func__, method=True), fn.__self__)
    if isinstance(fn, WeakMethod):
        return fn.with_func(_converted(fn.__func__, method=True))
    if is_keras_layer(fn):
        return fn
    call = inspect.getattr_static(type(fn), "__call__", None)  # a function's: a slot wrapper
    is_method = isinstance(call, types.FunctionType | tf.types.experimental.PolymorphicFunction)
    if is_method and not hasattr(fn, "get_concrete_function"):
        return types.MethodType(_converted(call, method=True), fn)
    return _converted(fn)


def tf_function_of(fn: Any) -> Any:
    """The `tf.function` that `autographed` calls as its Python function, or None: `fn`
    itself, a method's function, or the ``__call__`` of an object's class.

    A `tf.function` keys its traces on its arguments alone, not on the graph
    that calls it: a second shard's call reuses the first shard's trace, with
    the first shard's position in it as a constant or a captured tensor (a
    wrong value, or an `InaccessibleTensorError` from another graph).
    """
    if is_keras_layer(fn):
        return None
    if isinstance(fn, types.MethodType | WeakMethod):
        fn = fn.__func__
    elif not isinstance(fn, tf.types.experimental.PolymorphicFunction):
        fn = inspect.getattr_static(type(fn), "__call__", None)
    return fn if isinstance(fn, tf.types.experimental.PolymorphicFunction) else None


def _converted(fn: Callable[..., Any], *, method: bool = False) -> Callable[..., Any]:
    """`fn` converted; `method`: a function of a class, its instance bound later."""
    function = fn if isinstance(fn, tf.types.experimental.PolymorphicFunction) else None
    if function is not None:
        fn = function.python_function  # see `tf_function_of`
    if hasattr(fn, "get_concrete_function"):  # a ShardedFunction
        return fn
    try:
        converted = tf.autograph.to_graph(fn)
    except Exception:  # no source to read, a builtin: call it as written
        converted = fn
    if function is None or function.input_signature is None:
        return converted
    return _signed(converted, function, method)


def _signed(converted: Callable[..., Any], function: Any, method: bool) -> Callable[..., Any]:
    """`converted`, its arguments first made what `function`'s ``input_signature`` makes them.

    Called in its place, the `tf.function` would convert each value a
    `tf.TensorSpec` of its signature covers to a tensor of the spec's dtype (a
    Python ``3`` becomes a float32 tensor for a float32 spec), and refuse
    arguments its signature does not take (one sample where it takes a batch,
    another dtype); `converted` gets the same tensors, or the same refusal.
    Specs pair with the positional arguments in order (``*args`` included), as
    the `tf.function` pairs them. `method`: the first argument is the
    instance, which the signature leaves out.
    """
    signature = inspect.signature(function.python_function)
    specs = function.input_signature
    name = getattr(function, "__name__", "the tf.function")
    skip = 1 if method else 0

    @tf.autograph.experimental.do_not_convert
    def checked(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        positional = list(bound.args)
        labels = _positional_labels(signature, len(positional))
        for i, spec in enumerate(specs, start=skip):
            if i >= len(positional):
                break
            positional[i] = _as_signed(name, labels[i], spec, positional[i])
        return converted(*positional, **bound.kwargs)

    return functools.wraps(converted)(checked)


def _positional_labels(signature: inspect.Signature, count: int) -> list[str]:
    """The names of `count` positional arguments bound to `signature`: a parameter's
    name, ``args[k]`` for the k-th value of ``*args``."""
    labels = []
    for parameter in signature.parameters.values():
        if parameter.kind is parameter.VAR_POSITIONAL:
            labels += [f"{parameter.name}[{k}]" for k in range(count - len(labels))]
        elif parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            labels.append(parameter.name)
    return labels[:count]


def _as_signed(name: str, arg: str, spec: Any, value: Any) -> Any:
    """`value` as `spec` takes it: each value a `tf.TensorSpec` covers converted to a
    tensor of its dtype (``tf.convert_to_tensor(v, spec.dtype)``, as the
    `tf.function` converts it), checked against its spec (`_signed`).

    Raises:
      TypeError: naming `arg`, where the `tf.function` would refuse the value.
    """

    def cast(s: Any, v: Any) -> Any:
        if isinstance(s, tf.TensorSpec) and not isinstance(v, tf.Tensor):
            try:
                v = tf.convert_to_tensor(v, s.dtype)
            except (TypeError, ValueError):
                raise _Refused(f"a value that is not a {s.dtype.name} tensor: {v!r}") from None
        tensor = isinstance(v, tf.Tensor | tf.RaggedTensor | tf.SparseTensor)
        if tensor and isinstance(s, tf.TypeSpec) and not s.is_compatible_with(v):
            raise _Refused(f"shape {v.shape} and dtype {v.dtype.name}")
        return v

    try:
        if not tf.nest.is_nested(spec):  # one spec: a list or a number converts whole
            return cast(spec, value)
        try:
            tf.nest.assert_same_structure(spec, value, check_types=False)
        except (ValueError, TypeError):
            raise _Refused("a different structure") from None
        leaves = [cast(s, v) for s, v in zip(tf.nest.flatten(spec), tf.nest.flatten(value))]
        return tf.nest.pack_sequence_as(value, leaves)
    except _Refused as refused:
        raise TypeError(
            f"{name}'s input_signature takes {arg} as {spec}, but tfshard gives it {arg} "
            f"of {refused}, which the tf.function refuses, so tfshard does (give it "
            "arguments its signature takes, or change the signature)"
        ) from None


class _Refused(Exception):
    """A value an ``input_signature`` does not take (`_as_signed`), and why."""


def keras_of(obj: Any) -> Any:
    """The Keras package whose layer (or model) `obj` is, or None.

    Keras is never imported here: a layer's existence means it was.
    """
    for name in ("keras", "tf_keras"):  # Keras 3 (tf.keras), or Keras 2's package
        keras = sys.modules.get(name)
        if keras is not None and isinstance(obj, keras.layers.Layer):
            return keras
    return None


def is_keras_layer(fn: Any) -> bool:
    """Whether `fn` is a Keras layer or model (which takes batches, and converts itself)."""
    return keras_of(fn) is not None


class WeakMethod:
    """A method that holds its instance weakly and looks it up at each call.

    What a method decorated with `parallelize` runs as: its engine (and the
    graphs it traces) is cached per instance, as `tf.function` caches them,
    and that cache must not keep the instance alive. The caller holds the
    instance for the length of each call (`tfshard.parallel`'s bound
    function), so the function's ``self`` is always the instance itself.

    Args:
      func: the function of the class, taking the instance first.
      instance: the instance to call it with.
    """

    def __init__(self, func: Callable[..., Any], instance: Any) -> None:
        self.__func__ = func
        self._instance = weakref.ref(instance)
        functools.update_wrapper(self, func, updated=())
        # Without self, as a bound method's; it also stops inspect's unwrapping here.
        with contextlib.suppress(TypeError, ValueError):  # a builtin may have none
            self.__signature__ = inspect.signature(types.MethodType(func, instance))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        instance = self._instance()
        if instance is None:
            raise ReferenceError(
                f"{self.__name__}: the instance this method was bound to no longer exists"
            )
        return self.__func__(instance, *args, **kwargs)

    def with_func(self, func: Callable[..., Any]) -> WeakMethod:
        """This method with another function (its converted form), bound to the same instance."""
        other = copy.copy(self)
        other.__func__ = func
        return other
