"""errors: the error family, and reading TensorFlow's error text back.

Each parser is checked on messages TF really printed (captured from runs of
tfshard on 4 logical CPUs and on two workers on loopback, stack frames left
out) and on formats written by hand; the in-graph checks' messages come from
running the check itself. Where a parser shows through a public call, the call
is tested too.
"""

import concurrent.futures
import copy
import multiprocessing
import pickle
import re

import children
import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard import _plan, collect, errors
from tfshard.errors import ArgumentError, ShardError

CPUS = tuple(f"/device:CPU:{i}" for i in range(4))

# --------------------------------------------------------- failing_shard

_ASSERT = "assertion failed: [boom]"
_NAN = "log of a negative : Tensor had NaN values"
_NODE0 = "tfshard_shard_0/cond/loop_body/CheckNumerics/pfor/CheckNumerics"
_FAILING_SHARD_CASES = {
    "in place": (f"{_ASSERT}\n\t [[{{{{node tfshard_shard_0/cond/loop_body/Assert}}}}]]", 0),
    "shared trace": (
        f"{_ASSERT}\n\t [[{{{{node cond/loop_body/Assert}}}}]]\n"
        "\t [[tfshard_shard_2/StatefulPartitionedCall]]",
        2,
    ),
    "user function in the shared trace": (
        f"{_ASSERT}\n\t [[{{{{node inner/Assert}}}}]]\n\t [[cond/StatefulPartitionedCall]]\n"
        "\t [[tfshard_shard_3/StatefulPartitionedCall]]",
        3,
    ),
    "in place, other shards' receives after it": (
        f"{_ASSERT}\n\t [[{{{{node tfshard_shard_0/Assert}}}}]]\n"
        "\t [[tfshard_shard_2/StatefulPartitionedCall/_25]]\n"
        "\t [[tfshard_shard_0/cond/branch_executed/_7/_7]]",
        0,
    ),
    "shared trace, a receive between the node and its call": (
        f"{_ASSERT}\n\t [[{{{{node cond/Assert}}}}]]\n\t [[tfshard_shard_0/cond/pivot/_7/_7]]\n"
        "\t [[tfshard_shard_1/StatefulPartitionedCall]]",
        1,
    ),
    "the gather failed, a shard's receive after it": (
        "Tried to set a tensor\n\t [[{{node tfshard_collect/TensorListSetItem}}]]\n"
        "\t [[tfshard_shard_1/StatefulPartitionedCall/_15]]",
        None,
    ),
    "an aborted receive": (
        "RecvAsync is cancelled.\n\t [[{{node tfshard_shard_1/StatefulPartitionedCall/_15}}]]",
        None,
    ),
    "a node of no shard, then another report": (
        f"{_ASSERT}\n\t [[{{{{node cond/Assert}}}}]]\n\t [[other/StatefulPartitionedCall]]\n"
        "\t [[{{node tfshard_shard_1/Assert}}]]",
        None,
    ),
    "the cause after a cancelled root": (
        "2 root error(s) found.\n"
        "  (0) CANCELLED: RecvAsync is cancelled.\n"
        "\t [[{{node tfshard_shard_0/cond/Identity}}]]\n"
        f"  (1) INVALID_ARGUMENT: {_ASSERT}\n\t [[{{{{node cond/Assert}}}}]]\n"
        "\t [[tfshard_shard_3/StatefulPartitionedCall]]\n"
        "0 successful operations.\n0 derived errors ignored.",
        3,
    ),
    "the cause after an aborted root": (
        "2 root error(s) found.\n"
        "  (0) ABORTED: Step 4 was aborted\n\t [[{{node tfshard_shard_0/cond/Identity}}]]\n"
        f"  (1) INVALID_ARGUMENT: {_ASSERT}\n\t [[{{{{node tfshard_shard_2/Assert}}}}]]\n",
        2,
    ),
    "the cause after an aborted receive's root": (
        "2 root error(s) found.\n"
        f"  (0) INVALID_ARGUMENT: {_ASSERT}\n"
        "\t [[{{node tfshard_shard_1/StatefulPartitionedCall/_15}}]]\n"
        f"  (1) INVALID_ARGUMENT: {_ASSERT}\n\t [[{{{{node tfshard_shard_2/Assert}}}}]]\n",
        2,
    ),
    "a shard's root after a root of no shard": (
        "2 root error(s) found.\n"
        "  (0) INVALID_ARGUMENT: Tried to set a tensor\n"
        "\t [[{{node tfshard_collect/TensorListSetItem}}]]\n"
        f"  (1) INVALID_ARGUMENT: {_ASSERT}\n\t [[{{{{node tfshard_shard_2/Assert}}}}]]\n",
        2,
    ),
    "only the first cause counts": (
        "2 root error(s) found.\n"
        f"  (0) INVALID_ARGUMENT: {_ASSERT}\n\t [[{{{{node tfshard_shard_1/Assert}}}}]]\n"
        f"  (1) INVALID_ARGUMENT: {_ASSERT}\n\t [[{{{{node tfshard_shard_0/Assert}}}}]]\n",
        1,
    ),
    "names no node": ("Graph execution error: out of memory", None),
    "a parallelized function inside shard 3's shared trace": (
        f"{_ASSERT}\n\t [[{{{{node cond/Assert}}}}]]\n"
        "\t [[cond/tfshard_shard_0/StatefulPartitionedCall]]\n"
        "\t [[tfshard_shard_3/StatefulPartitionedCall]]",
        3,
    ),
    "a parallelized function inside shard 2, in place": (
        f"{_ASSERT}\n\t [[{{{{node tfshard_shard_2/cond/tfshard_shard_1/cond/Assert}}}}]]",
        2,
    ),
    # Captured: shard 0 failed on worker 0; the client got the error twice, once
    # forwarded by shard 1's receive on worker 1 (gRPC quotes it), once itself.
    "real: across workers, forwarded by a receive on another worker, then itself": (
        "2 root error(s) found.\n"
        f"  (0) INVALID_ARGUMENT:   {_NAN}\n\t [[{{{{node {_NODE0}}}}}]]\n"
        "Additional GRPC error information from remote target /job:worker/replica:0/task:0 "
        "while calling /tensorflow.WorkerService/RecvTensor:\n"
        f':UNKNOWN:Error received from peer  {{grpc_status:3, grpc_message:"{_NAN}\\n\\t '
        f'[[{{{{node {_NODE0}}}}}]]"}}\n'
        "\t [[tfshard_shard_1/cond/branch_executed/_15/_31]]\n"
        f"  (1) INVALID_ARGUMENT:  {_NAN}\n\t [[{{{{node {_NODE0}}}}}]]\n"
        "0 successful operations.\n1 derived errors ignored. [Op:__inference_body_1300]",
        0,
    ),
    # Captured: the output on worker 0, shard 2 failed on worker 1 (remote function format).
    "real: remote, a function node before the failing node": (
        f"{{{{function_node __inference_body_213}}}} {_NAN}\n"
        "\t [[{{function_node tfshard_shard_2_cond_true_151}}"
        "{{node tfshard_shard_2/cond/loop_body/CheckNumerics/pfor/CheckNumerics}}]]\n"
        "Additional GRPC error information from remote target /job:worker/replica:0/task:1 "
        "while calling /tensorflow.WorkerService/RecvTensor:\n"
        f':UNKNOWN:Error received from peer  {{grpc_status:3, grpc_message:"{_NAN}"}}\n'
        "\t [[tfshard_shard_2/cond/output/_22/_40]]",
        2,
    ),
    # Captured: a user's tf.function inlined into shard 0 traced in place; TF names
    # the node by its name in the function, and the receive after it is shard 1's.
    "real: a user's tf.function inlined in place names no shard": (
        "2 root error(s) found.\n"
        f"  (0) INVALID_ARGUMENT:  {_NAN}\n\t [[{{{{node CheckNumerics}}}}]]\n"
        "\t [[Func/tfshard_shard_1/cond/then/_8/tfshard_shard_1/cond/StatefulPartitionedCall"
        "/input/_37/_14]]\n"
        f"  (1) INVALID_ARGUMENT:  {_NAN}\n\t [[{{{{node CheckNumerics}}}}]]\n"
        "0 successful operations.\n0 derived errors ignored. [Op:__inference_body_77]",
        None,
    ),
}


