"""Qwen3-VL with transformers as the oracle: tiny random checkpoints (tests/hf_models.py) of
other shapes checked on packed rows; the packed check shown failing when a row's positions are
counted as one text or DeepStack is left out; what the import writes; a video laid out as
Qwen3-VL's processor lays it out (each temporal patch after its time) and generated from as
transformers generates."""

from __future__ import annotations

import json
from pathlib import Path

import hf_models
import jax
import numpy as np
import pytest
from test_chat import build_dir, hf

from jaxmllm.batch import bucketize
from jaxmllm.hf.check_whole import check_all
from jaxmllm.hf.importer import write_config
from jaxmllm.models.mllm import MultimodalLM

pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # (every test here runs transformers' models, on torch)
VOCAB = 512
NAMES = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def _checked(source: str, **kw) -> list[dict]:
    results = check_all(source, **kw)
    for result in results:
        assert result["max_abs_ref"] > 0.5, result  # a real signal, not zeros
    return results


@pytest.mark.slow
# (DeepStack from one block, into the first layer: the MoE's first shape below; the dense
# decoder under DeepStack: test_hf_whole's qwen3-vl)
@pytest.mark.parametrize(
    "shape",
    [
        dict(deepstack=(0, 1, 2), layers=4, sections=(2, 5, 5)),  # every block; other sections
        dict(deepstack=(), tied=True),  # none at all; tied embeddings
    ],
)
def test_qwen3_vl_of_other_shapes_checks_within_1e_4(shape, tmp_path):
    """Other depths, DeepStack at other blocks (or none), other M-RoPE sections, tied
    embeddings: every line (the LLM, the merger and DeepStack's rows, each of four samples
    packed into one row: text, two images, a video) within 1e-4 of transformers in fp32."""
    for result in _checked(hf_models.qwen3_vl(tmp_path / "m", **shape)):
        assert result["max_abs_diff"] < 1e-4, result


@pytest.mark.slow  # (~50 s: four checks)
def test_the_packed_check_fails_when_positions_or_deepstack_are_wrong(tmp_path, monkeypatch):
    """The packed check holds what packing must get right: with every sample's positions
    counted on through the row as text (no restart, no image grid: what a text packer writes),
    or with DeepStack's additions left out, the samples with media leave 1e-3 far behind while
    the text alone still matches. Counting a row as ONE multimodal document (each sample's
    positions shifted by where it starts) changes nothing: rotary positions are relative."""
    source = hf_models.qwen3_vl(tmp_path / "m")
    media = lambda results: [r for r in results if r["role"] == "model" and "text" not in r["what"]]
    text = lambda results: [r for r in results if "text alone" in r["what"]]
    assert all(r["max_abs_diff"] < 1e-4 for r in _checked(source))

    real = bucketize.mrope_positions
    start = [0]

    def shifted(tokens, *args):  # the row as one document: each sample where the last ended
        out = real(tokens, *args) + start[0]
        start[0] = int(out.max()) + 1
        return out

    monkeypatch.setattr(bucketize, "mrope_positions", shifted)
    assert all(r["max_abs_diff"] < 1e-4 for r in check_all(source))

    def as_text(tokens, *args):  # counted on through the row as text, no grid
        out = np.repeat((start[0] + np.arange(len(tokens)))[:, None], 3, 1).astype(np.int32)
        start[0] += len(tokens)
        return out

    start[0] = 0
    monkeypatch.setattr(bucketize, "mrope_positions", as_text)
    wrong = check_all(source)
    assert all(r["max_abs_diff"] > 1e-3 for r in media(wrong)), wrong
    assert all(r["max_abs_diff"] < 1e-4 for r in text(wrong)), wrong

    monkeypatch.setattr(bucketize, "mrope_positions", real)
    monkeypatch.setattr(MultimodalLM, "inputs_and_added", lambda m, mb, rows=None: no_deep(m, mb))
    jax.clear_caches()  # (the compiled model traced the real method)
    wrong = check_all(source)
    assert all(r["max_abs_diff"] > 1e-3 for r in media(wrong)), wrong
    assert all(r["max_abs_diff"] < 1e-4 for r in text(wrong)), wrong


