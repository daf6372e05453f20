"""Device discovery, resolution, context maps, virtual devices and transfers."""

import logging
import pathlib
import re
import threading

import numpy as np
import pytest
import tensorflow as tf

import tfshard
from tfshard import pinning
from tfshard.errors import (
    ArgumentError,
    ContextMapError,
    DeviceError,
    DeviceSetupError,
    TfshardError,
)

CPUS = [f"/device:CPU:{i}" for i in range(4)]


# ------------------------------------------------------------- discovery


def test_list_devices_reports_the_four_logical_cpus():
    assert tfshard.list_devices("CPU") == CPUS
    assert tfshard.list_devices("cpu") == CPUS
    assert tfshard.list_devices() == [d.name for d in tf.config.list_logical_devices()]


def test_list_devices_takes_any_device_type():
    assert tfshard.list_devices(" Cpu ") == CPUS
    assert tfshard.list_devices("tpu") == []  # a type this machine has none of
    assert tfshard.list_devices() == tfshard.list_devices("CPU") + tfshard.list_devices("GPU")


@pytest.mark.parametrize(
    "device_type, message",
    [
        (1, r"device_type=1\): a device type is one of 'CPU', 'GPU', .*or None for every device$"),
        # a device is not a device type (it used to list no device)
        ("gpu:0", r"device_type='gpu:0'\): .*; 'gpu:0' names one device: tfshard.resolve_device"),
        ("cpu:1", r"'cpu:1' names one device"),
        ("TPUX", r"device_type='TPUX'\): a device type is one of .*'TPU'.*device$"),
        ("", r"device_type=''\): a device type is one of"),
        (tf.config.LogicalDevice("/device:CPU:0", "CPU"), r"device_type=LogicalDevice\("),
    ],
)
def test_list_devices_refuses_what_is_not_a_device_type(device_type, message):
    with pytest.raises(ArgumentError, match=message):
        tfshard.list_devices(device_type)


def test_num_gpus_counts_logical_gpus():
    # That it does not start TF: test_virtual_devices_before_start_splits_the_cpu.
    assert tfshard.num_gpus() == len(tf.config.list_logical_devices("GPU"))


def test_cpu_names_the_first_cpu():
    assert tfshard.cpu() == "/device:CPU:0"


def test_try_gpu_falls_back_to_the_cpu_without_gpus():
    if tfshard.num_gpus():
        assert tfshard.try_gpu(0) == "/device:GPU:0"
    else:
        assert tfshard.try_gpu() == "/device:CPU:0"
        assert tfshard.try_gpu(3) == "/device:CPU:0"
    assert tfshard.try_gpu(tfshard.num_gpus()) == "/device:CPU:0"


def test_try_all_gpus_falls_back_to_the_cpu_without_gpus():
    expected = [f"/device:GPU:{i}" for i in range(tfshard.num_gpus())] or ["/device:CPU:0"]
    assert tfshard.try_all_gpus() == expected


def test_gpu_that_does_not_exist_says_how_to_fall_back():
    missing = tfshard.num_gpus()
    with pytest.raises(DeviceError, match=rf"gpu\({missing}\).*try_gpu\({missing}\)"):
        tfshard.gpu(missing)


@pytest.mark.parametrize("bad", [-1, 1.5, "0", True])
def test_gpu_index_must_be_a_non_negative_int(bad):
    with pytest.raises(DeviceError, match="index is an int >= 0"):
        tfshard.gpu(bad)


def test_numpy_integers_are_device_indices():
    assert tfshard.try_gpu(np.int64(99)) == "/device:CPU:0"
    assert tfshard.try_gpu(np.int32(0)) == tfshard.try_gpu(0)
    with pytest.raises(DeviceError, match=r"\(/device:GPU:99\) does not exist"):
        tfshard.resolve_device(np.int64(99))
    with pytest.raises(DeviceError, match=r"gpu\(99\): this process has"):
        tfshard.gpu(np.uint16(99))
    with pytest.raises(DeviceError, match="index is an int >= 0"):
        tfshard.gpu(np.bool_(True))


