"""Qwen3.5 and Qwen3.5-MoE text checkpoints in and out, held to transformers: tiny random
hybrids built in tmp_path (tests/hf_models.py), logits in fp32 on packed rows, the variants a
user meets (other layer patterns, head counts, key/value head ratios, conv widths, partial
rotary, tied embeddings, experts); and what import and export say of the whole, natively
multimodal checkpoints (their check, training and export: tests/test_hf_whole*.py)."""

from __future__ import annotations

import json
from pathlib import Path

import hf_models
import jax
import numpy as np
import pytest
from flax import nnx

from jaxmllm.hf.check import check_dir
from jaxmllm.hf.export import export_role
from jaxmllm.hf.importer import write_config
from jaxmllm.hf.towers import config_for, load_towers
from sharding.rules import keyed_leaves

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # (every test here runs transformers' models, on torch)

BUILD = {
    "qwen3_5": lambda d: hf_models.qwen3_5(d),
    "qwen3_5-moe": lambda d: hf_models.qwen3_5(d, experts=4),
    # its experts fused, as Qwen's own Qwen3.5-MoE files hold them
    "qwen3_5-moe-fused": lambda d: hf_models.fused_experts(
        hf_models.qwen3_5(d.with_name(d.name + "-linear"), experts=4), d
    ),
    # full attention first and twice, linear layers between
    "full-first": lambda d: hf_models.qwen3_5(d, layers=("full", "linear", "full", "linear")),
    # 6 query heads a kv head; a key head serving 3 value heads; a 3-tap convolution
    "heads-6-1-ratio-3-conv-3": lambda d: hf_models.qwen3_5(
        d, heads=(6, 1), linear_heads=(1, 3), conv=3, layers=("linear", "full", "linear")
    ),
    # tied embeddings, a 2-tap convolution, rotary on half of each head
    "tied-conv-2-half-rotary": lambda d: hf_models.qwen3_5(d, tied=True, conv=2, partial=0.5),
    # experts with as many key as value heads, 16-wide keys
    "moe-ratio-1": lambda d: hf_models.qwen3_5(d, experts=6, linear_heads=(2, 2), key_dim=16),
}


@pytest.mark.parametrize("name", sorted(BUILD))
def test_our_hybrid_decoder_matches_transformers_on_packed_rows(name, tmp_path):
    """`hf check`: three texts (150, 93 and 37 tokens) packed into one row (documents across
    the 64-token chunks), each text's logits within 1e-3 of transformers run on it alone."""
    result = check_dir(BUILD[name](tmp_path / name), tokens=150)
    assert "3 texts" in result["what"] and "packed into 1 row" in result["what"], result
    assert result["max_abs_ref"] > 5, result
    assert result["max_abs_diff"] < 1e-3, result


