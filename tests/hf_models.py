"""Tiny random HuggingFace models built locally (no downloads) for the parity tests.

HF's default init leaves norms at 1 and biases at 0, which would hide a wrong mapping of either:
every parameter here is drawn at random (weights ~ N(0, 0.1^2)-ish, norm scales around 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def randomize(model, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if (
                name.endswith("norm.weight")
                or "layernorm" in name
                or "layer_norm" in name
                or ("norm" in name.split(".")[-2] and name.endswith("weight"))
            ):
                p.copy_(1.0 + 0.2 * noise)
            elif p.ndim == 1:
                p.copy_(0.2 * noise)
            else:
                fan_in = max(int(p[0].numel()), 1)
                p.copy_(noise * (1.5 / fan_in**0.5))
    return model.eval()


def save(model, directory: Path) -> str:
    model.save_pretrained(directory)
    return str(directory)


def llama(
    directory: Path, *, tied: bool, scaling: bool = True, seed: int = 0, vocab: int = 300
) -> str:
    import transformers as T

    rope = (
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 5000.0,
        }
        if scaling
        else {"rope_type": "default", "rope_theta": 5000.0}
    )
    cfg = T.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        tie_word_embeddings=tied,
        max_position_embeddings=256,
    )
    return save(randomize(T.LlamaForCausalLM(cfg), seed), directory)


def qwen2(directory: Path, *, tied: bool, seed: int = 0, vocab: int = 300) -> str:
    import transformers as T

    cfg = T.Qwen2Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=tied,
    )
    return save(randomize(T.Qwen2ForCausalLM(cfg), seed), directory)


def qwen3(
    directory: Path, *, tied: bool = False, seed: int = 0, vocab: int = 300, bias: bool = False
) -> str:
    """A Qwen3 decoder: QK-norm, a head_dim (24) other than width / heads (64 / 4)."""
    import transformers as T

    cfg = T.Qwen3Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        attention_bias=bias,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=tied,
    )
    return save(randomize(T.Qwen3ForCausalLM(cfg), seed), directory)


def gemma3_text(
    directory: Path,
    *,
    layers: tuple[str, ...] = ("sliding", "sliding", "full", "sliding", "sliding"),
    window: int = 5,
    tied: bool = True,
    heads: tuple[int, int] = (4, 2),
    scalar: int = 40,
    scaling: float = 0.0,
    bias: bool = False,
    seed: int = 0,
    vocab: int = 300,
) -> str:
    """A Gemma 3 text decoder: `layers` sliding or full, a `window` shorter than the check's
    texts, a head_dim (24) other than width / heads (64 / 4), query_pre_attn_scalar `scalar`
    (not head_dim), the two rotary bases, linear rope scaling of the full layers by `scaling`
    (0: none)."""
    import transformers as T

    full = {"rope_type": "default", "rope_theta": 1e6}
    if scaling:
        full = {"rope_type": "linear", "factor": scaling, "rope_theta": 1e6}
    cfg = T.Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(layers),
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        head_dim=24,
        query_pre_attn_scalar=scalar,
        attention_bias=bias,
        rms_norm_eps=1e-6,
        sliding_window=window,
        layer_types=[f"{kind}_attention" for kind in layers],
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        tie_word_embeddings=tied,
        max_position_embeddings=256,
    )
    return save(randomize(T.Gemma3ForCausalLM(cfg), seed), directory)


def gemma4_text(
    directory: Path,
    *,
    layers: tuple[str, ...] = ("sliding", "sliding", "full", "sliding", "full"),
    window: int = 5,
    tied: bool = True,
    k_eq_v: bool = False,
    softcap: float | None = 30.0,
    bias: bool = False,
    experts: int = 0,
    top_k: int = 2,
    per_layer: int = 0,
    shared: int = 0,
    wide: bool = False,
    seed: int = 0,
    vocab: int = 300,
) -> str:
    """A Gemma 4 text decoder: `layers` sliding or full, a `window` shorter than the check's
    texts, the sliding layers' head_dim (24) other than width / heads (64 / 4) and the full
    layers' own (global_head_dim 32), proportional rotary on a quarter of the full layers'
    frequencies, logits soft-capped at `softcap`; with `k_eq_v`, the full layers' values are
    their keys' (and one kv head of their own); with `experts`, the MoE block in every layer
    (`top_k` of them a token, 32 wide; `moe_experts`); `per_layer`: per-layer inputs this wide (a
    table of vocab + 20 rows, its pad id 3; 0: none); `shared`: the last layers reusing keys
    and values, their MLPs twice as wide with `wide`."""
    import transformers as T

    moe = {}
    if experts:
        moe = dict(
            enable_moe_block=True,
            num_experts=experts,
            top_k_experts=top_k,
            moe_intermediate_size=32,
        )

    cfg = T.Gemma4TextConfig(
        **gemma4_text_config(vocab, layers, window, per_layer, shared),
        num_global_key_value_heads=1,
        attention_k_eq_v=k_eq_v,
        attention_bias=bias,
        use_double_wide_mlp=wide,
        final_logit_softcapping=softcap,
        tie_word_embeddings=tied,
        **moe,
    )
    model = randomize(T.Gemma4ForCausalLM(cfg), seed)
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # (a buffer: randomize draws parameters only)
        for layer in model.model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
            if experts:
                moe_experts(layer, gen)
    return save(model, directory)


def gemma4_text_config(
    vocab: int, layers: tuple[str, ...], window: int, per_layer: int, shared: int
) -> dict:
    """The tiny Gemma 4 text decoder's config.json keys `gemma4_text` and `gemma4` share:
    width 64, 4 heads of 24 (the full layers' 32), `layers` sliding or full under a `window`,
    proportional rotary on a quarter of the full layers' frequencies; `per_layer`: per-layer
    inputs this wide (a table of vocab + 20 rows, its pad id 3; 0: none); `shared`: the last
    layers reusing keys and values."""
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(layers),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        global_head_dim=32,
        rms_norm_eps=1e-6,
        sliding_window=window,
        layer_types=[f"{kind}_attention" for kind in layers],
        rope_parameters={
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1e6,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=vocab + 20,
        pad_token_id=3 if per_layer else 0,
        num_kv_shared_layers=shared,
        max_position_embeddings=256,
    )


def moe_experts(layer, gen) -> None:
    """Gemma 4's router and experts drawn as a trained layer's might be: the experts at their
    own fan-in (`randomize` takes a stacked tensor's [2f, width] as one), the router's scales
    around 1 and its logits spread over a few units, so each token's top-k is clear-cut (no
    near-tie that float rounding could flip) and the experts' weights differ."""
    import torch

    draw = lambda p: torch.randn(p.shape, generator=gen, dtype=torch.float32)  # noqa: E731
    ex, router = layer.experts, layer.router
    ex.gate_up_proj.copy_(draw(ex.gate_up_proj) * 1.5 / ex.gate_up_proj.shape[-1] ** 0.5)
    ex.down_proj.copy_(draw(ex.down_proj) * 1.5 / ex.down_proj.shape[-1] ** 0.5)
    router.proj.weight.copy_(draw(router.proj.weight) * 2.0)
    router.scale.copy_(1.0 + 0.2 * draw(router.scale))
    router.per_expert_scale.copy_(1.0 + 0.3 * draw(router.per_expert_scale))


def gemma3(
    directory: Path,
    *,
    seed: int = 0,
    vocab: int = 300,
    ids: tuple[int, int, int] = (297, 298, 299),
    tokens: int = 9,
    window: int = 5,
) -> str:
    """A whole Gemma 3: its text decoder (a sliding, a full and a sliding layer, a `window`
    shorter than an image's run of tokens), a SigLIP tower of 6x6 patches read to its final
    norm, its projector pooling them to `tokens` (a square: 9, windows of 2x2 patches).
    `ids`: the begin-of-image, end-of-image and image token ids."""
    import transformers as T

    text = dict(
        model_type="gemma3_text",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        query_pre_attn_scalar=40,
        rms_norm_eps=1e-6,
        sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        max_position_embeddings=256,
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=24,
        patch_size=4,
        layer_norm_eps=1e-6,
        vision_use_head=False,
    )
    boi, eoi, image = ids
    cfg = T.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
    )
    return save(randomize(T.Gemma3ForConditionalGeneration(cfg), seed), directory)


