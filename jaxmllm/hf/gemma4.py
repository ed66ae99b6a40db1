"""Gemma 4's text decoder: `Gemma4ForCausalLM` (`gemma4_text`, the row of `jaxmllm.hf.table`
with `layer_scalar`).

Gemma 3's block (`jaxmllm.hf.gemma`: four norms a layer, GeGLU, embeddings scaled by
sqrt(width), QK-norm, sliding and full layers by `layer_types`) with what Gemma 4 changed, each
an option of `model.llm`: its RMSNorms scale by their weight, not 1 + it (`norm: rms`); the
values are normed too, without a scale (`v_norm`); the scores are not scaled (`attn_scalar:
1`); each layer's output is multiplied by its `layer_scalar`; the logits are soft-capped
(`final_logit_softcapping`: `logit_softcap`). The full-attention layers have their own head
width and key-value heads (`per_layer_config`, or the hub's `global_head_dim` and
`num_global_key_value_heads`: `full_head_dim`, `full_kv_heads`), may take their values from the
key projection (`attention_k_eq_v`: `full_k_eq_v`), and turn a share of their rotary
frequencies (`rope_parameters.full_attention` of type `proportional`: `rope_scaling`).

The mixture-of-experts block (`enable_moe_block`, Gemma-4-26B-A4B) is jaxmllm's MoE
(`jaxmllm.models.moe`, `model.llm.moe`) in every layer: the layer's dense MLP is its shared
expert, ungated (`shared_mlp_dim`: intermediate_size, `shared_gate: false`), beside
`num_experts` routed GeGLU experts of `moe_intermediate_size`, `top_k_experts` a token; the
router reads the residual stream through its own weightless RMSNorm and scale (`router_norm`),
its top-k renormalised and times `per_expert_scale` (`expert_scale`); the two branches are
normed apart before and after (`branch_norms`: pre_feedforward_layernorm_2,
post_feedforward_layernorm_1 and _2). The experts are stored fused as transformers holds them
(`experts.gate_up_proj` [E, 2f, width], `experts.down_proj` [E, width, f]).

The small checkpoints (E2B, E4B) add two more. Per-layer inputs (`hidden_size_per_layer_input`,
256 where config.json leaves it out, as transformers reads it: `per_layer_dim`; the table's
vocabulary `vocab_size_per_layer_input`, `per_layer_vocab`; an encoder slot's id its
`pad_token_id`, `per_layer_pad_id`; `jaxmllm.models.per_layer`). Keys and values shared by the
last `num_kv_shared_layers` layers (`kv_shared_layers`): each reads those of the last earlier
layer of its type, sliding or full, and has no k/v projections or norms of its own (a
checkpoint that stores them anyway has them left alone, as transformers leaves them); with
`use_double_wide_mlp` their MLPs are twice as wide (`kv_shared_wide_mlp`).

Refused, naming the key: the MoE block beside per-layer inputs or shared keys (no checkpoint
has both; they are not checked together), bidirectional attention over all tokens
(`use_bidirectional_attention: all`), every layer sharing its keys (`num_kv_shared_layers`
equal to the depth: none would compute them).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxmllm.config.decoder import LayerKind
from jaxmllm.hf.decoders import (
    gated_mlp_links,
    layer_types,
    rope_section,
    rope_to_hf,
    shape_section,
    stacked_experts_links,
)
from jaxmllm.hf.family import Link, dense, read, refuse_unless, same
from jaxmllm.hf.gemma import (
    ACTIVATIONS,
    LAYER_TYPES,
    Gemma3,
    refuse_set,
    rope_parameters,
    window_section,
)

# What a Gemma 4 text config.json may turn on that is not built: refused unless unset (0 /
# null / false), each with what it is
NOT_BUILT = {
    # (none today: the per-layer inputs, shared keys and the MoE block are all read)
}
# transformers' default head width of the full layers where config.json names none
GLOBAL_HEAD_DIM = 512
# transformers' defaults of the per-layer inputs where config.json leaves them out (E2B's)
PER_LAYER_DIM = 256
PER_LAYER_VOCAB = 262_144
# The attention tensors a layer reusing another's keys and values has no place for (a
# checkpoint may hold them: transformers leaves them alone too)
SHARED_LEFT = re.compile(r"model\.layers\.\d+\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.")


class Gemma4(Gemma3):
    """Gemma 4's causal LM (module docstring): Gemma 3's family with Gemma 4's options."""

    def section(self, hf: dict) -> dict:
        """Our `model.llm` keys from Gemma 4's text config.json.

        Raises:
          FamilyError: naming a key whose value jaxmllm's decoder does not run.
        """
        where = f"{self.name} config.json"
        refuse_set(hf, where, NOT_BUILT, "set 0 / false for a checkpoint without it")
        both = hf.get("use_bidirectional_attention")
        refuse_unless(
            both in (None, "vision"),
            where,
            f"use_bidirectional_attention {both!r}: only causal text is built (null, or "
            "vision, which a text-only decoder never reaches)",
        )
        act = hf.get("hidden_activation") or ACTIVATIONS[0]
        refuse_unless(
            act in ACTIVATIONS,
            where,
            f"hidden_activation {act!r}: Gemma's MLP here is GeGLU with the tanh GELU "
            f"({' or '.join(ACTIVATIONS)})",
        )
        shape = shape_section(hf, where, tied=True)
        full, local = rope_parameters(hf, where)
        theta, scaling = full_rope(full, where)
        window = window_section(hf, where, shape["depth"], local)
        head_dim, kv_heads = full_shape(hf, where, shape)
        out = {
            **shape,
            "mlp_dim": int(hf["intermediate_size"]),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "norm": "rms",
            "mlp": "gated_gelu_tanh",
            "attn_bias": self.row.biases.read(hf),
            "qk_norm": True,
            "v_norm": True,
            "post_norms": True,
            "embed_scale": True,
            "attn_scalar": 1.0,
            "layer_scalar": True,
            "logit_softcap": float(hf.get("final_logit_softcapping") or 0.0),
            "window": window,
            "mrope_section": [0, 0, 0],
            **per_layer_section(hf, where),
            **kv_sharing_section(hf, where, shape["depth"], window["layers"]),
        }
        k_eq_v = bool(hf.get("attention_k_eq_v"))
        if window["layers"]:  # (the full layers' own shapes beside the windowed ones)
            width = out["head_dim"] or out["width"] // out["heads"]
            out["full_head_dim"] = head_dim if head_dim != width else 0
            out["full_kv_heads"] = kv_heads if kv_heads != out["kv_heads"] else 0
            out["full_k_eq_v"] = k_eq_v
        else:  # (every layer a full one: its shapes are the decoder's)
            refuse_unless(not k_eq_v, where, "attention_k_eq_v with no sliding layers is not built")
            out["kv_heads"] = kv_heads or out["kv_heads"]
            out["head_dim"] = 0 if head_dim * out["heads"] == out["width"] else head_dim
        if hf.get("enable_moe_block"):
            refuse_unless(
                not (out["per_layer_dim"] or out["kv_shared_layers"]),
                where,
                "enable_moe_block with hidden_size_per_layer_input or num_kv_shared_layers: the "
                "MoE block beside per-layer inputs or shared keys is not built (no checkpoint "
                "has both); set hidden_size_per_layer_input and num_kv_shared_layers to 0",
            )
            out["moe"] = moe_section(hf, where, out["mlp_dim"])
        return out

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """Gemma 4's text config.json of our `model.llm`: Gemma 3's, less the keys Gemma 4
        has not, with the full layers' shapes (`per_layer_config`), their rotary, the scores
        unscaled and the logits' soft cap."""
        llm = cfg.model.llm
        old = ("global_head_dim", "num_global_key_value_heads", "per_layer_config")
        out = super().to_hf_config(cfg, {k: v for k, v in (source or {}).items() if k not in old})
        for key in ("query_pre_attn_scalar", "attn_logit_softcapping"):
            del out[key]
        full = [i for i in range(llm.depth) if not llm.window.is_sliding(i)]
        own = {"head_dim": llm.full_head_dim or llm.head_width}
        if llm.full_k_eq_v:  # (transformers reads the kv heads' override with k_eq_v only)
            own["num_key_value_heads"] = llm.full_kv_heads or llm.kv_heads
        out.update(
            final_logit_softcapping=llm.logit_softcap or None,
            attention_k_eq_v=llm.full_k_eq_v,
            per_layer_config={str(i): dict(own) for i in full} if llm.window.enabled else {},
            hidden_size_per_layer_input=llm.per_layer_dim,
            vocab_size_per_layer_input=llm.per_layer_vocab_size,
            num_kv_shared_layers=llm.kv_shared_layers,
            use_double_wide_mlp=llm.kv_shared_wide_mlp,
            **moe_to_hf(llm),
        )
        if llm.per_layer_dim:
            out["pad_token_id"] = llm.per_layer_pad_id
        out["rope_parameters"]["full_attention"] = full_rope_to_hf(llm)
        return out

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options Gemma 4 has a counterpart for (a decoder from scratch)."""
        out = super().wants(cfg)
        anything = lambda what: ((lambda _: True), what)  # noqa: E731
        out.update(
            {
                "model.llm.norm": ("rms",),
                "model.llm.attn_scalar": (1.0,),
                "model.llm.v_norm": (True,),
                "model.llm.layer_scalar": (True,),
                "model.llm.logit_softcap": anything("any final_logit_softcapping"),
                "model.llm.full_head_dim": anything("any global head width"),
                "model.llm.full_kv_heads": anything("any global key-value heads"),
                "model.llm.full_k_eq_v": anything("attention_k_eq_v or not"),
                "model.llm.moe.experts": anything("its MoE block or none (enable_moe_block)"),
                **moe_wants(cfg.model.llm),
                "model.llm.per_layer_dim": anything("any hidden_size_per_layer_input"),
                "model.llm.per_layer_vocab": anything("any vocab_size_per_layer_input"),
                "model.llm.per_layer_pad_id": anything("any pad_token_id"),
                "model.llm.kv_shared_layers": anything("any num_kv_shared_layers"),
                "model.llm.kv_shared_wide_mlp": anything("use_double_wide_mlp or not"),
            }
        )
        return out

    def mlp_links(self, llm: Any, kind: LayerKind, p: str, ours: str, n: int) -> list[Link]:
        """Gemma's GeGLU MLP; in an MoE layer, our MoE's shared expert, and beside it the
        router, the experts (fused as transformers holds them) and the branches' norms."""
        if not kind.moe:
            return super().mlp_links(llm, kind, p, ours, n)
        w, moe, mlp = llm.width, llm.moe, ours + "mlp/"
        return [
            *gated_mlp_links(w, moe.shared_mlp_dim, p + "mlp.", mlp + "shared/", n),
            same(p + "post_feedforward_layernorm_1.weight", ours + "shared_post_norm/scale", n),
            dense(p + "router.proj.weight", mlp + "router/kernel", (w, moe.experts), 1, n),
            same(p + "router.scale", mlp + "router_scale", n),
            same(p + "router.per_expert_scale", mlp + "expert_scale", n),
            same(p + "pre_feedforward_layernorm_2.weight", ours + "experts_norm/scale", n),
            *stacked_experts_links(p + "experts.", mlp + "experts/", moe, w, n),
            same(p + "post_feedforward_layernorm_2.weight", ours + "experts_post_norm/scale", n),
        ]

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """Gemma 3's links, and the per-layer inputs' table, projection and norm."""
        llm = cfg.model.llm
        links = super().links(cfg, hf)
        if not llm.per_layer_dim:
            return links
        shape = (llm.width, llm.depth, llm.per_layer_dim)
        return [
            *links,
            same("model.embed_tokens_per_layer.weight", "llm/per_layer/embed/embedding"),
            dense(
                "model.per_layer_model_projection.weight", "llm/per_layer/projection/kernel", shape
            ),
            same("model.per_layer_projection_norm.weight", "llm/per_layer/norm/scale"),
        ]

    def skipped(self, name: str) -> bool:
        """Gemma 3's, and the keys and values of a layer reusing another's (`SHARED_LEFT`:
        every other layer's are consumed, so only theirs reach here)."""
        return bool(SHARED_LEFT.match(name)) or super().skipped(name)

    def layer_links(self, llm: Any, stack: str, kind: LayerKind, n: int) -> list[Link]:
        """Gemma 3's links of one stack at its own head shapes (a full stack's may differ),
        without a value projection where the values are the keys', without keys and values
        where the layers reuse another's (their MLPs maybe twice as wide), the per-layer
        inputs' gate, projection and norm, and the layer scalars."""
        if not kind.sliding and llm.window.enabled:
            llm = dataclasses.replace(
                llm,
                head_dim=llm.full_head_dim or llm.head_width,
                kv_heads=llm.full_kv_heads or llm.kv_heads,
            )
        if kind.kv_shared and llm.kv_shared_wide_mlp:
            llm = dataclasses.replace(llm, mlp_dim=2 * llm.mlp_dim)
        links = super().layer_links(llm, stack, kind, n)
        if llm.full_k_eq_v and not kind.sliding:
            links = [x for x in links if ".v_proj." not in x.hf[0]]
        if kind.kv_shared:
            links = [x for x in links if not SHARED_LEFT.match(x.hf[0].replace("{i}", "0"))]
        p, ours = "model.layers.{i}.", f"llm/transformer/{stack}/"
        if llm.per_layer_dim:
            w, d = llm.width, llm.per_layer_dim
            links += [
                dense(
                    p + "per_layer_input_gate.weight", ours + "per_layer_gate/kernel", (w, d), 1, n
                ),
                dense(
                    p + "per_layer_projection.weight", ours + "per_layer_out/kernel", (d, w), 1, n
                ),
                same(p + "post_per_layer_input_norm.weight", ours + "per_layer_norm/scale", n),
            ]
        return [*links, same(p + "layer_scalar", ours + "layer_scalar", n)]


