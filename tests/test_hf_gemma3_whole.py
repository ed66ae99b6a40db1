"""Gemma 3's whole model (`gemma3`: its text decoder, SigLIP, the pooling projector, images
read both ways) in and out, held to transformers on a tiny random checkpoint built in
tmp_path (tests/hf_models.py): `hf check`'s logits with images packed beside text, a negative
control with the images read causally, the bit-exact round trip, greedy ids with an image,
and what import refuses."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import hf_models
import numpy as np
import pytest
from flax import nnx
from test_chat import build_dir, hf
from test_generate_hf import VOCAB, _ours, hf_greedy, image_prompt

from jaxmllm.data.records.record import parse_record
from jaxmllm.data.text.tokenizer import make_tokenizer
from jaxmllm.hf import table
from jaxmllm.hf.__main__ import main
from jaxmllm.hf.export import Piece, write_piece
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.importer import write_config
from jaxmllm.hf.registry import read_hf_config
from jaxmllm.hf.safetensors import Checkpoint
from jaxmllm.hf.towers import load_model
from jaxmllm.hf.wholes import whole_for
from sharding.rules import keyed_leaves

pytest.importorskip("transformers")
pytestmark = pytest.mark.torch


def _check(directory: str, capsys, rc: int = 0) -> list[dict]:
    """`hf check DIR --json`'s lines (`rc`: its exit status, 1 where a figure is off)."""
    assert main(["check", directory, "--json"]) == rc
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_gemma3_with_images_packed_beside_text_matches_transformers(tmp_path, capsys):
    """The LLM on text, the tower and pooling projector on an image, then two samples with an
    image (text, `<start_of_image>`, nine image tokens, `<end_of_image>`, text: longer than
    the window of 5) and one of text alone packed into ONE row: every token's logits within
    1e-4 of transformers on each sample alone in fp32, given its `token_type_ids`."""
    results = _check(hf_models.gemma3(tmp_path / "gemma3"), capsys)
    assert [r["role"] for r in results] == ["llm", "vision", "model", "model", "model"]
    samples = [r["what"] for r in results[2:]]
    assert sum("6x6-patch image" in w for w in samples) == 2 and "text alone" in samples[1]
    assert all("packed 3 samples into 1 row" in w for w in samples)
    for result in results:
        assert result["max_abs_ref"] > 0.5, result  # a real signal, not zeros
        assert result["max_abs_diff"] < 1e-4, result


def test_images_read_causally_fail_the_check(tmp_path, capsys, monkeypatch):
    """The negative control: imported without `model.llm.bidirectional: [vision]`, the samples
    with an image are far off transformers' (its images read both ways) and text alone is not."""
    d = hf_models.gemma3(tmp_path / "gemma3")
    whole = whole_for(read_hf_config(d))
    monkeypatch.setattr(whole, "row", dataclasses.replace(table.GEMMA3, bidirectional=()))
    results = _check(d, capsys, rc=1)
    image = [r for r in results[2:] if "image" in r["what"]]
    text = [r for r in results if "image" not in r["what"]]
    assert len(image) == 2 and all(r["max_abs_diff"] > 1e-2 for r in image), image
    assert all(r["max_abs_diff"] < 1e-4 for r in text), text


def _flat(directory: str):
    """(the config `hf import --model` writes, our parameters loaded from `directory`)."""
    cfg, model = load_model(directory, directory)
    return cfg, keyed_leaves(nnx.to_pure_dict(nnx.state(model)))


def test_gemma3_import_then_export_is_bit_identical(tmp_path, caplog):
    """Every tensor of the whole checkpoint is consumed, and writing the loaded parameters back
    gives each bit for bit, with a config.json transformers loads without a missing or an
    unexpected key; the import sets the pooling projector and the images' spans."""
    import transformers

    source = hf_models.gemma3(tmp_path / "source")
    caplog.set_level(logging.INFO, logger="jaxmllm")
    cfg, flat = _flat(source)
    v = cfg.model.vision
    assert (v.projector, v.merge, v.final_norm) == ("pool", 2, True)
    assert cfg.model.llm.bidirectional == ("vision",)
    out = tmp_path / "out"
    whole = whole_for(read_hf_config(source))
    write_piece(cfg, Piece("", ("llm", "vision"), source, whole=whole), flat, out, 16 << 10)
    before, after = Checkpoint(source), Checkpoint(out)
    assert set(after.names()) == set(before.names())
    for n in after.names():
        a, b = before.get(n), after.get(n)
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), n
    cls = transformers.Gemma3ForConditionalGeneration
    _, info = cls.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    again = _flat(str(out))[1]
    assert all(np.array_equal(flat[k], again[k]) for k in flat)


