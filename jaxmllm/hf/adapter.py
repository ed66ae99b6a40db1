"""PEFT LoRA adapters in and out: `adapter_config.json` + `adapter_model.safetensors`.

Our adapters (`lora_a` [in..., r], `lora_b` [r, out...] beside a kernel, the update scaled by
alpha / r) and PEFT's (`<module>.lora_A.weight` [r, in], `<module>.lora_B.weight` [out, r]
beside a torch Linear, scaled by lora_alpha / r) hold the same update once their rows and
columns are laid out alike. The family's link that carries the kernel says how: `index_maps`
runs the link's own layout change on index arrays to learn which HF row and column each of our
kernel's outputs and inputs is, so every layout a family knows (a transposed Linear, heads
split out of a width, Qwen2-VL's fused qkv with its rotary permutation) carries adapters with
no table of its own. A Linear that holds several of our kernels (a fused qkv) gets one adapter
of their summed rank: A stacks theirs, B places each one's rows (exact both ways; on the way in
each of our kernels takes the shared A and its rows of B).

Keys are PEFT's: `base_model.model.<module>.lora_A.weight`, the module named as transformers
(5) builds the model (`Family.runtime`: `model.language_model.layers.0.self_attn.q_proj` in a
Qwen2-VL); reading also takes the checkpoint's own names (older PEFT). `target_modules` is one
regular expression matching exactly the adapted modules (a LLaVA's LLM and CLIP tower both
have q_proj). Whole modules trained beside the adapters (a projector) go in as PEFT's
`modules_to_save`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from jaxmllm.hf.family import Family, FamilyError, Link
from jaxmllm.hf.safetensors import CheckpointError, SafetensorsFile, write_file

log = logging.getLogger("jaxmllm")
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
A, B = "lora_A.weight", "lora_B.weight"


@dataclasses.dataclass(frozen=True)
class Module:
    """One HF Linear with an adapter: its weight's link and the kernels of ours it holds."""

    name: str  # the checkpoint's name of its weight, less `.weight` (`{i}`: its layer)
    runtime: str  # the module's name in the model transformers builds (`{i}`)
    link: Link
    kernels: tuple[int, ...]  # which of link.ours carry adapters (all that map into it)

    def names(self, layer: int | None) -> tuple[str, str]:
        """(runtime, checkpoint) names of its module at row `layer` of our stacked kernels."""
        if layer is None:
            return self.runtime, self.name
        i = self.link.hf_layer(layer)
        return self.runtime.format(i=i), self.name.format(i=i)

    def pattern(self) -> str:
        """A regular expression of its runtime names, at each of our layers (a LLaVA tower's
        blocks after its feature layer have none)."""
        ids = map(self.link.hf_layer, range(self.link.layers))
        layers = "(?:" + "|".join(map(str, ids)) + ")"
        return re.escape(self.runtime).replace(r"\{i\}", layers)


def modules(
    families: Iterable[tuple[Family, str]],
    cfg: Any,
    hf: dict | None,
    adapted: set,
    linear_only: bool = False,
):
    """The HF modules that hold adapted kernels (`adapted`: our kernels' paths with adapters),
    of each (family, prefix): the prefix is what the written checkpoint puts before the
    family's names. A kernel whose tensor is not one Linear's weight (Gemma 3's projector:
    a bare parameter) has no PEFT module: skipped where `linear_only` (reading an adapter, which
    cannot hold one), else refused.

    Raises:
      FamilyError: an adapted kernel no PEFT module holds (not `linear_only`), naming it."""
    out = []
    for family, prefix in families:
        for link in family.links(cfg, hf):
            hit = tuple(k for k, p in enumerate(link.ours) if p in adapted)
            if not hit:
                continue
            if len(link.hf) != 1 or not link.hf[0].endswith(".weight"):
                if linear_only:
                    continue
                raise FamilyError(
                    f"{link.hf[0]}: not one Linear's weight, so no PEFT adapter maps onto it; "
                    "export with --merged (the adapters merged into the weights), or train "
                    "without an adapter there (model.*.lora.targets)"
                )
            name = prefix + link.hf[0].removesuffix(".weight")
            out.append(Module(name, family.runtime(name), link, hit))
    return out


# ----------------------------------------------------------------------------- layouts


