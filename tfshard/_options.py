"""The options of one parallelized function: one frozen value, validated once.

`parallelize` validates what it was given into an `Options` and hands it whole
to `ShardedFunction`, which hands it to its engine; a variant (a method's
per-instance function) is ``dataclasses.replace(options, ...)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tfshard import _plan, collect, pinning
from tfshard.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class Options:
    """What `parallelize` was asked for (see its Args), validated.

    Attributes:
      devices: the device specs as given, or None for every GPU (else CPU);
        resolved when the function first runs.
      weights: integer weights (`_plan.integer_weights`), or None.
      per_sample: vectorise over rows, or call on each shard.
      reduce: the reduction record, or None to gather.
      output_device: the output device's spec as given, or None (the first device).
      broadcast: argument names or positions passed whole to every shard, as
        given (`tfshard._arguments.Arguments` checks them against the function).
      ragged: stack per-sample outputs as ragged tensors.
      jit_compile: compile each shard with XLA.
      allow_duplicate_devices: let two shards share a device.
    """

    devices: tuple[pinning.DeviceSpecLike, ...] | None = None
    weights: tuple[int, ...] | None = None
    per_sample: bool = True
    reduce: collect.Reduction | None = None
    output_device: pinning.DeviceSpecLike | None = None
    broadcast: Any = ()
    ragged: bool = False
    jit_compile: bool = False
    allow_duplicate_devices: bool = False

    @classmethod
    def validated(
        cls,
        *,
        devices: Any,
        weights: Sequence[float] | None,
        per_sample: bool,
        reduce: str | None,
        output_device: pinning.DeviceSpecLike | None,
        broadcast: Sequence[str | int],
        ragged: bool,
        jit_compile: bool,
        allow_duplicate_devices: bool,
    ) -> Options:
        """`parallelize`'s arguments checked, as one value; ArgumentError names a bad one."""
        op = collect.reduction(reduce)
        if ragged and op is not None:
            raise ArgumentError(
                f"ragged=True with reduce={reduce!r}: ragged outputs have no common shape "
                "to reduce; drop one of them"
            )
        if ragged and not per_sample:
            raise ArgumentError(
                "ragged=True needs per_sample=True: with per_sample=False the function "
                "returns its shard's rows itself (return a tf.RaggedTensor to get one)"
            )
        specs = _device_specs(devices)
        integer = _plan.integer_weights(weights)
        if specs is not None and integer is not None and len(specs) != len(integer):
            raise ArgumentError(
                f"weights has {len(integer)} entries but devices has {len(specs)}; "
                "give one weight per device"
            )
        return cls(
            devices=specs,
            weights=integer,
            per_sample=bool(per_sample),
            reduce=op,
            output_device=output_device,
            broadcast=broadcast,
            ragged=bool(ragged),
            jit_compile=bool(jit_compile),
            allow_duplicate_devices=bool(allow_duplicate_devices),
        )

    def resolve(self) -> tuple[tuple[str, ...], str]:
        """The canonical devices and output device (resolved now: context maps apply)."""
        if self.devices is None:
            devices = tuple(pinning.list_devices("GPU") or pinning.list_devices("CPU"))
        else:
            devices = tuple(pinning.resolve_device(d) for d in self.devices)
        if not self.allow_duplicate_devices and len(set(devices)) != len(devices):
            seen: dict[str, int] = {}
            for i, name in enumerate(devices):
                if name in seen:
                    specs = self.devices or devices
                    raise ArgumentError(
                        f"devices[{seen[name]}]={specs[seen[name]]!r} and "
                        f"devices[{i}]={specs[i]!r} are both {name}; two shards "
                        "on one device run one after the other. Remove one, or pass "
                        "allow_duplicate_devices=True if that is what you want (e.g. a "
                        "context map that aliases two names to one card)"
                    )
                seen[name] = i
        if self.weights is not None and len(self.weights) != len(devices):
            raise ArgumentError(
                f"weights has {len(self.weights)} entries but there are {len(devices)} "
                f"devices ({', '.join(devices)}); give one weight per device"
            )
        output = pinning.resolve_device(self.output_device) if self.output_device else devices[0]
        return devices, output


def _device_specs(devices: Any) -> tuple[Any, ...] | None:
    if devices is None:
        return None
    if isinstance(devices, str | int) or not isinstance(devices, Sequence):
        devices = [devices]
    if not devices:
        raise ArgumentError(
            "devices=[]: give at least one device, or devices=None for every "
            "GPU (else every CPU device)"
        )
    return tuple(devices)