def test_gpu_zero_on_a_gpu_machine(one_gpu):
    assert tfshard.gpu(0) == "/device:GPU:0"
    assert tfshard.try_gpu(0) == "/device:GPU:0"


# ------------------------------------------------------------ resolution


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("cpu", "/device:CPU:0"),
        ("CPU", "/device:CPU:0"),
        ("cpu:0", "/device:CPU:0"),
        ("cpu:3", "/device:CPU:3"),
        ("CPU:2", "/device:CPU:2"),
        ("/cpu:1", "/device:CPU:1"),
        ("/device:CPU:1", "/device:CPU:1"),
        ("device:cpu:2", "/device:CPU:2"),
        ("  cpu:1 ", "/device:CPU:1"),
        ("/job:localhost/replica:0/task:0/device:CPU:3", "/device:CPU:3"),
        ("/job:localhost/device:CPU:2", "/device:CPU:2"),
    ],
)
def test_resolve_device_accepts_every_cpu_spelling(spec, expected):
    assert tfshard.resolve_device(spec) == expected


def test_resolve_device_accepts_logical_devices_and_device_specs():
    logical = tf.config.list_logical_devices("CPU")[2]
    assert tfshard.resolve_device(logical) == "/device:CPU:2"
    assert tfshard.resolve_device(tf.DeviceSpec(device_type="CPU", device_index=1)) == CPUS[1]


@pytest.mark.parametrize(
    "spec", [1, "gpu:1", "GPU:1", "/gpu:1", "/device:GPU:1", "cuda1", "device:gpu:1"]
)
def test_every_gpu_spelling_names_gpu_one(spec):
    if tfshard.num_gpus() >= 2:
        assert tfshard.resolve_device(spec) == "/device:GPU:1"
    else:
        # The message spells out which device the spelling named.
        with pytest.raises(
            DeviceError, match=r"\(/device:GPU:1\) does not exist; this process has /device:CPU:0"
        ):
            tfshard.resolve_device(spec)


@pytest.mark.parametrize("spec", ["cuda", "gpu", "cuda0", "GPU:0"])
def test_bare_gpu_spellings_mean_gpu_zero(spec):
    if tfshard.num_gpus():
        assert tfshard.resolve_device(spec) == "/device:GPU:0"
    else:
        with pytest.raises(DeviceError, match=r"\(/device:GPU:0\) does not exist"):
            tfshard.resolve_device(spec)


def test_gpu_spellings_resolve_on_a_gpu_machine(two_gpus):
    for spec in [1, "gpu:1", "GPU:1", "/gpu:1", "/device:GPU:1", "cuda1"]:
        assert tfshard.resolve_device(spec) == "/device:GPU:1"


def test_missing_gpu_lists_existing_devices_and_suggests_fallbacks():
    with pytest.raises(DeviceError) as raised:
        tfshard.resolve_device("GPU:7")
    message = str(raised.value)
    assert "'GPU:7' (/device:GPU:7) does not exist" in message
    for name in CPUS:
        assert name in message
    assert "try_gpu" in message and "virtual_devices" in message


def test_missing_cpu_suggests_virtual_devices():
    with pytest.raises(DeviceError, match=r"cpu:9.*virtual_devices\(n\)"):
        tfshard.resolve_device("cpu:9")


def test_remote_name_without_a_cluster_is_an_error():
    with pytest.raises(DeviceError, match=r"/job:worker/task:1/device:CPU:0.*does not exist"):
        tfshard.resolve_device("/job:worker/task:1/device:CPU:0")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("opencl0:0", "TensorFlow has no OpenCL devices"),
        ("/physical_device:CPU:0", "is a physical device"),
        ("banana split", "is not a device name"),
        ("cpu:-1", "is not a device name"),
        ("", "is not a device name"),
        (True, "a bool is not a device"),
        (-1, "index is an int >= 0"),
        (1.0, "of type float"),
        (None, "of type NoneType"),
    ],
)
def test_bad_device_specs_say_what_is_wrong(spec, message):
    with pytest.raises(DeviceError, match=message):
        tfshard.resolve_device(spec)


