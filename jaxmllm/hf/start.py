"""Where a run's parameters start (`model.init_from`): an earlier run's checkpoint (`run`:
LLaVA's stage 2 starting from stage 1's projectors), HuggingFace checkpoints (`llm`, `vision`,
`audio`: `jaxmllm.hf.load`), a PEFT adapter (`adapter`: `jaxmllm.hf.adapter`), or, for whatever
none names, the random init of `train.seed`.

A resumed run restores its own checkpoint instead, but a run with LoRA adapters saves no frozen
base: it reads its base again from here (`run_base` for export and generation).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax
from flax import nnx

from jaxmllm.config import Config, ConfigError, from_dict
from jaxmllm.hf.adapter_load import adapter_params
from jaxmllm.hf.load import pretrained
from jaxmllm.loop.base import base_identity, check_base
from jaxmllm.loop.checkpoint import restore_params, run_stamp
from jaxmllm.models.lora import is_adapter
from jaxmllm.step.program import (
    base_dtypes,
    build_model,
    join,
    model_parts,
    overlay,
    split_tree,
)
from sharding.rules import keyed_leaves

log = logging.getLogger("jaxmllm")


def initial_params(cfg: Config, abstract: dict, adapters: bool = True) -> dict:
    """The parameters `model.init_from` gives, in the shardings of `abstract` (every
    parameter, trained and frozen, as `Program.abstract_params` gives them): a nested dict of
    a subset of them; the rest starts at random. `adapters` False: not the adapter's."""
    init = cfg.model.init_from
    given = run_params(init.run, abstract) if init.run else {}
    given = {**pretrained(cfg, abstract, skip=set(given)), **given}
    if init.adapter and adapters:
        given = join(given, adapter_params(cfg, abstract))
    return given


def run_params(run_dir: str, abstract: dict) -> dict:
    """The parameters of an earlier run's latest checkpoint that this model also has (whole
    top-level modules: a module the run did not have keeps its other source; adapters this
    model has and that run had not start fresh).

    Raises:
      ConfigError: no run or checkpoint there, a shared module of another shape, or one the
        run trained LoRA adapters on (its checkpoint holds them, not the base under them).
    """
    key = f"model.init_from.run={run_dir}"
    try:
        raw = json.loads((Path(run_dir) / "config.json").read_text())
    except OSError:
        raise ConfigError(f"{key}: no config.json (is it a run's train.output_dir?)") from None
    theirs, _ = model_parts(from_dict(Config, raw, source=f"{run_dir}/config.json"))
    their_shapes = keyed_leaves(nnx.to_pure_dict(theirs.template))
    mine = {p: v for p, v in keyed_leaves(abstract).items() if not is_adapter(p.split("/"))}
    shared = sorted({p.split("/")[0] for p in mine} & {p.split("/")[0] for p in their_shapes})
    adapted = [m for m in shared if m in theirs.adapted]
    if adapted:
        raise ConfigError(
            f"{key}: that run trained LoRA adapters on {', '.join(adapted)}, and its "
            "checkpoints hold the adapters, not a base with them: export it merged (python -m "
            f"jaxmllm.hf export {run_dir} --out DIR --merged) and start from DIR "
            "(model.init_from.llm / vision / audio)"
        )
    for path, leaf in mine.items():
        if path.split("/")[0] in shared and (
            path not in their_shapes or their_shapes[path].shape != leaf.shape
        ):
            have = their_shapes[path].shape if path in their_shapes else "no such parameter"
            raise ConfigError(
                f"{key}: parameter {path} is {tuple(leaf.shape)} here and {have} in that run; "
                "init_from.run needs the same modules (change model.* or the run)"
            )
    wanted = {k: abstract[k] for k in shared}
    params, frozen = theirs.split(wanted)
    params, frozen = (split_tree(t, lambda p: not is_adapter(p))[0] for t in (params, frozen))
    step, restored = restore_params(Path(run_dir), {"params": params, "frozen": frozen}, None)
    log.info("%s: step %d's %s", key, step, ", ".join(shared))
    return join(restored["params"], restored["frozen"])


def run_parameters(cfg: Config, run: Path, step: int | None = None) -> tuple[int, dict, dict]:
    """(step, trained params, frozen params) of a run's checkpoint `step` (None: the latest)
    on the default device: what export and generation read. A run with adapters saved no
    base: it is read again (`run_base`) and refused unless it is the base the checkpoint was
    trained on (its stamp's identity), naming both.

    Raises:
      ConfigError: no checkpoint there, or another base.
    """
    parts, _ = model_parts(cfg)
    shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
    shapes = jax.tree.map(shape, nnx.to_pure_dict(parts.template))
    params, frozen = parts.split(shapes)
    if not parts.adapted:
        step, got = restore_params(run, {"params": params, "frozen": frozen}, step)
        return step, got["params"], got["frozen"]
    step, got = restore_params(run, {"params": params}, step)
    saved = (run_stamp(run, step) or {}).get("base")
    if saved and "seed" in saved:  # (the seed it was drawn from, whatever config.json says now)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=saved["seed"]))
    base, loaded = run_base(cfg)
    where = f"checkpoint {step} in {Path(run) / 'checkpoints'}"
    check_base(where, saved, base_identity(cfg, base, loaded))
    return step, got["params"], base


def run_base(cfg: Config) -> tuple[dict, dict]:
    """The frozen base of a run with adapters as its training read it (not in its
    checkpoints): `model.init_from`'s parameters, the seed's random init where none names
    one, in the towers' base dtypes; on the default device. Also: what the sources gave of it
    (`jaxmllm.loop.base.base_identity` tells the seed's part from it)."""
    parts, _ = model_parts(cfg)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        nnx.to_pure_dict(parts.template),
    )
    trained, frozen = parts.split(shapes)
    frozen = jax.eval_shape(lambda f: base_dtypes(cfg, f), frozen)
    given = initial_params(cfg, join(trained, _sharded(frozen, device)), adapters=False)

    def init(given):  # (under jit the random init of what `given` replaces is never computed)
        _, base = build_model(cfg, cfg.train.seed)
        return base_dtypes(cfg, overlay(base, given))

    loaded = parts.split(given)[1]
    base = jax.jit(init)(given)
    return base, loaded


def _sharded(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
