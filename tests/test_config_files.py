"""Config files and `--set` values a probe (issue 50) showed to change a config silently or
hold the process: a key given twice in one mapping, a YAML alias bomb. Each is refused, exit
2, naming the file (or the `--set`) and the lines, within a time backstop."""

from __future__ import annotations

import time

import pytest

from jaxmllm.config import ConfigError, load_config
from jaxmllm.config.yamlfile import MAX_NODES, expanded_size, read_yaml, shown

pytestmark = pytest.mark.host  # (conftest.py: the mark, and its check)

BACKSTOP_S = 10.0  # a hang guard: each of these reads in milliseconds


def bomb(levels: int = 9) -> str:
    """The probe's value: nested aliases, 9 of each level (about 600 bytes; 9^9 values)."""
    parts = ["&a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    names = "abcdefghijklmnop"
    for k in range(1, levels):
        parts.append(f"&{names[k]} [" + ", ".join([f"*{names[k - 1]}"] * 9) + "]")
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize("key", ["train.output_dir", "model.llm.width", "data.sources"])
def test_an_alias_bomb_in_a_config_value_is_refused_before_it_is_formatted(tmp_path, key):
    """A 600-byte value of nested aliases ended in MemoryError after 28 s: the check that
    refused its type formatted it (`got [...]`) whole. Refused now from its expanded size,
    at once, in a file and in a `--set` alike."""
    section, _, rest = key.partition(".")
    path = tmp_path / "bomb.yaml"
    nested = rest.split(".")
    text = f"{section}:\n" + "".join(
        "  " * (i + 1) + f"{name}:" + ("\n" if i < len(nested) - 1 else f" {bomb()}\n")
        for i, name in enumerate(nested)
    )
    path.write_text(text)
    assert len(bomb()) < 700
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"{path}: its aliases .* expand to more than"):
        load_config(path)
    with pytest.raises(ConfigError, match=f"--set {key}: its aliases"):
        load_config(None, [f"{key}={bomb()}"])
    assert time.monotonic() - start < BACKSTOP_S


def test_values_are_quoted_cut_to_a_line_in_messages():
    many = [list(range(1000))] * 1000  # (under the bound: a million values, one shared row)
    assert len(shown(many)) < 200 and len(shown("x" * 10**6)) < 100
    with pytest.raises(ConfigError, match="must be an integer, got ") as e:
        load_config(None, ["model.llm.width=" + "[" + "x" * 10_000 + "]"])
    assert len(str(e.value)) < 500
    assert expanded_size(read_yaml(bomb(3), "x")) == 1 + 10 + 91 + 820  # (a, b = 9 a, c = 9 b)
    with pytest.raises(ConfigError, match="expand to more than"):
        read_yaml(bomb(9), "x")
    shared = [list(range(9))] * 100  # (900 values, 109 counted with their lists)
    assert expanded_size(shared) == 1 + 100 * 10 and expanded_size(shared, most=100) == 101
    assert MAX_NODES >= 1 << 16


def test_a_key_given_twice_in_a_mapping_is_refused_naming_both_lines(tmp_path):
    """A second `data:` section (pasted from another config): YAML kept the last, and the run
    trained on the other data set without a word."""
    path = tmp_path / "twice.yaml"
    path.write_text(
        "data:\n  source: synthetic\ntrain:\n  steps: 3\n  log_every: 1\n  steps: 4\n"
        "data:\n  source: none\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(path)
    message = str(e.value)
    assert str(path) in message and "the key 'data' is given twice" in message, message
    assert "lines 1 and 7" in message and "merge them into one" in message
    path.write_text("train:\n  steps: 3\n  steps: 4\n")
    with pytest.raises(ConfigError, match="the key 'steps' is given twice .*lines 2 and 3"):
        load_config(path)
    with pytest.raises(ConfigError, match="--set optim: .*the key 'lr' is given twice"):
        load_config(None, ["optim={lr: 1.0e-3, lr: 1.0e-2}"])


def test_a_merge_may_override_its_base(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(
        "data:\n  sources:\n    - &first {path: a.jsonl, weight: 1.0, name: a}\n"
        "    - {<<: *first, path: b.jsonl, name: b}\n"
    )
    cfg = load_config(path)
    assert [(s.path, s.weight, s.name) for s in cfg.data.sources] == [
        ("a.jsonl", 1.0, "a"),
        ("b.jsonl", 1.0, "b"),
    ]
