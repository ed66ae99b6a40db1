"""The family table: one frozen row per architecture jaxmllm reads, holding what families differ
in, and nothing else. Every model type's name lives here and nowhere else in `jaxmllm/`.

- A decoder (`DecoderRow`: Llama, Qwen2, Qwen3, their mixtures of experts, Qwen3.5's hybrids,
  Gemma 3's and Gemma 4's text decoders)
  is jaxmllm's own decoder with options: which attention projections have biases and which
  config.json key says so, QK-norm, routed experts and a shared expert, linear-attention layers
  among the full ones, sliding windows, Gemma's block. `jaxmllm.hf.decoders.Decoders` reads any
  such row (the hybrids: `jaxmllm.hf.hybrid.Qwen35`; Gemma's block: `jaxmllm.hf.gemma.Gemma3`, and
  `jaxmllm.hf.gemma4.Gemma4` over it);
  a new Llama-like family is one more row in `DECODERS`.
- A tower (`TowerRow`: SigLIP, CLIP, the Qwen VL towers, Whisper's and Qwen2-Audio's encoders,
  Gemma 4's vision tower and audio encoder)
  names the model types it reads and, for each, the transformers module `hf check` compares
  with; the layout of its tensors is its class's (`jaxmllm.hf.vision`, `qwen_vision`,
  `audio`), which names its row.
- A whole multimodal checkpoint (`WholeRow`: LLaVA, the Qwen VL wholes, Qwen2-Audio, Gemma 3,
  Gemma 4)
  names the decoders and towers it may hold and, per encoder phase, where `hf check` reads
  transformers' rows (`Hook`) and the tokens around an item (an image, Gemma 4's clip); which
  items its decoder reads both ways.

The consumers read rows: `whole_config.DECODERS` and `decoder_of` (our options -> a decoder
row), the registry's families and its refusal listing what is supported, `hf check`'s
transformers classes, the wholes' parts. See docs/adding-a-family.md.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Reference:
    """The transformers module `hf check` compares a checkpoint of one model type with."""

    model_type: str  # the config.json model_type
    cls: str  # the transformers class `from_pretrained` builds
    path: str = ""  # the module compared inside it ("vision_model": a SiglipModel's tower)
    # transformers.models.<module>.modeling_<module> holds the class (not exported at the top)
    module: str = ""


@dataclasses.dataclass(frozen=True)
class Biases:
    """Which attention projections have a bias: `on` ("qkv" or "qkvo") when config.json's
    `key` says so (its `default` where it leaves the key out); always `on` without a key."""

    on: str
    key: str = ""
    default: bool = False

    def read(self, hf: dict) -> str:
        """Our `attn_bias` from a config.json."""
        return self.on if not self.key or hf.get(self.key, self.default) else ""

    def allowed(self) -> tuple[str, ...]:
        """Our `attn_bias` values the family has (the default first, as refusals list them)."""
        if not self.key:
            return (self.on,)
        return (self.on, "") if self.default else ("", self.on)

    def to_hf(self, attn_bias: str) -> dict:
        """The config.json key of our `attn_bias` (none where the biases are always there)."""
        return {self.key: attn_bias == self.on} if self.key else {}


class Windows(enum.Enum):
    """Sliding-window attention in a decoder's config.json: the place a family with windows
    (Gemma) says how its `layer_types` / `sliding_window` are read."""

    ABSENT = "absent"  # its config.json has no such keys (Llama): nothing to check
    REFUSED = "refused"  # `use_sliding_window` / `layer_types` may name windows: refused
    # `layer_types` names each layer sliding_attention or full_attention, `sliding_window` the
    # window: read into `model.llm.window` (Gemma 3; `jaxmllm.hf.gemma`)
    LAYER_TYPES = "layer_types"


@dataclasses.dataclass(frozen=True)
class DecoderRow:
    """A causal LM's family: jaxmllm's decoder with the options below (see the module
    docstring); its model type is its `name`."""

    name: str  # config.json's model_type; what the CLI and errors call it
    hf_class: str  # the transformers class export writes and `hf check` builds
    biases: Biases  # which attention projections have biases, and the key saying so
    mlp_bias: bool = False  # config.json's `mlp_bias` may put biases on the MLP (Llama)
    qk_norm: bool = False  # RMSNorm over each head's queries and keys (Qwen3)
    moe: bool = False  # mixture-of-experts MLPs (`mlp.gate`, `mlp.experts`)
    shared_expert: bool = False  # a shared expert and its sigmoid gate beside them (Qwen2-MoE)
    hybrid: bool = False  # Gated DeltaNet layers among full-attention ones (Qwen3.5)
    windows: Windows = Windows.REFUSED  # sliding-window attention (`Windows`)
    # Gemma's block (`jaxmllm.hf.gemma`): four (1 + w) RMSNorms a layer (after attention and
    # the MLP too), a GeGLU MLP, embeddings scaled by sqrt(width), query_pre_attn_scalar
    post_norms: bool = False
    # Gemma 4's block over Gemma's (`jaxmllm.hf.gemma4`): each layer's output scaled by its
    # layer_scalar, plain RMSNorms, normed values, the full layers' own head shapes
    layer_scalar: bool = False
    # Gemma 4's mixture-of-experts block (`jaxmllm.hf.gemma4`): routed experts beside every
    # layer's MLP where config.json's enable_moe_block says, its tensors named apart from
    # `moe`'s (`router`, `experts` beside `mlp`)
    moe_block: bool = False
    role = "llm"

    def has_experts(self, enabled: bool) -> bool:
        """Whether the family's decoder may be with routed experts (`enabled`) or without."""
        return enabled == self.moe or (enabled and self.moe_block)

    @property
    def model_types(self) -> tuple[str, ...]:
        """The config.json model_type values it reads: its name."""
        return (self.name,)

    def reference(self, model_type: str) -> Reference:
        """`hf check`'s transformers module: the causal LM itself."""
        return Reference(model_type, self.hf_class)


