"""One copy of a model's weights on every device, read by the shard that runs there.

A `tf.Variable` lives on one device. Without replicas, every shard on another
device reads it from there on every call: for a Keras model, (K - 1) copies of
its weights per call, all leaving one device. With replicas, each device holds
its own copy and each shard reads the copy on its device, as
`tf.distribute.MirroredStrategy` does (it is what holds them).

    predict = tfshard.parallelize(lambda x: model(x), devices=devices, per_sample=False)
    with predict.replicas():            # variables created here: one copy per device
        model = build_model()           # or load_weights / set_weights here or later
    predict(images)                     # shard k reads the copy on devices[k]
    print(predict.explain(images))      # "0 B" of weights read from other devices

- `Replicas.of(devices)` is the one `Replicas` of a set of devices, shared by
  every parallelized function on those devices (``f.replicas()`` enters it).
- `replicate` copies an existing Keras model into replicas (a clone with its
  weights); anything else is built inside the scope.
- `apply_gradients` applies gradients (e.g. ``reduce="mean"`` of a
  parallelized function) to replicated variables with a Keras optimizer, so
  every copy takes the same update; Keras optimizers cannot do that outside
  `tf.distribute.Strategy.run`.
- `variable_reads` reads, from a traced graph, which variables each shard reads
  and from which device: `ShardedFunction.explain` prints the bytes that cross.

Weights change in one place for all copies: assignments outside the function
(`set_weights`, `load_weights`, `assign`, `apply_gradients`) write every copy.
Inside the function a shard cannot write them (each copy would take only its
own shard's update): that raises an `ArgumentError` naming the remedy.

A variable the function creates at a call made inside the scope (a Keras model
built at its first call, ``if self.v is None: self.v = tf.Variable(...)``) gets
its copies there, as under `MirroredStrategy.run`; created at a call outside
the scope, it is a plain variable. So does one made in any trace inside the
scope, as under `MirroredStrategy.scope`: the per-sample trace tfshard makes
before the shards (``per_sample=True``), a function on other devices, the
user's own `tf.function`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import tensorflow as tf

from tfshard import pinning, position
from tfshard._autograph import keras_of
from tfshard._graph import shard_accesses, shard_writes
from tfshard.errors import ArgumentError

__all__ = ("Replicas", "VariableRead", "apply_gradients", "replicate", "variable_reads")

# Ops that reach a variable without reading its value.
_NO_READ = frozenset({"VarIsInitializedOp", "VariableShape", "DestroyResourceOp"})


class Replicas:
    """The copies of variables on a set of devices of this machine.

    Use `Replicas.of` (or ``f.replicas()``): one instance per set of devices,
    so every parallelized function on them reads the same copies.

    Process-wide state (`_registry`, `generation`), because a device and a
    variable belong to the process, not to one function: the copies on a set
    of devices are one thing for every function on them, and a variable made
    by any of them must make every one retrace (`generation` changes).

    Attributes:
      devices: the canonical device names, one copy each.
      strategy: the `tf.distribute.MirroredStrategy` that holds the copies.
    """

    _registry: dict[tuple[str, ...], Replicas] = {}
    _lock = threading.Lock()
    # Bumped when replicas or replicated variables are made: the functions on
    # their devices retrace at their next call, to read the new copies.
    generation = 0

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.devices = devices
        # Copies change only by assignment outside the shards (a broadcast) and by
        # `apply_gradients`, whose one sum is made on the first device.
        logger = tf.get_logger()
        level = logger.level
        logger.setLevel(max(level, logging.WARNING))  # "Using MirroredStrategy with devices"
        try:
            self.strategy = _Strategy(
                list(devices), cross_device_ops=tf.distribute.ReductionToOneDevice(devices[0])
            )
        finally:
            logger.setLevel(level)
        # MirroredStrategy numbers replicas in its own device order.
        self._replica_of = {
            pinning.resolve_device(d): k
            for k, d in enumerate(self.strategy.extended.worker_devices)
        }
        # The variables made in `scope`, and each one's copies, by id (tf.Variable
        # is unhashable); weak, so replicas do not keep a dropped model alive.
        self._made: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()

    @classmethod
    def of(cls, devices: Sequence[str]) -> Replicas:
        """The replicas of these devices, in any order (a repeated device holds one copy)."""
        unique = _key(devices)
        remote = [d for d in unique if pinning.is_remote(d)]
        if remote:
            raise ArgumentError(
                f"replicas: {', '.join(remote)} belong to another machine; replicas hold "
                "copies on this machine's devices only. Keep the model on each worker "
                "(tfshard.processes), or read its weights remotely without replicas"
            )
        with cls._lock:
            found = cls._registry.get(unique)
            if found is None:
                found = cls._registry[unique] = cls(unique)
                cls.generation += 1
            return found

    @classmethod
    def find(cls, devices: Sequence[str]) -> Replicas | None:
        """The replicas of these devices if any were made, else None."""
        return cls._registry.get(_key(devices))

    @classmethod
    def forget_all(cls) -> None:
        """Forgets the replicas of every set of devices, as if none were made.

        A later `of` makes new copies, and every function retraces at its next
        call. Copies still held (by a model, an optimizer) live on. For a
        long-lived process that starts over: a test suite giving each test none.
        """
        with cls._lock:
            cls._registry.clear()
            cls.generation += 1

    @contextlib.contextmanager
    def scope(self, *, retrace: bool = True) -> Iterator[None]:
        """Variables created inside get one copy per device (`MirroredStrategy.scope`).

        So do the variables a parallelized function on these devices creates
        at a call made inside (a Keras model built at its first call), as
        `MirroredStrategy.run` makes them (`_made_in_a_shard`), and those any
        other trace creates inside (tfshard's per-sample trace, a function on
        other devices, the user's own `tf.function`), as under
        `MirroredStrategy.scope`: made outside the trace as in a shard when
        their initial value is known there (a callable, as Keras's, or a
        constant). Otherwise a tfshard trace refuses it with the fix (an
        `ArgumentError`, as a shard does) and the user's own `tf.function`
        has the strategy make it in the trace, as under its scope.

        Args:
          retrace: whether the functions on these devices retrace at their next
            call, to read the new variables. False only for variables no
            function has captured one of in its place: an optimizer's state,
            made by `apply_gradients`.
        """

        def record(next_creator: Any, **kwargs: Any) -> Any:
            if getattr(_making, "here", False):
                return next_creator(**kwargs)  # `_made_in_a_shard`'s own: it records it
            context = tf.distribute.get_replica_context()
            in_a_trace = tf.inside_function()
            in_a_shard = isinstance(context, _ShardContext) and in_a_trace
            # Outside a shard, in a trace (tfshard's per-sample trace, a function without
            # replicas, the user's own tf.function): already in the cross-replica context.
            # The strategy's own creator, in the trace, serves a tf.function's call but not
            # tfshard's get_concrete_function (a raw UnliftableError): tfshard's traces
            # make every variable outside, or refuse it with the fix.
            eagerly = (
                in_a_trace and context is None and (_known_outside(kwargs) or position.tracing())
            )
            if in_a_shard:
                variable = context.across_replicas(lambda: self._made_in_a_shard(kwargs))
            elif eagerly:
                variable = self._made_in_a_shard(kwargs, where="while tfshard traces it")
            else:
                variable = next_creator(**kwargs)
            for made in (variable, *self.strategy.experimental_local_results(variable)):
                self._made[id(made)] = made
            if retrace and not (in_a_shard or eagerly):
                # The new variable may take the place of one a function captured
                # (a rebuilt model): the functions retrace to read it.
                with Replicas._lock:
                    Replicas.generation += 1
            return variable

        other = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
        if other is not None and other is not self.strategy:
            raise ArgumentError(_nested_scopes(self.devices, other))
        with self.strategy.scope(), tf.variable_creator_scope(record):
            yield

    def _made_in_a_shard(
        self, kwargs: dict[str, Any], where: str = "while a shard is traced"
    ) -> Any:
        """A variable the function creates while a shard (or any trace) is traced, made
        with its copies.

        A variable made at the function's first call (a Keras model built
        there, ``if self.v is None: self.v = tf.Variable(...)``) is made as
        `MirroredStrategy.run` makes it: once, with a copy per device, each
        holding the same initial value. The copies are made outside the trace
        (`tf.init_scope`), eagerly, in the cross-replica context; the shard
        then reads its device's copy, as it reads a variable made before the
        call, and the shards traced after it find the variable made.
        `tf.function`'s rule still holds: a variable made at every trace is
        refused at the next one. No function retraces for it: none can have
        read a variable that did not exist before this trace.

        Raises:
          ArgumentError: its initial value is computed in the trace and is not
            a constant (``tf.random.normal(...)``, a function of the input).
        """
        initial = kwargs.get("initial_value")
        if tf.is_tensor(initial) and tf.is_symbolic_tensor(initial):
            value = tf.get_static_value(initial)  # tf.ones([4, 2]), tf.constant(...)
            if value is None:
                raise ArgumentError(_made_from_the_trace(kwargs.get("name"), initial, where))
            kwargs = {**kwargs, "initial_value": value}
        _making.here = True
        try:
            with tf.init_scope(), self.strategy.scope():
                return tf.Variable(**kwargs)
        finally:
            _making.here = False

    def shard(self, device: str) -> contextlib.AbstractContextManager[Any]:
        """Traces a shard on `device` so that replicated variables read its copy."""
        return _ShardContext(self.strategy, self._replica_of[pinning.resolve_device(device)])

    def holds(self, variable: Any) -> bool:
        """Whether `variable` (a tf or Keras variable) has its copies here."""
        if not isinstance(variable, tf.Variable):
            variable = getattr(variable, "value", variable)  # a Keras variable's tf.Variable
        return self._made.get(id(variable)) is variable

    def __repr__(self) -> str:
        return f"<tfshard.Replicas on {', '.join(self.devices)}>"


def _known_outside(kwargs: dict[str, Any]) -> bool:
    """Whether a variable's initial value can be had outside the trace making it:
    a callable (a Keras initializer), a Python or NumPy value, or a constant."""
    initial = kwargs.get("initial_value")
    if not (tf.is_tensor(initial) and tf.is_symbolic_tensor(initial)):
        return True
    return tf.get_static_value(initial) is not None


# Set while `Replicas._made_in_a_shard` makes a variable: the scopes it is made in
# record nothing of their own.
_making = threading.local()


def _made_from_the_trace(name: Any, initial: Any, where: str) -> str:
    what = f"the variable {name!r}" if name else "a variable"
    return (
        f"replicas: the function creates {what} {where}, from a value "
        f"computed in the trace ({initial.op.type} {initial.name}), and its copies must be "
        "made outside the trace, from a value known there. Pass the initial value as a "
        "callable (tf.Variable(lambda: tf.random.normal(...))), as Keras layers do, or "
        "create the variable before the call, inside `with f.replicas():` (build a Keras "
        "model there: model.build(input_shape), or call it once)"
    )


def _nested_scopes(devices: Sequence[str], other: Any) -> str:
    """Why a replicas scope cannot be entered inside the scope of `other`, a strategy."""
    held = getattr(other.extended, "worker_devices", ())
    where = f" (on {', '.join(held)})" if held else ""
    return (
        f"replicas: a scope for {', '.join(devices)} is entered inside another "
        f"distribution scope{where}: a variable gets its copies on one set of devices, "
        "so these scopes do not nest (nor do MirroredStrategy's). Leave the other scope "
        "first, or make the functions that share the variables on the same devices"
    )


def _key(devices: Sequence[str]) -> tuple[str, ...]:
    return tuple(sorted(set(devices)))


class _Strategy(tf.distribute.MirroredStrategy):
    """The strategy that holds the copies; inside a shard it counts one replica in sync.

    A Keras loss object and `tf.nn.compute_average_loss` divide by
    ``num_replicas_in_sync``, expecting the replicas' gradients to be summed.
    tfshard sums nothing implicitly (a shard's outputs reach the user's own
    reduction), so inside a shard the count is 1 and a loss gives what it
    gives on one device. Outside shards it is MirroredStrategy's own count.
    """

    @property
    def num_replicas_in_sync(self) -> int:
        if isinstance(tf.distribute.get_replica_context(), _ShardContext):
            return 1
        return super().num_replicas_in_sync


class _ShardContext(tf.distribute.ReplicaContext):
    """The replica context a shard is traced in: reads resolve to its device's copy.

    Replicas of MirroredStrategy synchronise through ``merge_call`` (an
    all-reduce, an aggregated assignment). Shards are traced one after another
    and never meet, so a merge would see one shard's value only: refuse it.
    """

    def __init__(self, strategy: tf.distribute.Strategy, replica: int) -> None:
        super().__init__(strategy, replica_id_in_sync_group=replica)
        self._replica = replica

    def across_replicas(self, fn: Any) -> Any:
        """``fn()`` in the strategy's cross-replica context, where copies are made.

        ``ReplicaContext.merge_call`` as it runs for a single replica: it
        synchronises nothing (no other shard takes part), it only leaves the
        replica context while `fn` runs.
        """
        # Not converted by autograph (merge_call converts it otherwise): an error
        # raised in it reaches the user as raised, without autograph's frames.
        return super().merge_call(tf.autograph.experimental.do_not_convert(lambda _: fn()))

    def merge_call(self, merge_fn: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise ArgumentError(
            f"the function synchronises replicas inside the shard of replica {self._replica} "
            "(an all-reduce or an aggregated assignment, from "
            f"{getattr(merge_fn, '__qualname__', merge_fn)}): each device's copy would take "
            "only its own shard's update. Return the update instead (gradients with "
            "reduce='mean') and apply it outside the function, e.g. with "
            "tfshard.replicas.apply_gradients(optimizer, zip(grads, variables)); call Keras "
            "layers with training=False inside"
        )


# ------------------------------------------------------------------ weights in


def replicate(model: Any, replicas: Replicas) -> Any:
    """A copy of a Keras model whose variables are replicated, with the same weights.

    A `Sequential` or functional model is copied as Keras saves and loads it
    (``model.save`` to a temporary ``.keras`` file, ``keras.saving.load_model``
    inside the scope, uncompiled): its config, its weights and what a layer
    keeps outside them (an adapted `StringLookup`'s or `TextVectorization`'s
    vocabulary, nested in custom layers too), as ``load_model`` would restore
    it on another machine, with the model's ``jit_compile`` (as Keras
    resolves it for `model`; `tfshard.parallelize` runs a model with it). A
    single layer is copied from its config and weights, and its assets.

    Args:
      model: a built Keras `Sequential` or functional model (one Keras can
        save; custom layers registered with
        ``keras.saving.register_keras_serializable``), or a layer with a config.
      replicas: where the copies go.

    Raises:
      ArgumentError: `model` cannot be copied; build it inside the scope.
    """
    keras = keras_of(model)
    if keras is None:
        raise ArgumentError(
            f"replicate({type(model).__name__}): only Keras models and layers can be copied "
            "into replicas; build it inside `with f.replicas():` instead"
        )
    try:
        if isinstance(model, keras.Model):
            clone = _saved_and_loaded(keras, model, replicas)
        else:
            with replicas.scope():
                clone = type(model).from_config(model.get_config())
                built = model.get_build_config()  # the shapes it was built for
                if built:
                    clone.build_from_config(built)
    except (NotImplementedError, TypeError, ValueError, AttributeError, KeyError) as error:
        raise ArgumentError(
            f"replicate({type(model).__name__}): it cannot be copied ({error}); build it "
            "inside `with f.replicas():` and load its weights there "
            "(model.load_weights(path) or model.set_weights(old.get_weights()))"
        ) from error
    if len(clone.weights) != len(model.weights):
        raise ArgumentError(
            f"replicate({type(model).__name__}): the copy has {len(clone.weights)} weights "
            f"and the model {len(model.weights)}; build the model (call it once) first"
        )
    if isinstance(model, keras.Model) and hasattr(model, "jit_compile"):
        # Its own, as Keras resolves it for the model (a model made in a strategy's
        # scope resolves "auto" to False, and the copy is made in one).
        clone.jit_compile = model.jit_compile
    if not isinstance(model, keras.Model):
        clone.set_weights(model.get_weights())  # cross-replica: writes every copy
        with replicas.scope():
            _copy_assets(model, clone)
    return clone


def _saved_and_loaded(keras: Any, model: Any, replicas: Replicas) -> Any:
    """`model` saved as a ``.keras`` file and loaded back inside the replicas' scope."""
    with tempfile.TemporaryDirectory(prefix="tfshard_replicate_") as folder:
        path = os.path.join(folder, "model.keras")
        model.save(path)
        with replicas.scope():
            return keras.saving.load_model(path, compile=False)