def gemma4(
    directory: Path,
    *,
    seed: int = 0,
    vocab: int = 300,
    ids: tuple[int, int, int] = (297, 298, 299),
    window: int = 4,
    standardize: bool = True,
    patch: int = 4,
    pool: int = 2,
    per_layer: int = 0,
    shared: int = 0,
    audio: tuple[int, int, int] | None = None,
    clipped: bool = False,
) -> str:
    """A whole Gemma 4: its text decoder (sliding, full, sliding, full layers, a `window`
    shorter than an image's run of tokens, images read both ways in the sliding layers), its
    vision tower (patches of `patch` pixels, `pool` x `pool` of them a soft token, axial
    tables of 16 rows,
    head_dim 8, standardised soft tokens) and embed_vision. `per_layer`: per-layer
    inputs this wide (a table of vocab + 20 rows, the pad id 3, whose row an image's soft
    tokens read; 0: none); `shared`: the last layers reusing keys. `ids`: the
    begin-of-image, end-of-image and image token ids. `audio`: the begin-of-audio,
    end-of-audio and audio token ids of an audio conformer (`gemma4_audio`'s, its bounds
    finite) and embed_audio (none: audio_config null). `clipped`: the tower's linears clipped,
    each's bounds drawn finite (they bite) but the MLP's down projection's (±inf)."""
    import torch
    import transformers as T

    layers = ("sliding", "full", "sliding", "full")
    text = dict(
        model_type="gemma4_text",
        **gemma4_text_config(vocab, layers, window, per_layer, shared),
        final_logit_softcapping=30.0,
        use_bidirectional_attention="vision",
    )
    vision = dict(
        model_type="gemma4_vision",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        patch_size=patch,
        pooling_kernel_size=pool,
        position_embedding_size=16,
        rope_parameters={"rope_type": "axial", "rope_theta": 100.0},
        standardize=standardize,
        rms_norm_eps=1e-6,
        use_clipped_linears=clipped,
    )
    boi, eoi, image = ids
    boa, eoa, clip = audio or (None, None, image)
    cfg = T.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=_gemma4_audio_config() if audio else None,
        boi_token_id=boi,
        eoi_token_id=eoi,
        image_token_id=image,
        video_token_id=image,
        audio_token_id=clip,
        boa_token_id=boa,
        eoa_token_index=eoa,
    )
    model = randomize(T.Gemma4ForConditionalGeneration(cfg), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # (buffers: randomize draws parameters only)
        for layer in model.model.language_model.layers:
            layer.layer_scalar.copy_(0.5 + torch.rand(1, generator=gen))
        tower = model.model.vision_tower
        if standardize:
            tower.std_bias.copy_(0.3 * torch.randn(32, generator=gen))
            tower.std_scale.copy_(0.5 + torch.rand(32, generator=gen))
    if audio:
        _bound(model.model.audio_tower, gen)
    if clipped:
        _bound(model.model.vision_tower, gen, unbounded="down_proj")
    return save(model, directory)


def siglip(directory: Path, seed: int = 0, head: bool = False) -> str:
    import transformers as T

    cfg = T.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=24,
        patch_size=4,
        vision_use_head=head,
    )
    return save(randomize(T.SiglipVisionModel(cfg), seed), directory)


