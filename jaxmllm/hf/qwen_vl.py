"""The Qwen VL whole checkpoints: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense and MoE).

- Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`,
  `Qwen2_5_VLForConditionalGeneration`): the Qwen2 LLM with M-RoPE in sections and the
  `visual.` tower whose patch merger is the projector (`jaxmllm.hf.qwen_vision`).
- Qwen3-VL (`Qwen3VLForConditionalGeneration`): the Qwen3 LLM (QK-norm) with M-RoPE
  interleaved (its rotary always interleaves time, row and column: `mrope_interleaved`, its
  sections [24, 20, 20] where config.json names none), and Qwen3-VL's tower (a learned table
  of positions besides the 2D rotary, DeepStack into the LLM's first layers). Its checkpoint
  names tensors as transformers 5 names the modules: the decoder under
  `model.language_model.` (the Qwen3 family's `model.` renamed), its head `lm_head`, the tower
  under `model.visual.`. Its videos are frames with their time written between them as text
  (`data.video_timestamps`), each frame an item of M-RoPE as transformers' `get_rope_index`
  splits `video_grid_thw`.
- Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`): the same with the Qwen3-MoE decoder
  (`model.llm.moe`: dense layers among the MoE ones by `mlp_only_layers` and
  `decoder_sparse_step`), its router always renormalising the top-k probabilities, its
  experts stacked as transformers 5 holds them (`decoders.stacked_experts_links`).
- Qwen3.5 and Qwen3.5-MoE (`Qwen3_5ForConditionalGeneration`,
  `Qwen3_5MoeForConditionalGeneration`): natively multimodal hybrids, Qwen3-VL's whole with
  the Qwen3.5 decoders (`jaxmllm.hf.hybrid`: Gated DeltaNet layers among full-attention ones,
  the MoE's experts one Linear each or fused, as the checkpoint holds them) and Qwen3-VL's
  tower without DeepStack. Its interleaved M-RoPE turns the rotary part of each head
  (`partial_rotary_factor`): `mrope_section` sums to its half (Qwen3.5's [11, 11, 10] where
  config.json names none).
"""

from __future__ import annotations

from typing import Any

from jaxmllm.hf import oracle
from jaxmllm.hf.family import Family, mismatches
from jaxmllm.hf.qwen_vision import Qwen3VLVision
from jaxmllm.hf.table import WholeRow
from jaxmllm.hf.whole import Whole
from jaxmllm.hf.whole_config import (
    decoder_family,
    enabled,
    nested,
    pixels,
    tokenizer_ids,
    tower_of,
)


class QwenVL(Whole):
    """Qwen2-VL and Qwen2.5-VL: a Qwen2 LLM with M-RoPE (at the top level of older files); its
    row of the table (`jaxmllm.hf.table.WholeRow`) names its decoder and tower."""

    parts = {"llm": ("text_config", ""), "vision": ("vision_config", "visual.")}
    token_keys = {"vision": ("image_token_id",)}
    runtime_prefix = {"vision": "model.visual."}
    interleaved = False  # M-RoPE's frequencies interleaved (Qwen3-VL), else in sections

    def __init__(self, row: WholeRow):
        """The whole of `row`: its decoder and tower families."""
        super().__init__(row)
        self.decoder = decoder_family(row.llm[0], row.experts)
        self.tower = self.own_tower()

    def own_tower(self) -> Family:
        """The tower family of the row's tower."""
        return tower_of(self.row.towers[0])

    def sub(self, role: str, hf: dict) -> dict:
        """A part's config; the LLM's is the top level of the hub's older, flat files."""
        if role == "llm" and not hf.get("text_config"):  # the hub's older, flat files
            return {k: v for k, v in hf.items() if k != "vision_config"}
        return super().sub(role, hf)

    def inner(self, role: str, hf: dict) -> Family:
        """The decoder for the LLM, else the tower."""
        return self.decoder if role == "llm" else self.tower

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        """The whole's config.json: from scratch, or `source`'s with `roles`' parts ours
        (its text keys nested or flat, as `source` has them)."""
        llm = cfg.model.llm
        if source is None:
            tk = tokenizer_ids(cfg)
            ids = {"image_token_id": tk.specials.media["vision"]}
            for key, token in (
                ("video_token_id", "<|video_pad|>"),
                ("vision_start_token_id", "<|vision_start|>"),
                ("vision_end_token_id", "<|vision_end|>"),
            ):
                found = getattr(tk, "token_id", lambda _: None)(token)
                if found is not None:
                    ids[key] = found
            text = self.decoder.to_hf_config(cfg, None)
            return {
                "architectures": [self.hf_class],
                "model_type": self.name,
                "text_config": nested(text, f"{self.name}_text"),
                "vision_config": nested(self.tower.to_hf_config(cfg, None)),
                "tie_word_embeddings": llm.tie_embeddings,
                **ids,
            }
        out = dict(source)
        if "llm" in roles:
            text = self.decoder.to_hf_config(cfg, self.sub("llm", source))
            if source.get("text_config"):
                kind = source["text_config"].get("model_type", f"{self.name}_text")
                out["text_config"] = nested(text, kind)
            else:  # flat: the text keys at the top level, as the source has them
                out.update(nested(text, self.name))
                out["architectures"] = [self.hf_class]
            out["tie_word_embeddings"] = llm.tie_embeddings
        if "vision" in roles:
            out["vision_config"] = nested(self.tower.to_hf_config(cfg, source))
        return out

    def reference_inputs(self, sample: Any, cfg: Any, specials: Any) -> dict:
        """transformers' inputs of a sample (`oracle.qwen_vl`)."""
        return oracle.qwen_vl(sample, cfg, specials)

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        """The image processor's and the processor's files of the run's settings."""
        v, d = cfg.model.vision, cfg.data
        image = {
            **pixels(cfg, "Qwen2VLImageProcessor"),
            "min_pixels": d.image_min_pixels,
            "max_pixels": d.image_max_pixels,
            "patch_size": v.patch_size,
            "merge_size": v.merge,
            "temporal_patch_size": v.temporal_patch,
        }
        return {
            "preprocessor_config.json": image,
            "processor_config.json": {"processor_class": self.processor_class},
        }

    def mismatches(self, cfg: Any) -> list[str]:
        """Our options the whole has no counterpart for: its decoder's, its tower's, M-RoPE."""
        wants = {
            **self.decoder.wants(cfg),
            **self.tower.wants(cfg),
            "model.llm.mrope_section": (any, "M-RoPE (time, row, column sections)"),
            "model.llm.mrope_interleaved": (self.interleaved,),
        }
        return (
            enabled(cfg, "vision", True)
            + enabled(cfg, "audio", False)
            + mismatches(cfg, wants, self.name)
        )


class Qwen3VL(QwenVL):
    """Qwen3-VL and Qwen3.5: the module docstring. Its row's decoder is Qwen3's, Qwen3-MoE's
    or a Qwen3.5 hybrid (whose tower has no DeepStack: the row's `deepstack`)."""

    parts = {
        "llm": ("text_config", "model.language_model."),
        "vision": ("vision_config", "model.visual."),
    }
    runtime_names = True
    interleaved = True
    video_timestamps = True

    def own_tower(self) -> Family:
        """Qwen3-VL's tower written into this whole, with DeepStack as the row says."""
        return Qwen3VLVision(self.name, deepstack=self.row.deepstack)

    def section(self, role: str, hf: dict) -> dict:
        """The part's section; the LLM's M-RoPE always interleaved, its sections the row's
        where config.json names none, its router renormalising top-k."""
        out = super().section(role, hf)
        if role == "llm":  # (transformers' rotary interleaves whatever config.json says)
            rope = self.sub(role, hf).get("rope_parameters") or {}
            sections = out.get("mrope_section") or rope.get("mrope_section") or ()
            out["mrope_interleaved"] = True
            out["mrope_section"] = (
                [int(x) for x in sections] if any(sections) else list(self.row.mrope_sections)
            )
            if out.get("moe", {}).get("experts"):  # (its router always renormalises top-k)
                out["moe"]["norm_topk_prob"] = True
        return out

    def place(self, role: str, name: str, at: str) -> str:
        """A part's tensor under the whole's names (the decoder's `model.` is
        `model.language_model.`)."""
        if role == "llm":  # the decoder's `model.` is `model.language_model.`; its head stays
            return at + name.removeprefix("model.") if name.startswith("model.") else name
        return at + name

    def owns(self, role: str, name: str) -> bool:
        """The LM head, at the top of the whole's names."""
        return role == "llm" and name.startswith("lm_head.")
