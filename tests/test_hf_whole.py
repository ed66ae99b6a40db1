"""Whole multimodal checkpoints in and out (LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL,
Qwen2-Audio), with transformers itself as the oracle: tiny random models built in tmp_path
(tests/hf_models.py, every parameter drawn at random), their logits with media in the prompt,
bit-exact round trips, what import writes, and what import and export refuse."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hf_models
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_chat import build_dir

from jaxmllm.config import ConfigError, VisionConfig, load_config
from jaxmllm.data.media.image import patchify
from jaxmllm.data.records.record import parse_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.text.tokenizer import make_tokenizer
from jaxmllm.hf.__main__ import main
from jaxmllm.hf.check import describe
from jaxmllm.hf.export import Piece, export_run, plan_export, write_piece
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.importer import model_section, write_config
from jaxmllm.hf.registry import read_hf_config
from jaxmllm.hf.safetensors import Checkpoint
from jaxmllm.hf.towers import load_model
from jaxmllm.hf.wholes import whole_for
from jaxmllm.models.vision import VisionEncoder
from jaxmllm.plan.tiles import from_segments
from sharding.rules import keyed_leaves

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]

WHOLES = {
    "llava-clip-llama": lambda d: hf_models.llava(d),
    "llava-siglip-qwen2": lambda d: hf_models.llava(d, tower="siglip", text="qwen2", tied=True),
    "qwen2-vl": hf_models.qwen2_vl,
    "qwen2-5-vl": hf_models.qwen2_5_vl,
    "qwen2-audio": hf_models.qwen2_audio,
    "qwen3-vl": hf_models.qwen3_vl,
    "qwen3-vl-moe": lambda d: hf_models.qwen3_vl_moe(d, dense_layers=(1,)),
    "qwen3-5": hf_models.qwen3_5_whole,
    "qwen3-5-moe": lambda d: hf_models.qwen3_5_whole(d, experts=4),
    # its experts fused, as Qwen's own files hold them (written back so)
    "qwen3-5-moe-fused": lambda d: hf_models.fused_experts(
        hf_models.qwen3_5_whole(d.with_name(d.name + "-linear"), experts=4), d
    ),
}
# A hybrid's Gated DeltaNet sums its chunks in another order than transformers' (1e-3 fp32)
BOUNDS = {"qwen3-5": 1e-3, "qwen3-5-moe": 1e-3, "qwen3-5-moe-fused": 1e-3}
CLASSES = {"qwen2-audio": "Qwen2AudioForConditionalGeneration"}  # (else image-text-to-text)


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(WHOLES))
def test_whole_model_with_media_matches_transformers(name, tmp_path, capsys):
    """`hf check DIR`: one line per part and then one per sample of a packed row: the LLM on
    text, the encoder and projector on an image (LLaVA's CLIP with its class token, read a
    block before the end; Qwen2.5-VL's windows) or a clip (Qwen2-Audio's pooled rows), then
    each sample (text alone, images of two sizes or clips, a Qwen VL's video) packed into ONE
    row as training packs them, every token's logits within 1e-4 (Qwen3.5's hybrids: 1e-3)
    of transformers run on that sample alone in fp32 (Qwen2.5-VL's video time in seconds, its
    second_per_grid_ts; Qwen3.5's interleaved M-RoPE on part of each head, its linear
    layers' state restarted at each sample)."""
    assert main(["check", WHOLES[name](tmp_path / name), "--json"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    samples = [r for r in results if r["role"] == "model"]
    assert [r["role"] for r in results[:2]] == ["llm", "audio" if "audio" in name else "vision"]
    deep = int(name.startswith("qwen3-vl"))  # (a line of DeepStack's rows)
    assert len(results) == 2 + deep + len(samples)
    n = 4 if name.startswith("qwen") and name != "qwen2-audio" else 3  # (+ a video)
    assert len(samples) == n and all(f"packed {n} samples into 1 row" in r["what"] for r in samples)
    assert any("text alone" in r["what"] for r in samples)
    if n == 4:
        assert any("temporal-patch video" in r["what"] for r in samples)
    line = describe(results[-1])
    assert " model: logits of sample " in line and ": largest difference " in line, line
    for result in results:
        assert result["max_abs_ref"] > 0.5, result  # a real signal, not zeros
        assert result["max_abs_diff"] < BOUNDS.get(name, 1e-4), result


@pytest.mark.torch
def test_check_role_prints_one_part_of_a_whole_checkpoint(tmp_path, capsys):
    """`hf check DIR --role R` on a whole checkpoint prints R's line alone; a role the
    checkpoint has no part for, or `--role model` on a checkpoint of one part, is refused naming
    what to pass (exit 2) before anything is compared."""
    whole = hf_models.qwen2_audio(tmp_path / "whole")
    assert main(["check", whole, "--role", "audio", "--json"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["role"] for r in results] == ["audio"] and results[0]["max_abs_diff"] < 1e-4
    assert main(["check", whole, "--role", "vision"]) == 2
    err = capsys.readouterr().err
    assert "no vision part" in err and "llm, audio, model" in err, err
    part = hf_models.llama(tmp_path / "llm", tied=False)
    assert main(["check", part, "--role", "model"]) == 2
    assert "holds one part" in capsys.readouterr().err


def _load(source: str):
    whole = whole_for(read_hf_config(source))
    roles = tuple(r for r in ("llm", "vision", "audio") if r in whole.parts)
    dirs = {r: source if r in roles else "" for r in ("vision", "audio")}
    cfg, model = load_model(source, dirs["vision"], dirs["audio"])
    return whole, roles, cfg, keyed_leaves(nnx.to_pure_dict(nnx.state(model)))


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(WHOLES))
def test_whole_import_then_export_is_bit_identical(name, tmp_path, caplog):
    """Every tensor of the whole checkpoint is consumed or knowingly left alone (LLaVA's last
    CLIP block and post_layernorm), and writing the loaded parameters back gives every tensor
    bit for bit, in shards, with a config.json transformers loads without a missing or an
    unexpected key."""
    import transformers

    source = WHOLES[name](tmp_path / "source")
    caplog.set_level(logging.INFO, logger="jaxmllm")
    whole, roles, cfg, flat = _load(source)
    encoder = next(r for r in roles if r != "llm")  # each part's load names the others'
    assert f"are its {encoder} part (model.init_from.{encoder} loads them)" in caplog.text
    assert "are its llm part (model.init_from.llm loads them)" in caplog.text, caplog.text
    out = tmp_path / "out"
    write_piece(cfg, Piece("", roles, source, whole=whole), flat, out, 16 << 10)
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    before, after = Checkpoint(source), Checkpoint(out)
    assert set(after.names()) == set(before.names())
    for n in after.names():
        a, b = before.get(n), after.get(n)
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), n
    cls = getattr(transformers, CLASSES.get(name, "AutoModelForImageTextToText"))
    _, info = cls.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    again = _load(str(out))[3]
    assert all(np.array_equal(flat[k], again[k]) for k in flat)


@pytest.mark.torch
def test_import_model_writes_the_whole_config(tmp_path):
    """`hf import --model` on a LLaVA directory: the LLM, the tower read at its feature layer
    (2 of its 3 blocks, no final norm, the class token), the projector (one patch a token, its
    GELU), every part from the directory; the processor's mean, std and square crop (as many
    pixels) and its tokenizer (whose <image> is config.json's image token) in data."""
    d = tmp_path / "llava"
    tk = build_dir(d, "llama", "meta-llama/Llama-3.1-8B-Instruct", extra=["<image>"])
    image = json.loads((tk / "tokenizer.json").read_text())["added_tokens"][-1]["id"]
    hf_models.llava(d, vocab=512, image=image)
    build_dir(d, "llama", "meta-llama/Llama-3.1-8B-Instruct", extra=["<image>"])
    mean, std = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]
    processor = {
        "image_processor": {
            "image_mean": mean,
            "image_std": std,
            "crop_size": {"height": 24, "width": 20},
            "size": {"shortest_edge": 24},
        },
        "image_token": "<image>",
        "processor_class": "LlavaProcessor",
    }
    (d / "processor_config.json").write_text(json.dumps(processor))
    out = tmp_path / "run.yaml"
    assert main(["import", "--model", str(d), "--out", str(out)]) == 0
    assert out.read_text().startswith(f"# python -m jaxmllm.train --config {out}")
    assert f"# Written by: python -m jaxmllm.hf import --model {d} --out {out}\n" in out.read_text()
    assert "It names no data yet" in out.read_text()  # (and training refuses it: data.path)
    cfg = load_config(out)
    v, init = cfg.model.vision, cfg.model.init_from
    assert (init.llm, init.vision, init.audio) == (str(d), str(d), "")
    assert (v.depth, v.final_norm, v.class_token, v.pre_norm, v.merge) == (2, False, True, True, 1)
    assert (v.projector_dim, v.projector_act, cfg.model.audio.enabled) == (0, "gelu", False)
    assert list(cfg.data.image_mean) == mean and list(cfg.data.image_std) == std
    assert cfg.data.image_min_pixels == cfg.data.image_max_pixels == 24 * 20
    assert cfg.data.tokenizer == str(d)

    config = json.loads((d / "config.json").read_text())
    config["image_token_index"] = 5  # not the tokenizer's placeholder
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(FamilyError, match="image_token_index is 5 but the tokenizer"):
        write_config(tmp_path / "again.yaml", model=str(d))


@pytest.mark.torch
def test_import_on_a_gpu_recipe_names_the_keys_still_to_set(tmp_path, monkeypatch):
    """`hf import --base RECIPE`: the recipe's placeholders (its data file, a shared folder of
    another cluster, its workers a process) are named in the written header, what is real here
    is not."""
    source = hf_models.qwen2_vl(tmp_path / "vl")
    monkeypatch.chdir(tmp_path)  # (the recipe's data/train.jsonl: relative to the command's)
    recipe = ROOT / "configs" / "gpu" / "qwen2vl_2b_multinode.yaml"
    write_config(tmp_path / "run.yaml", model=source, base=recipe)
    header = [line for line in (tmp_path / "run.yaml").read_text().splitlines() if line[:1] == "#"]
    at = header.index(
        "# Still to set (the --base recipe's placeholders, paths naming nothing here):"
    )
    unset = [line.split(":")[0].strip("# ") for line in header[at + 1 :]]
    assert unset == ["data.path", "train.output_dir", "data.workers"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("")
    write_config(tmp_path / "run.yaml", model=source, base=recipe)
    assert "#   data.path:" not in (tmp_path / "run.yaml").read_text()


def test_import_reads_a_llava_1_5_config_its_defaults_included(tmp_path):
    """llava-1.5-7b-hf's config.json names little of its text_config beyond model_type: the
    rest is LlamaConfig's defaults, filled as transformers fills them (4096 wide, 32 layers);
    its CLIP-L/336 tower is read at block 23 of 24 with its class token."""
    text = {
        "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "rms_norm_eps": 1e-05,
        "vocab_size": 32064,
    }
    vision = {
        "hidden_size": 1024,
        "image_size": 336,
        "intermediate_size": 4096,
        "model_type": "clip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "projection_dim": 768,
    }
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": 32000,
        "model_type": "llava",
        "projector_hidden_act": "gelu",
        "text_config": text,
        "vision_config": vision,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = model_section(str(tmp_path), str(tmp_path))
    llm, v = model["llm"], model["vision"]
    assert (llm["width"], llm["depth"], llm["heads"], llm["kv_heads"], llm["mlp_dim"]) == (
        4096,
        32,
        32,
        32,
        11008,
    )
    assert (llm["norm_eps"], llm["vocab_size"], llm["attn_bias"]) == (1e-5, 32064, "")
    tower = (v["depth"], v["position_grid"], v["class_token"], v["final_norm"])
    assert tower == (23, 24, True, False)


def test_the_processors_placeholder_is_the_images(tmp_path):
    """A LLaVA on a Qwen tokenizer: the tokenizer has Qwen's <|image_pad|> too, but the
    processor (processor_config.json's image_token) names <image>, which the images become."""
    from jaxmllm.data.text.tokenizer import make_tokenizer

    d = build_dir(tmp_path / "tok", "qwen", "Qwen/Qwen2.5-7B-Instruct", extra=["<image>"])
    pad = make_tokenizer(str(d)).specials.media["vision"]
    (d / "processor_config.json").write_text(json.dumps({"image_token": "<image>"}))
    image = make_tokenizer(str(d)).specials.media["vision"]
    assert make_tokenizer(str(d)).decode([image]) == "<image>" and image != pad


@pytest.mark.torch
def test_import_refuses_what_it_cannot_read(tmp_path, capsys):
    d = Path(hf_models.llava(tmp_path / "llava"))
    config = json.loads((d / "config.json").read_text())
    for key, value, match in (
        ("vision_feature_layer", [-2, -1], "several feature layers"),
        ("vision_feature_select_strategy", "full", "'full' with a clip tower"),
        ("vision_feature_layer", -9, "not one of the tower's 3 blocks"),
    ):
        (d / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(FamilyError, match=match):
            write_config(tmp_path / "run.yaml", model=str(d))
    (d / "config.json").write_text(json.dumps(config))
    tower = hf_models.siglip(tmp_path / "siglip")
    assert main(["import", "--model", tower, "--out", str(tmp_path / "x.yaml")]) == 2
    err = capsys.readouterr().err
    assert "not a model jaxmllm reads whole" in err and "pass it as --vision" in err, err
    assert "qwen2_vl" in err and "qwen3" in err, err  # (what it does read whole)
    single = hf_models.qwen2(tmp_path / "qwen2", tied=True)
    args = ["import", "--model", str(d), "--vision", single, "--out", str(tmp_path / "x.yaml")]
    assert main(args) == 2
    assert "--model brings its own encoders" in capsys.readouterr().err


def _packed(cfg: VisionConfig, grids, length: int):
    rng = np.random.default_rng(0)
    p = cfg.patch_size
    packed = [
        patchify(rng.normal(size=(h * p, w * p, 3)).astype(np.float32), p, cfg.merge)
        for h, w in grids
    ]
    x = np.concatenate([a for a, _ in packed])
    pos = np.concatenate([b for _, b in packed])
    seg = np.concatenate([np.full(len(a), i + 1) for i, (a, _) in enumerate(packed)])
    pad = length - len(x)
    return (
        np.pad(x, ((0, pad), (0, 0)))[None],
        np.pad(seg, (0, pad))[None],
        np.pad(pos, ((0, pad), (0, 0)))[None],
        len(seg),
    )


@pytest.mark.parametrize("kind", ["class_token", "window"])
def test_block_sparse_towers_equal_dense(kind):
    """A tower with class tokens (CLIP's: 3 images, their class rows after the patches) or
    windows (Qwen2.5-VL's: 4 images, windows cut by their edges, blocks 1 and 3 full) gives
    the same patch features with block-sparse attention (the planner's tiles of the images;
    the class rows' and the windows' band of tiles added by the tower) as with dense."""
    if kind == "class_token":
        cfg = VisionConfig(
            patch_size=4,
            width=32,
            depth=2,
            heads=4,
            mlp_dim=64,
            merge=1,
            positions="learned",
            position_grid=6,
            class_token=True,
            pre_norm=True,
            final_norm=False,
            norm="layer",
            mlp="quick_gelu",
            attn_bias="qkvo",
            mlp_bias=True,
            patch_bias=False,
        )
        grids, length, documents = [(6, 6), (4, 7), (3, 2)], 128, 5
    else:
        cfg = VisionConfig(
            patch_size=4,
            width=32,
            depth=4,
            heads=4,
            mlp_dim=48,
            norm="rms",
            mlp="gated_silu",
            mlp_bias=True,
            attn_bias="qkvo",
            window=4,
            full_blocks=(1, 3),
            patch_bias=False,
            temporal_patch=2,
        )
        grids, length, documents = [(10, 6), (4, 6), (2, 2), (8, 8)], 192, 0
    x, seg, pos, n = _packed(cfg, grids, length)
    out = {}
    for attention in ("dense", "block_sparse"):
        sparse = attention == "block_sparse"
        encoder = VisionEncoder(
            cfg,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            remat="none",
            attention=attention,
            block=16,
            documents=documents if sparse else 0,
            rngs=nnx.Rngs(0),
        )
        tiles = jnp.asarray(from_segments(seg[:, None], 16, False, 200)) if sparse else None
        run = nnx.jit(lambda e, *a: e(*a))  # (one program: op by op takes 10x as long)
        out[attention] = np.asarray(run(encoder, *map(jnp.asarray, (x, seg, pos)), tiles))[0, :n]
    assert np.abs(out["dense"]).max() > 0.5
    np.testing.assert_allclose(out["block_sparse"], out["dense"], atol=1e-5)


TINY = ROOT / "configs" / "tiny.yaml"


def _fake_run(tmp_path: Path, overrides: list[str]) -> Path:
    """A run directory holding only its config (what export reads before any checkpoint)."""
    import dataclasses

    cfg = load_config(TINY, overrides)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    return run


def test_export_from_scratch_refuses_naming_the_option_and_leaves_nothing(tmp_path, capsys):
    """The tiny model (jaxmllm's own blocks: RMSNorm and gated-MLP vision, 2D-RoPE towers and
    an audio encoder) is no HF architecture: export refuses, naming per family the first
    option without a counterpart (as Gemma 4, the one whole holding all three parts), before
    anything is read or written. An LLM alone with jaxmllm's scaled tied logits is refused as
    Llama and as Qwen2 naming that key. --out a file: exit 2 with a clear message."""
    run = _fake_run(tmp_path, [])
    out = tmp_path / "export"
    # (an LLM, a tower and an audio encoder together: Gemma 4 alone holds all three)
    with pytest.raises(FamilyError, match=r"as gemma4: model\.llm\.mlp='gated_silu'"):
        export_run(str(run), str(out))
    cfg = load_config(TINY, ["model.audio.enabled=false", "data.synthetic.audio_fraction=0"])
    with pytest.raises(FamilyError, match=r"as qwen2_vl: model\.llm\.attn_bias=''") as e:
        plan_export(cfg)
    assert "as llava: " in str(e.value) and "as qwen2_5_vl: " in str(e.value)
    llm_only = [
        "model.vision.enabled=false",
        "model.audio.enabled=false",
        "model.llm.tie_embeddings=true",
        "model.llm.attn_bias=qkv",
    ]
    with pytest.raises(FamilyError, match=r"as qwen2: model\.llm\.tied_logits_scaled=True"):
        plan_export(
            load_config(
                TINY,
                [*llm_only, "data.synthetic.audio_fraction=0", "data.synthetic.image_fraction=0"],
            )
        )
    assert not out.exists() and not list(tmp_path.glob(".export*"))
    (tmp_path / "file").write_text("x")
    assert main(["export", str(run), "--out", str(tmp_path / "file")]) == 2
    assert "is a file: name a directory" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert main(["export", str(run), "--out", str(tmp_path / "full")]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_an_export_that_fails_midway_leaves_nothing(tmp_path, monkeypatch):
    """Export writes aside and renames when complete: a failure after one of its checkpoints
    was written leaves neither --out nor the partial directory."""
    from jaxmllm.hf import export

    run = _fake_run(tmp_path, [])
    monkeypatch.setattr(
        export,
        "plan_export",
        lambda cfg: [Piece("llm", ("llm",), ""), Piece("vision", ("vision",), "")],
    )
    monkeypatch.setattr(export, "_restore", lambda cfg, run, step: (0, {}))

    def write(cfg, piece, flat, directory, max_shard):
        if piece.where == "vision":
            raise OSError("disk full")
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        return set()

    monkeypatch.setattr(export, "write_piece", write)
    with pytest.raises(OSError, match="disk full"):
        export_run(str(run), str(tmp_path / "export"))
    assert not (tmp_path / "export").exists() and not list(tmp_path.glob(".export*"))


@pytest.mark.torch
def test_a_config_that_trains_nothing_is_refused_naming_the_freeze_keys(tmp_path):
    """Stage 1 on an LLM alone (no encoder, so no projector) freezes everything: refused at
    load, naming the keys; with an encoder its projector trains."""
    base = ROOT / "configs" / "recipes" / "stage1.yaml"
    llm = hf_models.qwen2(tmp_path / "qwen2", tied=True)
    with pytest.raises(
        ConfigError,
        match=r"nothing trains: model\.llm\.freeze=true .*no "
        r"projector to train.*set one of them to false",
    ):
        write_config(tmp_path / "stage1.yaml", llm, base=base)
    frozen = [
        "model.llm.freeze=true",
        "model.vision.freeze=true",
        "model.audio.freeze=true",
        "model.projector_freeze=true",
    ]
    with pytest.raises(
        ConfigError,
        match=r"model\.vision\.freeze=true, model\.audio\.freeze=true, "
        r"model\.projector_freeze=true",
    ):
        load_config(TINY, frozen)
    assert load_config(TINY, frozen[:3]).model.projector_freeze is False


def _full_vocabulary(d: Path, name: str) -> str:
    """A whole checkpoint whose vocabulary is full: vocab_size is its tokenizer's size, which
    holds its towers' placeholders (Qwen's image and video tokens) and no audio token."""
    tk = build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct")
    tokenizer = json.loads((tk / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    size = len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])
    if name == "llava":
        image = ids["<|image_pad|>"]
        hf_models.llava(d, tower="siglip", text="qwen2", tied=True, vocab=size, image=image)
    else:
        media = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
        hf_models.qwen2_5_vl(d, vocab=size, ids=tuple(ids[t] for t in media))
    build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct")  # (the model's save wrote its own files)
    return str(d)


@pytest.mark.torch
@pytest.mark.parametrize(
    "name", [pytest.param("llava", marks=pytest.mark.slow), "qwen2_5_vl"]
)  # (LLaVA ~40 s: its SigLIP tower at its own size)
def test_a_vision_checkpoint_whose_vocabulary_is_full_comes_back_as_it_was(
    name, tmp_path, capsys, caplog
):
    """A vision model's tokenizer lacks an audio token, and the model has no audio tower: the
    import adds no placeholder for it (it grew 320 rows to 384 for one, and the export wrote
    them), so the vocabulary stays the checkpoint's, `hf check` compares every column, and the
    export gives the embedding back bit for bit. A record with audio is then refused naming
    the missing encoder, not given an id past the vocabulary."""
    source = _full_vocabulary(tmp_path / "source", name)
    have = read_hf_config(source)["text_config"]["vocab_size"]
    with caplog.at_level(logging.INFO, logger="jaxmllm"):
        whole, roles, cfg, flat = _load(source)
    assert cfg.model.llm.vocab_size == have
    assert not [r for r in caplog.records if "new vocabulary rows" in r.getMessage()]
    assert main(["check", source, "--json"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for result in results:
        assert result["max_abs_diff"] < 1e-4, result
        assert "vocabulary columns" not in result["what"], result

    out = tmp_path / "export"
    write_piece(cfg, Piece("", roles, source, whole=whole), flat, out, 16 << 10)
    assert read_hf_config(str(out))["text_config"]["vocab_size"] == have
    before, after = Checkpoint(source), Checkpoint(out)
    for embed in [n for n in before.names() if n.endswith("embed_tokens.weight")]:
        assert np.array_equal(after.get(embed), before.get(embed))

    tk = make_tokenizer(source, phases=("vision",))
    assert "audio" not in tk.specials.media and tk.vocab_size == have
    record = parse_record(
        {"id": "r", "text": "<audio> hi", "audio": ["a.wav"]},
        tmp_path,
        1,
    )
    with pytest.raises(RecordError, match="no audio encoder") as e:
        tk.pieces(record)
    assert e.value.reason == "no_encoder"
