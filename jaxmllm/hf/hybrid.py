"""Qwen3.5's hybrid decoders: `Qwen3_5ForCausalLM` and `Qwen3_5MoeForCausalLM` (the rows of
`jaxmllm.hf.table` with `hybrid`; the LLM of the Qwen3.5 multimodal checkpoints too).

Their layers are of two kinds by `layer_types`: `linear_attention` (Gated DeltaNet,
`jaxmllm.models.deltanet`) and `full_attention` (Qwen3's attention with QK-norm, a sigmoid
output gate whose weights sit beside each head's queries in q_proj, and rotary positions on the
first `partial_rotary_factor` of each head). Every RMSNorm scales by 1 + its weight, stored
zero-centred (`norm: rms_offset`, written back as stored). The MLP is SiLU-gated, or in the MoE
variant a mixture of experts in every layer, top-k renormalised, with a shared expert and its
sigmoid gate (`jaxmllm.models.moe`, the tensors named as Qwen2-MoE names them; the routed
experts one Linear each, as transformers saves them, or fused, as Qwen's files hold them:
`Decoders.for_checkpoint`).

A linear layer's fused `in_proj_qkv` rows [queries | keys | values] are regrouped by key head
(a key head's query, key and its values together: `qkv_order`), its conv1d channels the same,
so tensor parallelism splits whole key heads; a PEFT adapter on in_proj_qkv maps onto ours
with its B rows regrouped alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmllm.config.decoder import LayerKind
from jaxmllm.hf.decoders import (
    NOT_GEMMA,
    Decoders,
    gated_mlp_links,
    layer_types,
    moe_links,
    rope_section,
    shape_section,
)
from jaxmllm.hf.family import (
    FamilyError,
    Link,
    dense,
    mismatches,
    read,
    refuse_unless,
    reshaped,
    same,
)
from jaxmllm.models.deltanet import LinearSpec

LAYER_TYPES = ("linear_attention", "full_attention")


def qkv_order(spec: LinearSpec) -> np.ndarray:
    """transformers' in_proj_qkv rows in our order: row j of ours (flattened [key heads,
    group]) is row `order[j]` of theirs ([queries | keys | values], each head after head)."""
    kh, d, dv = spec.key_heads, spec.key_dim, spec.value_dim
    r = spec.value_heads // kh
    out = []
    for h in range(kh):
        out += [h * d + np.arange(d), kh * d + h * d + np.arange(d)]
        out.append(2 * kh * d + h * r * dv + np.arange(r * dv))
    return np.concatenate(out)


def regrouped(hf: str, ours: str, spec: LinearSpec, width: int, n: int) -> Link:
    """in_proj_qkv [channels, width] <-> our qkv kernel [width, key heads, group]."""
    order, shape = qkv_order(spec), (width, spec.key_heads, spec.group)

    def to_hf(k):
        """Our kernel back into in_proj_qkv's rows, in transformers' order."""
        out = np.empty_like(np.asarray(k).reshape(width, -1).T)
        out[order] = np.asarray(k).reshape(width, -1).T
        return (out,)

    return Link((hf,), (ours,), lambda w: (np.asarray(w)[order].T.reshape(shape),), to_hf, n)


def conv_link(hf: str, ours: str, spec: LinearSpec, n: int) -> Link:
    """conv1d.weight [channels, 1, taps] <-> our conv [taps, key heads, group]."""
    order = qkv_order(spec)
    shape = (spec.conv_width, spec.key_heads, spec.group)

    def to_hf(k):
        """Our conv back into conv1d's channels, in transformers' order."""
        flat = np.asarray(k).reshape(spec.conv_width, -1).T
        out = np.empty_like(flat)
        out[order] = flat
        return (out[:, None, :],)

    return Link((hf,), (ours,), lambda w: (np.asarray(w)[order, 0].T.reshape(shape),), to_hf, n)


class Qwen35(Decoders):
    """Qwen3.5 and Qwen3.5-MoE causal LMs (module docstring): a hybrid row of the table, its
    `moe` the MoE variant's; the routed experts one Linear each or fused, as
    `Decoders.for_checkpoint` finds them."""

    def section(self, hf: dict) -> dict:
        """Our `model.llm` keys: Qwen3's attention with its gate and partial rotary, the
        linear layers (`linear_section`), the experts in the MoE variant."""
        where = f"{self.name} config.json"
        act = read(hf, "hidden_act", where, "silu")
        refuse_unless(act == "silu", where, f"hidden_act {act!r}: the decoder's MLP is SiLU-gated")
        shape = shape_section(hf, where)
        depth = shape["depth"]
        head_dim = shape["head_dim"] or shape["width"] // shape["heads"]
        theta, scaling = rope_section(hf, where, partial=True)
        params = hf.get("rope_parameters") or {}
        fraction = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        rotary = int(head_dim * fraction)  # (transformers' width: its frequencies span it)
        refuse_unless(
            rotary > 0 and rotary % 2 == 0,
            where,
            f"partial_rotary_factor {fraction:g} of head_dim {head_dim} gives a rotary width of "
            f"{rotary} channels: transformers rotates {rotary + rotary % 2} of them at "
            f"frequencies spaced for {rotary}, which no even split of a head reproduces; "
            "jaxmllm imports a factor whose width is a whole even number of channels (is "
            "this config.json's head_dim or partial_rotary_factor not the model's?)",
        )
        out = {
            **shape,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "rotary_fraction": fraction,
            "attn_gate": True,
            "norm": "rms_offset",
            "mlp": "gated_silu",
            "attn_bias": self.row.biases.read(hf),
            "qk_norm": True,
            "linear": self.linear_section(hf, where, depth),
        }
        if self.row.moe:
            out["moe"] = self.moe_section(hf, where, depth)
            # (every layer's MLP is MoE: the dense width is not used; set so the config checks)
            out["mlp_dim"] = out["moe"].get("mlp_dim") or 1
        else:
            out["mlp_dim"] = int(read(hf, "intermediate_size", where))
        return out

    def linear_section(self, hf: dict, where: str, depth: int) -> dict:
        """Our `model.llm.linear` keys: the linear layers of `layer_types` and their sizes."""
        # (transformers' default: full attention every 4th layer)
        every = int(hf.get("full_attention_interval") or 4)
        types = layer_types(hf, where, depth, LAYER_TYPES, every)
        return {
            "layers": [i for i, t in enumerate(types) if t == "linear_attention"],
            "key_heads": int(read(hf, "linear_num_key_heads", where)),
            "value_heads": int(read(hf, "linear_num_value_heads", where)),
            "key_dim": int(read(hf, "linear_key_head_dim", where)),
            "value_dim": int(read(hf, "linear_value_head_dim", where)),
            "conv_width": int(read(hf, "linear_conv_kernel_dim", where)),
        }

    def moe_section(self, hf: dict, where: str, depth: int) -> dict:
        """Qwen3.5-MoE's experts: in every layer, top-k always renormalised (transformers'
        router does so whatever norm_topk_prob says), a shared expert with its gate."""
        out = super().moe_section(hf, where, depth)
        refuse_unless(out.get("experts", 0) > 0, where, "num_experts must be at least 1")
        shared = int(read(hf, "shared_expert_intermediate_size", where))
        return {**out, "norm_topk_prob": True, "shared_mlp_dim": shared, "every": 1}

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The decoder's config.json: `Decoders`' with the linear layers and experts."""
        llm = cfg.model.llm
        bad = mismatches(cfg, {"model.llm.attn_gate": (True,)}, self.name)  # (q_proj's width)
        if bad:
            raise FamilyError(f"{'; '.join(bad)}: not a {self.name} decoder")
        keep = ("full_attention_interval", "intermediate_size")
        out = super().to_hf_config(cfg, {k: v for k, v in (source or {}).items() if k not in keep})
        lin = llm.linear
        out["rope_parameters"]["partial_rotary_factor"] = llm.rotary_fraction
        out.update(
            layer_types=[LAYER_TYPES[not lin.is_linear(i)] for i in range(llm.depth)],
            linear_num_key_heads=lin.key_heads,
            linear_num_value_heads=lin.value_heads,
            linear_key_head_dim=lin.key_dim,
            linear_value_head_dim=lin.value_dim,
            linear_conv_kernel_dim=lin.conv_width,
        )
        if self.row.moe:  # (every layer's MLP is the experts': no dense width)
            m = llm.moe
            del out["intermediate_size"]
            out.update(
                num_experts=m.experts,
                num_experts_per_tok=m.top_k,
                moe_intermediate_size=m.mlp_dim,
                shared_expert_intermediate_size=m.shared_mlp_dim,
                router_aux_loss_coef=m.aux_loss_coef,
                output_router_logits=False,
            )
        return out

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options Qwen3.5 has a counterpart for (a decoder from scratch)."""
        llm = cfg.model.llm
        moe = self.row.moe
        return {
            "model.llm.norm": ("rms_offset",),
            "model.llm.mlp": ("gated_silu",),
            "model.llm.attn_bias": self.row.biases.allowed(),
            "model.llm.mlp_bias": (False,),
            "model.llm.qk_norm": (True,),
            "model.llm.attn_gate": (True,),
            "model.llm.moe.experts": (
                (lambda e: bool(e) == moe),
                "routed experts in every layer" if moe else "no experts (a dense MLP)",
            ),
            "model.llm.moe.every": (1,),
            "model.llm.moe.dense_layers": ((),),
            "model.llm.moe.norm_topk_prob": (True,) if moe else (True, False),
            "model.llm.moe.shared_mlp_dim": (
                (lambda s: bool(s) == moe),
                "a shared expert" if moe else "no shared expert",
            ),
            "model.llm.moe.shared_gate": (True,),
            "model.llm.rope_scaling.type": ("none",),
            "model.llm.tied_logits_scaled": (
                lambda scaled: not (scaled and llm.tie_embeddings),
                "tied logits x . E^T, unscaled",
            ),
            "model.llm.mrope_section": ((lambda m: not any(m)), "1D rotary positions"),
            **NOT_GEMMA,
        }

    def layer_links(self, llm: Any, stack: str, kind: LayerKind, n: int) -> list[Link]:
        """One stack's links (`kind`: linear or full attention, moe or a dense MLP)."""
        w = llm.width
        p, ours = "model.layers.{i}.", f"llm/transformer/{stack}/"
        links = [
            same(p + "input_layernorm.weight", ours + "attn_norm/scale", n),
            same(p + "post_attention_layernorm.weight", ours + "mlp_norm/scale", n),
        ]
        if kind.linear:
            links += linear_links(
                LinearSpec.of(llm.linear), w, p + "linear_attn.", ours + "attn/", n
            )
        else:
            links += attention_links(llm, p + "self_attn.", ours + "attn/", n)
        if kind.moe:
            links += moe_links(llm.moe, w, p + "mlp.", ours + "mlp/", n, self.experts)
        else:
            links += gated_mlp_links(w, llm.mlp_dim, p + "mlp.", ours + "mlp/", n)
        return links

    def skipped(self, name: str) -> bool:
        """The multi-token-prediction head some checkpoints carry (transformers leaves it
        too), and `Decoders`' rotary caches."""
        return name.startswith("mtp.") or super().skipped(name)


