"""Decoder families: Llama (3.x, with its rope scaling), Qwen2 / Qwen2.5 (q/k/v biases) and
Qwen3 (QK-norm, a head_dim of its own), and their mixtures of experts; the LLM of a whole
checkpoint is one of them on its `text_config` (`jaxmllm.hf.wholes`: Qwen2-VL's is Qwen2 with
M-RoPE). What each family is lives in its row of the family table (`jaxmllm.hf.table.DECODERS`):
`Decoders` reads any row, and has no branch of its own on a family.

All are jaxmllm's own decoder (RMSNorm, rotate-half RoPE, GQA, SiLU-gated MLP) with options:
`norm_eps`, `head_dim`, `attn_bias` (Qwen2: qkv; Llama and Qwen3: qkvo with attention_bias),
`mlp_bias`, `qk_norm` (Qwen3), `rope_scaling`, `mrope_section` (Qwen2-VL; interleaved:
Qwen3-VL's `mrope_interleaved`), and tied embeddings without jaxmllm's 1/sqrt(width) logit
scale.

A mixture of experts' routed experts are read in the layout the checkpoint holds (`EXPERTS`,
`Decoders.for_checkpoint`): transformers 5 reads Qwen2-MoE's, Qwen3-MoE's and Qwen3.5-MoE's
either one Linear each (what its save_pretrained writes) or fused (what it holds in memory, and
what Qwen's own Qwen3.5-MoE files hold); Qwen3-VL-MoE's only fused.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxmllm.config.decoder import LayerKind
from jaxmllm.hf.config_json import MAX_EXPERTS
from jaxmllm.hf.family import (
    Family,
    FamilyError,
    Link,
    dense,
    mismatches,
    read,
    refuse_unless,
    reshaped,
    same,
)
from jaxmllm.hf.table import DecoderRow, Windows
from jaxmllm.models.llm import kind_stacks

# Gemma's options (`jaxmllm.hf.gemma`), which a decoder of another row must not have
NOT_GEMMA = {
    "model.llm.post_norms": (False,),
    "model.llm.embed_scale": (False,),
    "model.llm.attn_scalar": (0.0,),
    "model.llm.window.enabled": ((lambda e: not e), "no sliding windows"),
    # (Gemma 4's, `jaxmllm.hf.gemma4`)
    "model.llm.v_norm": (False,),
    "model.llm.layer_scalar": (False,),
    "model.llm.logit_softcap": (0.0,),
    "model.llm.full_head_dim": (0,),
    "model.llm.full_kv_heads": (0,),
    "model.llm.full_k_eq_v": (False,),
    "model.llm.moe.router_norm": (False,),
    "model.llm.moe.expert_scale": (False,),
    "model.llm.moe.branch_norms": (False,),
    "model.llm.per_layer_dim": (0,),
    "model.llm.kv_shared_layers": (0,),
    "model.llm.kv_shared_wide_mlp": (False,),
}
ROPE_TYPES = {"default": "none", "mrope": "none", "linear": "linear", "llama3": "llama3"}
# How a checkpoint may lay out a mixture of experts' routed experts (`moe_links`): one Linear
# each (experts.{j}.gate_proj, up_proj, down_proj), fused (experts.gate_up_proj [E, 2f, width],
# experts.down_proj [E, width, f]), or fused and maybe each transposed (the hub's Qwen3-VL-MoE)
EXPERTS = ("linear", "fused", "fused_hub")
# A layer's experts in each layout that transformers' qwen2_moe conversion reads either way
LAYOUT_OF = {
    "fused": re.compile(r"(?:^|\.)layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj)$"),
    "linear": re.compile(r"(?:^|\.)layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight$"),
}


def shape_section(hf: dict, where: str, tied: bool = False) -> dict:
    """The `model.llm` keys every decoder family reads alike from its config.json: vocabulary,
    width, depth, heads and key-value heads, the head width (0: width / heads), the norms'
    epsilon, and a tied head (`tied`: where config.json does not say)."""
    width = int(read(hf, "hidden_size", where))
    heads = int(read(hf, "num_attention_heads", where))
    head_dim = int(hf.get("head_dim") or width // heads)
    return {
        "vocab_size": int(read(hf, "vocab_size", where)),
        "width": width,
        "depth": int(read(hf, "num_hidden_layers", where)),
        "heads": heads,
        "kv_heads": int(hf.get("num_key_value_heads") or heads),
        "head_dim": 0 if head_dim * heads == width else head_dim,
        "norm_eps": float(read(hf, "rms_norm_eps", where)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", tied)),
        "tied_logits_scaled": False,
    }


def layer_types(hf: dict, where: str, depth: int, kinds: tuple[str, str], every: int) -> list:
    """config.json's `layer_types` (`kinds`: the family's other kind, then "full_attention"),
    or where it has none, a full-attention layer every `every`th (the older files' pattern).

    Raises:
      FamilyError: for a list of another length than num_hidden_layers, or another kind.
    """
    types = hf.get("layer_types")
    if types is None:
        types = [kinds[(i + 1) % every == 0] for i in range(depth)]
    refuse_unless(
        isinstance(types, list) and len(types) == depth,
        where,
        f"layer_types must list num_hidden_layers={depth} layer kinds",
    )
    unknown = sorted({t for t in types if t not in kinds}, key=str)
    refuse_unless(not unknown, where, f"layer_types {unknown} (jaxmllm reads {', '.join(kinds)})")
    return types


def rope_section(hf: dict, where: str, partial: bool = False) -> tuple[float, dict]:
    """(rope_theta, our rope_scaling) from either config style: transformers 5's
    `rope_parameters`, or the hub's older `rope_theta` + `rope_scaling`; `partial`: the family
    reads a partial_rotary_factor itself (else one other than 1 is refused)."""
    params = hf.get("rope_parameters") or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        params = next(iter(params.values()))  # per layer type: the same for every layer here
    scaling = params or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    refuse_unless(
        kind in ROPE_TYPES,
        where,
        f"rope type {kind!r} is not supported (jaxmllm has {', '.join(ROPE_TYPES)})",
    )
    fraction = float(scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    refuse_unless(
        partial or fraction == 1.0,
        where,
        "partial_rotary_factor != 1 (rotary on part of each head) is not supported",
    )
    ours = {"type": ROPE_TYPES[kind]}
    if kind in ("linear", "llama3"):
        ours["factor"] = float(scaling["factor"])
    if kind == "llama3":
        ours["low_freq_factor"] = float(scaling["low_freq_factor"])
        ours["high_freq_factor"] = float(scaling["high_freq_factor"])
        ours["original_max_positions"] = int(scaling["original_max_position_embeddings"])
    return theta, ours


def rope_to_hf(llm: Any) -> dict:
    """transformers 5's `rope_parameters` of our decoder config."""
    s = llm.rope_scaling
    out = {"rope_theta": llm.rope_theta, "rope_type": {"none": "default"}.get(s.type, s.type)}
    if s.type in ("linear", "llama3"):
        out["factor"] = s.factor
    if s.type == "llama3":
        out.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_positions,
        )
    return out