def per_layer_section(hf: dict, where: str) -> dict:
    """Our per-layer inputs' keys (`per_layer_dim`, `per_layer_vocab`, `per_layer_pad_id`) of
    `hidden_size_per_layer_input` and `vocab_size_per_layer_input`, transformers' defaults where
    config.json leaves them out, and `pad_token_id` (an encoder slot's row)."""
    dim = int(hf.get("hidden_size_per_layer_input", PER_LAYER_DIM) or 0)
    if not dim:
        return {"per_layer_dim": 0}
    vocab = int(hf.get("vocab_size_per_layer_input", PER_LAYER_VOCAB) or 0)
    pad = hf.get("pad_token_id")
    refuse_unless(
        vocab > 0 and (pad is None or 0 <= int(pad) < vocab),
        where,
        f"vocab_size_per_layer_input {vocab} and pad_token_id {pad!r}: the per-layer table "
        "needs rows, the pad token's among them (an image's or a clip's tokens read its row)",
    )
    # (the table's rows given even where they are the vocabulary's: an import may grow that)
    return {"per_layer_dim": dim, "per_layer_vocab": vocab, "per_layer_pad_id": int(pad or 0)}


def kv_sharing_section(hf: dict, where: str, depth: int, sliding: list[int]) -> dict:
    """Our `kv_shared_layers` and `kv_shared_wide_mlp` of `num_kv_shared_layers` and
    `use_double_wide_mlp` (which transformers reads only with shared layers).

    Raises:
      FamilyError: every layer shares (none computes keys), or a shared layer's type (sliding
        or full) has no earlier layer that computes them (transformers refuses that too).
    """
    n = int(hf.get("num_kv_shared_layers") or 0)
    refuse_unless(
        0 <= n < depth,
        where,
        f"num_kv_shared_layers {n}: the layers before the last {n} of {depth} compute the keys "
        "and values those reuse, so it must be less than num_hidden_layers",
    )
    first = depth - n
    types = {i in sliding for i in range(first, depth)}
    refuse_unless(
        types <= {i in sliding for i in range(first)},
        where,
        f"num_kv_shared_layers {n}: a shared layer's type (sliding or full) has no earlier "
        "layer of its type to reuse keys and values from",
    )
    return {"kv_shared_layers": n, "kv_shared_wide_mlp": bool(n and hf.get("use_double_wide_mlp"))}


