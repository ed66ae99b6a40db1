"""Preference pairs, the data side (`train.objective: dpo`): TRL's standard and conversational
records and RLAIF-V's, in JSON lines, a JSON list and Parquet (pyarrow's and HF datasets'),
read into the same pairs; only each completion learned (a multi-turn prompt's assistant turns
are not); bad pairs counted by reason; data of the other objective refused at start-up; the
built-in synthetic pairs; and a pair's index row, whose LLM tokens are its length exactly."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.index import build_index
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.preprocess import Limits, Params, Preprocessor
from jaxmllm.data.records.record import Record, parse_record
from jaxmllm.data.rejects import RecordError, read_rejects
from jaxmllm.data.source import index_text, open_source
from jaxmllm.data.synthetic import SyntheticSource
from jaxmllm.data.text.tokenizer import ASSISTANT, ByteTokenizer, make_tokenizer

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

SMALL = ["data.image_min_pixels=256", "data.image_max_pixels=1024", "data.audio_max_frames=32"]
SETTINGS = ["data.source=files", "data.eval.source=none", *SMALL]
BYTES = ByteTokenizer()
QUESTIONS = ("What colour is it?", "Name the colour.", "Say hi")
ANSWER = {"chosen": "hi", "rejected": "bye"}
ANSWERS = (("red", "blue"), ("It is red.", "It is green."), ("hi", "bye"))


def config(path, *extra, objective="dpo"):
    sets = [*SETTINGS, f"data.path={path}", f"train.objective={objective}", *extra]
    return load_config("configs/tiny.yaml", sets)


@pytest.fixture(scope="module")
def png(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pairs")
    Image.new("RGB", (40, 24), (200, 30, 30)).save(root / "cat.png")
    return root / "cat.png"


def rows_of(form: str, png: Path, inline: bool = False) -> list[dict]:
    """Three pairs in a form: two about the image (the first places it, the second leaves it
    to go first), one text alone, which names no id; `inline`: the image as HF's struct."""
    image = {"bytes": png.read_bytes(), "path": png.name} if inline else png.name
    out = []
    for k, (question, (chosen, rejected)) in enumerate(zip(QUESTIONS, ANSWERS, strict=True)):
        has_image = k < 2
        if form == "standard":
            prompt = ("<image>" if k == 0 else "") + question
            row = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
            row["images"] = [image] if has_image else []
        elif form == "conversational":
            parts = [{"type": "image", "text": None}] if has_image else []
            parts.append({"type": "text", "text": question})
            row = {  # (chosen's content a string, rejected's parts: both as TRL writes them)
                "prompt": [{"role": "user", "content": parts}],
                "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [
                    {"role": "assistant", "content": [{"type": "text", "text": rejected}]}
                ],
                "images": [image] if has_image else [],
            }
        else:  # RLAIF-V's
            row = {"image": image if has_image else None, "question": question}
            row.update(chosen=chosen, rejected=rejected, ds_name="x", origin_split="y")
        out.append({"id": "ab"[k], **row} if k < 2 else row)
    return out


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, indent=1))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def pairs_of(path: Path, *extra) -> tuple[list, object]:
    cfg = config(path, *extra)
    summary = build_index(cfg, progress=False)
    assert summary["accepted"] == summary["pairs"] == 3 and not summary["rejects"], summary
    source = open_source(cfg)
    samples = [source[i] for i in range(len(source))]
    # (the index says where each pair splits: its chosen document's tokens)
    assert source.index.split[:, 0].tolist() == [x.documents[0] for x in samples]
    return samples, source


def check_pair(sample, chosen: str, rejected: str, tk=BYTES) -> None:
    """Two documents, each its prompt (nothing learned up to and with the last ASSISTANT
    marker), then its completion and EOS, learned: nothing else."""
    a, b = sample.documents
    assert sample.is_pair and a + b == len(sample.tokens)
    assert tk.decode(sample.tokens[sample.loss]) == f"{chosen}</s>{rejected}</s>"
    for lo, hi in ((0, a), (a, a + b)):
        ids, loss = sample.tokens[lo:hi], sample.loss[lo:hi]
        prompt = int(np.flatnonzero(ids == ASSISTANT)[-1]) + 1
        assert not loss[:prompt].any() and loss[prompt:].all()
    prompts = [sample.tokens[:a][: np.flatnonzero(sample.tokens[:a] == ASSISTANT)[-1]]]
    prompts.append(sample.tokens[a:][: np.flatnonzero(sample.tokens[a:] == ASSISTANT)[-1]])
    assert np.array_equal(*prompts)  # (the same prompt, its image's rows in both)


