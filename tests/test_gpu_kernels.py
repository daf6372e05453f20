"""The GPU graph without a GPU: where every op of a call is placed, and whether it has a kernel.

Why building against GPU names proves the GPU case: `Engine.trace` only builds a
graph; nothing checks that the devices exist until it runs, so the engine
traced for ``/device:GPU:0`` and ``/device:GPU:1`` is, op for op, the graph a
machine with two GPUs would run. On that machine TensorFlow's placer keeps
each op on the device its node names when a kernel for that device type and
the node's type attributes is registered, and otherwise moves it elsewhere
without a word (soft placement): for a GPU op, to the CPU, copying its
inputs there and back. The registry that decides this ships in every
TensorFlow wheel, GPU kernels included, so this machine reads the very table
the placer would read there. A node placed on a GPU whose op and dtypes have
a GPU kernel therefore stays on that GPU; one without would fall back.

Checked for every dtype tfshard splits, per sample and whole shard, gathered
and reduced, in every form a call's graph takes (`FORMS`: shards guarded or
bare, rows open or exact, in chunks of max_rows, sample by sample, a
dataset's traced loop with bare or guarded shards, and static weights planned
where the batch is or, of a large total, on the host), all dtypes in one graph:

- the plan (row counts, sizes, offsets, the empty-shard predicate, asserts)
  runs where the batch is (GPU:0 for a call, the host for a stream), in int32
  ops whose every argument TF keeps in host memory there, so no call waits for
  a GPU to learn its sizes, copies them to or from one, or sends them to the
  host; every size and count outside the shards is such an op
  (`_shape_math`);
- the split cuts the batch where it is (GPU:0 for a call; the host, where the
  iterator leaves it, for a stream, each piece then crossing once to its
  shard's GPU): every op that its values reach before a shard takes them runs
  there, the host runs no op that cuts values (`tests/test_gpu.py` reads a
  run's split by this), and the split's ops take their sizes and bounds from
  the host and their values from their own device, so nothing is copied on
  the way (`_split_problems`);
- shard k's ops, in nested functions too (the empty-shard cond's branches,
  tf.map_fn's while loop, a chunk loop), run on GPU k, the gather on the
  output device;
- every op placed on a GPU has a GPU kernel for its dtypes (or a DEFAULT
  kernel: function calls and If, whose predicate TF reads from host memory);
- the ops that move the user's values (split, slice, bitcast, cast, gather,
  TensorList) hold those values in device memory; TF registers some GPU
  kernels with every argument in host memory (int32 ones: TF keeps int32 on
  a GPU device in host memory, as shape arithmetic), which would copy the
  data to the host and back.

A node with no device of its own runs where the function that holds it is
called: the graph's top level on the output device (the engine calls it
there, and a stream its loop). A failure lists every problem of its graph.

Known gaps are listed in `GAPS` with their reason; the test fails when the
registry changes in either direction, so a new TF release is read again.

Strings are not here: TF has no GPU kernel that holds a string, so a string
batch is split and gathered by the CPU ops of the devices' host whatever the
device names say (its values never live on a GPU), nor is an assert's
message. XLA-compiled shard bodies (jit_compile=True) are checked for
placement only: XLA compiles them with its own kernels, which this registry
does not list.
"""

from __future__ import annotations

import collections
import functools
import re
from typing import Any, NamedTuple

import numpy as np
import pytest
import tensorflow as tf

# The kernel registry and the op definitions are not public API:
# get_registered_kernels_for_op and op_def_registry are what TensorFlow's own
# tests use to ask them, and only a test may depend on them.
from tensorflow.core.framework.attr_value_pb2 import AttrValue
from tensorflow.python.framework import kernels, op_def_registry

import tfshard
from tfshard import _arguments, _kinds, _options, collect, datasets
from tfshard._engine import Engine
from tfshard.errors import SHARD_SCOPE

