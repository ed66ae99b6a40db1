"""Vision families of the Qwen VL towers: Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's.

Both are jaxmllm's vision encoder with 2D rotary positions, a temporal patch embedding without
bias, a fused qkv with biases and a patch merger that is exactly jaxmllm's vision projector (the
merger's norm is the tower's final norm, its MLP the projector's: exact GELU, hidden width the
merged patches' `width x merge^2`). The tower's rotary pairs feature i with i + head_dim/2
(rows in the first quarter, columns in the second); jaxmllm's 2D rotary gives rows the first
half and columns the second: the same rotation once q's and k's head features are permuted,
which the links do.

- Qwen2-VL (`Qwen2VisionTransformerPretrainedModel`, or `visual.` of a Qwen2-VL): LayerNorm
  blocks with a quick-GELU MLP.
- Qwen2.5-VL (`Qwen2_5_VisionTransformerPretrainedModel`, or `visual.` of a Qwen2.5-VL):
  RMSNorm blocks with a SiLU-gated MLP with biases, and window attention: the blocks attend
  within windows of `window_size` pixels (`model.vision.window`, in patches) except those in
  `fullatt_block_indexes` (`full_blocks`), which attend over the whole image
  (`jaxmllm.models.vision_rows`: a window is a document).
- Qwen3-VL (`Qwen3VLVisionModel`, or `model.visual.` of a Qwen3-VL or Qwen3-VL-MoE): LayerNorm
  blocks with a tanh-GELU MLP with biases, a patch embedding with a bias, a learned table of
  positions (`num_position_embeddings`, a square grid) resized bilinearly to each image's grid
  and added to the patch embeddings (`position_grid`, `position_resize: bilinear`) besides the
  2D rotary, and DeepStack: the outputs of the blocks `deepstack_visual_indexes` through
  mergers of their own (`deepstack_merger_list`: a LayerNorm over the merged width, then the
  merger's MLP; our `vision_projector/deepstack`, stacked), added in the LLM's first layers.
- Qwen3.5's (`model.visual.` of a Qwen3.5 or Qwen3.5-MoE): Qwen3-VL's without DeepStack (its
  config has no `deepstack_visual_indexes`, its checkpoint no `deepstack_merger_list`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxmllm.hf.family import (
    Family,
    Link,
    dense,
    parts_of,
    permuted,
    read,
    refuse_unless,
    reshaped,
    same,
)
from jaxmllm.hf.table import QWEN2_5_VL_VISION, QWEN2_VL_VISION, QWEN3_VL_VISION
from jaxmllm.hf.vision import _prefix, layer_norm, linear

# Qwen2.5-VL video time steps a second where its config says none (transformers' default)
TOKENS_PER_SECOND = 4


def rope_permutation(head_dim: int) -> np.ndarray:
    """Our 2D rotary head layout from Qwen2-VL's: ours[j] = theirs[perm[j]] (see the module
    docstring): rows take their features 0..q and 2q..3q, columns q..2q and 3q..4q."""
    q = head_dim // 4
    return np.concatenate(
        [np.arange(0, q), np.arange(2 * q, 3 * q), np.arange(q, 2 * q), np.arange(3 * q, 4 * q)]
    )


class QwenTower(Family):
    """What the Qwen2-VL and Qwen2.5-VL towers share (see the module docstring)."""

    act = ""  # config.json's hidden_act

    def section(self, hf: dict) -> dict:
        """Our `model.vision` keys from the tower's config.json (a whole Qwen VL's
        `vision_config`): what the towers share, and their own `blocks`."""
        hf = hf.get("vision_config", hf)  # a whole Qwen VL: its vision tower
        where = f"{self.name} vision config.json"
        act = read(hf, "hidden_act", where, self.act)
        refuse_unless(act == self.act, where, f"hidden_act {act!r}: expected {self.act}")
        merge = int(hf.get("spatial_merge_size", 2))
        width = self.width(hf, where)
        rope = hf.get("rope_parameters") or {}
        return {
            "patch_size": int(read(hf, "patch_size", where)),
            "channels": int(hf.get("in_channels", hf.get("in_chans", 3))),
            "width": width,
            "depth": int(read(hf, "depth", where)),
            "heads": int(read(hf, "num_heads", where)),
            "merge": merge,
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
            "norm_eps": 1e-6,
            "attn_bias": "qkvo",
            "mlp_bias": True,
            "positions": "rope",
            "patch_bias": False,
            "temporal_patch": int(hf.get("temporal_patch_size", 2)),
            # (a video-capable patch embedding: the import takes what the family takes)
            "video": int(hf.get("temporal_patch_size", 2)) > 1,
            "projector_dim": width * merge * merge,
            "projector_act": "gelu",
            **self.blocks(hf, where, width, merge),
        }

    def width(self, hf: dict, where: str) -> int:
        """The tower's width, from the key its config.json names it by."""
        raise NotImplementedError

    def blocks(self, hf: dict, where: str, width: int, merge: int) -> dict:
        """The keys that differ between the towers (norm, MLP, windows)."""
        raise NotImplementedError

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options every Qwen VL tower has a counterpart for (the towers add their own)."""
        v = cfg.model.vision
        return {
            "model.vision.positions": ("rope",),
            "model.vision.position_grid": (0,),
            "model.vision.deepstack": ((lambda d: not d), "no DeepStack"),
            "model.vision.norm_eps": (1e-6,),
            "model.vision.attn_bias": ("qkvo",),
            "model.vision.mlp_bias": (True,),
            "model.vision.patch_bias": (False,),
            "model.vision.class_token": (False,),
            "model.vision.pre_norm": (False,),
            "model.vision.clipped_linears": (False,),
            "model.vision.final_norm": (True,),
            "model.vision.projector_act": ("gelu",),
            "model.vision.projector_dim": (
                lambda d: d == v.width * v.merge**2,
                f"the merged patches' width, {v.width * v.merge**2}",
            ),
        }

    def merger_out(self, hf: dict | None) -> int | None:
        """The merger's output width (the LLM width it was trained for)."""
        if hf is None:
            return None
        hf = hf.get("vision_config", hf)
        return int(hf.get(self.out_key, 0)) or None

    out_key = "hidden_size"  # config.json's key of the merger's output width

    def loads_merger(self, cfg: Any, hf: dict | None) -> bool:
        """The merger MLP is the projector only for an LLM of its output width (else the
        projector starts fresh and the merger's MLP is left alone)."""
        out = self.merger_out(hf)
        return out is None or out == cfg.model.llm.width

    def common_config(self, cfg: Any, source: dict | None) -> dict:
        """The config.json keys every Qwen VL tower writes alike (`source`'s others kept)."""
        v = cfg.model.vision
        out = dict((source or {}).get("vision_config", source or {}))
        out.update(
            architectures=[self.hf_class],
            model_type=self.model_types[0],
            depth=v.depth,
            hidden_act=self.act,
            num_heads=v.heads,
            in_channels=v.channels,
            patch_size=v.patch_size,
            spatial_merge_size=v.merge,
            temporal_patch_size=v.temporal_patch,
            rope_parameters={"rope_theta": v.rope_theta, "rope_type": "axial"},
        )
        return out

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The patch embedding, the fused qkv (its q and k rows permuted to our 2D rotary), the
        output projection, the blocks' own links and, where it is ours, the merger."""
        v = cfg.model.vision
        w, h, n, p, c, t = v.width, v.heads, v.depth, v.patch_size, v.channels, v.temporal_patch
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
            *self.block_links(cfg, layer, ours),
        ]
        if self.loads_merger(cfg, hf):
            links += self.merger_links(cfg)
        return links

    def merger_links(self, cfg: Any) -> list[Link]:
        """The merger's MLP: our vision projector (its norm is the tower's final norm)."""
        v = cfg.model.vision
        hidden, out = v.projector_dim or cfg.model.llm.width, cfg.model.llm.width
        return [
            *linear("merger.mlp.0", "vision_projector/fc1", (v.width * v.merge**2, hidden)),
            *linear("merger.mlp.2", "vision_projector/fc2", (hidden, out)),
        ]

    def block_links(self, cfg: Any, layer: str, ours: str) -> list[Link]:
        """A block's norms and MLP, and the final norm (the merger's), as the tower names them."""
        raise NotImplementedError

    def prefix(self, names: list[str]) -> str:
        """What a whole checkpoint puts before the tower's names (`visual.`)."""
        return _prefix(names, "patch_embed.proj.weight")

    def skipped(self, name: str) -> bool:
        """The merger's MLP when it was trained for another LLM width (`loads_merger`)."""
        # The merger's MLP when it was trained for another LLM width (`loads_merger`).
        return name.startswith("merger.mlp.")


