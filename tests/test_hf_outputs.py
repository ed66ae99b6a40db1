"""`hf import --out` and `hf export --out` aimed where nothing may be written (a file inside the
checkpoint read, an existing directory or file of the user's, a symbolic link, a path under a
file): one line naming the flag and the path, exit 2, nothing of the user's changed."""

from __future__ import annotations

import os

import pytest

from jaxmllm.hf.__main__ import main


def refused(capsys, argv: list[str], says: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --out ") and says in err and "Traceback" not in err, err
    assert err.count("\n") == 1, err


@pytest.fixture
def checkpoint(tmp_path):
    """A directory standing for a checkpoint: the refusals come before anything is read."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    return ckpt


def test_import_never_writes_where_it_may_not(tmp_path, capsys, checkpoint):
    imp = ["import", "--llm", str(checkpoint), "--out"]
    config = checkpoint / "config.json"
    refused(capsys, [*imp, str(config)], f"is inside {checkpoint}, which this command reads")
    refused(capsys, [*imp, str(checkpoint / "train.yaml")], "which this command reads")
    assert config.read_text() == '{"model_type": "llama"}'
    assert sorted(p.name for p in checkpoint.iterdir()) == ["config.json"]

    (tmp_path / "folder").mkdir()
    refused(capsys, [*imp, str(tmp_path / "folder")], "is a directory: name the file to write")
    mine = tmp_path / "mine.yaml"
    mine.write_text("train: {steps: 3}\n")
    refused(capsys, [*imp, str(mine)], "exists and this command did not write it")
    assert mine.read_text() == "train: {steps: 3}\n"

    dangling = tmp_path / "dangling.yaml"
    os.symlink(tmp_path / "nowhere.yaml", dangling)
    refused(capsys, [*imp, str(dangling)], "is a symbolic link (to ")
    assert not (tmp_path / "nowhere.yaml").exists()
    to_folder = tmp_path / "to_folder"
    os.symlink(tmp_path / "folder", to_folder)
    refused(capsys, [*imp, str(to_folder)], "is a symbolic link (to ")
    assert not list((tmp_path / "folder").iterdir())

    (tmp_path / "plain").write_text("x")
    under = tmp_path / "plain" / "sub" / "out.yaml"
    refused(capsys, [*imp, str(under)], f"{tmp_path / 'plain'} is a file, not a directory")


def test_export_never_writes_where_it_may_not(tmp_path, capsys):
    """(Refused before the run is read: the run directory here holds nothing.)"""
    exp = ["export", str(tmp_path / "run"), "--out"]
    (tmp_path / "empty").mkdir()
    dangling = tmp_path / "dangling"
    os.symlink(tmp_path / "nowhere", dangling)
    refused(capsys, [*exp, str(dangling)], "is a symbolic link (to ")
    assert not (tmp_path / "nowhere").exists() and dangling.is_symlink()
    to_empty = tmp_path / "to_empty"
    os.symlink(tmp_path / "empty", to_empty)
    refused(capsys, [*exp, str(to_empty)], "is a symbolic link (to ")
    assert to_empty.is_symlink() and not list((tmp_path / "empty").iterdir())
    (tmp_path / "plain").write_text("x")
    refused(capsys, [*exp, str(tmp_path / "plain" / "hf")], "is a file, not a directory")
    refused(capsys, [*exp, str(tmp_path / "plain")], "is a file: name a directory")
    assert (tmp_path / "plain").read_text() == "x"


@pytest.mark.torch
def test_import_rewrites_its_own_config_and_nothing_else(tmp_path, capsys):
    """A rerun of the same import writes its config again (it wrote it); the file is whole."""
    import hf_models

    llm = hf_models.llama(tmp_path / "llama", tied=False)
    out = tmp_path / "cfg" / "imported.yaml"
    assert main(["import", "--llm", llm, "--out", str(out)]) == 0
    first = out.read_text()
    assert main(["import", "--llm", llm, "--out", str(out)]) == 0
    assert out.read_text() == first
    assert sorted(p.name for p in out.parent.iterdir()) == ["imported.yaml"]  # no partial left
    capsys.readouterr()
