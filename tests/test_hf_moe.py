"""Qwen3, Qwen3-MoE and Qwen2-MoE checkpoints in and out, held to transformers (and peft):
tiny random models built in tmp_path (tests/hf_models.py), logits in fp32, the MoE variants a
user meets (dense layers among MoE ones, a sparse step, top-k probabilities renormalised or
not, a shared expert with its gate, other head counts and GQA ratios)."""

from __future__ import annotations

import json
import re
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
    "qwen3-vocab-99": lambda d: hf_models.qwen3(d, vocab=99),  # (transformers' test models')
    "qwen3-moe": lambda d: hf_models.qwen3_moe(d),
    # a dense layer among the MoE ones, top-k probabilities as they are, 6 query heads a kv head
    "qwen3-moe-dense-layer": lambda d: hf_models.qwen3_moe(
        d, dense_layers=(1,), norm_topk=False, heads=(6, 1)
    ),
    # every second layer MoE (decoder_sparse_step 2), top-4 of 16, tied embeddings
    "qwen3-moe-sparse-step": lambda d: hf_models.qwen3_moe(
        d, sparse_step=2, layers=4, experts=16, top_k=4, tied=True
    ),
    # decoder_sparse_step past the layers: no layer has experts, transformers' model is dense
    # (refused naming jaxmllm's model.llm.moe.experts before)
    "qwen3-moe-no-expert-layer": lambda d: hf_models.qwen3_moe(d, sparse_step=4, layers=3),
    "qwen2-moe-shared-expert": lambda d: hf_models.qwen2_moe(d),
    "qwen2-moe-no-biases": lambda d: hf_models.qwen2_moe(d, qkv_bias=False),
    # the experts fused, as transformers 5 holds them (and reads them from a checkpoint)
    "qwen3-moe-fused": lambda d: hf_models.fused_experts(
        hf_models.qwen3_moe(d.with_name(d.name + "-linear"), dense_layers=(1,)), d
    ),
}


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(BUILD))
def test_our_decoder_matches_transformers(name, tmp_path):
    """`hf check`: logits of 64 tokens within 1e-4 of transformers' (the target is 1e-3)."""
    result = check_dir(BUILD[name](tmp_path / name), tokens=64)
    assert result["max_abs_ref"] > 0.5, result
    assert result["max_abs_diff"] < 1e-4, result


@pytest.mark.torch
@pytest.mark.parametrize(
    "name", ["qwen3-moe-dense-layer", "qwen2-moe-shared-expert", "qwen3-moe-fused"]
)
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
    hf_models.assert_bit_identical(source, tmp_path / "out")
    theirs = json.loads((Path(source) / "config.json").read_text())
    ours = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob"):
        assert ours[key] == theirs[key], key
    assert ours["num_experts"] == theirs.get("num_experts", theirs.get("num_local_experts"))
    assert ours["mlp_only_layers"] == theirs["mlp_only_layers"]
    again = load_towers(config_for("llm", str(tmp_path / "out")), "llm")
    jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(towers))


@pytest.mark.torch
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


@pytest.mark.torch
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
    """An adapter of a causal LM as peft writes one, its B at random (a trained adapter's). Its
    A comes from torch's global generator (peft's init), seeded here in a fork of it, so the
    adapter is the same whatever ran before in the process."""
    import peft
    import torch

    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **options))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if ".lora_B." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    wrapped.save_pretrained(str(out))
    return str(out)


def adapter_effect(source: str, adapter: str, tokens: int = 64) -> float:
    """How far the adapter moves transformers' logits: max |peft's - the base's| over the same
    random tokens (what a test of "the adapter is read" must see above its tolerance)."""
    import torch
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, base.config.vocab_size, tokens))
    with torch.no_grad():
        plain = base(input_ids=ids[None]).logits
        moved = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids[None]).logits
    return float((moved - plain).abs().max())


