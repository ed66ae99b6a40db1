"""Gemma 4's whole model: `Gemma4ForConditionalGeneration` (`gemma4`, the table's `GEMMA4` row),
its text decoder and its vision tower (no audio tower yet).

- Its LLM is Gemma 4's text decoder (`jaxmllm.hf.gemma4`: `model.language_model.`, the
  causal LM's `model.` renamed, as transformers 5 names the modules), its tower Gemma 4's
  (`model.vision_tower.`, `jaxmllm.hf.gemma4_vision`), its projector `model.embed_vision.`
  (an RMSNorm without a scale, then `embedding_projection` [text width, vision width]):
  jaxmllm's `projector: pool`, `pool_embed`, the tower's pooling and standardisation before it.
- An image is `image_token_id` once per soft token, right after `boi_token_id` and before
  `eoi_token_id` (the row's `wrap`; Gemma4Processor writes nothing else around it). Its tokens
  attend to each other both ways where text_config's `use_bidirectional_attention` is
  `vision`, and then in the sliding-window layers only: the full-attention layers stay causal
  (transformers' `create_masks_for_vision_model`: `model.llm.bidirectional: [vision]`,
  `bidirectional_full: false`).
- Its processor resizes each image at its aspect ratio to at most `max_soft_tokens` x k x k
  patches (k: `pooling_kernel_size`), each side floored to whole k x k windows, small images
  scaled up: `data.image_resize: floor` within `data.image_max_pixels` (`hf import` sets them),
  so an image has exactly the processor's soft tokens, patch x patch x k x k pixels each.

Refused, naming the key: an audio tower (`audio_config`), and what the decoder and the tower
refuse.
"""

from __future__ import annotations

from typing import Any

from jaxmllm.hf import oracle, table
from jaxmllm.hf.family import Family, Link, dense, mismatches, refuse_unless
from jaxmllm.hf.whole import Whole
from jaxmllm.hf.whole_config import (
    DECODERS,
    decoder,
    enabled,
    nested,
    placeholder,
    tokenizer_ids,
    tower_of,
)

PROJECTOR = "model.embed_vision."
# The soft tokens an image may have in Gemma4ImageProcessor (its max_soft_tokens)
SOFT_TOKENS = (70, 140, 280, 560, 1120)
# Gemma4Processor's tokens around an image, and their config.json keys
WRAP_TOKENS = ("<|image>", "<image|>")


