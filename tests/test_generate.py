"""KV-cache generation: the cache against recomputing the whole sequence, batching, one program
each for prefill and the decode step, sampling, and the prompt templates.

The model is small and random (fp32, dense attention); prompts carry images and clips, so the
cache is held to the training forward pass (`MultimodalLM.__call__`) with media in the prompt.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmllm.batch.prompts import PromptShapes, prompt_batch, prompt_config, split_answer
from jaxmllm.config import (
    AudioConfig,
    BatchConfig,
    Config,
    DataConfig,
    LLMConfig,
    ModelConfig,
    VisionConfig,
)
from jaxmllm.config.decoder import WindowConfig
from jaxmllm.data.media.image import patchify
from jaxmllm.data.samples import Sample
from jaxmllm.data.text import tokenizer as tok
from jaxmllm.models import decode
from jaxmllm.step.generate import Generator
from jaxmllm.step.program import build_model, model_parts

IMAGE, AUDIO = tok.RESERVED.media["vision"], tok.RESERVED.media["audio"]  # the placeholders

N_MELS = 8
CFG = Config(
    model=ModelConfig(
        vision=VisionConfig(patch_size=4, width=32, depth=2, heads=2, mlp_dim=64),
        audio=AudioConfig(n_mels=N_MELS, width=32, depth=1, heads=2, mlp_dim=64),
        llm=LLMConfig(vocab_size=272, width=32, depth=2, heads=4, kv_heads=2, mlp_dim=64),
        attention="dense",
    ),
    batch=BatchConfig(route_pair_capacity=0, planner="first_fit"),
    data=DataConfig(source="synthetic"),  # (a run of the built-in data: the plain template)
)


def prompt(rng: np.random.Generator, n_text: int, images=(), clips=()) -> Sample:
    """BOS, each image's and clip's placeholder run, then random bytes."""
    media = [
        patchify(rng.integers(0, 256, (4 * h, 4 * w, 3), dtype=np.uint8), 4) for h, w in images
    ]
    audio = [(rng.normal(size=(f, N_MELS)).astype(np.float32), np.arange(f)) for f in clips]
    tokens = [tok.BOS]
    tokens += [IMAGE] * sum(len(p) // 4 for p, _ in media)
    tokens += [AUDIO] * sum(f // 4 for f in clips)
    tokens += rng.integers(0, 256, n_text).tolist()
    return Sample(
        -1,
        np.asarray(tokens, np.int32),
        np.zeros(len(tokens), bool),
        {"vision": media, "audio": audio},
    )


@pytest.fixture(scope="module")
def params():
    return build_model(CFG, seed=3)  # (eager: its ops compile once a process, as test_models)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [
        prompt(rng, 5, images=[(4, 6)], clips=[12]),
        prompt(rng, 11),
        prompt(rng, 3, images=[(2, 2), (4, 2)]),
    ]


@pytest.fixture(scope="module")
def gen(prompts):
    """One generator for the module's prompts (and a spare row): its programs compile once."""
    return Generator(CFG, PromptShapes.fit(prompts, CFG, 10, rows=4))


def test_kv_cache_decoding_equals_recomputing_the_sequence(params, prompts, gen):
    """Every new token's logits against the whole sequence so far run through the training
    forward pass (media in the prompt included): same ids, logits within 1e-5."""
    _held_to_recomputing(CFG, params, prompts, gen, new=6)


# Gemma 3's decoder: sliding windows of 3 tokens in two layers of three, its four norms a layer,
# an image's tokens seeing each other both ways
GEMMA = dataclasses.replace(
    CFG,
    model=dataclasses.replace(
        CFG.model,
        llm=dataclasses.replace(
            CFG.model.llm,
            depth=3,
            norm="rms_offset",
            mlp="gated_gelu_tanh",
            qk_norm=True,
            post_norms=True,
            embed_scale=True,
            attn_scalar=12.0,
            window=WindowConfig(size=3, every=3, rope_theta=100.0),
            bidirectional=("vision",),
            tie_embeddings=True,
            tied_logits_scaled=False,
        ),
    ),
)