def _copy_assets(layer: Any, clone: Any) -> None:
    """Copies what Keras keeps of a layer (and its sublayers) outside its weights.

    A lookup layer's vocabulary (StringLookup, IntegerLookup, TextVectorization
    after ``adapt``) is not a weight and not in its config, so a copy from its
    config has an empty table ("Table not initialized" at its first call);
    Keras's own saving moves it through the layer's ``save_assets`` /
    ``load_assets`` (and its TF-IDF weights through ``save_own_variables``),
    and so does this.
    """
    for original, copy in zip([layer, *_all_layers(layer)], [clone, *_all_layers(clone)]):
        if not (hasattr(original, "save_assets") and hasattr(copy, "load_assets")):
            continue
        # In the order Keras loads a saved model: variables first (TF-IDF weights),
        # then assets (the vocabulary, whose table is built with those weights).
        store: dict[str, Any] = {}
        original.save_own_variables(store)
        if store:
            copy.load_own_variables(store)
        with tempfile.TemporaryDirectory(prefix="tfshard_assets_") as folder:
            original.save_assets(folder)
            copy.load_assets(folder)


def _all_layers(model: Any) -> list[Any]:
    """A model's layers, each followed by its own (nested models'), in a stable order."""
    layers = []
    for layer in getattr(model, "layers", ()):
        layers.append(layer)
        layers.extend(_all_layers(layer))
    return layers