# Three: the shards off the output device (GPU:1 and GPU:2) call one shared
# trace, whose nodes are checked with the device of each call.
GPUS = ("/device:GPU:0", "/device:GPU:1", "/device:GPU:2")
HOST = "/device:CPU:0"
DTYPES = (
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "int8", "int16",
    "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
)  # fmt: skip
# Arguments that hold the user's values, for the ops that move them: these must
# not be in host memory on a GPU.
DATA_ARGS = {
    "SplitV": {"value", "output"},
    "StridedSlice": {"input", "output"},
    "Bitcast": {"input", "output"},
    "Cast": {"x", "y"},
    "GatherV2": {"params", "output"},
    "TensorListSetItem": {"item"},
    "TensorListConcatV2": {"tensor"},
    "TensorListFromTensor": {"tensor"},
    "Sum": {"input", "output"},
    "Max": {"input", "output"},
    "Min": {"input", "output"},
    "Pack": {"values", "output"},
    "Mul": {"x", "y", "z"},
    "SelectV2": {"t", "e", "output"},
}
# (mode, dtype) -> ops that would leave a GPU, and why tfshard leaves them.
GAPS: dict[tuple[str, str], set[str]] = {}


# ------------------------------------------------------------- the registry


@functools.cache
def _gpu_kernels(op_type: str) -> tuple[Any, ...]:
    """The GPU and DEFAULT kernels registered for an op (asking TF costs ~0.3 ms)."""
    listed = kernels.get_registered_kernels_for_op(op_type).kernel
    return tuple(k for k in listed if k.device_type in ("GPU", "DEFAULT"))


def _gpu_kernel(op_type: str, attrs: dict[str, Any]) -> Any:
    """The GPU (or DEFAULT) kernel TF would pick for a node, or None."""
    for kernel in _gpu_kernels(op_type):
        fits = True
        for constraint in kernel.constraint:
            allowed = set(constraint.allowed_values.list.type)
            value = attrs.get(constraint.name)
            if value is None:
                continue
            got = set(value.list.type) if value.HasField("list") else {value.type}
            fits = fits and got <= allowed
        if fits:
            return kernel
    return None


def _dtypes(attrs: dict[str, Any]) -> list[str]:
    names = []
    for value in attrs.values():
        if value.HasField("type"):
            names.append(tf.as_dtype(value.type).name)
        elif value.HasField("list"):
            names += [tf.as_dtype(t).name for t in value.list.type]
    return names


# ---------------------------------------------------------------- the graph

Node = collections.namedtuple("Node", "name op device attrs inputs")


def _nodes(graph_def: Any, device: str = GPUS[0]) -> list[Node]:
    """Every node of a graph and of the functions it calls, with its effective device.

    A node with no device runs where its function is called: the graph's top
    level on `device` (where the engine calls a call's graph, and a stream's
    loop), a function body's node where its call op runs; one colocated with
    another node runs beside it (unknown, "", beside a function's argument,
    such as a stream's iterator, which lives on the host). A nested node's name
    is prefixed with its call's, so a shard's nested ops keep its scope.
    `inputs` are the full names of the nodes whose outputs a node reads, in
    order (None for a function's argument), control inputs left out.
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    out: list[Node] = []

    def visit(node_defs: Any, prefix: str, inherited: str) -> None:
        local = {node.name: node for node in node_defs}
        for node in node_defs:
            placed = node.device or inherited
            classes = node.attr["_class"].list.s if "_class" in node.attr else []
            colocated = [c.decode()[len("loc:@") :] for c in classes]
            if colocated and not node.device:
                # Placed with what it reads (an iterator's ops, an optional's): that
                # node's device, or unknown ("") where it is the function's argument.
                beside = local.get(colocated[0])
                placed = (beside.device or inherited) if beside is not None else ""
            name = f"{prefix}{node.name}"
            sources = [i.split(":")[0] for i in node.input if not i.startswith("^")]
            inputs = [f"{prefix}{s}" if s in local else None for s in sources]
            out.append(Node(name, node.op, placed, dict(node.attr), inputs))
            called = [v.func.name for v in node.attr.values() if v.HasField("func")]
            if node.op in library:
                called.append(node.op)
            for fn in called:
                if fn in library:
                    visit(library[fn].node_def, f"{name}/", placed)

    visit(graph_def.node, "", device)
    return out


def _engine(
    per_sample: bool,
    reduce: str | None,
    fn: Any,
    jit: bool = False,
    max_rows: int | None = None,
    weights: tuple[int, ...] | None = None,
) -> Any:
    options = _options.Options(
        per_sample=per_sample,
        reduce=collect.reduction(reduce),
        jit_compile=jit,
        max_rows=max_rows,
        weights=weights,
    )
    return Engine(fn, options, name="f", devices=GPUS, output=GPUS[0])


def _same(x: Any) -> Any:
    return tf.nest.map_structure(tf.identity, x)


def _checked(x: Any) -> Any:
    """`_same`, asserting on each sample: such a function runs sample by sample
    (tf.map_fn, whose TensorLists hold its rows and outputs), not vectorised."""
    checks = [tf.debugging.assert_equal(tf.shape(t)[-1], 3) for t in tf.nest.flatten(x)]
    with tf.control_dependencies(checks):
        return _same(x)


def _batch(dtypes: tuple[str, ...], rows: int) -> dict[str, np.ndarray]:
    """One [rows, 3] array of each dtype: one call, one graph, every dtype's ops."""
    return {d: np.zeros([rows, 3], tf.as_dtype(d).as_numpy_dtype) for d in dtypes}


