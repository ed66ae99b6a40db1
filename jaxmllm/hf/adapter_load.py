"""A PEFT adapter into a model: the adapters (and `modules_to_save`) `model.init_from.adapter`
starts a run from, and the `model.*.lora` sections `hf import --adapter` writes for it.

Every tensor of the adapter is accounted for: an adapter of a module the model adapts, a module
saved whole that the model trains whole, or one the model knowingly leaves alone (a LLaVA
tower's blocks after its feature layer); anything else is refused naming it, so an adapter
never half-loads.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from jaxmllm.hf import experts_adapter
from jaxmllm.hf.adapter import PREFIX, Adapter, Module, check_targets, modules, ours_from
from jaxmllm.hf.family import Family, FamilyError, Link
from jaxmllm.hf.load import nest
from jaxmllm.hf.registry import ROLES, family_for, read_hf_config
from jaxmllm.hf.safetensors import Checkpoint
from jaxmllm.hf.whole import Part
from jaxmllm.models.mllm import kernel_paths
from sharding.rules import keyed_leaves

log = logging.getLogger("jaxmllm")


@dataclasses.dataclass(frozen=True)
class Source:
    """One part `model.init_from` names: its family and where its names start."""

    role: str
    family: Family
    prefix: str  # before the family's tensor names in its checkpoint
    hf: dict  # its config.json (a whole checkpoint's: the whole's)


def sources(cfg: Any) -> list[Source]:
    """The parts `model.init_from` names (each role of a whole checkpoint: one Part)."""
    out = []
    for role in ROLES:
        directory = getattr(cfg.model.init_from, role)
        if not directory or (role != "llm" and not getattr(cfg.model, role).enabled):
            continue
        hf, names = read_hf_config(directory), Checkpoint(directory).names()
        family = family_for(role, hf, f"model.init_from.{role}={directory}", names)
        out.append(Source(role, family, family.prefix(names), hf))
    return out


@dataclasses.dataclass
class Found:
    """What an adapter holds for a model: per adapted module its PEFT tensors per layer, the
    links of the modules it saves whole with their tensors."""

    adapters: list[tuple[Module, list[tuple]]]
    saved: list[tuple[Link, str, list[tuple[np.ndarray, ...]]]]  # (link, its runtime, layers)
    # a mixture of experts' stacked experts: (experts_adapter.ExpertsParam, (a, b) per layer)
    experts: list = dataclasses.field(default_factory=list)


def find(adapter: Adapter, cfg: Any, kernels: set[str], trains_whole) -> Found:
    """Accounts for every tensor of `adapter` against the model of `cfg` whose kernels
    `kernels` have adapters and whose top-level modules `trains_whole` (a predicate) are
    trained whole.

    Raises:
      FamilyError: a module with adapters the adapter misses a layer of, a tensor of a module
        the model has no adapter on (or does not train whole), naming them.
    """
    keys, used = set(adapter.keys()), set()
    found = Found([], [])
    for src in sources(cfg):
        if src.role == "llm":  # (adapters on the stacked experts: target_parameters)
            params = experts_adapter.present(adapter, cfg, src.family, src.prefix)
            found.experts, held = experts_adapter.read(adapter, params, cfg.model.llm.moe.experts)
            used |= held
        held = [
            (mod, _layers(adapter, mod, keys))
            for mod in modules([(src.family, src.prefix)], cfg, src.hf, kernels, True)
        ]
        _every_layer(adapter, held)
        for mod, layers in held:
            if layers[0] is None:
                continue  # (no adapter on it: the config's targets say whether that is wrong)
            used |= {k for got in layers for k in got[3]}
            found.adapters.append((mod, [got[:3] for got in layers]))
        for link in src.family.links(cfg, src.hf):
            got = _saved(adapter, link, src, keys)
            if got is None:
                continue
            whole = {p.split("/")[0] for p in link.ours}
            if not all(trains_whole(m) for m in whole):
                names = sorted({k for layer in got[1] for k in layer})
                raise FamilyError(
                    f"{adapter.directory}: modules_to_save holds {names[0]}, part of "
                    f"{', '.join(sorted(whole))}, which this model does not train whole (a "
                    "tower with adapters trains only them; a frozen one nothing)"
                )
            used |= {k for layer in got[1] for k in layer}
            found.saved.append((link, got[0], got[2]))
    left = sorted(k for k in keys - used if not _left_alone(k, sources(cfg)))
    if left:
        raise FamilyError(
            f"{adapter.directory}: {len(left)} tensors name modules this model has no adapter "
            f"on, e.g. {', '.join(left[:3])} (are model.*.lora's targets the adapter's? `hf "
            "import --adapter` writes them)"
        )
    return found


def _every_layer(adapter: Adapter, held: list[tuple[Module, list]]) -> None:
    """Refuses an adapter on some layers of a module and not others (`held`: each module's
    `_layers`). The layers of one HF module (one runtime name) may sit in several of our
    stacks (Gemma 3's sliding and full layers, a hybrid's linear and full ones), so they are
    counted together: a stack with none of them is a layer missing, as a row is."""
    rows: dict[str, list] = {}
    for mod, layers in held:
        for row, got in enumerate(layers):
            layer = row if mod.link.layers else None
            at = -1 if layer is None else mod.link.hf_layer(layer)
            rows.setdefault(mod.runtime, []).append((at, mod.names(layer)[0], got is None))
    for runtime, of_module in rows.items():
        missing = [name for _, name, absent in sorted(of_module) if absent]
        if missing and len(missing) < len(of_module):
            raise FamilyError(
                f"{adapter.directory}: {missing[0]} has no adapter while the other layers' "
                f"{runtime.rsplit('.', 1)[-1]} have one; jaxmllm trains every layer's "
                "(layers_to_transform is not supported)"
            )


def _layers(adapter: Adapter, mod: Module, keys: set) -> list:
    """Per layer, (A, B, runtime name, the two keys) of a module, or None where absent."""
    out = []
    for layer in range(mod.link.layers) if mod.link.layers else [None]:
        got = None
        for name in mod.names(layer):
            pair = [f"{PREFIX}{name}.lora_{x}.weight" for x in "AB"]
            if set(pair) <= keys:
                got = (*(adapter.tensor(k) for k in pair), mod.names(layer)[0], pair)
                break
        out.append(got)
    return out


def _saved(adapter: Adapter, link: Link, src: Source, keys: set):
    """A link's tensors as `modules_to_save` holds them (runtime names), per layer; None when
    the adapter does not save it."""
    runtime = lambda n: _runtime_tensor(src.family, src.prefix + n)
    per_layer, arrays = [], []
    for layer in range(link.layers) if link.layers else [None]:
        names = [PREFIX + runtime(n) for n in link.hf_names(layer)]
        if not set(names) <= keys:
            return None
        per_layer.append(names)
        arrays.append(tuple(adapter.tensor(k) for k in names))
    return link.hf[0], per_layer, arrays


def _runtime_tensor(family: Family, name: str) -> str:
    module, _, leaf = name.rpartition(".")
    return f"{family.runtime(module)}.{leaf}"


def _left_alone(key: str, srcs: list[Source]) -> bool:
    """Whether an adapter tensor is of a module the model knowingly leaves alone."""
    name = key.removeprefix(PREFIX)
    for suffix in (".lora_A.weight", ".lora_B.weight", ".weight", ".bias"):
        if name.endswith(suffix):
            module = name.removesuffix(suffix)
            break
    else:
        return False
    for src in srcs:
        ours = src.family.checkpoint_name(module) + ".weight"
        if isinstance(src.family, Part) and src.family.whole.part_of(ours) != src.role:
            continue
        if ours.startswith(src.prefix) and src.family.skipped(ours[len(src.prefix) :]):
            log.info("%s: left alone (the model does not use %s)", key, module)
            return True
    return False


# ----------------------------------------------------------------------------- into a run


def adapter_params(cfg: Any, abstract: dict) -> dict:
    """The adapters (and modules saved whole) `model.init_from.adapter` gives, in the
    shardings of `abstract` (every parameter, as `Program.abstract_params` gives them).

    Raises:
      FamilyError: a tensor with no place in the model, a rank other than model.*.lora's.
    """
    from jaxmllm.step.program import FREEZE_SWITCHES  # (the step's view of what trains)

    adapter = Adapter.read(cfg.model.init_from.adapter)
    flat = keyed_leaves(abstract)
    kernels = {p.rsplit("/", 1)[0] + "/kernel" for p in flat if p.endswith("/lora_a")}
    frozen = {k for k, f in FREEZE_SWITCHES.items() if f(cfg)}
    whole = lambda m: m not in frozen and not cfg.model.adapted(m)
    found = find(adapter, cfg, kernels, whole)
    out: dict[str, np.ndarray] = {}
    for mod, layers in found.adapters:
        for path, arrays in _kernel_adapters(mod, layers, flat, adapter, cfg).items():
            out[path] = arrays
    for link, _, layers in found.saved:
        per = [link.to_ours(*arrays) for arrays in layers]
        for k, path in enumerate(link.ours):
            value = np.stack([p[k] for p in per]) if link.layers else per[0][k]
            out[path] = np.asarray(value).reshape(flat[path].shape)
    out.update(_expert_adapters(found.experts, flat, adapter, cfg))
    what = f"{len(found.adapters)} adapted modules, {len(found.saved)} saved whole"
    log.info("model.init_from.adapter=%s: %s", adapter.directory, what)
    placed = {p: jax.device_put(v.astype(flat[p].dtype), flat[p].sharding) for p, v in out.items()}
    return nest(placed)


def _kernel_adapters(mod: Module, layers: list, flat: dict, adapter: Adapter, cfg) -> dict:
    """Our lora_a / lora_b (every layer stacked) of each adapted kernel of a module."""
    one = lambda shape: shape[1:] if mod.link.layers else shape
    shapes = [one(flat[p].shape) for p in mod.link.ours]
    n_in = _n_in(mod, lambda p: len(one(flat[_leaf(p, "lora_a")].shape)) - 1)
    per_kernel = ours_from(mod, layers, shapes, n_in, adapter.directory)
    out = {}
    for k, per in zip(mod.kernels, per_kernel, strict=True):
        path = mod.link.ours[k]
        module = path.split("/")[0]
        if per is None:
            raise FamilyError(
                f"{adapter.directory}: {layers[0][2]} adapts the other matrices it holds, not "
                f"{path}: leave it out of model.*.lora.targets (as `hf import --adapter` does)"
            )
        want, rank = flat[_leaf(path, "lora_a")].shape[-1], per[0][0].shape[-1]
        if rank != want:
            key = "projector_lora" if module.endswith("_projector") else f"{module}.lora"
            raise FamilyError(
                f"{adapter.directory}: {layers[0][2]} has adapters of rank {rank} for {path}, "
                f"model.{key}.rank is {want} (set it to the adapter's)"
            )
        theirs = adapter.scale(layers[0][2], layers[0][0].shape[0])
        ratio = theirs / (cfg.model.lora_of(module).alpha / want)  # (B carries the scale's)
        for leaf, x in (("lora_a", 0), ("lora_b", 1)):
            arrays = [p[x] * (ratio if x else 1.0) for p in per]
            out[_leaf(path, leaf)] = np.stack(arrays) if mod.link.layers else arrays[0]
    return out


def _expert_adapters(experts: list, flat: dict, adapter: Adapter, cfg) -> dict:
    """Our lora_a / lora_b of each adapted matrix of the stacked experts (every layer)."""
    out = {}
    lora = cfg.model.llm.lora
    for p, per in experts:
        a_path = f"{p.path}/{p.matrix}_adapter/lora_a"
        if a_path not in flat:
            raise FamilyError(
                f"{adapter.directory}: it adapts the experts' {experts_adapter.PARAMS[p.matrix]}, "
                "and model.llm.lora.targets leaves it out (gate and up: gate_up_proj; down: "
                "down_proj)"
            )
        want, rank = flat[a_path].shape[-1], per[0][0].shape[-1]
        if rank != want:
            raise FamilyError(
                f"{adapter.directory}: the experts' {experts_adapter.PARAMS[p.matrix]} adapters "
                f"have rank {rank}, ours {want} (model.llm.lora.rank={lora.rank}"
                f"{', doubled for gate_up as PEFT does' if p.matrix == 'gate_up' else ''})"
            )
        theirs = adapter.scale(experts_adapter.scale_name(p, p.layers[0]), rank)
        ratio = theirs / (lora.alpha / lora.rank)  # (B carries the scale's difference)
        out[a_path] = np.stack([a for a, _ in per])
        out[_leaf(a_path, "lora_b")] = np.stack([b * ratio for _, b in per])
    return out


def _n_in(mod: Module, of_adapted) -> list[int]:
    """Each kernel's leading input dims (`of_adapted(path)` for those with an adapter)."""
    return [of_adapted(p) if k in mod.kernels else 1 for k, p in enumerate(mod.link.ours)]