@tf.autograph.experimental.do_not_convert  # plain Python that builds ops, in a tf.function too
def apply_gradients(optimizer: Any, grads_and_vars: Iterable[tuple[Any, Any]]) -> Any:
    """``optimizer.apply_gradients(grads_and_vars)``, for replicated variables too.

    A Keras optimizer updates replicated variables only inside
    `tf.distribute.Strategy.run`, where it sums the gradients of all replicas.
    Here replica 0 contributes the gradients and the others zeros, so the sum
    is exactly the gradients given, and each copy takes the same update: the
    weights equal those of one-device training. Plain variables go straight
    to ``optimizer.apply_gradients``. Works eagerly and inside a `tf.function`.

    The optimizer belongs with the variables it updates: create it inside
    ``with f.replicas():`` for replicated ones (its state, Adam's moments
    among it, then has a copy per device as the variables do), outside for
    plain ones, as `MirroredStrategy` asks of its optimizers.

    Returns:
      The optimizer's iteration counter, as Keras's ``apply_gradients`` returns it.

    Raises:
      ArgumentError: ``optimizer`` has no ``apply_gradients``, ``grads_and_vars``
        is not an iterable of (gradient, variable) pairs (a pair given as
        (variable, gradient) included), a gradient's shape is not its
        variable's, some of the variables are replicated and some are not,
        they are replicated on different sets of devices, or the optimizer
        was created on the other side of ``with f.replicas():``.
    """
    pairs = _checked_pairs(optimizer, grads_and_vars)
    owner = _owner([v for _, v in pairs])
    _check_optimizer(optimizer, owner)
    if owner is None:
        return optimizer.apply_gradients(pairs)
    grads = tuple(g for g, _ in pairs)
    variables = [v for _, v in pairs]
    if getattr(optimizer, "built", None) is False:
        # Its state (momentum, Adam's moments), made once, eagerly and in the scope,
        # as Keras's fit builds it: made inside the step's tf.function, it would trace
        # the step twice (once to make them), and it makes no function retrace.
        with tf.init_scope(), owner.scope(retrace=False):
            optimizer.build(variables)

    def step(*grads: Any) -> None:
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        optimizer.apply_gradients(zip([_only_first(g, first) for g in grads], variables))

    def run(*grads: Any) -> None:
        with owner.scope():
            owner.strategy.run(step, args=grads)

    if tf.executing_eagerly():
        # MirroredStrategy.run is slow eagerly (it says so): one tf.function per
        # optimizer and list of variables, traced once.
        with _lock:
            per_optimizer = _compiled.setdefault(optimizer, {})
            key = tuple(id(v) for v in variables)
            if key not in per_optimizer:
                per_optimizer[key] = tf.function(run, autograph=False)
            run = per_optimizer[key]
    run(*grads)
    return optimizer.iterations