def _call(dtypes: tuple[str, ...], rows: int | None) -> Any:
    """A call on [N, 3] batches that already live on GPU:0 (rows None: unknown)."""
    call = _arguments.Arguments(_same, (), "f").classify((_batch(dtypes, rows or 4),), {})
    # As if they were on GPU:0: the split then runs there (an eager GPU tensor's device).
    leaves = tuple(leaf._replace(device=GPUS[0]) for leaf in call.key.leaves)
    return call._replace(key=call.key._replace(leaves=leaves), rows=rows)


def _loop(engine: Any, dtypes: tuple[str, ...]) -> Any:
    """The traced loop of a stream of [N, 3] batches, traced as `f(dataset)` traces it,
    and not run (nothing here can run on a GPU)."""
    dataset = tf.data.Dataset.from_tensor_slices(_batch(dtypes, 8)).batch(4)
    arguments = _arguments.Arguments(_same, (), "f")
    return datasets.Runner(engine).traced_loop(arguments, dataset, (), {})


class _Graph(NamedTuple):
    """A traced loop's graph, read as a concrete function's (`.graph`)."""

    graph: tf.Graph


# Every graph a call of a function (or a stream of them) can run, by the case that
# traces it, on three GPUs.
FORMS = {
    # Rows unknown (in a user's tf.function): every shard guarded against having none.
    "guarded": lambda engine, dtypes: engine.trace(_call(dtypes, None)),
    # Every device has rows: the shard on the output device runs bare. Per sample, the
    # second batch size's graph (rows open); the first's is "exact".
    "bare": lambda engine, dtypes: [engine.trace(_call(dtypes, n)) for n in (5, 4)][-1],
    # A per-sample function's first batch size: rows, sizes and bounds static; shards
    # of 2, 1 and 1 rows (pfor stacks a shard of one row as it stacks a constant).
    "exact": lambda engine, dtypes: engine.trace(_call(dtypes, 4)),
    # max_rows=1: each shard's rows in a loop of chunks on its device.
    "chunked": lambda engine, dtypes: engine.trace(_call(dtypes, None)),
    # A function that runs sample by sample (`_checked`: tf.map_fn), rows unknown.
    "sequential": lambda engine, dtypes: engine.trace(_call(dtypes, None)),
    # A dataset's traced loop: split on the host, pieces fed to the devices ahead.
    "stream": lambda engine, dtypes: _Graph(_loop(engine, dtypes).graph(False)),
    # Its twin for a batch that leaves a device no rows.
    "stream_guarded": lambda engine, dtypes: _Graph(_loop(engine, dtypes).graph(True)),
    # Static weights (`WEIGHTS`), rows unknown: planned in int32 where the batch is.
    "weighted": lambda engine, dtypes: engine.trace(_call(dtypes, None)),
    # Static weights of a total too large for an exact int32 plan: planned in int64 on
    # the host, the int32 sizes sent to the split.
    "weighted_on_host": lambda engine, dtypes: engine.trace(_call(dtypes, None)),
}
WEIGHTS = {"weighted": (3, 1, 2), "weighted_on_host": (46_341, 1, 2)}