def test_kv_cache_decoding_with_sliding_windows_equals_recomputing_the_sequence(prompts):
    """A decoder with sliding-window layers and images attending both ways (Gemma 3's) decodes
    from its cache as the training forward pass computes the whole sequence: a step's query
    over the cache sees its window only; prompts and answers longer than the window; the
    prompt's images both ways in prefill (dense, then block-sparse with the spans' tiles). The
    windowed layers' cache is a ring of their window's length, the full layers' the whole
    row's."""
    params = build_model(GEMMA, seed=5)
    cache = decode.empty_cache(model_parts(GEMMA)[0].merge(*params), rows=2, length=16)
    assert {kind: k.shape[2] for kind, k in cache.k.items()} == {"sliding": 3, "full": 16}
    gen = Generator(GEMMA, PromptShapes.fit(prompts, GEMMA, 8, rows=4))
    _held_to_recomputing(GEMMA, params, prompts, gen, new=5)
    # Block-sparse prefill: the windowed layers score only the tiles their window reaches
    # (blocks of 2, a window of 3: a query block and the one before it), and answer the same.
    bs = dataclasses.replace(
        GEMMA,
        model=dataclasses.replace(GEMMA.model, attention="block_sparse"),
        batch=dataclasses.replace(GEMMA.batch, attention_block=2),
    )
    sparse = Generator(bs, PromptShapes.fit(prompts, bs, 8, rows=4))
    assert 0 < sparse.window_tiles < sparse.tiles
    _held_to_recomputing(GEMMA, params, prompts, sparse, new=5)


def _held_to_recomputing(cfg, params, prompts, gen, new: int) -> None:
    """Every new token's logits of `gen` against the whole sequence so far run through the
    training forward pass of `cfg`: same ids, logits within 1e-5."""
    answers = gen.generate(*params, prompts, max_new_tokens=new, keep_logits=True)
    grown = lambda p, ids: dataclasses.replace(
        p,
        tokens=np.append(p.tokens, ids).astype(np.int32),
        loss=np.zeros(len(p.tokens) + len(ids), bool),
    )
    # The reference at one set of shapes (the longest sequences), so it compiles once.
    shapes = PromptShapes.fit(
        [grown(p, a.ids) for p, a in zip(prompts, answers, strict=True)], cfg, 0
    )
    parts = model_parts(prompt_config(cfg, shapes))[0]
    forward = jax.jit(lambda params, frozen, mb: parts.merge(params, frozen)(mb))
    for t in range(new):
        sequences = [grown(p, a.ids[:t]) for p, a in zip(prompts, answers, strict=True)]
        logits = np.asarray(forward(*params, prompt_batch(sequences, shapes, cfg)))
        for b, (seq, answer) in enumerate(zip(sequences, answers, strict=True)):
            want = logits[b, 0, len(seq.tokens) - 1]  # the last token's
            np.testing.assert_allclose(answer.logits[t], want, rtol=1e-5, atol=1e-5)
            assert answer.ids[t] == int(np.argmax(want))
    assert all(len(a.ids) == new and not a.stopped for a in answers)


def test_batching_changes_no_answer(params, prompts, gen):
    """Prompts of different lengths, with and without media, decoded together (right-padded,
    a spare row) give each the ids and logits it gets alone (in the first row, the others
    empty: the same program)."""
    new = 8
    batched = gen.generate(*params, prompts, max_new_tokens=new, keep_logits=True)
    for p, b in zip(prompts, batched, strict=True):
        [a] = gen.generate(*params, [p], max_new_tokens=new, keep_logits=True)
        assert a.ids == b.ids
        np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), rtol=1e-5, atol=1e-5)


def test_prefill_scores_the_prompt_as_training_does_not_the_cache(params, prompts, gen):
    """Prefill scored every prompt token against the whole cache (prompt and new tokens, dense
    [B, heads, P, S] scores): a long --max-new-tokens cost prefill as much as a long prompt.
    It scores the prompt among itself now, with the run's attention: its FLOPs do not grow
    with the room left for new tokens, and block-sparse prefill (host-made tiles of each
    prompt's causal blocks) answers as the dense one does."""
    sampling = (np.int32(0), np.int32(0), np.float32(0), np.float32(1))
    flops = {}
    for new in (16, 2048):
        g = Generator(CFG, PromptShapes.fit(prompts, CFG, new, rows=4))
        mb = prompt_batch(prompts, g.shapes, CFG)
        cost = g.prefill.lower(*params, mb, None, sampling).compile().cost_analysis()
        flops[new] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert flops[2048] < 1.05 * flops[16], flops

    bs = dataclasses.replace(
        CFG,
        model=dataclasses.replace(CFG.model, attention="block_sparse"),
        batch=dataclasses.replace(CFG.batch, attention_block=32),
    )
    shapes = PromptShapes.fit(prompts, bs, 6, rows=4)
    assert shapes.prompt_len % 32 == 0
    sparse = Generator(bs, shapes).generate(*params, prompts, max_new_tokens=6, keep_logits=True)
    dense = gen.generate(*params, prompts, max_new_tokens=6, keep_logits=True)
    for a, b in zip(sparse, dense, strict=True):
        assert a.ids == b.ids
        np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), rtol=1e-5, atol=1e-5)