@pytest.mark.parametrize("case", _FAILING_SHARD_CASES)
def test_failing_shard_reads_the_failing_node_and_its_calls(case):
    """Each message names the shard that failed, or none."""
    message, shard = _FAILING_SHARD_CASES[case]
    assert errors.failing_shard(message) == shard


@pytest.mark.parametrize("shard", [0, 1])  # traced in place; calling the shared trace
def test_a_failing_shard_is_named_with_its_device_and_rows(shard):
    devices = CPUS[1:]  # three devices: shards 1 and 2 share a trace
    f = tfshard.parallelize(
        lambda s: tf.debugging.check_numerics(tf.math.log(s), "log of a negative"),
        devices=devices,
    )
    x = np.ones(9, np.float32)
    x[3 * shard + 1] = -1.0
    with pytest.raises(ShardError) as raised:
        f(x)
    assert isinstance(raised.value, tf.errors.InvalidArgumentError)
    start = 3 * shard
    assert str(raised.value).startswith(
        f"<lambda>: shard {shard} on {devices[shard]} (rows [{start}:{start + 3}) of 9) failed: "
    )


# A real out-of-memory, run in a process of its own: with oneDNN's CPU allocator (this
# process's), a refused allocation is retried for 10 s before it fails; TensorFlow's plain
# one (TF_ENABLE_ONEDNN_OPTS=0) fails at once, with the same error. Shard 1 asks for more
# than any machine's address space (2**58 bytes a row), so no allocator can grant it, whatever
# the memory and overcommit policy: 4 TiB a row was granted and filled on a 128 GiB machine
# (no answer in 60 s). The child sees no GPU: the CPU bed's allocator, not a GPU's pinned one.
_OUT_OF_MEMORY = """
import json, numpy as np, tensorflow as tf, tfshard
tfshard.virtual_devices(3)
tf.config.threading.set_intra_op_parallelism_threads(1)

def greedy(block):
    # Shard 1 asks for 2**56 floats per row: the allocator really refuses (256 PiB a row).
    per_row = tf.where(tfshard.shard_index() == 1, tf.constant(2**56, tf.int64), 1)
    scratch = tf.zeros(tf.reshape(tf.shape(block, out_type=tf.int64)[0] * per_row, [1]))
    return block + tf.reduce_sum(scratch[:1])

found = {}
for max_rows in (None, 2):
    f = tfshard.parallelize(greedy, devices=["cpu:0", "cpu:1", "cpu:2"], per_sample=False,
                            max_rows=max_rows)
    x = np.arange(9, dtype=np.float32)
    try:
        f(x)
    except tfshard.ShardError as error:
        found[str(max_rows)] = {
            "message": str(error),
            "exhausted": isinstance(error, tf.errors.ResourceExhaustedError),
            "after": f(x[:1]).numpy().tolist(),  # shard 1 gets no rows: runs as usual
        }
print(json.dumps(found))
"""