def same(x, y) -> bool:
    return (
        np.array_equal(x.tokens, y.tokens)
        and np.array_equal(x.loss, y.loss)
        and x.documents == y.documents
        and x.grids == y.grids
        and all(
            np.array_equal(m[0], n[0]) and np.array_equal(m[1], n[1])
            for p in x.media
            for m, n in zip(x.media[p], y.media[p], strict=True)
        )
    )


# ----------------------------------------------------------------------------- forms


@pytest.fixture(scope="module")
def reference(png):
    samples, source = pairs_of(write(png.parent / "reference.jsonl", rows_of("standard", png)))
    return samples


@pytest.mark.parametrize("container", ["jsonl", "json", "parquet"])
@pytest.mark.parametrize("form", ["standard", "conversational", "rlaif"])
def test_every_form_and_container_reads_as_the_same_pairs(png, reference, form, container):
    rows = rows_of(form, png, inline=container == "parquet" and form == "rlaif")
    path = write(png.parent / f"{form}.{container}", rows)
    samples, source = pairs_of(path)
    assert source.pairs and source.index_rejects == {}
    for k, (x, (chosen, rejected)) in enumerate(zip(samples, ANSWERS, strict=True)):
        check_pair(x, chosen, rejected)
        assert same(x, reference[k]), (form, container, k)
    assert len(samples[0].media["vision"]) == 1 and len(samples[0].grids) == 1  # (once)
    assert not samples[2].media["vision"]
    ids = [source.record_id(i) for i in range(3)]
    assert ids[:2] == ["a", "b"] and ids[2].startswith(path.name)  # (its place in the file)


@pytest.mark.parametrize("form", ["conversational", "rlaif"])
def test_parquet_as_hf_datasets_writes_it(png, reference, tmp_path, form):
    """The oracle for "as datasets writes it" is datasets itself: an Image feature (RLAIF-V's
    `image`, or a list of them beside a conversational prompt)."""
    pytest.importorskip("datasets")
    from datasets import Dataset, Features, List, Value
    from datasets import Image as HFImage

    (tmp_path / png.name).write_bytes(png.read_bytes())
    rows = rows_of(form, png, inline=True)
    text = {"type": Value("string"), "text": Value("string")}
    if form == "rlaif":
        features = {"image": HFImage(), "question": Value("string")}
        features.update(chosen=Value("string"), rejected=Value("string"))
    else:
        features = {
            "images": List(HFImage()),
            "prompt": List({"role": Value("string"), "content": List(text)}),
            "chosen": List({"role": Value("string"), "content": Value("string")}),
            "rejected": List({"role": Value("string"), "content": List(text)}),
        }
    columns = {k: [r.get(k) for r in rows] for k in features}
    ds = Dataset.from_dict(columns, features=Features(features))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    samples, _ = pairs_of(tmp_path / "train.parquet")
    for k, (x, (chosen, rejected)) in enumerate(zip(samples, ANSWERS, strict=True)):
        check_pair(x, chosen, rejected)
        assert same(x, reference[k]), k


