"""The default model's tokenizer metadata and tokenizer, read once for the text tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from prefixd.text.tokenizer import Tokenizer
from tests.helpers.tiny_gguf import default_tokenizer_fields


@pytest.fixture(scope="session")
def gguf_fields(default_gguf: Path) -> dict[str, Any]:
    """tokenizer.* metadata of the default GGUF (a copy: tests build variants from it)."""
    return dict(default_tokenizer_fields())


@pytest.fixture(scope="session")
def tok(gguf_fields: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_fields(gguf_fields)
