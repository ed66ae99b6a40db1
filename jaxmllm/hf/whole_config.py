"""What every whole checkpoint's family (`jaxmllm.hf.wholes`, `jaxmllm.hf.qwen_vl`) writes and
reads alike: the decoder and tower families of the table's rows, its LLM's decoder family, a
part's config nested in the whole's config.json, the run's placeholder tokens and an image
processor's normalisation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxmllm.data.text.tokenizer import config_tokenizer
from jaxmllm.hf import table
from jaxmllm.hf.audio import Gemma4AudioEncoder, Qwen2AudioEncoder, WhisperEncoder
from jaxmllm.hf.decoders import Decoders
from jaxmllm.hf.family import Family, refuse_unless
from jaxmllm.hf.gemma import Gemma3
from jaxmllm.hf.gemma4 import Gemma4
from jaxmllm.hf.gemma4_vision import Gemma4Vision
from jaxmllm.hf.hybrid import Qwen35
from jaxmllm.hf.qwen_vision import Qwen2VLVision, Qwen3VLVision, Qwen25VLVision
from jaxmllm.hf.table import DecoderRow, TowerRow
from jaxmllm.hf.vision import Clip, Siglip


def decoder_family(row: DecoderRow, experts: str = "linear") -> Decoders:
    """The family that reads a decoder row (a hybrid's: Qwen3.5's layers; Gemma's block:
    `post_norms`, Gemma 4's over it: `layer_scalar`); `experts`: how its checkpoint lays out
    the routed experts (`decoders.EXPERTS`)."""
    gemma = Gemma4 if row.layer_scalar else Gemma3
    family = gemma if row.post_norms else Qwen35 if row.hybrid else Decoders
    return family(row, experts)


DECODERS = {row.name: decoder_family(row) for row in table.DECODERS}
# Every tower family, one per row of `table.TOWERS`
TOWERS: tuple[Family, ...] = (
    Siglip(),
    Clip(),
    Qwen2VLVision(),
    Qwen25VLVision(),
    Qwen3VLVision(),
    WhisperEncoder(),
    Qwen2AudioEncoder(),
    Gemma4Vision(),
    Gemma4AudioEncoder(),
)
PROJECTOR_ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def tower_of(row: TowerRow) -> Family:
    """The tower family of a tower row."""
    return next(t for t in TOWERS if t.row == row)


def decoder(hf: dict, where: str, allowed: Sequence[DecoderRow]) -> Decoders:
    """The decoder family of a whole's `text_config` (`hf`), one of the rows `allowed`
    (without a model_type: the first).

    Raises:
      FamilyError: naming its model_type and the ones jaxmllm reads there.
    """
    kind = hf.get("model_type", allowed[0].name)
    names = [row.name for row in allowed]
    refuse_unless(
        kind in names,
        where,
        f"text_config model_type {kind!r} is not supported (jaxmllm reads {', '.join(names)} here)",
    )
    return DECODERS[kind]


def decoder_of(cfg: Any) -> Decoders:
    """The decoder family our LLM's options say it is: of the table's rows, the one whose
    layer kinds (linear attention, routed experts) and block (Gemma's norms after attention
    and the MLP) are ours, then whose QK-norm is ours, then whose attention biases are ours
    (the table's first where several fit alike)."""
    llm = cfg.model.llm

    def fit(row: DecoderRow) -> tuple[bool, ...]:
        """How far `row` fits our options, most telling first."""
        return (
            row.hybrid == llm.linear.enabled
            and row.has_experts(llm.moe.enabled)
            and row.post_norms == llm.post_norms
            and row.layer_scalar == llm.layer_scalar,
            row.qk_norm == llm.qk_norm,
            llm.attn_bias in row.biases.allowed(),
        )

    return DECODERS[max(table.DECODERS, key=fit).name]


def nested(config: dict, model_type: str | None = None) -> dict:
    """A part's config as a whole's config.json nests it (no architectures of its own)."""
    out = {k: v for k, v in config.items() if k != "architectures"}
    if model_type:
        out["model_type"] = model_type
    return out


def enabled(cfg: Any, name: str, want: bool) -> list[str]:
    """A mismatch naming `model.<name>.enabled` unless the encoder is there as `want` says."""
    have = getattr(cfg.model, name).enabled
    return (
        []
        if have == want
        else [f"model.{name}.enabled={have} ({'needs' if want else 'has no'} {name} encoder)"]
    )


def tokenizer_ids(cfg: Any) -> Any:
    """The run's tokenizer (what a new config.json's placeholder ids are)."""
    return config_tokenizer(cfg)


def placeholder(cfg: Any, phase: str) -> str:
    """The text of the run's tokenizer's placeholder token of an encoder phase."""
    tk = tokenizer_ids(cfg)
    return tk.decode([tk.specials.media[phase]])


def pixels(cfg: Any, processor: str) -> dict:
    """An image processor's normalisation (rescaled to [0, 1], then mean / std per channel)."""
    d = cfg.data
    return {
        "image_processor_type": processor,
        "do_convert_rgb": True,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(d.image_mean),
        "image_std": list(d.image_std),
    }
