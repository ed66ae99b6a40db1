"""PEFT LoRA adapters in and out, with transformers and peft themselves as the oracle: adapters
peft wrote put on tiny Qwen2-VL, Qwen3-VL, Qwen3.5 and LLaVA checkpoints built in tmp_path give our
logits with an image in the prompt within 1e-4 of `PeftModel.from_pretrained`'s, and on tiny
Gemma 3 and Gemma 4 text decoders (their sliding and full layers stacks of ours, Gemma 4's
shared layers without k and v) their text's; a LoRA run
trained from such a checkpoint exports an adapter peft loads (and `--merged`, the model with
it merged) that gives the run's own logits; adapters with modules the model lacks, or on some
layers of a module only, are refused naming them."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import hf_models
import numpy as np
import pytest

from jaxmllm.hf.check_whole import check_all
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.importer import write_config

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]

LLM = r"model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
LINEAR = r"model\.language_model\.layers\.\d+\.linear_attn\.(in_proj_(qkv|z|b|a)|out_proj)"


def peft_adapter(source: str, out: Path, seed: int = 0, **options) -> str:
    """An adapter of the checkpoint as peft writes one, its A and B at random (a trained
    adapter's), the modules it saves whole moved off the checkpoint's. The same adapter each
    run: peft draws A from torch's global generator, seeded here (unseeded, each run checked
    another adapter; one draw in CI put Qwen2-VL's packed video sample 1.14e-4 off, others 3e-5
    to 8e-5: fp32's rounding, which a large adapter makes larger there, on both sides, since
    transformers' own fp32 logits of that sample are 3.6e-5 off its fp64 ones, 1.2e-5 elsewhere)."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(source)
    config = peft.LoraConfig(init_lora_weights=False, **options)
    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name or "modules_to_save" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    wrapped.save_pretrained(str(out))
    return str(out)


def logits(source: str, adapter: str = "") -> np.ndarray:
    """transformers' logits of a fixed text (peft's with `adapter`)."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(source).eval()
    if adapter:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        return model(input_ids=ids).logits[0].numpy()


CASES = {
    # The LLM and the vision tower's fused qkv (its rotary permutation: the link's own) and
    # output projection, scaled by rslora and a pattern of their own; the merger saved whole.
    "qwen2_vl": (
        hf_models.qwen2_vl,
        dict(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            alpha_pattern={"qkv": 12},
            target_modules=rf"(?:{LLM}|model\.visual\.blocks\.\d+\.attn\.(qkv|proj))",
            modules_to_save=["model.visual.merger.mlp.0"],
        ),
    ),
    # The LLM, the tower's fused qkv and output projection, and the merger's first matrix
    # with DeepStack's mergers' (our projector's adapters: the main one's and each level's).
    "qwen3_vl": (
        hf_models.qwen3_vl,
        dict(
            r=4,
            lora_alpha=8,
            target_modules=rf"(?:{LLM}|model\.visual\.blocks\.\d+\.attn\.(qkv|proj)|"
            r"model\.visual\.(merger|deepstack_merger_list\.\d+)\.linear_fc1)",
        ),
    ),
    # Qwen3.5's hybrid LLM (its full-attention layers' and its linear layers' matrices: the
    # fused in_proj_qkv regrouped by key head), the tower's qkv and output, the merger's fc1.
    "qwen3_5": (
        hf_models.qwen3_5_whole,
        dict(
            r=4,
            lora_alpha=8,
            target_modules=rf"(?:{LLM}|{LINEAR}|model\.visual\.blocks\.\d+\.attn\.(qkv|proj)|"
            r"model\.visual\.merger\.linear_fc1)",
        ),
    ),
    # The LLM and the CLIP tower's q and v (LLaVA's LLM has q_proj too: a regex tells them
    # apart), the projector's first matrix, each module of a rank of its own.
    "llava": (
        hf_models.llava,
        dict(
            r=2,
            lora_alpha=4,
            target_modules=rf"(?:{LLM}|model\.vision_tower\.encoder\.layers\.\d+\.self_attn\."
            r"(q|v)_proj|model\.multi_modal_projector\.linear_1)",
            rank_pattern={"linear_1": 3},
        ),
    ),
    # Gemma 3: its LLM (sliding and full layers) and the SigLIP tower's q and v, the images
    # read both ways in the packed check. (Its projector's matrix is a bare parameter,
    # `mm_input_projection_weight`, which no PEFT target_modules names.)
    "gemma3": (
        hf_models.gemma3,
        dict(
            r=4,
            lora_alpha=8,
            target_modules=rf"(?:{LLM}|model\.vision_tower\.encoder\.layers\.\d+\.self_attn\."
            r"(q|v)_proj)",
        ),
    ),
    # Gemma 4: its LLM, its own tower's q and v and its audio conformer's attention and
    # feed-forwards (each a Linear inside a clippable wrapper, `.linear`, its bounds biting:
    # the adapter works inside them), the images read both ways in the sliding layers, clips
    # packed beside them.
    "gemma4": (
        lambda d: hf_models.gemma4(d, clipped=True, audio=(294, 295, 296)),
        dict(
            r=4,
            lora_alpha=8,
            target_modules=rf"(?:{LLM}|model\.vision_tower\.encoder\.layers\.\d+\.self_attn\."
            r"(q|v)_proj\.linear|model\.audio_tower\.layers\.\d+\.(self_attn\.(q_proj|k_proj|"
            r"v_proj|post)|feed_forward[12]\.ffw_layer_[12])\.linear)",
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_peft_adapter_gives_peft_s_logits_with_an_image_in_the_prompt(name, tmp_path):
    """`hf check DIR --adapter A`: ours (the adapter read as `hf import --adapter` reads it)
    against transformers + `PeftModel.from_pretrained`, every line within 1e-4, the adapter
    moving the logits far more than that; and `hf import --adapter` writes the LoRA sections
    it implies."""
    build, options = CASES[name]
    source = build(tmp_path / name)
    adapter = peft_adapter(source, tmp_path / "adapter", **options)
    assert np.abs(logits(source, adapter) - logits(source)).max() > 0.05
    results = check_all(source, adapter=adapter)
    # (the whole model on samples packed into one row, an image in one of them)
    assert any(r["role"] == "model" and "-patch image" in r["what"] for r in results)
    for result in results:  # (Qwen3.5's hybrid: the 1e-3 of its linear layers' chunks)
        assert result["max_abs_diff"] < (1e-3 if name == "qwen3_5" else 1e-4), result
    cfg = write_config(tmp_path / "run.yaml", model=source, adapter=adapter)
    m = cfg.model
    assert m.init_from.adapter == str(Path(adapter).resolve())
    linear = ("in_qkv", "in_z", "in_b", "in_a", "out_proj") if name == "qwen3_5" else ()
    assert m.llm.lora.rank == options["r"] and set(m.llm.lora.targets) == set(
        ("q", "k", "v", "o", "gate", "up", "down", *linear)
    )
    if name == "qwen2_vl":
        assert set(m.vision.lora.targets) == {"q", "k", "v", "o"} and not m.vision.freeze
        assert m.projector_freeze is False and m.projector_lora.rank == 0  # (saved whole)
    elif name in ("qwen3_vl", "qwen3_5"):
        assert set(m.vision.lora.targets) == {"q", "k", "v", "o"}
        assert m.projector_lora.rank == 4 and m.projector_lora.targets == ("fc1",)
    elif name in ("gemma3", "gemma4"):
        assert set(m.vision.lora.targets) == {"q", "v"} and m.projector_lora.rank == 0
        if name == "gemma4":  # (fc1, fc2: both feed-forwards')
            assert set(m.audio.lora.targets) == {"q", "k", "v", "o", "fc1", "fc2"}
            assert any("-frame clip" in r["what"] for r in results)
    else:
        assert set(m.vision.lora.targets) == {"q", "v"}
        assert m.projector_lora.rank == 3 and m.projector_lora.targets == ("fc1",)


def test_an_adapter_of_modules_the_model_lacks_is_refused_naming_them(tmp_path):
    """target_modules naming modules no adapter of the model sits on (the LM head, a name no
    module has), weights of such a module, a DoRA adapter: refused, naming them, before
    anything trains."""
    source = hf_models.llava(tmp_path / "llava")
    adapter = Path(
        peft_adapter(
            source, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"]
        )
    )
    with pytest.raises(
        FamilyError,
        match=r"target_modules 'lm_head' name no module this model "
        r"can put an adapter on \(jaxmllm adapts .*q_proj",
    ):
        write_config(tmp_path / "run.yaml", model=source, adapter=str(adapter))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "qkv_proj"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(FamilyError, match=r"'qkv_proj' name no module"):
        write_config(tmp_path / "run.yaml", model=source, adapter=str(adapter))
    config["target_modules"] = ["q_proj"]  # (the config hides the LM head's weights)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(
        FamilyError,
        match=r"tensors name modules this model has no adapter on, "
        r"e\.g\. .*base_model\.model\.lm_head\.lora_A\.weight",
    ):
        write_config(tmp_path / "run.yaml", model=source, adapter=str(adapter))
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(FamilyError, match="DoRA adapters are not supported"):
        write_config(tmp_path / "run.yaml", model=source, adapter=str(adapter))


def test_modules_saved_whole_are_the_outermost_and_hold_no_adapters():
    """What a LoRA export saves whole (PEFT's modules_to_save) as PEFT can load it: a Gemma 4
    clipped linear's wrapper, not also its `.linear` inside it (wrapped twice, PEFT finds its
    tensors under neither name: tests/test_hf_whole_train.py's Gemma 4 LoRA run); and a tensor
    whose module holds adapters (embed_vision's standardisation is the vision tower's own
    std_bias) refused, naming it, where PEFT could only save the tower whole, over them."""
    from types import SimpleNamespace

    from jaxmllm.hf.adapter import outermost
    from jaxmllm.hf.peft_export import _check_saved_whole

    clipped = "model.audio_tower.layers.0.feed_forward1.ffw_layer_1"
    names = {clipped, clipped + ".linear", "model.embed_audio", "model.audio_tower.layers.1"}
    assert outermost(names) == sorted(names - {clipped + ".linear"})
    q = SimpleNamespace(runtime="model.vision_tower.encoder.layers.{i}.self_attn.q_proj.linear")
    _check_saved_whole({"model.embed_vision.embedding_projection.weight": 0}, [q], "d")
    with pytest.raises(
        FamilyError,
        match=r"model\.vision_tower\.std_bias \(trained whole\) belongs to "
        r"model\.vision_tower, which holds adapted modules.*--merged",
    ):
        _check_saved_whole({"model.vision_tower.std_bias": 0}, [q], "d")


# ----------------------------------------------------------------------------- Gemma 3's text

# the text-only causal LM's module paths (model.layers.N, not model.language_model.layers.N)
TEXT_LLM = r"model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GEMMA = {
    # each matrix by name, on the tied decoder (4 sliding layers of a 5-token window, a full one)
    "gemma3_text/names": (hf_models.gemma3_text, {}, SEVEN, 2),
    # peft's every Linear but the head, on the untied decoder with biases on q, k, v and o, its
    # full layers first and last (7.5e-5 from peft's: fp32's on both sides, transformers' own
    # 4e-5 from its fp64 logits, ours 6.8e-5; with B 4x ours stay 6.6e-5 from them)
    "gemma3_text/all-linear": (
        hf_models.gemma3_text,
        dict(layers=("full", "sliding", "sliding", "full"), tied=False, bias=True, heads=(4, 1)),
        "all-linear",
        2,
    ),
    "gemma3_text/regex": (hf_models.gemma3_text, {}, TEXT_LLM, 2),
    # Gemma 4's with per-layer inputs, its last sliding and full layers reusing keys (no k_proj
    # or v_proj there, so none adapted: four stacks, two without k and v), their MLPs wide
    "gemma4_text/ple-shared": (
        hf_models.gemma4_text,
        dict(per_layer=8, shared=2, wide=True),
        SEVEN,
        4,
    ),
}


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(GEMMA))
def test_a_peft_adapter_on_gemma_text_gives_peft_s_logits(name, tmp_path):
    """`hf check --adapter` on a Gemma3ForCausalLM or a Gemma4ForCausalLM (its sliding and full
    layers, and Gemma 4's shared ones, in stacks of ours, the adapter's layers shared out
    between them): within 1e-4 of peft's logits, the adapter moving them far more; `hf import
    --adapter` configures the seven targets, and the cost model prices the adapters it builds:
    2 FLOPs a token per adapter parameter."""
    from test_hf_moe import adapter_effect
    from test_hf_moe import peft_adapter as causal_adapter

    from jaxmllm.cost.flops import decoder_adapters
    from jaxmllm.cost.training import modules
    from jaxmllm.hf.adapter_load import shapes_of

    build, options, targets, stacks = GEMMA[name]
    source = build(tmp_path / "m", **options)
    adapter = causal_adapter(
        source, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=targets
    )
    (result,) = check_all(source, adapter=adapter)
    assert result["max_abs_diff"] < 1e-4, result
    assert adapter_effect(source, adapter) > 100 * result["max_abs_diff"] + 1e-3, result
    cfg = write_config(tmp_path / "run.yaml", model=source, adapter=adapter)
    lora = cfg.model.llm.lora
    assert (lora.rank, lora.alpha) == (4, 8)
    assert set(lora.targets) == {t.removesuffix("_proj") for t in SEVEN}
    shapes = shapes_of(cfg)
    adapted = {p.split("/")[2] for p in shapes if p.endswith("/lora_a")}
    assert len(adapted) == stacks, adapted  # (the sliding layers' and the full ones', ...)
    held = sum(np.prod(v.shape) for p, v in shapes.items() if "/lora_" in p)
    assert decoder_adapters(cfg.model.llm, modules(cfg.model)["llm"]) == 2 * held


@pytest.mark.torch
def test_an_adapter_on_gemma3_s_sliding_or_full_layers_alone_is_refused(tmp_path):
    """Gemma 3's sliding and full layers are two stacks of ours: an adapter on the full layer's
    q_proj alone (a regex naming it), or on the sliding layers' alone (layers_to_transform), is
    one on some layers of q_proj, refused naming a layer without one, as an adapter on one
    sliding layer is (jaxmllm trains every layer's). Counted per stack, a stack with none went
    unnoticed: the adapter loaded, that stack's adapters fresh (B zero), and a run trained them."""
    from test_hf_moe import peft_adapter as causal_adapter

    source = hf_models.gemma3_text(tmp_path / "m")  # (layers 0, 1, 3, 4 sliding; 2 full)
    cases = [
        (dict(target_modules=r"model\.layers\.2\.self_attn\.q_proj"), 0),
        (dict(target_modules=["q_proj"], layers_to_transform=[0, 1, 3, 4]), 2),
        (dict(target_modules=["q_proj"], layers_to_transform=[0, 1, 2, 4]), 3),
    ]
    for k, (options, missing) in enumerate(cases):
        adapter = causal_adapter(source, tmp_path / f"a{k}", r=2, lora_alpha=4, **options)
        with pytest.raises(
            FamilyError,
            match=rf"model\.layers\.{missing}\.self_attn\.q_proj has no adapter while the "
            r"other layers' q_proj have one.*layers_to_transform is not supported",
        ):
            write_config(tmp_path / "run.yaml", model=source, adapter=adapter)


# ----------------------------------------------------------------------------- a LoRA run


@pytest.mark.slow  # (a LoRA run a family: its step compiled, two checks)
# (Qwen3.5's whole: its tower's adapters and the whole's names are Qwen3-VL's here; its hybrid
# decoder's (the linear layers' matrices, in_proj_qkv regrouped) the text Qwen3.5-MoE's LoRA
# run, tests/test_hf_qwen35.py; its whole's export after training, test_hf_whole_train's.)
# (Gemma 4's whole, its conformer's adapters among them: test_hf_whole_train's LoRA run.)
# (Qwen2-VL's: its tower's adapters sit on the fused qkv and proj links of the Qwen towers'
# code, which Qwen3-VL's run takes; its Qwen2 decoder's adapters are exported after training
# from Qwen2.5-VL by test_preference_train's and test_grpo_train's runs; its names, in the fast
# test_a_peft_adapter_gives_peft_s_logits_with_an_image_in_the_prompt.)
@pytest.mark.parametrize("name", ["llava", "qwen3_vl"])
def test_a_lora_run_exports_an_adapter_peft_loads_with_the_runs_logits(name, tmp_path):
    """Import a whole checkpoint, train 2 steps of LoRA on its LLM and vision tower (the
    projector trained whole), export: a PEFT adapter of the checkpoint, which read back is the
    run's adapters bit for bit and gives peft's logits with an image in the prompt within
    1e-4; `--merged`: the model with the adapters merged, its logits peft's; (LLaVA's run,
    the check of the base's identity, whatever the family) a checkpoint whose files changed
    since is refused by a resume and by export, naming it."""
    import jax
    from test_hf_train import CPU
    from test_hf_whole_train import whole_dir

    import sharding
    from jaxmllm import train
    from jaxmllm.config import Config, ConfigError, from_dict, load_config
    from jaxmllm.hf.export import export_run
    from jaxmllm.hf.start import run_parameters
    from jaxmllm.hf.towers import load_model
    from jaxmllm.init_from import initial_params
    from jaxmllm.resolve.run import resolve_run
    from jaxmllm.step.stages.program import build_program
    from sharding.rules import keyed_leaves

    source = whole_dir(name, tmp_path / name)
    write_config(tmp_path / "run.yaml", model=source)
    out = tmp_path / "run"
    no_audio = ["model.audio.enabled=false", "data.synthetic.audio_fraction=0"]
    sets = [
        *CPU,
        f"train.output_dir={out}",
        "optim.lr=1e-2",
        "train.steps=2",
        "train.checkpoint_every=2",
        *no_audio,
        "model.llm.lora.rank=4",
        "model.llm.lora.alpha=8",
        "model.vision.lora.rank=2",
        "model.vision.lora.targets=[q,k,o]",
    ]
    cfg = load_config(tmp_path / "run.yaml", sets)
    train.main(cfg)
    adapter = tmp_path / "adapter"
    assert set(export_run(str(out), str(adapter))) == {"model"}
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["modules_to_save"]  # (the projector, trained whole)
    wrapped = transformers.AutoModelForImageTextToText.from_pretrained(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = peft.PeftModel.from_pretrained(wrapped, str(adapter))
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]  # (every one)
    named = {n for n, _ in wrapped.named_modules() if n.endswith(".lora_A")}
    assert named and all(re.search(config["target_modules"], n) for n in named)
    bound = 1e-4
    for result in check_all(source, adapter=str(adapter)):
        assert result["max_abs_diff"] < bound, result

    run_cfg = from_dict(Config, json.loads((out / "config.json").read_text()))  # (resolved)
    _, params, _ = run_parameters(run_cfg, out)
    trained = keyed_leaves(jax.device_get(params))
    _, back = load_model(source, source, adapter=str(adapter))
    mine = {p: v for p, v in _flat(back).items() if p in trained}
    assert set(mine) == set(trained)
    for path, value in trained.items():
        np.testing.assert_array_equal(mine[path], value, err_msg=path)

    again = write_config(tmp_path / "again.yaml", model=source, adapter=str(adapter))
    assert again.model.vision.lora.targets == ("k", "o", "q") and again.model.llm.lora.rank == 4
    again = load_config(tmp_path / "again.yaml", [*CPU, *no_audio])
    again = resolve_run(again, 8).cfg
    mesh = sharding.make_mesh(again.mesh)
    with jax.set_mesh(mesh):
        given = keyed_leaves(jax.device_get(initial_params(again, build_program(again, mesh))))
    for path, value in trained.items():  # (the trainer's start: model.init_from.adapter)
        np.testing.assert_array_equal(given[path], value, err_msg=path)

    merged = export_run(str(out), str(tmp_path / "merged"), merged=True)["model"]
    np.testing.assert_allclose(logits(str(merged)), logits(source, str(adapter)), atol=1e-4)
    for result in check_all(str(merged)):
        assert result["max_abs_diff"] < bound, result

    if name != "llava":
        return
    _perturb(Path(source))  # (its files changed since the run read them)
    refused = rf"trained on the base \(model\.init_from\.llm={source}.*content hash"
    with pytest.raises(ConfigError, match=refused):
        run_parameters(run_cfg, out)
    with pytest.raises(ConfigError, match=refused):
        train.main(load_config(tmp_path / "run.yaml", [*sets, "train.steps=3"]))


RUNS = {  # (builder, its options, the layers reusing keys: no k_proj, v_proj, stacks adapted,
    # the bound of the merged model's packed `hf check`: its family's own in test_hf_gemma4,
    # 1e-3, where the per-layer inputs' fp32 sums put a packed row 1e-4 to 2e-4 off)
    # (per-layer inputs trained through; layers 3 and 4 reuse keys, their MLPs wide. Gemma 3's
    # run would take no code this one does not: Gemma 4's layer links are Gemma 3's and more
    # (`hf.gemma4.Gemma4`), the adapters' code is every family's; Gemma 3's adapters read in,
    # test_a_peft_adapter_on_gemma_text_gives_peft_s_logits's cases)
    "gemma4_text": (
        hf_models.gemma4_text,
        dict(per_layer=8, shared=2, wide=True),
        (3, 4),
        4,
        1e-3,
    ),
}


@pytest.mark.slow  # (a LoRA run: its step compiled, the trainer's start, two checks)
@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_lora_run_on_gemma_text_exports_an_adapter_peft_loads_with_the_runs_logits(
    name, tmp_path
):
    """Import a Gemma4ForCausalLM, train 2 steps of LoRA on every matrix
    of its sliding and full layers (stacks of ours; Gemma 4's shared layers have no k and v),
    export: a PEFT adapter on each of the checkpoint's model.layers.N modules, which peft loads
    with no key missing and which gives the run's logits within 1e-4 of peft's; read back (and
    as the trainer starts from it) it is the run's adapters bit for bit; `--merged`: the model
    with them merged, its logits peft's."""
    import jax
    from test_chat import build_dir
    from test_hf_moe import TEXT_ONLY, exported_adapter, lora_run
    from test_hf_train import CPU

    import sharding
    from jaxmllm.config import load_config
    from jaxmllm.hf.export import export_run
    from jaxmllm.init_from import initial_params
    from jaxmllm.resolve.run import resolve_run
    from jaxmllm.step.stages.program import build_program
    from sharding.rules import keyed_leaves

    build, options, shared, stacks, bound = RUNS[name]
    d = tmp_path / "m"
    build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct")
    source = build(d, vocab=512, **options)  # (the tokenizer's ~420 ids fit)
    build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct")  # (save_pretrained wrote over it)
    out, adapter, config = lora_run(source, tmp_path)
    wrapped = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(source), str(adapter)
    )
    named = {n for n, _ in wrapped.named_modules() if n.endswith(".lora_A")}
    matrices = [f"self_attn.{x}_proj" for x in "qkvo"] + [f"mlp.{x}" for x in SEVEN[4:]]
    own = lambda i, m: i not in shared or m[-6:] not in ("k_proj", "v_proj")
    want = {
        f"base_model.model.model.layers.{i}.{m}.lora_A"
        for i in range(5)
        for m in matrices
        if own(i, m)
    }
    assert named == want and all(re.search(config["target_modules"], n) for n in named)
    trained, mine = exported_adapter(source, out, adapter, 1e-4)
    adapters = {p: v for p, v in trained.items() if "/lora_" in p}
    assert len({p.split("/")[2] for p in adapters}) == stacks  # (sliding, full, ...)
    assert not np.all(adapters[next(p for p in adapters if p.endswith("lora_b"))] == 0)
    for path, value in trained.items():
        np.testing.assert_array_equal(mine[path], value, err_msg=path)

    again = write_config(tmp_path / "again.yaml", model=source, adapter=str(adapter))
    assert again.model.llm.lora.rank == 4 and again.model.init_from.adapter
    again = resolve_run(load_config(tmp_path / "again.yaml", [*CPU, *TEXT_ONLY]), 8).cfg
    mesh = sharding.make_mesh(again.mesh)
    with jax.set_mesh(mesh):
        given = initial_params(again, build_program(again, mesh))
    given = keyed_leaves(jax.device_get(given))
    for path, value in adapters.items():  # (the trainer's start: model.init_from.adapter)
        np.testing.assert_array_equal(given[path], value, err_msg=path)

    merged = export_run(str(out), str(tmp_path / "merged"), merged=True)["model"]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        theirs = wrapped.eval()(input_ids=ids).logits[0].numpy()
        np.testing.assert_allclose(base(input_ids=ids).logits[0].numpy(), theirs, atol=1e-4)
    (plain,) = check_all(str(merged))
    assert plain["max_abs_diff"] < bound, plain


def _flat(model) -> dict:
    from flax import nnx

    from sharding.rules import keyed_leaves

    return keyed_leaves(nnx.to_pure_dict(nnx.state(model)))


def _perturb(directory: Path) -> None:
    """One LLM tensor of a checkpoint nudged (its files changed since a run read it)."""
    from jaxmllm.hf.safetensors import Checkpoint, write_checkpoint

    ck = Checkpoint(directory)
    tensors = {n: np.array(ck.get(n)) for n in ck.names()}
    name = next(n for n in tensors if n.endswith("layers.0.mlp.up_proj.weight"))
    tensors[name] = tensors[name] + np.asarray(1e-3, tensors[name].dtype)
    write_checkpoint(directory, sorted(tensors.items()))
