"""Gemma 4's vision tower (`Gemma4VisionModel`, `gemma4_vision`: the table's `GEMMA4_VISION` row),
read inside Gemma 4's whole model (`jaxmllm.hf.gemma4_whole`).

- Its patch embedding is one Linear without a bias of each patch's pixels (rows, columns,
  channels, as jaxmllm patchifies) after `2 (x - 0.5)` of the [0, 1] pixels: jaxmllm's
  normalisation by mean 0.5 and std 0.5 (`data.image_mean`, `image_std`, which `hf import`
  sets), so the processor's identity mean and std are not read.
- Its positions: two learned tables (`position_embedding_table` [2, size, width]) read at each
  patch's column and row and added (`model.vision.position_axes`), and in every block a 2D
  rotary whose first head half turns by column, the second by row, each a rotate-half rotary
  of base `rope_parameters.rope_theta` (`rope_axes: cols_first`).
- Its blocks are Gemma 4's text block's: plain RMSNorms before and after attention and the
  MLP (`post_norms`), QK-norm, values normed without a scale (`v_norm`), unscaled scores
  (`attn_scalar: 1`), a GeGLU MLP, no biases, no final norm.
- Its pooler averages each k x k window of patches (`pooling_kernel_size`: `model.vision.
  merge`), scales the mean by sqrt(width) and, with `standardize`, subtracts `std_bias` and
  multiplies by `std_scale`; the whole's `embed_vision` then norms it without a scale and
  projects it into the text width: jaxmllm's `projector: pool`, `pool_embed` (its std_bias and
  std_scale are parameters here, trained with the projector; buffers in transformers).

- Its clipped linears (`use_clipped_linears`: every attention and MLP Linear a
  Gemma4ClippableLinear, its input and output clamped to the `input_min` ... `output_max` it
  holds) are `model.vision.clipped_linears`: each matrix's bounds read from the checkpoint,
  never trained, ±inf (no bound) held as ±float32 max and written back as ±inf.

Refused, naming the key: key-value heads other than the heads, a head width other than
width / heads, attention biases, another activation or rotary type.
"""

from __future__ import annotations

from typing import Any

from jaxmllm.hf.decoders import gated_mlp_links
from jaxmllm.hf.family import (
    Family,
    Link,
    bounds,
    dense,
    read,
    refuse_unless,
    renamed,
    same,
)
from jaxmllm.hf.table import GEMMA4_VISION

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")  # (the tanh GELU: our gated_gelu_tanh)
# Our options a Gemma 4 tower always has
FIXED = {
    "norm": "rms",
    "mlp": "gated_gelu_tanh",
    "attn_bias": "",
    "mlp_bias": False,
    "qk_norm": True,
    "v_norm": True,
    "post_norms": True,
    "attn_scalar": 1.0,
    "positions": "rope",
    "rope_axes": "cols_first",
    "position_grid": 0,
    "patch_bias": False,
    "temporal_patch": 1,
    "final_norm": False,
    "pre_norm": False,
    "class_token": False,
    "window": 0,
    "projector": "pool",
    "pool_embed": True,
}
# Each block's Gemma4ClippableLinears (their module names) -> our matrices
CLIPPABLE = {
    "self_attn.q_proj": "attn/query",
    "self_attn.k_proj": "attn/key",
    "self_attn.v_proj": "attn/value",
    "self_attn.o_proj": "attn/out",
    "mlp.gate_proj": "mlp/gate",
    "mlp.up_proj": "mlp/up",
    "mlp.down_proj": "mlp/down",
}