_inputs_and_added = MultimodalLM.inputs_and_added


def no_deep(model, mb):
    return _inputs_and_added(model, mb)[0], None


def qwen3_vl_dir(d: Path, **kw) -> tuple[str, tuple[int, ...]]:
    """A whole Qwen3-VL with a Qwen tokenizer (Qwen2.5-VL's chat template: Qwen3-VL's renders
    images and videos alike) beside it; its placeholder ids."""
    tk = hf(build_dir(d, "qwen", "Qwen/Qwen2.5-VL-7B-Instruct"))
    ids = tuple(tk.convert_tokens_to_ids(t) for t in NAMES)
    hf_models.qwen3_vl(d, vocab=VOCAB, ids=ids, **kw)
    build_dir(d, "qwen", "Qwen/Qwen2.5-VL-7B-Instruct")  # (save_pretrained wrote over it)
    return str(d), ids


def test_import_writes_the_tower_deepstack_and_interleaved_mrope(tmp_path):
    """`hf import --model` of a Qwen3-VL: the tower's learned table (6 x 6, resized bilinearly)
    beside its 2D rotary, its biased patch embedding and tanh-GELU blocks, DeepStack's blocks;
    the Qwen3 LLM with interleaved M-RoPE (its sections); videos with their times written
    (data.video_timestamps)."""
    source, _ = qwen3_vl_dir(tmp_path / "m")
    cfg = write_config(tmp_path / "run.yaml", model=source)
    v, llm = cfg.model.vision, cfg.model.llm
    assert (v.positions, v.position_grid, v.position_resize) == ("rope", 6, "bilinear")
    assert (v.patch_bias, v.mlp, v.norm, v.deepstack) == (True, "gelu_tanh", "layer", (0, 2))
    assert (v.projector_dim, v.projector_act, v.final_norm) == (128, "gelu", True)
    assert (llm.qk_norm, llm.mrope_interleaved, llm.mrope_section) == (True, True, (4, 4, 4))
    assert cfg.data.video_timestamps and cfg.data.tokenizer == source


@pytest.mark.slow  # (~25 s)
def test_a_video_is_laid_out_and_generated_from_as_transformers_does(tmp_path):
    """`generate --hf DIR --video V`: each temporal patch of the video after its time as
    Qwen3-VL's processor writes it (`<0.2 seconds>`, its own vision start and end: its
    `replace_video_token`, run here on our sampled frames), the template's wrap around them
    all; M-RoPE places each temporal patch as an image of its own; the 8 greedy ids are
    transformers' given the same frames."""
    import torch
    import transformers
    from test_generate_hf import hf_greedy
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata
    from video_files import moving_frames, write_video

    from jaxmllm.batch.prompts import PromptShapes
    from jaxmllm.config.spec import Inputs
    from jaxmllm.data.media.video import frame_indices
    from jaxmllm.data.text.template import make_template
    from jaxmllm.generate import load_hf, parse_args, request_prompts, taking_videos
    from jaxmllm.step.generate import Generator

    source, ids = qwen3_vl_dir(tmp_path / "m")
    video = write_video(tmp_path / "m.mp4", moving_frames(33, 32, 48), fps=10)
    args = parse_args(["--hf", source, "--video", str(video), "--prompt", "Which way?"])
    cfg, params = load_hf(args)
    cfg = taking_videos(cfg)
    template = make_template(cfg, "auto", pretrained=True)
    (prompt,) = request_prompts(template, args)
    (grid,) = set(prompt.grids)
    assert len(prompt.grids) == 3 and grid[0] == 1  # three temporal patches, each a grid
    thw = [3, *grid[1:]]

    # The processor's own text for the video, in place of the template's one placeholder
    tk = hf(source)
    chat = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way?"}]}
    ]
    text = tk.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    meta = VideoMetadata(total_num_frames=33, fps=10.0, frames_indices=frame_indices(33, 6))

    class Processor:  # (what replace_video_token reads of a Qwen3VLProcessor)
        video_processor = type("V", (), {"merge_size": 2, "temporal_patch_size": 2})
        vision_start_token, vision_end_token = "<|vision_start|>", "<|vision_end|>"
        video_token = "<|video_pad|>"
        _calculate_timestamps = Qwen3VLProcessor._calculate_timestamps

    inputs = {"video_grid_thw": torch.tensor([thw]), "video_metadata": [meta]}
    frames = Qwen3VLProcessor.replace_video_token(Processor(), inputs, 0)
    assert frames.startswith("<0.2 seconds><|vision_start|>"), frames  # (frames 0 and 5)
    assert frames.count(" seconds><|vision_start|>") == 3 and "<2.5 seconds>" in frames
    want = tk(text.replace("<|video_pad|>", frames), add_special_tokens=False)["input_ids"]
    assert prompt.tokens.tolist() == want

    stop = frozenset(template.specials.stop)
    gen = Generator(cfg, PromptShapes.fit([prompt], cfg, 8), template.specials)
    (ours,) = gen.generate(
        params["params"], params["frozen"], [prompt], max_new_tokens=8, stop_ids=stop
    )
    tokens = prompt.tokens.astype(np.int64)
    patches = Inputs.pixels().normalise(np.concatenate([v for v, _ in prompt.media["vision"]]))
    pixels = patches.reshape(-1, 2, 4, 4, 3).transpose(0, 4, 1, 2, 3).reshape(len(patches), -1)
    model = transformers.AutoModelForImageTextToText.from_pretrained(source).eval()
    theirs = hf_greedy(
        model,
        tokens.tolist(),
        8,
        stop,
        pixel_values_videos=torch.from_numpy(pixels),
        video_grid_thw=torch.tensor([thw]),
        mm_token_type_ids=torch.from_numpy(2 * (tokens == ids[1])[None].astype(np.int64)),
    )
    assert len(ours.ids) == 8 and ours.ids == theirs