def test_a_shard_out_of_memory_is_named_with_its_rows_and_the_remedies():
    found = children.printed_json(_OUT_OF_MEMORY, TF_ENABLE_ONEDNN_OPTS="0")
    for max_rows, at_once in (
        (
            "None",
            "Pass max_rows=N to run each shard's function on at most N rows at a time (on its "
            "device, results as one run's; a list gives one limit per device)",
        ),
        ("2", f"It ran in chunks of at most 2 rows: pass a smaller max_rows= for {CPUS[1]}"),
    ):
        case = found[max_rows]
        assert case["exhausted"] and case["after"] == [0.0]
        first, second = case["message"].splitlines()[:2]
        assert first == (
            f"greedy: shard 1 on {CPUS[1]} (rows [3:6) of 9) failed: it ran out of memory. "
            f"{at_once}, or weights= to give {CPUS[1]} fewer rows (weights='auto' learns "
            "that from a call). Nothing else changed: the call returned nothing, and the "
            "next call runs as usual"
        )
        assert second == "TensorFlow's error: Graph execution error:"
        assert "OOM when allocating tensor" in case["message"]


@pytest.mark.parametrize("shard", [1, 2])
def test_a_failure_in_the_users_own_tf_function_names_a_shard_that_calls_the_shared_trace(shard):
    """Its nodes keep their names inside the user's function; the shared trace's call
    (``[[tfshard_shard_k/StatefulPartitionedCall]]``) names the shard. (Shard 0, traced
    in place, is named by no message: see the inlined case above.)"""

    @tf.function
    def my_step(block):
        return tf.debugging.check_numerics(tf.math.log(block), "log of a negative")

    devices = CPUS[1:]  # output on CPU:1: shards 1 and 2 call the shared trace
    f = tfshard.parallelize(my_step, per_sample=False, devices=devices)
    x = np.ones(9, np.float32)
    x[3 * shard + 2] = -1.0
    with pytest.raises(ShardError, match=rf"^my_step: shard {shard} on {devices[shard]} \(rows "):
        f(x)