def test_arrayrecord_implicit_prompts_and_llama_factorys_pairs(png, reference, tmp_path):
    """The ArrayRecord converter keeps a pair as jaxmllm's own (`messages`, `chosen`,
    `rejected`), read as the others; TRL's implicit prompt (two whole conversations) and
    LLaMA-Factory's sharegpt pairs read as the same pairs."""
    from jaxmllm.data.arrayrecord import convert

    (tmp_path / png.name).write_bytes(png.read_bytes())
    source = write(tmp_path / "s.jsonl", rows_of("standard", png))
    convert(source, tmp_path / "s.array_record")
    samples, _ = pairs_of(tmp_path / "s.array_record")
    assert all(same(x, y) for x, y in zip(samples, reference, strict=True))
    implicit, sharegpt = [], []
    for k, (question, (chosen, rejected)) in enumerate(zip(QUESTIONS, ANSWERS, strict=True)):
        user = {"role": "user", "content": ("<image>" if k < 2 else "") + question}
        media = {"images": [png.name] if k < 2 else []}
        implicit.append(
            {
                "id": f"i{k}",
                "chosen": [user, {"role": "assistant", "content": chosen}],
                "rejected": [user, {"role": "assistant", "content": rejected}],
                **media,
            }
        )
        sharegpt.append(
            {
                "id": f"s{k}",
                "conversations": [{"from": "human", "value": user["content"]}],
                "chosen": {"from": "gpt", "value": chosen},
                "rejected": {"from": "gpt", "value": rejected},
                **media,
            }
        )
    for rows in (implicit, sharegpt):
        samples, _ = pairs_of(write(tmp_path / f"{rows[0]['id']}.json", rows))
        assert all(same(x, y) for x, y in zip(samples, reference, strict=True))


# ----------------------------------------------------------------------------- what is learned

MULTI_TURN = [
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! Ask me."},
    {"role": "user", "content": "<image>What colour is it?"},
]


def multi_turn_pair(png: Path) -> Record:
    obj = {"id": "m", "messages": MULTI_TURN, "chosen": "red", "rejected": "blue"}
    return parse_record({**obj, "images": [png.name]}, png.parent, 1)


def flat(pieces, specials) -> tuple[np.ndarray, np.ndarray]:
    """Ids and loss of pieces, each media marker one placeholder id."""
    ids, loss = [], []
    for p in pieces:
        ids += p[1].tolist() if p[0] == "text" else [specials.media[p[0]]]
        loss += p[2].tolist() if p[0] == "text" else [False]
    return np.asarray(ids), np.asarray(loss, bool)


def prompt_learned(tk, doc: Record) -> tuple[bool, str]:
    """(whether any of the prompt's tokens is learned, the learned text) in a pair's
    document; the prompt is what generation continues from (the template's generation
    prompt; jaxmllm's format: up to and with the last ASSISTANT marker)."""
    ids, loss = flat(tk.pieces(doc), tk.specials)
    if isinstance(tk, ByteTokenizer):
        n = int(np.flatnonzero(ids == ASSISTANT)[-1]) + 1
    else:
        prompt = Record(doc.id, doc.turns[:-1], doc.media)
        gen = flat(tk.pieces(prompt, generation=True), tk.specials)[0]
        n = len(gen)
        assert np.array_equal(ids[:n], gen)
    return bool(loss[:n].any()), tk.decode(ids[loss])


@pytest.mark.parametrize("family", ["byte", "qwen"])
def test_only_the_completion_is_learned_never_the_prompts_turns(png, tmp_path, family):
    """A multi-turn prompt's assistant turn is not learned in either document; with the mask
    over every assistant turn (`learn_last` off: SFT's), the prompt's turn is learned: the
    check catches it."""
    if family == "byte":
        tk, eos = BYTES, "</s>"
    else:
        from test_chat import build_dir

        tk = make_tokenizer(
            str(build_dir(tmp_path / "qwen", "qwen", "Qwen/Qwen2.5-VL-7B-Instruct"))
        )
        eos = "<|im_end|>"
    record = multi_turn_pair(png)
    assert [len(side) for side in record.completions] == [1, 1]
    for side, answer in enumerate(("red", "blue")):
        doc = record.document(side)
        learned, text = prompt_learned(tk, doc)
        assert not learned and text == answer + eos
        learned, text = prompt_learned(tk, dataclasses.replace(doc, learn_last=False))
        assert learned and text == f"Hello! Ask me.{eos}{answer}{eos}"  # (the negative control)
    cfg = config(png, f"data.tokenizer={'byte' if family == 'byte' else tk.path}")
    pre = Preprocessor(Params.from_config(cfg), tk)
    sizes = pre.sizes(record)
    x = pre.sample(0, record, sizes, Limits())
    assert tk.decode(x.tokens[x.loss]) == f"red{eos}blue{eos}"
    assert len(x.media["vision"]) == 1 and x.documents[0] + x.documents[1] == len(x.tokens)


