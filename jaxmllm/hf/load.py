"""Pretrained HF weights into jaxmllm's sharded parameters, tensor by tensor.

For each `Link` of a family, the HF tensors are read from the memory-mapped checkpoint (one
layer at a time for stacked parameters), laid out as ours, and copied into one host buffer per
distinct shard of the parameter on this process's devices; the buffers are then put on their
devices. So a host holds at most one parameter's local shards plus one HF tensor at a time, a
device only its shard, and nothing is replicated on the host for a replicated parameter.

Every parameter of the modules a checkpoint fills must be filled, and every tensor under the
family's prefix consumed or knowingly skipped (`Family.skipped`): else the import is refused
naming them. A vocabulary larger than the checkpoint's (special tokens the tokenizer added)
starts its new rows at the mean of the checkpoint's rows.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxmllm.hf.family import FamilyError, Link
from jaxmllm.hf.registry import ROLES, family_for, read_hf_config
from jaxmllm.hf.safetensors import Checkpoint, CheckpointError
from jaxmllm.models.lora import is_adapter
from sharding.rules import keyed_leaves

log = logging.getLogger("jaxmllm")
VOCAB_AXIS = {"llm/embed/embedding": 0, "llm/lm_head/kernel": 1}  # may grow past the checkpoint


def pretrained(cfg: Any, abstract: dict, skip: set[str] = frozenset()) -> dict:
    """The parameters `cfg.model.init_from` names, in the shardings of `abstract`.

    Args:
      cfg: the whole config.
      abstract: nested dict of jax.ShapeDtypeStruct (with `.sharding`) of every parameter,
        trained and frozen, keyed as `nnx.to_pure_dict` keys them.
      skip: top-level modules given otherwise (an earlier run's): a checkpoint that would only
        fill those is not read.

    Returns:
      A nested dict of jax.Arrays holding the loaded parameters only ({} with no init_from).

    Raises:
      FamilyError / CheckpointError: naming the config key, the tensor or the parameter.
    """
    flat = keyed_leaves(abstract)
    loaded: dict[str, jax.Array] = {}
    for role in ROLES:
        directory = getattr(cfg.model.init_from, role)
        if directory and not _modules(cfg, role, directory) <= set(skip):
            loaded.update(load_role(cfg, role, directory, flat))
    return nest(loaded)


def _modules(cfg: Any, role: str, directory: str) -> set[str]:
    """The top-level modules a checkpoint fills."""
    hf = read_hf_config(directory)
    links = family_for(role, hf, directory).links(cfg, hf)
    return {p.split("/")[0] for link in links for p in link.ours}


def load_role(cfg: Any, role: str, directory: str, flat: dict) -> dict[str, jax.Array]:
    """One checkpoint's parameters ("/"-joined path -> array) for `role`."""
    key = f"model.init_from.{role}"
    start = time.perf_counter()
    ck, family, prefix, links, consumed = checkpoint_tensors(cfg, role, directory, key)
    out = {}
    fits(role, links, ck, prefix, flat, key)  # (before any allocation)
    grown: dict[str, int] = {}
    for link in links:
        arrays = fill(link, ck, prefix, [flat[p] for p in link.ours], key, grown)
        out.update(zip(link.ours, arrays, strict=True))
    if grown:  # (once for the embedding and the LM head alike)
        log.info(
            "%s: %d new vocabulary rows (tokens the tokenizer added) start at the mean of the "
            "checkpoint's rows (%s)",
            key,
            max(grown.values()),
            ", ".join(grown),
        )
    _check_complete(key, family, ck, prefix, consumed, out, flat)
    _left_alone(cfg, role, family, ck, prefix, consumed)
    elapsed = time.perf_counter() - start
    log.info(
        "%s: %d tensors of %s (%s) into %d parameters in %.1f s",
        key,
        len(consumed),
        directory,
        family.name,
        len(out),
        elapsed,
    )
    return out


def fits(role: str, links: list, ck: Checkpoint, prefix: str, flat: dict, key: str) -> None:
    """Every tensor the links read is of its parameters' size (`flat`: path -> shape), from
    the files' headers alone: what the loader checks before it allocates, and `hf import`
    before it writes a config (a config.json whose sizes are not its tensors' imported with
    exit 0, and training refused it).

    Raises:
      FamilyError: the model has no parameter a link fills.
      CheckpointError: a tensor of another size than its parameters (`check_sizes`).
    """
    for link in links:
        missing = [p for p in link.ours if p not in flat]
        if missing:
            raise FamilyError(
                f"{key}: the model has no parameter {missing[0]} for {link.hf[0]} "
                f"(is model.{role} set as the import wrote it?)"
            )
        check_sizes(link, ck, prefix, [flat[p] for p in link.ours], key)


LAYER_KEYS = ("num_hidden_layers", "depth", "encoder_layers", "num_layers", "n_layer")


def checkpoint_tensors(cfg: Any, role: str, directory: str, key: str) -> tuple:
    """(checkpoint, family, prefix, links, tensor names) of `role` read from `directory` for
    `cfg`: every tensor the family's links name is there (read from the headers: nothing
    loaded), so `hf import` refuses a config.json that claims more layers than its tensors
    hold before the trainer spends minutes building that model.

    Raises:
      CheckpointError: no safetensors (a pytorch_model.bin only, or nothing).
      FamilyError: a tensor missing, naming it (and the layer count and its config.json key
        when a layer past the tensors' last is what is missing).
    """
    hf = read_hf_config(directory)
    ck = Checkpoint(directory)
    family = family_for(role, hf, f"{key}={directory}", ck.names())
    prefix = family.prefix(ck.names())
    links = family.links(cfg, hf)
    consumed = set()
    for link in links:
        for i, n in enumerate(link_names(link)):
            if prefix + n not in ck:
                layer = link.hf_layer(i % max(link.layers, 1)) if link.layers else 0
                raise FamilyError(_missing(key, directory, hf, link, prefix + n, layer))
            consumed.add(prefix + n)
    return ck, family, prefix, links, consumed


def link_names(link: Link) -> list[str]:
    """A link's checkpoint tensor names, each of its layers' (without the checkpoint's
    prefix)."""
    rows = range(link.layers) if link.layers else [None]
    return [n.format(i=link.hf_layer(i)) if link.layers else n for n in link.hf for i in rows]


def _missing(key: str, directory: str, hf: dict, link: Link, name: str, layer: int) -> str:
    if not link.layers or layer == 0:
        return f"{key}: {directory} has no tensor {name}"
    parts = [("", hf)] + [(f"{k}.", v) for k, v in hf.items() if isinstance(v, dict)]
    depth = link.hf_layer(link.layers - 1) + 1  # (the layers this link's rows reach)
    claims = [f"{p}{k}" for p, part in parts for k in LAYER_KEYS if part.get(k) == depth]
    what = f"'{claims[0]}'" if claims else "its layer count"
    return (
        f"{key}: {Path(directory) / 'config.json'} says {depth} layers ({what}) but the "
        f"checkpoint's tensors hold {layer}: it has no {name}. Set config.json's "
        f"{claims[0] if claims else 'layer count'} to {layer}, or complete the checkpoint"
    )


def _check_complete(key, family, ck, prefix, consumed, out, flat) -> None:
    """Every parameter of the modules filled has its tensor, and every tensor of the family's
    part is used or knowingly left alone."""
    modules = {p.split("/")[0] for p in out}
    unfilled = [
        p
        for p in flat
        if p.split("/")[0] in modules and p not in out and not is_adapter(p.split("/"))
    ]  # (LoRA adapters start fresh, or from model.init_from.adapter)
    if unfilled:
        raise FamilyError(
            f"{key}: {len(unfilled)} parameters of {', '.join(sorted(modules))} have no tensor "
            f"in the checkpoint, e.g. {unfilled[0]}"
        )
    mine = [n for n in ck.names() if n.startswith(prefix)]
    left = [n for n in mine if n not in consumed and not family.skipped(n[len(prefix) :])]
    if left:
        raise FamilyError(
            f"{key}: {len(left)} tensors of the checkpoint have no place in the model, e.g. "
            f"{left[0]} (a variant of {family.name} jaxmllm does not read?)"
        )


def _left_alone(cfg: Any, role: str, family, ck: Checkpoint, prefix: str, consumed) -> None:
    """Logs what a role read of a checkpoint left alone: tensors of its part the model does not
    use (a pooling head), and a whole checkpoint's other parts, naming the key that loads each."""
    key = f"model.init_from.{role}"
    unused = [n for n in ck.names() if n not in consumed]
    parts = Counter(
        family.part_of(n[len(prefix) :]) if n.startswith(prefix) else "" for n in unused
    )
    own = parts.pop(role, 0) + parts.pop(None, 0)
    if own:
        log.info("%s: left alone %d tensors the model does not use (e.g. a pooling head)", key, own)
    elsewhere = parts.pop("", 0)
    if elsewhere:
        what = "a decoder, a text tower"
        log.info("%s: left alone %d tensors of parts it does not read (%s)", key, elsewhere, what)
    for part, n in sorted(parts.items()):  # a whole checkpoint's other parts
        directory = getattr(cfg.model.init_from, part, "")
        same = bool(directory) and Path(directory).resolve() == ck.dir.resolve()
        loaded = "loads them" if same else "is not this directory: left alone"
        where = f"model.init_from.{part} {loaded}"
        log.info("%s: %d tensors of %s are its %s part (%s)", key, n, ck.dir, part, where)


def check_sizes(link: Link, ck: Checkpoint, prefix: str, targets: list, key: str) -> None:
    """Refuses, from the files' headers alone, a link whose tensors do not hold as many
    elements as the parameters they fill (a config.json whose sizes are not its tensors'),
    naming the file, the tensor and the parameter; a vocabulary may only grow."""
    each = [math.prod(t.shape[1:] if link.layers else t.shape) for t in targets]
    grows = any(p in VOCAB_AXIS for p in link.ours)
    for layer in range(link.layers) if link.layers else [None]:
        names = link.hf_names(layer)
        have = sum(math.prod(ck.shape(prefix + n)) for n in names)
        if have != sum(each) and not (grows and have <= sum(each)):
            shapes = ", ".join(f"{n} {list(ck.shape(prefix + n))}" for n in names)
            want = ", ".join(
                f"{p} {list(t.shape[1:] if link.layers else t.shape)}"
                for p, t in zip(link.ours, targets, strict=True)
            )
            raise CheckpointError(
                f"{key}: tensor {shapes} in {ck.file(prefix + names[0])} does not hold the "
                f"model's {want}: the sizes in config.json are not the tensors' (a damaged or "
                "mismatched checkpoint)"
            )


def check_shapes(link: Link, names, stored, mapped, ck: Checkpoint, prefix: str, key: str) -> None:
    """Refuses tensors stored in another shape than the model's parameters map to (element
    counts alike: a [width, mlp] tensor where [mlp, width] is meant), naming file and both;
    a shape the link says it reads too (`Link.stored_as`) is not refused."""
    for name, a, b in zip(names, stored, mapped, strict=True):
        want = tuple(np.shape(b))
        also = link.stored_as(want) if link.stored_as else ()
        if tuple(a.shape) != want and tuple(a.shape) not in also:
            raise CheckpointError(
                f"{key}: tensor {name} in {ck.file(prefix + name)} is {list(a.shape)}, but the "
                f"model's sizes (config.json) store it as {list(np.shape(b))}: the same "
                "elements in another shape (transposed?) would load scrambled; a damaged or "
                "mismatched checkpoint"
            )


def fill(
    link: Link, ck: Checkpoint, prefix: str, targets: list, key: str, grown: dict | None = None
) -> list[jax.Array]:
    """The link's parameters as sharded arrays (see the module docstring); `grown` collects
    the vocabulary rows added to each parameter (path -> rows)."""
    shards = [_shards(t) for t in targets]
    buffers = [
        {k: np.empty(_shape(k), t.dtype) for k in s.values()}
        for t, s in zip(targets, shards, strict=True)
    ]

    def place(layer: int | None, outs: tuple[np.ndarray, ...]) -> None:
        for t, path, out, buf in zip(targets, link.ours, outs, buffers, strict=True):
            want = t.shape[1:] if layer is not None else t.shape
            out = _fit(np.asarray(out), want, path, link, key, grown)
            for k, b in buf.items():
                if layer is None:
                    b[...] = out[_slices(k)]
                elif k[0][0] <= layer < k[0][1]:
                    b[layer - k[0][0]] = out[_slices(k[1:])]

    def read(names: tuple[str, ...]) -> tuple[np.ndarray, ...]:
        arrays = [ck.get(prefix + n) for n in names]
        for n, a in zip(names, arrays, strict=True):  # (a copy damaged since its import)
            if not link.infinite or np.isnan(a).any():
                ck.check_finite(prefix + n, a)
        try:
            ours = link.to_ours(*arrays)
            back = link.to_hf(*ours)
        except ValueError:  # a reshape that cannot be: the config and the tensor disagree
            shapes = ", ".join(f"{n} {list(a.shape)}" for n, a in zip(names, arrays, strict=True))
            want = ", ".join(
                f"{p} {list(t.shape)}" for p, t in zip(link.ours, targets, strict=True)
            )
            raise FamilyError(
                f"{key}: tensor {shapes} does not fit the model's {want} (does model.* match "
                "the checkpoint's config.json?)"
            ) from None
        # (a tensor stored in another shape of its size, a transposed one, reshapes without
        # an error: its shape must be what ours map back to)
        check_shapes(link, names, arrays, back, ck, prefix, key)
        return ours

    if link.layers:
        for layer in range(link.layers):
            place(layer, read(link.hf_names(layer)))
    else:
        place(None, read(link.hf))
    arrays = []
    for t, s, buf in zip(targets, shards, buffers, strict=True):
        pieces = [jax.device_put(buf[k], d) for d, k in s.items()]
        arrays.append(jax.make_array_from_single_device_arrays(t.shape, t.sharding, pieces))
    return arrays


def _fit(
    out: np.ndarray, want: tuple, path: str, link: Link, key: str, grown: dict | None = None
) -> np.ndarray:
    if out.shape == tuple(want):
        return out
    axis = VOCAB_AXIS.get(path)
    same_else = axis is not None and all(
        a == b for i, (a, b) in enumerate(zip(out.shape, want, strict=True)) if i != axis
    )
    if same_else and out.shape[axis] < want[axis]:
        extra = want[axis] - out.shape[axis]
        mean = out.astype(np.float32).mean(axis=axis, keepdims=True)
        if grown is not None:
            grown[path] = extra
        return np.concatenate([out, np.repeat(mean.astype(out.dtype), extra, axis=axis)], axis)
    raise FamilyError(
        f"{key}: tensor {link.hf[0]} gives {path} the shape {list(out.shape)}, the model has "
        f"{list(want)} (does model.* match the checkpoint's config.json?)"
    )


def _shards(target) -> dict:
    """Device -> its shard's (start, stop) per dim, for this process's devices."""
    index = target.sharding.addressable_devices_indices_map(target.shape)
    return {d: _bounds(idx, target.shape) for d, idx in index.items()}


def _bounds(idx: tuple, shape: tuple) -> tuple[tuple[int, int], ...]:
    return tuple(
        (s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(idx, shape, strict=True)
    )


def _shape(bounds: tuple) -> tuple[int, ...]:
    return tuple(b - a for a, b in bounds)


def _slices(bounds: tuple) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in bounds)


def nest(flat: dict[str, Any]) -> dict:
    """A nested dict of "/"-joined paths' values (what `keyed_leaves` flattens)."""
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree
