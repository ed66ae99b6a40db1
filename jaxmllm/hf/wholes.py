"""The whole multimodal checkpoints jaxmllm reads and writes (`jaxmllm.hf.whole` is the contract).

- LLaVA (`LlavaForConditionalGeneration`): a CLIP or SigLIP tower, a two-layer projector
  (`multi_modal_projector.linear_1`, its activation, `linear_2`: jaxmllm's vision projector
  with one patch a token, `merge: 1`) and a Llama or Qwen2 LLM. The LLM reads the tower's
  hidden states after `vision_feature_layer` blocks, before its final norm: the model keeps
  those blocks (`model.vision.depth`, `final_norm: false`) and the others are left alone (and
  written back at export). `vision_feature_select_strategy: default` drops CLIP's class token
  after the blocks (jaxmllm's class tokens are never read by the LLM); a SigLIP tower has none
  (`full`). An image is `image_token_index` once per patch.
- Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (`jaxmllm.hf.qwen_vl`).
- Qwen2-Audio (`Qwen2AudioForConditionalGeneration`): the Qwen2-Audio encoder (Whisper's, its
  rows pooled in pairs), one Linear as projector (`multi_modal_projector.linear`,
  `model.audio.projector: linear`) and a Qwen2 LLM. A clip of L frames is L / 4 audio tokens.

The helpers every whole uses (its decoder family, nested configs, placeholders, pixels) are
`jaxmllm.hf.whole_config`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmllm.hf import oracle
from jaxmllm.hf.audio import Qwen2AudioEncoder
from jaxmllm.hf.family import Family, Link, mismatches, refuse_unless
from jaxmllm.hf.qwen_vision import Qwen2VLVision, Qwen25VLVision
from jaxmllm.hf.qwen_vl import Qwen3VL, QwenVL
from jaxmllm.hf.vision import Clip, Siglip, linear
from jaxmllm.hf.whole import Whole
from jaxmllm.hf.whole_config import (
    DECODERS,
    PROJECTOR_ACTS,
    decoder,
    decoder_of,
    enabled,
    nested,
    pixels,
    placeholder,
    tokenizer_ids,
)

__all__ = ["DECODERS", "WHOLES", "decoder_of", "whole_for"]


class Llava(Whole):
    name = "llava"
    model_types = ("llava",)
    hf_class = "LlavaForConditionalGeneration"
    processor_class = "LlavaProcessor"
    parts = {
        "llm": ("text_config", "language_model."),
        "vision": ("vision_config", "vision_tower."),
    }
    token_keys = {"vision": ("image_token_index", "image_token_id")}
    runtime_prefix = {"vision": "model.vision_tower."}
    towers = {"clip_vision_model": Clip(), "siglip_vision_model": Siglip()}

    def inner(self, role: str, hf: dict) -> Family:
        sub = self.sub(role, hf)
        if role == "llm":
            return decoder(sub, "llava config.json")
        kind = sub.get("model_type", "clip_vision_model")
        tower = self.towers.get(kind)
        refuse_unless(
            tower is not None,
            "llava config.json",
            f"vision_config model_type {kind!r}: jaxmllm reads {', '.join(self.towers)}",
        )
        return tower

    def feature_depth(self, hf: dict) -> int:
        """The tower's blocks before the hidden layer the LLM reads (`vision_feature_layer`)."""
        where, layer = "llava config.json", hf.get("vision_feature_layer", -2)
        refuse_unless(
            isinstance(layer, int),
            where,
            f"vision_feature_layer {layer!r}: several "
            "feature layers are not supported (one integer)",
        )
        depth = int(self.sub("vision", hf).get("num_hidden_layers", 0))
        used = layer if layer >= 0 else depth + 1 + layer
        refuse_unless(
            1 <= used <= depth,
            where,
            f"vision_feature_layer {layer} is not one of the tower's {depth} blocks",
        )
        return used

    def section(self, role: str, hf: dict) -> dict:
        out = super().section(role, hf)
        if role != "vision":
            return out
        where, tower = "llava config.json", self.inner(role, hf)
        strategy = hf.get("vision_feature_select_strategy", "default")
        want = "default" if tower.name == "clip" else "full"
        message = f"vision_feature_select_strategy {strategy!r} with a {tower.name} tower"
        refuse_unless(
            strategy == want, where, f"{message} is not supported (jaxmllm reads {want!r})"
        )
        refuse_unless(
            hf.get("multimodal_projector_bias", True),
            where,
            "multimodal_projector_bias: false is not supported",
        )
        act = hf.get("projector_hidden_act", "gelu")
        refuse_unless(
            act in PROJECTOR_ACTS,
            where,
            f"projector_hidden_act {act!r} is not supported ({', '.join(PROJECTOR_ACTS)})",
        )
        out.update(
            depth=self.feature_depth(hf),
            final_norm=False,
            merge=1,
            projector_dim=0,
            projector_act=PROJECTOR_ACTS[act],
        )
        return out

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        if role != "vision":
            return []
        v, out = cfg.model.vision, cfg.model.llm.width
        hidden = v.projector_dim or out
        p = "multi_modal_projector."
        return [
            *linear(p + "linear_1", "vision_projector/fc1", (v.width, hidden)),
            *linear(p + "linear_2", "vision_projector/fc2", (hidden, out)),
        ]

    def owns(self, role: str, name: str) -> bool:
        return role == "vision" and name.startswith("multi_modal_projector.")

    def unused(self, role: str, name: str, hf: dict) -> bool:
        return role == "vision" and self.inner(role, hf).unused(name, self.feature_depth(hf))

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        v, llm = cfg.model.vision, cfg.model.llm
        tower = Clip() if v.class_token else Siglip()
        act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[v.projector_act]
        if source is None:
            return {
                "architectures": [self.hf_class],
                "model_type": "llava",
                "text_config": nested(decoder_of(cfg).to_hf_config(cfg, None)),
                "vision_config": nested(tower.to_hf_config(cfg, None)),
                "vision_feature_layer": -1,
                "vision_feature_select_strategy": "default" if v.class_token else "full",
                "image_token_index": tokenizer_ids(cfg).specials.media["vision"],
                "image_seq_length": v.position_grid**2,
                "projector_hidden_act": act,
                "multimodal_projector_bias": True,
                "tie_word_embeddings": llm.tie_embeddings,
            }
        out = dict(source)
        if "llm" in roles:
            text = self.sub("llm", source)
            out["text_config"] = nested(
                self.inner("llm", source).to_hf_config(cfg, text), text.get("model_type")
            )
            out["tie_word_embeddings"] = llm.tie_embeddings
        if "vision" in roles:
            out["vision_config"] = nested(tower.to_hf_config(cfg, source))
            out["projector_hidden_act"] = act
        return out

    def mismatches(self, cfg: Any) -> list[str]:
        v, width = cfg.model.vision, cfg.model.llm.width
        tower = Clip() if v.class_token else Siglip()
        wants = {
            **decoder_of(cfg).wants(cfg),
            **tower.wants(cfg),
            "model.vision.final_norm": (False,),
            "model.vision.merge": (1,),
            "model.vision.projector_dim": ((lambda d: d in (0, width)), "the LLM's width"),
            "model.vision.projector_act": ("gelu", "gelu_tanh"),
        }
        return (
            enabled(cfg, "vision", True)
            + enabled(cfg, "audio", False)
            + mismatches(cfg, wants, "LLaVA")
        )

    def reference_inputs(self, sample: Any, cfg: Any, specials: Any) -> dict:
        return oracle.llava(sample, cfg, specials)

    def fillers(self, cfg: Any) -> dict[str, Any]:
        width = cfg.model.vision.width  # (the tower's final norm: LLaVA never applies it)
        return {
            "vision_tower.post_layernorm.weight": np.ones(width, np.float32),
            "vision_tower.post_layernorm.bias": np.zeros(width, np.float32),
        }

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        v = cfg.model.vision
        side = v.position_grid * v.patch_size
        image = {
            **pixels(cfg, "CLIPImageProcessor" if v.class_token else "SiglipImageProcessor"),
            "resample": 3,
            **(
                {
                    "size": {"shortest_edge": side},
                    "do_center_crop": True,
                    "crop_size": {"height": side, "width": side},
                }
                if v.class_token
                else {"size": {"height": side, "width": side}}
            ),
        }
        processor = {
            "processor_class": self.processor_class,
            "patch_size": v.patch_size,
            "vision_feature_select_strategy": "default" if v.class_token else "full",
            "num_additional_image_tokens": int(v.class_token),
            "image_token": placeholder(cfg, "vision"),
        }
        return {"preprocessor_config.json": image, "processor_config.json": processor}


