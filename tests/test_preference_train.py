"""DPO end to end on a user's pairs with images, as people run it: `hf import --model` of a tiny
random whole checkpoint, a preference file (RLAIF-V's JSONL, TRL's conversational Parquet with
inline images, TRL's standard JSON) indexed, two steps of DPO, then: with LoRA, `hf export`
writes a PEFT adapter that peft loads onto the transformers model with its logits ours (and
`hf check --data` on the pairs: their log-prob sums peft's); without, the reference is another
checkpoint (the first loss is not ln 2) and one of another vocabulary or architecture is
refused at start-up naming preference.reference."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_hf_whole_train import whole_dir

from jaxmllm import train
from jaxmllm.config import ConfigError, load_config
from jaxmllm.data.index import build_index
from jaxmllm.hf.__main__ import main as hf_main
from jaxmllm.hf.export import export_run
from jaxmllm.loop.metrics import read_metrics

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = [pytest.mark.slow, pytest.mark.torch]
PAIRS = 6
SIZES = ((24, 32), (32, 24), (40, 40), (24, 48))  # (images of other sizes: other grids)


def _images(d: Path, rng) -> list[str]:
    names = []
    for k in range(PAIRS):
        h, w = SIZES[k % len(SIZES)]
        Image.fromarray(rng.integers(0, 256, (h, w, 3), np.uint8)).save(d / f"{k}.png")
        names.append(f"{k}.png")
    return names


def _qa(k: int) -> tuple[str, str, str]:
    colours = ("red", "blue", "green")
    right, wrong = colours[k % 3], colours[(k + 1) % 3]
    return f"What colour is shape {k}?", f"It is {right}.", f"A {wrong} dog, I think."


def pairs_file(d: Path, form: str) -> Path:
    """PAIRS preference records about an image each, in one of the forms users bring:
    `rlaif_v` (JSONL, the image a path beside it), `trl_conversational` (Parquet, the images
    inline as HF datasets' structs {"bytes", "path"}), `trl_standard` (a JSON array)."""
    d.mkdir(parents=True, exist_ok=True)
    names = _images(d, np.random.default_rng(0))
    rows = []
    for k, name in enumerate(names):
        question, chosen, rejected = _qa(k)
        if form == "rlaif_v":
            rows.append({"image": name, "question": question, "chosen": chosen})
            rows[-1].update(rejected=rejected, ds_name="mine", origin_dataset="mine")
        elif form == "trl_conversational":
            parts = [{"type": "image", "text": None}, {"type": "text", "text": question}]
            rows.append(
                {
                    "prompt": [{"role": "user", "content": parts}],
                    "chosen": [
                        {"role": "assistant", "content": [{"type": "text", "text": chosen}]}
                    ],
                    "rejected": [
                        {"role": "assistant", "content": [{"type": "text", "text": rejected}]}
                    ],
                    "images": [{"bytes": (d / name).read_bytes(), "path": name}],
                }
            )
        else:
            prompt = f"<image>{question}"
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
            rows[-1]["images"] = [name]
    if form == "rlaif_v":
        path = d / "prefs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif form == "trl_conversational":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = d / "prefs.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path = d / "prefs.json"
        path.write_text(json.dumps(rows, indent=1))
    return path


def imported(name: str, tmp_path: Path) -> tuple[str, Path]:
    """A tiny whole checkpoint and the config `python -m jaxmllm.hf import --model` writes."""
    source = whole_dir(name, tmp_path / name)
    config = tmp_path / "run.yaml"
    assert hf_main(["import", "--model", source, "--out", str(config)]) == 0
    return source, config


# An imported tiny checkpoint on a user's file, on 8 CPU devices in fp32 (post-training runs:
# DPO here, GRPO in test_grpo_train)
ON_FILES = [
    "mesh.cpu_devices=8",
    "mesh.data=4",
    "mesh.fsdp=2",
    "model.compute_dtype=float32",
    "model.remat=none",
    "batch.llm_row_len=256",  # (a pair: ~130 tokens, its image's rows twice)
    "batch.attention_block=32",
    "data.source=files",
    "data.eval.source=none",
    "data.workers=0",
    "data.image_min_pixels=256",
    "data.image_max_pixels=1024",
]


def dpo_config(config: Path, data: Path, out: Path, *sets: str):
    """The imported config on the pairs, two steps of DPO on 8 CPU devices; indexed."""
    cfg = load_config(
        config,
        [
            *ON_FILES,
            f"data.path={data}",
            "train.objective=dpo",
            "train.steps=2",
            "train.checkpoint_every=2",
            "train.log_every=1",
            "train.progress_bar=false",
            "optim.lr=1e-2",
            "optim.warmup_steps=0",  # (the first step moves the policy off the reference)
            f"train.output_dir={out}",
            *sets,
        ],
    )
    summary = build_index(cfg, progress=False)
    assert summary["pairs"] == summary["accepted"] == PAIRS and not summary["rejects"], summary
    return cfg


def _logged(out: Path) -> list[dict]:
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2], rows
    for r in rows:
        assert r["pairs"] > 0 and np.isfinite(r["loss"]), r
    return rows


