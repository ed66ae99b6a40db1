"""The contract between a HuggingFace architecture and jaxmllm's parameters.

A `Family` (one per architecture: Llama, Qwen2, SigLIP, the Qwen2-VL vision tower, the Whisper
encoder) says three things:

- which config section it fills and how: `section(hf_config) -> dict` of our config keys (and
  `to_hf_config(cfg) -> dict` back), refusing what jaxmllm cannot run with the key named;
- which tensors are whose: `links(cfg)`, each `Link` a few HF tensors <-> a few of our
  parameters with the layout change both ways (a torch Linear is [out, in], ours [in, out...];
  a per-layer HF tensor is one slice of our [depth, ...] stacked parameter);
- which HF tensors it knowingly leaves alone (`skipped`: a SigLIP pooling head, a text tower,
  Whisper's decoder), so that every other tensor must be consumed.

Paths of our parameters are "/"-joined from the model's root ("llm/transformer/blocks/attn/
query/kernel"), as `nnx.to_pure_dict` nests them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxmllm.config.checks import UserError
from jaxmllm.models.layers import UNBOUNDED

Transform = Callable[..., tuple[np.ndarray, ...]]


class FamilyError(UserError):
    """A HF checkpoint jaxmllm cannot use as it is; the message names the key or tensor."""


@dataclasses.dataclass(frozen=True)
class Link:
    """HF tensors <-> our parameters; `{i}` in a HF name is the layer of a stacked parameter.

    `to_ours(*hf_arrays) -> our arrays` and `to_hf(*our_arrays) -> hf arrays`, one layer at a
    time when `layers` > 0 (our parameters then have a leading [layers] axis). Row j of ours is
    the checkpoint's layer `layer_ids[j]` (default j: a stack of every layer; a mixture of
    experts stacks its MoE layers and its dense ones apart). `stored_as(shape)`: the other
    shapes a HF tensor of `shape` (as `to_hf` writes it) may be stored in and `to_ours` tells
    apart (the hub's Qwen3-VL-MoE experts, transposed); any other shape is refused on load.
    """

    hf: tuple[str, ...]
    ours: tuple[str, ...]
    to_ours: Transform
    to_hf: Transform
    layers: int = 0
    layer_ids: tuple[int, ...] = ()
    stored_as: Callable[[tuple[int, ...]], tuple[tuple[int, ...], ...]] | None = None
    # ±inf is a value of its HF tensors (a clipped linear's "no bound"), not damage: only NaN
    # is refused on load
    infinite: bool = False

    def hf_layer(self, row: int) -> int:
        """The checkpoint's layer number of row `row` of our stacked parameters."""
        return self.layer_ids[row] if self.layer_ids else row

    def hf_names(self, layer: int | None = None) -> tuple[str, ...]:
        """The HF names of row `layer` of ours (None or unstacked: the names as they are)."""
        if not self.layers:
            return self.hf
        return tuple(n.format(i=self.hf_layer(layer)) for n in self.hf)


class Family:
    """One HF architecture (see the module docstring); subclasses fill in the three parts."""

    name: str = ""  # what the CLI and errors call it
    model_types: tuple[str, ...] = ()  # config.json model_type values it reads
    role: str = ""  # llm | vision | audio: the config section it fills
    hf_class: str = ""  # the transformers class export writes and check compares against
    # Export writes back the whole imported model with this part replaced (Whisper: its decoder)
    exports_whole: bool = False
    row: Any = None  # its row of the family table (`jaxmllm.hf.table`)

    def __init__(self, row: Any = None):
        """`row`: the family's row of the table (default: the class's), whose name, model
        types, role and transformers class are the family's."""
        row = self.row if row is None else row
        if row is not None:
            self.row, self.name, self.role = row, row.name, row.role
            self.model_types, self.hf_class = row.model_types, row.hf_class

    def section(self, hf: dict) -> dict:
        """Our config keys for this role from a HF config.json (dict)."""
        raise NotImplementedError

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """A HF config.json for our config `cfg` (the whole `Config`); `source` is the imported
        checkpoint's own config.json when it is at hand (its other keys are kept)."""
        raise NotImplementedError

    def links(self, cfg: Any) -> list[Link]:
        """The tensor links for our config (the whole `Config`)."""
        raise NotImplementedError

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options this architecture has a counterpart for, as `mismatches` takes them
        (what a module trained from scratch must have to be exported as this family)."""
        raise NotImplementedError

    def prefix(self, names: Sequence[str]) -> str:
        """The prefix this checkpoint puts before the names `links` uses ("" by default)."""
        return ""

    def for_checkpoint(self, names: Sequence[str], where: str = "") -> Family:
        """This family as it reads a checkpoint whose tensors are `names` (the part's, its
        prefix or not; `where`: the checkpoint, as a refusal names it): where transformers
        reads one architecture's tensors in two layouts (a mixture of experts' experts one
        Linear each or fused), the one `names` hold. Without names (a checkpoint written from
        scratch): the layout transformers saves. Self by default."""
        return self

    def skipped(self, name: str) -> bool:
        """Whether a tensor this family does not use is knowingly left alone."""
        return False

    def runtime(self, name: str) -> str:
        """The name transformers gives the module of a tensor (its checkpoint name without
        `.weight`) in the model it builds: the same for a checkpoint of one part; a whole
        checkpoint's parts nest otherwise (`whole.Part`). PEFT adapters name these."""
        return name

    def checkpoint_name(self, runtime: str) -> str:
        """The inverse of `runtime`."""
        return runtime

    def placed(self, name: str) -> str:
        """The checkpoint's name of a tensor or module its inner family names `name` (a part
        of a whole checkpoint is placed under the whole's names; else `name`)."""
        return name

    def part_of(self, name: str) -> str | None:
        """The role of the part a tensor belongs to in a whole checkpoint; None: one part."""
        return None