class Qwen2Audio(Whole):
    name = "qwen2_audio"
    model_types = ("qwen2_audio",)
    hf_class = "Qwen2AudioForConditionalGeneration"
    processor_class = "Qwen2AudioProcessor"
    parts = {"llm": ("text_config", "language_model."), "audio": ("audio_config", "audio_tower.")}
    token_keys = {"audio": ("audio_token_index", "audio_token_id")}
    runtime_prefix = {"audio": "model.audio_tower."}
    encoder = Qwen2AudioEncoder()

    def inner(self, role: str, hf: dict) -> Family:
        if role == "llm":
            return decoder(self.sub(role, hf), "qwen2_audio config.json", ("qwen2",))
        return self.encoder

    def section(self, role: str, hf: dict) -> dict:
        out = super().section(role, hf)
        if role == "audio":
            out["projector"] = "linear"
        return out

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        if role != "audio":
            return []
        shape = (cfg.model.audio.width, cfg.model.llm.width)
        return linear("multi_modal_projector.linear", "audio_projector/fc", shape)

    def owns(self, role: str, name: str) -> bool:
        return role == "audio" and name.startswith("multi_modal_projector.")

    def reference_inputs(self, sample: Any, cfg: Any, specials: Any) -> dict:
        return oracle.qwen2_audio(sample, cfg, specials)

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        llm = cfg.model.llm
        if source is None:
            return {
                "architectures": [self.hf_class],
                "model_type": "qwen2_audio",
                "text_config": nested(DECODERS["qwen2"].to_hf_config(cfg, None)),
                "audio_config": nested(self.encoder.to_hf_config(cfg, None)),
                "audio_token_index": tokenizer_ids(cfg).specials.media["audio"],
                "tie_word_embeddings": llm.tie_embeddings,
            }
        out = dict(source)
        if "llm" in roles:
            text = self.sub("llm", source)
            out["text_config"] = nested(DECODERS["qwen2"].to_hf_config(cfg, text), "qwen2")
        if "audio" in roles:
            out["audio_config"] = nested(self.encoder.to_hf_config(cfg, source))
        return out

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        a, rate = cfg.model.audio, cfg.data.audio_sample_rate
        seconds = a.max_positions * a.stride // 100  # (10 ms frames)
        features = {
            "feature_extractor_type": "WhisperFeatureExtractor",
            "feature_size": a.n_mels,
            "sampling_rate": rate,
            "hop_length": rate // 100,
            "chunk_length": seconds,
            "n_fft": 400,
            "n_samples": seconds * rate,
            "nb_max_frames": a.max_positions * a.stride,
            "padding_side": "right",
            "padding_value": 0.0,
            "return_attention_mask": True,
        }
        processor = {
            "processor_class": self.processor_class,
            "audio_token": placeholder(cfg, "audio"),
        }
        return {"preprocessor_config.json": features, "processor_config.json": processor}

    def mismatches(self, cfg: Any) -> list[str]:
        wants = {
            **DECODERS["qwen2"].wants(cfg),
            **self.encoder.wants(cfg),
            "model.audio.projector": ("linear",),
        }
        return (
            enabled(cfg, "audio", True)
            + enabled(cfg, "vision", False)
            + mismatches(cfg, wants, "Qwen2-Audio")
        )


WHOLES: tuple[Whole, ...] = (
    Llava(),
    QwenVL("qwen2_vl", Qwen2VLVision(), "Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    QwenVL(
        "qwen2_5_vl", Qwen25VLVision(), "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"
    ),
    Qwen3VL("qwen3_vl", "Qwen3VLForConditionalGeneration", "qwen3"),
    Qwen3VL("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "qwen3_moe"),
    Qwen3VL("qwen3_5", "Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    Qwen3VL("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
    Qwen2Audio(),
)


def whole_for(hf: dict | None) -> Whole | None:
    """The whole-checkpoint family of a config.json, or None (a checkpoint of one part)."""
    kind = (hf or {}).get("model_type")
    return next((w for w in WHOLES if kind in w.model_types), None)