def _traced(
    dtypes: str | tuple[str, ...],
    per_sample: bool,
    mode: str,
    jit: bool = False,
    form: str = "guarded",
) -> list[Node]:
    """The nodes of a call on three GPUs whose [N, 3] batches (one of each of
    `dtypes`) live on GPU:0, in `form`.

    The "guarded" form holds every op a call can run (a batch with a row for
    every device runs a subset); the others are what a call of their case runs.
    """
    dtypes = (dtypes,) if isinstance(dtypes, str) else dtypes
    engine = _engine(
        per_sample,
        None if mode == "gather" else mode,
        _checked if form == "sequential" else _same,
        jit,
        max_rows=1 if form == "chunked" else None,
        weights=WEIGHTS.get(form),
    )
    graph = FORMS[form](engine, dtypes).graph
    # Each form is what its case traces: rows exact or open, shards guarded or bare.
    rows = None if form.startswith("stream") else graph.inputs[0].shape[0]
    assert (rows == 4) if form == "exact" else rows is None, (form, graph.inputs[0])
    nodes = _nodes(graph.as_graph_def())
    conds = {n.name.split("/")[0] for n in nodes if n.op in ("StatelessIf", "If")}
    if form in ("guarded", "chunked", "sequential", "weighted", "weighted_on_host"):
        assert {f"{SHARD_SCOPE}{k}" for k in range(len(GPUS))} <= conds, conds
    elif form in ("bare", "exact"):
        assert f"{SHARD_SCOPE}0" not in conds, conds
    loops = {n.name for n in nodes if n.op in ("While", "StatelessWhile") and SHARD_SCOPE in n.name}
    mapped = any("per_sample" in name for name in loops)
    assert mapped == (form == "sequential" and per_sample), (form, loops)
    assert any("per_sample" not in name for name in loops) == (form == "chunked"), (form, loops)
    return nodes


def _type(device: str) -> str:
    return tf.DeviceSpec.from_string(device).device_type if device else ""


def _scope(name: str) -> tuple[str, int | None]:
    """Which part of a call a node belongs to: ("shard", k), ("feed", k) for the copy
    of shard k's rows in a stream's feed (None: the feed's plan and split),
    ("collect", None), or ("", None) for the plan and split of a call and a loop's
    own ops. The first such scope on its path decides (a shard's nested ops keep it).
    """
    parts = name.split("/")
    for i, part in enumerate(parts):
        if part.startswith(SHARD_SCOPE) and part[len(SHARD_SCOPE) :].isdigit():
            return "shard", int(part[len(SHARD_SCOPE) :])
        if part == "tfshard_collect":
            return "collect", None
        if part == "tfshard_feed":
            after = parts[i + 1] if i + 1 < len(parts) else ""
            shard = after[len("shard_") :] if after.startswith("shard_") else ""
            return "feed", int(shard) if shard.isdigit() else None
    return "", None


# The plan's ops and checks, outside every shard: where the batch is.
_PLAN_OPS = {
    "Assert", "FloorDiv", "FloorMod", "Unpack", "Less", "Greater", "Sub", "AddV2", "Sum", "Mul",
    "Maximum", "Minimum", "Equal", "Max", "Abs", "Pack",
}  # fmt: skip
# Ops whose output is not the values of their input (what tf.shape and friends read).
_METADATA = {"Shape", "ShapeN", "Size", "Rank"}
# Ops that cut or reinterpret values: on the host, only the plan's read of the batch size.
_CUTS = {"SplitV", "Split", "StridedSlice", "Slice", "Bitcast", "GatherV2"}


def _feeding_the_shards(nodes: list[Node]) -> set[str]:
    """The top-level nodes whose values the shards read (the plan, the split, the batch)."""
    by_name = {n.name: n for n in nodes}
    todo = [n.name for n in nodes if n.name.split("/")[0].startswith(SHARD_SCOPE)]
    seen: set[str] = set()
    while todo:
        for source in by_name[todo.pop()].inputs:
            if source is not None and source not in seen:
                seen.add(source)
                todo.append(source)
    return seen


