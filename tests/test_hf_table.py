"""The family table (`jaxmllm/hf/table.py`): every consumer reads its rows, and no code outside
it names a model type."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxmllm.hf import table
from jaxmllm.hf.check import HF_MODULES
from jaxmllm.hf.family import FamilyError
from jaxmllm.hf.registry import FAMILIES, family_for
from jaxmllm.hf.whole_config import decoder_of
from jaxmllm.hf.wholes import WHOLES

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

ROOT = Path(__file__).resolve().parents[1]
ROWS = (*table.DECODERS, *table.TOWERS)
MODEL_TYPES = {t for row in (*ROWS, *(w.row for w in WHOLES)) for t in row.model_types}
# Strings equal to a model type that name something else: model.audio.stem's and data.mel's
# value `whisper` is the Whisper stem and log-mel, options of ours
NOT_MODEL_TYPES = {"whisper"}


def model_type_names(source: str) -> list[str]:
    """The string constants of `source` that are a model type's name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in MODEL_TYPES - NOT_MODEL_TYPES:
                found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_model_type_names_live_only_in_the_table():
    """No module of jaxmllm/hf/ but the table names a model type (a branch on a family's
    name is a fact kept outside its row); the check finds one where it is put back."""
    found = {}
    for path in sorted((ROOT / "jaxmllm" / "hf").glob("*.py")):
        if path.name == "table.py":
            continue
        if names := model_type_names(path.read_text()):
            found[str(path.relative_to(ROOT))] = names
    assert not found, found
    assert model_type_names('if family.name == "qwen3_moe":\n    pass\n') == ["line 1: 'qwen3_moe'"]


def test_every_row_has_its_family_and_its_reference():
    """Each decoder and tower row is read by one family of the registry, each whole row by
    one whole, and `hf check` has a transformers module for each model type."""
    assert [f.row for f in FAMILIES] == list(ROWS)
    wholes = [v for v in vars(table).values() if isinstance(v, table.WholeRow)]
    assert sorted(w.row.name for w in WHOLES) == sorted(w.name for w in wholes)
    for family in FAMILIES:
        for t in family.model_types:
            assert HF_MODULES[t, family.role].model_type == t
    for whole in WHOLES:
        assert HF_MODULES[whole.name, "llm"].cls == whole.hf_class


def _llm(row: table.DecoderRow, attn_bias: str):
    """A config whose LLM has `row`'s layer kinds, block (its norms, its layer scalar) and
    QK-norm, and `attn_bias`."""
    llm = SimpleNamespace(
        linear=SimpleNamespace(enabled=row.hybrid),
        moe=SimpleNamespace(enabled=row.moe),
        post_norms=row.post_norms,
        layer_scalar=row.layer_scalar,
        qk_norm=row.qk_norm,
        attn_bias=attn_bias,
    )
    return SimpleNamespace(model=SimpleNamespace(llm=llm))


@pytest.mark.parametrize("row", table.DECODERS, ids=lambda r: r.name)
def test_decoder_of_finds_the_row_whose_options_ours_are(row):
    """Our options of each row's kind give that row back, whichever biases it allows."""
    for bias in row.biases.allowed():
        assert decoder_of(_llm(row, bias)).row == row


def test_decoder_of_prefers_the_tables_first_row_where_several_fit():
    """Biases no dense row without QK-norm has (q and v alone) give the first such row, and
    a row moved later in the table loses the tie."""
    assert decoder_of(_llm(table.QWEN2, "qv")).row == table.LLAMA
    assert decoder_of(_llm(table.QWEN2, "qkv")).row == table.QWEN2


def test_a_new_llama_like_family_is_one_row():
    """A row alone gives a family that reads, writes and names its config.json."""
    from jaxmllm.hf.whole_config import decoder_family

    row = dataclasses.replace(table.LLAMA, name="llama_like", hf_class="LlamaLikeForCausalLM")
    family = decoder_family(row)
    hf = {
        "model_type": "llama_like",
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 24,
        "rms_norm_eps": 1e-6,
        "attention_bias": True,
    }
    section = family.section(hf)
    assert section["attn_bias"] == "qkvo" and not section["qk_norm"]
    assert (family.name, family.model_types, family.role) == ("llama_like", ("llama_like",), "llm")


def test_the_refusal_lists_every_decoder_of_the_table():
    """An unknown model type is refused naming every decoder row and every whole."""
    with pytest.raises(FamilyError) as e:
        family_for("llm", {"model_type": "no_such_model"}, "ckpt")
    for name in [r.name for r in table.DECODERS] + [w.name for w in WHOLES if "llm" in w.parts]:
        assert name in str(e.value)