@pytest.mark.torch
@pytest.mark.parametrize(
    "targets",
    [
        ["q_proj", "k_proj", "v_proj", "o_proj"],  # attention alone
        ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],  # + the routed experts
        ["down_proj"],  # one expert matrix alone (its adapter un-nested)
    ],
)
def test_a_peft_adapter_on_an_moe_decoder_gives_peft_s_logits(targets, tmp_path):
    """PEFT adapters on a Qwen3-MoE (a dense layer among its MoE ones): on the attention, and
    on the routed experts where PEFT puts gate_proj, up_proj and down_proj targets on
    transformers 5's stacked experts (target_parameters: gate_up_proj at twice the rank,
    down_proj): `hf check --adapter` within 1e-4 of peft's logits, the adapter moving them
    far more, and `hf import --adapter` configures those targets."""
    pytest.importorskip("peft")
    source = hf_models.qwen3_moe(tmp_path / "m", dense_layers=(1,))
    adapter = peft_adapter(source, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=targets)
    (result,) = check_all(source, adapter=adapter)
    assert result["max_abs_diff"] < 1e-4, result
    assert adapter_effect(source, adapter) > 100 * result["max_abs_diff"] + 1e-3, result
    cfg = write_config(tmp_path / "run.yaml", model=source, adapter=adapter)
    assert cfg.model.llm.lora.rank == 4 and cfg.model.llm.lora.alpha == 8
    want = {t.removesuffix("_proj") for t in targets}
    assert set(cfg.model.llm.lora.targets) == want


@pytest.mark.torch
def test_a_peft_adapter_on_fused_experts_gives_peft_s_logits(tmp_path):
    """The same adapter on the routed experts (target_parameters) of a checkpoint whose experts
    are fused: `hf check --adapter` within 1e-4 of peft's, the adapter moving the logits."""
    pytest.importorskip("peft")
    linear = hf_models.qwen3_moe(tmp_path / "linear", dense_layers=(1,))
    source = hf_models.fused_experts(linear, tmp_path / "m")
    targets = ["gate_proj", "up_proj", "down_proj"]
    adapter = peft_adapter(source, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=targets)
    assert json.loads((Path(adapter) / "adapter_config.json").read_text())["target_parameters"]
    (result,) = check_all(source, adapter=adapter)
    assert result["max_abs_diff"] < 1e-4, result
    assert adapter_effect(source, adapter) > 100 * result["max_abs_diff"] + 1e-3, result


SHARED = {  # (a checkpoint with a shared expert, and our stacks its adapters land in)
    # a dense layer every second: the MoE layers 1, 3 are `moe_blocks`, the dense 0, 2 `blocks`
    "qwen2-moe": (
        lambda d: hf_models.qwen2_moe(d),
        ["moe_blocks/mlp/shared/gate", "blocks/mlp/gate"],
    ),
    # Gemma 4's MoE block: its dense MLP (mlp.gate_proj, ...) our ungated shared expert
    "gemma4-moe": (
        lambda d: hf_models.gemma4_text(d, experts=8),
        ["blocks/mlp/shared/gate", "full_moe_blocks/mlp/shared/down"],
    ),
}


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(SHARED))
def test_a_peft_adapter_on_a_shared_expert_gives_peft_s_logits(name, tmp_path):
    """With a shared expert (Qwen2-MoE, a dense layer every second; Gemma 4's dense MLP
    beside its experts) PEFT's gate_proj, up_proj and down_proj targets match the shared
    expert's Linears and the dense layers' MLPs, not the routed experts (no Linear there):
    ours put them there too, within 1e-4 of peft."""
    pytest.importorskip("peft")
    build, paths = SHARED[name]
    source = build(tmp_path / "m")
    targets = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = peft_adapter(source, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=targets)
    (result,) = check_all(source, adapter=adapter)
    assert result["max_abs_diff"] < 1e-4, result
    assert adapter_effect(source, adapter) > 100 * result["max_abs_diff"] + 1e-3, result
    from jaxmllm.hf.towers import load_model

    _, model = load_model(source, adapter=adapter)
    flat = keyed_leaves(nnx.to_pure_dict(nnx.state(model)))
    for path in paths:
        assert f"llm/transformer/{path}/lora_b" in flat, path
    assert not [p for p in flat if "experts" in p and "adapter" in p]


