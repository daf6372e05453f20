"""tfshard: run a TensorFlow function on every device at once, with one decorator.

>>> @tfshard.parallelize(devices=["cpu:0", "cpu:1"])
... def square(sample):
...     return sample * sample
>>> square(np.arange(4.0)).numpy()
array([0., 1., 4., 9.])

The public names load lazily (PEP 562), so ``import tfshard`` and
``python -m tfshard.utilization`` do not import TensorFlow until a name that
needs it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tfshard.errors import ArgumentError as ArgumentError
from tfshard.errors import ClusterError as ClusterError
from tfshard.errors import ContextMapError as ContextMapError
from tfshard.errors import DeviceError as DeviceError
from tfshard.errors import DeviceSetupError as DeviceSetupError
from tfshard.errors import ShardError as ShardError
from tfshard.errors import TfshardError as TfshardError
from tfshard.errors import UtilizationError as UtilizationError
from tfshard.errors import WorkerError as WorkerError
from tfshard.errors import WriteError as WriteError

if TYPE_CHECKING:
    from tfshard import processes as processes
    from tfshard import replicas as replicas
    from tfshard import utilization as utilization
    from tfshard.cluster import connect as connect
    from tfshard.parallel import ShardedFunction as ShardedFunction
    from tfshard.parallel import parallelize as parallelize
    from tfshard.pinning import ContextMap as ContextMap
    from tfshard.pinning import active_contexts as active_contexts
    from tfshard.pinning import cpu as cpu
    from tfshard.pinning import gpu as gpu
    from tfshard.pinning import list_devices as list_devices
    from tfshard.pinning import num_gpus as num_gpus
    from tfshard.pinning import pin as pin
    from tfshard.pinning import resolve_device as resolve_device
    from tfshard.pinning import set_contexts as set_contexts
    from tfshard.pinning import to_device as to_device
    from tfshard.pinning import try_all_gpus as try_all_gpus
    from tfshard.pinning import try_gpu as try_gpu
    from tfshard.pinning import use_contexts as use_contexts
    from tfshard.pinning import virtual_devices as virtual_devices
    from tfshard.position import row_index as row_index
    from tfshard.position import shard_index as shard_index
    from tfshard.timeline import Timeline as Timeline
    from tfshard.writing import load as load

__version__ = "0.1.0"

# Public name -> the module that defines it (None: the name is that module).
_LAZY = {
    "ShardedFunction": "tfshard.parallel",
    "parallelize": "tfshard.parallel",
    "ContextMap": "tfshard.pinning",
    "active_contexts": "tfshard.pinning",
    "connect": "tfshard.cluster",
    "cpu": "tfshard.pinning",
    "gpu": "tfshard.pinning",
    "list_devices": "tfshard.pinning",
    "num_gpus": "tfshard.pinning",
    "pin": "tfshard.pinning",
    "resolve_device": "tfshard.pinning",
    "set_contexts": "tfshard.pinning",
    "to_device": "tfshard.pinning",
    "try_all_gpus": "tfshard.pinning",
    "try_gpu": "tfshard.pinning",
    "use_contexts": "tfshard.pinning",
    "virtual_devices": "tfshard.pinning",
    "row_index": "tfshard.position",
    "shard_index": "tfshard.position",
    "Timeline": "tfshard.timeline",
    "load": "tfshard.writing",
    "processes": None,
    "replicas": None,
    "utilization": None,
}

__all__ = (
    "ArgumentError",
    "ClusterError",
    "ContextMap",
    "ContextMapError",
    "DeviceError",
    "DeviceSetupError",
    "ShardError",
    "ShardedFunction",
    "TfshardError",
    "Timeline",
    "UtilizationError",
    "WorkerError",
    "WriteError",
    "active_contexts",
    "connect",
    "cpu",
    "gpu",
    "list_devices",
    "load",
    "num_gpus",
    "parallelize",
    "pin",
    "processes",
    "replicas",
    "resolve_device",
    "row_index",
    "set_contexts",
    "shard_index",
    "to_device",
    "try_all_gpus",
    "try_gpu",
    "use_contexts",
    "utilization",
    "virtual_devices",
)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'tfshard' has no attribute {name!r}")
    module = _LAZY[name]
    value = (
        importlib.import_module(f"tfshard.{name}")
        if module is None
        else getattr(importlib.import_module(module), name)
    )
    globals()[name] = value  # Later lookups skip this function.
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