# ------------------------------------------------ errors that cross processes


def _each_error() -> dict[str, errors.TfshardError]:
    """One error of each class of the family, with what each carries besides its message."""
    op_error = tf.errors.InvalidArgumentError(None, None, "log of a negative")
    made = {
        "TfshardError": errors.TfshardError("tfshard failed"),
        "DeviceError": errors.DeviceError("device 'gpu:9' does not exist"),
        "ContextMapError": errors.ContextMapError("'dev0' is named twice"),
        "ArgumentError": errors.ArgumentError("batch_size=0: pass an int >= 1"),
        "DeviceSetupError": errors.DeviceSetupError("TensorFlow already started"),
        "ShardError": errors.ShardError("shard 1 on /device:CPU:1 failed"),
        "ShardInvalidArgumentError": errors.shard_error(op_error, "f: shard 1 failed: log"),
        "UtilizationError": errors.UtilizationError("nvidia-smi hung"),
        "ClusterError": errors.ClusterError("worker 1 at 127.0.0.1:2223 is down"),
        "WriteError": errors.write_error(
            OSError(28, "No space left on device", "/data/part-3.npy"), "f.write(ds, p)", "again"
        ),
        "WorkerError": errors.WorkerError(
            "worker 1 failed", index=1, device="gpu:1", traceback="Traceback: boom"
        ),
    }
    for error in made.values():
        error.add_note("tfshard: a note")
    return made


def _carried(error: BaseException) -> dict:
    """What an error carries: its type's name, message, arguments and attributes."""
    carried = {"type": type(error).__name__, "str": str(error), "args": error.args}
    carried.update(vars(error))
    if isinstance(error, OSError):
        carried.update(errno=error.errno, strerror=error.strerror, filename=error.filename)
    if isinstance(error, tf.errors.OpError):
        carried.update(message=error.message, error_code=error.error_code)
    return carried


def test_each_class_of_the_family_is_made_by_the_case_below():
    family = {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.TfshardError)
    }
    assert family | {"ShardInvalidArgumentError"} == set(_each_error())


@pytest.mark.parametrize("kind", list(_each_error()))
@pytest.mark.parametrize("how", ["pickle", "copy"])
def test_every_error_round_trips_through_pickle_and_copy(kind, how):
    """A worker process sends its error back whole (multiprocessing, concurrent.futures,
    joblib pickle it): the same type, message and attributes."""
    error = _each_error()[kind]
    again = pickle.loads(pickle.dumps(error)) if how == "pickle" else copy.copy(error)
    assert type(again) is type(error)
    assert _carried(again) == _carried(error)
    assert again.__notes__ == ["tfshard: a note"]
    if kind == "WriteError":
        assert (again.errno, again.filename) == (28, "/data/part-3.npy")
    if kind == "WorkerError":
        assert (again.index, again.device, again.traceback) == (1, "gpu:1", "Traceback: boom")


def test_a_shards_error_round_trips_through_pickle():
    f = tfshard.parallelize(
        lambda s: tf.debugging.check_numerics(tf.math.log(s), "log of a negative"),
        devices=CPUS[:2],
    )
    with pytest.raises(ShardError) as raised:
        f(np.array([1.0, 1.0, -1.0, 1.0], np.float32))
    again = pickle.loads(pickle.dumps(raised.value))
    assert type(again).__name__ == "ShardInvalidArgumentError"
    assert isinstance(again, errors.TfshardError) and isinstance(again, ShardError)
    assert isinstance(again, tf.errors.InvalidArgumentError)
    assert again.message == raised.value.message and str(again) == str(raised.value)
    assert again.message.startswith(f"<lambda>: shard 1 on {CPUS[1]} (rows [2:4) of 4) failed: ")
    assert again.error_code == raised.value.error_code == tf.errors.INVALID_ARGUMENT


