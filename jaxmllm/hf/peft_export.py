"""A run with LoRA adapters exported (`python -m jaxmllm.hf export RUN --out DIR`): a PEFT adapter
for each checkpoint its adapted modules came from (`adapter_config.json`,
`adapter_model.safetensors`; `jaxmllm.hf.adapter` lays them out), which `PeftModel.from_pretrained`
puts on that very checkpoint; or, with `--merged`, the checkpoints themselves with every adapter
merged into its matrix (W + alpha / r * A B), as any other run exports them.

An adapter is only meaningful on the base it was trained on: a module trained from scratch has
no checkpoint to put one on (export it merged), and a base an earlier run gave
(`model.init_from.run`) must be the checkpoint's, tensor for tensor, or the adapter is refused.
Modules trained whole beside the adapters (a projector) go in as PEFT's `modules_to_save`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from jaxmllm.config import Config
from jaxmllm.hf import experts_adapter
from jaxmllm.hf.adapter import modules, write_adapter
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.registry import read_hf_config
from jaxmllm.hf.safetensors import DTYPES, Checkpoint
from jaxmllm.hf.whole import Part
from jaxmllm.hf.wholes import decoder_of
from jaxmllm.models.lora import LEAVES, merged
from jaxmllm.models.mllm import expert_adapters, kernel_paths
from jaxmllm.step.program import model_parts

log = logging.getLogger("jaxmllm")
# A scanned stack's parameters (a transformer's stacks; the conformer's blocks, `audio/blocks/`)
STACKED = re.compile(r"/(transformer/(\w+_)?)?blocks/")


def check_adapter_pieces(cfg: Config, pieces: list) -> None:
    """Refuses, before anything is read, to write adapters for a module with no checkpoint to
    put them on (trained from scratch)."""
    adapted = {m for m, _ in kernel_paths(cfg.model).values()}
    adapted |= {"llm"} if expert_adapters(cfg.model) else set()
    for piece in pieces:
        mine = adapted & _modules_of(piece.roles)
        if mine and not piece.source:
            raise FamilyError(
                f"{', '.join(sorted(mine))} trained LoRA adapters on a base from no HuggingFace "
                "checkpoint (the random init of train.seed, or an earlier run): a PEFT adapter "
                "needs its base as a checkpoint. Export it with --merged"
            )


def _modules_of(roles) -> set[str]:
    return {m for r in roles for m in (r, f"{r}_projector") if r != "llm" or m == "llm"}


def merge_adapters(cfg: Config, flat: dict) -> dict:
    """`flat` ("/"-joined paths -> arrays) with each adapted kernel W + alpha / r * A B (in
    W's dtype, summed in fp32), the adapters dropped."""
    out = {k: v for k, v in flat.items() if k.rsplit("/", 1)[-1] not in LEAVES}
    for path, (module, _) in kernel_paths(cfg.model).items():
        lora = cfg.model.lora_of(module)
        a, b = (flat[path.rsplit("/", 1)[0] + "/" + leaf] for leaf in LEAVES)
        kernel = np.asarray(flat[path])
        if STACKED.search(path):  # (a scanned stack: one layer at a time)
            layers = [merged(kernel[i], a[i], b[i], lora.alpha / lora.rank) for i in range(len(a))]
            out[path] = np.stack(layers)
        else:
            out[path] = merged(kernel, a, b, lora.alpha / lora.rank)
    params = experts_adapter.params_of(cfg, decoder_of(cfg))  # (its paths: any family's)
    if params:  # (the routed experts' adapters: both matrices' scale is alpha / rank)
        scale = cfg.model.llm.lora.alpha / cfg.model.llm.lora.rank
        out.update(experts_adapter.merged(flat, params, dict.fromkeys(("gate_up", "down"), scale)))
    return out


def write_adapter_piece(cfg: Config, piece: Any, flat: dict, directory) -> set[str]:
    """The PEFT adapter of one exported checkpoint (`export.Piece`) in `directory`; returns
    the top-level modules it holds (as `export.write_piece`)."""
    ck = Checkpoint(piece.source)
    names, hf = ck.names(), read_hf_config(piece.source)
    if piece.whole is not None:
        families = [(Part(piece.whole, r, hf, names), "") for r in piece.roles]
    else:
        families = [(piece.family, piece.family.prefix(names))]
    parts, _ = model_parts(cfg)
    whole = lambda m: m not in parts.frozen_keys and m not in parts.adapted
    kernels = {p.rsplit("/", 1)[0] + "/kernel" for p in flat if p.endswith("/lora_a")}
    if cfg.model.init_from.run:
        _check_base(cfg, families, hf, ck, flat, parts)
    saved = {}
    for family, prefix in families:
        for link in family.links(cfg, hf):
            if not all(whole(p.split("/")[0]) for p in link.ours):
                continue
            for layer in range(link.layers) if link.layers else [None]:
                ours = [np.asarray(flat[p]) if layer is None else flat[p][layer] for p in link.ours]
                for name, value in zip(link.hf_names(layer), link.to_hf(*ours), strict=True):
                    stored = DTYPES[ck.dtype(prefix + name)] if prefix + name in ck else None
                    module, _, leaf = (prefix + name).rpartition(".")
                    key = f"{family.runtime(module)}.{leaf}"
                    saved[key] = np.asarray(value).astype(stored or np.float32)
    mods = modules(families, cfg, hf, kernels)
    _check_saved_whole(saved, mods, piece.source)
    scales = {m: cfg.model.lora_of(m).alpha / cfg.model.lora_of(m).rank for m in parts.adapted}
    dropout = max((cfg.model.lora_of(m).dropout for m in parts.adapted), default=0.0)
    experts = _experts(cfg, families, flat)
    write_adapter(directory, mods, flat, scales, dropout, saved, str(piece.source), experts)
    whole_modules = len({k.rsplit(".", 1)[0] for k in saved})
    log.info(
        "%s: a PEFT adapter of %d modules (%d saved whole) for %s",
        directory,
        len(mods),
        whole_modules,
        piece.source,
    )
    return {p.split("/")[0] for f, _ in families for link in f.links(cfg, hf) for p in link.ours}


def _check_saved_whole(saved: dict, mods: list, source: str) -> None:
    """Refuses a tensor trained whole whose module holds adapted ones: PEFT saves a module
    whole (`modules_to_save`) with every tensor under it, and the adapters inside it would be
    lost (Gemma 4's standardisation, `vision_tower.std_bias`, is the vision projector's, on
    the tower's own module).

    Raises:
      FamilyError: naming the tensor, a module with an adapter inside its module and the
        settings that avoid it.
    """
    for name in sorted(saved):
        owner = name.rsplit(".", 1)[0] + "."
        inside = [m.runtime for m in mods if m.runtime.startswith(owner)]
        if inside:
            raise FamilyError(
                f"{name} (trained whole) belongs to {owner[:-1]}, which holds adapted modules "
                f"({inside[0]}, ...) of {source}: a PEFT adapter can save it only as that whole "
                "module, over its adapters. Export with --merged, or train its module's "
                "parameters as adapters too (model.projector_lora) or frozen "
                "(model.projector_freeze)"
            )


def _experts(cfg: Config, families: list, flat: dict) -> dict | None:
    """The routed experts' adapters of the LLM among `families` (`experts_adapter`): their
    tensors and adapter_config.json keys; None without."""
    llm = [(f, prefix) for f, prefix in families if f.role == "llm"]
    params = [p for f, prefix in llm for p in experts_adapter.params_of(cfg, f, prefix)]
    if not params:
        return None
    lora = cfg.model.llm.lora
    return {
        "tensors": experts_adapter.tensors(params, flat),
        "config": experts_adapter.config_keys(params, lora.rank, lora.alpha),
        "rank": lora.rank,
        "alpha": lora.alpha,
    }


def _check_base(cfg, families, hf, ck: Checkpoint, flat: dict, parts) -> None:
    """The frozen parameters an earlier run gave must be the checkpoint's (in the base's
    dtype), or an adapter exported for the checkpoint would not apply to it."""
    frozen = lambda p: not parts.trains(tuple(p.split("/")))
    for family, prefix in families:
        for link in family.links(cfg, hf):
            if not all(frozen(p) for p in link.ours):
                continue
            for layer in range(link.layers) if link.layers else [None]:
                theirs = link.to_ours(*[ck.get(prefix + n) for n in link.hf_names(layer)])
                for path, value in zip(link.ours, theirs, strict=True):
                    mine = np.asarray(flat[path] if layer is None else flat[path][layer])
                    value = np.asarray(value)
                    if value.ndim == mine.ndim:  # (a vocabulary the tokenizer grew: its rows)
                        mine = mine[tuple(slice(0, n) for n in value.shape)]
                    if mine.shape != value.shape or not np.array_equal(
                        mine, value.astype(mine.dtype)
                    ):
                        raise FamilyError(
                            f"{path} of the run's base (model.init_from.run="
                            f"{cfg.model.init_from.run} gave it) is not {ck.dir}'s: an "
                            "adapter exported for that checkpoint would not apply to it. "
                            "Export with --merged"
                        )