def qwen2_vl_vision(directory: Path, seed: int = 0, out: int = 64) -> str:
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    cfg = Qwen2VLVisionConfig(
        depth=2,
        embed_dim=32,
        hidden_size=out,
        num_heads=4,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    return save(randomize(Qwen2VisionTransformerPretrainedModel(cfg), seed), directory)


def whisper(directory: Path, seed: int = 0) -> str:
    import transformers as T

    cfg = T.WhisperConfig(
        d_model=32,
        encoder_layers=2,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=32,
        vocab_size=100,
        max_target_positions=16,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=3,
        decoder_start_token_id=2,
        begin_suppress_tokens=None,
        suppress_tokens=None,
    )
    return save(randomize(T.WhisperForConditionalGeneration(cfg), seed), directory)


def qwen2_vl(
    directory: Path, seed: int = 0, tied: bool = False, vocab: int = 300, ids=(290, 291, 292, 293)
) -> str:
    """A whole Qwen2-VL (its Qwen2 LLM with M-RoPE, its vision tower and merger); `ids`: its
    image, video, vision start and vision end token ids."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]},
            bos_token_id=None,
            eos_token_id=None,
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=4,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=ids[0],
        video_token_id=ids[1],
        vision_start_token_id=ids[2],
        vision_end_token_id=ids[3],
        tie_word_embeddings=tied,
    )
    return save(randomize(Qwen2VLForConditionalGeneration(cfg), seed), directory)


def clip(directory: Path, seed: int = 0) -> str:
    import transformers as T

    cfg = T.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=24,
        patch_size=4,
    )
    return save(randomize(T.CLIPVisionModel(cfg), seed), directory)


QWEN25_VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=16,
    fullatt_block_indexes=[1, 3],
)


def qwen2_5_vl_vision(directory: Path, seed: int = 0, out: int = 64) -> str:
    """Windows of 16 pixels: 4 x 4 patches (2 x 2 merged tokens); blocks 1 and 3 full."""
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        Qwen2_5_VisionTransformerPretrainedModel,
    )

    cfg = Qwen2_5_VLVisionConfig(out_hidden_size=out, **QWEN25_VISION)
    return save(randomize(Qwen2_5_VisionTransformerPretrainedModel(cfg), seed), directory)


AUDIO = dict(
    d_model=32,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    num_mel_bins=16,
    max_source_positions=32,
)


def qwen2_audio_encoder(directory: Path, seed: int = 0) -> str:
    from transformers.models.qwen2_audio.configuration_qwen2_audio import (
        Qwen2AudioEncoderConfig,
    )
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    return save(randomize(Qwen2AudioEncoder(Qwen2AudioEncoderConfig(**AUDIO)), seed), directory)


def gemma4_audio(directory: Path, seed: int = 0, right: int = 2, clipped: bool = True) -> str:
    """Gemma 4's audio encoder: 16 mel bins (channels 16 and 8), chunks of 4 rows, each query
    seeing 4 rows before it and `right` - 1 after it, a logit cap of 5 (it bites), an RMS
    epsilon of 0.05 (the norms that read it differ from the fixed 1e-6 ones), and each clipped
    linear's bounds drawn finite (they bite too), but the light convolution's last (±inf)."""
    import torch
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel

    model = randomize(Gemma4AudioModel(_gemma4_audio_config(right, clipped)), seed)
    _bound(model, torch.Generator().manual_seed(seed + 1))
    return save(model, directory)


def _gemma4_audio_config(right: int = 2, clipped: bool = True):
    """`gemma4_audio`'s config."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig

    return Gemma4AudioConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        subsampling_conv_channels=[16, 8],
        conv_kernel_size=5,
        attention_chunk_size=4,
        attention_context_left=6,
        attention_context_right=right,
        attention_logit_cap=5.0,
        rms_norm_eps=0.05,
        use_clipped_linears=clipped,
        output_proj_dims=24,
    )


