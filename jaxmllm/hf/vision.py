"""Vision families of learned-position towers: SigLIP and CLIP.

- SigLIP (`SiglipVisionModel`, or the vision half of a `SiglipModel`): LayerNorm blocks with
  biases and a tanh-GELU MLP, a conv patch embedding with a bias, and a learned table of
  positions that jaxmllm resizes to each native-resolution image (`positions: learned`). The
  pooling head is left alone: the projector reads the patch features.
- CLIP (`CLIPVisionModel`, or the vision half of a `CLIPModel`): the same blocks with a
  quick-GELU MLP, a patch embedding without bias, a learned class token (`class_token`: its
  own row of the position table, the table's first) and a LayerNorm before the blocks
  (`pre_norm`: its `pre_layrnorm`).

Both end in a LayerNorm (`post_layernorm`); a LLaVA checkpoint reads a hidden layer before it
(`jaxmllm.hf.wholes`), so its links and what is left alone follow `final_norm` and `depth`.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxmllm.hf.family import (
    Family,
    Link,
    dense,
    matches,
    read,
    refuse_unless,
    reshaped,
    same,
    split_rows,
)
from jaxmllm.hf.table import CLIP, SIGLIP

GELUS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


def _prefix(names: list[str], suffix: str) -> str:
    """What the first of `names` ending in `suffix` has before it ("" if none does)."""
    for name in names:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return ""


def layer_norm(hf: str, ours: str, layers: int = 0) -> list[Link]:
    """A torch LayerNorm's weight and bias <-> our scale and bias."""
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


def conv2d(hf: str, ours: str, p: int, c: int, w: int) -> Link:
    """A torch Conv2d patch embedding [w, c, p, p] <-> our kernel [(p, p, c), w]."""
    return Link(
        (hf,),
        (ours,),
        lambda x: (np.asarray(x).transpose(2, 3, 1, 0).reshape(p * p * c, w),),
        lambda k: (np.asarray(k).reshape(p, p, c, w).transpose(3, 2, 0, 1),),
    )