class Gemma4Vision(Family):
    """Gemma 4's vision tower (the module docstring)."""

    row = GEMMA4_VISION

    def section(self, hf: dict) -> dict:
        """Our `model.vision` keys from Gemma 4's vision_config.

        Raises:
          FamilyError: naming a key whose value jaxmllm's tower does not run.
        """
        where = f"{self.name} config.json"
        width, heads = (
            int(read(hf, "hidden_size", where)),
            int(read(hf, "num_attention_heads", where)),
        )
        kv = int(hf.get("num_key_value_heads") or heads)
        refuse_unless(kv == heads, where, f"num_key_value_heads {kv}: the tower has {heads} heads")
        head_dim = int(hf.get("head_dim") or width // heads)
        refuse_unless(
            head_dim * heads == width,
            where,
            f"head_dim {head_dim}: jaxmllm's tower has width / heads = {width // heads}",
        )
        refuse_unless(not hf.get("attention_bias"), where, "attention_bias: true is not built")
        act = hf.get("hidden_activation") or ACTIVATIONS[0]
        refuse_unless(
            act in ACTIVATIONS,
            where,
            f"hidden_activation {act!r}: the MLP is GeGLU ({ACTIVATIONS[0]})",
        )
        rope = hf.get("rope_parameters") or {}
        refuse_unless(
            rope.get("rope_type", "axial") == "axial",
            where,
            f"rope_parameters.rope_type {rope.get('rope_type')!r}: the tower's rotary is axial",
        )
        return {
            **FIXED,
            "patch_size": int(read(hf, "patch_size", where)),
            "channels": 3,
            "width": width,
            "depth": int(read(hf, "num_hidden_layers", where)),
            "heads": heads,
            "mlp_dim": int(read(hf, "intermediate_size", where)),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "rope_theta": float(rope.get("rope_theta", 100.0)),
            "position_axes": int(read(hf, "position_embedding_size", where)),
            "merge": int(read(hf, "pooling_kernel_size", where)),
            "standardize": bool(hf.get("standardize")),
            "clipped_linears": bool(hf.get("use_clipped_linears")),
            "projector_dim": 0,
        }

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options Gemma 4's tower has a counterpart for (a tower from scratch)."""
        out = {f"model.vision.{k}": (v,) for k, v in FIXED.items()}
        out["model.vision.position_axes"] = ((lambda n: n > 0), "two learned tables of positions")
        out["model.vision.channels"] = (3,)
        return out

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """Gemma 4's vision_config of our `model.vision` (`source`'s other keys kept)."""
        v = cfg.model.vision
        out = dict((source or {}).get("vision_config") or {})
        out.update(
            model_type=self.model_types[0],
            hidden_size=v.width,
            intermediate_size=v.mlp_dim,
            num_hidden_layers=v.depth,
            num_attention_heads=v.heads,
            num_key_value_heads=v.heads,
            head_dim=v.width // v.heads,
            hidden_activation=ACTIVATIONS[0],
            rms_norm_eps=v.norm_eps,
            attention_bias=False,
            rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta},
            pooling_kernel_size=v.merge,
            patch_size=v.patch_size,
            position_embedding_size=v.position_axes,
            use_clipped_linears=v.clipped_linears,
            standardize=v.standardize,
        )
        return out

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The patch embedding and its tables, the blocks (their clipped linears' bounds where
        it has them), the standardisation."""
        v = cfg.model.vision
        w, h, f, n = v.width, v.heads, v.mlp_dim, v.depth
        e, pixels = w // h, v.patch_size**2 * v.channels
        p, ours = "encoder.layers.{i}.", "vision/transformer/blocks/"
        links = [
            dense("patch_embedder.input_proj.weight", "vision/patch_embed/kernel", (pixels, w)),
            same("patch_embedder.position_embedding_table", "vision/position_axes"),
            same(p + "input_layernorm.weight", ours + "attn_norm/scale", n),
            same(p + "post_attention_layernorm.weight", ours + "attn_post_norm/scale", n),
            same(p + "pre_feedforward_layernorm.weight", ours + "mlp_norm/scale", n),
            same(p + "post_feedforward_layernorm.weight", ours + "mlp_post_norm/scale", n),
            same(p + "self_attn.q_norm.weight", ours + "attn/q_norm/scale", n),
            same(p + "self_attn.k_norm.weight", ours + "attn/k_norm/scale", n),
            dense(p + "self_attn.o_proj.linear.weight", ours + "attn/out/kernel", (h, e, w), 2, n),
        ]
        for proj, name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            links.append(
                dense(
                    p + f"self_attn.{proj}.linear.weight",
                    ours + f"attn/{name}/kernel",
                    (w, h, e),
                    1,
                    n,
                )
            )
        mlp = gated_mlp_links(w, f, p + "mlp.", ours + "mlp/", n)
        links += [_clippable(link) for link in mlp]
        if v.clipped_linears:
            links += [bounds(p + theirs, ours + o, n) for theirs, o in CLIPPABLE.items()]
        if v.standardize:
            links += [
                same("std_bias", "vision_projector/std_bias"),
                same("std_scale", "vision_projector/std_scale"),
            ]
        return links


def _clippable(link: Link) -> Link:
    """A Linear's link under Gemma4ClippableLinear's name (`gate_proj.linear.weight`)."""
    return renamed(link, lambda name: name.replace(".weight", ".linear.weight"))
