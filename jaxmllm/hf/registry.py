"""Which family reads a HF checkpoint directory, by its config.json's model_type and the role
(llm, vision, audio) it is imported for: a checkpoint of one part (`FAMILIES`), or one part of a
whole multimodal checkpoint (`jaxmllm.hf.wholes.WHOLES`, read through `Part`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from jaxmllm.hf.audio import Qwen2AudioEncoder, WhisperEncoder
from jaxmllm.hf.decoders import Decoders
from jaxmllm.hf.family import Family, FamilyError
from jaxmllm.hf.qwen_vision import Qwen2VLVision, Qwen25VLVision
from jaxmllm.hf.vision import Clip, Siglip
from jaxmllm.hf.whole import Part
from jaxmllm.hf.wholes import WHOLES, whole_for

FAMILIES: tuple[Family, ...] = (
    Decoders("llama"),
    Decoders("qwen2"),
    Siglip(),
    Clip(),
    Qwen2VLVision(),
    Qwen25VLVision(),
    WhisperEncoder(),
    Qwen2AudioEncoder(),
)
ROLES = ("llm", "vision", "audio")


def read_hf_config(directory: str | Path) -> dict:
    """A checkpoint directory's config.json.

    Raises:
      FamilyError: naming the directory when there is no readable config.json.
    """
    path = Path(directory) / "config.json"
    try:
        return json.loads(path.read_text())
    except OSError:
        raise FamilyError(
            f"{directory}: no config.json (not a HuggingFace model directory)"
        ) from None
    except ValueError as e:
        raise FamilyError(f"{path}: not valid JSON ({e})") from None


def family_for(role: str, hf: dict, where: str = "", names: Sequence[str] = ()) -> Family:
    """The family that reads `hf` (a config.json) for `role`; for a whole checkpoint, the
    `Part` of it that role reads (`names`: its tensor names, which say how the part nests).

    Raises:
      FamilyError: naming the model_type and what jaxmllm reads for that role.
    """
    model_type = hf.get("model_type", "")
    whole = whole_for(hf)
    if whole is not None:
        if role in whole.parts:
            return Part(whole, role, hf, names)
        raise FamilyError(
            f"{where or 'checkpoint'}: a {whole.name} checkpoint has no {role} part (it holds "
            f"{', '.join(whole.parts)})"
        )
    for family in FAMILIES:
        if family.role == role and model_type in family.model_types:
            return family
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
