"""Generation from HuggingFace checkpoints (`python -m jaxmllm.generate --hf DIR`), held to
transformers' own greedy `generate` on tiny random models built here (tests/hf_models.py) with
a tokenizer directory beside them (test_chat.build_dir): the same prompt ids, then the same new
ids; for Qwen2-VL with an image in the prompt (M-RoPE's positions in prefill and decode).
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_models
import numpy as np
import pytest
from test_chat import build_dir, hf, hf_ids

from jaxmllm.batch.prompts import PromptShapes
from jaxmllm.config.spec import Inputs
from jaxmllm.data.media.image import patchify
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.template import make_template
from jaxmllm.generate import load_hf, main, parse_args, request_prompts
from jaxmllm.step.generate import Generator

VOCAB = 512  # the tokenizer's ~420 ids fit: nothing grows, the two models have the same rows


def hf_greedy(model, ids, new: int, stop, **inputs) -> list[int]:
    """transformers' greedy continuation of `ids` (at most `new` ids, ending at a stop id)."""
    import torch

    prompt = torch.tensor([list(ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=sorted(stop),
            pad_token_id=sorted(stop)[0],
            **inputs,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.torch
def test_greedy_llama_matches_transformers_for_32_tokens(tmp_path):
    """Llama (llama3 rope scaling, tied): a plain prompt is the tokenizer's ids (its BOS, then
    the text), and the 32 greedy ids are transformers'."""
    from transformers import LlamaForCausalLM

    src = hf_models.llama(tmp_path / "llama", tied=True, vocab=VOCAB)
    build_dir(Path(src), "llama", "meta-llama/Llama-3.1-8B-Instruct")
    text = "The quick brown fox jumps over the lazy dog."
    args = parse_args(
        ["--hf", src, "--template", "plain", "--prompt", text, "--max-new-tokens", "32"]
    )
    cfg, params = load_hf(args)
    template = make_template(cfg, args.template, pretrained=True)
    (prompt,) = request_prompts(template, args)
    assert prompt.tokens.tolist() == hf(Path(src))(text)["input_ids"]
    stop = template.specials.stop
    gen = Generator(cfg, PromptShapes.fit([prompt], cfg, 32), template.specials)
    (ours,) = gen.generate(
        params["params"], params["frozen"], [prompt], max_new_tokens=32, stop_ids=frozenset(stop)
    )
    theirs = hf_greedy(LlamaForCausalLM.from_pretrained(src).eval(), prompt.tokens, 32, stop)
    assert len(ours.ids) == 32 and ours.ids == theirs


@pytest.mark.torch
def test_greedy_qwen2_chat_from_the_command_line_matches_transformers(tmp_path, capsys):
    """Qwen2 (untied): `--prompt` is rendered by the directory's chat template with its
    generation prompt (apply_chat_template's ids) and --json prints transformers' greedy ids
    and their text."""
    from transformers import Qwen2ForCausalLM

    src = hf_models.qwen2(tmp_path / "qwen2", tied=False, vocab=VOCAB)
    build_dir(Path(src), "qwen", "Qwen/Qwen2.5-7B-Instruct")
    question = "What is in this picture?"
    want = hf_ids(Path(src), [{"role": "user", "content": question}], add_generation_prompt=True)
    assert main(["--hf", src, "--prompt", question, "--max-new-tokens", "32", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    tk = hf(Path(src))
    stop = {tk.convert_tokens_to_ids("<|im_end|>"), tk.convert_tokens_to_ids("<|endoftext|>")}
    theirs = hf_greedy(Qwen2ForCausalLM.from_pretrained(src).eval(), want, 32, stop)
    assert len(theirs) == 32 and answer["ids"] == theirs
    assert answer["text"] == tk.decode(theirs, skip_special_tokens=False).replace("<|im_end|>", "")


DECODERS = {  # (Qwen3.5-MoE's decoding: the image test's qwen3_5_moe, the same decoder)
    "qwen3": hf_models.qwen3,
    "qwen3_moe": lambda d, vocab: hf_models.qwen3_moe(d, vocab=vocab, dense_layers=(1,)),
    "qwen3_5": hf_models.qwen3_5,
    # (windows of 5 tokens; the prompt ~20, 24 new ids: seed 0's stop after 9, ids equal too)
    "gemma3_text": lambda d, vocab: hf_models.gemma3_text(d, vocab=vocab, seed=1),
    # (the full layers' own head width and kv heads, their values their keys', soft cap)
    "gemma4_text": lambda d, vocab: hf_models.gemma4_text(d, vocab=vocab, k_eq_v=True),
    # (per-layer inputs; layers 3 and 4 read the caches of 1, a ring of the window, and 2)
    "gemma4_text-ple-shared": lambda d, vocab: hf_models.gemma4_text(
        d, vocab=vocab, per_layer=8, shared=2, wide=True
    ),
}


# (Gemma 4's MoE block decodes through the MLP branch training runs, held by test_hf_gemma4's
# packed check; decoding through experts with a KV cache, by qwen3_moe's case)
@pytest.mark.torch
@pytest.mark.parametrize("name", list(DECODERS))
def test_greedy_decoders_with_their_own_caches_match_transformers(name, tmp_path, capsys):
    """Qwen3 (QK-norm), Qwen3-MoE (a dense layer among its MoE ones, the KV cache of each
    stack), Qwen3.5 (its linear layers' cached convolution window and state: the prompt by
    the chunked rule, each new token by the rule for one), Gemma 3's text decoder (its
    sliding layers' cache a ring of the window's length, filled from the prompt's last tokens)
    and Gemma 4's (its shared layers reading their source layers' caches, per-layer inputs of
    each new token): the chat-rendered prompt's greedy ids (24, or up to a stop id past 16) are
    transformers'."""
    import transformers

    src = DECODERS[name](tmp_path / name, vocab=VOCAB)
    build_dir(Path(src), "qwen", "Qwen/Qwen2.5-7B-Instruct")
    question = "Which colour is the sky?"
    want = hf_ids(Path(src), [{"role": "user", "content": question}], add_generation_prompt=True)
    assert main(["--hf", src, "--prompt", question, "--max-new-tokens", "24", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    tk = hf(Path(src))
    stop = {tk.convert_tokens_to_ids("<|im_end|>"), tk.convert_tokens_to_ids("<|endoftext|>")}
    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    theirs = hf_greedy(model, want, 24, stop)
    assert answer["ids"] == theirs, (answer["ids"], theirs)
    assert len(theirs) >= 16  # (or fewer, ending at a stop id)


@pytest.mark.torch
def test_logprobs_and_logits_are_transformers_scores(tmp_path, capsys):
    """`--json --logprobs 3 --logits F.npz`: each new id's log-probability, the 3 likeliest
    ids' and the saved logits of every step are transformers' greedy scores (its
    `output_scores`) within 1e-4."""
    import torch
    from transformers import Qwen2ForCausalLM

    src = hf_models.qwen2(tmp_path / "qwen2", tied=False, vocab=VOCAB)
    build_dir(Path(src), "qwen", "Qwen/Qwen2.5-7B-Instruct")
    saved = tmp_path / "logits.npz"
    argv = ["--hf", src, "--prompt", "Hello", "--max-new-tokens", "6", "--json"]
    assert main([*argv, "--logprobs", "3", "--logits", str(saved)]) == 0
    answer = json.loads(capsys.readouterr().out)
    want = hf_ids(Path(src), [{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    model = Qwen2ForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([want]),
            max_new_tokens=len(answer["ids"]),
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
    scores = torch.stack(out.scores)[:, 0].double()
    theirs = torch.log_softmax(scores, -1).numpy()
    ids = answer["ids"]
    assert ids == out.sequences[0, len(want) :].tolist()
    np.testing.assert_allclose(answer["logprobs"], theirs[np.arange(len(ids)), ids], atol=1e-4)
    for step, best in enumerate(answer["top_logprobs"]):
        assert list(map(int, best)) == np.argsort(-theirs[step])[:3].tolist()
    np.testing.assert_allclose(np.load(saved)["answer_0"], scores.numpy(), atol=1e-4)
    with pytest.raises(SystemExit) as refused:  # (it goes with --json)
        parse_args([*argv[:-1], "--logprobs", "3"])
    assert refused.value.code == 2


@pytest.mark.torch
def test_hf_generation_refuses_what_it_cannot_read(tmp_path, capsys):
    """No tokenizer beside the weights, or a directory that is no checkpoint: a clear error."""
    src = hf_models.llama(tmp_path / "llama", tied=True)
    assert main(["--hf", src, "--prompt", "hi"]) == 2
    assert "has no tokenizer.json: name the checkpoint's tokenizer directory" in (
        capsys.readouterr().err
    )
    (tmp_path / "empty").mkdir()
    assert main(["--hf", str(tmp_path / "empty"), "--prompt", "hi"]) == 2
    assert "--hf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--run", "x", "--tokenizer", "y", "--prompt", "hi"])


def image_prompt(tk, g: int, p: int, k: int, image_id: int, around=()):
    """A prompt with one random image of g x g patches of p px (k x k of them a token) after
    its first three words, between the ids `around` (begin, end; none: ()): (our Sample, its
    ids, the image normalised as transformers takes it, [H, W, C])."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (g * p, g * p, 3), dtype=np.uint8)
    patches, positions = patchify(pixels, p, k)  # (uint8: our encoder normalises them)
    image = Inputs.pixels().normalise(pixels)  # (what transformers takes: the config's default)
    words = tk("Describe the picture, please.", add_special_tokens=False)["input_ids"]
    begin, end = ([around[0]], [around[1]]) if around else ([], [])
    tokens = [*words[:3], *begin, *[image_id] * (g // k) ** 2, *end, *words[3:]]
    prompt = Sample(
        -1,
        np.asarray(tokens, np.int32),
        np.zeros(len(tokens), bool),
        {"vision": [(patches, positions)]},
        grids=[(g, g)],
    )
    return prompt, tokens, image


def _ours(d: Path, prompt: Sample, new: int) -> tuple[list[int], frozenset]:
    """Our greedy ids for `prompt` from the whole checkpoint `d` (`--hf d`), and its stops."""
    cfg, params = load_hf(parse_args(["--hf", str(d), "--prompt", "."]))
    template = make_template(cfg, "auto", pretrained=True)
    specials = template.specials  # (the directory's placeholder is the prompt's)
    phase = next(p for p, items in prompt.media.items() if items)
    assert specials.media[phase] in prompt.tokens
    stop = frozenset(template.specials.stop)
    gen = Generator(cfg, PromptShapes.fit([prompt], cfg, new), template.specials)
    (ours,) = gen.generate(
        params["params"], params["frozen"], [prompt], max_new_tokens=new, stop_ids=stop
    )
    return ours.ids, stop


@pytest.mark.torch
@pytest.mark.parametrize("tower", ["clip", pytest.param("siglip", marks=pytest.mark.slow)])
def test_llava_with_an_image_generates_transformers_tokens(tmp_path, tower):
    """A whole LLaVA from one directory: CLIP read at its second-to-last block with the class
    token dropped (Llama), or SigLIP at its last block (Qwen2); the image is one `<image>` id
    a patch; the 16 greedy ids are transformers'."""
    from transformers import LlavaForConditionalGeneration

    d, family = tmp_path / "llava", ("llama" if tower == "clip" else "qwen")
    template = "meta-llama/Llama-3.1-8B-Instruct" if tower == "clip" else "Qwen/Qwen2.5-7B-Instruct"
    tk = hf(build_dir(d, family, template, extra=["<image>"]))
    image_id = tk.convert_tokens_to_ids("<image>")
    text = "llama" if tower == "clip" else "qwen2"
    hf_models.llava(d, tower=tower, text=text, vocab=VOCAB, image=image_id)
    build_dir(d, family, template, extra=["<image>"])  # (save_pretrained wrote over it)
    # LlavaProcessor's file names the placeholder (a Qwen tokenizer has its <|image_pad|> too)
    (d / "processor_config.json").write_text(json.dumps({"image_token": "<image>"}))

    g, p = 6, 4  # the tower's own size (transformers reads LLaVA's images at it)
    prompt, tokens, image = image_prompt(tk, g, p, 1, image_id)
    ours, stop = _ours(d, prompt, 16)

    import torch

    model = LlavaForConditionalGeneration.from_pretrained(str(d)).eval()
    pixels = torch.from_numpy(image.transpose(2, 0, 1)[None].copy())
    theirs = hf_greedy(model, tokens, 16, stop, pixel_values=pixels)
    assert len(ours) == 16 and ours == theirs


QWEN_VL = {  # (the others: hf_models' builder of the family's name)
    "qwen3_5": hf_models.qwen3_5_whole,
    "qwen3_5_moe": lambda d, **kw: hf_models.qwen3_5_whole(d, experts=4, **kw),
}


@pytest.mark.torch
@pytest.mark.parametrize(
    ("family", "gh", "gw"),
    [
        ("qwen2_vl", 6, 4),
        ("qwen2_5_vl", 10, 6),
        # (the MoEs hold their dense twins' options too: Qwen3-VL's DeepStack and interleaved
        # M-RoPE, Qwen3.5's linear layers; the twins' decoding is the text test's above)
        ("qwen3_vl_moe", 6, 4),
        ("qwen3_5_moe", 6, 4),
    ],
)
def test_qwen_vl_with_an_image_generates_transformers_first_tokens(tmp_path, family, gh, gw):
    """A whole Qwen2-VL, Qwen2.5-VL, Qwen3-VL-MoE or Qwen3.5-MoE from one
    directory (its tower found in it; Qwen2.5-VL's windows of 4 x 4 patches, six over the
    image, two blocks full; Qwen3-VL's learned positions, its DeepStack added in the
    prefill's first layers, interleaved M-RoPE; Qwen3.5's on part of each head, its linear
    layers' state and window carried from the prefill; the MoEs' experts in the KV-cache
    steps): an image between the tokenizer's vision start and end; prefill places its tokens
    on the image's grid, decoding counts on from one past the largest position (Qwen2-VL's
    rope delta): the first 8 ids are transformers'."""
    import transformers

    d = tmp_path / family
    tk = hf(build_dir(d, "qwen", "Qwen/Qwen2.5-VL-7B-Instruct"))
    names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    ids = tuple(tk.convert_tokens_to_ids(t) for t in names)
    build = QWEN_VL.get(family) or getattr(hf_models, family)
    build(d, vocab=VOCAB, ids=ids)
    build_dir(d, "qwen", "Qwen/Qwen2.5-VL-7B-Instruct")  # (save_pretrained wrote over it)

    rng = np.random.default_rng(0)
    p = 4
    pixels = rng.integers(0, 256, (gh * p, gw * p, 3), dtype=np.uint8)
    patches, positions = patchify(pixels, p, 2)  # (uint8: our encoder normalises them)
    words = tk("Describe the picture, please.")["input_ids"]
    tokens = [*words[:3], ids[2], *[ids[0]] * (gh * gw // 4), ids[3], *words[3:]]
    prompt = Sample(
        -1,
        np.asarray(tokens, np.int32),
        np.zeros(len(tokens), bool),
        {"vision": [(patches, positions)]},
        grids=[(gh, gw)],
    )
    ours, stop = _ours(d, prompt, 8)

    import torch

    frames = Inputs.pixels().normalise(patches).reshape(-1, p, p, 3).transpose(0, 3, 1, 2)
    pixels = torch.from_numpy(np.repeat(frames[:, :, None], 2, axis=2).reshape(len(frames), -1))
    kinds = torch.from_numpy((np.asarray(tokens) == ids[0])[None].astype(np.int32))
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(d)).eval()
    grid = torch.tensor([[1, gh, gw]])
    theirs = hf_greedy(
        model, tokens, 8, stop, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=kinds
    )
    assert len(ours) == 8 and ours == theirs


@pytest.mark.torch
def test_qwen2_audio_with_a_clip_generates_transformers_tokens(tmp_path):
    """A whole Qwen2-Audio: a 48-frame clip (12 `<|AUDIO|>` ids between its bos and eos),
    its encoder pooling pairs of rows, the Linear projector; the 16 greedy ids are
    transformers' given the clip's frames padded with zeros to Whisper's window."""
    from transformers import Qwen2AudioForConditionalGeneration

    d = tmp_path / "qwen2_audio"
    extra = ["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"]
    tk = hf(build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct", extra=extra))
    audio, bos, eos = (tk.convert_tokens_to_ids(t) for t in extra)
    hf_models.qwen2_audio(d, vocab=VOCAB, audio=audio)
    build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct", extra=extra)

    frames, mels, window = 48, 16, 64
    clip = np.random.default_rng(0).normal(size=(frames, mels)).astype(np.float32)
    words = tk("What do you hear?")["input_ids"]
    tokens = [*words[:2], bos, *[audio] * (frames // 4), eos, *words[2:]]
    media = {"audio": [(clip, np.arange(frames))]}
    prompt = Sample(-1, np.asarray(tokens, np.int32), np.zeros(len(tokens), bool), media)
    ours, stop = _ours(d, prompt, 16)

    import torch

    features = np.zeros((1, mels, window), np.float32)
    features[0, :, :frames] = clip.T
    mask = torch.from_numpy((np.arange(window) < frames)[None].astype(np.int64))
    model = Qwen2AudioForConditionalGeneration.from_pretrained(str(d)).eval()
    theirs = hf_greedy(
        model,
        tokens,
        16,
        stop,
        input_features=torch.from_numpy(features),
        feature_attention_mask=mask,
    )
    assert len(ours) == 16 and ours == theirs


@pytest.mark.torch
def test_qwen2_5_vl_with_a_video_generates_transformers_tokens(tmp_path):
    """A whole Qwen2.5-VL and a video file on the command line (`--video`): the template places
    its `<|video_pad|>` ids, decoding samples 6 of its 33 frames (1.82 fps, not the asked 2:
    a temporal patch spans 1.1 s), M-RoPE counts its time in seconds x tokens_per_second; the
    8 greedy ids are transformers' given the same frames and its `second_per_grid_ts`."""
    import torch
    import transformers
    from transformers.video_utils import VideoMetadata
    from video_files import moving_frames, write_video

    from jaxmllm.data.media.video import frame_indices
    from jaxmllm.generate import taking_videos

    d = tmp_path / "qwen2_5_vl"
    tk = hf(build_dir(d, "qwen", "Qwen/Qwen2.5-VL-7B-Instruct"))
    names = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    ids = tuple(tk.convert_tokens_to_ids(t) for t in names)
    hf_models.qwen2_5_vl(d, vocab=VOCAB, ids=ids)
    build_dir(d, "qwen", "Qwen/Qwen2.5-VL-7B-Instruct")  # (save_pretrained wrote over it)
    video = write_video(tmp_path / "m.mp4", moving_frames(33, 32, 48), fps=10)

    args = parse_args(["--hf", str(d), "--video", str(video), "--prompt", "Which way?"])
    cfg, params = load_hf(args)
    cfg = taking_videos(cfg)
    assert cfg.model.vision.tokens_per_second == 4  # (the checkpoint's, read by the import)
    template = make_template(cfg, "auto", pretrained=True)
    (prompt,) = request_prompts(template, args)
    (grid,) = prompt.grids
    assert grid[0] == 3 and len(grid) == 4  # three temporal patches, in absolute time
    stop = frozenset(template.specials.stop)
    gen = Generator(cfg, PromptShapes.fit([prompt], cfg, 8), template.specials)
    (ours,) = gen.generate(
        params["params"], params["frozen"], [prompt], max_new_tokens=8, stop_ids=stop
    )

    tokens = prompt.tokens.astype(np.int64)
    assert (tokens == ids[1]).sum() == grid[0] * grid[1] * grid[2] // 4
    patches = Inputs.pixels().normalise(np.concatenate([v for v, _ in prompt.media["vision"]]))
    theirs_pixels = patches.reshape(-1, 2, 4, 4, 3).transpose(0, 4, 1, 2, 3)
    meta = VideoMetadata(total_num_frames=33, fps=10.0, frames_indices=frame_indices(33, 6))
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(d)).eval()
    theirs = hf_greedy(
        model,
        tokens.tolist(),
        8,
        stop,
        pixel_values_videos=torch.from_numpy(theirs_pixels.reshape(len(patches), -1)),
        video_grid_thw=torch.tensor([grid[:3]]),
        second_per_grid_ts=torch.tensor([2 / meta.sampled_fps]),
        mm_token_type_ids=torch.from_numpy(2 * (tokens == ids[1])[None].astype(np.int64)),
    )
    assert len(ours.ids) == 8 and ours.ids == theirs