def _dpo_loss(out: Path, row: dict) -> float:
    """A logged step's preference loss: its loss less an MoE's router losses (their
    coefficients times the logged means, as the step adds them)."""
    moe = json.loads((out / "config.json").read_text())["model"]["llm"].get("moe") or {}
    router = moe.get("aux_loss_coef", 0) * row.get("moe/aux_loss", 0)
    return row["loss"] - router - moe.get("z_loss_coef", 0) * row.get("moe/z_loss", 0)


LORA = ["model.llm.lora.rank=4", "model.llm.lora.alpha=8", "model.vision.lora.rank=2"]


def lora_run_exports_to_peft(
    name: str, form: str, tmp_path: Path, *sets: str, pair_check: bool = True
) -> None:
    """The LoRA DPO flow: the first step's loss ln 2 (the reference is the policy with its
    adapters off, and they start at zero; an MoE's router losses aside), the second's not, its
    margin positive; the export a PEFT adapter that peft loads with every key, its logits ours
    (`exported_adapter`: with an image in the prompt), read back the run's adapters; and
    (`pair_check`) `hf check --adapter --data` on the pairs: each completion's log-prob sum
    peft's."""
    from test_hf_moe import exported_adapter

    source, config = imported(name, tmp_path)
    data = pairs_file(tmp_path / "data", form)
    out = tmp_path / "run"
    train.main(dpo_config(config, data, out, *LORA, *sets))
    first, second = _logged(out)
    assert _dpo_loss(out, first) == pytest.approx(math.log(2), abs=1e-6), first
    assert abs(first["rewards/margins"]) < 1e-5, first
    assert abs(_dpo_loss(out, second) - math.log(2)) > 1e-4, second
    assert second["rewards/margins"] > 0, second  # (the step moved the policy the right way)

    adapter = tmp_path / "adapter"
    assert set(export_run(str(out), str(adapter))) == {"model"}
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    trained, mine = exported_adapter(source, out, adapter, 1e-4)
    moved = [p for p in trained if p.endswith("lora_b")]
    assert moved and any(np.abs(trained[p]).max() > 0 for p in moved)  # (B moved off zero)
    for path, value in trained.items():
        np.testing.assert_allclose(mine[path], value, rtol=1e-6, atol=1e-7, err_msg=path)
    if pair_check:
        check = ["check", source, "--adapter", str(adapter), "--data", str(data), "--json"]
        assert hf_main(check) == 0


def test_rlaif_v_jsonl_lora_dpo_on_qwen2_5_vl_exports_an_adapter_peft_loads(tmp_path, capsys):
    """RLAIF-V's flat records with images, LoRA on the LLM and the vision tower of a
    Qwen2.5-VL (windowed tower, M-RoPE): `lora_run_exports_to_peft`."""
    lora_run_exports_to_peft("qwen2_5_vl", "rlaif_v", tmp_path)
    pairs = [json.loads(x) for x in capsys.readouterr().out.splitlines() if "chosen_logps" in x]
    assert len(pairs) == 4 and all(p["max_abs_diff"] < 1e-4 for p in pairs), pairs


def test_trl_conversational_parquet_lora_dpo_on_qwen3_vl_moe_exports_an_adapter(tmp_path):
    """TRL's conversational records in Parquet, the images inline as HF datasets' structs, LoRA
    DPO on a Qwen3-VL-MoE (DeepStack, experts over 2 devices beside 2 x 2 data-parallel ones):
    `lora_run_exports_to_peft`."""
    mesh = ["mesh.data=2", "mesh.expert=2"]
    lora_run_exports_to_peft(
        "qwen3_vl_moe", "trl_conversational", tmp_path, *mesh, pair_check=False
    )  # (the pairs' check of a Qwen3-VL-MoE: test_hf_check_pairs)


def test_full_dpo_against_another_checkpoint_and_refusals_naming_the_reference(tmp_path):
    """TRL's standard records in a JSON array; every parameter trained (no LoRA), the
    reference another random Qwen2.5-VL of the same vocabulary: the first step's loss is not
    ln 2 (policy and reference differ from the start) and the second moves. A reference of
    another vocabulary, or of another architecture (a Qwen3-VL), stops the run at start-up
    with one line naming preference.reference, writing no checkpoint and no config."""
    source, config = imported("qwen2_5_vl", tmp_path)
    data = pairs_file(tmp_path / "data", "trl_standard")
    others = {
        "vocabulary": whole_dir("qwen2_5_vl", tmp_path / "vocab", vocab=640),
        "architecture": whole_dir("qwen3_vl", tmp_path / "arch"),
    }
    for what, other in others.items():
        out = tmp_path / f"refused-{what}"
        cfg = dpo_config(config, data, out, f"preference.reference={other}")
        with pytest.raises(ConfigError) as refused:
            train.main(cfg)
        message = str(refused.value)
        assert "\n" not in message and f"preference.reference={other}" in message, message
        assert not list(out.glob("checkpoints/*")) and not (out / "config.json").exists()
        print(message)

    reference = whole_dir("qwen2_5_vl", tmp_path / "reference", seed=1)
    out = tmp_path / "run"
    train.main(dpo_config(config, data, out, f"preference.reference={reference}"))
    first, second = _logged(out)
    print(first, second)
    assert abs(first["loss"] - math.log(2)) > 1e-3, first
    assert first["rewards/margins"] != 0 and second["loss"] != first["loss"], (first, second)