def test_a_run_with_context_groups_answers_as_one_without(params, prompts, gen):
    """A run with mesh.context asks its held-out questions under its own mesh: a prompt row is
    whole on its device, so nothing is gathered over the group (the gather of the encoder
    rows, sized for the training batch, failed on the prompt batch: every such run with
    data.eval.questions stopped at its first evaluation)."""
    import sharding

    cfg = dataclasses.replace(
        CFG,
        model=dataclasses.replace(CFG.model, attention="block_sparse"),
        batch=dataclasses.replace(
            CFG.batch, attention_block=32, planner="orchestrated", route_pair_capacity=-1
        ),
        mesh=dataclasses.replace(CFG.mesh, data=4, context=2),
    )
    with jax.set_mesh(sharding.make_mesh(cfg.mesh)):
        got = Generator(cfg, PromptShapes.fit(prompts, cfg, 4, rows=4)).generate(
            *params, prompts, max_new_tokens=4, keep_logits=True
        )
    want = gen.generate(*params, prompts, max_new_tokens=4, keep_logits=True)
    for a, b in zip(got, want, strict=True):
        assert a.ids == b.ids
        np.testing.assert_allclose(np.stack(a.logits), np.stack(b.logits), rtol=1e-5, atol=1e-5)


def test_stop_ids_end_a_row_and_are_kept(params, prompts, gen):
    free = gen.generate(*params, prompts, max_new_tokens=8)
    stop = free[0].ids[2]
    stopped = gen.generate(*params, prompts, max_new_tokens=8, stop_ids=frozenset({stop}))
    first = free[0].ids.index(stop)
    assert stopped[0].ids == free[0].ids[: first + 1] and stopped[0].stopped
    for f, s in zip(free[1:], stopped[1:], strict=True):  # the others go on as before
        cut = f.ids.index(stop) + 1 if stop in f.ids else len(f.ids)
        assert s.ids == f.ids[:cut]


def test_one_compiled_program_for_prefill_and_one_for_the_step(params, prompts, gen):
    """However many tokens, prompts or sampling settings: one program each."""
    gen.generate(*params, prompts, max_new_tokens=10)
    gen.generate(*params, prompts[1:], max_new_tokens=7, temperature=0.7, top_p=0.9, seed=1)
    assert gen.prefill._cache_size() == 1
    assert gen.step._cache_size() == 1


