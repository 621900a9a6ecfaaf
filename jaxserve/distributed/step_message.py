"""The step message: what the leader sends the followers each step, and its bytes.

One message holds a step's decision (RUN, PLACEMENT or STOP), a small metadata map and
the step's packed host inputs as NumPy arrays. The leader serialises it once (`encode`)
and every transport carries those same bytes (`jaxserve.distributed.step_channel`).
The arrays travel as raw buffers (no per-element encoding), and a follower parses each
array layout once (`StepDecoder`): the arrays it returns are views of one buffer.

Wire format: a fixed prefix (`PREFIX`: step, kind, the leader's wall clock at the send,
then the byte sizes of what follows), then the body: the meta map (msgpack), the arrays'
layout (msgpack [(dtype, shape)], its own bytes so that it is parsed once per layout),
the arrays' raw buffers one after the other, each from a multiple of `_ALIGN` bytes into
the body (zero padding between).
No sockets here.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgpack
import numpy as np

RUN = "run"
STOP = "stop"
# A new EPLB expert placement: arrays = [physical_to_logical [M, S] int32]; meta "steps":
# the RUN messages before it. Followers apply it before the next step, as the leader.
PLACEMENT = "placement"
KINDS = (RUN, STOP, PLACEMENT)
# step, kind, sent (time.time()), meta bytes, layout bytes, array bytes (with padding).
PREFIX = struct.Struct("<qBdIII")
_ALIGN = 16
# Layouts a decoder keeps (one per step shape in practice: bounded anyway).
_MAX_LAYOUTS = 4096


@dataclass(frozen=True, slots=True)
class StepMessage:
    """One step's decision: kind (RUN, PLACEMENT or STOP), a small metadata map, the
    input arrays."""

    step: int
    kind: str
    meta: dict
    arrays: list[np.ndarray]


def encode(step: int, arrays: Sequence[np.ndarray], meta: dict | None, kind: str) -> bytes:
    """The bytes of one message (prefix and body), stamped with the wall clock now.

    Raises:
        ValueError: `kind` is not one of KINDS.
    """
    sent = time.time()
    arrays = [np.asarray(a, order="C") for a in arrays]
    packed_meta = msgpack.packb(meta or {})
    layout = msgpack.packb([(a.dtype.str, a.shape) for a in arrays])
    parts = [packed_meta, layout, _padding(len(packed_meta) + len(layout))]
    array_bytes = 0
    for a in arrays:
        parts += (a, _padding(a.nbytes))
        array_bytes += a.nbytes + len(parts[-1])
    prefix = PREFIX.pack(step, KINDS.index(kind), sent, len(packed_meta), len(layout), array_bytes)
    return b"".join([prefix, *parts])


class Header(NamedTuple):
    """A message's prefix, unpacked (`StepDecoder.header`): what to read next
    (`body_bytes`) and where its parts start."""

    step: int
    kind: str
    sent: float  # the leader's time.time() at the send
    meta_bytes: int
    layout_bytes: int
    arrays_offset: int  # where the arrays start in the body (after meta, layout, padding)
    body_bytes: int


class StepDecoder:
    """A follower's decoding of messages: the prefix, then the body into arrays (views of
    the body); each array layout is parsed once."""

    def __init__(self) -> None:
        # Parsed array layouts by their bytes: [(shape, dtype, offset)].
        self._layouts: dict[bytes, list[tuple[tuple, np.dtype, int]]] = {}

    @staticmethod
    def header(prefix) -> Header:
        """Unpack `PREFIX.size` bytes."""
        step, kind, sent, meta_bytes, layout_bytes, array_bytes = PREFIX.unpack(prefix)
        arrays_offset = meta_bytes + layout_bytes
        arrays_offset += len(_padding(arrays_offset))
        return Header(
            step, KINDS[kind], sent, meta_bytes, layout_bytes, arrays_offset,
            arrays_offset + array_bytes,
        )  # fmt: skip

    @staticmethod
    def new_body(header: Header) -> np.ndarray:
        """A fresh buffer for the body (uint8, 16-byte aligned): the arrays are views of it
        and outlive the next message."""
        return np.empty(header.body_bytes, np.uint8)

    def decode(self, header: Header, body: np.ndarray) -> StepMessage:
        """The message of `header` whose body `body` holds."""
        meta = msgpack.unpackb(body[: header.meta_bytes].data)
        layout_key = body[header.meta_bytes : header.meta_bytes + header.layout_bytes].tobytes()
        layout = self._layouts.get(layout_key)
        if layout is None:
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[layout_key] = _parse_layout(layout_key)
        start = header.arrays_offset
        arrays = [np.ndarray(shape, dtype, body, start + offset) for shape, dtype, offset in layout]
        return StepMessage(header.step, header.kind, meta, arrays)


def _parse_layout(packed: bytes) -> list[tuple[tuple, np.dtype, int]]:
    """(shape, dtype, byte offset) of each array of a message, from its packed layout."""
    layout, offset = [], 0
    for dtype_str, shape in msgpack.unpackb(packed):
        dtype, shape = np.dtype(dtype_str), tuple(shape)
        layout.append((shape, dtype, offset))
        nbytes = math.prod(shape) * dtype.itemsize
        offset += nbytes + len(_padding(nbytes))
    return layout


def _padding(nbytes: int) -> bytes:
    """The zero bytes that bring `nbytes` to a multiple of _ALIGN."""
    return bytes(-nbytes % _ALIGN)
