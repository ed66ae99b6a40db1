"""What a lowered program is made of: its matmuls by operand dtype, its scatters by update shape.

The device step should multiply compute-dtype operands only (no fp32 x fp32 dot under bf16
compute) and scatter no row per token; these read the StableHLO text a jitted function lowers
to (`jax.jit(f).lower(...).as_text()`), before XLA's passes, with global (unpartitioned)
shapes and every scan body once. The tests hold the train step to them and `bench.gpu` writes
them beside each step's HLO.
"""

from __future__ import annotations

import collections
import re

_TYPE = r"tensor<([^>]*)>"
_DOT = re.compile(rf"stablehlo\.dot_general.*?\({_TYPE}, {_TYPE}\) -> {_TYPE}")
# A scatter's operation spans its update region; its signature follows the region's end.
_SCATTER = re.compile(rf'"stablehlo\.scatter".*?\}}\) : \({_TYPE}, {_TYPE}, {_TYPE}\)', re.S)


def _dtype(tensor_type: str) -> str:
    """The element type of a StableHLO tensor type's text ('4x8xbf16' -> 'bf16')."""
    return tensor_type.split("x")[-1]


def _shape(tensor_type: str) -> tuple[int, ...]:
    """The dimensions of a StableHLO tensor type's text ('4x8xbf16' -> (4, 8))."""
    return tuple(int(d) for d in tensor_type.split("x")[:-1])


def dot_dtypes(text: str) -> collections.Counter:
    """(lhs, rhs, result) element types -> how many dot_generals have them."""
    found = _DOT.findall(text)
    return collections.Counter(tuple(_dtype(t) for t in types) for types in found)


def scatter_updates(text: str) -> list[tuple[tuple[int, ...], str]]:
    """The shape and element type of every scatter's updates."""
    return [(_shape(updates), _dtype(updates)) for _, _, updates in _SCATTER.findall(text)]


def row_scatters(text: str, tokens: int, width: int) -> list[tuple[int, ...]]:
    """Scatters whose updates are rows of `width` for `tokens` or more positions: one row per
    token (a gather over every token, transposed)."""
    found = []
    for shape, _ in scatter_updates(text):
        if len(shape) >= 2 and shape[-1] == width and _count(shape[:-1]) >= tokens:
            found.append(shape)
    return found


def _count(dims: tuple[int, ...]) -> int:
    """The elements of an array of these dimensions (1 for a scalar)."""
    total = 1
    for d in dims:
        total *= d
    return total


def describe(text: str) -> dict:
    """Counts for a report: dots by dtype, scatters, the program's size."""
    return {
        "dots": {" x ".join(k[:2]) + " -> " + k[2]: v for k, v in dot_dtypes(text).items()},
        "scatters": len(scatter_updates(text)),
        "stablehlo_chars": len(text),
    }