def _shape_math(nodes: list[Node]) -> set[str]:
    """The nodes that compute from shapes only (sizes, counts, bounds, predicates): a
    Shape-like op or a constant, and every node all of whose inputs are such nodes."""
    by_name = {n.name: n for n in nodes}
    known: dict[str, bool] = {}

    def of_shapes(name: str) -> bool:
        if name in known:
            return known[name]
        known[name] = False  # a cycle (a loop's back edge) is not shape math
        node = by_name[name]
        if node.op in _METADATA or node.op == "Const":
            known[name] = True
        elif node.inputs and all(s is not None for s in node.inputs):
            known[name] = all(of_shapes(s) for s in node.inputs)
        return known[name]

    return {n.name for n in nodes if of_shapes(n.name)}


def _int_math(node: Node) -> bool:
    """Whether `node` computes int32 or bool values (every output), from int32 or bool
    inputs: a size, count, bound or predicate (not a Shape, whose input it never reads)."""
    if node.op in _METADATA or not set(_dtypes(node.attrs)) <= {"int32", "bool"}:
        return False
    outputs = op_def_registry.get(node.op).output_arg
    for arg in outputs:
        enum = arg.type or (node.attrs[arg.type_attr].type if arg.type_attr else None)
        if enum is None or tf.as_dtype(enum) not in (tf.int32, tf.bool):
            return False
    return bool(outputs)


def _args_on_device(node: Node) -> set[str]:
    """The arguments and outputs `node` holds in device memory on a GPU."""
    op_def = op_def_registry.get(node.op)
    kernel = _gpu_kernel(node.op, node.attrs)
    args = {a.name for a in [*op_def.input_arg, *op_def.output_arg]}
    return args if kernel is None else args - set(kernel.host_memory_arg)


def _in_host_memory(node: Node, arg: str) -> bool:
    """Whether `node`, on a GPU, holds its argument or output `arg` in host memory."""
    kernel = _gpu_kernel(node.op, node.attrs)
    return kernel is not None and arg in kernel.host_memory_arg


def _op(node: Node) -> str:
    return f"{node.op}({', '.join(_dtypes(node.attrs))})"


def _split_problems(nodes: list[Node], dtypes: tuple[str, ...], stream: bool) -> set[str]:
    """What keeps the split from cutting each batch where it is, with its sizes and
    bounds from the host and nothing copied on the way (none: an empty set).

    The split is every node the batch's values reach (not through Shape) before a
    shard, the gather or a function call takes them: in a call, from the graph's
    inputs (on GPU:0); in a stream, from each batch the feed takes from the iterator
    (on the host), up to the copy of each shard's piece to its GPU.
    """
    by_name = {n.name: n for n in nodes}
    readers = collections.defaultdict(list)
    for node in nodes:
        for source in node.inputs:
            if source is not None:
                readers[source].append(node)
    enums = {tf.as_dtype(d).as_datatype_enum for d in dtypes}
    if stream:
        where = HOST
        batches = [n for n in nodes if n.name.endswith("tfshard_feed/cond")]
    else:
        where = GPUS[0]
        batches = [
            n for n in nodes if n.op == "Placeholder" and "/" not in n.name
            and n.attrs["dtype"].type in enums
        ]  # fmt: skip
    # A stream's feed: once before its loop, once in it.
    assert len(batches) == (2 if stream else len(dtypes)), batches
    problems, split, todo = set(), set(), [n.name for n in batches]
    while todo:
        for reader in readers[todo.pop()]:
            kind, shard = _scope(reader.name)
            if reader.name in split or reader.op in _METADATA or kind in ("shard", "collect"):
                continue
            if kind == "feed" and shard is not None:
                # The copy of shard k's piece to GPU k: from the host, once.
                for made in (by_name[s] for s in reader.inputs if s):
                    if made.device != HOST:
                        problems.add(f"shard {shard}'s piece crosses from {made.device}")
                continue
            if "Call" in reader.op or reader.op in ("If", "StatelessIf", "While", "StatelessWhile"):
                continue  # a shard's function call, its guard, a loop: not the split
            split.add(reader.name)
            todo.append(reader.name)
    assert split, "no split found"
    for node in (by_name[name] for name in split):
        # (a) Where the batch is.
        if node.device != where:
            problems.add(f"{_op(node)} of the split runs on {node.device}, not {where}")
        if _type(node.device) != "GPU":
            continue
        # (b) Its host-memory arguments (sizes, bounds, strides) made on the host or
        # held there; its values from its own device: nothing copied on the way.
        op_def = op_def_registry.get(node.op)
        args = [a.name for a in op_def.input_arg]
        if len(args) != len(node.inputs):
            continue  # a list argument: not one of the split's ops
        for arg, source in zip(args, node.inputs):
            made = by_name.get(source) if source else None
            if made is None:
                continue
            if _in_host_memory(node, arg):
                outputs = [a.name for a in op_def_registry.get(made.op).output_arg]
                if made.device != HOST and not any(_in_host_memory(made, o) for o in outputs):
                    problems.add(
                        f"{_op(node)}'s {arg} is made by {_op(made)} on {made.device}, "
                        "in device memory: it crosses to the host"
                    )
            elif made.device != node.device:
                problems.add(f"{_op(node)}'s {arg} crosses from {made.device}")
    # (c) On the host, nothing cuts values but the plan's reads of the batch size and
    # of its sizes (a StridedSlice of Shape, or of sizes): what tests/test_gpu.py takes
    # for the split.
    sizes = _shape_math(nodes)
    for node in nodes:
        if stream or node.device != HOST or node.op not in _CUTS or _scope(node.name)[0]:
            continue
        if node.name in sizes:
            continue
        if node.op != "StridedSlice" or by_name[node.inputs[0]].op not in _METADATA:
            source = by_name[node.inputs[0]].op
            problems.add(f"the host runs {_op(node)} of {source}: it cuts values, not the batch")
    return problems


