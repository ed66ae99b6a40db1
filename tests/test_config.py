"""Config loading: types, unknown keys with the closest name, overrides, the shipped configs."""

import re
from pathlib import Path

import pytest

from jaxmllm.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")))
def test_shipped_configs_load_and_start_with_their_command(name):
    path = ROOT / "configs" / name
    assert isinstance(load_config(path), Config)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# python -m jaxmllm.train --config configs/"), first


def test_unknown_key_names_file_key_and_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert str(path) in msg and "optim.learning_rate" in msg and "optim.lr" in msg


def test_unknown_section(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("modle: {}\n")
    with pytest.raises(ConfigError, match="did you mean 'model'"):
        load_config(path)


def test_wrong_type_names_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("batch:\n  microbatches: two\n")
    with pytest.raises(ConfigError, match=r"batch\.microbatches must be an integer"):
        load_config(path)


def test_check_failure_names_full_key():
    with pytest.raises(ConfigError, match=r"model\.llm\.kv_heads"):
        load_config(None, ["model.llm.heads=4", "model.llm.kv_heads=3"])


@pytest.mark.parametrize(
    "sets, key",
    [
        (["model.llm.depth=4", "model.llm.kv_shared_layers=4"], "kv_shared_layers"),
        (["model.llm.kv_shared_wide_mlp=true"], "kv_shared_wide_mlp"),
        (["model.llm.per_layer_dim=8", "model.llm.per_layer_pad_id=300"], "per_layer_pad_id"),
        (  # (the full layer 3 shared, no full layer before it)
            [
                "model.llm.depth=4",
                "model.llm.window.size=8",
                "model.llm.window.layers=[0,1,2]",
                "model.llm.kv_shared_layers=2",
            ],
            "kv_shared_layers",
        ),
        (
            [
                "model.llm.kv_shared_layers=1",
                "model.llm.lora.rank=4",
                "model.llm.lora.dropout=0.1",
            ],
            "lora.dropout",
        ),
        (["model.llm.kv_shared_layers=1", "mesh.stage=2"], "mesh.stage"),
    ],
)
def test_per_layer_inputs_and_shared_keys_refuse_what_they_cannot_run(sets, key):
    """Every layer sharing keys, a wide MLP without shared layers, a pad id past the per-layer
    table, a shared layer with no earlier layer of its kind, adapter dropout on keys that are
    computed twice, pipeline stages: refused naming the key."""
    base = ["model.llm.vocab_size=300", "data.tokenizer=byte"]
    with pytest.raises(ConfigError, match=re.escape(key)):
        load_config(None, [*base, *sets])


def test_a_vocabulary_smaller_than_the_byte_tokenizer_is_refused_only_with_byte_data():
    """Byte ids need 264 rows: refused where bytes are tokenized (the built-in data, a data set
    under data.tokenizer: byte), naming the key; a config without data (an HF checkpoint's
    own, `hf check` of a 99-token model) or with another tokenizer is not held to it (that
    tokenizer's size is checked when the source opens)."""
    small = "model.llm.vocab_size=200"
    with pytest.raises(
        ConfigError, match=r"model\.llm\.vocab_size: the byte tokenizer needs at least 264"
    ):
        load_config("configs/tiny.yaml", [small])
    with pytest.raises(ConfigError, match=r"model\.llm\.vocab_size: the byte tokenizer"):
        load_config(None, [small, "data.path=train.jsonl"])
    assert load_config(None, [small]).model.llm.vocab_size == 200
    assert load_config(None, [small, "data.path=x.jsonl", "data.tokenizer=ckpt/"]).data.path


@pytest.mark.parametrize(
    "setting, key",
    [
        ("model.attention=dense", r"model\.attention: must be block_sparse with mesh\.context=2"),
        ("batch.planner=grain", r"batch\.planner: must be orchestrated with mesh\.context=2"),
    ],
)
def test_context_parallelism_refuses_what_it_cannot_split(setting, key):
    split = ["mesh.context=2", "model.attention=block_sparse", "batch.planner=orchestrated"]
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*split, setting])
    load_config(None, split)  # (alone, the split loads)


