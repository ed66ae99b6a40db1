"""Evaluation's host side: the held-out synthetic share, the eval set planned at the training
step's shapes with every sample counted once, the metrics rows, the answers' scores and the
prompt templates. (The trainer with evaluation on: tests/test_train.py.)"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from jaxmllm.batch.bucketize import batch_shapes
from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.preprocess import Params, Preprocessor
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.scoring import score_answer
from jaxmllm.data.synthetic import SyntheticSource
from jaxmllm.data.text import tokenizer as tok
from jaxmllm.data.text.template import RecordTemplate, make_template
from jaxmllm.loop.evaluate import MIXES, HeldOut, eval_metrics, plan_set, sample_mixes
from jaxmllm.loop.metrics import read_metrics
from jaxmllm.resolve.run import resolve_run

IMAGE, AUDIO = tok.RESERVED.media["vision"], tok.RESERVED.media["audio"]  # the placeholders

HELD = 24


def tiny(*extra):
    sets = ["data.synthetic.num_samples=256", f"data.eval.samples={HELD}", "train.steps=20"]
    return load_config("configs/tiny.yaml", [*sets, *extra])


def test_the_held_out_share_is_the_synthetic_samples_after_the_training_range():
    cfg = tiny()
    held, train = HeldOut(cfg), SyntheticSource(cfg)
    more = SyntheticSource(load_config("configs/tiny.yaml", ["data.synthetic.num_samples=280"]))
    assert len(train) == 256 and len(held) == HELD  # the trainer draws indices < 256 only
    for i in (0, 5, HELD - 1):
        assert held[i].tokens.tolist() == more[256 + i].tokens.tolist()
        assert held.index.record(i) == more.lengths().record(256 + i)
    assert (
        held.index.record(0) != train.lengths().record(0)
        or held[0].media["vision"] != train[0].media["vision"]
    )


@pytest.fixture(scope="module")
def resolved():
    """tiny's run: its batch resolved against its training data, as the trainer has."""
    return resolve_run(tiny(), 8)


def test_the_eval_set_is_planned_at_the_step_shapes_and_counts_each_sample_once(tmp_path, resolved):
    """The run's planner and bucket shapes (so the eval step takes the train step's batch),
    and each sample's loss tokens counted exactly once under its modality mix, however many
    times the planner brought it."""
    cfg = resolved.cfg
    held = HeldOut(cfg)
    batches, *_ = plan_set(resolved, held, held.index)
    shapes = batch_shapes(cfg, 8)
    for batch in batches:
        assert {k: (v.shape, v.dtype) for k, v in batch.items() if k != "eval_mix"} == {
            k: (s, np.dtype(d)) for k, (s, d) in shapes.items()
        }
        assert batch["eval_mix"].shape == batch["llm_tokens"].shape
    counted = np.zeros(len(MIXES))
    for batch in batches:
        mask = batch["llm_loss_mask"] > 0
        np.add.at(counted, batch["eval_mix"][mask & (batch["eval_mix"] >= 0)], 1)
    want = np.zeros(len(MIXES))
    for i, mix in enumerate(sample_mixes(held.index)):
        want[mix] += held[i].loss[1:].sum()  # (token t's target is token t + 1)
    np.testing.assert_array_equal(counted, want)
    assert set(np.flatnonzero(want)) == {0, 1, 2}  # text, image and audio samples all there