_PAIRS = "pass (gradient, variable) pairs, as zip(grads, model.trainable_variables) makes them"


def _checked_pairs(optimizer: Any, grads_and_vars: Any) -> list[tuple[Any, Any]]:
    """The pairs as a list, once each is a (gradient, variable) of one shape."""
    if not callable(getattr(optimizer, "apply_gradients", None)):
        raise ArgumentError(
            f"apply_gradients: optimizer={optimizer!r} of type {type(optimizer).__name__} has "
            "no apply_gradients; pass a Keras optimizer such as keras.optimizers.SGD(0.1)"
        )
    if isinstance(grads_and_vars, str | bytes | dict) or not _iterable(grads_and_vars):
        raise ArgumentError(
            f"apply_gradients: grads_and_vars={grads_and_vars!r} of type "
            f"{type(grads_and_vars).__name__}; {_PAIRS}"
        )
    pairs = []
    for index, pair in enumerate(grads_and_vars):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ArgumentError(f"apply_gradients: pair {index} is {_short(pair)}; {_PAIRS}")
        gradient, variable = pair
        if not _is_variable(variable):
            if _is_variable(gradient):
                raise ArgumentError(
                    f"apply_gradients: pair {index} is (variable {_name(gradient)}, gradient), "
                    f"swapped; {_PAIRS}"
                )
            raise ArgumentError(
                f"apply_gradients: pair {index} holds {_short(variable)} where its variable "
                f"goes; {_PAIRS}"
            )
        shape = getattr(gradient, "shape", None)
        if shape is not None and not tf.TensorShape(shape).is_compatible_with(variable.shape):
            raise ArgumentError(
                f"apply_gradients: pair {index} gives variable {_name(variable)} of shape "
                f"{tf.TensorShape(variable.shape)} a gradient of shape {tf.TensorShape(shape)}; "
                f"each gradient has its variable's shape: {_PAIRS}, in the same order"
            )
        pairs.append((gradient, variable))
    return pairs