def _bound(model, gen, unbounded: str = "linear_end") -> None:
    """Each clipped linear's bounds of a Gemma 4 tower drawn finite, but those of the linears
    named `unbounded` (left ±inf; the conformer's: the light convolution's last)."""
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if unbounded in name:  # (left unbounded, ±inf: no clamp)
                continue
            if name.rsplit(".", 1)[-1] in ("input_min", "output_min"):
                buf.copy_(-1.0 - 2.0 * torch.rand((), generator=gen))
            elif name.rsplit(".", 1)[-1] in ("input_max", "output_max"):
                buf.copy_(1.0 + 2.0 * torch.rand((), generator=gen))


def _text(kind: str, vocab: int, mrope: bool = False) -> dict:
    rope = {"rope_type": "default", "rope_theta": 1e6 if kind == "qwen2" else 5000.0}
    if mrope:
        rope["mrope_section"] = [2, 3, 3]
    return dict(
        model_type=kind,
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def llava(
    directory: Path,
    tower: str = "clip",
    text: str = "llama",
    seed: int = 0,
    vocab: int = 300,
    image: int = 299,
    tied: bool = False,
) -> str:
    """A whole LLaVA: a CLIP tower read at its second-to-last block with the class token
    dropped (LLaVA-1.5's), or a SigLIP tower read at its last block, all patches; its projector;
    a Llama or Qwen2 LLM. `image`: the image token id."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=24,
        patch_size=4,
    )
    if tower == "clip":
        vision["model_type"], layer, strategy = "clip_vision_model", -2, "default"
    else:
        vision["model_type"], layer, strategy = "siglip_vision_model", -1, "full"
    text_cfg = _text(text, vocab)
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text_cfg,
        image_token_id=image,
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        image_seq_length=36,
        tie_word_embeddings=tied,
    )
    return save(randomize(LlavaForConditionalGeneration(cfg), seed), directory)


def qwen2_5_vl(
    directory: Path, seed: int = 0, tied: bool = False, vocab: int = 300, ids=(290, 291, 292, 293)
) -> str:
    """A whole Qwen2.5-VL (windowed tower as `qwen2_5_vl_vision`); `ids` as `qwen2_vl`'s."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    text = _text("qwen2", vocab, mrope=True)
    text.pop("model_type")
    cfg = Qwen2_5_VLConfig(
        text_config=text,
        vision_config=dict(out_hidden_size=64, **QWEN25_VISION),
        image_token_id=ids[0],
        video_token_id=ids[1],
        vision_start_token_id=ids[2],
        vision_end_token_id=ids[3],
        tie_word_embeddings=tied,
    )
    return save(randomize(Qwen2_5_VLForConditionalGeneration(cfg), seed), directory)


def qwen2_audio(directory: Path, seed: int = 0, vocab: int = 300, audio: int = 299) -> str:
    """A whole Qwen2-Audio: its encoder (32-row table: clips up to 64 frames), the Linear
    projector, a Qwen2 LLM; `audio`: the audio token id."""
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    cfg = Qwen2AudioConfig(
        audio_config=dict(model_type="qwen2_audio_encoder", **AUDIO),
        text_config=_text("qwen2", vocab),
        audio_token_id=audio,
    )
    return save(randomize(Qwen2AudioForConditionalGeneration(cfg), seed), directory)


def qwen3_moe(
    directory: Path,
    *,
    seed: int = 0,
    vocab: int = 300,
    experts: int = 8,
    top_k: int = 2,
    norm_topk: bool = True,
    dense_layers: tuple[int, ...] = (),
    sparse_step: int = 1,
    layers: int = 3,
    heads: tuple[int, int] = (4, 2),
    tied: bool = False,
) -> str:
    """A Qwen3-MoE decoder (QK-norm, head_dim 24 of width 64), `dense_layers` among its MoE
    ones; the router drawn at random too, so tokens spread over the experts."""
    import transformers as T

    cfg = T.Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        head_dim=24,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk,
        mlp_only_layers=list(dense_layers),
        decoder_sparse_step=sparse_step,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=tied,
        router_aux_loss_coef=0.01,
    )
    return save(randomize(T.Qwen3MoeForCausalLM(cfg), seed), directory)