class Qwen2VLVision(QwenTower):
    """Qwen2-VL's tower (the module docstring)."""

    row = QWEN2_VL_VISION
    act = "quick_gelu"

    def width(self, hf: dict, where: str) -> int:
        """Qwen2-VL's width is its `embed_dim`."""
        return int(read(hf, "embed_dim", where))

    def blocks(self, hf: dict, where: str, width: int, merge: int) -> dict:
        """LayerNorm blocks with a quick-GELU MLP of `mlp_ratio` times the width."""
        mlp = int(width * float(hf.get("mlp_ratio", 4)))
        return {"mlp_dim": mlp, "norm": "layer", "mlp": "quick_gelu"}

    def wants(self, cfg: Any) -> dict[str, Any]:
        """The shared options, LayerNorm and quick-GELU, no windows, a time step per patch."""
        return {
            **super().wants(cfg),
            "model.vision.norm": ("layer",),
            "model.vision.mlp": ("quick_gelu",),
            "model.vision.window": (0,),
            "model.vision.tokens_per_second": (0,),  # (a time step per temporal patch)
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The tower's config.json (`embed_dim`, the LLM's width as its merger's output)."""
        v = cfg.model.vision
        out = self.common_config(cfg, source)
        out.update(
            embed_dim=v.width,
            hidden_size=cfg.model.llm.width,
            mlp_ratio=v.mlp_dim // v.width if v.mlp_dim % v.width == 0 else v.mlp_dim / v.width,
        )
        return out

    def block_links(self, cfg: Any, layer: str, ours: str) -> list[Link]:
        """LayerNorms `norm1`, `norm2`, the MLP's `fc1`, `fc2`, the merger's `ln_q`."""
        v = cfg.model.vision
        w, f, n = v.width, v.mlp_dim, v.depth
        return [
            *layer_norm(layer + "norm1", ours + "attn_norm", n),
            *layer_norm(layer + "norm2", ours + "mlp_norm", n),
            *linear(layer + "mlp.fc1", ours + "mlp/fc1", (w, f), 1, n),
            *linear(layer + "mlp.fc2", ours + "mlp/fc2", (f, w), 1, n),
            *layer_norm("merger.ln_q", "vision/transformer/final_norm"),
        ]


class Qwen25VLVision(QwenTower):
    """Qwen2.5-VL's tower (the module docstring)."""

    row = QWEN2_5_VL_VISION
    act = "silu"
    out_key = "out_hidden_size"

    def width(self, hf: dict, where: str) -> int:
        """Qwen2.5-VL's width is its `hidden_size`."""
        return int(read(hf, "hidden_size", where))

    def blocks(self, hf: dict, where: str, width: int, merge: int) -> dict:
        """RMSNorm blocks with a SiLU-gated MLP, windows of `window_size` pixels, the full-
        attention blocks, videos' time steps a second."""
        patch = int(read(hf, "patch_size", where))
        units = int(read(hf, "window_size", where)) // merge // patch  # merged tokens a side
        refuse_unless(
            units >= 1,
            where,
            f"window_size {hf['window_size']} is under one merge block ({merge} x {patch} pixels)",
        )
        full = [int(i) for i in hf.get("fullatt_block_indexes") or []]
        # (videos in absolute time; transformers' Qwen2_5_VLVisionConfig default when absent)
        tps = float(hf.get("tokens_per_second", TOKENS_PER_SECOND))
        refuse_unless(tps > 0, where, f"tokens_per_second {tps}: expected a positive rate")
        return {
            "tokens_per_second": tps,
            "mlp_dim": int(read(hf, "intermediate_size", where)),
            "norm": "rms",
            "mlp": "gated_silu",
            "window": units * merge,
            "full_blocks": full,
        }

    def wants(self, cfg: Any) -> dict[str, Any]:
        """The shared options, RMSNorm and the gated MLP, windows and videos in absolute time."""
        v = cfg.model.vision
        return {
            **super().wants(cfg),
            "model.vision.norm": ("rms",),
            "model.vision.mlp": ("gated_silu",),
            "model.vision.window": (lambda x: x > 0, "windows of window_size pixels"),
            "model.vision.tokens_per_second": (
                lambda x: x > 0,
                "videos placed in absolute time (its vision_config.tokens_per_second)",
            ),
            "model.vision.full_blocks": (
                lambda b: all(i < v.depth for i in b),
                "full-attention blocks among its blocks",
            ),
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The tower's config.json with its windows, full blocks and time steps a second."""
        v = cfg.model.vision
        out = self.common_config(cfg, source)
        out.update(
            hidden_size=v.width,
            intermediate_size=v.mlp_dim,
            out_hidden_size=cfg.model.llm.width,
            window_size=v.window * v.patch_size,
            fullatt_block_indexes=list(v.full_blocks),
            tokens_per_second=_whole_number(v.tokens_per_second),
        )
        return out

    def block_links(self, cfg: Any, layer: str, ours: str) -> list[Link]:
        """RMSNorms `norm1`, `norm2` and `merger.ln_q`, and the gated MLP's Linears."""
        v = cfg.model.vision
        w, f, n = v.width, v.mlp_dim, v.depth
        links = [
            same(layer + "norm1.weight", ours + "attn_norm/scale", n),
            same(layer + "norm2.weight", ours + "mlp_norm/scale", n),
            same("merger.ln_q.weight", "vision/transformer/final_norm/scale"),
        ]
        for proj, name, shape in (
            ("gate_proj", "gate", (w, f)),
            ("up_proj", "up", (w, f)),
            ("down_proj", "down", (f, w)),
        ):
            links += linear(layer + f"mlp.{proj}", ours + f"mlp/{name}", shape, 1, n)
        return links


def _whole_number(x: float) -> int | float:
    """transformers' configs write tokens_per_second as an int (4, 2): kept one where it is."""
    return int(x) if float(x).is_integer() else x


class Qwen3VLVision(QwenTower):
    """Qwen3-VL's tower (the module docstring); `kind`: the whole checkpoint it is written
    into (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5: the vision config's model_type is its name and
    `_vision`; default its own name); `deepstack`: whether it has DeepStack (Qwen3.5's has
    none)."""

    row = QWEN3_VL_VISION
    act = "gelu_pytorch_tanh"
    out_key = "out_hidden_size"

    def __init__(self, kind: str = "", deepstack: bool = True):
        """The tower as the whole `kind` writes it (see the class docstring)."""
        super().__init__()
        self.kind, self.deepstack = kind or self.name, deepstack

    def width(self, hf: dict, where: str) -> int:
        """Qwen3-VL's width is its `hidden_size`."""
        return int(read(hf, "hidden_size", where))

    def blocks(self, hf: dict, where: str, width: int, merge: int) -> dict:
        """LayerNorm blocks with a tanh-GELU MLP, a patch bias, the learned table of positions (a
        square grid) and the DeepStack levels."""
        table = int(read(hf, "num_position_embeddings", where))
        grid = math.isqrt(table)
        refuse_unless(
            grid * grid == table,
            where,
            f"num_position_embeddings {table} is not a square grid of positions",
        )
        deep = [int(i) for i in hf.get("deepstack_visual_indexes") or []]
        refuse_unless(
            self.deepstack or not deep,
            where,
            f"deepstack_visual_indexes {deep}: a {self.kind} tower has no DeepStack",
        )
        depth = int(read(hf, "depth", where))
        refuse_unless(
            all(0 <= i < depth for i in deep) and len(set(deep)) == len(deep),
            where,
            f"deepstack_visual_indexes {deep} must be distinct blocks of the tower's {depth}",
        )
        return {
            "mlp_dim": int(read(hf, "intermediate_size", where)),
            "norm": "layer",
            "mlp": "gelu_tanh",
            "patch_bias": True,
            "position_grid": grid,
            "position_resize": "bilinear",
            "deepstack": deep,
        }

    def wants(self, cfg: Any) -> dict[str, Any]:
        """The shared options, the learned positions resized bilinearly, DeepStack (or none)."""
        return {
            **super().wants(cfg),
            "model.vision.norm": ("layer",),
            "model.vision.mlp": ("gelu_tanh",),
            "model.vision.patch_bias": (True,),
            "model.vision.position_grid": ((lambda g: g > 0), "a learned table of positions"),
            "model.vision.position_resize": ("bilinear",),
            "model.vision.window": (0,),
            "model.vision.tokens_per_second": (0,),  # (videos: a time step per frame)
            "model.vision.deepstack": (
                (
                    lambda d: len(d) <= cfg.model.llm.depth,
                    "DeepStack into as many of the LLM's first layers",
                )
                if self.deepstack
                else ((lambda d: not d), "no DeepStack")
            ),
        }

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The tower's config.json, its model type the whole's (`kind`)."""
        v = cfg.model.vision
        out = self.common_config(cfg, source)
        out.update(
            model_type=f"{self.kind}_vision",
            hidden_size=v.width,
            intermediate_size=v.mlp_dim,
            out_hidden_size=cfg.model.llm.width,
            num_position_embeddings=v.position_grid**2,
        )
        if self.deepstack:
            out["deepstack_visual_indexes"] = list(v.deepstack)
        return out

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The shared links, the patch embedding's bias and the position table."""
        return [
            *super().links(cfg, hf),
            same("patch_embed.proj.bias", "vision/patch_embed/bias"),
            same("pos_embed.weight", "vision/position_embedding"),
        ]

    def block_links(self, cfg: Any, layer: str, ours: str) -> list[Link]:
        """LayerNorms `norm1`, `norm2` and `merger.norm`, the MLP's `linear_fc1`, `linear_fc2`."""
        v = cfg.model.vision
        w, f, n = v.width, v.mlp_dim, v.depth
        return [
            *layer_norm(layer + "norm1", ours + "attn_norm", n),
            *layer_norm(layer + "norm2", ours + "mlp_norm", n),
            *linear(layer + "mlp.linear_fc1", ours + "mlp/fc1", (w, f), 1, n),
            *linear(layer + "mlp.linear_fc2", ours + "mlp/fc2", (f, w), 1, n),
            *layer_norm("merger.norm", "vision/transformer/final_norm"),
        ]

    def merger_links(self, cfg: Any) -> list[Link]:
        """The merger's MLP (our projector) and DeepStack's mergers (stacked: `{i}` a level)."""
        v = cfg.model.vision
        merged, out = v.width * v.merge**2, cfg.model.llm.width
        hidden, k = v.projector_dim or out, len(v.deepstack)
        deep, ours = "deepstack_merger_list.{i}.", "vision_projector/deepstack/"
        links = [
            *linear("merger.linear_fc1", "vision_projector/fc1", (merged, hidden)),
            *linear("merger.linear_fc2", "vision_projector/fc2", (hidden, out)),
        ]
        if k:
            links += [
                *layer_norm(deep + "norm", ours + "norm", k),
                *linear(deep + "linear_fc1", ours + "fc1", (merged, hidden), 1, k),
                *linear(deep + "linear_fc2", ours + "fc2", (hidden, out), 1, k),
            ]
        return links

    def skipped(self, name: str) -> bool:
        """The mergers when they were trained for another LLM width (`loads_merger`)."""
        # The mergers when they were trained for another LLM width (`loads_merger`).
        return name.startswith(("merger.linear_fc", "deepstack_merger_list."))