def _leaf(kernel: str, leaf: str) -> str:
    return kernel.rsplit("/", 1)[0] + "/" + leaf


# ----------------------------------------------------------------------------- hf import


def lora_sections(cfg_all: Any, directory: str) -> tuple[dict, set[str]]:
    """The `model.*.lora` sections an adapter implies for the model of `cfg_all` (its config
    with adapters on every matrix, to find which the adapter has): module -> {rank, alpha,
    dropout, targets}; and the top-level modules it saves whole.

    Raises:
      FamilyError: target_modules the model has no module for; ranks that differ within a
        tower; any tensor `find` refuses.
    """
    adapter = Adapter.read(directory)
    kernels = kernel_paths(cfg_all.model)
    flat = shapes_of(cfg_all)
    mods = [
        m
        for src in sources(cfg_all)
        for m in modules([(src.family, src.prefix)], cfg_all, src.hf, set(kernels), True)
    ]
    names = [n for m in mods for layer in _each(m.link.layers) for n in m.names(layer)]
    short = sorted({m.runtime.rsplit(".", 1)[-1] for m in mods})
    check_targets(adapter, names, short)
    found = find(adapter, cfg_all, set(kernels), lambda m: True)
    sections: dict[str, dict] = {}
    for mod, layers in found.adapters:
        scale = adapter.scale(layers[0][2], layers[0][0].shape[0])
        ranks = _kernel_ranks(mod, layers, flat)
        for k, rank in zip(mod.kernels, ranks, strict=True):
            if rank is None:  # (a matrix of a fused Linear it has no adapter for)
                continue
            module, target = kernels[mod.link.ours[k]]
            fresh = {"rank": rank, "alpha": scale * rank, "dropout": 0.0, "targets": []}
            got = sections.setdefault(module, fresh)
            if got["rank"] != rank:
                raise FamilyError(
                    f"{directory}: {layers[0][2]} has rank {rank}, other adapters of {module} "
                    f"rank {got['rank']}: jaxmllm gives a module's adapters one rank"
                )
            got["targets"].append(target)
    for p, per in found.experts:
        rank = per[0][0].shape[-1] // (2 if p.matrix == "gate_up" else 1)
        scale = adapter.scale(experts_adapter.scale_name(p, p.layers[0]), per[0][0].shape[-1])
        fresh = {"rank": rank, "alpha": scale * rank, "dropout": 0.0, "targets": []}
        got = sections.setdefault("llm", fresh)
        if got["rank"] != rank:
            raise FamilyError(
                f"{directory}: the experts' {experts_adapter.PARAMS[p.matrix]} adapters have rank "
                f"{rank}{' (half of gate_up_proj s)' if p.matrix == 'gate_up' else ''}, the "
                f"LLM's other adapters rank {got['rank']}: jaxmllm gives a module's adapters one"
            )
        got["targets"] += ["gate", "up"] if p.matrix == "gate_up" else ["down"]
    dropout = float(adapter.config.get("lora_dropout") or 0.0)
    for got in sections.values():
        got["dropout"] = dropout
        got["targets"] = sorted(set(got["targets"]))
    saved = {p.split("/")[0] for link, _, _ in found.saved for p in link.ours}
    both = sorted(saved & set(sections))
    if both:
        raise FamilyError(
            f"{directory}: modules_to_save holds parts of {', '.join(both)}, which has adapters "
            "too: jaxmllm trains a module's adapters or all of it, not both"
        )
    return sections, saved