def test_device_error_is_a_value_error_and_a_tfshard_error():
    with pytest.raises(ValueError):
        tfshard.resolve_device("cpu:9")
    with pytest.raises(TfshardError):
        tfshard.resolve_device("cpu:9")


# ----------------------------------------------------------- context maps


def test_context_map_parses_names_in_order():
    m = tfshard.ContextMap.parse("dev0->GPU:0;dev1->GPU:1")
    assert list(m.items()) == [("dev0", "GPU:0"), ("dev1", "GPU:1")]
    assert str(m) == "dev0->GPU:0;dev1->GPU:1"
    assert tfshard.ContextMap.parse(repr(m)[len("ContextMap.parse(") + 1 : -2]) == m


@pytest.mark.parametrize(
    "text",
    [
        " dev0 -> cpu:0 ; dev1->cpu:1 ",
        "dev0->cpu:0;dev1->cpu:1;",
        "dev0->cpu:0 ;\n dev1 ->cpu:1 ; ",
    ],
)
def test_context_map_tolerates_whitespace_and_a_trailing_semicolon(text):
    assert dict(tfshard.ContextMap.parse(text)) == {"dev0": "cpu:0", "dev1": "cpu:1"}


def test_empty_context_map_string_is_an_empty_map():
    assert len(tfshard.ContextMap.parse("")) == 0
    assert len(tfshard.ContextMap.parse("  ")) == 0


def test_names_may_contain_other_characters():
    m = tfshard.ContextMap.parse("encoder.A->cpu:1;my-gpu->cpu:2;dev:0->cpu:3")
    assert list(m) == ["encoder.A", "my-gpu", "dev:0"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("->GPU:0", r"entry 0 '->GPU:0' .*the context name is empty"),
        ("dev0->GPU:0;  ->GPU:1", r"entry 1 '->GPU:1' .*the context name is empty"),
        ("dev0->", r"entry 0 'dev0->' .*the device of 'dev0' is empty"),
        ("dev0 GPU:0", r"entry 0 'dev0 GPU:0' .*expected 'name->device'"),
        ("dev0->GPU:0;;dev1->GPU:1", r"entry 1 '' .*expected 'name->device'"),
        ("a->b->GPU:0", r"entry 0 'a->b->GPU:0' .*more than one '->'"),
        ("cuda0->GPU:0", r"'cuda0' begins with 'cuda'"),
        ("gpu_main->GPU:0", r"'gpu_main' begins with 'gpu'"),
        ("CPUx->cpu:0", r"'CPUx' begins with 'cpu'"),
        ("opencl->GPU:0", r"'opencl' begins with 'opencl'"),
        (
            "dev0->GPU:0;dev1->GPU:1;dev0->GPU:2",
            r"entry 2 'dev0->GPU:2' .*'dev0' is already mapped to 'GPU:0'",
        ),
    ],
)
def test_bad_context_maps_name_the_entry_and_the_problem(text, message):
    with pytest.raises(ContextMapError, match=message):
        tfshard.ContextMap.parse(text)


def test_context_map_from_a_dict_checks_the_same_rules():
    assert dict(tfshard.ContextMap({"dev0": "cpu:1"})) == {"dev0": "cpu:1"}
    with pytest.raises(ContextMapError, match="begins with 'gpu'"):
        tfshard.ContextMap({"gpu0": "cpu:1"})


