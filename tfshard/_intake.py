"""Taking a dataset in: what the user asked of a stream, checked once, as one record.

Each dataset element is one global batch, split across the devices exactly as
a tensor argument would be. Elements are passed to the function the way
`tf.data.Dataset.map` passes them: a tuple element is spread over the
positional parameters, anything else is the first argument; a Keras model
takes ``x`` of ``(x, y[, sample_weight])`` elements, as ``Model.predict`` does.

`take` reads the dataset as the call asked (`Asked`: ``batch_size=``,
``batched=``, ``progress=``, checked before anything else), checks it against
the function and returns an `Intake`: the global batches the function takes,
and how each becomes a call. The stream rooms (`tfshard.datasets`) run it;
nothing here runs the function.
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple, TextIO

import tensorflow as tf

from tfshard import _autograph, _kinds, _stream, _trees, collect
from tfshard._arguments import Arguments, Call, check_flag, integer
from tfshard.errors import ArgumentError, fields_differ


class Asked(NamedTuple):
    """tfshard's keywords of a call on a dataset: the one record of them (`checked`).

    Attributes:
      batch_size: batch a dataset of single samples into global batches of this
        many (the last may be smaller); None: its elements are batches.
      batched: whether elements are batches already; None to tell from the
        element spec (`prepare`).
      progress: True for progress lines on stderr, False for none, or a stream
        to write them to.
    """

    batch_size: int | None = None
    batched: bool | None = None
    progress: bool | TextIO = False

    def checked(self) -> Asked:
        """Itself, once each keyword is of its kind; else ArgumentError naming it."""
        _stream.check_progress(self.progress)
        check_flag(self.batched, "batched", "", none="tell from the element spec")
        size = self.batch_size
        if size is not None and (integer(size) is None or size < 1):
            raise ArgumentError(
                f"batch_size={size!r}: the number of samples per global batch, an int >= 1"
            )
        return self._replace(
            batch_size=None if size is None else integer(size),
            batched=None if self.batched is None else bool(self.batched),
        )


# Keywords that belong to tfshard, not to the function, in a call on a dataset.
DATASET_OPTIONS = Asked._fields


class Intake(NamedTuple):
    """One stream as the user asked for it, checked: built once by `take`.

    Attributes:
      name: the parallelized function's name.
      arguments: how its arguments are sorted into a call.
      batches: the global batches as the function takes them (a Keras model's
        ``x``, batched if asked), checked, prefetching.
      args: further positional arguments, passed with every batch.
      kwargs: further keyword arguments, passed with every batch.
      asked: tfshard's keywords, checked.
    """

    name: str
    arguments: Arguments
    batches: tf.data.Dataset
    args: tuple
    kwargs: dict
    asked: Asked

    def call(self, element: Any) -> Call:
        """The call of one batch (an element of `batches`, or its stand-in).

        Raises:
          ArgumentError: as a call on the element's fields and the further
            arguments would; fields whose rows differ name the dataset's fix
            (`tfshard.errors.fields_differ`).
        """
        fields = split_element(element)

        def rows_differ(differ: str, name: str, first: str) -> ArgumentError | None:
            names = self.arguments.names(len(fields), ())  # the fields' parameters
            return fields_differ(self.name, differ) if {name, first} <= {*names} else None

        return self.arguments.classify((*fields, *self.args), self.kwargs, rows_differ)

    def empty(self) -> Call:
        """The call of a batch of zero rows: what a dataset with no elements gives
        (outputs of zero rows, their unknown dimensions 0)."""
        return self.call(zeros(self.batches.element_spec))

    def meter(self, *, done_batches: int = 0, done_rows: int = 0) -> _stream.Progress | None:
        """The progress report ``progress=`` asks for over all of `batches` (None: none);
        `done_batches` and `done_rows` were done before this run (a resumed write)."""
        return _stream.meter(
            self.name,
            self.batches,
            self.asked.progress,
            done_batches=done_batches,
            done_rows=done_rows,
        )

    def refuse_infinite(self, call: str, never: str, fix: str) -> None:
        """Raises ArgumentError where the dataset repeats forever: `call` `never` ends
        (``"the write would never end"``), and `fix` says what to do instead."""
        if int(self.batches.cardinality()) == tf.data.INFINITE_CARDINALITY:
            raise ArgumentError(f"{call}: the dataset is infinite (it repeats), so {never}; {fix}")


def take(
    arguments: Arguments,
    fn: Any,
    dataset: tf.data.Dataset,
    args: tuple,
    kwargs: dict,
    *,
    cpu_only: bool = False,
    **asked: Any,
) -> Intake:
    """The dataset taken in as the call asked (`asked`: `Asked`'s keywords, checked
    first): a Keras model's ``x`` (`model_inputs`), elements checked against the
    function's parameters, batched if asked (`prepare`, with `cpu_only`); `args`
    and `kwargs` go with every batch. Raises ArgumentError where a keyword, the
    dataset or its elements do not fit the function."""
    record = Asked(**asked).checked()
    dataset = model_inputs(dataset, fn)
    _check_specs(arguments, dataset, args, kwargs)
    batches = prepare(dataset, record.batch_size, record.batched, cpu_only=cpu_only)
    return Intake(arguments.name, arguments, batches, args, kwargs, record)


def refuse_stream_options(arguments: Arguments, kwargs: dict[str, Any]) -> None:
    """Raises ArgumentError for a stream's keyword in a call on tensors.

    ``batch_size=``, ``batched=`` and ``progress=`` belong to tfshard only when
    the first argument is a dataset; on tensors they would reach the user's
    function, which then reads as rejecting them. A function that takes the
    keyword itself (a parameter of that name, or ``**kwargs``) gets it.
    """
    params = arguments.signature.parameters if arguments.signature else {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in DATASET_OPTIONS:
        if key in kwargs and key not in params:
            name = arguments.name
            raise ArgumentError(
                f"{name}(..., {key}=...): {key}= is for a tf.data.Dataset, as in "
                f"{name}(dataset, {key}=...) or {name}.iterate(dataset, {key}=...); "
                f"with tensors or arrays the whole argument is one batch, so drop {key}= "
                f"(or call {name} on parts of it)"
            )


def _leaf_paths(spec: Any) -> list[tuple[str, Any]]:
    """(path, leaf) for each leaf of an element or its spec, e.g. ("element['image']", ...)."""
    leaves, key = _trees.flatten(spec, "element")
    return list(zip(_trees.paths("element", key), leaves))


def prepare(
    dataset: tf.data.Dataset,
    batch_size: int | None,
    batched: bool | None,
    *,
    cpu_only: bool = False,
) -> tf.data.Dataset:
    """Checks the dataset's elements and batches them if asked to.

    When every shard runs on this machine's CPU (`cpu_only`), tf.data's
    autotuning is turned off unless the dataset's options set it
    (``options.autotune.enabled``): its background tuning thread competes with
    the shards for the same cores. Parallel `map` calls and prefetching keep
    their default parallelism and buffers. On GPUs it stays on.

    Args:
      dataset: the input.
      batch_size: when given, the dataset holds one sample per element and is
        batched into global batches of this many samples (the last may be
        smaller).
      batched: whether elements are already batches; None to tell from the
        element spec (a batch dimension of unknown size, as `Dataset.batch`
        makes, means batched).
      cpu_only: the shards run on the host's own CPU cores.

    Returns:
      A dataset of global batches, prefetching.

    Raises:
      ArgumentError: the dataset's elements have no batch dimension, or it is
        ambiguous whether they have one, or `batch_size` is invalid.
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ArgumentError(
            f"expected a tf.data.Dataset, got {type(dataset).__name__}; for tensors and "
            "arrays call the function itself, f(x)"
        )
    for where, spec in _leaf_paths(dataset.element_spec):
        if not _kinds.splittable(spec):
            fix = (
                "flat_map each window into a batch first: ds.flat_map(lambda w: w.batch(n))"
                if isinstance(spec, tf.data.DatasetSpec)
                else "map it to a tensor first (e.g. tf.sparse.to_dense)"
            )
            raise ArgumentError(
                f"{where} is a {type(spec).__name__}; tfshard splits tensors and ragged "
                f"tensors along their first dimension: {fix}"
            )
    batch_size, batched, _ = Asked(batch_size, batched).checked()
    if batch_size is not None:
        if batched:
            raise ArgumentError(
                "batch_size= batches a dataset of single samples, but batched=True says its "
                "elements are batches already; pass one or the other"
            )
        leaves = _leaf_paths(dataset.element_spec)
        if all(isinstance(s, tf.TensorSpec) and _batch_of_unknown_size(s) for _, s in leaves):
            shapes = ", ".join(f"{where}: {spec.shape}" for where, spec in leaves)
            raise ArgumentError(
                f"batch_size={batch_size}: the dataset's elements are batches already ({shapes}, "
                "a first dimension of unknown size, as dataset.batch makes), and batching them "
                "again would make each batch one sample; pass batched=True instead of "
                "batch_size (or dataset.unbatch() first). Samples whose first dimension varies "
                "do not batch: pad them (dataset.padded_batch) or make them ragged "
                "(dataset.ragged_batch), then pass batched=True"
            )
        dataset = dataset.batch(batch_size)
    elif batched is False:
        raise ArgumentError(
            "batched=False: each element is one sample, so pass batch_size=N to let "
            "tfshard batch them"
        )
    elif batched is None:
        leaves = _leaf_paths(dataset.element_spec)
        for where, spec in leaves:
            if spec.shape.rank == 0:
                raise ArgumentError(
                    f"{where} is a scalar, so the dataset has no batch dimension; pass "
                    "batch_size=N to let tfshard batch it (or call dataset.batch(N) first)"
                )
        if not all(_batch_of_unknown_size(spec) for _, spec in leaves):
            shapes = ", ".join(f"{where}: {spec.shape}" for where, spec in leaves)
            raise ArgumentError(
                f"cannot tell whether the dataset's elements are batches ({shapes}); pass "
                "batch_size=N if each element is one sample, or batched=True if each is a "
                "batch (e.g. made by dataset.batch(N, drop_remainder=True))"
            )
    if cpu_only and dataset.options().autotune.enabled is None:
        options = tf.data.Options()
        options.autotune.enabled = False
        dataset = dataset.with_options(options)
    return dataset.prefetch(tf.data.AUTOTUNE)


