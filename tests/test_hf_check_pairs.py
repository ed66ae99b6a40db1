"""`hf check DIR --data PAIRS`: preference pairs' completion log-prob sums, training's (the
pairs packed into one row, each pair's two documents in it, its media encoded once) against
transformers' on each document alone; shown failing when the prompt is counted, when the
documents are swapped and when a pair's image fills one document only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_hf_whole_train import whole_dir

from jaxmllm.batch import bucketize
from jaxmllm.hf import check_pairs
from jaxmllm.hf.__main__ import main
from jaxmllm.hf.check import describe
from jaxmllm.hf.check_whole import check_all

pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # (every test here runs transformers' models, on torch)
BOUND = 1e-4  # (sums of a few fp32 log-probs; hf check's own --tolerance is 1e-3)
QUESTIONS = ("What is in the picture?", "Name the colour.", "Say hi")
ANSWERS = (("A red circle on a mat.", "A dog."), ("Blue.", "It is green, I think."), ("hi", "bye"))


def _images(d: Path) -> list[str]:
    rng = np.random.default_rng(0)
    for name, (h, w) in (("a.png", (40, 56)), ("b.png", (24, 32))):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(d / name)
    return ["a.png", "b.png"]


def rlaif_v(d: Path) -> Path:
    """RLAIF-V's flat records in JSONL: two pairs about an image (of other sizes), one text."""
    d.mkdir(parents=True, exist_ok=True)
    images = [*_images(d), None]
    rows = [
        {"id": f"p{k + 1}", "image": image, "question": q, "chosen": c, "rejected": r}
        for k, (image, q, (c, r)) in enumerate(zip(images, QUESTIONS, ANSWERS, strict=True))
    ]
    path = d / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def trl_parquet(d: Path) -> Path:
    """TRL's standard form in Parquet, the images inline as HF datasets' structs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d.mkdir(parents=True, exist_ok=True)
    names = _images(d)
    rows = []
    for k, (q, (c, r)) in enumerate(zip(QUESTIONS, ANSWERS, strict=True)):
        images = [{"bytes": (d / names[k]).read_bytes(), "path": names[k]}] if k < 2 else []
        prompt = ("<image>" if images else "") + q
        rows.append({"id": f"p{k + 1}", "prompt": prompt, "chosen": c, "rejected": r})
        rows[-1]["images"] = images
    path = d / "prefs.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _lines(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def _pairs(results: list[dict]) -> list[dict]:
    return [r for r in results if "chosen_logps" in r]


def test_qwen2_5_vl_pairs_log_probs_are_transformers(tmp_path, capsys):
    """RLAIF-V's records (two with an image, one text alone): the encoder's rows, and per pair
    the chosen and rejected completion sums and token counts, ours from the three pairs packed
    into one row, within 1e-4 of transformers on each document alone; words without --json."""
    source = whole_dir("qwen2_5_vl", tmp_path / "m")
    data = rlaif_v(tmp_path / "data")
    assert main(["check", source, "--data", str(data), "--json"]) == 0
    results = _lines(capsys)
    pairs = _pairs(results)
    assert [p["id"] for p in pairs] == ["p1", "p2", "p3"], results
    assert any(r["role"] == "vision" for r in results)  # (the first pair's image)
    for r in results:
        assert r["max_abs_diff"] < BOUND, r
    for p in pairs:
        assert "packed 3 pairs into 1 row" in p["what"], p
        for side in check_pairs.SIDES:
            mine, theirs = p[f"{side}_logps"]["jaxmllm"], p[f"{side}_logps"]["transformers"]
            assert mine < -1 and abs(mine - theirs) == pytest.approx(p[f"{side}_logps"]["abs_diff"])
            counts = p[f"{side}_tokens"]
            assert counts["jaxmllm"] == counts["transformers"] >= 2, p  # (answer and EOS)
    assert pairs[0]["chosen_tokens"]["jaxmllm"] > pairs[0]["rejected_tokens"]["jaxmllm"]
    words = "\n".join(describe(r) for r in results)  # (what the command prints without --json)
    assert "completion log-prob sums of pair 1 of 3 (record 'p1'" in words
    assert "chosen -" in words and "(transformers -" in words


def test_the_pair_check_fails_on_the_prompt_a_swap_or_an_image_in_one_document(
    tmp_path, monkeypatch, capsys
):
    """The check holds what DPO must get right: with transformers' sums counting the prompt
    too, or taking the rejected document for the chosen, every pair is far off (exit 1); with
    a pair's image rows filling its chosen document only (the rejected's slots left to the
    placeholder's embedding), the image pairs' rejected sums are far off while the text pair
    and every chosen sum still match."""
    source = whole_dir("qwen2_5_vl", tmp_path / "m")
    data = str(rlaif_v(tmp_path / "data"))
    check = lambda: _pairs(check_all(source, data=data))

    with monkeypatch.context() as m:  # the prompt counted
        every = lambda doc: np.arange(len(doc.tokens)) < len(doc.tokens) - 1
        m.setattr(check_pairs, "completion_mask", every)
        assert main(["check", source, "--data", data, "--json"]) == 1
        for p in _pairs(_lines(capsys)):
            assert p["chosen_tokens"]["transformers"] > p["chosen_tokens"]["jaxmllm"] + 20, p
            assert p["max_abs_diff"] > 1.0, p

    real = check_pairs.documents
    with monkeypatch.context() as m:  # the documents swapped
        m.setattr(check_pairs, "documents", lambda sample: real(sample)[::-1])
        for p in check():
            assert p["chosen_logps"]["abs_diff"] > 1.0 and p["max_abs_diff"] > 1.0, p

    def once(rows, dest, copies):  # a pair's rows into its chosen document's slots alone
        rows = rows[: len(dest) // copies]
        return np.concatenate([rows, np.full(len(dest) - len(rows), -1)])

    with monkeypatch.context() as m:
        m.setattr(bucketize, "_copies", once)
        image1, image2, text = check()
    for p in (image1, image2):
        assert p["chosen_logps"]["abs_diff"] < BOUND, p
        assert p["rejected_logps"]["abs_diff"] > 0.1, p
    assert text["max_abs_diff"] < BOUND, text


@pytest.mark.slow  # (~15 s: two checks)
def test_qwen3_vl_moe_pairs_from_trl_parquet_packed_and_one_per_row(tmp_path):
    """A Qwen3-VL-MoE (DeepStack's rows filling both documents' slots, experts routed per
    token) on TRL's standard records in Parquet with inline images: every pair within 1e-4 of
    transformers, packed into one row and each pair in a row of its own."""
    source = whole_dir("qwen3_vl_moe", tmp_path / "m")
    data = str(trl_parquet(tmp_path / "data"))
    for packed in (True, False):
        results = check_all(source, data=data, packed=packed)
        assert any("DeepStack" in r["what"] for r in results)
        pairs = _pairs(results)
        assert [p["id"] for p in pairs] == ["p1", "p2", "p3"]
        where = "packed 3 pairs into 1 row" if packed else "each pair in a row of its own"
        for r in results:
            assert r["max_abs_diff"] < BOUND, r
        assert all(where in p["what"] for p in pairs)


@pytest.mark.slow  # (~15 s a family: a check each)
# (The dense Qwen3-VL and Qwen3.5: their MoE twins' pairs hold every option of theirs,
# DeepStack's rows in both documents (the test above), the linear layers' restarts and
# M-RoPE, beside the experts; the dense decoders' logits are test_hf_whole's.)
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5_moe"])
def test_every_vision_family_s_pairs_are_transformers(tmp_path, family):
    """The other whole families hf check covers with a native-resolution vision tower
    (Qwen3.5's hybrids: each pair's two documents restart the linear layers' states, as
    separate samples do), on RLAIF-V's records packed into one row: every pair within 1e-4 of
    transformers. (LLaVA's check takes only square images of its tower's size, pairs or not.)"""
    source = whole_dir(family, tmp_path / "m")
    results = check_all(source, data=str(rlaif_v(tmp_path / "data")))
    assert [p["id"] for p in _pairs(results)] == ["p1", "p2", "p3"], results
    for r in results:
        assert r["max_abs_diff"] < BOUND, r
