"""Every engine option is checked: by its line in the milestone's ``OPTIONS`` table, or by ``resolve`` itself."""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

# Options whose checks need the machine or another option (device, dtype, lengths, backends, capture sizes and token
# counts, quantization: its kernel runs on the CPU in float32 only; fuse_layers=True: its calls run in some dtypes
# only).
CHECKED_BY_RESOLVE = {"model", "device", "dtype", "max_model_len", "linear_backend", "attention_backend",
                      "cudagraph_capture_sizes", "piecewise_capture_sizes", "quantization", "fuse_layers"}


def test_every_option_has_a_line_in_the_table(mod, milestone):
    config = importlib.import_module(f"{mod.__name__}.config")
    fields = {field.name for field in dataclasses.fields(config.EngineConfig)}
    assert set(config.OPTIONS) == fields - CHECKED_BY_RESOLVE, (
        f"{milestone}: an option without a line in OPTIONS: {sorted(fields - CHECKED_BY_RESOLVE - set(config.OPTIONS))}"
    )


def test_a_bad_value_is_refused_with_the_options_name(mod, milestone):
    config = importlib.import_module(f"{mod.__name__}.config")
    for name, kind in config.OPTIONS.items():
        with pytest.raises(ValueError, match="^" + re.escape(f"{name} must be {kind.description}")):
            config.EngineConfig(device="cpu", **{name: object()}).resolve(model_max_len=64)
