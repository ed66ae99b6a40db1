"""Gemma 3's whole model: `Gemma3ForConditionalGeneration` (`gemma3`, the table's `GEMMA3` row).

- Its LLM is Gemma 3's text decoder (`jaxmllm.hf.gemma`: `language_model.`), its tower SigLIP
  read to its last block and final norm (`vision_tower.`, `jaxmllm.hf.vision`).
- Its projector (`multi_modal_projector.`) average-pools the tower's image_size / patch_size
  square of patches in k x k windows to `mm_tokens_per_image` tokens, normalises each by
  `mm_soft_emb_norm` (Gemma's 1 + w RMSNorm, the tower's layer_norm_eps) and multiplies it by
  `mm_input_projection_weight` [vision width, text width]: jaxmllm's `projector: pool` with
  `merge: k` (each run of k x k rows one token's window, in merge order).
- An image is `image_token_index` once per token, after `boi_token_index` and before
  `eoi_token_index` (the row's `wrap`); its tokens attend to each other both ways
  (transformers' `token_type_ids`: `model.llm.bidirectional: [vision]`).

Its processor resizes every image to image_size x image_size; jaxmllm resizes to as many
pixels at the image's aspect ratio (`data.image_min_pixels` = `image_max_pixels`), so a square
image gets exactly the processor's tokens and another more or fewer. Pan and scan
(`do_pan_and_scan`) is not built and refused at import naming the key.
"""

from __future__ import annotations

import math
from typing import Any

from jaxmllm.hf import oracle, table
from jaxmllm.hf.family import Family, Link, mismatches, refuse_unless, same
from jaxmllm.hf.whole import Whole
from jaxmllm.hf.whole_config import (
    DECODERS,
    decoder,
    enabled,
    nested,
    pixels,
    placeholder,
    tokenizer_ids,
    tower_of,
)

PROJECTOR = "multi_modal_projector."