@pytest.mark.parametrize(
    "setting, key",
    [
        ("mesh.context_steps=some", r"mesh\.context_steps: must be one of all, long"),
        ("mesh.context=1", r"mesh\.context_steps: long splits .*set mesh\.context > 1"),
    ],
)
def test_a_context_degree_per_step_refuses_what_it_cannot_split(setting, key):
    """mesh.context_steps: long (issue 57) needs groups to plan; its spec plans each device's
    own rows in the base steps and groups in the long ones (a long variant at the base's
    tiles where none is set), by either strategy."""
    from jaxmllm.batch.prompts import PromptShapes, prompt_config
    from jaxmllm.config.spec import BatchSpec
    from jaxmllm.resolve.resumed import context_changed

    per_step = ["mesh.context=2", "mesh.context_steps=long", "batch.llm_long_tiles=[]"]
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*per_step, setting])
    tiles = ["batch.llm_tiles=40", "batch.vision_tiles=9", "batch.audio_tiles=9"]
    spec = BatchSpec.of(load_config(None, [*per_step, *tiles]), resolved=False)
    assert (spec.context, spec.long_context, spec.variants) == (1, 2, 2)
    assert (spec.at(1).context, spec.at(1).long_context, spec.top.group_row_len) == (2, 0, 8192)
    assert spec.at(0).context == 1 and spec.tile_caps(1)["llm"] == 40
    # (ulysses too: its long variants' groups exchange heads, the base's rows are a device's)
    ulysses = load_config(None, [*per_step, *tiles, "mesh.context_strategy=ulysses"])
    spec = BatchSpec.of(ulysses, resolved=False).at(1)
    assert (spec.context, spec.context_strategy) == (2, "ulysses")
    # (a checkpoint of static groups resumed with them per step: its sizes resolved anew)
    cfg = load_config(None, per_step)
    shapes = PromptShapes(rows=8, prompt_len=64, total_len=96, units={"vision": 64, "audio": 64})
    assert prompt_config(cfg, shapes).mesh.context == 1  # (questions' rows: whole, no groups)
    assert context_changed(cfg, {"mesh.context": 2})
    assert not context_changed(cfg, {"mesh.context": 2, "mesh.context_steps": "long"})


def test_context_parallelism_names_what_the_model_is_before_what_can_change():
    """Qwen3.5 (M-RoPE and linear-attention layers) with mesh.context=2: the linear layers are
    the reason, and no advice changes the model (its M-RoPE positions, its attention)."""
    hybrid = ["model.llm.depth=4", "model.llm.linear.every=4", "model.llm.linear.key_heads=2"]
    hybrid += ["model.llm.linear.value_heads=4", "model.llm.mrope_section=[16,24,24]"]
    for defaults in ([], ["model.attention=dense", "batch.planner=grain"]):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["mesh.context=2", *hybrid, *defaults])
        assert "mesh.context: 2: a decoder with linear-attention" in str(err.value)
        assert "context_strategy: ulysses" in str(err.value)  # (the way that splits it)
        assert "mrope" not in str(err.value)
    # (M-RoPE alone splits: the batch carries each token's index in its document)
    load_config(None, ["mesh.context=2", "model.llm.mrope_section=[16,24,24]"])


@pytest.mark.parametrize(
    "setting, key",
    [
        ("mesh.context=3", r"model\.llm\.heads: 16: .*16 attention heads over .*mesh\.context=3"),
        (
            "mesh.tensor=2 mesh.context=16",
            r"model\.llm\.heads: 16: .*8 attention heads per tensor rank .*mesh\.context=16",
        ),
        ("mesh.context=8", r"model\.llm\.linear\.value_heads: 4: .*4 value heads .*context=8"),
        (
            "mesh.tensor=2 mesh.context=4",
            r"model\.llm\.linear\.value_heads: 4: .*2 value heads per tensor rank .*context=4",
        ),
        (
            "mesh.context_strategy=scatter",
            r"mesh\.context_strategy: must be one of gather, ulysses",
        ),
    ],
)
def test_ulysses_refuses_heads_the_group_does_not_divide(setting, key):
    """mesh.context_strategy: ulysses splits attention's heads (a tensor rank's) and a Gated
    DeltaNet's value heads over the group: counts it does not divide are refused, naming the
    keys; a hybrid whose value heads it divides loads, also with fewer key heads than the
    group (repeated; gather refuses it: the test above)."""
    ulysses = ["mesh.context_strategy=ulysses", "mesh.context=2"]
    hybrid = ["model.llm.depth=4", "model.llm.linear.every=4", "model.llm.linear.key_heads=2"]
    hybrid += ["model.llm.linear.value_heads=4"]
    with pytest.raises(ConfigError, match=key):
        load_config(None, [*ulysses, *hybrid, *setting.split()])
    cfg = load_config(None, [*ulysses, *hybrid])
    assert cfg.mesh.context_strategy == "ulysses" and cfg.model.llm.linear.enabled
    assert load_config(None, [*ulysses, *hybrid, "mesh.context=4"]).mesh.context == 4


