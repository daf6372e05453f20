"""Test bed for the whole tree (tests/ and the doctests in tfshard/).

It lives at the root, not in tests/, so the doctests see the same devices: the
CPU split into 4 logical devices with one intra-op thread each, done here
before anything starts TensorFlow's runtime. Each logical device then behaves
like one slow accelerator, and K shards on K devices run concurrently (bounded
by the cores).
"""

import os

import numpy as np
import pytest
import tensorflow as tf

import tfshard

NUM_DEVICES = 4

tfshard.virtual_devices(NUM_DEVICES)
# The GPU suite (tests/test_gpu.py) needs two GPUs; on a machine with one, split it
# in two (TFSHARD_VIRTUAL_GPU_MB each) when that suite is required to run.
if (
    os.environ.get("TFSHARD_REQUIRE_GPU") == "1"
    and len(tf.config.list_physical_devices("GPU")) == 1
):
    tfshard.virtual_devices(
        2, "GPU", memory_limit_mb=int(os.environ.get("TFSHARD_VIRTUAL_GPU_MB", "8192"))
    )
tf.config.threading.set_intra_op_parallelism_threads(1)


@pytest.fixture(autouse=True)
def _doctest_namespace(doctest_namespace):
    doctest_namespace.update(tf=tf, np=np, tfshard=tfshard)


@pytest.fixture(autouse=True)
def _doctests_run_on_the_cpu_bed(request):
    """Doctests show the CPU bed, by name, on a machine with GPUs too.

    Their eager ops run under ``tf.device("/device:CPU:0")`` (TensorFlow's default would be
    GPU:0 there). An example whose source says ``# no GPU`` shows what a machine without one
    prints: it is skipped, with the reason, where TensorFlow lists a GPU.
    """
    test = getattr(request.node, "dtest", None)  # a doctest item's doctest.DocTest
    if test is None:
        yield
        return
    if tf.config.list_logical_devices("GPU") and any(
        "# no GPU" in example.source for example in test.examples
    ):
        pytest.skip(f"{test.name} shows a machine without a GPU; this one has GPUs")
    with tf.device("/device:CPU:0"):
        yield
