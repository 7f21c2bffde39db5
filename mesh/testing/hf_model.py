"""The bundled SmolLM2 GGUF as a Hugging Face model directory, for engines that load those
(vLLM): no download, so the GPU tests and ``mesh bench vllm`` run on a machine with no network.

transformers reads the GGUF (dequantizing its weights to float16) and writes the directory once;
later calls find it in place. Needs torch, transformers and gguf, which a vLLM host has.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mesh.models import resolve_model_path
from protocol.errors import UnavailableError


def default_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "nats-llm-mesh" / "smollm2-135m-instruct-hf"


def hf_from_gguf(out: Path | None = None, gguf: Path | None = None) -> Path:
    """The model directory (made on first use) holding the weights, config and tokenizer with
    its chat template."""
    out = out or default_dir()
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise UnavailableError(
            f"turning the bundled GGUF into a model directory needs torch, transformers and "
            f"gguf ({exc}): pip install 'nats-llm-mesh[vllm]'",
            retryable=False,
        ) from None

    gguf = gguf or resolve_model_path(None)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError(f"{gguf.name} carries no chat template")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float16
    )
    # The weights come dequantized; what marks them as GGUF would stop save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted run left
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out
