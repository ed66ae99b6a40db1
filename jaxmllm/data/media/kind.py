"""What a kind of media is to preprocessing (`MediaKind`): how its files' sizes are read from
their headers, what parts an item becomes in its phase's bucket and how they are decoded.

A contract below both sides: the kinds (`jaxmllm.data.media.kinds`) implement it, the
preprocessor (`jaxmllm.data.preprocess`) calls it, and neither imports the other for it. A kind
is given the parameters of preprocessing (`jaxmllm.data.params.Params`) and the record's
`Limits`, and the state a load shares (`Decoding`), nothing more.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from jaxmllm.data.params import Limits, Params
from jaxmllm.data.samples import Item

if TYPE_CHECKING:
    from jaxmllm.config import Config
    from jaxmllm.data.frame_store import FrameCache

# An item's part in its phase's bucket: (units it takes: patches or frames, the patch grid of
# an image or video frame (rows, cols[, M-RoPE's time step]) or None)
PartOf = tuple[int, tuple | None]


@dataclass
class Decoding:
    """What the loads of one sample share beyond the parameters: videos' frames decoded once
    (data.frame_cache; None: decoded each time) and how each video's were got (`cache_hit`,
    `decoded`, `decoded_<why>`: the sample's `frames`)."""

    frames: FrameCache | None = None
    counts: Counter = field(default_factory=Counter)


class MediaKind(Protocol):
    """A kind of media of the table (`jaxmllm.config.phases.KINDS`) as preprocessing reads it.

    `size` below is the kind's entry of an index row (`size_key`): read from the file's header
    by `read_size`, so the index counts what training decodes.
    """

    size_key: ClassVar[str]  # an index row's key of the kind's sizes, one per item
    size_types: ClassVar[tuple[type, ...]]  # the types of a size's fields
    whole: ClassVar[bool]  # a part is taken whole or not at all (else trimmed to fit)
    pixels: ClassVar[bool]  # data.on_oversize's shrink lowers its pixel budget

    def per_token(self, p: Params) -> int:
        """Units (patches, frames) of the kind's phase per LLM token."""
        ...

    def read_size(self, p: Params, src: Any, record_id: str) -> tuple:
        """The item's size from its file's header; raises RecordError over the caps."""
        ...

    def check(self, p: Params, j: int, size: tuple, record_id: str) -> None:
        """Raises RecordError for item `j` when its phase cannot use it at all."""
        ...

    def parts(self, p: Params, size: tuple, limits: Limits) -> list[PartOf]:
        """The parts an item of `size` becomes in its phase's bucket, within `limits`."""
        ...

    def stamps(self, p: Params, size: tuple, limits: Limits) -> list[float] | None:
        """Each part's time in seconds where it is written before it, else None."""
        ...

    def load(
        self,
        p: Params,
        src: Any,
        size: tuple,
        limits: Limits,
        record_id: str,
        parts: list[int] | None = None,
        item: int = 0,
        decoding: Decoding | None = None,
    ) -> list[Item | None]:
        """The item's parts decoded (`parts`: these only, the others None; None = all), checked
        against `size`; `item`: its number in the record."""
        ...


class PhaseMedia(MediaKind, Protocol):
    """A phase's own kind of media (images for vision, clips for audio), which also says how
    large one of the phase's items can be (what sizes its bucket)."""

    def largest(self, cfg: Config) -> int:
        """The most units (patches, frames) one of the phase's items can have."""
        ...