# ------------------------------------------------------------------- tests

MODES = ("gather", "sum", "mean", "max", "min")


def _reducible(dtype: str, mode: str) -> bool:
    dtype = tf.as_dtype(dtype)
    if mode == "gather":
        return True
    if dtype == tf.bool:
        return False
    return not (dtype.is_complex and mode in ("max", "min"))


CASES = [
    pytest.param(per_sample, mode, form, id=f"{form}-{mode}-{'sample' if per_sample else 'shard'}")
    for form in FORMS
    for mode in MODES
    for per_sample in (True, False)
    # A whole-shard function's graph never has exact rows (`Engine._exact_rows`), nor a
    # map of its samples.
    if per_sample or form not in ("exact", "sequential")
]


@pytest.mark.parametrize("per_sample, mode, form", CASES)
def test_every_op_stays_where_it_is_placed_on_gpus(per_sample, mode, form):
    """Every dtype of `DTYPES` that `mode` takes, one batch each, in one call's graph."""
    dtypes = tuple(d for d in DTYPES if _reducible(d, mode))
    stream = form.startswith("stream")
    nodes = _traced(dtypes, per_sample, mode, form=form)
    misplaced = _split_problems(nodes, dtypes, stream)
    plan = _feeding_the_shards(nodes)
    assert stream or any(n.op in _PLAN_OPS for n in nodes if n.name in plan), "no plan found"
    sizes = _shape_math(nodes)
    missing, in_host_memory = set(), set()
    for node in nodes:
        kind, k = _scope(node.name)
        want = None
        # (b) each shard's ops on its own GPU, nested ones included.
        if kind == "shard":
            want = {GPUS[k]}
        elif kind == "collect":
            # The gather on the output device; a reduction's partials on their shards.
            want = {GPUS[0]} if mode == "gather" else set(GPUS)
        elif kind == "feed":
            # A stream's plan and split on the host, each shard's piece copied to its GPU.
            want = {HOST if k is None else GPUS[k]}
        # (a) the plan and every check where the batch is (a stream's: in its feed,
        # on the host); what only finishes the result (a mean's count of rows) is the
        # output device's.
        elif not stream and node.op in _PLAN_OPS and (node.name in plan or node.op == "Assert"):
            # (Large weights: the plan in int64 on the host, and its sizes used there;
            # the outputs' row check still where they land.)
            on_host = form == "weighted_on_host" and node.op != "Assert"
            want = {HOST if on_host else GPUS[0]}
        # (d) every size, count and predicate outside the shards (int32 and bool shape
        # math) holds all its arguments in host memory: nothing of it copies to or
        # from a GPU, nor waits for one.
        # (A stream's loop is its own: its plan and split run on the host.)
        plan_math = not stream and kind != "shard" and node.name in sizes
        if plan_math and _int_math(node) and _type(node.device) == "GPU":
            on_device = _args_on_device(node)
            if on_device:
                misplaced.add(f"{kind or 'plan'} {_op(node)} holds {sorted(on_device)} on a GPU")
        if want is not None and node.device and node.device not in want:
            misplaced.add(f"{kind or 'plan'} {_op(node)} on {node.device}, not {sorted(want)}")
        if _type(node.device) != "GPU" or node.op in ("Placeholder", "NoOp", "_Arg", "_Retval"):
            continue
        if "string" in _dtypes(node.attrs):
            continue  # an assert's message: strings live on the host (see above)
        # (c) a GPU kernel for this op and its dtypes, its values in device memory.
        kernel = _gpu_kernel(node.op, node.attrs)
        if kernel is None:
            missing.add(_op(node))
            continue
        # Sizes and counts are int32 in host memory by design ((d); a stream's batch
        # takes its plan's sizes as arguments): no user's values pass through an op
        # of int32 alone outside a shard (an int32 batch is split as float32).
        counts = node.name in sizes or set(_dtypes(node.attrs)) == {"int32"}
        held = set() if counts else DATA_ARGS.get(node.op, set()) & set(kernel.host_memory_arg)
        # Inside a shard, int32 ops are pfor's shape arithmetic; a loop's own are its
        # counters (the batch's index into the stream's TensorLists).
        counter = stream and not kind and _dtypes(node.attrs) == ["int32"]
        if held and kind != "shard" and not counter:
            in_host_memory.add(f"{_op(node)}: {sorted(held)}")
    gaps = set().union(*(GAPS.get((mode, d), set()) for d in dtypes))
    assert (sorted(misplaced), sorted(missing | in_host_memory)) == ([], sorted(gaps))