# ----------------------------------------------------------------------------- layouts


def same(hf: str, ours: str, layers: int = 0) -> Link:
    """A tensor stored alike on both sides (norm scales, biases of a flat width, tables)."""
    ident = lambda x: (x,)
    return Link((hf,), (ours,), ident, ident, layers)


def dense(hf: str, ours: str, shape: Sequence[int], n_in: int = 1, layers: int = 0) -> Link:
    """A torch Linear weight [out, in] <-> our kernel of `shape` ([in dims..., out dims...],
    the first `n_in` dims being the input's, e.g. [width, heads, head_dim] for a query)."""
    shape = tuple(shape)
    n = math.prod(shape[:n_in])
    return Link(
        (hf,),
        (ours,),
        lambda w: (np.asarray(w).T.reshape(shape),),
        lambda k: (np.asarray(k).reshape(n, -1).T,),
        layers,
    )


def bounds(hf: str, ours: str, layers: int) -> Link:
    """A Gemma4ClippableLinear's four scalar bounds <-> a clipped `layers.Dense`'s `bounds` [4]
    (input min and max, output min and max); its ±inf (no bound) is our ±`UNBOUNDED`, back to
    ±inf on export."""
    keys = ("input_min", "input_max", "output_min", "output_max")

    def to_ours(*b):
        x = np.asarray([np.asarray(v).reshape(()) for v in b], np.float32)
        return (np.where(np.isinf(x), np.sign(x) * UNBOUNDED, x).astype(np.float32),)

    def to_hf(x):
        x = np.asarray(x, np.float32)
        x = np.where(np.abs(x) == UNBOUNDED, np.sign(x) * np.inf, x).astype(np.float32)
        return tuple(x[j].reshape(()) for j in range(4))

    names = tuple(f"{hf}.{k}" for k in keys)
    return Link(names, (ours + "/bounds",), to_ours, to_hf, layers, infinite=True)


def reshaped(hf: str, ours: str, shape: Sequence[int], layers: int = 0) -> Link:
    """A flat HF tensor (a bias of heads x head_dim) <-> ours of `shape`."""
    shape = tuple(shape)
    return Link(
        (hf,),
        (ours,),
        lambda b: (np.asarray(b).reshape(shape),),
        lambda x: (np.asarray(x).reshape(-1),),
        layers,
    )


def permuted(link: Link, perm: np.ndarray) -> Link:
    """`link` with our last axis permuted by `perm` (ours[..., j] = theirs[..., perm[j]])."""
    inverse = np.argsort(perm)
    return dataclasses.replace(
        link,
        to_ours=lambda *a: tuple(x[..., perm] for x in link.to_ours(*a)),
        to_hf=lambda *a: link.to_hf(*(x[..., inverse] for x in a)),
    )


def parts_of(hf: str, ours: Sequence[str], links: Sequence[Link], layers: int = 0) -> Link:
    """One HF tensor whose leading axis concatenates equal parts, each one of ours (a fused
    qkv), each part laid out by the matching single link."""

    def to_ours(w):
        """Each part of the HF tensor as its link lays it out."""
        parts = np.split(np.asarray(w), len(links))
        return tuple(link.to_ours(p)[0] for link, p in zip(links, parts, strict=True))

    def to_hf(*xs):
        """Ours back into the one HF tensor, part after part."""
        return (np.concatenate([link.to_hf(x)[0] for link, x in zip(links, xs, strict=True)]),)

    return Link((hf,), tuple(ours), to_ours, to_hf, layers)


def renamed(link: Link, name: Callable[[str], str]) -> Link:
    """`link` with each HF name `n` as `name(n)` (a part's tensors in a whole checkpoint)."""
    return dataclasses.replace(link, hf=tuple(name(n) for n in link.hf))


def split_rows(hf: str, ours: Sequence[str], rows: int) -> Link:
    """One HF table whose first `rows` rows are one of ours and the rest another (CLIP's
    position table: the class token's row, then the patches')."""
    return Link(
        (hf,),
        tuple(ours),
        lambda t: (np.asarray(t)[:rows].reshape(-1), np.asarray(t)[rows:]),
        lambda a, b: (np.concatenate([np.asarray(a).reshape(rows, -1), np.asarray(b)]),),
    )


# ----------------------------------------------------------------------------- config reading


def read(hf: dict, key: str, where: str, default: Any = ...) -> Any:
    """A key of a HF config, or a FamilyError naming it when it is missing."""
    if key in hf:
        return hf[key]
    if default is ...:
        raise FamilyError(f"{where}: config.json has no {key!r}")
    return default


def refuse_unless(ok: bool, where: str, message: str) -> None:
    """A FamilyError `where: message` unless `ok`."""
    if not ok:
        raise FamilyError(f"{where}: {message}")


def matches(patterns: Sequence[str], name: str) -> bool:
    """Whether a tensor name matches one of a few regular expressions."""
    return any(re.fullmatch(p, name) for p in patterns)


def mismatches(cfg: Any, wants: dict[str, Any], family: str) -> list[str]:
    """The options of `cfg` a HF family has no counterpart for, each naming its key.

    `wants`: config key ("model.vision.mlp") -> the values the family has (a tuple), or
    (predicate, what it has) for a rule.
    """
    out = []
    for key, want in wants.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        if isinstance(want, tuple) and want and callable(want[0]):
            ok, has = want[0](value), want[1]
        else:
            ok, has = value in want, " or ".join(repr(w) for w in want)
        if not ok:
            out.append(f"{key}={value!r} ({family} has {has})")
    return out