# A worker of a process pool makes a failing call of its own; its error comes back through
# pickle (the pool's own), to a process where its class was never made.
_FAILS_IN_A_WORKER = """
import numpy as np, tensorflow as tf, tfshard
tfshard.virtual_devices(2)
def log(s):
    return tf.debugging.check_numerics(tf.math.log(s), "log of a negative")
tfshard.parallelize(log, devices=["cpu:0", "cpu:1"])(np.array([1.0, 1.0, -1.0, 1.0], np.float32))
"""


def test_a_shards_error_comes_back_from_a_process_pools_worker(monkeypatch):
    for name, value in children.environ(TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="").items():
        monkeypatch.setenv(name, value)
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter, not a fork of this one
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
        failed = pool.submit(exec, _FAILS_IN_A_WORKER, {}).exception(timeout=300)
    assert type(failed).__name__ == "ShardInvalidArgumentError"
    assert isinstance(failed, ShardError) and isinstance(failed, tf.errors.InvalidArgumentError)
    assert failed.message.startswith(f"log: shard 1 on {CPUS[1]} (rows [2:4) of 4) failed: ")
    assert "log of a negative" in failed.message


# ------------------------------------------------ tfshard's in-graph checks


def _failed_check(got, want, message: str) -> str:
    """The message TF raises for `_plan.host_assert` failing on these vectors."""

    @tf.function
    def check():
        with tf.control_dependencies(
            [_plan.host_assert(tf.constant(got), tf.constant(want), message)]
        ):
            return tf.constant(0)

    with pytest.raises(tf.errors.InvalidArgumentError) as raised:
        check()
    return raised.value.message


def test_rows_error_names_the_output_the_shard_and_its_rows():
    message = _failed_check(
        [2, 1, 2], [2, 2, 2], f"{errors.ROWS_DIFFER} outputs['y'] :end (each shard's ...)"
    )
    error = errors.rows_error("step", CPUS[:3], message, tuple(collect.REDUCTIONS))
    assert isinstance(error, ArgumentError)
    assert str(error).startswith(
        "step: outputs['y'] on shard 1 (/device:CPU:1) has 1 rows for 2; with per_sample=False"
    )


def test_rows_error_offers_the_reductions_of_collects_table():
    error = errors.rows_error("f", CPUS[:2], f"{errors.ROWS_DIFFER} outputs :end", ("sum", "x"))
    assert str(error).endswith("(a shard's value: pass reduce='sum'/'x')")
    table = errors.rows_error(
        "f", CPUS[:2], f"{errors.ROWS_DIFFER} outputs :end", tuple(collect.REDUCTIONS)
    )
    assert str(table).endswith(f"pass reduce={collect.reduction_names()})")


def test_inputs_error_names_the_argument_whose_rows_differ():
    message = _failed_check([3, 3, 4], [3, 3, 3], f"{errors.INPUTS_DIFFER} a, b, c['d'] :end")
    error = errors.inputs_error("step", message)
    assert isinstance(error, ArgumentError)
    assert str(error).startswith("step: c['d'] has 4 rows but a has 3; every split argument")


def test_assert_parsers_without_the_vectors_still_say_what_failed():
    rows = errors.rows_error(
        "f", CPUS[:2], f"{errors.ROWS_DIFFER} outputs :end", tuple(collect.REDUCTIONS)
    )
    assert str(rows).startswith("f: outputs has the wrong number of rows; with per_sample=False")
    inputs = errors.inputs_error("f", f"{errors.INPUTS_DIFFER} a, b :end")
    assert "f: the split arguments have different numbers of rows;" in str(inputs)


def test_whole_shard_outputs_with_the_wrong_rows_fail_naming_the_shard():
    """rows_error through a call: shard 1 (rows [2:4)) returns one row for two."""
    f = tfshard.parallelize(lambda x: x[:1], per_sample=False, devices=CPUS[:2])
    with pytest.raises(ArgumentError, match=r"outputs on shard [01] \(/device:CPU:[01]\) has 1 "):
        f(np.zeros([4, 2], np.float32))


# ------------------------------------------------------------------ pfor


