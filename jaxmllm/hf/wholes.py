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
- Gemma 3 (`jaxmllm.hf.gemma_whole`), Gemma 4 (`jaxmllm.hf.gemma4_whole`).
- Qwen2-Audio (`Qwen2AudioForConditionalGeneration`): the Qwen2-Audio encoder (Whisper's, its
  rows pooled in pairs), one Linear as projector (`multi_modal_projector.linear`,
  `model.audio.projector: linear`) and a Qwen2 LLM. A clip of L frames is L / 4 audio tokens.

The helpers every whole uses (its decoder family, nested configs, placeholders, pixels) are
`jaxmllm.hf.whole_config`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxmllm.hf import oracle, table
from jaxmllm.hf.family import Family, Link, mismatches, refuse_unless
from jaxmllm.hf.gemma4_whole import Gemma4Whole
from jaxmllm.hf.gemma_whole import Gemma3Whole
from jaxmllm.hf.qwen_vl import Qwen3VL, QwenVL
from jaxmllm.hf.vision import linear
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
    tower_of,
)

__all__ = ["DECODERS", "WHOLES", "decoder_of", "whole_for"]


class Llava(Whole):
    """LLaVA (the module docstring): its row names the decoders and towers it reads."""

    row = table.LLAVA
    parts = {
        "llm": ("text_config", "language_model."),
        "vision": ("vision_config", "vision_tower."),
    }
    token_keys = {"vision": ("image_token_index", "image_token_id")}
    runtime_prefix = {"vision": "model.vision_tower."}
    fixed_size = True

    def __init__(self):
        """LLaVA's towers, by the model type its vision_config names (the first: default)."""
        super().__init__()
        towers = [tower_of(row) for row in self.row.towers]
        self.towers = {t.model_types[0]: t for t in towers}

    def inner(self, role: str, hf: dict) -> Family:
        """The LLM's decoder or the tower, by the model type its sub-config names.

        Raises:
          FamilyError: a model type LLaVA is not read with, naming the ones it is.
        """
        sub = self.sub(role, hf)
        where = f"{self.name} config.json"
        if role == "llm":
            return decoder(sub, where, self.row.llm)
        kind = sub.get("model_type", next(iter(self.towers)))
        tower = self.towers.get(kind)
        refuse_unless(
            tower is not None,
            where,
            f"vision_config model_type {kind!r}: jaxmllm reads {', '.join(self.towers)}",
        )
        return tower

    def tower_with(self, class_token: bool) -> Family:
        """The tower whose class token is as ours (CLIP's has one, SigLIP's none)."""
        return next(t for t in self.towers.values() if t.options["class_token"] == class_token)

    def feature_depth(self, hf: dict) -> int:
        """The tower's blocks before the hidden layer the LLM reads (`vision_feature_layer`)."""
        where, layer = f"{self.name} config.json", hf.get("vision_feature_layer", -2)
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
        """A part's section; the tower's read at the feature layer, the projector's keys.

        Raises:
          FamilyError: a feature select strategy, projector bias or activation jaxmllm does
            not read, naming it.
        """
        out = super().section(role, hf)
        if role != "vision":
            return out
        where, tower = f"{self.name} config.json", self.inner(role, hf)
        strategy = hf.get("vision_feature_select_strategy", "default")
        # (the class token, CLIP's, is dropped after the blocks; a tower without one keeps all)
        want = "default" if tower.options["class_token"] else "full"
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
        """The projector's two Linears, beside the tower."""
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
        """The projector's tensors, the vision part's."""
        return role == "vision" and name.startswith("multi_modal_projector.")

    def unused(self, role: str, name: str, hf: dict) -> bool:
        """The tower's blocks past the feature layer, and its final norm."""
        return role == "vision" and self.inner(role, hf).unused(name, self.feature_depth(hf))

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        """The whole's config.json: from scratch (the decoder our options say), or `source`'s
        with `roles`' parts ours."""
        v, llm = cfg.model.vision, cfg.model.llm
        tower = self.tower_with(v.class_token)
        act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[v.projector_act]
        if source is None:
            return {
                "architectures": [self.hf_class],
                "model_type": self.name,
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
        """Our options LLaVA has no counterpart for (its decoder's, its tower's, the
        projector's)."""
        v, width = cfg.model.vision, cfg.model.llm.width
        tower = self.tower_with(v.class_token)
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
        """transformers' inputs of a sample (`oracle.llava`)."""
        return oracle.llava(sample, cfg, specials)

    def fillers(self, cfg: Any) -> dict[str, Any]:
        """The tower's final norm, as ones and zeros (LLaVA never applies it)."""
        width = cfg.model.vision.width  # (the tower's final norm: LLaVA never applies it)
        return {
            "vision_tower.post_layernorm.weight": np.ones(width, np.float32),
            "vision_tower.post_layernorm.bias": np.zeros(width, np.float32),
        }

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        """The image processor's (CLIP's or SigLIP's) and the processor's files."""
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
    """Qwen2-Audio (the module docstring): its row's decoder and encoder."""

    row = table.QWEN2_AUDIO
    parts = {"llm": ("text_config", "language_model."), "audio": ("audio_config", "audio_tower.")}
    token_keys = {"audio": ("audio_token_index", "audio_token_id")}
    runtime_prefix = {"audio": "model.audio_tower."}

    def __init__(self):
        """Its decoder (the row's first) and its encoder."""
        super().__init__()
        self.decoder = DECODERS[self.row.llm[0].name]
        self.encoder = tower_of(self.row.towers[0])

    def inner(self, role: str, hf: dict) -> Family:
        """The LLM's decoder (one the row names) or the encoder."""
        if role == "llm":
            return decoder(self.sub(role, hf), f"{self.name} config.json", self.row.llm)
        return self.encoder

    def section(self, role: str, hf: dict) -> dict:
        """A part's section; the audio projector is one Linear."""
        out = super().section(role, hf)
        if role == "audio":
            out["projector"] = "linear"
        return out

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        """The projector's Linear, beside the encoder."""
        if role != "audio":
            return []
        shape = (cfg.model.audio.width, cfg.model.llm.width)
        return linear("multi_modal_projector.linear", "audio_projector/fc", shape)

    def owns(self, role: str, name: str) -> bool:
        """The projector's tensors, the audio part's."""
        return role == "audio" and name.startswith("multi_modal_projector.")

    def reference_inputs(self, sample: Any, cfg: Any, specials: Any) -> dict:
        """transformers' inputs of a sample (`oracle.qwen2_audio`)."""
        return oracle.qwen2_audio(sample, cfg, specials)

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        """The whole's config.json: from scratch, or `source`'s with `roles`' parts ours."""
        llm = cfg.model.llm
        if source is None:
            return {
                "architectures": [self.hf_class],
                "model_type": self.name,
                "text_config": nested(self.decoder.to_hf_config(cfg, None)),
                "audio_config": nested(self.encoder.to_hf_config(cfg, None)),
                "audio_token_index": tokenizer_ids(cfg).specials.media["audio"],
                "tie_word_embeddings": llm.tie_embeddings,
            }
        out = dict(source)
        if "llm" in roles:
            text = self.sub("llm", source)
            out["text_config"] = nested(self.decoder.to_hf_config(cfg, text), self.decoder.name)
        if "audio" in roles:
            out["audio_config"] = nested(self.encoder.to_hf_config(cfg, source))
        return out

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        """The feature extractor's (Whisper's) and the processor's files."""
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
        """Our options Qwen2-Audio has no counterpart for (its decoder's, its encoder's)."""
        wants = {
            **self.decoder.wants(cfg),
            **self.encoder.wants(cfg),
            "model.audio.projector": ("linear",),
        }
        return (
            enabled(cfg, "audio", True)
            + enabled(cfg, "vision", False)
            + mismatches(cfg, wants, "Qwen2-Audio")
        )


# Each whole row of the table with the class that reads its layout
WHOLES: tuple[Whole, ...] = (
    Llava(),
    QwenVL(table.QWEN2_VL),
    QwenVL(table.QWEN2_5_VL),
    Qwen3VL(table.QWEN3_VL),
    Qwen3VL(table.QWEN3_VL_MOE),
    Qwen3VL(table.QWEN3_5),
    Qwen3VL(table.QWEN3_5_MOE),
    Qwen2Audio(),
    Gemma3Whole(),
    Gemma4Whole(),
)


def whole_for(hf: dict | None) -> Whole | None:
    """The whole-checkpoint family of a config.json, or None (a checkpoint of one part)."""
    kind = (hf or {}).get("model_type")
    return next((w for w in WHOLES if kind in w.model_types), None)
