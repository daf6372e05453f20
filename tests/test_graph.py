"""_graph: a traced call's shards, and the variables they write, argument by argument.

The reference is the function as written: which variable it assigns, through how many
functions (a cond's branch, a loop's body, a nested tf.function) the handle travels.
"""

import numpy as np
import tensorflow as tf

from tfshard import _graph
from tfshard.errors import SHARD_SCOPE


def _traced(body, *specs):
    return tf.function(body, autograph=False).get_concrete_function(*specs)


def test_writes_are_named_by_the_variable_written_not_every_variable_the_op_takes():
    read, written = tf.Variable([1.0, 2.0]), tf.Variable(0.0)

    def body(x):
        with tf.name_scope(f"{SHARD_SCOPE}0"):
            # One cond takes both handles; only `written` is assigned inside it.
            def branch():
                written.assign_add(tf.reduce_sum(x * read))
                return tf.identity(read)

            out = tf.cond(tf.reduce_sum(x) > 0, branch, lambda: tf.identity(read))
        with tf.name_scope(f"{SHARD_SCOPE}1"):
            inner = tf.function(lambda v: read.assign(v * 2.0), autograph=False)
            inner(x)  # a nested function writes `read`
        return out

    concrete = _traced(body, tf.TensorSpec([2], tf.float32))
    writes = {(k, v.name) for k, v in _graph.shard_writes(concrete)}
    assert writes == {(0, written.name), (1, read.name)}
    reads = {(k, v.name) for k, _, v in _graph.shard_accesses(concrete)}
    assert (0, read.name) in reads and (0, written.name) in reads


def test_writes_resources_sees_a_generator_and_an_assignment_in_nested_functions():
    generator = tf.random.Generator.from_seed(1)
    v = tf.Variable(1.0)
    spec = tf.TensorSpec([], tf.float32)
    assert not _graph.writes_resources(_traced(lambda x: x * v, spec))
    assert _graph.writes_resources(_traced(lambda x: x + generator.normal([]), spec))
    nested = tf.function(lambda x: v.assign_add(x), autograph=False)
    assert _graph.writes_resources(_traced(lambda x: nested(x) * 2.0, spec))


def test_written_arguments_follow_identities_back_to_the_argument():
    v = tf.Variable(np.zeros(2, np.float32))

    def body(x):
        tf.cond(x[0] > 0, lambda: v.assign(x).read_value(), lambda: tf.identity(x))
        return x

    concrete = _traced(body, tf.TensorSpec([2], tf.float32))
    library = {f.signature.name: f for f in concrete.graph.as_graph_def().library.function}
    branch = next(name for name in library if "true" in name)
    # The true branch's arguments: the handle comes in as one of them, and is written.
    assert _graph.written_arguments(library, branch, {})