@dataclasses.dataclass(frozen=True)
class TowerRow:
    """A vision tower's or audio encoder's family: the model types it reads, each with the
    transformers module `hf check` compares (a whole SiglipModel's tower, Whisper's encoder)."""

    name: str  # what the CLI and errors call it
    role: str  # vision | audio
    hf_class: str  # the transformers class export writes
    references: tuple[Reference, ...]  # one per config.json model_type it reads

    @property
    def model_types(self) -> tuple[str, ...]:
        """The config.json model_type values it reads (the first: what export writes)."""
        return tuple(r.model_type for r in self.references)

    def reference(self, model_type: str) -> Reference:
        """`hf check`'s transformers module for a checkpoint of `model_type`."""
        return next(r for r in self.references if r.model_type == model_type)


@dataclasses.dataclass(frozen=True)
class Hook:
    """Where `hf check` reads transformers' encoder rows in a whole model: the module hooked
    and how its output gives the rows of an item of `n` placeholder tokens."""

    module: str
    rows: Callable[[Any, int], Any]


@dataclasses.dataclass(frozen=True)
class WholeRow:
    """A whole multimodal checkpoint's family; its model type is its `name`."""

    name: str  # config.json's model_type; what the CLI and errors call it
    hf_class: str  # the transformers class export writes and `hf check` builds
    processor_class: str  # the transformers processor of its directory
    llm: tuple[DecoderRow, ...]  # the decoders its text_config may be (the first: its own)
    towers: tuple[TowerRow, ...]  # the vision or audio towers it may hold (the first: default)
    # Per encoder phase, where `hf check` reads transformers' rows of its items
    hooks: dict[str, Hook] = dataclasses.field(default_factory=dict, hash=False)
    mrope_sections: tuple[int, ...] = ()  # M-RoPE's sections where config.json names none
    deepstack: bool = False  # its tower's blocks feed the LLM's first layers (Qwen3-VL)
    # How its checkpoint lays out routed experts (`decoders.EXPERTS`): "linear" reads them one
    # Linear each or fused, as the files hold them (`Decoders.for_checkpoint`)
    experts: str = "linear"
    # Per encoder phase, the config.json keys of the ids its processor writes before and after
    # an item's placeholders (Qwen's `<|vision_start|>`, Gemma's `<start_of_image>`, Gemma 4's
    # `<|audio>`); a phase absent, or a key the config.json leaves out: none
    wraps: dict[str, tuple[str, str]] = dataclasses.field(
        default_factory=lambda: {"vision": ("vision_start_token_id", "vision_end_token_id")},
        hash=False,
    )
    # The phases whose items attend to each other both ways in its decoder (`model.llm.
    # bidirectional`; transformers' `token_type_ids`: Gemma 3's images; Gemma 4's where its
    # text_config's use_bidirectional_attention says vision, in its sliding layers only)
    bidirectional: tuple[str, ...] = ()

    @property
    def model_types(self) -> tuple[str, ...]:
        """The config.json model_type values it reads: its name."""
        return (self.name,)


# ----------------------------------------------------------------------------- hook readers


