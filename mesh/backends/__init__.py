"""Inference engines behind one interface (:class:`mesh.backends.base.Backend`)."""

from __future__ import annotations

from mesh.backends.base import Backend, Capacity, Chunk, Health
from mesh.config import ModelSettings


def create_backend(settings: ModelSettings) -> Backend:
    """The backend named by ``settings.backend``; engines are imported only when chosen."""
    if settings.backend == "llama_cpp":
        from mesh.backends.llama_cpp import LlamaCppBackend

        return LlamaCppBackend(settings)
    if settings.backend == "deterministic":
        from mesh.backends.deterministic import DeterministicBackend

        return DeterministicBackend(settings)
    if settings.backend == "openai":
        from mesh.backends.openai_http import OpenAIHTTPBackend

        return OpenAIHTTPBackend(settings)
    from mesh.backends.vllm import VLLMBackend

    return VLLMBackend(settings)


__all__ = ["Backend", "Capacity", "Chunk", "Health", "create_backend"]
