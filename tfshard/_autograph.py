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
from collections.abc import Callable, Mapping
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
    """`value` as `spec` takes it, by TensorFlow's rules for an ``input_signature``.

    Each value a `tf.TypeSpec` of `spec` covers is its leaf, whatever it is: a
    value that is not a tensor converts whole to a tensor of a `tf.TensorSpec`'s
    dtype (``tf.convert_to_tensor(v, spec.dtype)``: a nested Python list of
    numbers becomes one tensor), another spec takes only its own kind of value
    (a `tf.RaggedTensorSpec` a `tf.RaggedTensor`, never a list), and a tensor
    must be compatible with its spec.

    Above the leaves the structures match by kind, as the `tf.function` casts
    them: a tuple takes a tuple (a namedtuple too) and a list a list, of the
    same length (a list is refused where the signature has a tuple, and the
    reverse); a namedtuple takes a namedtuple with the same fields and comes
    back as the signature's; a dict takes a mapping with the same keys and
    comes back as the signature's type. A part of which nothing converts is
    given as it came, as the `tf.function` gives it.

    Raises:
      TypeError: naming `arg`, where the `tf.function` would refuse the value.
    """
    try:
        return _cast(spec, value, arg, "")
    except _Refused as refused:
        raise TypeError(
            f"{name}'s input_signature takes {arg} as {spec}, but tfshard gives it {arg} "
            f"of {refused}, which the tf.function refuses, so tfshard does (give it "
            "arguments its signature takes, or change the signature)"
        ) from None


def _cast(spec: Any, value: Any, arg: str, path: str) -> Any:
    """`value`, at `path` in argument `arg`, as `spec` takes it (`_as_signed`)."""
    at = f" at {arg}{path}" if path else ""
    if isinstance(spec, tf.TypeSpec):
        if isinstance(spec, tf.TensorSpec) and not isinstance(value, tf.Tensor):
            try:
                value = tf.convert_to_tensor(value, spec.dtype)
            except (TypeError, ValueError):
                raise _Refused(
                    f"a value that is not a {spec.dtype.name} tensor{at}: {value!r}"
                ) from None
        elif not isinstance(spec, tf.TensorSpec) and not isinstance(value, spec.value_type):
            raise _Refused(f"a {type(value).__name__}{at}, not a {spec.value_type.__name__}")
        tensor = isinstance(value, tf.Tensor | tf.RaggedTensor | tf.SparseTensor)
        if tensor and not spec.is_compatible_with(value):
            raise _Refused(f"shape {value.shape} and dtype {value.dtype.name}{at}")
        return value
    if isinstance(spec, Mapping):
        if not isinstance(value, Mapping):
            raise _Refused(f"a {type(value).__name__}{at} where the signature has a dict")
        if set(value) != set(spec):
            raise _Refused(f"a mapping with keys {sorted(map(repr, value))}{at}")
        keys = list(spec)
        parts = [_cast(spec[k], value[k], arg, f"{path}[{k!r}]") for k in keys]
        if all(p is value[k] for p, k in zip(parts, keys)):
            return value
        return type(spec)(**dict(zip(keys, parts)))  # as TensorFlow builds it
    if _is_namedtuple(spec):
        if not _is_namedtuple(value) or set(value._fields) != set(spec._fields):
            raise _Refused(f"a {type(value).__name__}{at}, not a namedtuple of {spec._fields}")
        olds = [getattr(value, n) for n in spec._fields]
        parts = [_cast(s, v, arg, f"{path}.{n}") for s, v, n in zip(spec, olds, spec._fields)]
        if all(p is v for p, v in zip(parts, olds)):
            return value
        return type(spec)(*parts)
    if isinstance(spec, tuple | list):
        kind = tuple if isinstance(spec, tuple) else list
        if not isinstance(value, kind):
            raise _Refused(
                f"a {type(value).__name__}{at} where the signature has a {kind.__name__}"
            )
        if len(value) != len(spec):
            raise _Refused(f"{len(value)} values{at} where the signature has {len(spec)}")
        parts = [_cast(s, v, arg, f"{path}[{i}]") for i, (s, v) in enumerate(zip(spec, value))]
        if all(p is v for p, v in zip(parts, value)):
            return value
        return kind(parts)
    try:  # another structure (attrs): matched as tf.nest matches it
        tf.nest.assert_same_structure(spec, value, check_types=False)
    except (ValueError, TypeError):
        raise _Refused(f"a different structure{at}") from None
    leaves = [_cast(s, v, arg, path) for s, v in zip(tf.nest.flatten(spec), tf.nest.flatten(value))]
    return tf.nest.pack_sequence_as(value, leaves)


def _is_namedtuple(value: Any) -> bool:
    """Whether `value` is a namedtuple (a tuple with ``_fields``), as TensorFlow tells one."""
    return isinstance(value, tuple) and isinstance(getattr(value, "_fields", None), tuple)


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