def index_maps(link: Link, shapes: list[tuple[int, ...]], n_in: list[int]) -> tuple:
    """((O, I) of the HF weight, [(out_src, in_src) per kernel]): for each of our kernels
    (one layer's `shapes`, `n_in` leading input dims) the HF row of each of its outputs and
    the HF column of each of its inputs, flattened. Raises FamilyError for a link whose
    layout mixes rows and columns (no adapter maps through it)."""
    (w,) = link.to_hf(*[np.zeros(s, np.float32) for s in shapes])
    o, i = w.shape
    kind = np.int32 if max(o, i) < 2**31 else np.int64
    rows = link.to_ours(np.broadcast_to(np.arange(o, dtype=kind)[:, None], (o, i)))
    cols = link.to_ours(np.broadcast_to(np.arange(i, dtype=kind)[None, :], (o, i)))
    maps = []
    for shape, k_in, r, c in zip(shapes, n_in, rows, cols, strict=True):
        fan_in = math.prod(shape[:k_in])
        r, c = np.asarray(r).reshape(fan_in, -1), np.asarray(c).reshape(fan_in, -1)
        out_src, in_src = r[0], c[:, 0]
        if not ((r == out_src).all() and (c == in_src[:, None]).all()):
            raise FamilyError(f"{link.hf[0]}: its layout mixes rows and columns: no adapter maps")
        if not np.array_equal(np.sort(in_src), np.arange(i)):
            raise FamilyError(f"{link.hf[0]}: a kernel of ours reads part of its inputs")
        maps.append((out_src, in_src))
    return (o, i), maps


# ----------------------------------------------------------------------------- out


def adapter_tensors(mod: Module, flat: dict, scales: dict) -> tuple[dict, int, float]:
    """A module's PEFT tensors (runtime names, every layer), its rank and its scale."""
    paths = [mod.link.ours[k] for k in mod.kernels]
    a = [np.asarray(flat[_sibling(p, "lora_a")], np.float32) for p in paths]
    b = [np.asarray(flat[_sibling(p, "lora_b")], np.float32) for p in paths]
    layers = mod.link.layers
    one = lambda x: x[1:] if layers else x
    shapes = [one(flat[p].shape) for p in mod.link.ours]
    n_in = [0] * len(mod.link.ours)
    for k, x in zip(mod.kernels, a, strict=True):
        n_in[k] = len(one(x.shape)) - 1
    n_in = [n or 1 for n in n_in]
    (o, i), maps = index_maps(mod.link, shapes, n_in)
    scale = {scales[p.split("/")[0]] for p in paths}
    if len(scale) != 1:
        raise FamilyError(f"{mod.name}: its kernels' adapters scale differently: {scale}")
    out = {}
    for layer in range(layers) if layers else [None]:
        a_hf, b_hf = [], []
        for k, ak, bk in zip(mod.kernels, a, b, strict=True):
            out_src, in_src = maps[k]
            ak, bk = (ak[layer], bk[layer]) if layers else (ak, bk)
            r = ak.shape[-1]
            a_rows = np.zeros((r, i), np.float32)
            a_rows[:, in_src] = ak.reshape(-1, r).T
            b_cols = np.zeros((o, r), np.float32)
            b_cols[out_src] = bk.reshape(r, -1).T
            a_hf.append(a_rows)
            b_hf.append(b_cols)
        runtime, _ = mod.names(layer)
        out[f"{PREFIX}{runtime}.{A}"] = np.concatenate(a_hf)
        out[f"{PREFIX}{runtime}.{B}"] = np.concatenate(b_hf, axis=1)
    rank = sum(x.shape[-1] for x in a)
    return out, rank, scale.pop()


def _sibling(kernel: str, leaf: str) -> str:
    return kernel.rsplit("/", 1)[0] + "/" + leaf