def test_import_refuses_what_gemma3_sets_and_jaxmllm_does_not_build(tmp_path):
    """Pan and scan, and a token count the tower's patches do not pool to, each refused naming
    its key."""
    d = Path(hf_models.gemma3(tmp_path / "gemma3"))
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "mm_tokens_per_image": 8}))
    with pytest.raises(FamilyError, match="mm_tokens_per_image 8"):
        write_config(tmp_path / "run.yaml", model=str(d))
    (d / "config.json").write_text(json.dumps(config))
    processor = {"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True}
    (d / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(FamilyError, match="do_pan_and_scan"):
        write_config(tmp_path / "run.yaml", model=str(d))


def test_gemma3_with_an_image_generates_transformers_tokens(tmp_path):
    """A whole Gemma 3 from one directory, an image in the prompt between its begin and end
    tokens (read both ways in prefill, as transformers' token_type_ids read them): the 16
    greedy ids are transformers'."""
    import torch
    from transformers import Gemma3ForConditionalGeneration

    d = tmp_path / "gemma3"
    template, extra = "meta-llama/Llama-3.1-8B-Instruct", ["<boi>", "<eoi>", "<image_soft>"]
    tk = hf(build_dir(d, "llama", template, extra=extra))
    boi, eoi, image_id = (tk.convert_tokens_to_ids(t) for t in extra)
    hf_models.gemma3(d, vocab=VOCAB, ids=(boi, eoi, image_id), seed=1)
    build_dir(d, "llama", template, extra=extra)  # (save_pretrained wrote over it)
    (d / "processor_config.json").write_text(json.dumps({"image_token": "<image_soft>"}))

    g, p, k = 6, 4, 2  # the tower's own size; 2x2 patches pooled to a token
    prompt, tokens, image = image_prompt(tk, g, p, k, image_id, (boi, eoi))
    ours, stop = _ours(d, prompt, 16)

    model = Gemma3ForConditionalGeneration.from_pretrained(str(d)).eval()
    types = torch.tensor([[int(t == image_id) for t in tokens]])
    pixels = torch.from_numpy(image.transpose(2, 0, 1)[None].copy())
    theirs = hf_greedy(model, tokens, 16, stop, pixel_values=pixels, token_type_ids=types)
    assert len(ours) == 16 and ours == theirs


def test_an_image_is_wrapped_as_gemma3s_processor_wraps_it(tmp_path):
    """A tokenizer with Gemma 3's image tokens: an image becomes a blank line,
    `<start_of_image>`, its placeholder (one a row, laid out later), `<end_of_image>` and a
    blank line, as Gemma3Processor's `full_image_sequence` writes it."""
    names = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    d = build_dir(tmp_path / "tk", "llama", None, names, image_token="<image_soft_token>")
    tk = make_tokenizer(str(d))
    assert "<image_soft_token>" not in tk.added_tokens  # (the checkpoint's own)
    record = parse_record({"id": "a", "text": "hi<image>ok", "images": ["y"]}, Path("."), 1)
    pieces = tk.pieces(record)
    assert [p[0] for p in pieces] == ["text", "vision", "text"]
    before, after = pieces[0][1], pieces[2][1]
    boi, eoi = (tk.token_id(t) for t in names[:2])
    assert before[-1] == boi and tk.decode(before[:-1]).endswith("hi\n\n"), tk.decode(before)
    assert after[0] == eoi and tk.decode(after[1:]).startswith("\n\nok"), tk.decode(after)
    assert tk.specials.media["vision"] == tk.token_id("<image_soft_token>")


def test_a_from_scratch_export_loads_in_autoprocessor_and_lays_an_image_out_as_ours(tmp_path):
    """A Gemma 3 exported from scratch (no imported directory: the processor's files made from
    the data section) with a Gemma tokenizer (its begin, end and soft image tokens):
    AutoProcessor builds Gemma3Processor from the directory, and a prompt with an image comes
    out as our tokenizer lays it out (blank line, begin, one soft token per pooled window,
    end, blank line), its token types marking the image, its pixels at the tower's size."""
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer

    names = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    special = dict(zip(("boi_token", "eoi_token", "image_token"), names, strict=True))
    d = build_dir(tmp_path / "tk", "llama", None, names, **special)
    ids = tuple(AutoTokenizer.from_pretrained(str(d)).convert_tokens_to_ids(names))
    source = hf_models.gemma3(tmp_path / "source", vocab=512, ids=ids)
    cfg, flat = _flat(source)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(d)))
    out = tmp_path / "out"
    whole = whole_for(read_hf_config(source))
    write_piece(cfg, Piece("", ("llm", "vision"), "", whole=whole), flat, out, 16 << 10)
    config = json.loads((out / "config.json").read_text())
    assert (config["boi_token_index"], config["eoi_token_index"]) == ids[:2]
    assert config["image_token_index"] == ids[2]

    processor = AutoProcessor.from_pretrained(str(out))
    assert type(processor).__name__ == "Gemma3Processor"
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (30, 50, 3), dtype=np.uint8))
    theirs = processor(text="hi<start_of_image>ok", images=[image], return_tensors="np")
    tk = make_tokenizer(str(d))
    record = parse_record({"id": "a", "text": "hi<image>ok", "images": ["y"]}, Path("."), 1)
    (_, before, _), (_, _), (_, after, _) = tk.pieces(record)
    v = cfg.model.vision
    tokens = (v.position_grid // v.merge) ** 2
    ours = [*before, *[ids[2]] * tokens, *after[:-1]]  # (ours ends the record: its end token)
    assert after[-1] in tk.specials.stop
    assert theirs["input_ids"][0].tolist() == ours
    assert theirs["token_type_ids"][0].tolist() == [int(t == ids[2]) for t in ours]
    side = v.position_grid * v.patch_size
    assert theirs["pixel_values"].shape == (1, 3, side, side)
