"""What a resumed run keeps of the sizes its checkpoints were planned with."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from jaxmllm.config import AUTO_LADDERS, AUTO_SIZES, Config
from jaxmllm.process import distributed

log = logging.getLogger("jaxmllm")


def keep_resolved(cfg: Config, out: Path) -> Config:
    """A run resuming from `out`'s checkpoints keeps the `-1` (auto) batch sizes they were
    planned with (from `out`/config.json): those come from dry runs as long as the run, and
    the step count may change between runs (a longer run would resolve others and be
    refused). A run starting afresh resolves them anew."""
    saved_path, ckpts = out / "config.json", out / "checkpoints"
    if not saved_path.exists() or not ckpts.exists() or not any(ckpts.iterdir()):
        return cfg
    run = json.loads(saved_path.read_text())
    mesh = run.get("mesh", {})
    chosen = mesh.get("context_steps", "all")
    if cfg.mesh.context_steps == "auto" and chosen in ("all", "long"):
        # (auto was chosen from the data when the run started: resumed, it keeps that choice;
        # none is recorded as mesh.context 1, the context axis' devices in mesh.data)
        keep = {"context_steps": chosen}
        if mesh.get("context", 1) == 1 and cfg.mesh.context > 1:
            keep |= {"context": 1, "data": mesh.get("data", -1)}
        log.info("resuming: mesh.context_steps=auto keeps the run's choice, mesh %s", keep)
        cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **keep))
    if context_changed(cfg, distributed.flatten(run)):
        log.info(
            "resuming with mesh.context=%d in %s steps (the checkpoints were trained with %s "
            "in %s): the batch sizes resolved from the data are resolved anew for the new "
            "context groups",
            cfg.mesh.context,
            cfg.mesh.context_steps,
            run.get("mesh", {}).get("context", 1),
            run.get("mesh", {}).get("context_steps", "all"),
        )
        return cfg
    saved = run.get("batch", {})
    keep = {
        k: saved[k]
        for k in AUTO_SIZES
        if getattr(cfg.batch, k) == -1 and isinstance(saved.get(k), int) and saved[k] >= 0
    }
    keep |= {  # (the long variants' tiles: lists, [-1] auto; none where the run that wrote
        # the checkpoints predates them: it planned without)
        k: tuple(saved.get(k, ()))
        for k in AUTO_LADDERS
        if getattr(cfg.batch, k) == (-1,) and (k not in saved or _counts(saved[k]))
    }
    if not keep:
        return cfg
    log.info("resuming: batch sizes resolved by the run that wrote the checkpoints: %s", keep)
    return dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, **keep))


def _counts(value: object) -> bool:
    """Whether a saved value is a resolved list of counts (>= 0)."""
    return isinstance(value, list) and all(isinstance(v, int) and v >= 0 for v in value)


def context_changed(cfg: Config, saved_flat: dict) -> bool:
    """Whether the run that wrote `saved_flat` (a flattened config.json) had another
    mesh.context (1 before the key existed) or planned its groups in other steps
    (mesh.context_steps; all before the key existed)."""
    steps = saved_flat.get("mesh.context_steps", "all") != cfg.mesh.context_steps
    return steps or saved_flat.get("mesh.context", 1) != cfg.mesh.context