# ----------------------------------------------------------------------------- the index row


def test_a_pairs_index_row_is_its_length(png):
    """A pair with an image: its item listed once, its text its tokens but one copy of the
    image's rows, so the index's LLM tokens (text + a token per encoder row) are the pair's
    length; counted as text without that copy (or as an SFT sample's text) it is not."""
    cfg = config(png)
    pre = Preprocessor(Params.from_config(cfg))
    record = multi_turn_pair(png)
    sizes = pre.sizes(record)
    counts = pre.layout(record, sizes).counts()
    x = pre.sample(0, record, sizes, Limits())
    media = list(pre.tokenizer.specials.media.values())
    rows = counts["images"][0] // pre.per_token["vision"]
    assert counts["images"] == [len(x.media["vision"][0][0])] and rows > 1
    assert int(np.isin(x.tokens, media).sum()) == 2 * rows  # (in both documents)
    llm = LengthsIndex.from_records([counts]).llm_tokens(pre.per_token)
    assert int(llm[0]) == len(x.tokens) and counts["text"] == index_text(x, media)
    assert counts["split"] == x.documents[0]  # (where it splits: its chosen document's tokens)
    sft_text = int(np.isin(x.tokens, media, invert=True).sum())  # (what a one-document count is)
    wrong = LengthsIndex.from_records([{**counts, "text": sft_text}]).llm_tokens(pre.per_token)
    assert int(wrong[0]) == len(x.tokens) - rows


def test_a_pair_too_long_for_the_row_is_skipped_whole_never_cut(png, tmp_path):
    """Each document fits the row, the two do not: the pair is skipped at start-up as
    `pair_too_long` naming the setting to raise (under truncate too), and a layout a limit
    cuts never becomes a sample."""
    rows = [
        {"id": "short", "prompt": "Say hi", "chosen": "hi", "rejected": "bye"},
        {"id": "long", "prompt": "Count", "chosen": "1 2 3 " * 20, "rejected": "1 2 4 " * 20},
    ]
    path = write(tmp_path / "p.jsonl", rows)
    summary = build_index(config(path), progress=False)
    assert summary["accepted"] == 2 and summary["percentiles"]["llm_tokens"]["max"] > 192
    for policy in ("truncate", "shrink", "skip"):
        source = open_source(config(path, f"data.on_oversize={policy}"))
        assert len(source) == 1 and source.record_id(0) == "short"
        (entry,) = source.startup_rejects
        assert entry["reason"] == "pair_too_long" and "batch.llm_row_len" in entry["detail"]
        assert entry["action"] == "skip"
    pre = Preprocessor(Params.from_config(config(path)))
    record = parse_record(
        {**rows[1], "messages": [{"role": "user", "content": "Count"}]}, tmp_path, 1
    )
    sizes = pre.sizes(record)
    assert pre.layout(record, sizes, Limits(max_tokens=192)).cut
    with pytest.raises(RecordError, match="batch.llm_row_len") as e:
        pre.sample(0, record, sizes, Limits(max_tokens=192))
    assert e.value.reason == "pair_too_long"


def test_a_pair_over_the_row_by_its_image_shrinks_whole(tmp_path):
    """data.on_oversize: shrink makes a pair's image smaller in both documents until the two
    fit the row: kept whole, its index row its length; truncate skips it."""
    Image.new("RGB", (160, 160), (30, 200, 30)).save(tmp_path / "big.png")
    row = {"id": "big", "prompt": "<image>What colour?", "chosen": "green", "rejected": "red"}
    path = write(tmp_path / "p.jsonl", [{**row, "images": ["big.png"]}])
    sets = ["data.image_max_pixels=16384", "batch.llm_row_len=384"]
    summary = build_index(config(path, *sets), progress=False)
    assert summary["percentiles"]["llm_tokens"]["max"] > 384
    source = open_source(config(path, *sets, "data.on_oversize=shrink"))
    (entry,) = source.startup_rejects
    assert entry["action"] == "shrink" and entry["reason"] == "oversize"
    x = source[0]
    check_pair(x, "green", "red")
    assert len(x.tokens) <= 384 and x.documents[0] == x.documents[1] + 2
    rows = len(x.media["vision"][0][0]) // source.pre.per_token["vision"]
    assert int(np.isin(x.tokens, source.media_ids).sum()) == 2 * rows
    llm = source.index.llm_tokens(source.pre.per_token)
    assert int(llm[0]) == len(x.tokens) and int(source.index.split[0, 0]) == x.documents[0]
    skipped = open_source(config(path, *sets, "data.on_oversize=truncate", "data.min_accept=0"))
    assert [e["reason"] for e in skipped.startup_rejects] == ["pair_too_long"]


