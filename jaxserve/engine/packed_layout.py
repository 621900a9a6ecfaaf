"""The arrays one device step takes (`DeviceInputs`) and how they pack into two flat
buffers (`PackedLayout`).

A step moves two host buffers (int32 and float32) to the device instead of ~20 small
arrays, which is most of the host's dispatch cost; the step unpacks them by static
slices. `step_inputs.InputBuilder` fills the arrays through views into the buffers;
`step_fn.step` unpacks them. NumPy on the host, traceable JAX in the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from jaxserve.engine.sampling_metadata import SamplingMetadata
from jaxserve.models.base import AttentionMetadata


@jax.tree_util.register_dataclass
@dataclass
class DeviceInputs:
    """The arrays one step takes (NumPy on the host, jax.Array inside the step).

    tokens, positions: [T] int32; metadata: models/base.py's AttentionMetadata;
    logits_indices: [R] int32, flat index of each row's last token;
    sampling: the sampler's per-row metadata for R rows and history L;
    prompt_next_ids: [P] int32, at flat position t the prompt token that follows it when
        its prompt log-prob is wanted, else -1.
    """

    tokens: np.ndarray
    positions: np.ndarray
    metadata: AttentionMetadata
    logits_indices: np.ndarray
    sampling: SamplingMetadata
    prompt_next_ids: np.ndarray


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where each array of a `DeviceInputs` lives in two flat buffers, int32 and float32
    (uint32 arrays share the int32 buffer bit for bit).

    entries: per pytree leaf, (buffer: "i" or "f", shape, dtype, offset in elements).
    """

    treedef: Any
    entries: tuple[tuple[str, tuple[int, ...], np.dtype, int], ...]
    int_size: int
    float_size: int
    # Per entry (buffer index 0/1, start, end, dtype or None when it is the buffer's,
    # shape or None when 1-D): `views` runs every step, and np.prod, a no-op .view and
    # a no-op .reshape per leaf were most of its ~150 us (23 leaves).
    _cuts: tuple[tuple[int, int, int, np.dtype | None, tuple[int, ...] | None], ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        cuts = []
        for kind, shape, dtype, offset in self.entries:
            buffer_dtype = np.dtype(np.float32 if kind == "f" else np.int32)
            cuts.append(
                (
                    0 if kind == "i" else 1,
                    offset,
                    offset + math.prod(shape),
                    None if dtype == buffer_dtype else dtype,
                    None if len(shape) == 1 else shape,
                )
            )
        object.__setattr__(self, "_cuts", tuple(cuts))

    @classmethod
    def of(cls, template: DeviceInputs) -> PackedLayout:
        """The layout of `template`'s arrays (int32, uint32 or float32 each).

        Raises:
            TypeError: an array of another dtype.
        """
        leaves, treedef = jax.tree.flatten(template)
        entries, sizes = [], {"i": 0, "f": 0}
        for leaf in leaves:
            dtype = np.dtype(leaf.dtype)
            if dtype not in (np.int32, np.uint32, np.float32):
                raise TypeError(f"PackedLayout: {dtype} arrays are not packed")
            kind = "f" if dtype == np.float32 else "i"
            entries.append((kind, tuple(leaf.shape), dtype, sizes[kind]))
            sizes[kind] += leaf.size
        return cls(treedef, tuple(entries), sizes["i"], sizes["f"])

    def pack(self, template: DeviceInputs) -> tuple[np.ndarray, np.ndarray]:
        """`template` copied into fresh (int32 [int_size], float32 [float_size]) buffers."""
        ints = np.empty(self.int_size, np.int32)
        floats = np.empty(self.float_size, np.float32)
        for leaf, view in zip(
            jax.tree.leaves(template), jax.tree.leaves(self.views(ints, floats)), strict=True
        ):
            view[...] = leaf
        return ints, floats

    def views(self, ints: np.ndarray, floats: np.ndarray) -> DeviceInputs:
        """The arrays as views into one rank's buffers ([int_size], [float_size])."""
        bufs = (ints, floats)
        views = []
        for buffer, start, end, dtype, shape in self._cuts:
            view = bufs[buffer][start:end]
            if dtype is not None:
                view = view.view(dtype)
            views.append(view if shape is None else view.reshape(shape))
        return self.treedef.unflatten(views)

    def unpack(self, ints: jax.Array, floats: jax.Array, dp: int = 1) -> DeviceInputs:
        """The arrays back from dp ranks' buffers of this layout concatenated
        ([dp * int_size], [dp * float_size]); each array comes back as the ranks' arrays
        concatenated along its first axis (the DP flat-batch layout). Traceable: static
        slices and bitcasts."""
        bufs = {"i": ints.reshape(dp, -1), "f": floats.reshape(dp, -1)}
        leaves = []
        for kind, shape, dtype, offset in self.entries:
            size = math.prod(shape)
            flat = bufs[kind][:, offset : offset + size]
            if flat.dtype != dtype:
                flat = jax.lax.bitcast_convert_type(flat, dtype)
            leaves.append(flat.reshape((dp * shape[0], *shape[1:])))
        return jax.tree.unflatten(self.treedef, leaves)