def merger_rows(out: Any, n: int) -> Any:
    """A Qwen VL tower's output: its merger's rows, every image's (split by image later)."""
    import torch

    rows = out.pooler_output
    return torch.cat(list(rows)) if isinstance(rows, list | tuple) else rows


def projector_rows(out: Any, n: int) -> Any:
    """A projector's output for one item: its first row of rows."""
    return out[0]


def embedded_rows(out: Any, n: int) -> Any:
    """Gemma 4's `embed_vision` output for one item: the first `n` of its rows (every image's
    soft tokens, one after another, no batch axis)."""
    return out[:n]


def clip_rows(out: Any, n: int) -> Any:
    """An audio projector's output for one clip: the rows of its `n` placeholders (Qwen2-Audio's
    projector, Gemma 4's `embed_audio`: [clips, rows, width], a clip's padding rows last)."""
    return out[0, :n]


# ----------------------------------------------------------------------------- decoders

ALL_OR_NONE = Biases("qkvo", key="attention_bias")  # every projection or none

LLAMA = DecoderRow("llama", "LlamaForCausalLM", ALL_OR_NONE, mlp_bias=True, windows=Windows.ABSENT)
QWEN2 = DecoderRow("qwen2", "Qwen2ForCausalLM", Biases("qkv"))
QWEN3 = DecoderRow("qwen3", "Qwen3ForCausalLM", ALL_OR_NONE, qk_norm=True)
QWEN2_MOE = DecoderRow(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    Biases("qkv", key="qkv_bias", default=True),
    moe=True,
    shared_expert=True,
)
QWEN3_MOE = DecoderRow("qwen3_moe", "Qwen3MoeForCausalLM", ALL_OR_NONE, qk_norm=True, moe=True)
QWEN3_5_TEXT = DecoderRow(
    "qwen3_5_text", "Qwen3_5ForCausalLM", ALL_OR_NONE, qk_norm=True, hybrid=True
)
QWEN3_5_MOE_TEXT = DecoderRow(
    "qwen3_5_moe_text",
    "Qwen3_5MoeForCausalLM",
    ALL_OR_NONE,
    qk_norm=True,
    moe=True,
    shared_expert=True,
    hybrid=True,
)
GEMMA3_TEXT = DecoderRow(
    "gemma3_text",
    "Gemma3ForCausalLM",
    ALL_OR_NONE,
    qk_norm=True,
    windows=Windows.LAYER_TYPES,
    post_norms=True,
)
GEMMA4_TEXT = DecoderRow(
    "gemma4_text",
    "Gemma4ForCausalLM",
    ALL_OR_NONE,
    qk_norm=True,
    windows=Windows.LAYER_TYPES,
    post_norms=True,
    layer_scalar=True,
    moe_block=True,
)
# (the order `decoder_of` prefers among rows that fit a config alike: Llama before Qwen2)
DECODERS = (
    LLAMA,
    QWEN2,
    QWEN3,
    QWEN2_MOE,
    QWEN3_MOE,
    QWEN3_5_TEXT,
    QWEN3_5_MOE_TEXT,
    GEMMA3_TEXT,
    GEMMA4_TEXT,
)

# ----------------------------------------------------------------------------- towers

SIGLIP = TowerRow(
    "siglip",
    "vision",
    "SiglipVisionModel",
    (
        Reference("siglip_vision_model", "SiglipVisionModel"),
        Reference("siglip", "SiglipModel", "vision_model"),
    ),
)
CLIP = TowerRow(
    "clip",
    "vision",
    "CLIPVisionModel",
    (
        Reference("clip_vision_model", "CLIPVisionModel"),
        Reference("clip", "CLIPModel", "vision_model"),
    ),
)
QWEN2_VL_VISION = TowerRow(
    "qwen2_vl",
    "vision",
    "Qwen2VisionTransformerPretrainedModel",
    (Reference("qwen2_vl_vision", "Qwen2VisionTransformerPretrainedModel", module="qwen2_vl"),),
)
QWEN2_5_VL_VISION = TowerRow(
    "qwen2_5_vl",
    "vision",
    "Qwen2_5_VisionTransformerPretrainedModel",
    (
        Reference(
            "qwen2_5_vl_vision", "Qwen2_5_VisionTransformerPretrainedModel", module="qwen2_5_vl"
        ),
    ),
)
QWEN3_VL_VISION = TowerRow(
    "qwen3_vl",
    "vision",
    "Qwen3VLVisionModel",
    (
        Reference("qwen3_vl_vision", "Qwen3VLVisionModel"),
        Reference("qwen3_vl_moe_vision", "Qwen3VLMoeVisionModel"),
    ),
)
WHISPER = TowerRow(
    "whisper",
    "audio",
    "WhisperForConditionalGeneration",
    (Reference("whisper", "WhisperModel", "encoder"),),
)
QWEN2_AUDIO_ENCODER = TowerRow(
    "qwen2_audio",
    "audio",
    "Qwen2AudioEncoder",
    (Reference("qwen2_audio_encoder", "Qwen2AudioEncoder", module="qwen2_audio"),),
)
GEMMA4_VISION = TowerRow(
    "gemma4_vision",
    "vision",
    "Gemma4VisionModel",
    (Reference("gemma4_vision", "Gemma4VisionModel"),),
)
GEMMA4_AUDIO = TowerRow(
    "gemma4_audio",
    "audio",
    "Gemma4AudioModel",
    (Reference("gemma4_audio", "Gemma4AudioModel", module="gemma4"),),
)
TOWERS = (
    SIGLIP,
    CLIP,
    QWEN2_VL_VISION,
    QWEN2_5_VL_VISION,
    QWEN3_VL_VISION,
    WHISPER,
    QWEN2_AUDIO_ENCODER,
    GEMMA4_VISION,
    GEMMA4_AUDIO,
)