# ----------------------------------------------------------------------------- bad pairs


def test_bad_pairs_are_counted_by_reason(png, tmp_path):
    good = {"prompt": "Say hi", "chosen": "hi", "rejected": "bye"}
    rows = [
        {"id": "ok", **good},
        {"id": "no-rejected", "prompt": "Say hi", "chosen": "hi"},
        {"id": "none-chosen", **good, "chosen": None},
        {"id": "empty", **good, "chosen": ""},
        {"id": "blank", **good, "rejected": [{"role": "assistant", "content": " "}]},
        {"id": "same", **good, "rejected": "hi"},
        {"id": "image-in-answer", **good, "chosen": "<image>hi", "images": [png.name]},
        {"id": "two-answers", **good, "chosen": [{"role": "assistant", "content": "a"}] * 2},
        {"id": "no-prompt", "chosen": "hi", "rejected": "bye"},
    ]
    (tmp_path / png.name).write_bytes(png.read_bytes())
    path = write(tmp_path / "bad.jsonl", rows)
    summary = build_index(config(path, "data.min_accept=0"), progress=False)
    assert summary["accepted"] == summary["pairs"] == 1
    assert summary["rejects"] == {
        "pair_missing_side": 2,
        "pair_empty_side": 2,
        "pair_identical": 1,
        "placeholder_mismatch": 1,
        "malformed_line": 2,
    }
    details = {r["id"]: r["detail"] for r in read_rejects(Path(summary["index"]) / "rejects.jsonl")}
    assert details["no-rejected"] == "missing 'rejected'"
    assert details["none-chosen"] == "missing 'chosen'"
    assert details["empty"] == "'chosen' is empty"
    assert details["blank"].startswith("'rejected' is empty")
    assert details["same"] == "'chosen' and 'rejected' are identical"
    assert "belong to its prompt" in details["image-in-answer"]
    assert "one assistant message" in details["two-answers"]
    assert "'prompt'" in details["no-prompt"]
    source = open_source(config(path, "data.min_accept=0"))
    assert source.index_rejects == summary["rejects"]  # (the run's rejects/index_<reason>)


# ----------------------------------------------------------------------------- the objective