class Decoders(Family):
    """A causal LM of one decoder row (`jaxmllm.hf.table.DecoderRow`): Llama, Qwen2, Qwen3 and
    the Qwen2-MoE, Qwen3-MoE mixtures of experts."""

    def __init__(self, row: DecoderRow, experts: str = "linear"):
        """`row`: the family's row of the table; `experts`: how the checkpoint lays out the
        routed experts (`EXPERTS`): one Linear each (transformers' save_pretrained) until
        `for_checkpoint` reads them fused; Qwen3-VL-MoE's `fused_hub` only."""
        super().__init__(row)
        self.experts = experts

    def for_checkpoint(self, names: Sequence[str], where: str = "") -> Decoders:
        """Self reading the experts as `names` hold them, one Linear each or fused (a family
        that reads one layout only, Qwen3-VL-MoE's, is itself).

        Raises:
          FamilyError: the checkpoint holds experts in both layouts, naming one of each.
        """
        if self.experts != "linear":
            return self
        found = {k: next((n for n in names if p.search(n)), None) for k, p in LAYOUT_OF.items()}
        refuse_unless(
            not all(found.values()),
            where or f"{self.name} checkpoint",
            f"its experts are both fused ({found['fused']}) and one Linear each "
            f"({found['linear']}): transformers reads every layer's in one layout (a "
            "checkpoint half converted? write every layer's experts alike)",
        )
        if not found["fused"]:
            return self
        fused = copy.copy(self)
        fused.experts = "fused"
        return fused

    def section(self, hf: dict) -> dict:
        """Our `model.llm` keys from the decoder's config.json, its row saying which biases,
        norms and experts it has.

        Raises:
          FamilyError: naming a key whose value jaxmllm's decoder cannot run.
        """
        where = f"{self.name} config.json"
        act = read(hf, "hidden_act", where, "silu")
        refuse_unless(act == "silu", where, f"hidden_act {act!r}: the decoder's MLP is SiLU-gated")
        refuse_unless(
            int(hf.get("pretraining_tp", 1)) == 1, where, "pretraining_tp != 1 is not supported"
        )
        if self.row.windows is Windows.REFUSED:
            kinds = set(hf.get("layer_types") or ["full_attention"])
            refuse_unless(
                not hf.get("use_sliding_window") and kinds == {"full_attention"},
                where,
                "sliding-window attention (use_sliding_window / layer_types) is not supported",
            )
        theta, scaling = rope_section(hf, where)
        bias = self.row.biases.read(hf)
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        mrope = [int(x) for x in rope.get("mrope_section", [0, 0, 0])]
        interleaved = bool(rope.get("mrope_interleaved", False)) and any(mrope)
        out = {
            **shape_section(hf, where),
            "mlp_dim": int(read(hf, "intermediate_size", where)),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "norm": "rms",
            "mlp": "gated_silu",
            "attn_bias": bias,
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "qk_norm": self.row.qk_norm,
            "mrope_section": mrope,
            "mrope_interleaved": interleaved,
        }
        if self.row.moe:
            out["moe"] = self.moe_section(hf, where, out["depth"])
        return out

    def moe_section(self, hf: dict, where: str, depth: int) -> dict:
        """Our `model.llm.moe` keys from a mixture of experts' config.json."""
        experts = hf.get("num_experts", hf.get("num_local_experts")) or 0
        refuse_unless(
            isinstance(experts, int) and 0 <= experts <= MAX_EXPERTS,
            where,
            f"num_experts {experts!r:.40} must be a whole number from 0 to {MAX_EXPERTS}",
        )
        if not experts:  # (no experts: every layer's MLP is dense)
            return {"experts": 0}
        dense = [int(i) for i in hf.get("mlp_only_layers") or []]
        refuse_unless(
            all(0 <= i < depth for i in dense),
            where,
            f"mlp_only_layers {dense} names a layer past num_hidden_layers={depth}",
        )
        every = int(hf.get("decoder_sparse_step") or 1)
        if not any((i + 1) % every == 0 and i not in dense for i in range(depth)):
            return {"experts": 0}  # (transformers builds every layer's MLP dense then)
        shared = int(hf.get("shared_expert_intermediate_size") or 0)
        out = {
            "experts": experts,
            "top_k": int(read(hf, "num_experts_per_tok", where)),
            "mlp_dim": int(read(hf, "moe_intermediate_size", where)),
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "every": every,
            "dense_layers": dense,
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0)),
            "shared_mlp_dim": shared if self.row.shared_expert else 0,
            "shared_gate": True,
        }
        refuse_unless(
            out["top_k"] <= experts,
            where,
            f"num_experts_per_tok={out['top_k']} is more than num_experts={experts}",
        )
        return out

    def to_hf_config(self, cfg: Any, source: dict | None) -> dict:
        """The decoder's config.json of our `model.llm` (`source`'s other keys kept).

        Raises:
          FamilyError: our attention biases or QK-norm differ from the row's (the tensors'
            names depend on them).
        """
        llm = cfg.model.llm
        wants = self.wants(cfg)
        layout = {k: wants[k] for k in ("model.llm.attn_bias", "model.llm.qk_norm")}
        bad = mismatches(cfg, layout, self.name)  # (what the tensors' names depend on)
        if bad:
            raise FamilyError(f"{'; '.join(bad)}: not a {self.name} decoder")
        out = {k: v for k, v in (source or {}).items() if k not in ("rope_theta", "rope_scaling")}
        out.update(
            architectures=[self.hf_class],
            model_type=self.row.name,
            vocab_size=llm.vocab_size,
            hidden_size=llm.width,
            num_hidden_layers=llm.depth,
            num_attention_heads=llm.heads,
            num_key_value_heads=llm.kv_heads,
            intermediate_size=llm.mlp_dim,
            head_dim=llm.head_width,
            hidden_act="silu",
            rms_norm_eps=llm.norm_eps,
            rope_parameters=rope_to_hf(llm),
            tie_word_embeddings=llm.tie_embeddings,
        )
        out.update(self.row.biases.to_hf(llm.attn_bias))
        if self.row.mlp_bias:
            out.update(mlp_bias=llm.mlp_bias)
        if self.row.moe:
            out.update(moe_to_hf(llm, self.row.shared_expert))
        if any(llm.mrope_section):
            out["rope_parameters"]["mrope_section"] = list(llm.mrope_section)
            if llm.mrope_interleaved:
                out["rope_parameters"]["mrope_interleaved"] = True
        return out

    def wants(self, cfg: Any) -> dict[str, Any]:
        """Our options this architecture has a counterpart for (a decoder from scratch)."""
        llm, row = cfg.model.llm, self.row
        return {
            "model.llm.norm": ("rms",),
            "model.llm.mlp": ("gated_silu",),
            "model.llm.attn_bias": row.biases.allowed(),
            "model.llm.mlp_bias": (False, True) if row.mlp_bias else (False,),
            "model.llm.qk_norm": (row.qk_norm,),
            "model.llm.moe.experts": (
                (lambda e: bool(e) == row.moe),
                "routed experts" if row.moe else "no experts (a dense MLP)",
            ),
            "model.llm.moe.shared_mlp_dim": (
                (lambda s: bool(s) == row.shared_expert),
                "a shared expert" if row.shared_expert else "no shared expert",
            ),
            "model.llm.moe.shared_gate": (True,),
            "model.llm.tied_logits_scaled": (
                lambda scaled: not (scaled and llm.tie_embeddings),
                "tied logits x . E^T, unscaled",
            ),
            "model.llm.mrope_section": ((lambda m: not any(m)), "1D rotary positions"),
            # (Qwen3.5's, `jaxmllm.hf.hybrid`: a whole of another decoder must not take them)
            "model.llm.linear.enabled": ((lambda e: not e), "no linear-attention layers"),
            "model.llm.attn_gate": (False,),
            "model.llm.rotary_fraction": (1.0,),
            **NOT_GEMMA,
        }

    def links(self, cfg: Any, hf: dict | None = None) -> list[Link]:
        """The embedding, each stack of layers (`layer_links`), the final norm and the head."""
        llm = cfg.model.llm
        links = [same("model.embed_tokens.weight", "llm/embed/embedding")]
        for stack, kind, ids in kind_stacks(llm):  # (a mixture of experts: MoE and dense apart)
            links += [stacked(x, ids) for x in self.layer_links(llm, stack, kind, len(ids))]
        links.append(same("model.norm.weight", "llm/transformer/final_norm/scale"))
        if not llm.tie_embeddings:
            # (-1: the checkpoint's vocabulary; the loader grows it to ours if tokens were added)
            links.append(dense("lm_head.weight", "llm/lm_head/kernel", (llm.width, -1)))
        return links

    def layer_links(self, llm: Any, stack: str, kind: LayerKind, n: int) -> list[Link]:
        """The links of one stack of our layers (`stack`, of `kind`: dense or moe), `n` layers,
        `{i}` the checkpoint's layer."""
        w, h, k, e, f = llm.width, llm.heads, llm.kv_heads, llm.head_width, llm.mlp_dim
        p, ours = "model.layers.{i}.", f"llm/transformer/{stack}/"
        links = [
            same(p + "input_layernorm.weight", ours + "attn_norm/scale", n),
            dense(p + "self_attn.q_proj.weight", ours + "attn/query/kernel", (w, h, e), 1, n),
            dense(p + "self_attn.k_proj.weight", ours + "attn/key/kernel", (w, k, e), 1, n),
            dense(p + "self_attn.v_proj.weight", ours + "attn/value/kernel", (w, k, e), 1, n),
            dense(p + "self_attn.o_proj.weight", ours + "attn/out/kernel", (h, e, w), 2, n),
            same(p + "post_attention_layernorm.weight", ours + "mlp_norm/scale", n),
        ]
        if kind.moe:
            links += moe_links(llm.moe, w, p + "mlp.", ours + "mlp/", n, self.experts)
        else:
            links += gated_mlp_links(w, f, p + "mlp.", ours + "mlp/", n)
        heads = {
            "q": ("query", llm.heads),
            "k": ("key", llm.kv_heads),
            "v": ("value", llm.kv_heads),
        }
        for letter, (name, count) in heads.items():
            if letter in llm.attn_bias:
                hf_name = p + f"self_attn.{letter}_proj.bias"
                links.append(reshaped(hf_name, ours + f"attn/{name}/bias", (count, e), n))
        if llm.qk_norm:
            links.append(same(p + "self_attn.q_norm.weight", ours + "attn/q_norm/scale", n))
            links.append(same(p + "self_attn.k_norm.weight", ours + "attn/k_norm/scale", n))
        if "o" in llm.attn_bias:
            links.append(same(p + "self_attn.o_proj.bias", ours + "attn/out/bias", n))
        if llm.mlp_bias and kind == "dense":
            for proj, name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                links.append(same(p + f"mlp.{proj}.bias", ours + f"mlp/{name}/bias", n))
        return links

    def skipped(self, name: str) -> bool:
        """The rotary caches some older exports stored (recomputed from the config)."""
        return name.endswith("rotary_emb.inv_freq")