def _batch_of_unknown_size(spec: tf.TypeSpec) -> bool:
    """Whether `spec` has a first dimension of unknown size (a batch, as `Dataset.batch` makes)."""
    return spec.shape.rank is not None and spec.shape.rank > 0 and spec.shape[0] is None


def model_inputs(dataset: tf.data.Dataset, fn: Any) -> tf.data.Dataset:
    """The dataset as `fn` takes it: for a Keras model, the ``x`` of each element.

    ``Model.predict`` (and ``fit``) take a dataset of ``x``, ``(x,)``, ``(x, y)``
    or ``(x, y, sample_weight)`` and feed the model ``x`` alone
    (``keras.utils.unpack_x_y_sample_weight``); a parallelized model does the
    same, so the dataset a user trains with runs through it. Any other
    function takes elements as `tf.data.Dataset.map` passes them
    (`split_element`).

    Raises:
      ArgumentError: a Keras model's element is a tuple of more than three.
    """
    keras = _autograph.keras_of(fn)
    spec = dataset.element_spec
    if keras is None or not isinstance(fn, keras.Model) or not isinstance(spec, tuple):
        return dataset
    name = getattr(fn, "name", type(fn).__name__)
    unpack = keras.utils.unpack_x_y_sample_weight
    try:
        x_spec = unpack(spec)[0]
    except ValueError:
        raise ArgumentError(
            f"{name}(dataset): a Keras model takes elements x, (x,), (x, y) or "
            "(x, y, sample_weight), as Model.predict does, but they are tuples of "
            f"{len(spec)}: put a model's several inputs in one tuple or dict, ((x1, x2), y)"
        ) from None
    inputs = getattr(fn, "inputs", None) or []
    if len(inputs) > 1 and len(_trees.flatten(x_spec)[0]) == 1 and len(spec) > 1:
        # Keras reads (x1, x2) as (x, y): the model's second input would be dropped.
        raise ArgumentError(
            f"{name}(dataset): the model takes {len(inputs)} inputs, but dataset elements "
            f"of {len(spec)} fields are read as (x, y[, sample_weight]), as Model.predict "
            "reads them, so x is the first field alone; give the inputs as one tuple or "
            "dict: ((x1, x2),) or ((x1, x2), y)"
        )
    # A one-tuple: x is the model's one argument, even a tuple of its several inputs.
    return dataset.map(lambda *element: (unpack(element)[0],))