def test_the_plan_and_the_split_run_where_the_batch_is():
    nodes = _traced("float32", True, "gather")
    top = [n for n in nodes if "/" not in n.name or n.name.startswith(("split", "tfshard_rows"))]
    by_op = collections.defaultdict(set)
    for node in top:
        by_op[node.op].add(node.device)
    # The row count: a Shape where the batch is (its int32 output is in host memory),
    # everything computed from it there in int32, every argument in host memory:
    # nothing on the host's CPU, nothing copied to or from the GPU.
    assert by_op["Shape"] == {GPUS[0]}
    assert by_op["SplitV"] == {GPUS[0]}
    plan = [n for n in top if n.op in ("Sub", "FloorDiv", "FloorMod", "AddV2", "Unpack")]
    assert {"FloorDiv", "AddV2"} <= {n.op for n in plan}  # sizes (a guarded shard counts its own)
    for node in plan:
        assert node.device == GPUS[0] and _dtypes(node.attrs) == ["int32"], node
        assert not _args_on_device(node), node
    assert HOST not in {n.device for n in nodes}
    # The empty-shard guard: each shard takes its rows as an int32 scalar (a
    # function on a GPU takes one in host memory), its GPU's Greater reads and
    # writes int32 in host memory, and If (and the Switch it lowers to) reads
    # the predicate there: no device copy.
    # Shard 0 (on the output GPU) traces in place, the others call the shared trace.
    guard = re.compile(rf"{SHARD_SCOPE}\d+/((Stateful)?PartitionedCall/)?Greater")
    guards = [n for n in nodes if guard.fullmatch(n.name)]
    assert [n.device for n in guards] == list(GPUS)
    assert [n.name.count("PartitionedCall/") for n in guards] == [0, 1, 1]
    assert {tf.as_dtype(n.attrs["T"].type) for n in guards} == {tf.int32}
    int32 = {"T": AttrValue(type=tf.int32.as_datatype_enum)}
    assert {"x", "y", "z"} <= set(_gpu_kernel("Greater", int32).host_memory_arg)
    conds = [n for n in nodes if n.op in ("StatelessIf", "If")]
    assert [n.device for n in conds] == list(GPUS)
    assert "cond" in _gpu_kernel("StatelessIf", {}).host_memory_arg
    assert (
        "pred"
        in _gpu_kernel("Switch", {"T": AttrValue(type=tf.float32.as_datatype_enum)}).host_memory_arg
    )