def test_an_adapter_on_one_of_gate_and_up_is_refused():
    from jaxmllm.config import Config, ConfigError, from_dict

    llm = {"moe": {"experts": 4, "mlp_dim": 8}, "lora": {"rank": 2, "targets": ["q", "gate"]}}
    with pytest.raises(ConfigError, match="gate and up adapt each expert's fused"):
        from_dict(Config, {"model": {"llm": llm}})
    llm["lora"] = {"rank": 2, "targets": ["all"], "dropout": 0.1}
    with pytest.raises(ConfigError, match="lora.dropout"):
        from_dict(Config, {"model": {"llm": llm}})


# ----------------------------------------------------------------------------- end to end


def _with_tokenizer(name: str, d: Path) -> str:
    """A tiny random checkpoint of `name` with a Qwen tokenizer directory beside it."""
    from test_chat import build_dir

    build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct")
    build = {
        "qwen3": hf_models.qwen3,
        "qwen3_moe": hf_models.qwen3_moe,
        "gemma4_moe": lambda d, vocab: hf_models.gemma4_text(d, experts=8, vocab=vocab),
    }[name]
    source = build(d, vocab=512)  # (the tokenizer's ~420 ids fit: no rows are added)
    build_dir(d, "qwen", "Qwen/Qwen2.5-7B-Instruct")  # (save_pretrained wrote over it)
    return source


TEXT_ONLY = ["data.synthetic.image_fraction=0", "data.synthetic.audio_fraction=0"]
TEXT_ONLY += ["data.synthetic.multi_image_fraction=0"]


@pytest.mark.slow
@pytest.mark.torch
# (the dense Qwen3 decoder's import and export links are held bit for bit by the fast round
# trip, and its training by every whole Qwen model's run: the runs here are the MoE blocks')
@pytest.mark.parametrize("name", ["qwen3_moe", "gemma4_moe"])
def test_import_train_export_holds_to_transformers(name, tmp_path):
    """`hf import --model` -> check -> train 2 steps (the experts split over mesh.expert=2;
    Gemma 4's MoE beside its dense MLP, sliding and full layers) -> `hf export` ->
    transformers loads the export, its logits ours within 1e-4 of the run's parameters (which
    moved from the import's)."""
    from test_hf_train import CPU
    from test_hf_whole_train import run_params

    from jaxmllm import train
    from jaxmllm.config import load_config
    from jaxmllm.hf.export import export_run

    source = _with_tokenizer(name, tmp_path / name)
    (before,) = check_all(source)
    assert before["max_abs_diff"] < 1e-4, before
    write_config(tmp_path / "run.yaml", model=source)
    out = tmp_path / "run"
    mesh = ["mesh.data=2", "mesh.expert=2"]
    sets = [*CPU, *TEXT_ONLY, *mesh, f"train.output_dir={out}", "optim.lr=1e-2"]
    train.main(load_config(tmp_path / "run.yaml", [*sets, "train.steps=2"]))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["moe/dropped"] == 0 and metrics[-1]["moe/sent_remote_share"] > 0.2
    exported = export_run(str(out), str(tmp_path / "export"))["model"]
    (after,) = check_all(str(exported))
    assert after["max_abs_diff"] < 1e-4, after
    trained = run_params(out)
    load = lambda d: keyed_leaves(
        nnx.to_pure_dict(nnx.state(load_towers(config_for("llm", d), "llm")))
    )
    got, imported = load(str(exported)), load(source)
    for path, value in got.items():
        np.testing.assert_array_equal(value, trained[path], err_msg=path)
    assert any(not np.array_equal(imported[p], got[p]) for p in got)  # (training moved them)


