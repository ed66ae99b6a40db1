"""Gemma 3's text decoder: `Gemma3ForCausalLM` (`gemma3_text`, the row of `jaxmllm.hf.table`
with `post_norms`).

jaxmllm's decoder with Gemma's options (`model.llm`): every RMSNorm scales by 1 + its weight,
stored zero-centred (`norm: rms_offset`), and a layer has four of them, before and after
attention and the MLP (`post_norms`); the MLP is GeGLU with the tanh GELU (`mlp:
gated_gelu_tanh`); token embeddings are scaled by sqrt(width) (`embed_scale`); QK-norm; the
scores scale by 1 / sqrt(query_pre_attn_scalar) (`attn_scalar`); the head is tied by default.
Its layers are of two kinds by `layer_types`: `sliding_attention` attends within the last
`sliding_window` tokens of the document and turns its rotary positions at the local base,
unscaled; `full_attention` attends to the whole document at the global base, with the rope
scaling a config sets (linear in the 4B and larger checkpoints): `model.llm.window`.

transformers 5 writes the two bases as `rope_parameters` per layer type; older config.json
files as `rope_theta`, `rope_local_base_freq` and `rope_scaling` (the global layers'), and may
leave `layer_types` out for `sliding_window_pattern` (a full layer every sixth): both read.
What Gemma 3 may set and jaxmllm's decoder does not run (logit soft-capping, bidirectional
attention, other activations, a scaled local rotary) is refused naming its key.
"""

from __future__ import annotations

from typing import Any

from jaxmllm.config.decoder import LayerKind
from jaxmllm.hf.decoders import (
    ROPE_TYPES,
    Decoders,
    gated_mlp_links,
    layer_types,
    rope_section,
    rope_to_hf,
    shape_section,
)
from jaxmllm.hf.family import Link, read, refuse_unless, same

LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' names of the tanh GELU (gelu_new is the same formula)
ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")
# What a Gemma 3 config.json may turn on that is not built: refused unless unset (null / false)
NOT_BUILT = {
    "final_logit_softcapping": "tanh soft-capping of the logits",
    "attn_logit_softcapping": "tanh soft-capping of the attention scores",
    "use_bidirectional_attention": "bidirectional attention over text",
}


def refuse_set(hf: dict, where: str, not_built: dict[str, str], unset: str) -> None:
    """Refuses the first key of `not_built` (key -> what it builds) that `hf` sets, naming it,
    what jaxmllm does not build, and `unset`: what a checkpoint without it sets there.

    Raises:
      FamilyError: naming the key and its value.
    """
    for key, what in not_built.items():
        refuse_unless(
            not hf.get(key),
            where,
            f"{key} {hf.get(key)!r}: {what} is not built in jaxmllm's decoder ({unset})",
        )


