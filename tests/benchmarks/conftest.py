"""One bf16 profile of samples/llama.py (captured and compiled three ways: ~10 s) shared by the benchmark tests."""

from __future__ import annotations

import pytest

from fxshard.cost.profile import model_profile


@pytest.fixture(scope="session")
def llama_bf16_profile():
    return model_profile("samples/llama.py", dtype="bf16")