@pytest.mark.slow
@pytest.mark.torch
def test_a_lora_run_on_an_moe_exports_an_adapter_peft_loads(tmp_path):
    """LoRA on a Qwen3-MoE's attention and routed experts (rank 4: gate_up at 8, as PEFT),
    the experts over mesh.expert=2, 2 steps: the exported PEFT adapter (target_parameters for
    the experts) loads in peft without a missing key and gives the run's logits within 1e-4;
    read back, it is the run's adapters bit for bit; `--merged` gives the same logits."""
    from jaxmllm.hf.export import export_run

    source = _with_tokenizer("qwen3_moe", tmp_path / "m")
    out, adapter, config = lora_run(source, tmp_path, "mesh.data=2", "mesh.expert=2")
    assert sorted(config["target_parameters"]) == ["down_proj", "gate_up_proj"]
    assert config["rank_pattern"] == {r".*\.gate_up_proj": 8}
    trained, mine = exported_adapter(source, out, adapter, 1e-4)
    experts = [p for p in trained if "experts/gate_up_adapter" in p]
    assert experts and not np.all(trained[experts[-1]] == 0)  # (B moved from zero)
    for path, value in trained.items():
        np.testing.assert_allclose(mine[path], value, rtol=1e-6, err_msg=path)
    merged = export_run(str(out), str(tmp_path / "merged"), merged=True)["model"]
    (plain,) = check_all(str(merged))
    assert plain["max_abs_diff"] < 1e-4, plain


def lora_run(source: str, tmp_path: Path, *sets: str) -> tuple[Path, Path, dict]:
    """Two steps of a rank-4 LoRA run on the text of checkpoint `source` (and `sets`), its
    adapter exported: (the run's folder, the adapter's, its adapter_config.json)."""
    from test_hf_train import CPU

    from jaxmllm import train
    from jaxmllm.config import load_config
    from jaxmllm.hf.export import export_run

    write_config(tmp_path / "run.yaml", model=source)
    out = tmp_path / "run"
    lora = ["model.llm.lora.rank=4", "model.llm.lora.alpha=8", *sets]
    sets = [*CPU, *TEXT_ONLY, *lora, f"train.output_dir={out}", "optim.lr=1e-2"]
    train.main(load_config(tmp_path / "run.yaml", [*sets, "train.steps=2"]))
    adapter = tmp_path / "adapter"
    assert set(export_run(str(out), str(adapter))) == {"model"}
    return out, adapter, json.loads((adapter / "adapter_config.json").read_text())


