"""The recipes end to end on tiny random HF models: import onto configs/recipes/stage1.yaml,
train (only the projectors move), stage 2 from stage 1's run, export, and transformers loads
the export with logits equal to ours."""

from __future__ import annotations

from pathlib import Path

import hf_models
import jax
import numpy as np
import pytest
from test_chat import build_dir

from jaxmllm import train
from jaxmllm.config import load_config
from jaxmllm.hf.check import check_dir
from jaxmllm.hf.export import export_run
from jaxmllm.hf.importer import write_config
from jaxmllm.hf.safetensors import Checkpoint
from jaxmllm.init_from import initial_params
from jaxmllm.loop.checkpoint import restore_params
from jaxmllm.resolve.run import resolve_run
from jaxmllm.step.program import build_program
from sharding.rules import keyed_leaves

pytest.importorskip("transformers")
pytestmark = pytest.mark.torch  # (the checkpoints are written by transformers' models)
ROOT = Path(__file__).resolve().parents[1]
CPU = [  # the recipes sized for 8 CPU devices and built-in data
    "mesh.cpu_devices=8",
    "mesh.data=4",
    "mesh.fsdp=2",
    "model.compute_dtype=float32",
    "model.remat=none",
    "batch.llm_row_len=256",
    "batch.microbatches=2",
    "batch.attention_block=32",
    "data.source=synthetic",
    "data.path=",
    "data.synthetic.num_samples=256",
    "data.synthetic.max_image_side=8",
    "data.synthetic.max_audio_frames=64",
    "train.steps=3",
    "train.checkpoint_every=3",
    "train.log_every=1",
    "train.progress_bar=false",
    "optim.warmup_steps=1",
]


def _same(a: dict, b: dict, prefix: str) -> bool:
    a, b = keyed_leaves(a), keyed_leaves(b)
    keys = [k for k in a if k.startswith(prefix)]
    return bool(keys) and all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in keys)


@pytest.mark.slow
def test_recipes_stage1_then_stage2_then_export(tmp_path):
    llm = hf_models.qwen2(tmp_path / "qwen2", tied=True)
    build_dir(Path(llm), "qwen", "Qwen/Qwen2.5-7B-Instruct")  # its tokenizer: ~400 ids + specials
    vision = hf_models.siglip(tmp_path / "siglip")
    audio = hf_models.whisper(tmp_path / "whisper")
    runs = tmp_path / "runs"

    # Stage 1: encoders and LLM frozen, the projectors train.
    base1 = ROOT / "configs" / "recipes" / "stage1.yaml"
    write_config(tmp_path / "stage1.yaml", llm, vision, audio, base=base1)
    out1 = runs / "stage1"
    cfg1 = load_config(
        tmp_path / "stage1.yaml", [*CPU, f"train.output_dir={out1}", "optim.lr=1e-2"]
    )
    assert (cfg1.model.llm.freeze, cfg1.model.vision.freeze, cfg1.model.projector_freeze) == (
        True,
        True,
        False,
    )
    train.main(cfg1)
    exported1 = export_run(str(out1), str(tmp_path / "export1"))
    vocab = cfg1.model.llm.vocab_size  # 300 rows grown to the tokenizer's, by 128s
    assert vocab > 300 and vocab % 128 == 0, vocab
    for role, source in (("llm", llm), ("vision", vision), ("audio", audio)):
        before, after = Checkpoint(source), Checkpoint(exported1[role])
        for name in before.names():  # (the embedding's first 300 rows: the new ones are added)
            rows = before.get(name).shape[0]
            assert np.array_equal(before.get(name), after.get(name)[:rows]), (role, name)

    # Stage 2 starts from stage 1's parameters (its trained projectors), not the checkpoints'.
    base2 = ROOT / "configs" / "recipes" / "stage2.yaml"
    write_config(tmp_path / "stage2.yaml", llm, vision, audio, base=base2)
    out2 = runs / "stage2"
    cfg2 = load_config(
        tmp_path / "stage2.yaml",
        [*CPU, f"train.output_dir={out2}", f"model.init_from.run={out1}", "optim.lr=3e-3"],
    )
    run = resolve_run(cfg2)
    prog = build_program(run.cfg, run.mesh)
    with jax.set_mesh(prog.mesh):
        start = jax.device_get(initial_params(cfg2, prog))
    _, stage1 = restore_params(out1, _abstract(prog, frozen=("llm", "vision", "audio")))
    stage1 = {**stage1["params"], **stage1["frozen"]}
    for module in ("llm", "vision_projector", "audio_projector", "vision", "audio"):
        assert _same(start, stage1, module), module
    train.main(cfg2)

    # The export after training: transformers loads it and its logits are ours.
    exported2 = export_run(str(out2), str(tmp_path / "export2"))
    for role in ("llm", "vision", "audio"):
        result = check_dir(str(exported2[role]))
        assert result["max_abs_diff"] < 1e-4, result
    before, after = Checkpoint(llm), Checkpoint(exported2["llm"])
    assert not all(np.array_equal(before.get(n), after.get(n)) for n in before.names())


