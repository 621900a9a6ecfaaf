"""HF checkpoint tensor names <-> model parameter paths: the vocabulary of name maps.

A family declares one `WeightSpec` per parameter: its path in the NNX state and the
checkpoint layouts it may come from (e.g. per-expert tensors or the fused transformers
5.x experts). Each layout says which HF tensors it reads, their expected shapes, how to
turn them into the parameter (`to_param`) and, for the layout written on export, the
inverse (`from_param`). HF `nn.Linear` stores [out, in]; parameters here are [in, out].
Arrays are NumPy (host) arrays; the loader casts and places them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

ParamPath = tuple[str | int, ...]


@dataclass(frozen=True)
class CheckpointLayout:
    """One way a parameter is stored in a checkpoint.

    names: HF tensor names read (all must be present for this layout to apply).
    shapes: the expected shape of each, in the same order.
    to_param: the HF tensors (in `names` order) -> the parameter value.
    from_param: the parameter value -> the HF tensors; None if this layout is read-only.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    to_param: Callable[[list[np.ndarray]], np.ndarray]
    from_param: Callable[[np.ndarray], list[np.ndarray]] | None = None


@dataclass(frozen=True)
class WeightSpec:
    """A parameter and its checkpoint layouts; the first layout present wins on load, the
    first with `from_param` is written on export."""

    path: ParamPath
    layouts: tuple[CheckpointLayout, ...]


def one(path: ParamPath, layout: CheckpointLayout) -> WeightSpec:
    """A parameter stored in a single layout."""
    return WeightSpec(path, (layout,))


def copy(name: str, shape: tuple[int, ...]) -> CheckpointLayout:
    """A tensor stored as-is (norm weights, the embedding)."""
    return CheckpointLayout((name,), (shape,), lambda ts: ts[0], lambda p: [p])


def bias(name: str, param_shape: tuple[int, ...]) -> CheckpointLayout:
    """An HF Linear bias [out] reshaped to `param_shape` (e.g. [heads, head_dim])."""
    size = 1
    for n in param_shape:
        size *= n
    return CheckpointLayout(
        (name,), ((size,),), lambda ts: ts[0].reshape(param_shape), lambda p: [p.reshape(-1)]
    )


def linear(name: str, out_features: int, in_features: int, param_shape: tuple[int, ...]):
    """An HF Linear weight [out, in] stored transposed as [in, out], then reshaped to
    `param_shape` (e.g. [embed, heads, head_dim] for q_proj)."""

    def to_param(ts: list[np.ndarray]) -> np.ndarray:
        return ts[0].T.reshape(param_shape)

    def from_param(p: np.ndarray) -> list[np.ndarray]:
        return [np.ascontiguousarray(p.reshape(in_features, out_features).T)]

    return CheckpointLayout((name,), ((out_features, in_features),), to_param, from_param)


def stacked_experts(names: Sequence[str], out_features: int, in_features: int):
    """Per-expert HF Linear weights [out, in] (one tensor per expert) stacked into
    [E, in, out]."""

    def to_param(ts: list[np.ndarray]) -> np.ndarray:
        return np.stack([t.T for t in ts])

    def from_param(p: np.ndarray) -> list[np.ndarray]:
        return [np.ascontiguousarray(p[e].T) for e in range(p.shape[0])]

    shapes = ((out_features, in_features),) * len(names)
    return CheckpointLayout(tuple(names), shapes, to_param, from_param)


def fused_gate_up(name: str, num_experts: int, inter: int, hidden: int, half: int):
    """One half of transformers 5.x fused `experts.gate_up_proj` [E, 2*inter, hidden]
    (gate first, then up, as `chunk(2)` splits it) -> [E, hidden, inter]. Read-only."""

    def to_param(ts: list[np.ndarray]) -> np.ndarray:
        return np.ascontiguousarray(
            ts[0][:, half * inter : (half + 1) * inter, :].transpose(0, 2, 1)
        )

    return CheckpointLayout((name,), ((num_experts, 2 * inter, hidden),), to_param)


def fused_down(name: str, num_experts: int, inter: int, hidden: int):
    """transformers 5.x fused `experts.down_proj` [E, hidden, inter] -> [E, inter, hidden].
    Read-only."""

    def to_param(ts: list[np.ndarray]) -> np.ndarray:
        return np.ascontiguousarray(ts[0].transpose(0, 2, 1))

    return CheckpointLayout((name,), ((num_experts, hidden, inter),), to_param)


def path_str(path: ParamPath) -> str:
    """'layers.0.self_attn.q_proj' for ('layers', 0, 'self_attn', 'q_proj')."""
    return ".".join(str(p) for p in path)
