"""`python -m jaxmllm.bench.node`: a recipe's real step on every device of the machine, one
report. Its CPU smoke: configs/tiny.yaml on the 8 forced CPU devices (tests/conftest.py)."""

from __future__ import annotations

import json

import pytest

from jaxmllm.bench import node


@pytest.mark.slow  # (a bench run: the trainer's step compiled on 8 devices, warm-up, steps)
def test_the_node_report_holds_the_step_its_mfu_two_ways_the_fill_and_the_host(tmp_path, capsys):
    out = tmp_path / "node.json"
    args = ["--config", "configs/tiny.yaml", "--steps", "2", "--warmup", "1", "--json", str(out)]
    assert node.main([*args, "--set", "train.peak_tflops=0.5"]) == 0
    r = json.loads(out.read_text())
    assert r["devices"] == 8 and r["steps"] == len(r["per_step"]) == 2
    assert r["first_step_s"] > r["step_time_s"] > 0 and r["tokens_per_s"] > 0
    # MFU from the configured peak, the towers' FLOPs in it and out of it
    assert 0 < r["llm_tflops_per_device"] < r["tflops_per_device"]
    assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5)
    assert r["mfu_llm"] == pytest.approx(r["llm_tflops_per_device"] / 0.5)
    assert {k for k in r if k.startswith("fill/")} == {"fill/llm", "fill/vision", "fill/audio"}
    assert all(0 < r[k] <= 1 for k in r if k.startswith("fill/"))
    assert 0 <= r["host/wait_share"] < 1 and r["host/load_s"] > 0
    text = capsys.readouterr().out
    for line in ("first step (its compile included)", "MFU, all phases / the LLM alone"):
        assert line in text
    assert "fill, vision" in text and "host: waited for the next batch" in text


def test_a_precomputed_reference_is_refused_naming_what_to_benchmark_instead():
    from jaxmllm.config import ConfigError, load_config

    cfg = load_config("configs/tiny_dpo.yaml", ["preference.reference=precomputed"])
    with pytest.raises(ConfigError, match="preference.reference: base"):
        node.bench_config(cfg, 2)