class Gemma3(Decoders):
    """Gemma 3's causal LM (module docstring): Gemma's block over `Decoders`' links, its
    windowed and full layers stacked apart (`model.llm.window`)."""

    def section(self, hf: dict) -> dict:
        """Our `model.llm` keys from Gemma 3's config.json.

        Raises:
          FamilyError: naming a key whose value jaxmllm's decoder does not run.
        """
        where = f"{self.name} config.json"
        refuse_set(hf, where, NOT_BUILT, "a checkpoint trained without it sets null")
        act = hf.get("hidden_activation") or hf.get("hidden_act") or ACTIVATIONS[0]
        refuse_unless(
            act in ACTIVATIONS,
            where,
            f"hidden_activation {act!r}: Gemma's MLP here is GeGLU with the tanh GELU "
            f"({' or '.join(ACTIVATIONS)})",
        )
        shape = shape_section(hf, where, tied=True)
        full, local = rope_parameters(hf, where)
        theta, scaling = rope_section({"rope_parameters": full}, where)
        return {
            **shape,
            "mlp_dim": int(read(hf, "intermediate_size", where)),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "norm": "rms_offset",
            "mlp": "gated_gelu_tanh",
            "attn_bias": self.row.biases.read(hf),
            "qk_norm": True,
            "post_norms": True,
            "embed_scale": True,
            "attn_scalar": float(hf.get("query_pre_attn_scalar") or 256),
            "window": window_section(hf, where, shape["depth"], local),
            "mrope_section": [0, 0, 0],
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """Gemma 3's config.json of our `model.llm`: `Decoders`' with its activation, the
        rotary bases per layer type, the layer types and the window (`source`'s other keys
        kept)."""
        llm = cfg.model.llm
        old = ("hidden_act", "rope_local_base_freq", "sliding_window_pattern")
        kept = {k: v for k, v in (source or {}).items() if k not in old}
        out = super().to_hf_config(cfg, kept)
        del out["hidden_act"]
        win = llm.window
        out.update(
            hidden_activation=ACTIVATIONS[0],
            rope_parameters={
                "full_attention": rope_to_hf(llm),
                "sliding_attention": {"rope_type": "default", "rope_theta": win.rope_theta},
            },
            layer_types=[LAYER_TYPES[not win.is_sliding(i)] for i in range(llm.depth)],
            query_pre_attn_scalar=whole_if_whole(llm.attn_scalar or llm.head_width),
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
        if win.size:
            out["sliding_window"] = win.size
        return out

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options Gemma 3 has a counterpart for (a decoder from scratch)."""
        out = super().wants(cfg)
        out.update(
            {
                "model.llm.norm": ("rms_offset",),
                "model.llm.mlp": ("gated_gelu_tanh",),
                "model.llm.mlp_bias": (False,),
                "model.llm.qk_norm": (True,),
                "model.llm.post_norms": (True,),
                "model.llm.embed_scale": (True,),
                "model.llm.attn_scalar": ((lambda s: True), "any query_pre_attn_scalar"),
                "model.llm.window.enabled": ((lambda e: True), "windows or none"),
            }
        )
        return out

    def layer_links(self, llm: Any, stack: str, kind: LayerKind, n: int) -> list[Link]:
        """One stack's links: `Decoders`' attention, Gemma's four norms (its
        `post_attention_layernorm` is the norm after attention, not before the MLP), GeGLU."""
        p, ours = "model.layers.{i}.", f"llm/transformer/{stack}/"
        attention = [
            link
            for link in super().layer_links(llm, stack, kind, n)
            if link.hf[0].startswith(p + "self_attn.")
        ]
        return [
            same(p + "input_layernorm.weight", ours + "attn_norm/scale", n),
            *attention,
            same(p + "post_attention_layernorm.weight", ours + "attn_post_norm/scale", n),
            same(p + "pre_feedforward_layernorm.weight", ours + "mlp_norm/scale", n),
            *self.mlp_links(llm, kind, p, ours, n),
            same(p + "post_feedforward_layernorm.weight", ours + "mlp_post_norm/scale", n),
        ]

    def mlp_links(self, llm: Any, kind: LayerKind, p: str, ours: str, n: int) -> list[Link]:
        """A layer's MLP between its norms: GeGLU (`p`: the checkpoint's layer, `ours`: our
        stack's)."""
        return gated_mlp_links(llm.width, llm.mlp_dim, p + "mlp.", ours + "mlp/", n)


def whole_if_whole(x: float) -> int | float:
    """`x` as an int where it is one (transformers types query_pre_attn_scalar int, and its
    strict config refuses 256.0)."""
    return int(x) if float(x).is_integer() else x


def rope_parameters(hf: dict, where: str) -> tuple[dict, dict]:
    """(the full-attention layers' rotary settings, the sliding layers') in transformers 5's
    form, from either: `rope_parameters` per layer type, or `rope_theta` (default 1e6),
    `rope_scaling` and `rope_local_base_freq` (default 1e4)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(params or hf.get("rope_scaling") or {})}
        local = {}
    full.setdefault("rope_theta", hf.get("rope_theta", 1e6))
    full.setdefault("rope_type", full.pop("type", "default"))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 1e4))
    kind = local.get("rope_type", local.get("type", "default"))
    refuse_unless(
        kind == "default",
        where,
        f"rope_parameters.sliding_attention.rope_type {kind!r}: the sliding layers' rotary is "
        f"built unscaled here (the full layers take {', '.join(ROPE_TYPES)})",
    )
    return full, local


def window_section(hf: dict, where: str, depth: int, local: dict) -> dict:
    """Our `model.llm.window` keys: the sliding layers of `layer_types` (or of
    `sliding_window_pattern`), `sliding_window`, the local rotary base."""
    # (older files: a full layer every `sliding_window_pattern`th)
    every = int(hf.get("sliding_window_pattern") or 6)
    types = layer_types(hf, where, depth, LAYER_TYPES, every)
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    size = hf.get("sliding_window")
    refuse_unless(
        not sliding or (isinstance(size, int) and size > 0),
        where,
        f"sliding_window {size!r}: layer_types names sliding_attention layers, which need a "
        "window of a whole number of tokens",
    )
    return {
        "size": int(size or 0),
        "layers": sliding,
        "rope_theta": float(local["rope_theta"]),
    }