@pytest.mark.parametrize("steps", ["all", "long"])
def test_each_host_evaluates_its_own_rows_of_the_set_with_context_groups(tmp_path, steps):
    """mesh.context=2 on 2 hosts of 4 devices (context groups 0, 1 on the first, 2, 3 on the
    second): each host's eval batches are its slice of the one-host batches, text, routing and
    each token's mix alike, and every sample is counted once over the hosts (the eval feed
    takes a host's context groups as the training feed does); with the groups in the long
    steps only (mesh.context_steps: long), each batch's own: a device's rows in the base
    steps, a group's in the long ones, each run by its variant's model."""
    cfg = tiny("mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "batch.llm_row_len=96")
    cfg = replace(cfg, mesh=replace(cfg.mesh, context_steps=steps))
    run = resolve_run(cfg, 8)
    held = HeldOut(run.cfg)
    whole, _, variants = plan_set(run, held, held.index)
    assert (max(variants) > 0 and min(variants) == 0) == (steps == "long")
    counted = 0
    for host in range(2):
        positions = np.arange(4 * host, 4 * host + 4)
        mine = replace(run, positions=positions)
        batches, *_ = plan_set(mine, held, held.index)
        assert len(batches) == len(whole)
        for got, want in zip(batches, whole, strict=True):
            assert got.keys() == want.keys()
            for key, value in want.items():
                np.testing.assert_array_equal(got[key], value[:, positions], err_msg=key)
            mask = got["llm_loss_mask"] > 0
            counted += int((mask & (got["eval_mix"] >= 0)).sum())
        assert any((b["eval_mix"] >= 0).any() for b in batches), host  # (its text is there)
    assert counted == sum(int(held[i].loss[1:].sum()) for i in range(len(held)))


def test_eval_rows_are_token_weighted_and_merge_into_their_steps_row(tmp_path):
    sums = np.zeros((3, len(MIXES)))
    sums[:, 0] = (6.0, 3.0, 4.0)  # text: 4 tokens, loss 6, 3 right
    sums[:, 2] = (2.0, 0.0, 4.0)
    row = eval_metrics(sums)
    assert row["eval/loss"] == 1.0 and row["eval/accuracy"] == 3 / 8
    assert row["eval/loss/text"] == 1.5 and row["eval/accuracy/audio"] == 0.0
    assert "eval/loss/image" not in row
    lines = [{"step": 4, "loss": 2.0}, {"step": 4, **row}]  # (what the trainer writes)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    [merged] = read_metrics(tmp_path)
    assert merged["loss"] == 2.0 and merged["eval/loss"] == 1.0 and merged["step"] == 4


def test_answers_are_scored_by_what_they_name():
    assert score_answer("a red circle", "a red circle") == {
        "exact": 1.0,
        "count": 1.0,
        "colour": 1.0,
        "shape": 1.0,
    }
    two = score_answer("a red cross and a blue cross", "a red circle and a green cross")
    assert two == {"exact": 0.0, "count": 1.0, "colour": 0.5, "shape": 0.5}
    assert score_answer("a red circle", "a red circle and a green cross")["count"] == 0.0
    tone = score_answer("a rising low tone", "a rising high tone")
    assert tone == {"exact": 0.0, "contour": 1.0, "pitch": 0.0}
    assert score_answer("1 2 3", "a steady mid tone")["pitch"] == 0.0


def test_sampled_answers_are_each_questions_own_and_scored_beside_the_greedy_one(
    resolved, monkeypatch
):
    """data.eval.sampled_answers: n answers a question from one batch (question q's are rows
    q x n ..): near temperature 0 each is its question's greedy answer, so mean@n and best@n
    are the greedy score; at temperature 1 they are drawn again the same at the same step,
    best@n is at least mean@n, and the log and the end-of-run table give both."""
    from jaxmllm.loop.answers import Questions
    from jaxmllm.step import generate
    from jaxmllm.step.program import build_model

    sets = ["data.eval.sampled_answers=3", "data.eval.max_new_tokens=6"]
    cfg = replace(tiny(*sets, "data.eval.temperature=1e-6"), batch=resolved.cfg.batch)
    weights = build_model(cfg, seed=3)  # (random: every answer a guess, each its own)
    cold = Questions(cfg, HeldOut(cfg), 5)
    results = cold.ask(*weights, step=7)
    assert len({r["answer"] for r in results}) > 1  # (the questions' answers differ)
    for r in results:
        assert r["samples"] == [r["answer"]] * 3, (r["answer"], r["samples"])
    row = Questions.metrics(results)
    for key in {k for r in results for k in r["scores"]}:
        greedy = row[f"eval/answers/{key}"]
        assert row[f"eval/answers/{key}/mean@3"] == row[f"eval/answers/{key}/best@3"] == greedy
    # (the temperature is traced: the same questions' programs sample at 1)
    cold.cfg = replace(cfg, data=replace(cfg.data, eval=replace(cfg.data.eval, temperature=1.0)))
    first, again, later = (cold.ask(*weights, step=s) for s in (7, 7, 8))
    assert [r["samples"] for r in first] == [r["samples"] for r in again]
    assert [r["samples"] for r in first] != [r["samples"] for r in later]
    assert [r["answer"] for r in first] == [r["answer"] for r in results]  # (greedy: unmoved)
    row = Questions.metrics(first)
    assert row["eval/answers/exact/best@3"] >= row["eval/answers/exact/mean@3"]
    table = cold.report(first, 7)
    assert "sampled answers (3 a question at temperature 1), right: greedy / of the" in table
    rates = [row[f"eval/answers/exact{k}"] for k in ("", "/mean@3", "/best@3")]
    assert "  exact {:.0%} / {:.0%} / {:.0%}".format(*rates) in table
    # (a cache the devices cannot hold is refused before the run's first step, naming the keys)
    monkeypatch.setattr(generate, "memory_bytes", lambda: 1000)
    with pytest.raises(ConfigError, match=r"data\.eval\.sampled_answers=3: .* 15 rows \(5 q"):
        Questions(cfg, HeldOut(cfg), 5)


def test_eval_config_is_checked_with_the_key_named():
    with pytest.raises(ConfigError, match=r"data\.eval\.source"):
        load_config("configs/tiny.yaml", ["data.source=jsonl", "data.path=x.jsonl"])
    with pytest.raises(ConfigError, match=r"data\.eval\.path"):
        load_config(None, ["data.eval.source=jsonl"])
    with pytest.raises(ConfigError, match=r"train\.eval_every"):
        load_config(None, ["train.eval_every=-1"])
    with pytest.raises(ConfigError, match=r"did you mean 'data\.eval\.questions'"):
        load_config(None, ["data.eval.question=3"])
    with pytest.raises(ConfigError, match=r"data\.eval\.sampled_answers: .*questions"):
        load_config(None, ["data.eval.sampled_answers=4", "data.eval.questions=0"])
    with pytest.raises(ConfigError, match=r"data\.eval\.temperature: must be > 0"):
        load_config(None, ["data.eval.temperature=0"])


@pytest.fixture
def image_file(tmp_path):
    path = tmp_path / "red.png"
    Image.fromarray(np.full((40, 56, 3), (200, 20, 20), np.uint8)).save(path)
    return path


def test_templates_render_prompts_as_training_renders_records(image_file):
    """chat: a messages record's user turn, then the assistant marker; plain: a text record
    without its closing EOS. Media through the training preprocessor (placeholders one per
    encoder row); the built-in data's runs use plain."""
    cfg = tiny()
    pre = Preprocessor(Params.from_config(cfg))
    chat, plain = RecordTemplate(pre, chat=True), RecordTemplate(pre, chat=False)
    text = list(b"what is this? ")
    p = chat.prompt("what is this? ", {"vision": [image_file]})
    rows = len(p.media["vision"][0][0]) // cfg.model.vision.merge**2
    assert p.tokens.tolist() == [tok.BOS, tok.USER] + [IMAGE] * rows + text + [tok.ASSISTANT]
    p = plain.prompt(
        "what is this? ", {"vision": [image_file]}
    )  # (the media first, when not placed)
    assert p.tokens.tolist() == [tok.BOS] + [IMAGE] * rows + text
    p = plain.prompt("look: <image> what is this? ", {"vision": [image_file]})
    assert p.tokens.tolist()[:7] == [tok.BOS] + list(b"look: ")
    assert chat.decode([104, 105, tok.EOS]) == "hi" and chat.specials.stop == (tok.EOS,)
    ids = [tok.BOS] + [IMAGE] * rows + text
    assert plain.prompt_ids(ids, {"vision": [image_file]}).tokens.tolist() == ids
    with pytest.raises(RecordError, match=f"need {rows}"):
        plain.prompt_ids(ids[:-3] + [IMAGE], {"vision": [image_file]})
    with pytest.raises(RecordError, match="missing|no such|not found"):
        plain.prompt("what is this? ", {"vision": [image_file.with_name("gone.png")]})
    assert not make_template(cfg).chat
    assert make_template(replace(cfg), "chat").chat


def test_a_manifest_eval_set_brings_its_questions_and_counts_every_sample(tmp_path, resolved):
    """data.eval from a JSONL file with its own index (built with the run's config): every
    record counted once; its chats ask their user turn, its captions their image or clip."""
    from jaxmllm.bench.data import write_dataset
    from jaxmllm.data.index import build_index
    from jaxmllm.loop.answers import Questions
    from jaxmllm.loop.evaluate import eval_source

    manifest = write_dataset(tmp_path, images=6, audio=3)
    small = ["data.image_min_pixels=256", "data.image_max_pixels=1024", "data.audio_max_frames=32"]
    cfg = tiny(
        "data.eval.source=jsonl", f"data.eval.path={manifest}", "data.eval.samples=0", *small
    )
    cfg = replace(cfg, batch=resolved.cfg.batch)  # (the training data's: unchanged)
    with pytest.raises(ConfigError, match=r"data\.eval: no lengths index"):
        eval_source(cfg)
    build_index(cfg, manifest, progress=False)
    source, index = eval_source(cfg)
    assert len(index) == 9
    batches, rejects, _ = plan_set(replace(resolved, cfg=cfg), source, index)
    counted = sum(int(((b["eval_mix"] >= 0) & (b["llm_loss_mask"] > 0)).sum()) for b in batches)
    assert counted == sum(int(source[i].loss[1:].sum()) for i in range(len(index)))
    assert rejects == [] and not list(tmp_path.glob("rejects*"))  # (none: none written)
    questions = Questions(replace(cfg), source, 4)
    shown = [questions.show(p.tokens) for p in questions.prompts]
    assert "<user>what colour is the box?<assistant>" in shown and "" in shown
    assert all(
        t.startswith("a ") or t in ("red", "green", "blue", "yellow", "white", "purple")
        for t in questions.truths
    ), questions.truths


def test_the_eval_sets_rejects_are_written_once_a_start_passed_its_checks(tmp_path, monkeypatch):
    """The eval set (a manifest with an image gone since its index was built) was planned, and
    its rejects appended to rejects.eval.jsonl, before the checkpoint was restored: a start
    refused there (a checkpoint of another format, another process count) left the file in a
    folder the trainer promises to leave as it was, and every resume appended the same rejects
    again. A refused start now writes none; a start that passed its checks writes them, once
    however many times the run starts."""
    from jaxmllm import train
    from jaxmllm.bench.data import write_dataset
    from jaxmllm.data.index import build_index
    from jaxmllm.data.rejects import read_rejects

    manifest = write_dataset(tmp_path / "eval", images=6, audio=3)
    out = tmp_path / "run"
    small = ["data.image_min_pixels=256", "data.image_max_pixels=1024", "data.audio_max_frames=32"]
    eval_set = ["data.eval.source=jsonl", f"data.eval.path={manifest}", "data.eval.samples=0"]
    cfg = tiny(*eval_set, *small, "data.eval.questions=0", f"train.output_dir={out}")
    build_index(cfg, manifest, progress=False)
    record = next(r for r in map(json.loads, manifest.read_text().splitlines()) if "images" in r)
    (manifest.parent / record["images"][0]).unlink()

    class Started(Exception):
        """Raised where the loop would begin: the start-up is done."""

    def refused(*args):
        raise ConfigError("checkpoint 2 is of another format (refused, as check_format does)")

    with monkeypatch.context() as m:
        m.setattr(train, "restore_latest", refused)
        with pytest.raises(ConfigError, match="another format"):
            train.main(cfg)
    assert not (out / "rejects.eval.jsonl").exists() and not (out / "config.json").exists()
    monkeypatch.setattr(train, "MetricsWriter", lambda *a, **k: (_ for _ in ()).throw(Started()))
    for _ in range(2):  # (a start, and a resumed one)
        with pytest.raises(Started):
            train.main(cfg)
        logged = read_rejects(out / "rejects.eval.jsonl")
        assert [(r["id"], r["reason"]) for r in logged] == [(record["id"], "missing_media")]
