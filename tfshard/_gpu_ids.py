"""How ``nvidia-smi``, CUDA and TensorFlow number the same GPUs.

``nvidia-smi`` numbers GPUs in PCI bus order. TensorFlow's ``GPU:N`` is CUDA's device N,
which follows ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``.
`tfshard.utilization.GpuReading.device` is filled in by these rules (CUDA's, as PyTorch's
``torch.cuda`` also reimplements them):

- ``CUDA_VISIBLE_DEVICES`` unset: every GPU is visible, in CUDA order.
- Set: a comma-separated list, and the i-th entry that parses becomes ``GPU:i``. The kind of
  the first entry sets the kind of the list:

  - indices (``"2,0"``): read like C's ``strtoul`` (``"1gpu"`` is 1); an index refers to CUDA
    order, not to ``nvidia-smi``'s;
  - UUIDs (``"GPU-8f3a..."``): any prefix that starts with ``GPU-`` and names one GPU;
  - MIG instances (``"MIG-..."``): each takes a ``GPU:i`` slot but is a slice of a GPU, so no
    whole-GPU reading maps to it.

  Parsing stops at the first entry that is invalid (negative, out of range, an ambiguous or
  unknown UUID, an entry of another kind); a repeated GPU hides every GPU; an empty value
  hides every GPU.
- ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA order is ``nvidia-smi`` order.
- Otherwise CUDA orders ``FASTEST_FIRST``, by a heuristic NVIDIA does not specify, breaking
  ties in PCI order. When every GPU on the machine has the same name (one model), that is
  ``nvidia-smi`` order. With mixed models the order is not knowable from ``nvidia-smi``, so
  GPUs reached through an index (or through an unset ``CUDA_VISIBLE_DEVICES``) get
  ``device=None`` rather than a guess; UUID entries still map exactly. Set
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (or use UUIDs) to make the mapping exact.

What the mapping does not see: ``tf.config.set_visible_devices`` calls inside a process, GPUs
TensorFlow skips (too old a compute capability), which shift later ``GPU:N`` names, and MIG
mode with ``CUDA_VISIBLE_DEVICES`` unset. It assumes the text lists every GPU on the machine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Protocol


class Gpu(Protocol):
    """A GPU as ``nvidia-smi`` lists it (`tfshard.utilization.GpuReading` is one)."""

    @property
    def index(self) -> int: ...

    @property
    def uuid(self) -> str | None: ...

    @property
    def name(self) -> str | None: ...


def tf_device_names(gpus: Sequence[Gpu], environ: Mapping[str, str]) -> dict[int, str]:
    """Maps nvidia-smi index to TensorFlow device name by the rules in the module docstring.

    Args:
        gpus: Every GPU on the machine, as nvidia-smi lists them.
        environ: The environment of the process whose names are wanted.

    Returns:
        ``{nvidia-smi index: "/device:GPU:N"}`` for each GPU that process sees.
    """
    by_index = sorted(gpus, key=lambda r: r.index)
    pci_order = environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    one_model = len({r.name for r in by_index}) <= 1 and all(r.name for r in by_index)
    # CUDA's own order of the GPUs, or None when it cannot be known from nvidia-smi.
    cuda_order = by_index if pci_order or one_model else None
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        visible = list(cuda_order) if cuda_order is not None else []
    else:
        visible = _visible(spec, by_index, cuda_order)
    return {
        gpu.index: f"/device:GPU:{ordinal}"
        for ordinal, gpu in enumerate(visible)
        if gpu is not None
    }


def _visible(spec: str, gpus: Sequence[Gpu], cuda_order: Sequence[Gpu] | None) -> list[Gpu | None]:
    """Applies CUDA_VISIBLE_DEVICES: entry i is the GPU that becomes GPU:i (None: unknown)."""
    visible: list[Gpu | None] = []
    seen: set[object] = set()
    kind = "GPU-" if spec.startswith("GPU-") else "MIG-" if spec.startswith("MIG-") else None
    for raw in spec.split(","):
        key: object
        if kind is None:
            ordinal = _strtoul(raw.strip())
            if ordinal < 0 or ordinal >= len(gpus):
                break
            key = ordinal
            gpu = cuda_order[ordinal] if cuda_order is not None else None
        elif not raw.startswith(kind):
            break
        elif kind == "MIG-":
            # A MIG instance is its own CUDA device, not the whole GPU nvidia-smi reports.
            key, gpu = raw, None
        else:
            matches = [g for g in gpus if g.uuid is not None and g.uuid.startswith(raw)]
            if len(matches) != 1:
                break
            gpu = matches[0]
            key = gpu.index
        if key in seen:
            return []
        seen.add(key)
        visible.append(gpu)
    return visible


def _strtoul(text: str) -> int:
    """The leading integer of text, sign included, or -1 when it starts with no digits.

    C's strtoul, which CUDA uses, reads "1gpu" as 1 and stops there; a negative entry ends the
    list either way.
    """
    match = re.match(r"[+-]?[0-9]+", text)
    return int(match.group()) if match else -1
