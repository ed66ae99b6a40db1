"""Qwen3, Qwen3-MoE and Qwen2-MoE checkpoints in and out, held to transformers (and peft):
tiny random models built in tmp_path (tests/hf_models.py), logits in fp32, the MoE variants a
user meets (dense layers among MoE ones, a sparse step, top-k probabilities renormalised or
not, a shared expert with its gate, other head counts and GQA ratios)."""

from __future__ import annotations

import json
from pathlib import Path

import hf_models
import jax
import numpy as np
import pytest
from flax import nnx

from jaxmllm.hf.__main__ import main
from jaxmllm.hf.check import check_dir
from jaxmllm.hf.check_whole import check_all
from jaxmllm.hf.export import export_role
from jaxmllm.hf.importer import write_config
from jaxmllm.hf.safetensors import Checkpoint
from jaxmllm.hf.towers import config_for, load_towers
from sharding.rules import keyed_leaves

transformers = pytest.importorskip("transformers")

BUILD = {
    "qwen3": lambda d: hf_models.qwen3(d),
    "qwen3-tied-biases": lambda d: hf_models.qwen3(d, tied=True, bias=True),
    "qwen3-moe": lambda d: hf_models.qwen3_moe(d),
    # a dense layer among the MoE ones, top-k probabilities as they are, 6 query heads a kv head
    "qwen3-moe-dense-layer": lambda d: hf_models.qwen3_moe(
        d, dense_layers=(1,), norm_topk=False, heads=(6, 1)
    ),
    # every second layer MoE (decoder_sparse_step 2), top-4 of 16, tied embeddings
    "qwen3-moe-sparse-step": lambda d: hf_models.qwen3_moe(
        d, sparse_step=2, layers=4, experts=16, top_k=4, tied=True
    ),
    "qwen2-moe-shared-expert": lambda d: hf_models.qwen2_moe(d),
    "qwen2-moe-no-biases": lambda d: hf_models.qwen2_moe(d, qkv_bias=False),
}


@pytest.mark.parametrize("name", sorted(BUILD))
def test_our_decoder_matches_transformers(name, tmp_path):
    """`hf check`: logits of 64 tokens within 1e-4 of transformers' (the target is 1e-3)."""
    result = check_dir(BUILD[name](tmp_path / name), tokens=64)
    assert result["max_abs_ref"] > 0.5, result
    assert result["max_abs_diff"] < 1e-4, result


@pytest.mark.parametrize("name", ["qwen3-moe-dense-layer", "qwen2-moe-shared-expert"])
def test_import_then_export_is_bit_identical(name, tmp_path):
    """Every expert's tensors consumed into the stacked experts (MoE and dense layers in stacks
    of their own) and written back bit for bit, with the config.json's MoE keys."""
    source = BUILD[name](tmp_path / "source")
    cfg = config_for("llm", source)
    towers = load_towers(cfg, "llm")
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(towers)))
    if "dense" in name:
        assert flat["llm/transformer/blocks/mlp/experts/gate"].shape == (2, 8, 64, 32)
        assert flat["llm/transformer/dense_blocks/mlp/gate/kernel"].shape == (1, 64, 96)
    export_role(cfg, "llm", flat, tmp_path / "out", 16 << 10)
    before, after = Checkpoint(source), Checkpoint(tmp_path / "out")
    assert set(after.names()) == set(before.names())
    for n in after.names():
        assert np.array_equal(before.get(n).view(np.uint8), after.get(n).view(np.uint8)), n
    theirs = json.loads((Path(source) / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert ours[key] == theirs[key], key
    assert ours["num_experts"] == theirs.get("num_experts", theirs.get("num_local_experts"))
    assert ours["mlp_only_layers"] == theirs["mlp_only_layers"]
    again = load_towers(config_for("llm", str(tmp_path / "out")), "llm")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(towers))


def test_a_causal_lm_given_as_model_is_a_text_only_model(tmp_path, capsys):
    """`hf import --model` on a Qwen3-MoE checkpoint writes a whole text-only config: its LLM
    (the experts, the router's loss coefficient), no encoder; the trainer loads it."""
    source = hf_models.qwen3_moe(tmp_path / "qwen3_moe", dense_layers=(2,))
    out = tmp_path / "run.yaml"
    assert main(["import", "--model", source, "--out", str(out)]) == 0
    from jaxmllm.config import load_config

    cfg = load_config(out)
    m = cfg.model
    assert not m.vision.enabled and not m.audio.enabled
    assert m.init_from.llm == str(Path(source).resolve()) and not m.init_from.vision
    moe = m.llm.moe
    assert (moe.experts, moe.top_k, moe.mlp_dim, moe.dense_layers) == (8, 2, 32, (2,))
    assert moe.aux_loss_coef == 0.01 and m.llm.qk_norm and m.llm.head_dim == 24


def test_the_layer_count_and_expert_count_refusals_name_the_key(tmp_path):
    """A config.json whose expert count is not its tensors' is refused from the headers, naming
    the missing expert tensor; a damaged num_experts is refused naming the key."""
    from jaxmllm.hf.family import FamilyError

    source = Path(hf_models.qwen3_moe(tmp_path / "m"))
    hf = json.loads((source / "config.json").read_text())
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    (source / "config.json").write_text(json.dumps({**hf, key: 9}))
    with pytest.raises(FamilyError, match=r"experts\.8\.gate_proj\.weight"):
        write_config(tmp_path / "run.yaml", model=str(source))
    (source / "config.json").write_text(json.dumps({**hf, key: 10**9}))
    with pytest.raises(FamilyError, match="num_experts"):
        write_config(tmp_path / "run.yaml", model=str(source))


def peft_adapter(source: str, out: Path, **options) -> str:
    """An adapter of a causal LM as peft writes one, its B at random (a trained adapter's)."""
    import peft
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **options))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    wrapped.save_pretrained(str(out))
    return str(out)


def test_a_peft_adapter_on_an_moe_decoder_gives_peft_s_logits(tmp_path):
    """PEFT adapters on a Qwen3-MoE's attention and on its dense layer's MLP (transformers'
    routed experts are stacked parameters: no module for an adapter): `hf check --adapter`
    within 1e-4 of peft's, and `hf import --adapter` configures those targets."""
    pytest.importorskip("peft")
    source = hf_models.qwen3_moe(tmp_path / "m", dense_layers=(1,))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = peft_adapter(source, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=targets)
    (result,) = check_all(source, adapter=adapter)
    assert result["max_abs_diff"] < 1e-4, result
    cfg = write_config(tmp_path / "run.yaml", model=source, adapter=adapter)
    assert cfg.model.llm.lora.rank == 4
    assert set(cfg.model.llm.lora.targets) == {"q", "k", "v", "o", "gate", "up", "down"}
