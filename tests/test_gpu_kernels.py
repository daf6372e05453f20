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
and reduced:

- the plan (row counts, sizes, offsets, the empty-shard predicate, asserts)
  runs on the output device's host CPU, so no call waits for a GPU to learn
  its sizes;
- shard k's ops, in nested functions too (the empty-shard cond's branches,
  tf.map_fn's while loop), run on GPU k, the gather on the output device;
- every op placed on a GPU has a GPU kernel for its dtypes (or a DEFAULT
  kernel: function calls and If, whose predicate TF reads from host memory);
- the ops that move the user's values (split, slice, bitcast, cast, gather,
  TensorList) hold those values in device memory; TF registers some GPU
  kernels with every argument in host memory (int32 ones: TF keeps int32 on
  a GPU device in host memory, as shape arithmetic), which would copy the
  data to the host and back.

Known gaps are listed in `GAPS` with their reason; the test fails when the
registry changes in either direction, so a new TF release is read again.

Strings are not here: TF has no GPU kernel that holds a string, so a string
batch is split and gathered by the CPU ops of the devices' host whatever the
device names say (its values never live on a GPU). XLA-compiled shard bodies
(jit_compile=True) are checked for placement only: XLA compiles them with its
own kernels, which this registry does not list.
"""

from __future__ import annotations

import collections
import re
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

# The kernel registry is not public API: get_registered_kernels_for_op is what
# TensorFlow's own tests use to ask it, and only a test may depend on it.
from tensorflow.core.framework.attr_value_pb2 import AttrValue
from tensorflow.python.framework import kernels

from tfshard import _arguments, _kinds, _options, collect
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


def _gpu_kernel(op_type: str, attrs: dict[str, Any]) -> Any:
    """The GPU (or DEFAULT) kernel TF would pick for a node, or None."""
    for kernel in kernels.get_registered_kernels_for_op(op_type).kernel:
        if kernel.device_type not in ("GPU", "DEFAULT"):
            continue
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

Node = collections.namedtuple("Node", "name op device attrs")


def _nodes(graph_def: Any) -> list[Node]:
    """Every node of a graph and of the functions it calls, with its effective device.

    A node in a function body with no device runs where its call op runs; its
    name is prefixed with the call's, so a shard's nested ops keep its scope.
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    out: list[Node] = []

    def visit(node_defs: Any, prefix: str, inherited: str) -> None:
        for node in node_defs:
            device = node.device or inherited
            name = f"{prefix}{node.name}"
            out.append(Node(name, node.op, device, dict(node.attr)))
            called = [v.func.name for v in node.attr.values() if v.HasField("func")]
            if node.op in library:
                called.append(node.op)
            for fn in called:
                if fn in library:
                    visit(library[fn].node_def, f"{name}/", device)

    visit(graph_def.node, "", "")
    return out


def _engine(per_sample: bool, reduce: str | None, fn: Any, jit: bool = False) -> Any:
    options = _options.Options(
        per_sample=per_sample, reduce=collect.reduction(reduce), jit_compile=jit
    )
    return Engine(fn, options, name="f", devices=GPUS, output=GPUS[0])


def _traced(dtype: str, per_sample: bool, mode: str, jit: bool = False) -> list[Node]:
    """The nodes of a call on two GPUs whose [N, 3] batch already lives on GPU:0."""
    x = np.zeros([4, 3], tf.as_dtype(dtype).as_numpy_dtype)
    fn = tf.identity
    call = _arguments.Arguments(fn, (), "f").classify((x,), {})
    # As if x were on GPU:0: the split then runs there (an eager GPU tensor's device);
    # its rows unknown, as in a user's tf.function: the graph with the empty-shard guard,
    # every op a call can run (a batch with a row for every device runs a subset).
    leaves = tuple(leaf._replace(device=GPUS[0]) for leaf in call.key.leaves)
    call = call._replace(key=call.key._replace(leaves=leaves), rows=None)
    engine = _engine(per_sample, None if mode == "gather" else mode, fn, jit)
    return _nodes(engine.trace(call).graph.as_graph_def())


def _type(device: str) -> str:
    return tf.DeviceSpec.from_string(device).device_type if device else ""


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
    pytest.param(
        dtype, per_sample, mode, id=f"{dtype}-{mode}-{'sample' if per_sample else 'shard'}"
    )
    for dtype in DTYPES
    for mode in MODES
    for per_sample in (True, False)
    if _reducible(dtype, mode)
]


@pytest.mark.parametrize("dtype, per_sample, mode", CASES)
def test_every_op_stays_where_it_is_placed_on_gpus(dtype, per_sample, mode):
    nodes = _traced(dtype, per_sample, mode)
    shard = {f"{SHARD_SCOPE}{k}/": device for k, device in enumerate(GPUS)}
    missing, in_host_memory = set(), set()
    for node in nodes:
        scope = next((s for s in shard if node.name.startswith(s)), None)
        # (b) each shard's ops on its own GPU, nested ones included.
        if scope is not None:
            assert node.device == shard[scope], node
        elif node.name.startswith("tfshard_collect/"):
            # The gather on the output device; a reduction's partials on their shards.
            assert node.device == GPUS[0] or (mode != "gather" and node.device in GPUS), node
        # (a) the plan and every check on the host CPU.
        elif node.op in ("Assert", "Range", "FloorDiv", "FloorMod", "Cumsum", "Unpack", "Less"):
            assert node.device == HOST, node
        if node.op in ("Greater", "Sub", "AddV2") and scope is None and "collect" not in node.name:
            assert node.device == HOST, node
        if _type(node.device) != "GPU" or node.op in ("Placeholder", "NoOp", "_Arg", "_Retval"):
            continue
        # (c) a GPU kernel for this op and its dtypes, its values in device memory.
        kernel = _gpu_kernel(node.op, node.attrs)
        if kernel is None:
            missing.add(f"{node.op}({', '.join(_dtypes(node.attrs))})")
            continue
        held = DATA_ARGS.get(node.op, set()) & set(kernel.host_memory_arg)
        if held and scope is None:  # inside a shard, int32 ops are pfor's shape arithmetic
            in_host_memory.add(f"{node.op}({', '.join(_dtypes(node.attrs))}): {sorted(held)}")
    assert (missing | in_host_memory) == GAPS.get((mode, dtype), set())


def test_the_plan_runs_on_the_host_and_the_split_where_the_batch_is():
    nodes = _traced("float32", True, "gather")
    top = [n for n in nodes if "/" not in n.name or n.name.startswith(("split", "tfshard_rows"))]
    by_op = collections.defaultdict(set)
    for node in top:
        by_op[node.op].add(node.device)
    # The row count: a Shape where the batch is (its output is in host memory),
    # everything computed from it on the host.
    assert by_op["Shape"] == {GPUS[0]}
    assert by_op["SplitV"] == {GPUS[0]}
    for op in ("FloorDiv", "FloorMod", "Range", "Unpack"):
        assert by_op[op] == {HOST}, op
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
    for dtype, carrier in _kinds.CARRIERS.items():
        for src, dst in ((dtype, carrier), (carrier, dtype)):
            attrs = {
                "SrcT": AttrValue(type=src.as_datatype_enum),
                "DstT": AttrValue(type=dst.as_datatype_enum),
            }
            assert _gpu_kernel("Cast", attrs) is not None, (src, dst)