def _short(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"a {type(value).__name__} of shape {tf.TensorShape(value.shape)}"
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:80] + "..."


def _is_variable(value: Any) -> bool:
    # A Keras 3 variable is no tf.Variable, but it assigns as one does.
    return isinstance(value, tf.Variable) or (
        callable(getattr(value, "assign_sub", None)) and hasattr(value, "shape")
    )


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _check_optimizer(optimizer: Any, owner: Replicas | None) -> None:
    """Refuses an optimizer made on the other side of ``replicas()`` from its variables.

    A Keras optimizer makes its iteration counter when it is created, in the
    strategy of that moment, and its slots later in the same one: made
    outside, it fails on replicated variables deep inside TensorFlow ("Mixing
    different tf.distribute.Strategy objects"); made inside, on plain ones.
    """
    counter = getattr(optimizer, "iterations", None)
    if counter is None:
        return  # not a Keras optimizer: nothing to tell its home by
    home = next((r for r in list(Replicas._registry.values()) if r.holds(counter)), None)
    if home is owner:
        return
    name = type(optimizer).__name__
    if owner is None:
        raise ArgumentError(
            f"apply_gradients: the {name} optimizer was created inside `with f.replicas():` "
            f"(on {', '.join(home.devices)}) but its variables are not replicated; create "
            "the optimizer where its variables were created, outside that scope. A Keras "
            "model made inside the scope but first built by a call outside it has plain "
            "variables: build it inside (model.build(input_shape), or its first call)"
        )
    raise ArgumentError(
        f"apply_gradients: the variables are replicated (on {', '.join(owner.devices)}) "
        f"but the {name} optimizer was created outside `with f.replicas():`; create it "
        "there with the model (`with f.replicas(): model = build(); optimizer = "
        f"keras.optimizers.{name}(...)`), so its state has a copy on each device as the "
        "variables do. A model compiled before f.replicate(model) keeps its optimizer "
        "outside: make a new one inside the scope for the copy (or compile the copy there)"
    )