def test_the_packed_check_fails_when_the_state_is_not_restarted(tmp_path, monkeypatch):
    """The packed check holds the restarts: with the linear layers' documents not restarted
    (every row one document) the packed samples' logits are far from transformers'."""
    from jaxmllm.models import deltanet

    source = hf_models.qwen3_5(tmp_path / "m", vocab=296)  # (a program of its own)
    whole = deltanet.document_starts
    monkeypatch.setattr(
        deltanet, "document_starts", lambda seg, row=0: whole(jax.numpy.ones_like(seg), row)
    )
    jax.clear_caches()
    try:
        result = check_dir(source, tokens=150)
    finally:
        jax.clear_caches()
    assert result["max_abs_diff"] > 0.1, result


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5-moe", "qwen3_5-moe-fused"])
def test_import_then_export_is_bit_identical(name, tmp_path):
    """Every tensor consumed (the linear layers' fused in_proj_qkv and conv1d regrouped by
    key head, q_proj's queries and gates, the experts stacked, from one Linear each or fused)
    and written back bit for bit in the layout read, with config.json's layer_types and
    linear-attention sizes."""
    source = BUILD[name](tmp_path / "source")
    cfg = config_for("llm", source)
    assert cfg.model.llm.linear.layers == (0, 1, 2)
    towers = load_towers(cfg, "llm")
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(towers)))
    assert flat["llm/transformer/blocks/attn/qkv/kernel"].shape == (3, 64, 2, 2 * 32 + 2 * 12)
    assert flat["llm/transformer/blocks/attn/conv"].shape == (3, 4, 2, 2 * 32 + 2 * 12)
    full = "full_moe_blocks" if "moe" in name else "full_blocks"
    assert flat[f"llm/transformer/{full}/attn/query/kernel"].shape == (1, 64, 4, 32)
    export_role(cfg, "llm", flat, tmp_path / "out", 16 << 10)
    hf_models.assert_bit_identical(source, tmp_path / "out")
    theirs = json.loads((Path(source) / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    keys = ["layer_types", "linear_num_key_heads", "linear_num_value_heads"]
    keys += ["linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim"]
    keys += ["num_experts", "shared_expert_intermediate_size"] if "moe" in name else []
    for key in keys:
        assert ours[key] == theirs[key], key
    assert ours["rope_parameters"]["partial_rotary_factor"] == 0.25
    again = load_towers(config_for("llm", str(tmp_path / "out")), "llm")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(towers))


def test_a_hybrid_given_as_model_is_a_text_only_model(tmp_path):
    """`hf import --model` on a Qwen3.5-MoE checkpoint writes a whole text-only config: the
    linear layers and their sizes, the gate, partial rotary, zero-centred norms, experts in
    every layer with the shared one; the trainer loads it."""
    from jaxmllm.config import load_config
    from jaxmllm.hf.__main__ import main

    source = hf_models.qwen3_5(tmp_path / "m", experts=4, layers=("linear", "full"))
    out = tmp_path / "run.yaml"
    assert main(["import", "--model", source, "--out", str(out)]) == 0
    llm = load_config(out).model.llm
    assert llm.linear.layers == (0,) and llm.linear.key_heads == 2 and llm.linear.conv_width == 4
    assert llm.attn_gate and llm.qk_norm and llm.norm == "rms_offset"
    assert llm.rotary_fraction == 0.25 and llm.rotary_dim == 4
    assert (llm.moe.experts, llm.moe.shared_mlp_dim, llm.moe.norm_topk_prob) == (4, 48, True)


# (the dense Qwen3.5's adapters: the whole's, tests/test_lora_hf.py, on the same decoder)
@pytest.mark.parametrize("name", ["qwen3_5-moe", "qwen3_5-moe-fused"])
def test_a_peft_adapter_on_every_matrix_gives_peft_s_logits(name, tmp_path):
    """A PEFT adapter on every Linear (LLaMA-Factory's `all`: the full-attention layers'
    q_proj with its gate rows, k, v, o; the linear layers' in_proj_qkv (its rows regrouped
    like the weight's), in_proj_z, in_proj_b, in_proj_a, out_proj; the MLPs, in the MoE the
    shared expert's, as PEFT matches them; the MoE's experts one Linear each or fused): `hf
    check --adapter` within 5e-5 of the largest logit of peft's (these random hybrids' fp32
    noise: transformers' own fp32 logits are 1.5e-4 from its float64 ones; ours are 4.2e-4 from
    peft's of up to 11.0 as XLA:CPU emits loops by default, 5.2e-4 with the elemental emitter
    the tests compile with, tests/runs.py: the same math, rounded elsewhere), the adapter
    moving the logits, and `hf import --adapter` configures the targets."""
    pytest.importorskip("peft")
    from test_hf_moe import adapter_effect, peft_adapter

    from jaxmllm.hf.check_whole import check_all

    source = BUILD[name](tmp_path / "m")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    targets += ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
    adapter = peft_adapter(source, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=targets)
    (result,) = check_all(source, adapter=adapter)
    assert result["max_abs_diff"] < 5e-5 * result["max_abs_ref"], result
    assert adapter_effect(source, adapter) > 10 * result["max_abs_diff"] + 1e-3, result
    cfg = write_config(tmp_path / "run.yaml", model=source, adapter=adapter)
    lora = cfg.model.llm.lora
    assert (lora.rank, lora.alpha) == (4, 8)
    assert {"in_qkv", "in_z", "in_b", "in_a", "out_proj", "q", "gate"} <= set(lora.targets)


def test_what_a_hybrid_does_not_run_with_is_refused_naming_the_key(tmp_path):
    """An unknown layer type names layer_types; context parallelism and pipeline stages over
    linear-attention layers are refused at start-up naming mesh.context and mesh.stage; a
    chunk not a power of two names linear.chunk."""
    from jaxmllm.config import Config, ConfigError, from_dict
    from jaxmllm.hf.family import FamilyError

    source = Path(hf_models.qwen3_5(tmp_path / "m"))
    hf = json.loads((source / "config.json").read_text())
    hf["layer_types"][1] = "sliding_attention"
    (source / "config.json").write_text(json.dumps(hf))
    with pytest.raises(FamilyError, match="layer_types.*sliding_attention"):
        write_config(tmp_path / "run.yaml", model=str(source))
    llm = {"linear": {"every": 4, "key_heads": 2, "value_heads": 4}, "depth": 4}
    with pytest.raises(ConfigError, match="mesh.context"):
        from_dict(Config, {"model": {"llm": llm}, "mesh": {"context": 2}})
    with pytest.raises(ConfigError, match="mesh.stage"):
        from_dict(Config, {"model": {"llm": llm}, "mesh": {"stage": 2}})
    with pytest.raises(ConfigError, match="linear.chunk.*power of two"):
        from_dict(Config, {"model": {"llm": {**llm, "linear": {**llm["linear"], "chunk": 48}}}})


# ----------------------------------------------------------------------------- end to end


def _with_tokenizer(d: Path, experts: int = 0) -> str:
    """A tiny random Qwen3.5 (MoE with `experts`) with a Qwen tokenizer directory beside it."""
    from test_chat import build_dir

    build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct")
    source = hf_models.qwen3_5(d, vocab=512, experts=experts)  # (the tokenizer's ids fit)
    build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct")  # (save_pretrained wrote over it)
    return source


TEXT_ONLY = ["data.synthetic.image_fraction=0", "data.synthetic.audio_fraction=0"]
TEXT_ONLY += ["data.synthetic.multi_image_fraction=0"]


# (Import, train and export of the text hybrids: the whole Qwen3.5-MoE's run in
# tests/test_hf_whole_train.py trains this decoder, its experts over mesh.expert=2, and holds
# its export after training to transformers; a text-only run's export: test_hf_moe's; the text
# checkpoints' import and export, bit for bit and against transformers: the tests above.)


@pytest.mark.slow  # (a LoRA run: one compile of its step, a check of its adapter)
# (The only LoRA run on a hybrid: the whole Qwen3.5's tower and names are Qwen3-VL's run in
# tests/test_lora_hf.py, the dense MLPs' adapters every family's there; `--merged` merges each
# kernel alike, whatever the layer: test_hf_moe's and test_lora_hf's.)
@pytest.mark.parametrize("experts", [4], ids=["qwen3_5_moe"])
def test_a_lora_run_exports_an_adapter_peft_loads(experts, tmp_path):
    """LoRA (rank 4, every matrix: the full-attention layers' q, k, v, o, the linear layers'
    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, the MLPs or the shared expert),
    2 steps: the exported PEFT adapter loads in peft with no missing key and gives the run's
    logits within 5e-4; read back it is the run's adapters."""
    from test_hf_moe import exported_adapter, lora_run

    source = _with_tokenizer(tmp_path / "m", experts)
    out, adapter, config = lora_run(source, tmp_path)
    assert "in_proj_qkv" in config["target_modules"] and "q_proj" in config["target_modules"]
    trained, mine = exported_adapter(source, out, adapter, 5e-4)
    moved = [p for p in trained if p.endswith("attn/qkv/lora_b")]
    assert moved and not np.all(trained[moved[0]] == 0)  # (B moved from zero)
    for path, value in trained.items():
        np.testing.assert_allclose(mine[path], value, rtol=1e-6, atol=1e-7, err_msg=path)


# ----------------------------------------------------------------------------- whole checkpoints


@pytest.mark.parametrize("experts", [0, 4], ids=["qwen3_5", "qwen3_5_moe"])
def test_import_of_a_whole_writes_the_hybrid_with_interleaved_mrope_and_no_deepstack(
    experts, tmp_path
):
    """`hf import --model` of a whole Qwen3.5: the hybrid LLM (its linear layers, the gated
    full-attention ones) with interleaved M-RoPE on the rotary quarter of each head, Qwen3-VL's
    tower without DeepStack, videos with their times written; the same options from scratch
    export as that whole and no other (as Qwen3-VL: not its decoder), and with DeepStack as
    none, naming the key."""
    from jaxmllm.config import load_config
    from jaxmllm.hf.export import plan_export
    from jaxmllm.hf.family import FamilyError, mismatches
    from jaxmllm.hf.whole_config import DECODERS

    source = hf_models.qwen3_5_whole(tmp_path / "m", experts=experts)
    cfg = write_config(tmp_path / "run.yaml", model=source)
    v, llm = cfg.model.vision, cfg.model.llm
    assert llm.linear.layers == (0, 2) and llm.attn_gate and llm.norm == "rms_offset"
    assert (llm.rotary_fraction, llm.rotary_dim) == (0.25, 12)
    assert (llm.mrope_interleaved, llm.mrope_section) == (True, (2, 2, 2))
    assert bool(llm.moe.experts) == bool(experts)
    assert (v.deepstack, v.position_grid, v.position_resize) == ((), 6, "bilinear")
    assert cfg.data.video_timestamps
    name = "qwen3_5_moe" if experts else "qwen3_5"
    scratch = [f"model.init_from.{r}=" for r in ("llm", "vision")]
    (piece,) = plan_export(load_config(tmp_path / "run.yaml", scratch))
    assert piece.whole.name == name and piece.whole.hf_class.startswith("Qwen3_5")
    deep = load_config(tmp_path / "run.yaml", [*scratch, "model.vision.deepstack=[0]"])
    with pytest.raises(FamilyError) as e:
        plan_export(deep)
    assert f"as {name}: model.vision.deepstack=(0,) ({name} has no DeepStack)" in str(e.value)
    assert "as qwen3_vl: model.llm.norm='rms_offset'" in str(e.value)
    qwen3 = mismatches(cfg, DECODERS["qwen3"].wants(cfg), "qwen3")  # (the rest it refuses)
    for key in ("linear.enabled=True", "attn_gate=True", "rotary_fraction=0.25"):
        assert any(m.startswith(f"model.llm.{key} ") for m in qwen3), qwen3


def test_import_refuses_a_whole_qwen3_5_with_deepstack_naming_the_key(tmp_path):
    """A Qwen3.5 config.json whose vision_config names DeepStack blocks (transformers' class
    has none) is refused, naming the key, before anything is written."""
    from jaxmllm.hf.family import FamilyError

    source = Path(hf_models.qwen3_5_whole(tmp_path / "m"))
    hf = json.loads((source / "config.json").read_text())
    hf["vision_config"]["deepstack_visual_indexes"] = [0]
    (source / "config.json").write_text(json.dumps(hf))
    with pytest.raises(FamilyError, match=r"deepstack_visual_indexes \[0\]: .*no DeepStack"):
        write_config(tmp_path / "run.yaml", model=str(source))
    assert not (tmp_path / "run.yaml").exists()