def qwen2_moe(directory: Path, *, seed: int = 0, vocab: int = 300, qkv_bias: bool = True) -> str:
    """A Qwen2-MoE decoder: q/k/v biases, a shared expert with its sigmoid gate, top-k
    probabilities not renormalised, a dense layer every second (decoder_sparse_step 2)."""
    import transformers as T

    cfg = T.Qwen2MoeConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        qkv_bias=qkv_bias,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    return save(randomize(T.Qwen2MoeForCausalLM(cfg), seed), directory)


def _qwen3_5_text(
    vocab: int,
    layers: tuple[str, ...],
    heads: tuple[int, int],
    linear_heads: tuple[int, int],
    conv: int,
    key_dim: int,
    head_dim: int,
    rope: dict,
    experts: int,
) -> dict:
    """A tiny Qwen3.5 text config's keys (`qwen3_5`'s arguments; `rope`: rope_parameters)."""
    out = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=len(layers),
        num_attention_heads=heads[0],
        num_key_value_heads=heads[1],
        head_dim=head_dim,
        layer_types=[f"{kind}_attention" for kind in layers],
        linear_num_key_heads=linear_heads[0],
        linear_num_value_heads=linear_heads[1],
        linear_key_head_dim=key_dim,
        linear_value_head_dim=12,
        linear_conv_kernel_dim=conv,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, **rope},
    )
    if experts:
        out.update(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=experts,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.01,
        )
    else:
        out["intermediate_size"] = 96
    return out


