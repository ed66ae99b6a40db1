"""Vision families: SigLIP and the Qwen2-VL vision tower.

- SigLIP (`SiglipVisionModel`, or the vision half of a `SiglipModel`): LayerNorm blocks with
  biases and a tanh-GELU MLP, a conv patch embedding with a bias, and a learned table of
  positions that jaxmllm resizes to each native-resolution image (`positions: learned`). The
  pooling head is left alone: the projector reads the patch features.
- Qwen2-VL's vision tower (`Qwen2VisionTransformerPretrainedModel`, or `visual.` of a Qwen2-VL
  checkpoint): LayerNorm blocks, quick-GELU MLP, a fused qkv, 2D rotary positions, a temporal
  patch embedding without bias, and its patch merger, which is exactly jaxmllm's vision
  projector (the merger's LayerNorm is the tower's final norm, its MLP the projector's, exact
  GELU, hidden width 4x the tower's). Its rotary pairs feature i with i + head_dim/2 (rows in
  the first quarter, columns in the second); jaxmllm's 2D rotary gives rows the first half and
  columns the second: the same rotation once q's and k's head features are permuted, which the
  links do.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmllm.hf.family import (
    Family,
    Link,
    dense,
    matches,
    parts_of,
    permuted,
    read,
    refuse_unless,
    reshaped,
    same,
)

GELUS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


def _prefix(names: list[str], suffix: str) -> str:
    for name in names:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return ""


def layer_norm(hf: str, ours: str, layers: int = 0) -> list[Link]:
    return [
        same(hf + ".weight", ours + "/scale", layers),
        same(hf + ".bias", ours + "/bias", layers),
    ]


def linear(hf: str, ours: str, shape: tuple, n_in: int = 1, layers: int = 0) -> list[Link]:
    """A torch Linear with a bias: weight [out, in] and bias [out] <-> kernel, bias."""
    out_shape = shape[n_in:]
    return [
        dense(hf + ".weight", ours + "/kernel", shape, n_in, layers),
        reshaped(hf + ".bias", ours + "/bias", out_shape, layers),
    ]


class Siglip(Family):
    name = "siglip"
    model_types = ("siglip_vision_model", "siglip")
    role = "vision"
    hf_class = "SiglipVisionModel"

    def section(self, hf: dict) -> dict:
        hf = hf.get("vision_config", hf)  # a whole SiglipModel: its vision half
        where = "siglip config.json"
        act = read(hf, "hidden_act", where, "gelu_pytorch_tanh")
        refuse_unless(act in GELUS, where, f"hidden_act {act!r} is not supported ({list(GELUS)})")
        image, patch = int(read(hf, "image_size", where)), int(read(hf, "patch_size", where))
        return {
            "patch_size": patch,
            "channels": int(hf.get("num_channels", 3)),
            "width": int(read(hf, "hidden_size", where)),
            "depth": int(read(hf, "num_hidden_layers", where)),
            "heads": int(read(hf, "num_attention_heads", where)),
            "mlp_dim": int(read(hf, "intermediate_size", where)),
            "norm": "layer",
            "norm_eps": float(hf.get("layer_norm_eps", 1e-6)),
            "mlp": GELUS[act],
            "attn_bias": "qkvo",
            "mlp_bias": True,
            "positions": "learned",
            "position_grid": image // patch,
            "patch_bias": True,
            "temporal_patch": 1,
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        v = cfg.model.vision
        inv = {"gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
        out = dict((source or {}).get("vision_config", source or {}))
        out.update(
            architectures=[self.hf_class],
            model_type="siglip_vision_model",
            hidden_size=v.width,
            intermediate_size=v.mlp_dim,
            num_hidden_layers=v.depth,
            num_attention_heads=v.heads,
            num_channels=v.channels,
            patch_size=v.patch_size,
            image_size=v.position_grid * v.patch_size,
            hidden_act=inv[v.mlp],
            layer_norm_eps=v.norm_eps,
        )
        return out

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        v = cfg.model.vision
        w, h, f, n, p, c = v.width, v.heads, v.mlp_dim, v.depth, v.patch_size, v.channels
        e = w // h
        conv = Link(
            ("embeddings.patch_embedding.weight",),
            ("vision/patch_embed/kernel",),
            lambda x: (np.asarray(x).transpose(2, 3, 1, 0).reshape(p * p * c, w),),
            lambda k: (np.asarray(k).reshape(p, p, c, w).transpose(3, 2, 0, 1),),
        )
        layer, ours = "encoder.layers.{i}.", "vision/transformer/blocks/"
        links = [
            conv,
            same("embeddings.patch_embedding.bias", "vision/patch_embed/bias"),
            same("embeddings.position_embedding.weight", "vision/position_embedding"),
            *layer_norm("post_layernorm", "vision/transformer/final_norm"),
            *layer_norm(layer + "layer_norm1", ours + "attn_norm", n),
            *layer_norm(layer + "layer_norm2", ours + "mlp_norm", n),
            *linear(layer + "self_attn.out_proj", ours + "attn/out", (h, e, w), 2, n),
            *linear(layer + "mlp.fc1", ours + "mlp/fc1", (w, f), 1, n),
            *linear(layer + "mlp.fc2", ours + "mlp/fc2", (f, w), 1, n),
        ]
        for proj, name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            links += linear(layer + f"self_attn.{proj}", ours + f"attn/{name}", (w, h, e), 1, n)
        return links

    def prefix(self, names: list[str]) -> str:
        return _prefix(names, "embeddings.patch_embedding.weight")

    def skipped(self, name: str) -> bool:
        # The pooling head (for image-text contrastive use), a SiglipModel's text half.
        return matches([r"(.*\.)?head\..*", r"text_model\..*", r"logit_(scale|bias)"], name)


def rope_permutation(head_dim: int) -> np.ndarray:
    """Our 2D rotary head layout from Qwen2-VL's: ours[j] = theirs[perm[j]] (see the module
    docstring): rows take their features 0..q and 2q..3q, columns q..2q and 3q..4q."""
    q = head_dim // 4
    return np.concatenate([np.arange(0, q), np.arange(2 * q, 3 * q), np.arange(q, 2 * q),
                           np.arange(3 * q, 4 * q)])  # fmt: skip


class Qwen2VLVision(Family):
    name = "qwen2_vl"
    model_types = ("qwen2_vl_vision", "qwen2_vl")
    role = "vision"
    hf_class = "Qwen2VisionTransformerPretrainedModel"

    def section(self, hf: dict) -> dict:
        hf = hf.get("vision_config", hf)  # a whole Qwen2-VL: its vision tower
        where = "qwen2_vl vision config.json"
        act = read(hf, "hidden_act", where, "quick_gelu")
        refuse_unless(act == "quick_gelu", where, f"hidden_act {act!r}: expected quick_gelu")
        width, merge = int(read(hf, "embed_dim", where)), int(hf.get("spatial_merge_size", 2))
        rope = hf.get("rope_parameters") or {}
        return {
            "patch_size": int(read(hf, "patch_size", where)),
            "channels": int(hf.get("in_channels", 3)),
            "width": width,
            "depth": int(read(hf, "depth", where)),
            "heads": int(read(hf, "num_heads", where)),
            "mlp_dim": int(width * float(hf.get("mlp_ratio", 4))),
            "merge": merge,
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
            "norm": "layer",
            "norm_eps": 1e-6,
            "mlp": "quick_gelu",
            "attn_bias": "qkvo",
            "mlp_bias": True,
            "positions": "rope",
            "patch_bias": False,
            "temporal_patch": int(hf.get("temporal_patch_size", 2)),
            "projector_dim": width * merge * merge,
            "projector_act": "gelu",
        }

    def merger_out(self, hf: dict | None) -> int | None:
        """The merger's output width (the LLM width it was trained for)."""
        if hf is None:
            return None
        return int(hf.get("vision_config", hf).get("hidden_size", 0)) or None

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        v = cfg.model.vision
        out = dict((source or {}).get("vision_config", source or {}))
        out.update(
            architectures=[self.hf_class],
            model_type="qwen2_vl_vision",
            depth=v.depth,
            embed_dim=v.width,
            hidden_size=cfg.model.llm.width,
            hidden_act="quick_gelu",
            mlp_ratio=v.mlp_dim // v.width if v.mlp_dim % v.width == 0 else v.mlp_dim / v.width,
            num_heads=v.heads,
            in_channels=v.channels,
            patch_size=v.patch_size,
            spatial_merge_size=v.merge,
            temporal_patch_size=v.temporal_patch,
            rope_parameters={"rope_theta": v.rope_theta, "rope_type": "axial"},
        )
        return out

    def loads_merger(self, cfg: Any, hf: dict | None) -> bool:
        """The merger MLP is the projector only for an LLM of its output width (else the
        projector starts fresh and the merger's MLP is left alone)."""
        out = self.merger_out(hf)
        return out is None or out == cfg.model.llm.width

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        v = cfg.model.vision
        w, h, f, n, p, c, t = (v.width, v.heads, v.mlp_dim, v.depth, v.patch_size, v.channels,
                               v.temporal_patch)  # fmt: skip
        e = w // h
        perm = rope_permutation(e)
        conv = Link(
            ("patch_embed.proj.weight",),
            ("vision/patch_embed/kernel",),
            lambda x: (np.asarray(x).transpose(2, 3, 4, 1, 0).reshape(t * p * p * c, w),),
            lambda k: (np.asarray(k).reshape(t, p, p, c, w).transpose(4, 3, 0, 1, 2),),
        )
        layer, ours = "blocks.{i}.", "vision/transformer/blocks/"
        names = [ours + f"attn/{x}" for x in ("query", "key", "value")]
        kernels = [dense("", "", (w, h, e), 1) for _ in range(3)]
        biases = [reshaped("", "", (h, e)) for _ in range(3)]
        kernels[:2] = [permuted(k, perm) for k in kernels[:2]]
        biases[:2] = [permuted(b, perm) for b in biases[:2]]
        links = [
            conv,
            parts_of(layer + "attn.qkv.weight", [x + "/kernel" for x in names], kernels, n),
            parts_of(layer + "attn.qkv.bias", [x + "/bias" for x in names], biases, n),
            *linear(layer + "attn.proj", ours + "attn/out", (h, e, w), 2, n),
            *layer_norm(layer + "norm1", ours + "attn_norm", n),
            *layer_norm(layer + "norm2", ours + "mlp_norm", n),
            *linear(layer + "mlp.fc1", ours + "mlp/fc1", (w, f), 1, n),
            *linear(layer + "mlp.fc2", ours + "mlp/fc2", (f, w), 1, n),
            *layer_norm("merger.ln_q", "vision/transformer/final_norm"),
        ]
        if self.loads_merger(cfg, hf):
            hidden, out = v.projector_dim or cfg.model.llm.width, cfg.model.llm.width
            links += linear("merger.mlp.0", "vision_projector/fc1", (w * v.merge**2, hidden))
            links += linear("merger.mlp.2", "vision_projector/fc2", (hidden, out))
        return links

    def prefix(self, names: list[str]) -> str:
        return _prefix(names, "patch_embed.proj.weight")

    def skipped(self, name: str) -> bool:
        return False