def full_rope(params: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, our rope_scaling) of the full layers' `rope_parameters`: `proportional`
    (a share of the frequencies turning, `partial_rotary_factor`), or what `rope_section`
    reads."""
    if params.get("rope_type") != "proportional":
        return rope_section({"rope_parameters": params}, where)
    fraction = float(params.get("partial_rotary_factor", 1.0))
    refuse_unless(
        0 < fraction <= 1,
        where,
        f"rope_parameters.full_attention.partial_rotary_factor {fraction}: must be in (0, 1]",
    )
    factor = float(params.get("factor", 1.0))
    scaling = {"type": "proportional", "fraction": fraction, "factor": factor}
    return float(params.get("rope_theta", 1e6)), scaling


def full_rope_to_hf(llm: Any) -> dict:
    """The full layers' `rope_parameters` of our rotary (`full_rope`'s inverse)."""
    s = llm.rope_scaling
    if s.type != "proportional":
        return rope_to_hf(llm)
    out = {"rope_type": "proportional", "rope_theta": llm.rope_theta}
    out["partial_rotary_factor"] = s.fraction
    if s.factor != 1.0:
        out["factor"] = s.factor
    return out


def full_shape(hf: dict, where: str, shape: dict) -> tuple[int, int]:
    """(head width, key-value heads; 0: the decoder's) of the full-attention layers, from
    `per_layer_config` (every full layer's alike, no sliding layer's) or the hub's
    `global_head_dim` (512 where neither is given, as transformers) and, with
    `attention_k_eq_v`, `num_global_key_value_heads`."""
    depth = shape["depth"]
    types = layer_types(hf, where, depth, LAYER_TYPES, 6)
    per_layer = hf.get("per_layer_config")
    if per_layer is None:
        head_dim = int(hf.get("global_head_dim") or GLOBAL_HEAD_DIM)
        kv = hf.get("num_global_key_value_heads") if hf.get("attention_k_eq_v") else None
        return head_dim, int(kv or 0)
    own = {int(i): dict(v) for i, v in per_layer.items()}
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    alike = [own.get(i) for i in full]
    refuse_unless(
        set(own) <= set(full) and all(x == alike[0] for x in alike),
        where,
        f"per_layer_config {per_layer!r:.200}: jaxmllm reads one override of every "
        "full_attention layer alike, and none of a sliding one",
    )
    first = alike[0] if alike else {}
    extra = set(first) - {"head_dim", "num_key_value_heads"}
    refuse_unless(
        not extra,
        where,
        f"per_layer_config sets {sorted(extra)}: only head_dim and num_key_value_heads are read",
    )
    head_dim = int(first.get("head_dim") or shape["head_dim"] or shape["width"] // shape["heads"])
    return head_dim, int(first.get("num_key_value_heads") or 0)


def moe_section(hf: dict, where: str, mlp_dim: int) -> dict:
    """Our `model.llm.moe` of Gemma 4's MoE block (module docstring): in every layer, the
    dense MLP as an ungated shared expert beside the routed ones, Gemma's router and norms."""
    experts = int(read(hf, "num_experts", where))
    top_k = int(read(hf, "top_k_experts", where))
    refuse_unless(
        0 < top_k <= experts,
        where,
        f"top_k_experts={top_k} must be from 1 to num_experts={experts}",
    )
    return {
        "experts": experts,
        "top_k": top_k,
        "mlp_dim": int(read(hf, "moe_intermediate_size", where)),
        "norm_topk_prob": True,
        "shared_mlp_dim": mlp_dim,
        "shared_gate": False,
        "router_norm": True,
        "expert_scale": True,
        "branch_norms": True,
    }


def moe_to_hf(llm: Any) -> dict:
    """Gemma 4's config.json keys of our `model.llm.moe` (`moe_section`'s inverse)."""
    m = llm.moe
    if not m.enabled:
        return {"enable_moe_block": False}
    return {
        "enable_moe_block": True,
        "num_experts": m.experts,
        "top_k_experts": m.top_k,
        "moe_intermediate_size": m.mlp_dim,
    }


def moe_wants(llm: Any) -> dict[str, Any]:
    """Our MoE options Gemma 4 has a counterpart for: none, or its block in every layer
    (`moe_section`'s)."""
    if not llm.moe.enabled:
        return {}
    return {
        "model.llm.moe.every": (1,),
        "model.llm.moe.dense_layers": ((),),
        "model.llm.moe.norm_topk_prob": (True,),
        "model.llm.moe.shared_mlp_dim": (llm.mlp_dim,),
        "model.llm.moe.shared_gate": (False,),
        "model.llm.moe.router_norm": (True,),
        "model.llm.moe.expert_scale": (True,),
        "model.llm.moe.branch_norms": (True,),
    }