def stacked(link: Link, ids: tuple[int, ...]) -> Link:
    """`link` over the checkpoint's layers `ids` (a stack of some of them)."""
    every = ids == tuple(range(len(ids)))
    return dataclasses.replace(link, layer_ids=() if every else ids)


def gated_mlp_links(w: int, f: int, hf: str, ours: str, n: int) -> list[Link]:
    """A SiLU-gated MLP's three Linear weights (`gate_proj`, `up_proj`, `down_proj`)."""
    return [
        dense(hf + "gate_proj.weight", ours + "gate/kernel", (w, f), 1, n),
        dense(hf + "up_proj.weight", ours + "up/kernel", (w, f), 1, n),
        dense(hf + "down_proj.weight", ours + "down/kernel", (f, w), 1, n),
    ]


def moe_links(moe: Any, w: int, hf: str, ours: str, n: int, experts: str = "linear") -> list:
    """An MoE layer's router (`gate`), its experts laid out as `experts` says (`EXPERTS`: one
    Linear each, `experts.{j}.*_proj`, or `stacked_experts_links`), stacked [E, ...] on our
    side, and the shared expert with its gate."""
    links = [dense(hf + "gate.weight", ours + "router/kernel", (w, moe.experts), 1, n)]
    if experts == "linear":
        for proj in ("gate", "up", "down"):
            links.append(experts_link(hf, f"{proj}_proj", ours + f"experts/{proj}", moe.experts, n))
    else:
        hub = experts == "fused_hub"
        links += stacked_experts_links(hf + "experts.", ours + "experts/", moe, w, n, hub)
    if moe.shared_mlp_dim:
        links += gated_mlp_links(w, moe.shared_mlp_dim, hf + "shared_expert.", ours + "shared/", n)
        if moe.shared_gate:
            links.append(
                dense(hf + "shared_expert_gate.weight", ours + "shared_gate/kernel", (w, 1), 1, n)
            )
    return links