def _kernel_ranks(mod: Module, layers: list, flat: dict) -> list[int]:
    """The rank each adapted kernel of a module takes from the adapter (`ours_from`)."""
    one = lambda shape: shape[1:] if mod.link.layers else shape
    shapes = [one(flat[p].shape) for p in mod.link.ours]
    n_in = _n_in(mod, lambda p: len(one(flat[_leaf(p, "lora_a")].shape)) - 1)
    per_kernel = ours_from(mod, layers, shapes, n_in, "")
    return [None if per is None else per[0][0].shape[-1] for per in per_kernel]


def shapes_of(cfg: Any) -> dict:
    """Every parameter's shape ("/"-joined path -> ShapeDtypeStruct) of `cfg`'s model, its
    batch unresolved (the parameters do not depend on it): nothing is allocated."""
    from flax import nnx

    from jaxmllm.config import BatchConfig
    from jaxmllm.config.spec import BatchSpec
    from jaxmllm.models import MultimodalLM

    batch = BatchConfig(planner="first_fit", route_pair_capacity=0, attention_block=1)
    model = dataclasses.replace(cfg.model, attention="dense")
    cfg = dataclasses.replace(cfg, batch=batch, model=model)
    spec = BatchSpec.of(cfg)
    abstract = nnx.eval_shape(lambda: MultimodalLM(cfg.model, spec, rngs=nnx.Rngs(0)))
    return keyed_leaves(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))


def _each(layers: int) -> list:
    return list(range(layers)) if layers else [None]
