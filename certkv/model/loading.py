"""Loading causal LMs: the embedded model, a named model or GGUF file, a local folder, or a Hugging Face id.

All of them load through the same `transformers` Auto classes. The embedded model ships inside the
package (``certkv/embedded``), so ``load_model("embedded")`` never touches the network. A named
model (``smollm2-135m``) or a ``.gguf`` path is converted once into a local folder in certkv's
cache (:mod:`certkv.model.named_models`) and loaded from there, offline. A hub id is first looked
up in the local Hugging Face cache; when it is not there and cannot be downloaded the caller gets
one line saying so instead of a stack of HTTP errors.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from certkv.errors import CertkvError
from certkv.model.embedded_tokenizer import EMBEDDED_DIR
from certkv.model.named_models import converted_folder, gguf_fingerprint, is_gguf_source

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED = "embedded"
#: The embedded model fine-tuned to also recite its context's records (builtin:recite, answers of
#: 42-126 tokens): the long-generation contracts' model. Same architecture and tokenizer; its own
#: weights, so that the default model's calibrated figures and tests stay as they are.
EMBEDDED_RECITE = "embedded-recite"
EMBEDDED_RECITE_DIR = EMBEDDED_DIR.parent / "embedded_recite"


def resolve_device(device: str = "auto") -> str:
    """`auto` means CUDA when present, else CPU; anything else is checked and passed through."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise CertkvError(f"device {device!r} was asked for but CUDA is not available; use device: cpu or auto")
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise CertkvError(f"unknown device {device!r}; use auto, cpu or cuda[:N]")
    return device


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """`auto` means bfloat16 on CUDA and float32 on CPU (CPU half precision is slow and inexact)."""
    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise CertkvError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def _source(name_or_path: str) -> tuple[str, bool]:
    """Return (what to pass to from_pretrained, whether it is a local folder)."""
    if name_or_path in (EMBEDDED, EMBEDDED_RECITE):
        folder = EMBEDDED_DIR if name_or_path == EMBEDDED else EMBEDDED_RECITE_DIR
        if not (folder / "model.safetensors").is_file():
            raise CertkvError(
                f"the {name_or_path} model's weights are missing from {folder}; reinstall certkv "
                "or, from a certkv checkout, train them with `python tools/train_embedded.py`"
            )
        return str(folder), True
    if is_gguf_source(name_or_path):  # a named model or a .gguf file: its converted folder
        return str(converted_folder(name_or_path)), True
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise CertkvError(f"model folder {path} has no config.json; point to a saved Hugging Face model folder")
        return str(path), True
    return name_or_path, False


def model_fingerprint(name_or_path: str = EMBEDDED) -> str:
    """A short identity of a model's weights, without loading them.

    Local folders (the embedded model included): sha256 over config.json and every weight file's
    name and content (size and name only past 1 GB in total, to keep resuming cheap). Named models
    and ``.gguf`` paths: the GGUF file's sha256 (remembered while its size and mtime hold, so
    repeated calls cost a ``stat``), without converting it. Hub ids: the id and the cached
    snapshot's commit when one is cached.
    """
    if is_gguf_source(name_or_path):
        return gguf_fingerprint(name_or_path)
    source, local = _source(name_or_path)
    if not local:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(name_or_path, "config.json")
        except Exception:  # noqa: BLE001 - a fingerprint must never stop a run
            cached = None
        revision = Path(cached).parent.name if isinstance(cached, str) else "not-cached"
        return f"{name_or_path}@{revision}"
    folder = Path(source)
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
    hash_content = sum(p.stat().st_size for p in weights) <= 1 << 30
    for p in weights:
        digest.update(p.name.encode())
        digest.update(p.read_bytes() if hash_content else str(p.stat().st_size).encode())
    return f"{name_or_path}#{digest.hexdigest()[:16]}"


def load_model(
    name_or_path: str = EMBEDDED, device: str = "auto", dtype: str = "auto", attn_implementation: str = "sdpa"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in eval mode, for calibration or serving.

    Parameters
    ----------
    name_or_path : str, default "embedded"
        ``"embedded"`` (the tiny Llama shipped in the package: offline, CPU), a named model such as
        ``"smollm2-135m"`` or a ``.gguf`` path (converted once into certkv's cache, then offline), a
        local folder, or a Hugging Face id (downloaded unless ``HF_HUB_OFFLINE`` is set and it is cached).
    device : str, default "auto"
        ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    dtype : str, default "auto"
        ``"auto"``, ``"float32"``, ``"float16"`` or ``"bfloat16"``.
    attn_implementation : str, default "sdpa"
        The transformers attention the model is built with; certkv switches it per call where it
        needs another (the batched candidate decode, the Hájek attention).

    Returns
    -------
    (model, tokenizer)
        A ``transformers`` causal LM and its tokenizer.

    Raises
    ------
    CertkvError
        One line naming what is missing (weights, a folder, a device) and how to fix it.
    """
    source, local = _source(name_or_path)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    kwargs: dict[str, Any] = {"local_files_only": True} if (local or offline) else {}
    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a weight-loading bar per call would drown certkv's own output
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=torch_dtype, attn_implementation=attn_implementation, **kwargs
        )
    except OSError as exc:
        if local:
            raise CertkvError(f"could not load the model in {source}: {exc}") from None
        where = "offline (HF_HUB_OFFLINE is set)" if offline else "offline and could not be downloaded"
        raise CertkvError(
            f"model {name_or_path!r} is not available {where}; download it first "
            f"(`hf download {name_or_path}`) or pass a local folder"
        ) from None
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()
    model.to(device)
    model.eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