@pytest.mark.parametrize(
    "setting, key",
    [
        ("model.llm.bidirectional=[video]", r"model\.llm\.bidirectional: 'video': each must be"),
        ("model.audio.enabled=false", r"model\.llm\.bidirectional: 'audio': each must be"),
        ("model.attention=cudnn", r"model\.attention: the decoder's bidirectional spans"),
        ("mesh.context=2", r"mesh\.context: 2: the decoder's bidirectional spans"),
    ],
)
def test_bidirectional_spans_refuse_what_does_not_run_them(setting, key):
    """Images or clips attending both ways (Gemma 3's images): an encoder the model lacks, the
    cuDNN kernel and the context split are refused, naming the key."""
    spans = "model.llm.bidirectional=[vision,audio]"
    with pytest.raises(ConfigError, match=key):
        load_config(None, [spans, setting])
    assert load_config(None, [spans]).model.llm.bidirectional == ("vision", "audio")


def test_overrides_apply_and_coerce():
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        ["optim.lr=1", "train.steps=7", "model.vision.enabled=false"],
    )
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.train.steps == 7 and not cfg.model.vision.enabled


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_config(None, ["optim.lr"])
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        load_config(None, ["train.step=3"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_small_config_is_a_realistic_single_gpu_model():
    import jax

    from jaxmllm.resolve.attention import resolve_attention
    from jaxmllm.step.program import model_parts

    cfg = load_config(ROOT / "configs" / "small.yaml", ["batch.route_pair_capacity=64"])
    cfg = resolve_attention(cfg)  # (attention: auto, for this machine's devices)
    parts, _ = model_parts(cfg)
    count = sum(x.size for x in jax.tree.leaves(nnx_pure(parts.template)))
    assert 300e6 <= count <= 1e9, count


def nnx_pure(state):
    from flax import nnx

    return nnx.to_pure_dict(state)


def test_a_resumed_run_keeps_the_auto_sizes_its_checkpoints_were_planned_with(tmp_path):
    """`-1` batch sizes come from dry runs as long as the run: a resumed run with more steps
    takes them from the run that wrote the checkpoints (else it would be refused); a fresh
    output dir, or a key the user set, resolves as configured."""
    from dataclasses import replace

    from jaxmllm.loop.checkpoint import check_resumable, write_config
    from jaxmllm.resolve.resumed import keep_resolved

    cfg = load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path}"])
    assert cfg.batch.route_pair_capacity == -1
    planned = replace(cfg, batch=replace(cfg.batch, route_pair_capacity=37, devices_per_host=8))
    write_config(planned, tmp_path)
    assert keep_resolved(cfg, tmp_path) is cfg  # no checkpoints yet: resolve anew
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    longer = replace(cfg, train=replace(cfg.train, steps=cfg.train.steps * 10))
    kept = keep_resolved(longer, tmp_path)
    assert (kept.batch.route_pair_capacity, kept.batch.devices_per_host) == (37, 8)
    check_resumable(kept, tmp_path)  # accepted
    own = replace(longer, batch=replace(longer.batch, route_pair_capacity=48))
    assert keep_resolved(own, tmp_path).batch.route_pair_capacity == 48  # the user's value
    with pytest.raises(ConfigError, match="route_pair_capacity: 37 -> 48"):
        check_resumable(keep_resolved(own, tmp_path), tmp_path)


def test_fixed_length_tuples_and_dotless_floats_are_read():
    cfg = load_config(None, ["data.image_mean=[0.48, 0.46, 0.41]", "optim.lr=1e-3"])
    assert cfg.data.image_mean == (0.48, 0.46, 0.41) and cfg.optim.lr == 1e-3
    with pytest.raises(ConfigError, match=r"data\.image_std must be a list of 3 values"):
        load_config(None, ["data.image_std=[0.5, 0.5]"])
    with pytest.raises(ConfigError, match=r"image_std: every channel's std must be > 0"):
        load_config(None, ["data.image_std=[0.5, 0, 0.5]"])


@pytest.mark.parametrize(
    "sets, policy",
    [
        (["model.remat=true"], "full"),
        (["model.remat=true", "model.remat_policy=nothing"], "full"),
        (["model.remat=true", "model.remat_policy=dots"], "save_dots"),
        (["model.remat=false", "model.remat_policy=dots"], "none"),
        (["model.remat=save_dots_except_mlp"], "save_dots_except_mlp"),
    ],
)
def test_remat_as_configs_wrote_it_before_the_names_reads_as_its_policy(sets, policy):
    cfg = load_config(None, sets)
    assert cfg.model.remat == policy
    assert cfg.model.remat_of("llm") == cfg.model.remat_of("vision") == policy


def test_a_tower_takes_its_own_remat_policy_and_bad_ones_say_what_to_write():
    cfg = load_config(None, ["model.remat=save_dots", "model.vision.remat=full"])
    assert [cfg.model.remat_of(t) for t in ("vision", "audio", "llm")] == [
        "full",
        "save_dots",
        "save_dots",
    ]
    with pytest.raises(
        ConfigError, match=r"model\.vision\.remat: true .* model\.vision\.remat: full"
    ):
        load_config(None, ["model.vision.remat=true"])
    with pytest.raises(ConfigError, match=r"model\.remat: must be one of none, full, save_dots"):
        load_config(None, ["model.remat=dots"])
    with pytest.raises(ConfigError, match=r"model\.remat_policy is gone.*model\.remat: save_dots"):
        load_config(None, ["model.remat=full", "model.remat_policy=dots"])


def test_a_run_written_before_the_remat_names_resumes_under_any_policy(tmp_path):
    """Its config.json (remat: true, remat_policy: nothing) reads back as `full`, and the
    policy may change on resume: it changes no state."""
    import json

    from jaxmllm.config import from_dict, to_dict
    from jaxmllm.loop.checkpoint import check_resumable

    cfg = load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path}"])
    old = to_dict(cfg)
    old["model"]["remat"], old["model"]["remat_policy"] = True, "nothing"
    for tower in ("vision", "audio", "llm"):
        del old["model"][tower]["remat"]
    (tmp_path / "config.json").write_text(json.dumps(old))
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    assert from_dict(Config, old).model.remat == "full"
    resumed = lambda *sets: load_config(
        "configs/tiny.yaml", [f"train.output_dir={tmp_path}", *sets]
    )
    check_resumable(resumed("model.llm.remat=save_qkv"), tmp_path)
    with pytest.raises(ConfigError, match="model.llm.width"):  # (what does change state)
        check_resumable(resumed("model.llm.width=64"), tmp_path)


def test_infinity_means_no_cap_and_other_non_finite_floats_are_refused(tmp_path):
    """A cap (`max_*`) may be .inf, meaning none; NaN anywhere, and infinity elsewhere, are
    numbers nowhere downstream; an integer past a float's range is refused, not a traceback."""
    cfg = load_config("configs/tiny.yaml", ["data.max_audio_seconds=.inf"])
    assert cfg.data.max_audio_seconds == float("inf")
    for bad in ["data.max_audio_seconds=.nan", "data.max_video_seconds=-.inf", "optim.b1=.inf"]:
        with pytest.raises(ConfigError, match=r"must be a finite number"):
            load_config("configs/tiny.yaml", [bad])
    path = tmp_path / "huge.yaml"
    path.write_text(f"model:\n  llm:\n    rope_theta: {'9' * 400}\n")
    with pytest.raises(ConfigError, match=r"model.llm.rope_theta is over a float's range"):
        load_config(path)