@pytest.mark.parametrize(
    "message, expected",
    [
        ("Incompatible shapes: [2] vs. [3]\n\t [[{{node loop_body/pfor/Add}}]]", True),
        ("TensorListStack: element shapes differ [[{{node x/pfor/TensorListStack}}]]", True),
        ("Incompatible shapes: [2] vs. [3]\n\t [[{{node tfshard_shard_0/Add}}]]", False),
        (f"{_NAN}\n\t [[{{{{node {_NODE0}}}}}]]", False),
        # A failure in pfor's loop of one sample, its result forwarded through a stack.
        (
            f"{_NAN}\n\t [[{{{{node s_1/loop_body/CheckNumerics}}}}]]\n\t "
            "[[s_1/loop_body/CheckNumerics/pfor/TensorArrayV2Stack/TensorListStack/_8]]",
            False,
        ),
    ],
)
def test_pfor_stack_failure_is_pfors_own_stacking(message, expected):
    assert errors.pfor_stack_failure(message) is expected


# -------------------------------------------------------- remote errors

_DEAD = (
    "remote target /job:worker/replica:0/task:1/device:CPU:0 while calling "
    "/tensorflow.eager.EagerService/Enqueue:\n:UNAVAILABLE:Connection refused "
    '{grpc_message:"failed to connect to all addresses; last error: UNKNOWN: '
    'ipv4:127.0.0.1:2223: Failed to connect to remote host", grpc_status:14}'
)


def test_remote_tasks_reads_the_called_task_and_peer_addresses():
    addresses = {"127.0.0.1:2222": ("worker", 0), "127.0.0.1:2223": ("worker", 1)}
    assert errors.remote_tasks(_DEAD, addresses) == {("worker", 1)}
    assert errors.remote_tasks("Socket closed (ipv4:127.0.0.1:2222)", addresses) == {("worker", 0)}
    assert errors.remote_tasks("ipv6:[::1]:2222 closed", addresses) == set()
    assert errors.remote_tasks("out of memory", addresses) == set()


def test_grpc_reason_and_whether_the_peer_answered():
    assert errors.grpc_reason(_DEAD).startswith("failed to connect to all addresses")
    assert errors.grpc_reason("no gRPC here") is None
    assert not errors.peer_answered(_DEAD)  # UNAVAILABLE: the worker was not reached
    forwarded = _FAILING_SHARD_CASES["real: remote, a function node before the failing node"]
    assert errors.peer_answered(forwarded[0])  # the worker answered with the shard's error
    assert not errors.peer_answered("no gRPC here")


# A worker killed mid-call, the output on the other worker (captured, 1.1 KB).
_KILLED_MID_CALL = (
    "2 root error(s) found.\n"
    "  (0) UNAVAILABLE: {{function_node __inference_body_192}} Socket closed\n"
    "Additional GRPC error information from remote target "
    "/job:worker/replica:0/task:1/device:CPU:0 while calling "
    "/tensorflow.eager.EagerService/RunComponentFunction:\n"
    ':UNKNOWN:Error received from peer  {grpc_message:"Socket closed", grpc_status:14}\n'
    "  (1) UNAVAILABLE: {{function_node __inference_body_192}} Socket closed\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:1 "
    "while calling /tensorflow.WorkerService/RecvTensor:\n"
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}\n'
    "\t [[{{node tfshard_shard_1/cond/output/_14/_26}}]]\n"
    "0 successful operations.\n"
    "0 derived errors ignored."
)


def test_trimmed_remote_keeps_each_root_error_its_target_and_node():
    assert errors.trimmed_remote(_KILLED_MID_CALL) == (
        "2 root error(s) found.\n"
        "  (0) UNAVAILABLE: Socket closed\n"
        "  (from /job:worker/replica:0/task:1/device:CPU:0, RunComponentFunction)\n"
        "  (1) UNAVAILABLE: Socket closed\n"
        "  (from /job:worker/replica:0/task:1, RecvTensor)\n"
        "\t [[{{node tfshard_shard_1/cond/output/_14/_26}}]]"
    )
    assert errors.trimmed_remote("x" * 1000, limit=100) == "x" * 100 + " ... (900 more characters)"