def split_element(element: Any) -> tuple[Any, ...]:
    """An element as positional arguments: a tuple is spread over them, as `Dataset.map` does."""
    return element if type(element) is tuple else (element,)


def zeros(spec: Any) -> Any:
    """An element of zero rows that fits `spec`; unknown inner dimensions are 0."""
    return collect.empty(_trees.map_leaves(collect.stacked_spec, spec))


def _check_specs(arguments: Arguments, dataset: tf.data.Dataset, args: tuple, kwargs: dict) -> None:
    """Fails early when the element structure does not fit the function."""
    params = arguments.signature
    if params is None:
        return
    element = split_element(dataset.element_spec)
    try:
        params.bind(*element, *args, **kwargs)
    except TypeError as error:
        labelled = ""
        if len(element) in (2, 3):
            labelled = (
                "; for (x, y[, sample_weight]) elements of a Keras model, parallelize the "
                "model itself (it takes them as Model.predict does) or map the dataset to "
                "its inputs first, dataset.map(lambda x, *labels: x)"
            )
        raise ArgumentError(
            f"{arguments.name}: dataset elements are {dataset.element_spec}, passed as "
            f"{len(element)} positional argument(s) (a tuple element is spread over the "
            f"parameters, as Dataset.map does), which does not fit {arguments.name}{params}: "
            f"{error}{labelled}"
        ) from None