@pytest.mark.parametrize(
    "mapping, message",
    [
        (3, r"ContextMap\(3\): pass a mapping of context names to device specs"),
        ("dev0->cpu:1", r"or None for an empty map; for a string use ContextMap.parse"),
        (["dev0", "cpu:1"], r"ContextMap\(\['dev0', 'cpu:1'\]\): pass a mapping"),
        # 1 is no empty device: it is an int, where a context map holds names
        ({"dev0": 1}, r"the device of 'dev0' is 1 of type int; .* such as 'GPU:1'"),
        ({"dev0": None}, r"the device of 'dev0' is None of type NoneType"),
        ({"dev0": ""}, r"the device of 'dev0' is empty"),
        ({1: "cpu:1"}, r"the context name 1 is of type int; a context name is a non-empty"),
    ],
)
def test_context_map_refuses_what_is_not_a_map_of_names(mapping, message):
    with pytest.raises(ContextMapError, match=message):
        tfshard.ContextMap(mapping)
    if isinstance(mapping, dict):
        with pytest.raises(ContextMapError, match=message):
            tfshard.set_contexts(mapping, log=False)
        assert tfshard.active_contexts() is None


def test_context_names_resolve_inside_use_contexts():
    with tfshard.use_contexts("dev0->cpu:2;dev1->/device:CPU:3", log=False) as active:
        assert tfshard.active_contexts() is active
        assert tfshard.resolve_device("dev0") == "/device:CPU:2"
        assert tfshard.resolve_device("dev1") == "/device:CPU:3"
    assert tfshard.active_contexts() is None
    with pytest.raises(DeviceError, match="'dev0' is not a device name"):
        tfshard.resolve_device("dev0")


def test_use_contexts_nests_and_none_hides_the_outer_map():
    with tfshard.use_contexts("dev0->cpu:1", log=False):
        with tfshard.use_contexts("dev0->cpu:2", log=False):
            assert tfshard.resolve_device("dev0") == "/device:CPU:2"
        with tfshard.use_contexts(None):
            assert tfshard.active_contexts() is None
        assert tfshard.resolve_device("dev0") == "/device:CPU:1"


def test_set_contexts_makes_a_map_active_until_cleared():
    tfshard.set_contexts("dev0->cpu:3", log=False)
    assert tfshard.resolve_device("dev0") == "/device:CPU:3"
    tfshard.set_contexts(None)
    assert tfshard.active_contexts() is None


def test_environment_variable_supplies_the_map(monkeypatch):
    monkeypatch.setenv("TFSHARD_CONTEXTS", "dev0->cpu:1;dev1->cpu:2")
    assert tfshard.resolve_device("dev1") == "/device:CPU:2"
    with tfshard.use_contexts("dev1->cpu:3", log=False):  # An explicit map wins.
        assert tfshard.resolve_device("dev1") == "/device:CPU:3"


def test_reset_contexts_forgets_every_map_and_the_variable_counts_again(monkeypatch, caplog):
    monkeypatch.setenv("TFSHARD_CONTEXTS", "dev0->cpu:1")
    opened, reset = threading.Event(), threading.Event()
    seen_in_thread = []

    def open_block():  # another thread's block is forgotten too
        with tfshard.use_contexts("dev0->cpu:3", log=False):
            opened.set()
            reset.wait(timeout=60)
            seen_in_thread.append(tfshard.active_contexts())

    with caplog.at_level(logging.INFO, logger="tfshard"):
        assert tfshard.resolve_device("dev0") == "/device:CPU:1"
        tfshard.set_contexts("dev0->cpu:2", log=False)
        thread = threading.Thread(target=open_block)
        thread.start()
        assert opened.wait(timeout=60)
        with tfshard.use_contexts("dev0->cpu:3", log=False):
            assert tfshard.resolve_device("dev0") == "/device:CPU:3"
            pinning.reset_contexts()
            reset.set()
            assert tfshard.resolve_device("dev0") == "/device:CPU:1"
        assert tfshard.resolve_device("dev0") == "/device:CPU:1"  # set_contexts' map is gone
        thread.join(timeout=60)
    assert seen_in_thread == [tfshard.active_contexts()]
    assert str(seen_in_thread[0]) == "dev0->cpu:1"
    messages = [r.getMessage() for r in caplog.records]
    # The variable is read and logged afresh after the reset.
    assert sum(m.startswith("Mapped name dev0 to device /device:CPU:1") for m in messages) == 2


