"""A checkpoint holding NaN or Inf weights: `hf import` refuses it naming the tensor and its
file (it imported with exit 0 and trained until the non-finite guard stopped the run, whose
advice, lower optim.lr, was wrong there), and so does a run starting from a copy damaged since
its import."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from jaxmllm.hf.safetensors import Checkpoint, first_nonfinite, write_checkpoint


@pytest.mark.parametrize("dtype", ["F64", "F32", "F16", "BF16"])
def test_first_nonfinite_reads_every_float_width(dtype):
    kind = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
    array = np.linspace(-3e4, 3e4, 3 * 5 * 7).astype(kind[dtype]).reshape(3, 5, 7)
    assert first_nonfinite(array, dtype) == (0, -1)
    array[1, 2, 3] = np.inf
    array[2, 0, 1] = -np.inf
    array[2, 4, 6] = np.nan
    assert first_nonfinite(array, dtype) == (3, 1 * 35 + 2 * 7 + 3)
    assert first_nonfinite(np.full((4,), 7, np.int32), "I32") == (0, -1)


def damage(directory, name: str, value: float, dtype=None) -> None:
    """Rewrites the checkpoint in `directory` with `value` in tensor `name` (cast to `dtype`)."""
    ck = Checkpoint(directory)
    tensors = {n: np.array(ck.get(n)) for n in ck.names()}
    del ck
    array = tensors[name].astype(dtype or tensors[name].dtype)
    array.reshape(-1)[5] = value
    tensors[name] = array
    write_checkpoint(directory, sorted(tensors.items()))


@pytest.mark.torch
@pytest.mark.parametrize("value, dtype", [(np.nan, None), (np.inf, ml_dtypes.bfloat16)])
def test_import_refuses_a_checkpoint_with_nonfinite_weights(tmp_path, capsys, value, dtype):
    import hf_models

    from jaxmllm.hf.__main__ import main

    llm = hf_models.llama(tmp_path / "llama", tied=False)
    name = "model.layers.1.mlp.down_proj.weight"
    damage(llm, name, value, dtype)
    capsys.readouterr()  # (transformers' progress bar)
    out = tmp_path / "imported.yaml"
    assert main(["import", "--llm", llm, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if x.startswith("error: ")]  # (after a note)
    assert line.startswith(f"error: {llm}/model.safetensors: tensor {name} holds 1 NaN or Inf")
    assert "the first at [0, 5]" in err and "optim.lr" not in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.torch
def test_a_run_refuses_a_checkpoint_damaged_after_its_import(tmp_path, capsys):
    """(The loader checks each tensor as it reads it: no second pass over the files.)"""
    import hf_models

    from jaxmllm.hf.__main__ import main as hf
    from jaxmllm.train import cli as train

    llm = hf_models.llama(tmp_path / "llama", tied=False)
    out = tmp_path / "imported.yaml"
    assert hf(["import", "--llm", llm, "--out", str(out)]) == 0
    name = "model.embed_tokens.weight"
    damage(llm, name, np.nan)
    capsys.readouterr()
    argv = ["--config", str(out), "--set", "data.source=synthetic", "train.steps=1"]
    argv += [f"train.output_dir={tmp_path / 'run'}", "data.synthetic.image_fraction=0"]
    argv += ["data.synthetic.audio_fraction=0"]
    assert train(argv) == 2
    err = capsys.readouterr().err
    assert f"error: {llm}/model.safetensors: tensor {name} holds 1 NaN or Inf" in err, err