def exported_adapter(source: str, out: Path, adapter: Path, bound: float) -> tuple[dict, dict]:
    """A LoRA run's exported PEFT adapter on `source` (a causal LM or a whole multimodal
    checkpoint): peft loads it with no missing key, and `hf check --adapter` gives its logits
    (a whole's: with media) within `bound`. Returns the run's parameters and the adapter read
    back onto `source`, by path, for the caller to compare."""
    import warnings

    import peft

    from jaxmllm.config import Config, from_dict
    from jaxmllm.hf.registry import read_hf_config
    from jaxmllm.hf.start import run_parameters
    from jaxmllm.hf.towers import load_model
    from jaxmllm.hf.wholes import whole_for

    whole = whole_for(read_hf_config(source))
    auto = transformers.AutoModelForImageTextToText if whole else transformers.AutoModelForCausalLM
    base = auto.from_pretrained(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft.PeftModel.from_pretrained(base, str(adapter))
    assert not [w for w in caught if "missing adapter keys" in str(w.message)]
    results = check_all(source, adapter=str(adapter))
    assert len(results) == 1 or whole is not None, results
    for result in results:
        assert result["max_abs_diff"] < bound, result
    run_cfg = from_dict(Config, json.loads((out / "config.json").read_text()))
    _, params, _ = run_parameters(run_cfg, out)
    parts = whole.parts if whole is not None else ()
    encoders = [source if r in parts else "" for r in ("vision", "audio")]
    _, back = load_model(source, *encoders, adapter=str(adapter))
    return keyed_leaves(jax.device_get(params)), keyed_leaves(nnx.to_pure_dict(nnx.state(back)))


FUSED = {  # (linear: a checkpoint with one Linear per expert, as save_pretrained writes)
    "qwen3-moe": lambda d: hf_models.qwen3_moe(d, dense_layers=(1,)),
    "qwen2-moe": lambda d: hf_models.qwen2_moe(d),
    "qwen3_5-moe": lambda d: hf_models.qwen3_5(d, experts=4),
    "qwen3_5-moe-whole": lambda d: hf_models.qwen3_5_whole(d, experts=4),
}


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(FUSED))
def test_experts_fused_as_qwen_s_files_import_as_one_linear_each(name, tmp_path):
    """The experts fused as transformers 5 holds them and Qwen's Qwen3.5-MoE files store them
    (gate_up_proj [E, 2f, width], down_proj [E, width, f]): transformers itself reads that
    folder to the same logits as the one Linear per expert it was made from (so the layout is
    real: the same weights, bit for bit), and the import of either gives the same parameters bit
    for bit."""
    from jaxmllm.hf.towers import load_model

    linear = FUSED[name](tmp_path / "linear")
    fused = hf_models.fused_experts(linear, tmp_path / "fused")
    names = Checkpoint(fused).names()
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert not any(".mlp.experts.0." in n for n in names)
    whole = name.endswith("whole")
    cls = transformers.AutoModelForImageTextToText if whole else transformers.AutoModelForCausalLM
    ids = np.arange(1, 24)[None]
    logits, weights = [], []
    for directory in (linear, fused):
        model, info = cls.from_pretrained(directory, output_loading_info=True)
        assert not any(info.values()), info
        logits.append(model(input_ids=__import__("torch").as_tensor(ids)).logits.detach())
        weights.append({k: v.numpy() for k, v in model.state_dict().items()})
    # transformers reads both folders to the same weights, bit for bit; its logits of them
    # agree to float rounding only (transformers 5.24 on torch 2.13: 6e-6 apart, the same
    # weights in tensors of other strides taking other kernels)
    assert set(weights[0]) == set(weights[1])
    for k in weights[0]:
        np.testing.assert_array_equal(weights[0][k], weights[1][k], k)
    np.testing.assert_allclose(logits[0].numpy(), logits[1].numpy(), rtol=1e-5, atol=1e-5)
    params = []
    for directory in (linear, fused):
        _, ours = load_model(directory, directory if whole else "")
        params.append(keyed_leaves(nnx.to_pure_dict(nnx.state(ours))))
    assert set(params[0]) == set(params[1])
    for k in params[0]:
        np.testing.assert_array_equal(np.asarray(params[0][k]), np.asarray(params[1][k]), k)


@pytest.mark.torch
def test_a_checkpoint_with_experts_in_both_layouts_is_refused_naming_them(tmp_path):
    """One layer's experts fused among others one Linear each (or both for one layer): the
    import is refused naming a tensor of each layout, before anything is written."""
    from safetensors.numpy import load_file, save_file

    from jaxmllm.hf.family import FamilyError

    linear = hf_models.qwen3_moe(tmp_path / "linear", layers=2)
    fused = hf_models.fused_experts(linear, tmp_path / "fused")
    mixed = {k: v for k, v in load_file(Path(linear) / "model.safetensors").items()}
    layer0 = "model.layers.0.mlp.experts."
    mixed = {k: v for k, v in mixed.items() if not k.startswith(layer0)}
    mixed.update(
        {
            k: v
            for k, v in load_file(Path(fused) / "model.safetensors").items()
            if k.startswith(layer0)
        }
    )
    save_file(mixed, Path(fused) / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(FamilyError) as e:
        write_config(tmp_path / "run.yaml", model=fused)
    message = str(e.value)
    assert f"{fused}: its experts are both fused" in message, message
    assert re.search(r"\(model\.layers\.0\.mlp\.experts\.(gate_up|down)_proj\)", message)
    assert re.search(r"\(model\.layers\.1\.mlp\.experts\.0\.\w+_proj\.weight\)", message)
    assert not (tmp_path / "run.yaml").exists()