class Gemma4Whole(Whole):
    """Gemma 4's whole model (the module docstring)."""

    row = table.GEMMA4
    parts = {
        "llm": ("text_config", "model.language_model."),
        "vision": ("vision_config", "model.vision_tower."),
    }
    token_keys = {"vision": ("image_token_id",)}
    runtime_names = True

    def __init__(self):
        """Its decoder (the row's) and its tower (Gemma 4's)."""
        super().__init__()
        self.decoder = DECODERS[self.row.llm[0].name]
        self.tower = tower_of(self.row.towers[0])

    def inner(self, role: str, hf: dict) -> Family:
        """The LLM's decoder, or the tower.

        Raises:
          FamilyError: another text or vision model type, or an audio tower, naming it.
        """
        where = f"{self.name} config.json"
        refuse_unless(
            not hf.get("audio_config"),
            where,
            "audio_config is set: Gemma 4's audio tower is not built in jaxmllm yet (a "
            "checkpoint without it has audio_config null)",
        )
        sub = self.sub(role, hf)
        if role == "llm":
            return decoder(sub, where, self.row.llm)
        kind = sub.get("model_type", self.tower.model_types[0])
        refuse_unless(
            kind in self.tower.model_types,
            where,
            f"vision_config model_type {kind!r}: jaxmllm reads {self.tower.model_types[0]} here",
        )
        return self.tower

    def section(self, role: str, hf: dict) -> dict:
        """A part's section; the LLM's with its images read both ways in its sliding layers
        where text_config's use_bidirectional_attention is vision."""
        out = super().section(role, hf)
        if role == "llm" and self.sub(role, hf).get("use_bidirectional_attention") == "vision":
            out["bidirectional"] = list(self.row.bidirectional)
            out["bidirectional_full"] = False
        return out

    def place(self, role: str, name: str, at: str) -> str:
        """A part's tensor under the whole's names (the decoder's `model.` is
        `model.language_model.`; its head stays `lm_head`)."""
        if role == "llm":
            return at + name.removeprefix("model.") if name.startswith("model.") else name
        return at + name

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        """The projector's matrix (embed_vision's; its norm has no weight)."""
        if role != "vision":
            return []
        shape = (cfg.model.vision.width, cfg.model.llm.width)
        kernel = "vision_projector/fc/kernel"
        return [dense(PROJECTOR + "embedding_projection.weight", kernel, shape)]

    def owns(self, role: str, name: str) -> bool:
        """The projector's tensors, the vision part's; the LM head, the LLM's."""
        if role == "vision":
            return name.startswith(PROJECTOR)
        return role == "llm" and name.startswith("lm_head.")

    def data_keys(self, proc: dict, where: str, hf: dict) -> dict:
        """Our `data` keys of its image processor (the module docstring): the floor rule
        within max_soft_tokens x k x k patches (280 where the file names none), pixels to
        [-1, 1] as its patch embedder maps them.

        Raises:
          FamilyError: a processor that normalises before the model does, or whose patch or
            pooling size is not the tower's.
        """
        refuse_unless(
            not proc.get("do_normalize"),
            where,
            "do_normalize: true: Gemma 4's patch embedder maps [0, 1] pixels to [-1, 1] "
            "itself; a processor that normalises first is not read (set it to false)",
        )
        tower = self.sub("vision", hf)
        p, k = int(tower.get("patch_size", 16)), int(tower.get("pooling_kernel_size", 3))
        theirs = (proc.get("patch_size", p), proc.get("pooling_kernel_size", k))
        refuse_unless(
            theirs == (p, k),
            where,
            f"patch_size {theirs[0]} and pooling_kernel_size {theirs[1]}: config.json's "
            f"vision_config has {p} and {k}; they must agree",
        )
        budget = int(proc.get("max_soft_tokens", 280)) * (k * p) ** 2
        return {
            "image_resize": "floor",
            "image_min_pixels": budget,
            "image_max_pixels": budget,
            "image_mean": [0.5] * 3,
            "image_std": [0.5] * 3,
        }

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        """The whole's config.json: from scratch, or `source`'s with `roles`' parts ours."""
        llm = cfg.model.llm
        both = "vision" if llm.bidirectional else None
        if source is None:
            tk = tokenizer_ids(cfg)
            ids = {"image_token_id": tk.specials.media["vision"]}
            for key, token in zip(self.row.wrap, WRAP_TOKENS, strict=True):
                found = getattr(tk, "token_id", lambda _: None)(token)
                if found is not None:
                    ids[key] = found
            text = nested(self.decoder.to_hf_config(cfg, None), self.decoder.name)
            return {
                "architectures": [self.hf_class],
                "model_type": self.name,
                "text_config": {**text, "use_bidirectional_attention": both},
                "vision_config": nested(self.tower.to_hf_config(cfg, None)),
                "audio_config": None,
                "tie_word_embeddings": llm.tie_embeddings,
                **ids,
            }
        out = dict(source)
        if "llm" in roles:
            text = nested(
                self.decoder.to_hf_config(cfg, self.sub("llm", source)), self.decoder.name
            )
            out["text_config"] = {**text, "use_bidirectional_attention": both}
            out["tie_word_embeddings"] = llm.tie_embeddings
        if "vision" in roles:
            out["vision_config"] = nested(self.tower.to_hf_config(cfg, source))
        return out

    def mismatches(self, cfg: Any) -> list[str]:
        """Our options Gemma 4 has no counterpart for (its decoder's, its tower's, images read
        both ways in every layer, its processor's resize and pixels)."""
        spans = cfg.model.llm.bidirectional
        wants = {
            **self.decoder.wants(cfg),
            **self.tower.wants(cfg),
            "model.llm.bidirectional": (
                (lambda b: tuple(b) in ((), ("vision",))),
                "[vision] or []",
            ),
            "model.llm.bidirectional_full": ((lambda f: not (spans and f)), "false (sliding only)"),
            "data.image_resize": ("floor",),
            "data.image_mean": ((lambda m: tuple(m) == (0.5,) * 3), "0.5 a channel"),
            "data.image_std": ((lambda m: tuple(m) == (0.5,) * 3), "0.5 a channel"),
            "data.image_max_pixels": (
                (lambda n: n in self.budgets(cfg)),
                "max_soft_tokens x (patch x merge)^2 pixels, max_soft_tokens one of "
                f"{', '.join(map(str, SOFT_TOKENS))}",
            ),
        }
        return (
            enabled(cfg, "vision", True)
            + enabled(cfg, "audio", False)
            + mismatches(cfg, wants, "Gemma 4")
        )

    def budgets(self, cfg: Any) -> tuple[int, ...]:
        """The pixel budgets Gemma4ImageProcessor has at our patch and merge sizes."""
        v = cfg.model.vision
        return tuple(t * (v.patch_size * v.merge) ** 2 for t in SOFT_TOKENS)

    def reference_inputs(self, sample: Any, cfg: Any, specials: Any) -> dict:
        """transformers' inputs of a sample (`oracle.gemma4`)."""
        return oracle.gemma4(sample, cfg, specials)

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        """Gemma4ImageProcessor's file (its resize at our budget, [0, 1] pixels) and the
        processor's."""
        v, d = cfg.model.vision, cfg.data
        tokens = d.image_max_pixels // (v.patch_size * v.merge) ** 2
        image = {
            "image_processor_type": "Gemma4ImageProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": False,
            "image_mean": [0.0] * 3,
            "image_std": [1.0] * 3,
            "patch_size": v.patch_size,
            "pooling_kernel_size": v.merge,
            "max_soft_tokens": tokens,
        }
        processor = {
            "processor_class": self.processor_class,
            "image_seq_length": tokens,
            "image_token": placeholder(cfg, "vision"),
        }
        return {"preprocessor_config.json": image, "processor_config.json": processor}