def test_remote_cause_reads_a_tensorflow_error_and_nothing_else():
    addresses = {"127.0.0.1:2222": ("worker", 0), "127.0.0.1:2223": ("worker", 1)}
    tasks = frozenset(addresses.values())
    dead = errors.remote_cause(tf.errors.UnavailableError(None, None, _DEAD), addresses, tasks)
    assert dead.tasks == {("worker", 1)}
    assert dead.reason.startswith("failed to connect to all addresses")
    assert errors.remote_cause(ValueError(_DEAD), addresses, tasks) is None  # not TF's
    forwarded = _FAILING_SHARD_CASES["real: remote, a function node before the failing node"][0]
    shards_own = tf.errors.InvalidArgumentError(None, None, forwarded)
    assert errors.remote_cause(shards_own, addresses, tasks) is None  # the worker answered
    # Unreachable in time, naming no task: about the network all the same.
    late = tf.errors.DeadlineExceededError(None, None, "Deadline Exceeded")
    assert errors.remote_cause(late, addresses, tasks) == errors.RemoteCause(frozenset(), None)


def test_connects_errors_say_what_they_said_with_tensorflows_text_trimmed():
    cluster, client = "127.0.0.1:2222,127.0.0.1:2223", "127.0.0.1:4000"
    error = tf.errors.UnavailableError(None, None, _KILLED_MID_CALL)
    # The messages cluster.connect wrote itself before errors wrote them, with TF's whole text.
    before = (
        f"connect: the workers of {cluster} answer, but a value could not go from this client "
        f"({client}) to every worker, between every two workers, and back: {error.message}. "
        f"Every worker must reach every other worker's address and this client's address "
        f"{client} (firewalls, or 'localhost' in the cluster where another machine needs a "
        "real address)"
    )
    after = str(errors.links_failed(error, cluster=cluster, client=client))
    assert after == (
        f"connect: the workers of {cluster} answer, but a value could not go from this client "
        f"({client}) to every worker, between every two workers, and back. Every worker must "
        f"reach every other worker's address and this client's address {client} (firewalls, "
        "or 'localhost' in the cluster where another machine needs a real address). "
        f"TensorFlow's error: {errors.trimmed_remote(_KILLED_MID_CALL)}"
    )
    # What it said is all there; gRPC's repetitions and TF's counts are not.
    head, fix = before.split(f": {error.message}. ")
    assert after.startswith(head) and f"{fix}. TensorFlow's error: " in after
    assert "Error received from peer" in before and "Error received from peer" not in after
    assert "0 successful operations" not in after and len(after) < len(before)

    refused = ValueError("Unable to connect: the server def is malformed")
    joined = errors.join_failed(refused, cluster=cluster, client=client)
    assert isinstance(joined, errors.ClusterError)
    assert str(joined) == (
        f"connect: TensorFlow could not connect to {cluster} as {client}: {refused}"
    )
    joined = str(errors.join_failed(error, cluster=cluster, client=client))
    assert joined == (
        f"connect: TensorFlow could not connect to {cluster} as {client}: "
        f"{errors.trimmed_remote(_KILLED_MID_CALL)}"
    )


# ------------------------------------------------------------- XLA (issue 37)


# Run in a process of its own, from a script's shallow stack: TensorFlow cuts its message
# at about 12 KB, and under pytest the stacks it repeats push out the line that names the
# shard ([[tfshard_shard_k/PartitionedCall]]), so no shard can be named (see the report of
# issue 37: the engine then raises TF's error as it came).
_XLA_FLIP = """
import json, numpy as np, tensorflow as tf, tfshard
tfshard.virtual_devices(2)
tf.config.threading.set_intra_op_parallelism_threads(1)
f = tfshard.parallelize(
    lambda s: tf.image.stateless_random_flip_left_right(s, seed=tf.stack([tfshard.row_index(), 0])),
    jit_compile=True, devices=["cpu:0", "cpu:1"])
try:
    f(np.zeros([8, 4, 4, 3], np.float32))
except tf.errors.OpError as error:
    print(json.dumps({"message": str(error), "shard": isinstance(error, tfshard.ShardError),
                      "tf": isinstance(error, tf.errors.InvalidArgumentError)}))
"""