def test_data_of_the_other_objective_is_refused_at_start(png, tmp_path):
    pairs = write(tmp_path / "pairs.parquet", rows_of("standard", png))
    (tmp_path / png.name).write_bytes(png.read_bytes())
    sft = write(tmp_path / "sft.jsonl", [{"id": "s", "text": "hello"}])
    # Before the build (by the first record, or Parquet's columns) ...
    with pytest.raises(ConfigError, match=r"holds preference pairs.*set train.objective: dpo"):
        build_index(config(pairs, objective="sft"), progress=False)
    with pytest.raises(ConfigError, match=r"holds no preference pairs.*train.objective: sft"):
        build_index(config(sft), progress=False)
    # ... and when the run opens its index (whatever the format: from the index's count).
    built = build_index(config(pairs), progress=False)
    plain = build_index(config(sft, objective="sft"), progress=False)
    # (where each pair splits, a column of pair data only: an SFT index is what it was)
    assert "split.npy" in built["columns"] and "split.npy" not in plain["columns"]
    docs = built["percentiles"]["llm_tokens_per_document"]
    assert docs["count"] == 6 and docs["total"] == built["percentiles"]["llm_tokens"]["total"]
    assert "llm_tokens_per_document" not in plain["percentiles"]
    with pytest.raises(ConfigError, match=r"data.path .*pairs.parquet holds preference pairs"):
        open_source(config(pairs, objective="sft"))
    with pytest.raises(ConfigError, match=r"sft.jsonl holds no preference pairs.*'dpo'"):
        open_source(config(sft))
    # A mixture: every source must hold what the objective trains on.
    mixed = f"data.sources=[{{path: {pairs}}}, {{path: {sft}}}]"
    with pytest.raises(ConfigError, match=r"data.sources' 'sft' .* no preference pairs"):
        open_source(config("", mixed))
    two = write(tmp_path / "more.jsonl", rows_of("standard", png))
    build_index(config(two), progress=False)
    both = open_source(config("", f"data.sources=[{{path: {pairs}}}, {{path: {two}}}]"))
    assert both.pairs and len(both) == 6 and all(both[i].is_pair for i in range(6))
    assert both.index.split[:, 0].tolist() == [both[i].documents[0] for i in range(6)]
    # One data set holding both kinds (jaxmllm's own records: its first SFT, so the build goes
    # on), each kind's objective refused alike.
    ask = [{"role": "user", "content": "hi"}]
    sft_row = {"id": "s", "messages": [*ask, {"role": "assistant", "content": "yo"}]}
    one = write(tmp_path / "one.jsonl", [sft_row, {"id": "p", "messages": ask, **ANSWER}])
    build_index(config(one, objective="sft"), progress=False)
    for objective in ("sft", "dpo"):
        with pytest.raises(ConfigError, match=r"1 preference pairs .* and 1 other records"):
            open_source(config(one, objective=objective))


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_pairs_and_their_index_rows():
    """Every sample a pair: the SFT sample as its chosen document, the same prompt with a wrong
    answer as its rejected one; `lengths()`, vectorised, is each pair's index row."""
    sets = ["data.synthetic.num_samples=600", "data.synthetic.video_fraction=0.2"]
    pairs = SyntheticSource(load_config("configs/tiny.yaml", [*sets, "train.objective=dpo"]))
    sft = SyntheticSource(load_config("configs/tiny.yaml", sets))
    index = pairs.lengths()
    assert np.array_equal(index.items["vision"].sizes, sft.lengths().items["vision"].sizes)
    media = list(pairs.specials.media.values())
    per_token = {"vision": pairs.merge**2, "audio": pairs.subsample}
    llm = index.llm_tokens(per_token)
    kinds = set()
    for i in range(0, 600, 3):
        x, one = pairs[i], sft[i]
        a, b = x.documents
        row = {"text": index_text(x, media)}
        row["images"] = [len(m[0]) for m in x.media["vision"]]
        row["audio"] = [len(m[0]) for m in x.media["audio"]]
        row["split"] = a  # (where it splits: the chosen document's tokens)
        assert row == index.record(i) and int(llm[i]) == len(x.tokens), i
        assert np.array_equal(x.tokens[:a], one.tokens) and x.grids == one.grids
        chosen, rejected = x.tokens[:a], x.tokens[a:]
        learned = [np.flatnonzero(x.loss[:a])[0], np.flatnonzero(x.loss[a:])[0]]
        assert learned[0] == learned[1] and np.array_equal(
            chosen[: learned[0]], rejected[: learned[1]]
        )  # (the same prompt, nothing of it learned)
        assert x.loss[:a][learned[0] :].all() and x.loss[a:][learned[1] :].all()
        right, wrong = BYTES.decode(chosen[learned[0] :]), BYTES.decode(rejected[learned[1] :])
        assert right != wrong and right.endswith("</s>") and wrong.endswith("</s>")
        if "moving" in right:
            kinds.add("video")
            assert right.rsplit(" ", 1)[0] == wrong.rsplit(" ", 1)[0]  # (the other way)
        elif "tone" in right:
            kinds.add("audio")
        elif right[0].isdigit():
            kinds.add("text")
            assert b == a and sum(p != q for p, q in zip(right, wrong, strict=True)) == 1
        else:
            kinds.add("image")
        assert np.array_equal(pairs[i].tokens, x.tokens)  # (deterministic)
    assert kinds == {"image", "audio", "video", "text"}
