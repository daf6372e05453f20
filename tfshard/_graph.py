"""Reading a traced call's graph: each shard's ops, and the resources they read and write.

A call's graph names shard k's ops ``tfshard_shard_k/...`` (`errors.SHARD_SCOPE`).
What a shard does to a variable is read from the ops that take its handle, and,
for ops that call functions (a conditional, a loop, a shared or compiled trace),
from inside those functions, argument by argument (`written_arguments`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import tensorflow as tf

from tfshard.errors import shard_in

# Op types (prefixes) that write a variable they are given.
VARIABLE_WRITES = (
    "Assign",
    "ResourceApply",
    "ResourceScatter",
    "ResourceSparseApply",
    "ResourceStridedSliceAssign",
)
# ... and every resource they are given: variables, and a tf.random.Generator's state.
WRITES = (
    *VARIABLE_WRITES,
    "RngReadAndSkip",
    "RngSkip",
    "StatefulRandomBinomial",
    "StatefulStandardNormal",
    "StatefulTruncatedNormal",
    "StatefulUniform",
)
# Calling ops whose first input is not an argument of the functions they call
# (a conditional's predicate, a case's branch index).
_ARGUMENT_OFFSET = {"If": 1, "StatelessIf": 1, "Case": 1, "StatelessCase": 1}


def writes_resources(concrete: Any) -> bool:
    """Whether a traced function, or one it calls, writes a resource (`WRITES`)."""
    return any(node.op.startswith(WRITES) for node in _nodes(concrete))


def writes_variables(concrete: Any) -> bool:
    """Whether a traced function, or one it calls, writes a variable (`VARIABLE_WRITES`)."""
    return any(node.op.startswith(VARIABLE_WRITES) for node in _nodes(concrete))


def asserts(concrete: Any) -> bool:
    """Whether a traced function, or one it calls, holds an Assert (a tf.debugging.assert_*)."""
    return any(node.op == "Assert" for node in _nodes(concrete))


def _nodes(concrete: Any) -> list[Any]:
    """The nodes of a traced function and of every function in its library."""
    graph = concrete.graph.as_graph_def()
    return [*graph.node, *(n for f in graph.library.function for n in f.node_def)]


def shard_ops(concrete: Any) -> Iterator[tuple[int, Any]]:
    """``(k, op)`` for each op of shard k in a traced call."""
    for op in concrete.graph.get_operations():
        k = shard_in(op.name)
        if k is not None:
            yield k, op


def shard_accesses(concrete: Any) -> Iterator[tuple[int, Any, tf.Variable]]:
    """``(k, op, variable)`` for each op of shard k that takes a captured variable's handle."""
    captured = _captured_variables(concrete)
    for k, op in shard_ops(concrete):
        for tensor in op.inputs:
            variable = captured.get(tensor.name)
            if variable is not None:
                yield k, op, variable


def shard_writes(concrete: Any) -> Iterator[tuple[int, tf.Variable]]:
    """``(k, variable)`` for each captured variable an op of shard k writes.

    An op writes the variable whose handle is its first input (`WRITES`), or
    calls functions that write the arguments at some positions
    (`written_arguments`): those inputs' variables are the ones written.
    """
    captured = _captured_variables(concrete)
    library = {f.signature.name: f for f in concrete.graph.as_graph_def().library.function}
    memo: dict[str, frozenset[int]] = {}
    for k, op in shard_ops(concrete):
        if op.type.startswith(WRITES):
            positions: set[int] = {0}
        else:
            offset = _ARGUMENT_OFFSET.get(op.type, 0)
            positions = {
                offset + i
                for fn in _called(op.node_def)
                for i in written_arguments(library, fn, memo)
            }
        for position in sorted(positions):
            if position < len(op.inputs):
                variable = captured.get(op.inputs[position].name)
                if variable is not None:
                    yield k, variable


def written_arguments(
    library: dict[str, Any], fn: str, memo: dict[str, frozenset[int]]
) -> frozenset[int]:
    """The positions of the arguments that function `fn`, or one it calls, writes (memoised).

    A write's handle is followed back through the function's Identity ops to
    the argument it came from; a write of a handle made inside the function
    (its own variable) is no argument's.
    """
    if fn in memo:
        return memo[fn]
    memo[fn] = frozenset()  # a recursive call is not a write by itself
    function = library.get(fn)
    if function is None:
        return memo[fn]
    arguments = {arg.name: i for i, arg in enumerate(function.signature.input_arg)}
    nodes = {node.name: node for node in function.node_def}

    def argument_of(source: str) -> int | None:
        for _ in range(len(nodes) + 1):  # an Identity chain is at most every node
            name = source.split(":")[0]
            if name in arguments:
                return arguments[name]
            node = nodes.get(name)
            if node is None or node.op != "Identity" or not node.input:
                return None
            source = node.input[0]
        return None

    written: set[int] = set()
    for node in function.node_def:
        inputs = [i for i in node.input if not i.startswith("^")]
        if node.op.startswith(WRITES):
            handles = inputs[:1]
        else:
            offset = _ARGUMENT_OFFSET.get(node.op, 0)
            handles = [
                inputs[offset + i]
                for called in _called(node)
                for i in written_arguments(library, called, memo)
                if offset + i < len(inputs)
            ]
        written.update(a for a in map(argument_of, handles) if a is not None)
    memo[fn] = frozenset(written)
    return memo[fn]


def _captured_variables(concrete: Any) -> dict[str, tf.Variable]:
    """The variables a traced graph captures, by the name of their handle inside it."""
    handles = {id(v.handle): v for v in concrete.graph.variables}
    return {
        internal.name: handles[id(external)]
        for external, internal in concrete.graph.captures
        if id(external) in handles
    }


def _called(node: Any) -> list[str]:
    """The functions a node calls (PartitionedCall's f, If's branches, While's body)."""
    names = []
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return names
