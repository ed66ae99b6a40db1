"""The modules one HF checkpoint fills, built alone and loaded on one device: what `hf check`
compares with transformers, and what the parity tests run. Names are MultimodalLM's (`llm`,
`vision`, `vision_projector`, `audio`), so the same links load them."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmllm.config import Config, InitFrom, from_dict
from jaxmllm.config.spec import BatchSpec
from jaxmllm.hf.importer import (
    adapter_sections,
    check_placeholders,
    data_section,
    encoder_phases,
    model_section,
    vocab_size,
    whole_tokens,
)
from jaxmllm.hf.load import pretrained
from jaxmllm.hf.registry import ROLES, read_hf_config, section_of
from jaxmllm.hf.start import initial_params
from jaxmllm.hf.wholes import whole_for
from jaxmllm.models import MultimodalLM
from jaxmllm.models.encoders import audio_encoder
from jaxmllm.models.llm import Decoder
from jaxmllm.models.projectors import vision_projector
from jaxmllm.models.vision import VisionEncoder
from jaxmllm.step.program import overlay

log = logging.getLogger(__name__)


class Towers(nnx.Module):
    """The decoder, or an encoder (and the vision projector) of a config; fp32, dense attention."""

    def __init__(self, cfg: Config, role: str, *, rngs: nnx.Rngs):
        kw = dict(dtype=jnp.float32, param_dtype=jnp.float32, rngs=rngs)
        enc = dict(remat="none", attention="dense", **kw)
        m = cfg.model
        if role == "llm":
            self.llm = Decoder(m.llm, **enc)
        elif role == "vision":
            self.vision = VisionEncoder(m.vision, **enc)
            self.vision_projector = vision_projector(m, **kw)
        else:
            self.audio = audio_encoder(m.audio, **enc)


def config_for(role: str, directory: str, llm_width: int = 0) -> Config:
    """A config whose `role` module is the checkpoint's (the others small placeholders)."""
    hf = read_hf_config(directory)
    section = section_of(role, hf, directory)
    model: dict[str, Any] = {"init_from": {role: directory}}
    model[role] = section
    whole = whole_for(hf)
    if role != "llm" and whole is not None:  # the decoder sizes the projector: the whole's
        model["llm"] = whole.section("llm", hf)
    elif role != "llm":  # the decoder only sizes the projector: the merger's width if it has one
        tower = hf.get("vision_config", hf)
        merger = tower.get("out_hidden_size", tower.get("hidden_size"))
        merger = merger if role == "vision" else None
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


def load_model(
    llm: str,
    vision: str = "",
    audio: str = "",
    seed: int = 0,
    tokenizer: str = "",
    adapter: str = "",
) -> tuple[Config, MultimodalLM]:
    """A whole MultimodalLM from HF directories, on one device, fp32, dense attention (what
    generation from `--hf` runs): the config `hf import` would write, the checkpoints' weights,
    and a module no checkpoint has (a projector) from the random init of `seed`. A whole
    checkpoint is `llm` and each encoder it holds. `tokenizer`: its directory (default: `llm`).
    `adapter`: a PEFT LoRA adapter of these checkpoints, put on them (`hf import --adapter`)."""
    model = model_section(llm, vision, audio)
    data = data_section(llm, vision, audio, tokenizer)
    check_placeholders(llm, data["tokenizer"])
    phases = encoder_phases(model)
    model["llm"]["vocab_size"] = vocab_size(model["llm"]["vocab_size"], data["tokenizer"], phases)
    model["attention"] = "dense"
    batch = {"planner": "first_fit", "route_pair_capacity": 0, "attention_block": 1}
    batch = whole_tokens(batch, model)
    if model["audio"].get("positions") == "sinusoidal":
        data["audio_max_frames"] = model["audio"]["max_positions"] * 2
    raw = {"model": model, "batch": batch, "data": data}
    if adapter:
        adapter_sections(raw, adapter, llm)
    cfg = from_dict(Config, raw, source=llm)
    spec = BatchSpec.of(cfg)
    abstract = nnx.eval_shape(lambda: MultimodalLM(cfg.model, spec, rngs=nnx.Rngs(seed)))
    graphdef, state = nnx.split(abstract)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), nnx.to_pure_dict(state)
    )

    def init(given):  # (under jit the random init of what `given` replaces is never computed)
        fresh = nnx.state(MultimodalLM(cfg.model, spec, rngs=nnx.Rngs(seed)))
        return overlay(nnx.to_pure_dict(fresh), given)

    given = initial_params(cfg, shapes)  # (the checkpoints', the adapter's)
    fresh = sorted(k for k in shapes if k not in given)
    if fresh:  # (a projector between a separate tower and the LLM: untrained until stage 1)
        log.warning("no checkpoint has %s: randomly initialised (seed %d)", ", ".join(fresh), seed)
    pure = jax.jit(init, donate_argnums=0)(given)
    nnx.replace_by_pure_dict(state, pure)
    return cfg, nnx.merge(graphdef, state)