def experts_link(hf: str, proj: str, ours: str, experts: int, n: int) -> Link:
    """E per-expert torch Linear weights [out, in] <-> our stacked [E, in, out]."""
    names = tuple(f"{hf}experts.{j}.{proj}.weight" for j in range(experts))
    return Link(
        names,
        (ours,),
        lambda *ws: (np.stack([np.asarray(x).T for x in ws]),),
        lambda x: tuple(np.asarray(x)[j].T for j in range(experts)),
        n,
    )


def stacked_experts_links(
    hf: str, ours: str, moe: Any, w: int, n: int, hub: bool = False
) -> list[Link]:
    """The experts stacked as transformers 5 holds them: `gate_up_proj` [E, 2f, w] (each
    expert's gate rows, then its up rows) and `down_proj` [E, w, f], which it also saves so for
    Qwen3-VL-MoE (and Qwen's Qwen3.5-MoE files hold so). `hub`: also the hub's Qwen3-VL-MoE
    files' layout, each transposed ([E, w, 2f], [E, f, w]), told apart by their shape as
    transformers' loader tells them (a square one read as it saves them); else that shape is
    refused. Ours: gate and up [E, w, f], down [E, f, w]; an export writes transformers'
    layout."""
    e, f = moe.experts, moe.mlp_dim

    def hubs(shape):
        """The hub's layout of a tensor transformers saves as `shape`."""
        return ((shape[0], shape[2], shape[1]),)

    def gate_up(x):
        """Ours (gate, up) of `gate_up_proj` in either layout."""
        x = np.asarray(x)
        x = x if x.shape == (e, 2 * f, w) else x.transpose(0, 2, 1)  # (the hub's [E, w, 2f])
        return x[:, :f].transpose(0, 2, 1), x[:, f:].transpose(0, 2, 1)

    def down(x):
        """Ours of `down_proj` in either layout."""
        x = np.asarray(x)
        return (x.transpose(0, 2, 1) if x.shape == (e, w, f) else x,)  # (else the hub's)

    return [
        Link(
            (hf + "gate_up_proj",),
            (ours + "gate", ours + "up"),
            gate_up,
            lambda g, u: (np.concatenate([g, u], axis=-1).transpose(0, 2, 1),),
            n,
            stored_as=hubs if hub else None,
        ),
        Link(
            (hf + "down_proj",),
            (ours + "down",),
            down,
            lambda x: (x.transpose(0, 2, 1),),
            n,
            stored_as=hubs if hub else None,
        ),
    ]


def moe_to_hf(llm: Any, shared_expert: bool) -> dict:
    """A mixture of experts' config.json keys of our `model.llm.moe` (`shared_expert`: the
    family has one, its width written)."""
    m = llm.moe
    out = {
        "num_experts": m.experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.mlp_dim,
        "norm_topk_prob": m.norm_topk_prob,
        "decoder_sparse_step": m.every,
        "mlp_only_layers": list(m.dense_layers),
        "router_aux_loss_coef": m.aux_loss_coef,
        "output_router_logits": False,
    }
    if shared_expert:
        out["shared_expert_intermediate_size"] = m.shared_mlp_dim
    return out