def test_environment_map_logs_its_mappings_once(monkeypatch, caplog):
    monkeypatch.setenv("TFSHARD_CONTEXTS", "dev0->cpu:1;dev1->GPU:9")
    with caplog.at_level(logging.INFO, logger="tfshard"):
        assert tfshard.resolve_device("dev0") == "/device:CPU:1"
        assert tfshard.resolve_device("cpu:2") == "/device:CPU:2"
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("Mapped name dev0 to device /device:CPU:1") for m in messages) == 1
    assert any(m.startswith("TFSHARD_CONTEXTS: context 'dev1' -> 'GPU:9'") for m in messages)
    with pytest.raises(DeviceError, match="context 'dev1'"):
        tfshard.resolve_device("dev1")


def test_malformed_environment_variable_names_the_variable(monkeypatch):
    monkeypatch.setenv("TFSHARD_CONTEXTS", "gpu->cpu:1")
    with pytest.raises(ContextMapError, match=r"^TFSHARD_CONTEXTS: entry 0"):
        tfshard.resolve_device("dev0")


def test_activation_logs_each_mapping_and_shared_devices(caplog):
    with (
        caplog.at_level(logging.INFO, logger="tfshard"),
        tfshard.use_contexts("dev0->cpu:1;dev1->cpu:1;dev2->cpu:2"),
    ):
        pass
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("Mapped name dev0 to device /device:CPU:1 (logical device 1 of 4")
        for m in messages
    )
    assert any(m.startswith("Mapped name dev2 to device /device:CPU:2 (") for m in messages)
    assert "Context names dev0, dev1 share device /device:CPU:1" in messages


def test_activation_logging_can_be_turned_off(caplog):
    with (
        caplog.at_level(logging.INFO, logger="tfshard"),
        tfshard.use_contexts("dev0->cpu:1", log=False),
    ):
        pass
    assert not caplog.records


def test_context_to_a_missing_device_names_the_context():
    with pytest.raises(DeviceError, match=r"context 'dev0' -> 'GPU:5': device 'GPU:5'"):
        tfshard.use_contexts("dev0->GPU:5").__enter__()


def test_context_mapped_to_another_context_is_an_error():
    with (
        tfshard.use_contexts("a->b;b->cpu:1", log=False),
        pytest.raises(DeviceError, match="maps to another context name 'b'"),
    ):
        tfshard.resolve_device("a")


def test_unknown_name_lists_the_active_context_names():
    with (
        tfshard.use_contexts("dev0->cpu:1", log=False),
        pytest.raises(DeviceError, match=r"active context names: \['dev0'\]"),
    ):
        tfshard.resolve_device("dev9")


def test_bad_contexts_argument_type():
    with pytest.raises(ContextMapError, match="pass a ContextMap"):
        tfshard.set_contexts(42)


# -------------------------------------------------------- virtual devices


def test_virtual_devices_after_start_explains_the_ordering():
    with pytest.raises(DeviceSetupError, match=r"must run before TensorFlow starts.*4 logical CPU"):
        tfshard.virtual_devices(2)


def test_virtual_devices_repeating_the_current_split_is_harmless():
    assert tfshard.virtual_devices(4) == CPUS
    assert tfshard.virtual_devices(np.int64(4), " cpu ") == CPUS  # a NumPy integer is an int


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        ((0,), {}, r"n=0\): n is the number of devices"),
        ((-2,), {}, r"n=-2\)"),
        ((2.0,), {}, r"n=2.0\)"),
        ((2, "GPU"), {}, "splitting a GPU needs memory_limit_mb"),
        ((2, "CPU"), {"memory_limit_mb": 100}, "a memory limit applies to GPUs only"),
        ((2, None), {}, r"virtual_devices\(2, device_type=None\): TensorFlow splits a 'CPU' or"),
        ((2, 3), {}, r"device_type=3\): TensorFlow splits a 'CPU' or a 'GPU'"),
        ((2, "TPU"), {}, r"device_type='TPU'\)"),
        ((2, "GPU", "1024"), {}, r"memory_limit_mb='1024'\): give the memory of each logical"),
        ((2, "GPU", -5), {}, r"memory_limit_mb=-5\): give the memory .* an int >= 1"),
        ((2, "GPU", 0), {}, r"memory_limit_mb=0\)"),
        ((2, "GPU", 1024.0), {}, r"memory_limit_mb=1024\.0\)"),
        ((2, "GPU", True), {}, r"memory_limit_mb=True\)"),
        ((np.bool_(True),), {}, r"n=np\.True_\): n is the number"),
    ],
)
def test_virtual_devices_rejects_bad_arguments(args, kwargs, message):
    with pytest.raises(ArgumentError, match=message):
        tfshard.virtual_devices(*args, **kwargs)