def qwen3_5(
    directory: Path,
    *,
    seed: int = 0,
    vocab: int = 300,
    layers: tuple[str, ...] = ("linear", "linear", "linear", "full"),
    heads: tuple[int, int] = (4, 2),
    linear_heads: tuple[int, int] = (2, 4),
    conv: int = 4,
    key_dim: int = 32,
    partial: float = 0.25,
    tied: bool = False,
    experts: int = 0,
) -> str:
    """A Qwen3.5 hybrid decoder: Gated DeltaNet layers (`linear_heads`: key and value heads)
    among full-attention ones (`layers`, in order), head_dim 16 of width 64, rotary on
    `partial` of each head; with `experts`, Qwen3.5-MoE (top-2, a shared expert)."""
    import transformers as T

    rope = {"partial_rotary_factor": partial}
    text = _qwen3_5_text(vocab, layers, heads, linear_heads, conv, key_dim, 16, rope, experts)
    if experts:
        cfg = T.Qwen3_5MoeTextConfig(tie_word_embeddings=tied, **text)
        return save(randomize(T.Qwen3_5MoeForCausalLM(cfg), seed), directory)
    cfg = T.Qwen3_5TextConfig(tie_word_embeddings=tied, **text)
    return save(randomize(T.Qwen3_5ForCausalLM(cfg), seed), directory)


def qwen3_5_whole(
    directory: Path,
    *,
    seed: int = 0,
    vocab: int = 300,
    ids=(290, 291, 292, 293),
    layers: tuple[str, ...] = ("linear", "full", "linear", "full"),
    linear_heads: tuple[int, int] = (2, 4),
    sections=(2, 2, 2),
    tied: bool = False,
    experts: int = 0,
) -> str:
    """A whole, natively multimodal Qwen3.5 (`experts`: Qwen3.5-MoE): `qwen3_5`'s hybrid
    decoder with interleaved M-RoPE of `sections` on a quarter of each head (head_dim 48: 12
    rotary dims, 6 frequencies), Qwen3-VL's tower without DeepStack; `ids` as `qwen2_vl`'s."""
    import transformers as T

    rope = {"partial_rotary_factor": 0.25, "mrope_section": list(sections)}
    rope["mrope_interleaved"] = True
    text = _qwen3_5_text(vocab, layers, (4, 2), linear_heads, 4, 32, 48, rope, experts)
    vision = dict(out_hidden_size=64, **QWEN3_VL_VISION)
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    parts = dict(text_config=text, vision_config=vision, **dict(zip(keys, ids, strict=True)))
    config, model = (
        (T.Qwen3_5MoeConfig, T.Qwen3_5MoeForConditionalGeneration)
        if experts
        else (T.Qwen3_5Config, T.Qwen3_5ForConditionalGeneration)
    )
    cfg = config(tie_word_embeddings=tied, **parts)
    return save(randomize(model(cfg), seed), directory)


QWEN3_VL_VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=4,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=36,
)


def _qwen3_vl_parts(vocab: int, layers: int, sections, deepstack, ids) -> dict:
    """A tiny Qwen3-VL's config keys: its Qwen3 text config (QK-norm, head_dim 24 of width
    64, interleaved M-RoPE of `sections`), its tower's (DeepStack from blocks `deepstack`),
    its placeholder ids (image, video, vision start, vision end)."""
    text = _text("qwen3", vocab)
    text.pop("model_type")
    text.update(
        num_hidden_layers=layers,
        head_dim=24,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": list(sections),
            "mrope_interleaved": True,
        },
    )
    vision = dict(out_hidden_size=64, deepstack_visual_indexes=list(deepstack), **QWEN3_VL_VISION)
    keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return dict(text_config=text, vision_config=vision, **dict(zip(keys, ids, strict=True)))