@pytest.mark.parametrize("dtype", ["float32", "uint8", "int64"])
def test_jit_compiled_shards_are_placed_on_their_gpus(dtype):
    nodes = _traced(dtype, True, "gather", jit=True)
    compiled = [n for n in nodes if "_XlaMustCompile" in n.attrs]
    assert [n.device for n in compiled] == list(GPUS)
    assert all(n.attrs["_XlaMustCompile"].b for n in compiled)
    for node in nodes:
        for k, device in enumerate(GPUS):
            if node.name.startswith(f"{SHARD_SCOPE}{k}/"):
                assert node.device == device, node


def test_the_routing_tables_match_the_registry():
    """tfshard's dtype tables say what the installed TF's kernels say, no more, no less."""

    def device_memory(op, dtype, attr, data):
        kernel = _gpu_kernel(op, {attr: AttrValue(type=dtype.as_datatype_enum)})
        return kernel is not None and not (set(kernel.host_memory_arg) & data)

    every = [tf.as_dtype(d) for d in DTYPES]
    split = {d for d in every if device_memory("SplitV", d, "T", DATA_ARGS["SplitV"])}
    assert split == _kinds.SPLIT_DTYPES
    sliced = {d for d in every if device_memory("StridedSlice", d, "T", DATA_ARGS["StridedSlice"])}
    assert sliced >= _kinds.SLICED_DTYPES
    for op, attr in (
        ("TensorListSetItem", "element_dtype"),
        ("TensorListConcatV2", "element_dtype"),
        ("TensorListFromTensor", "element_dtype"),
        ("GatherV2", "Tparams"),
    ):
        covered = {d for d in every if device_memory(op, d, attr, DATA_ARGS[op])}
        assert covered == set(every) - set(_kinds.CARRIERS), op
        assert set(_kinds.CARRIERS.values()) <= covered, op
    # pfor stacks an output the same for every sample with Tile: a map's outputs leave
    # it as their carriers where Tile lacks a GPU kernel (int16 has one; it is carried
    # for the TensorLists above).
    tiled = {d for d in every if _gpu_kernel("Tile", {"T": AttrValue(type=d.as_datatype_enum)})}
    assert set(every) - tiled <= set(_kinds.CARRIERS)
    assert set(_kinds.CARRIERS.values()) <= tiled
    for dtype, carrier in _kinds.CARRIERS.items():
        for src, dst in ((dtype, carrier), (carrier, dtype)):
            attrs = {
                "SrcT": AttrValue(type=src.as_datatype_enum),
                "DstT": AttrValue(type=dst.as_datatype_enum),
            }
            assert _gpu_kernel("Cast", attrs) is not None, (src, dst)


@pytest.mark.parametrize("sequential", [False, True], ids=["vectorized", "map_fn"])
@pytest.mark.parametrize("dtype", sorted(d.name for d in _kinds.CARRIERS))
def test_outputs_that_leave_a_map_as_carriers_come_back_exact(dtype, sequential):
    """A per-sample function's outputs of a `_kinds.CARRIERS` dtype leave its map as
    the carrier (pfor's Tile and tf.map_fn's TensorLists have no GPU kernels for them)
    and come back bit for bit: extremes, a constant, shards of one static row."""
    info = np.iinfo(dtype)
    x = np.array(
        [[info.min, info.max], [0, 1], [info.max - 1, 7], [3, info.min + 1], [5, 6]], dtype
    )
    same = np.array([info.max, info.min], dtype)

    def fn(sample):
        if sequential:  # an assert: sample by sample (tf.map_fn)
            tf.debugging.assert_equal(tf.size(sample), 2)
        return {"row": sample, "same": tf.constant(same)}

    f = tfshard.parallelize(fn, devices=["/device:CPU:1", "/device:CPU:2", "/device:CPU:3"])
    for rows in (4, 5):  # the first size exactly (shards of 2, 1 and 1 rows), then any
        out = f(x[:rows])
        assert out["row"].dtype == out["same"].dtype == tf.as_dtype(dtype)
        np.testing.assert_array_equal(out["row"].numpy(), x[:rows])
        np.testing.assert_array_equal(out["same"].numpy(), np.tile(same, [rows, 1]))