def _abstract(prog, frozen: tuple[str, ...]) -> dict:
    """Host shapes of every parameter, split as a run with `frozen` modules saved them."""
    pure = {**prog.abstract["params"], **prog.abstract["frozen"]}
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), pure)
    return {
        "params": {k: v for k, v in shapes.items() if k not in frozen},
        "frozen": {k: v for k, v in shapes.items() if k in frozen},
    }


@pytest.mark.slow  # two compiles of the imported model's step (pipelined and not)
def test_pretrained_start_under_pipeline_stages(tmp_path):
    """A Qwen2 LLM (biases, tied head) and a SigLIP tower imported onto stage 2's recipe, its
    vision encoder frozen, run with mesh.stage=2 x data 4: the pipelined state starts from
    exactly the tensors the unpipelined program loads, and its first step's loss and
    gradients are the unpipelined step's on the same 4 data-parallel buckets."""
    from test_pipeline import assert_same_math

    from jaxmllm.feed.iterator import make_pipeline
    from jaxmllm.step.program import make_loss_and_grads
    from jaxmllm.step.stages.loop import pipeline_loss
    from jaxmllm.step.stages.program import build_program as build_pipelined

    llm = hf_models.qwen2(tmp_path / "qwen2", tied=True)
    vision = hf_models.siglip(tmp_path / "siglip")
    write_config(tmp_path / "run.yaml", llm, vision, base=ROOT / "configs/recipes/stage2.yaml")
    cfg = load_config(
        tmp_path / "run.yaml",
        [
            *CPU,
            "model.init_from.run=",
            "mesh.stage=2",
            "mesh.data=4",
            "mesh.fsdp=1",
            "model.audio.enabled=false",
            "data.synthetic.audio_fraction=0",
            "batch.microbatches=4",
        ],
    )
    shard = train.sharding
    mesh = shard.make_mesh(cfg.mesh)
    run = resolve_run(cfg, 4)
    cfg = run.cfg
    host = next(make_pipeline(run, prefetch=0))["batch"]
    with jax.set_mesh(mesh):
        prog = build_pipelined(cfg, mesh)
        assert "vision" in prog.parts.frozen_keys and "llm" not in prog.parts.frozen_keys
        state = prog.init(initial_params(cfg, prog))
        piped = jax.device_get(prog.weights(state))
        fn = jax.jit(jax.value_and_grad(pipeline_loss(prog.parts, prog.layout)))
        loss, grads = fn(state["params"], state["frozen"], shard.make_global_batch(host, mesh))
        got = float(loss), jax.device_get(prog.layout.to_depth(grads))
    flat = shard.make_mesh({"data": 4, "fsdp": 1}, devices=jax.devices()[:4])
    with jax.set_mesh(flat):
        ref = build_program(cfg, flat)
        start = jax.device_get(initial_params(cfg, ref))
        loss_and_grads = jax.jit(make_loss_and_grads(ref.parts))
        batch = shard.make_global_batch(host, flat)
        want = jax.device_get(loss_and_grads(piped["params"], piped["frozen"], batch))
    both = {**piped["params"], **piped["frozen"]}
    for module in ("llm/", "vision/"):  # loaded, not random: the same tensors either way
        assert _same(both, start, module), module
    assert_same_math(got, want)