def test_virtual_gpus_without_a_gpu_say_so():
    if tfshard.num_gpus():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match="this machine has no visible GPU"):
        tfshard.virtual_devices(2, "GPU", memory_limit_mb=1024)


def test_virtual_devices_before_start_splits_the_cpu(before_the_runtime_starts):
    out, _ = before_the_runtime_starts
    # num_gpus, try_gpu and try_all_gpus read the configuration only: the split still works.
    names = str(["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"])
    assert out[1:2] + out[3:5] == ["0 /device:CPU:0 True", names, names]


# -------------------------------------------------------------- transfers


def test_to_device_returns_the_same_object_when_already_there():
    with tf.device("/device:CPU:2"):
        x = tf.constant([1.0, 2.0])
    assert tfshard.to_device(x, "cpu:2") is x
    nested = {"a": x, "b": (x, x)}
    assert tfshard.to_device(nested, "/device:CPU:2") is nested


def test_to_device_copies_to_another_device():
    x = tf.constant([1.0, 2.0])
    y = tfshard.to_device(x, "cpu:3")
    assert y is not x
    assert y.device.endswith("/device:CPU:3")
    np.testing.assert_array_equal(y.numpy(), x.numpy())


def test_to_device_copies_only_what_is_elsewhere_in_a_structure():
    with tf.device("/device:CPU:1"):
        here = tf.constant([1])
    there = tf.constant([2])
    out = tfshard.to_device({"here": here, "there": [there]}, "cpu:1")
    assert out["here"] is here
    assert out["there"][0].device.endswith("CPU:1")
    assert out["there"][0].numpy().tolist() == [2]


def test_to_device_converts_numpy_and_copies_variables_and_ragged():
    out = tfshard.to_device(np.arange(3), "cpu:2")
    assert isinstance(out, tf.Tensor) and out.device.endswith("CPU:2")
    v = tf.Variable([1.0, 2.0])
    copied = tfshard.to_device(v, "cpu:1")
    assert copied.device.endswith("CPU:1") and copied.numpy().tolist() == [1.0, 2.0]
    rt = tf.ragged.constant([[1, 2], [3]])
    moved = tfshard.to_device(rt, "cpu:3")
    assert moved.flat_values.device.endswith("CPU:3")
    assert moved.to_list() == [[1, 2], [3]]


@pytest.mark.parametrize(
    "x, message",
    [
        (None, r"to_device: x is of type NoneType, which is no tensor; pass a tensor"),
        ({1, 2}, r"x is of type set, which is no tensor"),
        (lambda: 0, r"x is of type function, which is no tensor"),
        ([1.0, None], r"x holds None, which is of type NoneType, which is no tensor"),
        ({"a": object()}, r"x holds <object object .*>, which is of type object"),
    ],
)
def test_to_device_refuses_what_is_no_tensor(x, message):
    with pytest.raises(ArgumentError, match=message):
        tfshard.to_device(x, "cpu:1")


def test_to_device_inside_a_function_places_an_identity():
    @tf.function
    def f(x):
        return tfshard.to_device(x, "cpu:3") * 2

    graph = f.get_concrete_function(tf.TensorSpec([2])).graph
    devices = {op.device for op in graph.get_operations() if op.type == "Identity"}
    assert "/device:CPU:3" in devices
    assert f(tf.constant([1.0, 2.0])).numpy().tolist() == [2.0, 4.0]