class LearnedTower(Family):
    """What SigLIP and CLIP share: config.json's keys, the encoder layers, the final norm."""

    acts: dict[str, str] = {}  # HF hidden_act -> our mlp
    options: dict[str, Any] = {}  # our options fixed by the architecture
    norm_eps = 1e-5  # config.json's layer_norm_eps where it names none

    def section(self, hf: dict) -> dict:
        """Our `model.vision` keys from the tower's config.json (a whole model's
        `vision_config`)."""
        hf = hf.get("vision_config", hf)  # a whole model: its vision half
        where = f"{self.name} config.json"
        act = read(hf, "hidden_act", where, next(iter(self.acts)))
        refuse_unless(
            act in self.acts, where, f"hidden_act {act!r} is not supported ({list(self.acts)})"
        )
        image, patch = int(read(hf, "image_size", where)), int(read(hf, "patch_size", where))
        return {
            "patch_size": patch,
            "channels": int(hf.get("num_channels", 3)),
            "width": int(read(hf, "hidden_size", where)),
            "depth": int(read(hf, "num_hidden_layers", where)),
            "heads": int(read(hf, "num_attention_heads", where)),
            "mlp_dim": int(read(hf, "intermediate_size", where)),
            "norm": "layer",
            "norm_eps": float(hf.get("layer_norm_eps", self.norm_eps)),
            "mlp": self.acts[act],
            "attn_bias": "qkvo",
            "mlp_bias": True,
            "positions": "learned",
            "position_grid": image // patch,
            "temporal_patch": 1,
            **self.options,
        }

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options this architecture has a counterpart for (a tower from scratch)."""
        fixed = {f"model.vision.{k}": (v,) for k, v in self.options.items()}
        return {
            **fixed,
            "model.vision.positions": ("learned",),
            "model.vision.norm": ("layer",),
            "model.vision.mlp": tuple(self.acts.values()),
            "model.vision.attn_bias": ("qkvo",),
            "model.vision.mlp_bias": (True,),
            "model.vision.temporal_patch": (1,),
            "model.vision.window": (0,),
            "model.vision.clipped_linears": (False,),
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The tower's config.json of our `model.vision` (`source`'s other keys kept)."""
        v = cfg.model.vision
        inv = {ours: theirs for theirs, ours in reversed(self.acts.items())}
        out = dict((source or {}).get("vision_config", source or {}))
        out.update(
            architectures=[self.hf_class],
            model_type=self.model_types[0],
            hidden_size=v.width,
            intermediate_size=v.mlp_dim,
            num_hidden_layers=out.get("num_hidden_layers", v.depth) if source else v.depth,
            num_attention_heads=v.heads,
            num_channels=v.channels,
            patch_size=v.patch_size,
            image_size=v.position_grid * v.patch_size,
            hidden_act=inv[v.mlp],
            layer_norm_eps=v.norm_eps,
        )
        return out

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The patch embedding, the encoder layers and (with `final_norm`) the final norm."""
        v = cfg.model.vision
        w, h, f, n = v.width, v.heads, v.mlp_dim, v.depth
        e = w // h
        layer, ours = "encoder.layers.{i}.", "vision/transformer/blocks/"
        links = [
            conv2d(
                "embeddings.patch_embedding.weight",
                "vision/patch_embed/kernel",
                v.patch_size,
                v.channels,
                w,
            ),
            *layer_norm(layer + "layer_norm1", ours + "attn_norm", n),
            *layer_norm(layer + "layer_norm2", ours + "mlp_norm", n),
            *linear(layer + "self_attn.out_proj", ours + "attn/out", (h, e, w), 2, n),
            *linear(layer + "mlp.fc1", ours + "mlp/fc1", (w, f), 1, n),
            *linear(layer + "mlp.fc2", ours + "mlp/fc2", (f, w), 1, n),
        ]
        for proj, name in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
            links += linear(layer + f"self_attn.{proj}", ours + f"attn/{name}", (w, h, e), 1, n)
        if v.final_norm:
            links += layer_norm("post_layernorm", "vision/transformer/final_norm")
        return links

    def prefix(self, names: list[str]) -> str:
        """What a whole SiglipModel or CLIPModel puts before the tower's names."""
        return _prefix(names, "embeddings.patch_embedding.weight")

    def unused(self, name: str, depth: int) -> bool:
        """Whether a tower tensor is one a tower read at `depth` layers, before its final
        norm, does not use (LLaVA's feature layer)."""
        match = re.fullmatch(r"encoder\.layers\.(\d+)\..*", name)
        return bool(match and int(match.group(1)) >= depth) or name.startswith("post_layernorm.")


class Siglip(LearnedTower):
    """SigLIP's tower (the module docstring)."""

    row = SIGLIP
    acts = GELUS
    options = {"patch_bias": True, "class_token": False, "pre_norm": False, "final_norm": True}
    norm_eps = 1e-6

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The shared links, the patch embedding's bias and the position table."""
        return [
            *super().links(cfg, hf),
            same("embeddings.patch_embedding.bias", "vision/patch_embed/bias"),
            same("embeddings.position_embedding.weight", "vision/position_embedding"),
        ]

    def skipped(self, name: str) -> bool:
        """The pooling head (for image-text contrastive use), a SiglipModel's text half."""
        return matches([r"(.*\.)?head\..*", r"text_model\..*", r"logit_(scale|bias)"], name)


class Clip(LearnedTower):
    """CLIP's tower (the module docstring)."""

    row = CLIP
    acts = {"quick_gelu": "quick_gelu", "gelu": "gelu"}
    # CLIPVisionModel's last_hidden_state is the blocks' output: its post_layernorm only
    # normalises the pooled class token, left alone here
    options = {"patch_bias": False, "class_token": True, "pre_norm": True, "final_norm": False}

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The shared links, the class token, its position row and the pre-blocks norm."""
        table = ("vision/class_position", "vision/position_embedding")
        return [
            *super().links(cfg, hf),
            same("embeddings.class_embedding", "vision/class_embedding"),
            split_rows("embeddings.position_embedding.weight", table, 1),
            *layer_norm("pre_layrnorm", "vision/pre_norm"),
        ]

    def skipped(self, name: str) -> bool:
        """A CLIPModel's text half and projections; an older file's position_ids buffer."""
        patterns = [
            r"text_model\..*",
            r"(visual|text)_projection\..*",
            r"logit_scale",
            r"(.*\.)?position_ids",
            r"post_layernorm\..*",
        ]
        return matches(patterns, name)
