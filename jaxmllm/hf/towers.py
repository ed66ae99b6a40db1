"""The modules one HF checkpoint fills, built alone and loaded on one device: what `hf check`
compares with transformers, and what the parity tests run. Names are MultimodalLM's (`llm`,
`vision`, `vision_projector`, `audio`), so the same links load them."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.config import Config, InitFrom, from_dict
from jaxmllm.hf.load import pretrained
from jaxmllm.hf.registry import ROLES, family_for, read_hf_config
from jaxmllm.models.audio import AudioEncoder
from jaxmllm.models.llm import Decoder
from jaxmllm.models.projectors import vision_projector
from jaxmllm.models.vision import VisionEncoder
from jaxmllm.step import overlay


class Towers(nnx.Module):
    """The decoder, or an encoder (and the vision projector) of a config; fp32, dense attention."""

    def __init__(self, cfg: Config, role: str, *, rngs: nnx.Rngs):
        kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
        enc = dict(remat=False, attention="dense", **kw)
        m = cfg.model
        if role == "llm":
            self.llm = Decoder(m.llm, **enc)
        elif role == "vision":
            self.vision = VisionEncoder(m.vision, **enc)
            self.vision_projector = vision_projector(m, **kw)
        else:
            self.audio = AudioEncoder(m.audio, **enc)


def config_for(role: str, directory: str, llm_width: int = 0) -> Config:
    """A config whose `role` module is the checkpoint's (the others small placeholders)."""
    hf = read_hf_config(directory)
    section = family_for(role, hf, directory).section(hf)
    model: dict[str, Any] = {"init_from": {role: directory}}
    model[role] = section
    if role != "llm":  # the decoder only sizes the projector: the merger's width if it has one
        merger = hf.get("vision_config", hf).get("hidden_size") if role == "vision" else None
        width = llm_width or (merger if section.get("projector_act") == "gelu" else 64)
        model["llm"] = {"width": width, "depth": 1, "heads": 2, "kv_heads": 2, "mlp_dim": 32}
    for other in ("vision", "audio"):
        model.setdefault(other, {"enabled": False})
    raw = {"model": model, "batch": {"attention_block": 1}, "data": {"audio_max_frames": 4}}
    return from_dict(Config, raw, source=directory)


def load_towers(cfg: Config, role: str) -> Towers:
    """The role's modules with the checkpoint's weights (unfilled ones, a fresh projector, 0)."""
    abstract = nnx.eval_shape(lambda: Towers(cfg, role, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), nnx.to_pure_dict(state)
    )
    one = InitFrom(**{r: getattr(cfg.model.init_from, r) if r == role else "" for r in ROLES})
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=one))
    loaded = pretrained(cfg, shapes)
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    nnx.replace_by_pure_dict(state, overlay(zeros, loaded))
    return nnx.merge(graphdef, state)