def test_check_data_compares_the_users_own_records(tmp_path, capsys):
    """`hf check DIR --data FILE`: the file's records (an image, a video, text) preprocessed as
    the import's config would (the checkpoint's tokenizer and chat template; the video's times
    between its temporal patches), packed into one row, each within 1e-4 of transformers on it
    alone; a file with no readable record is refused naming why (exit 2)."""
    from PIL import Image
    from video_files import moving_frames, write_video

    from jaxmllm.hf.__main__ import main

    source, _ = qwen3_vl_dir(tmp_path / "m")
    data = tmp_path / "data"
    data.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 56, 3), np.uint8)).save(
        data / "a.png"
    )
    write_video(data / "v.mp4", moving_frames(20, 32, 48), fps=10)
    turn = lambda q, a: [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    records = [
        {"id": "img", "images": ["a.png"], "messages": turn("<image>What is it?", "A cat.")},
        {"id": "vid", "videos": ["v.mp4"], "messages": turn("<video>Which way?", "Right.")},
        {"id": "txt", "messages": turn("Hello there", "Hi.")},
    ]
    path = data / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["check", source, "--data", str(path), "--json"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    samples = [r for r in results if r["role"] == "model"]
    assert len(samples) == 3 and "record 'vid'" in samples[1]["what"], samples
    assert all("packed 3 samples into 1 row" in r["what"] for r in samples)
    for result in results:
        assert result["max_abs_diff"] < 1e-4, result
    (data / "bad.jsonl").write_text(
        json.dumps({"id": "x", "images": ["gone.png"], "text": "<image>"})
    )
    assert main(["check", source, "--data", str(data / "bad.jsonl")]) == 2
    assert "no record to check" in capsys.readouterr().err


# ----------------------------------------------------------------------------- Qwen3-VL-MoE


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape",
    [
        dict(experts=4, top_k=1, deepstack=(1,)),  # top-1 of 4, DeepStack from one block
        dict(experts=6, top_k=3, layers=4, sparse_step=2),  # a dense layer every second
        dict(experts=8, top_k=2, dense_layers=(0, 2), moe_dim=24),  # dense layers; 2f != width
    ],
)
def test_qwen3_vl_moe_of_other_shapes_checks_within_1e_4(shape, tmp_path):
    """Other expert counts and top-k, dense layers among the MoE ones (mlp_only_layers,
    decoder_sparse_step), experts whose fused gate_up is not square: every line within 1e-4
    of transformers in fp32 (each sample of a packed row)."""
    for result in _checked(hf_models.qwen3_vl_moe(tmp_path / "m", **shape)):
        assert result["max_abs_diff"] < 1e-4, result


def test_qwen3_vl_moe_reads_the_hubs_transposed_experts_and_writes_transformers(tmp_path):
    """The hub's Qwen3-VL-MoE files hold the stacked experts transposed ([E, width, 2f],
    [E, f, width]) from what transformers 5 saves: both load to the same parameters (told by
    their shape, as transformers tells them), and the export writes transformers' layout."""
    from flax import nnx

    from jaxmllm.hf.export import Piece, write_piece
    from jaxmllm.hf.safetensors import Checkpoint, write_checkpoint
    from jaxmllm.hf.towers import load_model
    from jaxmllm.hf.wholes import whole_for
    from sharding.rules import keyed_leaves

    saved = hf_models.qwen3_vl_moe(tmp_path / "saved", moe_dim=24)
    ck = Checkpoint(saved)
    experts = lambda n: n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    hub = tmp_path / "hub"
    tensors = [(n, ck.get(n).transpose(0, 2, 1) if experts(n) else ck.get(n)) for n in ck.names()]
    write_checkpoint(hub, sorted(tensors), 1 << 30)
    (hub / "config.json").write_text((Path(saved) / "config.json").read_text())
    gate_up = next(n for n in ck.names() if n.endswith("gate_up_proj"))
    assert ck.get(gate_up).shape[1:] == (48, 64)  # (transformers': [E, 2f, width])

    flat = lambda d: keyed_leaves(nnx.to_pure_dict(nnx.state(load_model(d, d)[1])))
    a, b = flat(saved), flat(str(hub))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    for result in check_all(str(hub)):  # (transformers transposes them back on its own)
        assert result["max_abs_diff"] < 1e-4, result
    cfg, _ = load_model(str(hub), str(hub))
    whole = whole_for(json.loads((hub / "config.json").read_text()))
    out = tmp_path / "out"
    write_piece(cfg, Piece("", ("llm", "vision"), str(hub), whole=whole), b, out, 1 << 30)
    back = Checkpoint(out)
    for n in ck.names():
        assert np.array_equal(back.get(n), ck.get(n)), n  # (transformers' own layout)


# (Attention alone, q, k, v and o: the dense Qwen3-VL's adapters on every LLM matrix,
# test_lora_hf's check; attention beside the experts here.)
@pytest.mark.parametrize(
    "targets",
    [
        dict(  # + the routed experts, named (PEFT 0.21 moves no MLP target onto them here),
            # gate and up fused at twice the rank and alpha as PEFT's own conversion puts them
            target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            rank_pattern={r".*\.gate_up_proj": 8},
            alpha_pattern={r".*\.gate_up_proj": 16},
        ),
    ],
)
def test_a_peft_adapter_on_qwen3_vl_moe_gives_peft_s_logits(targets, tmp_path):
    """PEFT adapters on a Qwen3-VL-MoE's LLM (a dense layer among its MoE ones): attention,
    and the routed experts' stacked matrices (target_parameters, under
    model.language_model.): `hf check --adapter` within 1e-4 of peft's, every sample of the
    packed row; `hf import --adapter` configures those targets."""
    import peft
    import torch
    import transformers

    source = hf_models.qwen3_vl_moe(tmp_path / "m", dense_layers=(1,))
    model = transformers.AutoModelForImageTextToText.from_pretrained(source)
    # (the tower's modules have other names: qkv, proj, linear_fc1, ...)
    config = peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, **targets)
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    wrapped.save_pretrained(str(tmp_path / "adapter"))
    for result in check_all(source, adapter=str(tmp_path / "adapter")):
        assert result["max_abs_diff"] < 1e-4, result
    cfg = write_config(tmp_path / "run.yaml", model=source, adapter=str(tmp_path / "adapter"))
    experts = {"gate", "up", "down"} if "target_parameters" in targets else set()
    want = {t.removesuffix("_proj") for t in targets["target_modules"]} | experts
    assert set(cfg.model.llm.lora.targets) == want and cfg.model.vision.freeze