def test_the_command_line_answers_from_a_runs_checkpoint(params, gen, tmp_path, capsys):
    """`python -m jaxmllm.generate --run`: the run's config and checkpoint (params only),
    prompts rendered by its template, one JSON object a prompt, the generator's own answers;
    a prompt given as its ids is the same prompt; a bad run or step is a one-line error."""
    import orbax.checkpoint as ocp

    from jaxmllm import generate
    from jaxmllm.loop.checkpoint import make_checkpoint_manager, write_config

    cfg = dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, output_dir=str(tmp_path)))
    write_config(cfg, tmp_path)  # a run as the trainer leaves it: config.json, checkpoints/3
    state = {"params": params[0], "frozen": params[1], "step": np.int32(3)}
    with make_checkpoint_manager(cfg) as mngr:
        mngr.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)
    texts = ["12 13 14", "7", "hello", "what is this? "]  # (gen's shapes: its programs)
    run = ["--run", str(tmp_path), "--max-new-tokens", "10", "--json"]
    assert generate.main([*run, *[a for t in texts for a in ("--prompt", t)]]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    rendered = [[tok.BOS, *t.encode()] for t in texts]  # the plain template: BOS text
    as_samples = [Sample(-1, np.asarray(r, np.int32), np.zeros(len(r), bool)) for r in rendered]
    want = gen.generate(*params, as_samples, max_new_tokens=10, stop_ids=frozenset({tok.EOS}))
    assert [g["ids"] for g in got] == [w.ids for w in want]
    byte = tok.ByteTokenizer()
    assert [g["text"] for g in got] == [
        byte.decode([i for i in w.ids if i != tok.EOS]) for w in want
    ]
    ids = [a for r in rendered for a in ("--prompt-ids", ",".join(map(str, r)))]
    assert generate.main([*run, "--step", "3", *ids]) == 0
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == got
    assert generate.main(["--run", str(tmp_path / "nowhere"), "--prompt", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert generate.main([*run, "--step", "5", "--prompt", "1"]) == 2
    assert "no checkpoint 5" in capsys.readouterr().err


def test_generation_refuses_ids_outside_the_vocabulary_and_prompts_past_memory(
    params, tmp_path, capsys
):
    """Ids past the vocabulary or negative generated garbage with exit 0; a prompt too long
    for the device allocated its dense prefill scores and the cache (42 GB) and failed in a
    traceback. Each is one line now, before anything is compiled or allocated."""
    import orbax.checkpoint as ocp

    from jaxmllm import generate
    from jaxmllm.loop.checkpoint import make_checkpoint_manager, write_config

    cfg = dataclasses.replace(CFG, train=dataclasses.replace(CFG.train, output_dir=str(tmp_path)))
    write_config(cfg, tmp_path)
    state = {"params": params[0], "frozen": params[1], "step": np.int32(1)}
    with make_checkpoint_manager(cfg) as mngr:
        mngr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(state)), force=True)
    run = ["--run", str(tmp_path), "--max-new-tokens", "4"]
    for ids, bad in (("257,49,272", 272), ("257,-3,49", -3)):
        assert generate.main([*run, f"--prompt-ids={ids}"]) == 2
        err = capsys.readouterr().err
        assert f"prompt 1: token id {bad} is outside the model's vocabulary" in err, err
        assert "model.llm.vocab_size=272" in err and "Traceback" not in err
        assert err.count("\n") == 1
    long = ",".join(["49"] * 2_000_000)  # (dense scores of 2M tokens: 64 TB)
    assert generate.main([*run, "--prompt-ids", long]) == 2
    err = capsys.readouterr().err
    assert "2000000 prompt tokens + --max-new-tokens 4" in err and "TB" in err, err[:500]
    assert "shorten the prompt" in err and err.count("\n") == 1


def test_a_video_too_short_for_a_temporal_patch_is_a_one_line_error(tmp_path):
    """A one-frame video for a model whose temporal patch is two frames: a division by zero in
    generation's prompt (Qwen3-VL's timestamps), silently left out without them; the record
    error training gives it now."""
    from video_files import grey_frames, write_video

    from jaxmllm.data.rejects import RecordError
    from jaxmllm.data.text.template import make_template

    vision = dataclasses.replace(CFG.model.vision, temporal_patch=2, video=True)
    stamps = dataclasses.replace(CFG.data, video_timestamps=True)
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, vision=vision), data=stamps)
    clip = write_video(tmp_path / "one.mp4", grey_frames(1, 32, 32), fps=4)
    template = make_template(cfg, "plain")
    with pytest.raises(RecordError, match=r"video_too_short: video 0: 1 frames .* temporal patch"):
        template.prompt("which way? ", {"video": [clip]})
    two = write_video(tmp_path / "two.mp4", grey_frames(2, 32, 32), fps=4)
    assert len(template.prompt("which way? ", {"video": [two]}).media["vision"]) == 1


def test_sampling_is_seeded_and_top_p_narrows_to_the_likeliest():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(64, 50)) * 3, jnp.float32)
    key, other = jax.random.key(0), jax.random.key(1)
    jitted = jax.jit(decode.pick)
    pick = lambda k, t, p: np.asarray(jitted(logits, k, jnp.float32(t), jnp.float32(p)))
    greedy = np.argmax(np.asarray(logits), -1)
    assert (pick(key, 0.0, 1.0) == greedy).all()
    assert (pick(key, 1.0, 1e-6) == greedy).all()  # the nucleus is the likeliest token alone
    hot = pick(key, 1.0, 1.0)
    assert (hot == pick(key, 1.0, 1.0)).all() and (hot != pick(other, 1.0, 1.0)).any()
    assert (hot != greedy).any()
    # top_p keeps the smallest set of likeliest tokens reaching p: never one outside it
    probs = np.asarray(jax.nn.softmax(logits, -1))
    order = np.argsort(-probs, -1)
    mass = np.take_along_axis(probs, order, -1).cumsum(-1)
    for seed in range(5):
        got = pick(jax.random.key(seed), 1.0, 0.5)
        rank = np.argmax(order == got[:, None], -1)
        allowed = (mass < 0.5).sum(-1)  # ranks 0..allowed are inside the nucleus
        assert (rank <= allowed).all()


def test_split_answer_cuts_a_sample_before_its_first_loss_token():
    tokens = np.array(
        [tok.BOS, IMAGE, IMAGE, 65, 66, 67, tok.EOS],
        np.int32,
    )
    loss = np.array([0, 0, 0, 0, 1, 1, 1], bool)
    prompt_part, answer = split_answer(Sample(0, tokens, loss))
    assert prompt_part.tokens.tolist() == tokens[:4].tolist()
    assert answer.tolist() == [66, 67, tok.EOS]
    assert split_answer(Sample(0, tokens, np.array([0, 1, 1, 1, 1, 1, 1], bool))) is None
