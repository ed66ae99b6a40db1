"""Which family reads a HF checkpoint directory, by its config.json's model_type and the role
(llm, vision, audio) it is imported for: a checkpoint of one part (`FAMILIES`), or one part of a
whole multimodal checkpoint (`jaxmllm.hf.wholes.WHOLES`, read through `Part`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jaxmllm.hf.family import Family, FamilyError
from jaxmllm.hf.whole import Part
from jaxmllm.hf.whole_config import TOWERS
from jaxmllm.hf.wholes import DECODERS, WHOLES, whole_for

# Every family of one part: a decoder per row of the table's decoders, a tower per tower row
FAMILIES: tuple[Family, ...] = (*DECODERS.values(), *TOWERS)
ROLES = ("llm", "vision", "audio")


# The sizes a config.json gives (at the top, or in a text_config / vision_config), each a whole
# number from 1 to its bound: far above any real model, far below what would allocate or loop
# until the machine gives out (vocab_size 1e12, num_hidden_layers 1e9; heads 0 divides by zero).
MAX_VOCAB, MAX_WIDTH, MAX_LAYERS, MAX_HEADS = 1 << 24, 1 << 18, 1024, 4096
MAX_EXPERTS = 1 << 14
SIZES = {
    **dict.fromkeys(("vocab_size",), MAX_VOCAB),
    **dict.fromkeys(
        (
            "hidden_size",
            "intermediate_size",
            "head_dim",
            "d_model",
            "embed_dim",
            "encoder_ffn_dim",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "out_hidden_size",
        ),
        MAX_WIDTH,
    ),
    **dict.fromkeys(("linear_num_key_heads", "linear_num_value_heads"), MAX_HEADS),
    **dict.fromkeys(("linear_conv_kernel_dim",), 64),
    **dict.fromkeys(("num_experts_per_tok", "decoder_sparse_step"), MAX_EXPERTS),
    **dict.fromkeys(("num_hidden_layers", "depth", "encoder_layers"), MAX_LAYERS),
    **dict.fromkeys(
        ("num_attention_heads", "num_key_value_heads", "num_heads", "encoder_attention_heads"),
        MAX_HEADS,
    ),
    **dict.fromkeys(("patch_size", "num_mel_bins"), 1 << 12),
    **dict.fromkeys(("image_size", "max_source_positions", "num_position_embeddings"), 1 << 20),
    **dict.fromkeys(
        ("spatial_merge_size", "in_channels", "num_channels", "temporal_patch_size"), 64
    ),
}
SECTIONS = ("text_config", "vision_config", "audio_config")


def read_hf_config(directory: str | Path) -> dict:
    """A checkpoint directory's config.json, its sizes checked (`SIZES`).

    Raises:
      FamilyError: naming the directory when there is no readable config.json, or the file
        and the key of a size that is not a whole number within its bounds.
    """
    path = Path(directory) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except OSError:
        raise FamilyError(
            f"{directory}: no config.json (not a HuggingFace model directory)"
        ) from None
    except (ValueError, RecursionError) as e:
        raise FamilyError(f"{path}: not valid JSON ({e})"[:500]) from None
    if not isinstance(hf, dict):
        raise FamilyError(f"{path}: not a JSON object")
    for prefix, part in [("", hf)] + [(f"{k}.", hf[k]) for k in SECTIONS if k in hf]:
        if not isinstance(part, dict):
            raise FamilyError(f"{path}: {prefix[:-1]} must be an object")
        for key, most in SIZES.items():
            value = part.get(key)
            if value is not None and not (
                isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most
            ):
                raise FamilyError(
                    f"{path}: {prefix}{key} = {value!r:.40} must be a whole number from 1 to "
                    f"{most} (this checkpoint's config.json is damaged or not a model's)"
                )
    return hf


def section_of(role: str, hf: dict, where: str) -> dict:
    """Our config keys for `role` from a checked config.json (`read_hf_config`): the family's
    `section`, with any value it cannot read (a string for a number) a FamilyError."""
    family = family_for(role, hf, where)
    try:
        return family.section(hf)
    except FamilyError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:
        raise FamilyError(
            f"{where}: config.json has a value {family.name} cannot read ({type(e).__name__}: {e})"[
                :500
            ]
        ) from None


def family_for(role: str, hf: dict, where: str = "", names: Sequence[str] = ()) -> Family:
    """The family that reads `hf` (a config.json) for `role`; for a whole checkpoint, the
    `Part` of it that role reads (`names`: its tensor names, which say how the part nests and
    how its tensors are laid out: `Family.for_checkpoint`).

    Raises:
      FamilyError: naming the model_type and what jaxmllm reads for that role, or a tensor
        of a layout the family refuses.
    """
    model_type = hf.get("model_type", "")
    whole = whole_for(hf)
    if whole is not None:
        if role in whole.parts:
            return Part(whole, role, hf, names, where)
        raise FamilyError(
            f"{where or 'checkpoint'}: a {whole.name} checkpoint has no {role} part (it holds "
            f"{', '.join(whole.parts)})"
        )
    for family in FAMILIES:
        if family.role == role and model_type in family.model_types:
            return family.for_checkpoint(names, where)
    supported = sorted(t for f in FAMILIES if f.role == role for t in f.model_types)
    supported += sorted(t for w in WHOLES if role in w.parts for t in w.model_types)
    other = [f.role for f in FAMILIES if model_type in f.model_types]
    hint = f" (it is a {other[0]} model: pass it as --{other[0]})" if other else ""
    raise FamilyError(
        f"{where or 'checkpoint'}: model_type {model_type!r} is not a supported {role} "
        f"architecture{hint}; jaxmllm reads {', '.join(supported)} for the {role}"
    )


def roles_of(hf: dict) -> tuple[str, ...]:
    """The roles a checkpoint fills: a whole checkpoint's parts, or its family's role."""
    whole = whole_for(hf)
    if whole is not None:
        return tuple(r for r in ROLES if r in whole.parts)
    return tuple(f.role for f in FAMILIES if hf.get("model_type") in f.model_types)[:1]