def test_pin_resolves_and_places():
    with tfshard.use_contexts("dev0->cpu:2", log=False), tfshard.pin("dev0") as name:
        y = tf.constant([1.0]) + 1.0
    assert name == "/device:CPU:2"
    assert y.device.endswith("/device:CPU:2")


def test_pin_rejects_unknown_devices_before_entering():
    with pytest.raises(DeviceError), tfshard.pin("cpu:11"):
        pass


def test_use_contexts_is_per_thread_above_the_process_wide_map(monkeypatch):
    # Like tf.device: a block in one thread must not rename devices in another.
    monkeypatch.setenv("TFSHARD_CONTEXTS", "dev0->cpu:1")
    inside, checked = threading.Event(), threading.Event()
    seen = {}

    def block():
        with tfshard.use_contexts("dev0->cpu:3", log=False):
            inside.set()
            checked.wait(timeout=30)
            seen["block"] = tfshard.resolve_device("dev0")

    thread = threading.Thread(target=block)
    thread.start()
    try:
        assert inside.wait(timeout=30)
        seen["env"] = tfshard.resolve_device("dev0")
        tfshard.set_contexts("dev0->cpu:2", log=False)  # Every thread, below its blocks.
        seen["process"] = tfshard.resolve_device("dev0")
    finally:
        checked.set()
        thread.join(timeout=30)
    assert seen == {"env": "/device:CPU:1", "process": "/device:CPU:2", "block": "/device:CPU:3"}
    assert tfshard.resolve_device("dev0") == "/device:CPU:2"


@pytest.mark.parametrize(
    "name",
    [
        "/device:CPU:1",
        "device:cpu:1",
        "worker0:cpu:0",
        "cpu:1",
        "gpu",
        "/cpu:1",
        "/gpu:0",
        "TPU:0",
        "xla_cpu",
        "/job:worker/task:1/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:2",
    ],
)
def test_a_context_name_cannot_spell_a_device(name):
    # Else resolve_device(name) and output_device=name would mean another device.
    with pytest.raises(ContextMapError, match=rf"entry 0 '{re.escape(name)}->cpu:3' .*reads as"):
        tfshard.ContextMap.parse(f"{name}->cpu:3")
    with pytest.raises(ContextMapError, match="choose another name"):
        tfshard.ContextMap({name: "cpu:3"})


def test_reading_the_environment_map_does_not_start_tensorflow(before_the_runtime_starts):
    out, err = before_the_runtime_starts
    # The map was read before the split, and the split still worked.
    assert out[2] == str([("dev0", "cpu:0"), ("dev1", "cpu:1")])
    assert out[3] == str(["/device:CPU:0", "/device:CPU:1", "/device:CPU:2"])
    assert out[5:] == ["/device:CPU:1"]
    # The mappings are still logged, once, when a name is first resolved.
    assert err.count("Mapped name dev1 to device /device:CPU:1") == 1


# ----------------------------------------------------------------- README


def _readme_device_lines() -> list[tuple[str, str]]:
    """README's "Devices by name" snippet: (call, comment) of each resolve_device line."""
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Devices by name, not by card", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    lines = [line.partition("#") for line in snippet.splitlines()]
    return [(c.strip(), n.strip()) for c, _, n in lines if c.startswith("tfshard.resolve_device(")]


def test_the_readme_device_names_say_what_resolve_device_gives_here():
    # Whatever this machine has: 4 logical CPUs here, GPUs on a GPU machine.
    checked = _readme_device_lines()
    assert checked
    for call, comment in checked:
        claimed = re.findall(r"'(/device:[A-Z]+:\d+)'", comment)
        try:
            got = eval(call, {"tfshard": tfshard})  # The README's own line, as a reader runs it.
        except DeviceError:
            assert "else DeviceError" in comment, (call, comment)
            assert tfshard.num_gpus() < 2, (call, comment)
        else:
            assert got == claimed[0], (call, comment)