def test_an_xla_compile_failure_is_one_line_and_the_root_cause_once():
    """TF repeats the cause and a 'Stack trace for op definition' per shard and per
    function it converted; the message says what XLA could not compile, the remedy,
    then TF's root cause once."""
    found = children.printed_json(_XLA_FLIP)
    assert found["shard"] and found["tf"]
    message = found["message"]
    cause = "Reading input as constant from a dynamic tensor is not yet supported"
    first_line = (
        r"<lambda>: shard [01] on /device:CPU:[01] \(rows \[[04]:[48]\) of 8\) failed: "
        r"XLA could not compile the function \(jit_compile=True\) at node "
        r"\S*stateless_random_flip_left_right\S*; pass jit_compile=False to run it "
        rf"without XLA\nTensorFlow's error: INVALID_ARGUMENT: {cause}"
    )
    assert re.match(first_line, message), message
    assert message.count(cause) == 1
    assert message.count("Stack trace for op definition") <= 1
    assert len(message.splitlines()) == 2


def test_an_xla_compile_failure_whose_text_tf_cut_is_still_one_line_and_the_cause():
    """Under pytest's deep stack TF's text is cut before the line naming the shard: the
    message still says what XLA could not compile and its cause, once, as a ShardError."""
    f = tfshard.parallelize(
        lambda s: tf.image.stateless_random_flip_left_right(
            s, seed=tf.stack([tfshard.row_index(), tf.constant(0, tf.int64)])
        ),
        jit_compile=True,
        devices=CPUS[:2],
    )
    with pytest.raises(ShardError) as caught:
        f(np.zeros([8, 4, 4, 3], np.float32))
    assert isinstance(caught.value, tf.errors.InvalidArgumentError)
    message = str(caught.value)
    cause = "Reading input as constant from a dynamic tensor is not yet supported"
    assert re.match(r"<lambda>(: shard \d on \S+ \(rows [^)]*\))? failed: XLA could not", message)
    assert message.count(cause) == 1 and len(message.splitlines()) == 2, message


def test_an_op_xla_has_no_kernel_for_is_named_with_its_shard():
    """XLA's text names the failing node twice: still one report, whose call names shard 1."""
    node = "loop_body/AsString/pfor/TensorArrayV2"
    root = (
        "INVALID_ARGUMENT:  Detected unsupported operations when trying to compile graph "
        "cond_true_233[] on XLA_CPU_JIT: TensorListReserve (No registered 'TensorListReserve' "
        f"OpKernel for XLA_CPU_JIT devices compatible with node {{{{node {node}}}}}{{{{node "
        f'{node}}}}}\nThe op is created at: \nFile "a.py", line 12, in <module>\n\ttf2xla '
        "conversion failed while converting cond_true_233[].\n\nStack trace for op "
        'definition: \nFile "a.py", line 12, in <module>\n\n\t [[cond]]\n'
        "\t [[tfshard_shard_1/PartitionedCall]]\n"
    )
    message = f"Graph execution error:\n\n2 root error(s) found.\n  (0) {root}  (1) {root}"
    assert errors.failing_shard(message) == 1
    assert not errors.pfor_stack_failure(message)
    what, cause = errors.user_frames(message).split("\n")
    assert what == (
        "XLA could not compile the function (jit_compile=True): XLA_CPU_JIT has no kernel "
        f"for op TensorListReserve at node {node}; pass jit_compile=False to run it without "
        "XLA, or keep ops XLA has no kernel for out of the function"
    )
    assert cause.startswith("TensorFlow's error: INVALID_ARGUMENT: Detected unsupported ")


@pytest.mark.parametrize("dtype", [tf.float32, tf.int32])  # a concat, a TensorList
@pytest.mark.parametrize("count", [2, 4])  # shapes known when traced; known when run
def test_shards_outputs_of_different_shapes_past_the_rows_are_named(dtype, count):
    f = tfshard.parallelize(
        lambda x: tf.tile(x, [1, tfshard.shard_index() + 1]),
        devices=[f"cpu:{k}" for k in range(count)],
        per_sample=False,
    )
    x = tf.cast(np.arange(14).reshape(7, 2), dtype)
    with pytest.raises(tfshard.ArgumentError) as raised:
        f(x)
    message = str(raised.value)
    assert message.startswith("<lambda>: ") and "same shape past the rows on every shard" in message
    assert "File " not in message and "{{node" not in message  # no trace, no TF node