def qwen3_vl(
    directory: Path,
    seed: int = 0,
    tied: bool = False,
    vocab: int = 300,
    ids=(290, 291, 292, 293),
    deepstack=(0, 2),
    layers: int = 3,
    sections=(4, 4, 4),
) -> str:
    """A whole Qwen3-VL: its Qwen3 LLM with interleaved M-RoPE, its tower (a 6 x 6 learned
    table resized bilinearly, 2D rotary) with DeepStack from blocks `deepstack` into the LLM's
    first layers (`_qwen3_vl_parts`); `ids` as `qwen2_vl`'s."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    parts = _qwen3_vl_parts(vocab, layers, sections, deepstack, ids)
    cfg = Qwen3VLConfig(tie_word_embeddings=tied, **parts)
    return save(randomize(Qwen3VLForConditionalGeneration(cfg), seed), directory)


def qwen3_vl_moe(
    directory: Path,
    seed: int = 0,
    vocab: int = 300,
    ids=(290, 291, 292, 293),
    deepstack=(0, 2),
    layers: int = 3,
    experts: int = 8,
    top_k: int = 2,
    dense_layers: tuple[int, ...] = (),
    sparse_step: int = 1,
    tied: bool = False,
    moe_dim: int = 32,
) -> str:
    """A whole Qwen3-VL-MoE: `qwen3_vl`'s tower and LLM with its MLPs mixtures of `experts`
    of width `moe_dim` (top `top_k`, always renormalised), `dense_layers` among them; the
    router drawn at random too, so tokens spread over the experts."""
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    parts = _qwen3_vl_parts(vocab, layers, (4, 4, 4), deepstack, ids)
    parts["text_config"].update(
        moe_intermediate_size=moe_dim,
        num_experts=experts,
        num_experts_per_tok=top_k,
        mlp_only_layers=list(dense_layers),
        decoder_sparse_step=sparse_step,
        router_aux_loss_coef=0.01,
    )
    cfg = Qwen3VLMoeConfig(tie_word_embeddings=tied, **parts)
    return save(randomize(Qwen3VLMoeForConditionalGeneration(cfg), seed), directory)


def qwen3_vl_vision(directory: Path, seed: int = 0, out: int = 64) -> str:
    """Qwen3-VL's tower alone (its merger and DeepStack's from block 1)."""
    from transformers import Qwen3VLVisionModel
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    cfg = Qwen3VLVisionConfig(out_hidden_size=out, deepstack_visual_indexes=[1], **QWEN3_VL_VISION)
    return save(randomize(Qwen3VLVisionModel(cfg), seed), directory)


def fused_experts(source: str, directory: Path) -> str:
    """A copy of the MoE checkpoint `source` (one Linear per expert, as save_pretrained writes)
    with each layer's routed experts fused as transformers 5 holds them and Qwen's Qwen3.5-MoE
    files store them: `mlp.experts.gate_up_proj` [E, 2f, width] (each expert's gate rows, then
    its up rows) and `mlp.experts.down_proj` [E, width, f]."""
    import re
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    directory.mkdir(parents=True)
    one = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")
    for path in Path(source).iterdir():
        if path.suffix != ".safetensors":
            shutil.copy2(path, directory / path.name)
            continue
        tensors, experts = {}, {}
        for name, x in load_file(path).items():
            m = one.fullmatch(name)
            if m:
                experts.setdefault(m[1], {})[(int(m[2]), m[3])] = x
            else:
                tensors[name] = x
        for layer, parts in experts.items():
            n = 1 + max(j for j, _ in parts)
            gate_up = [np.concatenate([parts[j, "gate"], parts[j, "up"]]) for j in range(n)]
            tensors[layer + "gate_up_proj"] = np.stack(gate_up)
            tensors[layer + "down_proj"] = np.stack([parts[j, "down"] for j in range(n)])
        save_file(tensors, directory / path.name, metadata={"format": "pt"})
    return str(directory)


def assert_bit_identical(source: str | Path, out: str | Path) -> None:
    """`out`'s safetensors hold `source`'s tensors, the same names, bit for bit."""
    from jaxmllm.hf.safetensors import Checkpoint

    before, after = Checkpoint(source), Checkpoint(out)
    assert set(after.names()) == set(before.names())
    for n in after.names():
        assert np.array_equal(before.get(n).view(np.uint8), after.get(n).view(np.uint8)), n