def write_adapter(
    directory: Path,
    mods: list[Module],
    flat: dict,
    scales: dict,
    dropout: float,
    saved: dict[str, np.ndarray],
    base: str,
    experts: dict | None = None,
) -> None:
    """`adapter_config.json` and `adapter_model.safetensors` of `mods` (their adapters in
    `flat`, "/"-joined paths; `scales`: alpha / rank per top-level module), `saved`: whole
    modules trained beside them (runtime tensor names -> arrays: `modules_to_save`);
    `experts`: a mixture of experts' adapters on its stacked experts (PEFT's
    target_parameters: `jaxmllm.hf.experts_adapter`), {tensors, config, rank, alpha}."""
    tensors, ranks = {}, {}
    for mod in mods:
        got, rank, scale = adapter_tensors(mod, flat, scales)
        tensors.update(got)
        ranks[mod.pattern()] = (rank, scale * rank)
    if ranks:
        (r, alpha), _ = Counter(ranks.values()).most_common(1)[0]
    else:  # (the experts' adapters alone)
        r, alpha = experts["rank"], experts["alpha"]
    tensors.update({PREFIX + k: v for k, v in saved.items()})
    params = {}
    if experts is not None:
        tensors.update({PREFIX + k: v for k, v in experts["tensors"].items()})
        params = experts["config"]
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base,
        "r": int(r),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": "(?:" + "|".join(sorted(ranks)) + ")" if ranks else [],
        "target_parameters": params.get("target_parameters"),
        "rank_pattern": {
            **{k: int(v[0]) for k, v in ranks.items() if v != (r, alpha)},
            **params.get("rank_pattern", {}),
        },
        "alpha_pattern": {
            **{k: float(v[1]) for k, v in ranks.items() if v != (r, alpha)},
            **params.get("alpha_pattern", {}),
        },
        "modules_to_save": outermost({n.rsplit(".", 1)[0] for n in saved}) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    directory.mkdir(parents=True, exist_ok=True)
    write_file(directory / WEIGHTS, sorted(tensors.items()))
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def outermost(names: set[str]) -> list[str]:
    """The modules among `names` inside none of the others: PEFT saves a module whole with
    every module under it, and a module listed inside another (Gemma 4's clipped linears:
    the wrapper's bounds and its `.linear`) would be wrapped twice, its tensors found under
    neither name."""
    return sorted(n for n in names if not any(n.startswith(o + ".") for o in names))