# ----------------------------------------------------------------------------- wholes

VISUAL = Hook("model.visual", merger_rows)
LLAVA = WholeRow(
    "llava",
    "LlavaForConditionalGeneration",
    "LlavaProcessor",
    llm=(LLAMA, QWEN2, QWEN3),
    towers=(CLIP, SIGLIP),
    hooks={"vision": Hook("model.multi_modal_projector", projector_rows)},
)
QWEN2_VL = WholeRow(
    "qwen2_vl",
    "Qwen2VLForConditionalGeneration",
    "Qwen2VLProcessor",
    llm=(QWEN2,),
    towers=(QWEN2_VL_VISION,),
    hooks={"vision": VISUAL},
)
QWEN2_5_VL = WholeRow(
    "qwen2_5_vl",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen2_5_VLProcessor",
    llm=(QWEN2,),
    towers=(QWEN2_5_VL_VISION,),
    hooks={"vision": VISUAL},
)
QWEN3_VL = WholeRow(
    "qwen3_vl",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLProcessor",
    llm=(QWEN3,),
    towers=(QWEN3_VL_VISION,),
    hooks={"vision": VISUAL},
    mrope_sections=(24, 20, 20),
    deepstack=True,
)
# (the hub's files hold its experts fused, maybe each transposed: `decoders.EXPERTS`)
QWEN3_VL_MOE = dataclasses.replace(
    QWEN3_VL,
    name="qwen3_vl_moe",
    hf_class="Qwen3VLMoeForConditionalGeneration",
    llm=(QWEN3_MOE,),
    experts="fused_hub",
)
QWEN3_5 = WholeRow(
    "qwen3_5",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3VLProcessor",
    llm=(QWEN3_5_TEXT,),
    towers=(QWEN3_VL_VISION,),
    hooks={"vision": VISUAL},
    mrope_sections=(11, 11, 10),
)
QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    name="qwen3_5_moe",
    hf_class="Qwen3_5MoeForConditionalGeneration",
    llm=(QWEN3_5_MOE_TEXT,),
)
QWEN2_AUDIO = WholeRow(
    "qwen2_audio",
    "Qwen2AudioForConditionalGeneration",
    "Qwen2AudioProcessor",
    llm=(QWEN2,),
    towers=(QWEN2_AUDIO_ENCODER,),
    hooks={"audio": Hook("model.multi_modal_projector", clip_rows)},
)
GEMMA3 = WholeRow(
    "gemma3",
    "Gemma3ForConditionalGeneration",
    "Gemma3Processor",
    llm=(GEMMA3_TEXT,),
    towers=(SIGLIP,),
    hooks={"vision": Hook("model.multi_modal_projector", projector_rows)},
    wraps={"vision": ("boi_token_index", "eoi_token_index")},
    bidirectional=("vision",),
)
GEMMA4 = WholeRow(
    "gemma4",
    "Gemma4ForConditionalGeneration",
    "Gemma4Processor",
    llm=(GEMMA4_TEXT,),
    towers=(GEMMA4_VISION, GEMMA4_AUDIO),
    hooks={
        "vision": Hook("model.embed_vision", embedded_rows),
        "audio": Hook("model.embed_audio", clip_rows),
    },
    # (its config.json's keys as Gemma4Config names them: eoa's is an `_index`)
    wraps={
        "vision": ("boi_token_id", "eoi_token_id"),
        "audio": ("boa_token_id", "eoa_token_index"),
    },
    bidirectional=("vision",),
)
