"""The values a checkpoint's config.json may hold, checked when it is read: each key jaxmllm
reads has a kind (a size, a real number in a range, a flag, a name, a list of layer indexes)
and a value of another kind, or out of its range, is refused naming the file and the key.

A damaged or hand-edited config.json otherwise ended in a traceback deep in the import, or
worse, imported with exit 0 as something else (`"tie_word_embeddings": "false"` is a true
string; a `rope_theta` of 0 puts every position at one angle).
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxmllm.hf.family import FamilyError

# Whole numbers from 1 to a bound: far above any real model, far below what would allocate or
# loop until the machine gives out (vocab_size 1e12, num_hidden_layers 1e9; heads 0 divides by
# zero).
MAX_VOCAB, MAX_WIDTH, MAX_LAYERS, MAX_HEADS = 1 << 24, 1 << 18, 1024, 4096
MAX_EXPERTS = 1 << 14
MAX_POSITIONS = 1 << 24
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
    **dict.fromkeys(("max_position_embeddings", "original_max_position_embeddings"), MAX_POSITIONS),
    **dict.fromkeys(("window_size",), 1 << 16),
    **dict.fromkeys(("pretraining_tp",), MAX_HEADS),
    **dict.fromkeys(("image_seq_length",), 1 << 20),
    **dict.fromkeys(("full_attention_interval", "sliding_window_pattern"), MAX_LAYERS),
}
# Whole numbers from 0, 0 being "none" as some families' files write it (Qwen2-MoE's
# `"sliding_window": 0` beside `"use_sliding_window": false`); a family whose layers read the
# value refuses 0 there (hf/gemma.py).
COUNTS = {"sliding_window": MAX_POSITIONS}
# Token ids a whole names for its placeholders: whole numbers from 0 within any vocabulary
TOKEN_IDS = (
    "image_token_index",
    "image_token_id",
    "video_token_id",
    "audio_token_index",
    "audio_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
)
# Real numbers: (lowest, highest, whether the lowest itself is allowed)
REALS = {
    "rope_theta": (0.0, 1e12, False),
    "rope_local_base_freq": (0.0, 1e12, False),
    "query_pre_attn_scalar": (0.0, 1e9, False),
    "rms_norm_eps": (0.0, 1.0, False),
    "layer_norm_eps": (0.0, 1.0, False),
    "partial_rotary_factor": (0.0, 1.0, False),
    "factor": (0.0, 1e6, False),
    "low_freq_factor": (0.0, 1e6, False),
    "high_freq_factor": (0.0, 1e6, False),
    "router_aux_loss_coef": (0.0, 1e6, True),
    "tokens_per_second": (0.0, 1e6, False),
    "mlp_ratio": (0.0, 1e3, False),
}
FLAGS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "mrope_interleaved",
    "norm_topk_prob",
    "multimodal_projector_bias",
)
NAMES = (
    "model_type",
    "hidden_act",
    "hidden_activation",
    "projector_hidden_act",
    "activation_function",
    "vision_feature_select_strategy",
    "rope_type",
    "type",
)
# Lists of layer indexes or section sizes (whole numbers from 0), with the length they must have
INDEXES = {
    "mrope_section": 3,
    "deepstack_visual_indexes": None,
    "fullatt_block_indexes": None,
    "mlp_only_layers": None,
}
# The sections whose keys are checked: a whole's parts, and the rotary settings in any of them
SECTIONS = ("text_config", "vision_config", "audio_config")
ROPE = ("rope_parameters", "rope_scaling")


def check_values(hf: dict, path: Path) -> None:
    """Refuses a value of config.json `hf` (read from `path`) of the wrong kind or out of its
    range, at the top, in a whole's part sections, and in their rotary settings.

    Raises:
      FamilyError: naming the file, the key (dotted from the top) and what it must be.
    """
    for prefix, part in _parts(hf, path):
        for key, value in part.items():
            if value is None:  # (transformers' "not set": the default applies)
                continue
            must = _rule(key, value)
            if must:
                raise FamilyError(
                    f"{path}: {prefix}{key} = {value!r:.60} must be {must} (this checkpoint's "
                    "config.json is damaged or not a model's)"
                )


def _parts(hf: dict, path: Path):
    """(dotted prefix, mapping) of every section whose keys are checked."""
    sections = [("", hf)] + [(f"{k}.", hf[k]) for k in SECTIONS if hf.get(k) is not None]
    for prefix, part in sections:
        if not isinstance(part, dict):
            raise FamilyError(f"{path}: {prefix[:-1]} must be an object")
        yield prefix, part
        for key in ROPE:
            rope = part.get(key)
            if rope is None:
                continue
            if not isinstance(rope, dict):
                raise FamilyError(f"{path}: {prefix}{key} must be an object")
            yield f"{prefix}{key}.", rope
            for layer_type, inner in rope.items():  # (per layer type: transformers 5)
                if isinstance(inner, dict):
                    yield f"{prefix}{key}.{layer_type}.", inner


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rule(key: str, value: object) -> str:
    """What `value` of `key` must be, or "" when it is that."""
    if key in SIZES:
        most = SIZES[key]
        return "" if _whole(value) and 1 <= value <= most else f"a whole number from 1 to {most}"
    if key in COUNTS:
        most = COUNTS[key]
        return "" if _whole(value) and 0 <= value <= most else f"a whole number from 0 to {most}"
    if key in TOKEN_IDS:
        ok = _whole(value) and 0 <= value < MAX_VOCAB
        return "" if ok else f"a token id, a whole number from 0 to {MAX_VOCAB - 1}"
    if key in REALS:
        low, high, closed = REALS[key]
        real = (_whole(value) or isinstance(value, float)) and math.isfinite(value)
        inside = real and (low <= value if closed else low < value) and value <= high
        return "" if inside else f"a number {'from' if closed else 'above'} {low:g} to {high:g}"
    if key == "use_bidirectional_attention":  # (Gemma 3's a flag, Gemma 4's all or vision)
        ok = isinstance(value, bool | str)
        return "" if ok else "true or false (Gemma 3), or all or vision (Gemma 4)"
    if key in FLAGS:
        return "" if isinstance(value, bool) else "true or false"
    if key in NAMES:
        return "" if isinstance(value, str) else "a name (a string)"
    if key in INDEXES:
        length = INDEXES[key]
        ok = isinstance(value, list) and all(_whole(x) and 0 <= x <= MAX_WIDTH for x in value)
        if ok and (length is None or len(value) == length):
            return ""
        return f"a list of {length or 'any number of'} whole numbers from 0"
    if key == "layer_types":
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
        return "" if ok else "a list of layer kinds (strings)"
    return ""
