"""What a weight held in a CPU kernel's layout shows the model code: the logical array's
`shape`, `dtype` and `ndim`, and `[...]` returning itself (what `nnx.Param[...]` asks of a
value), so the layouts (`cpu_dense.PanelMajor`, `cpu_moe.ExpertPanels`) pass through
the NNX state and `jit` where the plain array was. Each subclass is a pytree whose one
leaf is `panels` and says how its layout maps to the logical array."""

from __future__ import annotations

import jax


class PackedWeight:
    """A weight of logical shape `shape` held as `panels` (a kernel's layout)."""

    panels: jax.Array
    shape: tuple[int, ...]

    @property
    def dtype(self):
        return self.panels.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, index):
        if index is Ellipsis:
            return self
        raise TypeError(f"{type(self).__name__} supports [...] only, got [{index!r}]")
