"""A checkpoint's config.json whose values have the wrong kind, lie out of range, or disagree
with each other: `hf import` refuses it in one line naming the file's key (a traceback deep in
the import before, or an exit 0 importing another model), and its advice never changes the
model. A value transformers honours exactly is imported, and held to transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from jaxmllm.hf.__main__ import main
from jaxmllm.hf.config_json import check_values
from jaxmllm.hf.family import FamilyError


def claim(directory: Path, key: str, value) -> None:
    """Sets `key` (dotted for a nested section) of `directory`'s config.json."""
    path = directory / "config.json"
    data = json.loads(path.read_text())
    *outer, last = key.split(".")
    node = data
    for part in outer:
        node = node[part]
    node[last] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("key", "value", "must"),
    [
        ("tie_word_embeddings", "false", "true or false"),  # (a true string)
        ("attention_bias", 0, "true or false"),
        ("num_hidden_layers", 2.0, "a whole number from 1 to"),
        ("hidden_size", True, "a whole number from 1 to"),
        ("rope_parameters.rope_theta", 0, "a number above 0"),
        ("rope_parameters.rope_theta", -5e5, "a number above 0"),
        ("rms_norm_eps", "1e-6", "a number above 0 to 1"),
        ("rope_parameters.partial_rotary_factor", 1.5, "a number above 0 to 1"),
        ("text_config.rope_parameters.mrope_section", [16, 24], "a list of 3 whole numbers"),
        ("text_config.rope_parameters.mrope_section", [16, 24, 24.5], "a list of 3 whole"),
        ("vision_config.deepstack_visual_indexes", "0,2", "a list of any number of whole"),
        ("hidden_act", ["silu"], "a name (a string)"),
        ("image_token_id", "151655", "a token id"),
        ("layer_types", "full_attention", "a list of layer kinds"),
        # (0 is Qwen2-MoE's "no window", read by test_hf_moe's checkpoints)
        ("sliding_window", -1, "a whole number from 0 to"),
    ],
)
def test_a_value_of_the_wrong_kind_is_refused_naming_its_key(key, value, must):
    """(On the dict as read: the rules are the same for every family and section.)"""
    hf = {
        "model_type": "qwen3_vl",
        "rope_parameters": {"rope_theta": 1e6},
        "text_config": {"rope_parameters": {"mrope_section": [16, 24, 24]}},
        "vision_config": {},
    }
    *outer, last = key.split(".")
    node = hf
    for part in outer:
        node = node[part]
    node[last] = value
    with pytest.raises(FamilyError, match="damaged or not a model's") as e:
        check_values(hf, Path("ck/config.json"))
    assert str(e.value).startswith(f"ck/config.json: {key} = {value!r:.60} must be {must}")
    node[last] = None  # (transformers' "not set": its default)
    check_values(hf, Path("ck/config.json"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import hf_models

    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": Path(hf_models.llama(root / "llama", tied=False)),
        "qwen3_5": Path(hf_models.qwen3_5(root / "qwen3_5")),
        "qwen2_vl": Path(hf_models.qwen2_vl(root / "qwen2_vl")),
    }


def imported(built, tmp_path, capsys, name: str, key: str, value) -> tuple[int, str]:
    """(`hf import`'s exit code, its error line) for a copy of `name` with `key` = `value`."""
    directory = Path(shutil.copytree(built[name], tmp_path / name))
    claim(directory, key, value)
    capsys.readouterr()
    flag = "--model" if name == "qwen2_vl" else "--llm"
    code = main(["import", flag, str(directory), "--out", str(tmp_path / "run.yaml")])
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert len(errors) == (code != 0), errors
    assert (tmp_path / "run.yaml").exists() == (code == 0)
    return code, (errors or [""])[0]


@pytest.mark.torch
@pytest.mark.parametrize(
    ("name", "key", "value", "says"),
    [
        ("llama", "num_key_value_heads", 3, "num_attention_heads 4 is not a multiple of its "),
        (
            "qwen2_vl",
            "text_config.rope_parameters.mrope_section",
            [1, 1, 1],
            "mrope_section [1, 1, 1] sums to 3, and must to half the 16 rotary channels",
        ),
        (  # (head 16: 5 channels; transformers rotates 6 at frequencies spaced for 5)
            "qwen3_5",
            "rope_parameters.partial_rotary_factor",
            0.3125,
            "partial_rotary_factor 0.3125 of head_dim 16 gives a rotary width of 5 channels",
        ),
        ("qwen2_vl", "text_config.initializer_range", "small", "initializer_range"),
        # (sizes the tensors do not have: imported with exit 0, then refused by training)
        ("llama", "hidden_size", 128, "does not hold the model's"),
        ("llama", "intermediate_size", 64, "does not hold the model's"),
        ("qwen2_vl", "vision_config.embed_dim", 48, "does not hold the model's"),
    ],
)
def test_values_that_disagree_are_refused_naming_the_checkpoint_s_keys(
    built, tmp_path, capsys, name, key, value, says
):
    code, error = imported(built, tmp_path, capsys, name, key, value)
    assert code == 2 and says in error, error
    assert "model.llm." not in error and "[0, 0, 0]" not in error  # (no advice to change it)


@pytest.mark.torch
def test_a_partial_rotary_width_transformers_truncates_to_an_even_one_is_its_model(
    built, tmp_path, capsys
):
    """0.3 of a 16-wide head: transformers rotates int(4.8) = 4 channels, as jaxmllm does."""
    from jaxmllm.hf.check_whole import check_all

    assert (
        imported(built, tmp_path, capsys, "qwen3_5", "rope_parameters.partial_rotary_factor", 0.3)[
            0
        ]
        == 0
    )
    (result,) = check_all(str(tmp_path / "qwen3_5"), "llm", tokens=16)
    assert result["max_abs_diff"] < 1e-3, result


@pytest.mark.torch
def test_a_video_capable_tower_imports_taking_videos(built, tmp_path, capsys):
    """Qwen2-VL's tower has a temporal patch: the import set model.vision.video false, and
    the user's videos, accepted by `hf check --data` and the index, were refused by training."""
    import yaml

    assert imported(built, tmp_path, capsys, "qwen2_vl", "model_type", "qwen2_vl")[0] == 0
    vision = yaml.safe_load((tmp_path / "run.yaml").read_text())["model"]["vision"]
    assert vision["temporal_patch"] == 2 and vision["video"] is True