# ----------------------------------------------------------------------------- in


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A PEFT adapter directory as read: its config and its tensors by module name."""

    directory: str
    config: dict
    file: SafetensorsFile

    @classmethod
    def read(cls, directory: str) -> Adapter:
        """Raises FamilyError naming the file and what is wrong, or what jaxmllm does not
        read (DoRA, bias adapters, another PEFT method)."""
        where = Path(directory)
        try:
            config = json.loads((where / CONFIG).read_text())
        except OSError:
            raise FamilyError(f"{directory}: no {CONFIG} (not a PEFT adapter directory)") from None
        except ValueError as e:
            raise FamilyError(f"{where / CONFIG}: not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise FamilyError(f"{where / CONFIG}: not a JSON object")
        cls._check(config, where / CONFIG)
        try:
            file = SafetensorsFile(where / WEIGHTS)
        except CheckpointError as e:
            raise FamilyError(f"{directory}: {e}") from None
        return cls(directory, config, file)

    @staticmethod
    def _check(config: dict, path: Path) -> None:
        refuse = lambda ok, what: None if ok else _refuse(f"{path}: {what}")
        kind = config.get("peft_type")
        refuse(kind == "LORA", f"peft_type {kind!r}: jaxmllm reads LoRA adapters (LORA)")
        refuse(not config.get("use_dora"), "use_dora: DoRA adapters are not supported")
        bias = config.get("bias", "none")
        refuse(bias == "none", f"bias {bias!r}: adapters with biases are not supported (none)")
        refuse(not config.get("fan_in_fan_out"), "fan_in_fan_out: only torch Linear layers")
        for key in ("r", "lora_alpha"):
            value = config.get(key)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
            refuse(ok, f"{key} must be a number > 0, got {value!r}")

    def scale(self, runtime: str, rank: int) -> float:
        """PEFT's scale of a module: lora_alpha (its alpha_pattern) / its rank (sqrt with
        rslora)."""
        patterns = self.config.get("alpha_pattern") or {}
        alpha = float(_pattern(patterns, runtime, self.config["lora_alpha"]))
        return alpha / (math.sqrt(rank) if self.config.get("use_rslora") else rank)

    def keys(self) -> list[str]:
        return self.file.names()

    def tensor(self, key: str) -> np.ndarray:
        return np.asarray(self.file.get(key), np.float32)


def _refuse(message: str):
    raise FamilyError(message)


def _pattern(patterns: dict, name: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key whose regex ends the name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def read_module(adapter: Adapter, mod: Module, layers: int) -> list[tuple | None]:
    """Per layer (or the one), (A [R, I], B [O, R], runtime name) of the module in the
    adapter, by its runtime or its checkpoint name; None where the adapter has none."""
    keys = set(adapter.keys())
    out = []
    for layer in range(layers) if layers else [None]:
        found = None
        for name in mod.names(layer):
            if f"{PREFIX}{name}.{A}" in keys and f"{PREFIX}{name}.{B}" in keys:
                a, b = (adapter.tensor(f"{PREFIX}{name}.{leaf}") for leaf in (A, B))
                found = (a, b, mod.names(layer)[0])
                break
        out.append(found)
    return out


def ours_from(mod: Module, layers: list[tuple], shapes: list, n_in: list, directory: str):
    """Our adapters of each adapted kernel of `mod` from its PEFT A [R, I] and B [O, R] of
    every layer (`layers`: (A, B, runtime name) each): per kernel, its (lora_a, lora_b) per
    layer, at PEFT's scale. A Linear holding several kernels (a fused qkv) gives each the rank
    columns its rows of B use when they split the rank into equal disjoint blocks (what
    export writes), else the whole shared rank."""
    (o, i), maps = index_maps(mod.link, shapes, n_in)
    for a_hf, b_hf, runtime in layers:
        rank = a_hf.shape[0]
        if a_hf.shape != (rank, i) or b_hf.shape != (o, rank):
            raise FamilyError(
                f"{directory}: {runtime}'s lora_A {list(a_hf.shape)} and lora_B "
                f"{list(b_hf.shape)} do not fit its weight [{o}, {i}]"
            )
    columns = kernel_columns(mod, [b for _, b, _ in layers], maps)
    out = []
    for k, cols in zip(mod.kernels, columns, strict=True):
        if cols is None:  # (its rows of a fused B are zero where the others' split the rank)
            out.append(None)
            continue
        out_src, in_src = maps[k]
        shape, per = shapes[k], []
        for a_hf, b_hf, _ in layers:
            a = a_hf[cols][:, in_src].T.reshape(*shape[: n_in[k]], len(cols))
            b = b_hf[out_src][:, cols].T.reshape(len(cols), *shape[n_in[k] :])
            per.append((a, b))
        out.append(per)
    return out


def kernel_columns(mod: Module, bs: list[np.ndarray], maps: list) -> list[np.ndarray | None]:
    """Per adapted kernel of `mod`, the rank columns of its adapter (see `ours_from`); None
    for a kernel of a fused Linear whose rows of B are zero in every layer while the others'
    split the rank (export wrote no adapter for it)."""
    rank = bs[0].shape[1]
    whole = [np.arange(rank)] * len(mod.kernels)
    if len(mod.kernels) == 1:
        return whole
    used = []
    for k in mod.kernels:
        nonzero = np.zeros(rank, bool)
        for b in bs:
            nonzero |= np.any(b[maps[k][0]] != 0, axis=0)
        used.append(np.flatnonzero(nonzero))
    live = [u for u in used if len(u)]
    disjoint = live and len(np.unique(np.concatenate(live))) == sum(len(u) for u in live)
    if not (disjoint and len({len(u) for u in live}) == 1):
        return whole
    return [u if len(u) else None for u in used]


def check_targets(adapter: Adapter, names: list[str], adaptable: list[str]) -> None:
    """Refuses an adapter whose `target_modules` name modules the model has no adapter for,
    naming them (`names`: every module name of the model's adaptable matrices, runtime and
    checkpoint, every layer; `adaptable`: their short names, for the message)."""
    targets = adapter.config.get("target_modules")
    if isinstance(targets, str):
        missing = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
    elif isinstance(targets, list):
        hit = lambda t: any(n == t or n.endswith(f".{t}") for n in names)
        missing = [t for t in targets if not hit(t)]
    else:
        missing = []  # (none named: the weights say which)
    if missing:
        raise FamilyError(
            f"{adapter.directory}: target_modules {', '.join(map(repr, missing))} name no module "
            f"this model can put an adapter on (jaxmllm adapts {', '.join(adaptable)}); "
            "adapters on other modules (embeddings, the LM head, convolutions) are not supported"
        )
