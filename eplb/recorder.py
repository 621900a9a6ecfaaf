"""`ExpertLoadRecorder`: the expert load of the last W engine steps, on the host.

The model's forward counts, per MoE layer, the (real token, top-k choice) pairs sent to
each physical expert slot (`DecoderOnlyLM.forward_with_expert_counts`); the model runner
fetches those [M, S] int32 counts with the step's sampled tokens (no extra device sync)
and records them here. From the window this module derives what the load balancer and
the metrics need: the load per slot, per logical expert and per EP rank, and the
balancedness of each layer.

Follows vLLM's EPLB (`vllm/distributed/eplb/eplb_state.py`: per-layer per-physical-expert
token counts of each forward pass, a sliding window of `window_size` = 1000 steps,
balancedness = mean / max of the EP ranks' loads) and SGLang's
ExpertDistributionRecorder; the logical load is the input of DeepSeek's EPLB
(github.com/deepseek-ai/EPLB, `rebalance_experts`).

Counts are kept by physical slot, so they are only meaningful for the placement they
were recorded under: after a re-placement, call `reset` (vLLM zeroes its window then).
NumPy only: no JAX, no device work.
"""

from __future__ import annotations

import numpy as np

# vLLM's EPLBConfig.window_size default.
DEFAULT_WINDOW = 1000


def balancedness(load_per_device: np.ndarray) -> np.ndarray | float:
    """Mean over devices / max over devices of the load on each device (vLLM's and
    DeepSeek's balancedness).

    1.0 is perfectly balanced, 1 / ep the worst (all load on one device); no load at
    all counts as balanced (1.0: no device is a straggler).

    load_per_device: [..., ep] >= 0 (summed slot loads per device). Returns [...]
    float64: a float for a 1-D input.
    """
    load = np.asarray(load_per_device, np.float64)
    peak = load.max(-1)
    ratio = np.where(peak > 0, load.mean(-1) / np.where(peak > 0, peak, 1.0), 1.0)
    return float(ratio) if ratio.ndim == 0 else ratio


class ExpertLoadRecorder:
    """Sliding-window sum of per-step expert-slot counts.

    Args:
        num_layers: M, MoE layers (rows of each step's counts).
        num_slots: S, physical expert slots per layer.
        ep: EP ranks the slots are spread over: slot s lives on rank s // (S / ep)
            (`jaxserve.sharding.placement`); 1 on one device.
        window: W, steps the window holds (one engine step, i.e. one device call, is one
            entry; a multi-step decode call's counts are already summed over its steps).

    Raises:
        ValueError: num_layers or num_slots below 1, window below 1, ep below 1 or not
            dividing num_slots (each names the argument).
    """

    def __init__(self, num_layers: int, num_slots: int, ep: int = 1, window: int = DEFAULT_WINDOW):
        if num_layers < 1:
            raise ValueError(f"num_layers: expected >= 1 MoE layers, got {num_layers}")
        if num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1 expert slots, got {num_slots}")
        if window < 1:
            raise ValueError(f"window: expected >= 1 steps, got {window}")
        if ep < 1 or num_slots % ep:
            raise ValueError(f"ep: {ep} EP ranks must be >= 1 and divide num_slots={num_slots}")
        self.num_layers, self.num_slots, self.ep, self.window = num_layers, num_slots, ep, window
        # Ring buffer of the last `window` steps (int32: one step's count is at most the
        # step's tokens x top-k), their running sum, and every count since start-up.
        self._ring = np.zeros((window, num_layers, num_slots), np.int32)
        self._window_sum = np.zeros((num_layers, num_slots), np.int64)
        self._total = np.zeros((num_layers, num_slots), np.int64)
        self._next = 0  # ring index the next step goes to
        self._filled = 0  # steps in the window, <= window
        self.num_steps = 0  # steps recorded since start-up

    def record(self, counts: np.ndarray) -> None:
        """Add one step's counts, dropping the oldest step once the window is full.

        counts: [M, S] non-negative ints, tokens routed to each slot of each MoE layer.

        Raises:
            ValueError: counts of another shape, or negative.
        """
        counts = np.asarray(counts)
        if counts.shape != (self.num_layers, self.num_slots):
            raise ValueError(
                f"counts: expected shape {(self.num_layers, self.num_slots)} "
                f"(MoE layers, expert slots), got {counts.shape}"
            )
        if counts.size and counts.min() < 0:
            raise ValueError("counts: token counts must be non-negative")
        slot = self._ring[self._next]
        self._window_sum -= slot  # the step falling out (zeros until the ring is full)
        slot[...] = counts
        self._window_sum += slot
        self._total += slot
        self._next = (self._next + 1) % self.window
        self._filled = min(self._filled + 1, self.window)
        self.num_steps += 1

    def reset(self) -> None:
        """Empty the window (after a re-placement: slot counts of the old placement would
        be charged to the experts now in those slots). The since-start totals stay."""
        self._ring[...] = 0
        self._window_sum[...] = 0
        self._next = self._filled = 0

    @property
    def num_window_steps(self) -> int:
        """Steps in the window now (<= window)."""
        return self._filled

    def slot_load(self) -> np.ndarray:
        """[M, S] int64: tokens routed to each slot of each layer over the window."""
        return self._window_sum.copy()

    def total_slot_load(self) -> np.ndarray:
        """[M, S] int64: tokens routed to each slot since start-up (not windowed)."""
        return self._total.copy()

    def total_routed_tokens(self) -> int:
        """(token, top-k choice) pairs routed since start-up, summed over MoE layers."""
        return int(self._total.sum())

    def expert_load(self, physical_to_logical: np.ndarray, num_experts: int) -> np.ndarray:
        """[M, E] int64: the window's load per logical expert (the sum over its replicas),
        the input of DeepSeek's `rebalance_experts`.

        physical_to_logical: [S] (one placement for every layer) or [M, S] ints in
            [0, num_experts): the logical expert of each slot, as in
            `jaxserve.sharding.placement.ExpertPlacement`.

        Raises:
            ValueError: a table of another shape, or an entry outside [0, num_experts).
        """
        p2l = np.asarray(physical_to_logical)
        if p2l.ndim == 1:
            p2l = np.broadcast_to(p2l, (self.num_layers, p2l.shape[0]))
        if p2l.shape != (self.num_layers, self.num_slots):
            raise ValueError(
                f"physical_to_logical: expected shape ({self.num_slots},) or "
                f"{(self.num_layers, self.num_slots)}, got {np.shape(physical_to_logical)}"
            )
        if p2l.size and (p2l.min() < 0 or p2l.max() >= num_experts):
            raise ValueError(f"physical_to_logical: entries must be in [0, {num_experts})")
        load = np.zeros((self.num_layers, num_experts), np.int64)
        rows = np.broadcast_to(np.arange(self.num_layers)[:, None], p2l.shape)
        np.add.at(load, (rows, p2l), self._window_sum)
        return load

    def rank_load(self) -> np.ndarray:
        """[M, ep] int64: the window's load per EP rank (rank d holds slots
        [d * S/ep, (d + 1) * S/ep))."""
        return self._window_sum.reshape(self.num_layers, self.ep, -1).sum(axis=2)

    def balancedness(self) -> np.ndarray:
        """[M] float64 in (0, 1]: per layer, `balancedness` of the EP ranks' window loads
        (1.0 for a layer with no load yet)."""
        return balancedness(self.rank_load())