class Gemma3Whole(Whole):
    """Gemma 3's whole model (the module docstring)."""

    row = table.GEMMA3
    parts = {
        "llm": ("text_config", "language_model."),
        "vision": ("vision_config", "vision_tower."),
    }
    token_keys = {"vision": ("image_token_index", "image_token_id")}
    runtime_prefix = {"vision": "model.vision_tower."}
    fixed_size = True

    def __init__(self):
        """Its decoder (the row's) and its tower (SigLIP)."""
        super().__init__()
        self.decoder = DECODERS[self.row.llm[0].name]
        self.tower = tower_of(self.row.towers[0])

    def inner(self, role: str, hf: dict) -> Family:
        """The LLM's decoder, or the tower (refused unless SigLIP's).

        Raises:
          FamilyError: another text or vision model type, naming it.
        """
        sub, where = self.sub(role, hf), f"{self.name} config.json"
        if role == "llm":
            return decoder(sub, where, self.row.llm)
        kind = sub.get("model_type", self.tower.model_types[0])
        refuse_unless(
            kind in self.tower.model_types,
            where,
            f"vision_config model_type {kind!r}: jaxmllm reads "
            f"{', '.join(self.tower.model_types)} here",
        )
        return self.tower

    def merge(self, hf: dict) -> int:
        """The pooling window's side k: patches a side over tokens a side.

        Raises:
          FamilyError: `mm_tokens_per_image` not a square whose side divides the patches a side.
        """
        where, sub = f"{self.name} config.json", self.sub("vision", hf)
        side = int(sub.get("image_size", 0)) // max(int(sub.get("patch_size", 1)), 1)
        tokens = hf.get("mm_tokens_per_image", 256)
        per_side = math.isqrt(tokens) if isinstance(tokens, int) and tokens > 0 else 0
        refuse_unless(
            per_side > 0 and per_side**2 == tokens and side % per_side == 0,
            where,
            f"mm_tokens_per_image {tokens!r}: the projector pools the tower's {side}x{side} "
            "patches to a square of tokens whose side divides it",
        )
        return side // per_side

    def section(self, role: str, hf: dict) -> dict:
        """A part's section: the LLM's with its images read both ways; the tower's with the
        pooling projector."""
        out = super().section(role, hf)
        if role == "llm":
            out["bidirectional"] = list(self.row.bidirectional)
        else:
            out.update(projector="pool", merge=self.merge(hf), projector_dim=0)
        return out

    def own_links(self, role: str, cfg: Any, hf: dict) -> list[Link]:
        """The projector's norm and matrix (stored [vision width, text width], as our kernel)."""
        if role != "vision":
            return []
        return [
            same(PROJECTOR + "mm_soft_emb_norm.weight", "vision_projector/norm/scale"),
            same(PROJECTOR + "mm_input_projection_weight", "vision_projector/fc/kernel"),
        ]

    def owns(self, role: str, name: str) -> bool:
        """The projector's tensors, the vision part's."""
        return role == "vision" and name.startswith(PROJECTOR)

    def to_hf_config(self, cfg: Any, source: dict | None, roles: tuple[str, ...]) -> dict:
        """The whole's config.json: from scratch, or `source`'s with `roles`' parts ours."""
        llm, v = cfg.model.llm, cfg.model.vision
        tokens = (v.position_grid // v.merge) ** 2
        if source is None:
            tk = tokenizer_ids(cfg)
            ids = {"image_token_index": tk.specials.media["vision"]}
            for key, token in zip(
                self.row.wraps["vision"], ("<start_of_image>", "<end_of_image>"), strict=True
            ):
                found = getattr(tk, "token_id", lambda _: None)(token)
                if found is not None:
                    ids[key] = found
            return {
                "architectures": [self.hf_class],
                "model_type": self.name,
                "text_config": nested(self.decoder.to_hf_config(cfg, None), self.decoder.name),
                "vision_config": nested(self.tower.to_hf_config(cfg, None)),
                "mm_tokens_per_image": tokens,
                "tie_word_embeddings": llm.tie_embeddings,
                **ids,
            }
        out = dict(source)
        if "llm" in roles:
            text = self.sub("llm", source)
            out["text_config"] = nested(self.decoder.to_hf_config(cfg, text), self.decoder.name)
            out["tie_word_embeddings"] = llm.tie_embeddings
        if "vision" in roles:
            out["vision_config"] = nested(self.tower.to_hf_config(cfg, source))
            out["mm_tokens_per_image"] = tokens
        return out

    def mismatches(self, cfg: Any) -> list[str]:
        """Our options Gemma 3 has no counterpart for (its decoder's, its tower's, the
        projector's, images read causally)."""
        v = cfg.model.vision
        grid = v.position_grid
        wants = {
            **self.decoder.wants(cfg),
            **self.tower.wants(cfg),
            "model.vision.projector": ("pool",),
            "model.vision.merge": (
                (lambda m: grid % m == 0),
                f"a divisor of position_grid={grid}",
            ),
            "model.llm.bidirectional": ((lambda b: tuple(b) == ("vision",)), "[vision]"),
        }
        return (
            enabled(cfg, "vision", True)
            + enabled(cfg, "audio", False)
            + mismatches(cfg, wants, "Gemma 3")
        )

    def reference_inputs(self, sample: Any, cfg: Any, specials: Any) -> dict:
        """transformers' inputs of a sample (`oracle.gemma3`)."""
        return oracle.gemma3(sample, cfg, specials)

    def processor_files(self, cfg: Any) -> dict[str, dict]:
        """The image processor's (Gemma 3's: every image resized to the tower's size, no pan
        and scan) and the processor's files."""
        v = cfg.model.vision
        side = v.position_grid * v.patch_size
        image = {
            **pixels(cfg, "Gemma3ImageProcessor"),
            "resample": 2,
            "size": {"height": side, "width": side},
            "do_pan_and_scan": False,
        }
        processor = {
            "processor_class": self.processor_class,
            "image_seq_length": (v.position_grid // v.merge) ** 2,
            "image_token": placeholder(cfg, "vision"),
        }
        return {"preprocessor_config.json": image, "processor_config.json": processor}
