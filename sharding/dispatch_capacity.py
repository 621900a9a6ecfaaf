"""How many rows the expert-parallel dispatch moves per peer, and the bytes that costs.

The all_to_all dispatch (`moe_ep`) moves static buffers: [ep, C, H] per device and
round. Sized for the worst case (C = tokens_per_device * min(top_k, slots_per_device),
every token choosing experts of one device) they are ep * min(k, L) / k times the rows
a step really routes off-device: ~40x at ep = 64 with DeepSeek-V3's shapes. A routing-
sized dispatch (the capacity factor of GShard / Switch Transformer, made drop-free):

- main round: C_main = ceil(capacity_factor * mean) rows per peer, where mean =
  tokens_per_device * top_k / ep is the expected rows from one device to one peer when
  the load is balanced (EPLB keeps it near the mean);
- overflow rounds: the rows past C_main go in further all_to_all rounds of
  B = ceil(OVERFLOW_FRACTION * C_main) rows per peer, as many as the step's largest
  per-peer excess over all devices needs (ceil(excess / B), the excess a `pmax`, so
  every device runs the same number of rounds and the collectives meet); none when no
  device overflows. No token is ever dropped, whatever the routing.

One overflow buffer size in a loop, not a `lax.switch` over several sizes: each size
would compile its own copy of the expert FFN (measured: 4-8x the compile time of the
MoE layer on the CPU), while the loop compiles one.

This module holds the sizing and the byte accounting only (no JAX): the dispatch
(`moe_ep`), the benchmark (`scripts/bench_ep.py`) and the test against the compiled
HLO (`tests/test_ep_dispatch.py`) all call it, so the number reported is the buffer used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Default factor over the mean per-peer load for the main round. 1.25: at balanced
# routing with EPLB and >= 256 tokens per device the main round covers a step's busiest
# peer in most steps (see `scripts/bench_ep.py --simulate`).
DEFAULT_CAPACITY_FACTOR = 1.25
# One overflow round's rows per peer, as a fraction of the main round's.
OVERFLOW_FRACTION = 0.25
# Bytes of one dispatched expert id (int32), sent beside each row.
_ID_BYTES = 4


def worst_case_rows(tokens_per_device: int, top_k: int, slots_per_device: int) -> int:
    """Rows one device may have to send one peer in one MoE step: a token's k experts
    are distinct, so at most min(k, slots per device) of them sit on one device."""
    return tokens_per_device * min(top_k, slots_per_device)


@dataclass(frozen=True, slots=True)
class DispatchCapacity:
    """The static buffer sizes of one MoE layer's dispatch, in rows per peer.

    main: rows per peer of the main round (1 <= main <= worst).
    worst: the worst-case rows per peer (`worst_case_rows`).
    overflow: rows per peer of one overflow round (0 when main == worst: nothing can
        overflow).
    ep: devices the layer's experts are spread over.
    """

    main: int
    worst: int
    overflow: int
    ep: int

    @property
    def max_overflow_rounds(self) -> int:
        """Overflow rounds of the worst case (every token on one device's experts)."""
        return -(-(self.worst - self.main) // self.overflow) if self.overflow else 0

    def overflow_rounds(self, excess: int) -> int:
        """Overflow rounds of a step whose largest per-peer excess over `main` (any
        device to any device) is `excess`: ceil(excess / overflow), 0 if excess <= 0.

        Raises:
            ValueError: excess > worst - main (impossible for real routing).
        """
        if excess > self.worst - self.main:
            raise ValueError(
                f"overflow_rounds: excess {excess} > worst - main = {self.worst - self.main}"
            )
        return -(-excess // self.overflow) if excess > 0 else 0


def dispatch_capacity(
    tokens_per_device: int,
    top_k: int,
    ep: int,
    slots_per_device: int,
    capacity_factor: float | None = DEFAULT_CAPACITY_FACTOR,
) -> DispatchCapacity:
    """The buffer sizes for `tokens_per_device` tokens per device (after the tp split).

    capacity_factor: main round = ceil(factor * tokens_per_device * top_k / ep), at
        least 1 row, at most the worst case; an overflow round holds
        ceil(OVERFLOW_FRACTION * main) rows. None = the worst case in one round (the
        buffers of the dispatch before routing-sized capacity).

    Raises:
        ValueError: a size < 1 or capacity_factor <= 0.
    """
    if min(tokens_per_device, top_k, ep, slots_per_device) < 1:
        raise ValueError(
            "dispatch_capacity: tokens_per_device, top_k, ep and slots_per_device must be "
            f">= 1, got {tokens_per_device}, {top_k}, {ep}, {slots_per_device}"
        )
    worst = worst_case_rows(tokens_per_device, top_k, slots_per_device)
    if capacity_factor is None:
        return DispatchCapacity(worst, worst, 0, ep)
    if not capacity_factor > 0:
        raise ValueError(f"dispatch_capacity: capacity_factor must be > 0, got {capacity_factor}")
    mean = tokens_per_device * top_k / ep
    main = max(1, min(worst, math.ceil(capacity_factor * mean - 1e-9)))
    overflow = min(worst - main, max(1, math.ceil(OVERFLOW_FRACTION * main)))
    return DispatchCapacity(main, worst, overflow, ep)


def row_bytes(hidden: int, itemsize: int) -> int:
    """Bytes one dispatched row costs its sender: the activation row and its int32
    local expert id out, the result row (same dtype) back."""
    return 2 * hidden * itemsize + _ID_BYTES


def dispatch_bytes_per_device(
    cap: DispatchCapacity, hidden: int, itemsize: int, overflow_rounds: int = 0
) -> int:
    """Bytes one device sends to the other ep - 1 devices in one MoE layer step: every
    round's buffers, padding included (the chunk a device keeps for itself is not sent).
    The one-int32 pmax that sets the number of overflow rounds is not counted.

    overflow_rounds: this step's (`cap.overflow_rounds(excess)`), 0 if none.
    """
    rows = cap.main + overflow_rounds * cap.overflow
    return (cap.ep - 1) * rows * row_bytes(hidden, itemsize)


def ideal_bytes_per_device(rows_off_device: float, hidden: int, itemsize: int) -> float:
    """Bytes a dispatch that moves exactly the routed rows would send for
    `rows_off_device` rows routed from one device to the others."""
    return rows_off_device * row_bytes(hidden, itemsize)


def ragged_bytes_per_device(rows_off_device: int, hidden: int, itemsize: int, ep: int) -> int:
    """Bytes one device sends in one MoE layer step of the ragged dispatch
    (`moe_ragged`, GPU): its routed rows out and back, plus three all_to_alls of [ep]
    int32 (per-peer counts, receive offsets, send offsets) to the other ep - 1 devices."""
    return rows_off_device * row_bytes(hidden, itemsize) + 3 * (ep - 1) * _ID_BYTES