def attention_links(llm: Any, hf: str, ours: str, n: int) -> list[Link]:
    """A full-attention layer's: q_proj holds each head's queries then its output gate."""
    w, h, k, e = llm.width, llm.heads, llm.kv_heads, llm.head_width
    links = [
        dense(hf + "q_proj.weight", ours + "query/kernel", (w, h, 2 * e), 1, n),
        dense(hf + "k_proj.weight", ours + "key/kernel", (w, k, e), 1, n),
        dense(hf + "v_proj.weight", ours + "value/kernel", (w, k, e), 1, n),
        dense(hf + "o_proj.weight", ours + "out/kernel", (h, e, w), 2, n),
        same(hf + "q_norm.weight", ours + "q_norm/scale", n),
        same(hf + "k_norm.weight", ours + "k_norm/scale", n),
    ]
    if llm.attn_bias:
        links += [
            reshaped(hf + "q_proj.bias", ours + "query/bias", (h, 2 * e), n),
            reshaped(hf + "k_proj.bias", ours + "key/bias", (k, e), n),
            reshaped(hf + "v_proj.bias", ours + "value/bias", (k, e), n),
            same(hf + "o_proj.bias", ours + "out/bias", n),
        ]
    return links


def linear_links(spec: LinearSpec, w: int, hf: str, ours: str, n: int) -> list[Link]:
    """A Gated DeltaNet layer's (`linear_attn.`)."""
    hv, dv = spec.value_heads, spec.value_dim
    return [
        regrouped(hf + "in_proj_qkv.weight", ours + "qkv/kernel", spec, w, n),
        conv_link(hf + "conv1d.weight", ours + "conv", spec, n),
        dense(hf + "in_proj_z.weight", ours + "z/kernel", (w, hv, dv), 1, n),
        dense(hf + "in_proj_b.weight", ours + "b/kernel", (w, hv), 1, n),
        dense(hf + "in_proj_a.weight", ours + "a/kernel", (w, hv), 1, n),
        same(hf + "dt_bias", ours + "dt_bias", n),
        same(hf + "A_log", ours + "a_log", n),
        same(hf + "norm.weight", ours + "norm", n),
        dense(hf + "out_proj.weight", ours + "out/kernel", (hv, dv, w), 2, n),
    ]