_lock = threading.Lock()
_compiled: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], Any]] = weakref.WeakKeyDictionary()


def _only_first(grad: Any, first: tf.Tensor) -> Any:
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        values = tf.where(first, grad.values, tf.zeros_like(grad.values))
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    return tf.where(first, grad, tf.zeros_like(grad))


def _name(variable: Any) -> str:
    return str(getattr(variable, "path", None) or getattr(variable, "name", "?"))


def _owner(variables: Sequence[Any]) -> Replicas | None:
    owners = {id(r): r for r in list(Replicas._registry.values()) for v in variables if r.holds(v)}
    if len(owners) > 1:
        raise ArgumentError(
            "apply_gradients: the variables belong to replicas of different devices; "
            "apply each set's gradients separately"
        )
    owner = next(iter(owners.values()), None)
    if owner is not None:
        plain = [_name(v) for v in variables if not owner.holds(v)]
        if plain:
            raise ArgumentError(
                f"apply_gradients: {', '.join(plain[:3])} are not replicated but other "
                f"variables are (on {', '.join(owner.devices)}); create every variable the "
                "optimizer updates inside `with f.replicas():`"
            )
    return owner


# ------------------------------------------------------------------ weights read


@dataclasses.dataclass(frozen=True)
class VariableRead:
    """One variable a shard reads on every call.

    Attributes:
      name: the variable's name.
      device: where the copy it reads lives.
      nbytes: its size in bytes (0 when its shape is not fully known).
      remote: whether that is another device than the shard's.
    """

    name: str
    device: str
    nbytes: int
    remote: bool


def variable_reads(concrete: Any, devices: Sequence[str]) -> list[list[VariableRead]]:
    """For each shard of a traced call, the variables it reads and from where.

    A shard reads a variable when one of its ops (``tfshard_shard_k/...``)
    takes the variable's handle: a read, or a nested function or loop that
    reads it. TensorFlow places a variable's read where the variable is, so
    one on another device crosses to the shard, whole, on every call.
    """
    reads: list[dict[str, VariableRead]] = [{} for _ in devices]
    for k, op, variable in shard_accesses(concrete):
        if op.type not in _NO_READ and variable.name not in reads[k]:
            reads[k][variable.name] = _read(variable, devices[k])
    return [list(r.values()) for r in reads]


def check_compiled_reads(concrete: Any, devices: Sequence[str], name: str) -> None:
    """XLA cannot read a variable on another device: say so before the call fails."""
    for k, reads in enumerate(variable_reads(concrete, devices)):
        remote = [r for r in reads if r.remote]
        if remote:
            names = ", ".join(f"{r.name} (on {r.device})" for r in remote[:3])
            more = f" and {len(remote) - 3} more" if len(remote) > 3 else ""
            raise ArgumentError(
                f"{name}: with jit_compile=True, shard {k} on {devices[k]} "
                f"reads {names}{more}, and XLA cannot read a variable on another "
                "device. Create the variables inside `with f.replicas():` (a copy per "
                "device; f.replicate(model) copies a built Keras model), or pass "
                "jit_compile=False"
            )


def check_no_writes(concrete: Any, replicas: Replicas, name: str) -> None:
    """Refuses a traced call whose shards assign replicated variables.

    A shard that assigns a replicated variable (a Keras layer called with
    ``training=True`` updating its moving averages, ``v.assign_add``) writes
    only the copy on its device: the copies would drift apart silently. The
    writes are found in the graph, so the message names the variables
    written, not merely ones the writing op was given.
    """
    written: dict[int, list[str]] = {}
    for k, variable in shard_writes(concrete):
        # A variable synchronised on read (a Keras metric's total and count) is
        # written copy by copy by design, as under MirroredStrategy, and read as
        # the aggregate of its copies (their sum): each shard adds its own rows.
        on_read = variable.synchronization == tf.VariableSynchronization.ON_READ
        if not on_read and replicas.holds(variable):
            names = written.setdefault(k, [])
            if variable.name not in names:
                names.append(variable.name)
    if not written:
        return
    k, names = min(written.items())
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    what = "variable" if len(names) == 1 else "variables"
    raise ArgumentError(
        f"{name}: shard {k} assigns the replicated {what} {', '.join(names[:3])}{more}: "
        "a shard would change only the copy on its own device, and the copies would drift "
        "apart. Call Keras layers with training=False inside the function (BatchNormalization "
        "with training=True writes its moving mean and variance), or return the update "
        "(e.g. gradients with reduce='mean') and apply it outside, where every copy takes "
        "it: tfshard.replicas.apply_gradients(optimizer, zip(grads, vars))"
    )


def _read(variable: tf.Variable, shard_device: str) -> VariableRead:
    shape = variable.shape
    nbytes = shape.num_elements() * variable.dtype.size if shape.is_fully_defined() else 0
    remote = not pinning.same_device(variable.device, shard_device)
    return VariableRead(variable.name, pinning.resolve_device(variable.device), nbytes, remote)


def remote_bytes(reads: Sequence[VariableRead]) -> int:
    """The bytes of the variables in `reads` that live on another device."""
    return sum(r.nbytes for r in reads if r.remote)
