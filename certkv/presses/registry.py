"""Press names, lazy resolution and construction.

Contracts name presses by short registry names (``snapkv``, ``streaming_llm``, ...) or by an import
path ``package.module:Class``. Validating a contract must not import torch, so the kvpress table
below is static: it is checked against ``kvpress.__all__`` by the test suite so it cannot drift from
the installed kvpress (0.5.5). Classes are imported only when a press is built at calibration time.

Every registry entry records how ``kv_retained`` maps onto the press (its *retention knob*): most
presses take ``compression_ratio = 1 − kv_retained``; wrappers (adakv, criticalkv, chunkkv, ...)
forward that attribute to their inner press. Presses whose eviction is configured by something else
(ThinK prunes key channels, DuoAttention compresses heads, DMS uses a threshold, ...) have no knob:
a contract cannot certify them by kv_retained, and saying so at validation time is better than a
calibration run whose nominal retention means nothing.

Some presses with a knob still cannot run where a contract asks for them, and are refused at
validation too, with one line saying why (:func:`refusal_reason`): presses that score with weights
trained for particular base models (KVzap, fast KVzip, RestoreKV download them from the Hugging Face
hub by the model's name; none exist for the embedded model), and PyramidKV, whose per-layer budgets
leave caches of different lengths that transformers cannot attend over with one attention mask.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from certkv.errors import CertkvError
from certkv.model.named_models import is_gguf_source

#: press_kwargs keys whose values are presses themselves (a name, an import path, or a nested
#: ``{press: ..., press_kwargs: {...}}`` mapping). ``presses`` holds a list of them (ComposedPress).
PRESS_PARAMS = ("press", "base_press", "prefilling_press", "decoding_press", "prompt_press")
PRESS_LIST_PARAMS = ("presses",)

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_IMPORT_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class PressInfo:
    """One registry entry.

    `target` is ``"package.module:Class"`` or the class itself. `knob` is the dotted attribute that
    receives ``1 − kv_retained`` after construction (``None``: the press has no such setting).
    """

    name: str
    target: Any
    knob: str | None = "compression_ratio"


# name -> (kvpress class name, retention knob). Names are the kvpress module names without
# "_press", i.e. snake_case of the class name without "Press" as kvpress spells its files.
_KVPRESS: dict[str, tuple[str, str | None]] = {
    # Scorer presses: compression_ratio field, base ScorerPress top-k compress().
    "snapkv": ("SnapKVPress", "compression_ratio"),
    "streaming_llm": ("StreamingLLMPress", "compression_ratio"),
    "knorm": ("KnormPress", "compression_ratio"),
    "tova": ("TOVAPress", "compression_ratio"),
    "observed_attention": ("ObservedAttentionPress", "compression_ratio"),
    "random": ("RandomPress", "compression_ratio"),
    "expected_attention": ("ExpectedAttentionPress", "compression_ratio"),
    "expected_attention_stats": ("ExpectedAttentionStatsPress", "compression_ratio"),
    "keydiff": ("KeyDiffPress", "compression_ratio"),
    "lagkv": ("LagKVPress", "compression_ratio"),
    "qfilter": ("QFilterPress", "compression_ratio"),
    "cur": ("CURPress", "compression_ratio"),
    "leverage": ("LeverageScorePress", "compression_ratio"),
    "compactor": ("CompactorPress", "compression_ratio"),
    "non_causal_attention": ("NonCausalAttnPress", "compression_ratio"),
    "kvzap": ("KVzapPress", "compression_ratio"),
    "cap": ("CapPress", "compression_ratio"),
    "pyramidkv": ("PyramidKVPress", "compression_ratio"),
    # Other presses with a compression_ratio field.
    "finch": ("FinchPress", "compression_ratio"),
    "kvzip": ("KVzipPress", "compression_ratio"),
    "fastkvzip": ("FastKVzipPress", "compression_ratio"),
    "kvgrad": ("KVgradPress", "compression_ratio"),
    "restorekv": ("RestoreKVPress", "compression_ratio"),
    "kvcompose": ("KVComposePress", "compression_ratio"),
    "lukv": ("LUKVPress", "compression_ratio"),
    # Wrappers whose compression_ratio property forwards to the inner `press`.
    "adakv": ("AdaKVPress", "compression_ratio"),
    "criticalkv": ("CriticalKVPress", "compression_ratio"),
    "critical_adakv": ("CriticalAdaKVPress", "compression_ratio"),
    "chunkkv": ("ChunkKVPress", "compression_ratio"),
    "entropy_gated_chunkkv": ("EntropyGatedChunkKVPress", "compression_ratio"),
    "block": ("BlockPress", "compression_ratio"),
    "chunk": ("ChunkPress", "compression_ratio"),
    "key_rerotation": ("KeyRerotationPress", "compression_ratio"),
    "merging": ("MergingPress", "compression_ratio"),
    # Wrappers configured otherwise.
    # Decoding-time compression (certkv.engine.decoding_run runs them as kvpress's pipeline does):
    # kv_retained is the share of every token seen so far that each compression keeps; the
    # prefill-and-decoding wrapper forwards it to its decoding press, which must then be a
    # compression_ratio_decoding press (its prefilling press keeps its own compression_ratio).
    "prefill_decoding": ("PrefillDecodingPress", "decoding_press.target_compression_ratio"),
    "compression_ratio_decoding": ("CompressionRatioDecodingPress", "target_compression_ratio"),
    "decoding": ("DecodingPress", None),  # target_size in tokens, not a share
    "cam": ("CAMPress", None),  # decoding-time, target_size in tokens
    "composed": ("ComposedPress", None),  # ratio is the product of the inner presses' ratios
    "per_layer_compression": ("PerLayerCompressionPress", None),  # compression_ratios per layer
    "dms": ("DMSPress", None),  # score threshold; the ratio is an outcome
    # Not token eviction by a ratio.
    "think": ("ThinKPress", None),  # key channel pruning
    "duo_attention": ("DuoAttentionPress", None),  # head_compression_ratio
    "simlayerkv": ("SimLayerKVPress", None),  # lazy-layer threshold
}

#: kvpress exports that are not presses a contract can name (abstract bases, the pipeline).
KVPRESS_NOT_PRESSES = frozenset({"BasePress", "ScorerPress", "KVPressTextGenerationPipeline"})

#: certkv's own presses (static, like the kvpress table: naming them imports nothing).
_CERTKV: dict[str, tuple[str, str | None]] = {
    "probabilistic": ("certkv.presses.probabilistic:ProbabilisticPress", "compression_ratio"),
    # The same sampling while decoding: kv_retained of every token seen, sampled again every
    # compression_interval forwards (certkv.engine.decoding_run runs it as the decoding presses).
    "probabilistic_decoding": ("certkv.presses.probabilistic_decoding:ProbabilisticDecodingPress", "compression_ratio"),
    "deterministic_head": ("certkv.presses.deterministic_head:DeterministicHeadPress", "compression_ratio"),
    "value_diff": ("certkv.presses.value_diff:ValueDiffPress", "compression_ratio"),
    # Response-aware: they choose after the prefill, from the response's queries (certkv's engine only).
    "deferkv": ("certkv.presses.deferkv:DeferKVPress", "compression_ratio"),
    "lorekv": ("certkv.presses.lorekv:LOREKVPress", "compression_ratio"),
    "behavior_preserving": ("certkv.presses.behavior_preserving:BehaviorPreservingPress", "compression_ratio"),
}

#: Press targets whose candidates record a survey-variance certificate (``certificate_max``), so
#: a contract's ``gate.certificate`` bounds apply to them (docs/design.md, "Gate signals").
_CERTIFICATE_TARGETS = frozenset({
    "certkv.presses.probabilistic:ProbabilisticPress",
    "certkv.presses.probabilistic_decoding:ProbabilisticDecodingPress",
})

#: The contract's model name that means certkv's embedded model (certkv.model.loading.EMBEDDED,
#: spelled out here so validation imports no torch).
EMBEDDED_MODEL = "embedded"
#: Both embedded models' names (certkv.model.loading.EMBEDDED and EMBEDDED_RECITE): no trained
#: scorer weights exist for either.
EMBEDDED_MODELS = frozenset({EMBEDDED_MODEL, "embedded-recite"})

#: kvpress presses that score with weights trained for particular base models, fetched from the
#: Hugging Face hub by the model's name when the press first runs (kvpress class -> why). No such
#: weights exist for the embedded model, nor under a GGUF-converted model's name (certkv's named
#: models), so a contract on either that names one is refused; for any other model kvpress looks
#: them up by its name at calibration time.
_TRAINED_PER_MODEL: dict[str, str] = {
    "KVzapPress": (
        "kvzap scores with a small model trained per base model (nvidia/KVzap-mlp-<model> or "
        "nvidia/KVzap-linear-<model>, downloaded from the Hugging Face hub)"
    ),
    "FastKVzipPress": (
        "fastkvzip scores with gates trained per base model (<model>/q<groups>_dim16_sink16.pt in "
        "Jang-Hyun/Fast-KVzip, downloaded from the Hugging Face hub)"
    ),
    "RestoreKVPress": (
        "restorekv encodes restore tokens with embeddings and a LoRA adapter trained per base model "
        "(higokri/RestoreKV-<model>, downloaded from the Hugging Face hub; published for "
        "Llama-3.1-8B-Instruct and Qwen3-8B)"
    ),
}

#: kvpress presses that keep a different number of entries in each layer (kvpress class -> why).
#: transformers builds one attention mask for every layer from layer 0's cache length, so a call over
#: such a cache fails with sdpa and eager attention, kvpress's own pipeline included. sdpa needs no
#: mask for a single token: under the query-aware protocol (one prompt token fed, then one token a
#: step) the press runs, unless a candidate needs eager attention. Nested in a wrapper, only the
#: press's scores are used, so nothing is refused there.
_PER_LAYER_BUDGETS: dict[str, str] = {
    "PyramidKVPress": (
        "pyramidkv keeps a different number of entries in each layer, and transformers builds one "
        "attention mask for all layers from layer 0's cache length"
    ),
}

#: kvpress presses that score from the attention weights, so certkv loads the model with eager
#: attention for the whole contract (certkv.engine.engine.needs_attention_weights).
_NEEDS_EAGER = frozenset({"ObservedAttentionPress"})

#: kvpress wrappers whose ``press`` must be a score-based press (kvpress asserts a ScorerPress).
_WRAPS_SCORER = frozenset({
    "AdaKVPress", "CriticalKVPress", "CriticalAdaKVPress", "ChunkKVPress", "EntropyGatedChunkKVPress",
    "BlockPress", "ChunkPress", "KeyRerotationPress", "PerLayerCompressionPress", "DMSPress",
})

#: Every press a contract may name: the two static tables, registered at import (:func:`register_press`).
_REGISTRY: dict[str, PressInfo] = {}


def register_press(name: str, target: Any, *, knob: str | None = "compression_ratio", replace: bool = False) -> None:
    """Register a press under `name`; `target` is ``"package.module:Class"`` or a class.

    certkv's own presses register the same way as kvpress's, so contracts name them alike. Passing
    an import path keeps registration free of imports. Re-registering a name needs `replace=True`
    so a typo cannot silently shadow a kvpress press.
    """
    if not _NAME_RE.match(name):
        raise CertkvError(f"press name {name!r} must be lower snake_case (letters, digits, underscores)")
    if isinstance(target, str) and not _IMPORT_PATH_RE.match(target):
        raise CertkvError(f"press target {target!r} must be an import path like package.module:Class")
    if name in _REGISTRY and not replace:
        raise CertkvError(f"press {name!r} is already registered; pass replace=True to override it")
    _REGISTRY[name] = PressInfo(name, target, knob)


for _name, (_cls, _knob) in _KVPRESS.items():
    register_press(_name, f"kvpress:{_cls}", knob=_knob)
for _name, (_target, _knob) in _CERTKV.items():
    register_press(_name, _target, knob=_knob)


def known_presses() -> list[str]:
    """Every registered press name, sorted."""
    return sorted(_REGISTRY)


def is_import_path(spec: str) -> bool:
    """Whether `spec` looks like ``package.module:Class``."""
    return bool(_IMPORT_PATH_RE.match(spec))


def is_known_press(spec: str) -> bool:
    """Whether `spec` is a registry name or an import path; imports nothing."""
    return spec in _REGISTRY or is_import_path(spec)


def press_info(spec: str) -> PressInfo:
    """The registry entry of `spec`; an import path gets the default knob ``compression_ratio``."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if is_import_path(spec):
        return PressInfo(spec, spec, "compression_ratio")
    raise CertkvError(unknown_press_message(spec))


def produces_certificates(name: str) -> bool:
    """Whether a press records the survey-variance certificate the gate's ``certificate`` bounds
    apply to: certkv's ``probabilistic`` and ``probabilistic_decoding`` presses (by name or by
    import path). Imports nothing."""
    info = _REGISTRY.get(name)
    target = info.target if info is not None else name
    return isinstance(target, str) and target in _CERTIFICATE_TARGETS


def _kvpress_class(spec: str) -> str | None:
    """The kvpress class `spec` names (a registry name or a kvpress import path), or None."""
    info = _REGISTRY.get(spec)
    target = info.target if info is not None else spec
    if isinstance(target, type):
        module, cls = target.__module__, target.__name__
    elif isinstance(target, str) and is_import_path(target):
        module, _, cls = target.partition(":")
    else:
        return None
    return cls if module == "kvpress" or module.startswith("kvpress.") else None


#: kvpress presses that compress while the answer is decoded (certkv.engine.decoding_run runs them).
_DECODING_TIME = frozenset({"DecodingPress", "CompressionRatioDecodingPress", "PrefillDecodingPress"})
#: certkv's presses that do (the same runner).
_CERTKV_DECODING_TIME = frozenset({"certkv.presses.probabilistic_decoding:ProbabilisticDecodingPress"})
#: certkv presses that decode from a cache of their own making, which a KV format cannot store: the
#: probabilistic ones (their Hájek attention reads their sample's weights) and the response-aware ones
#: (they choose after the prefill, over the full cache the engine holds).
_OWN_CACHE = {
    "certkv.presses.probabilistic:ProbabilisticPress": "decodes its sample under its own Hájek attention",
    "certkv.presses.probabilistic_decoding:ProbabilisticDecodingPress": "decodes its sample under its own Hájek attention",
    "certkv.presses.deferkv:DeferKVPress": "chooses its entries after the prefill, over the full cache",
    "certkv.presses.lorekv:LOREKVPress": "chooses its entries after the prefill, over the full cache",
    "certkv.presses.behavior_preserving:BehaviorPreservingPress": "chooses its entries after the prefill, over the full cache",
}


def format_refusal(spec: str) -> str | None:
    """Why the press `spec` cannot keep its entries in a KV format (None: it can)."""
    target = press_info(spec).target if is_known_press(spec) else spec
    return _OWN_CACHE.get(target) if isinstance(target, str) else None


def compresses_while_decoding(spec: str) -> bool:
    """Whether a press compresses the cache while decoding (kvpress's decoding presses and their
    prefill-and-decoding wrapper, certkv's ``probabilistic_decoding``), so that its cost is a
    generation's, not a prefill's. Imports nothing."""
    info = _REGISTRY.get(spec)
    target = info.target if info is not None else spec
    return _kvpress_class(spec) in _DECODING_TIME or (isinstance(target, str) and target in _CERTKV_DECODING_TIME)


def needs_eager_attention(spec: str) -> bool:
    """Whether a press makes certkv load the model with eager attention (it scores from the
    attention weights: kvpress's ObservedAttention). Imports nothing."""
    return _kvpress_class(spec) in _NEEDS_EAGER


#: certkv presses whose settings read the question's positions, which the query-aware protocol
#: moves into the prefill: (setting, why), refused above 1 under that protocol.
_QUESTION_WINDOWS = {
    "certkv.presses.behavior_preserving:BehaviorPreservingPress": (
        "window",
        "it averages the next-token distributions of the question's last positions fed over the full "
        "cache, and the query-aware protocol prefills all of the question but its last token",
    ),
}


def refusal_reason(
    spec: str,
    *,
    model: str = EMBEDDED_MODEL,
    query_aware: bool = False,
    eager: bool = False,
    nested: bool = False,
    press_kwargs: Mapping[str, Any] | None = None,
) -> str | None:
    """Why press `spec` cannot run for a contract, as one line naming the press, or None.

    `model` is the contract's model, `query_aware` its protocol, `eager` whether one of its
    candidates makes certkv load the model with eager attention (:func:`needs_eager_attention`),
    `nested` whether `spec` is a wrapper's inner press, `press_kwargs` its settings. Imports
    nothing: contract validation calls it for every policy press and every nested one.
    """
    info = _REGISTRY.get(spec)
    target = info.target if info is not None else spec
    if query_aware and isinstance(target, str) and target in _QUESTION_WINDOWS:
        setting, why = _QUESTION_WINDOWS[target]
        value = (press_kwargs or {}).get(setting, 1)
        if isinstance(value, int) and value > 1:
            return (
                f"press {spec!r} cannot use {setting} {value} under the query-aware protocol: {why}; use "
                f"{setting}: 1 or protocol query_aware: false"
            )
    cls = _kvpress_class(spec)
    if cls is None:
        return None
    if cls in _TRAINED_PER_MODEL and model in EMBEDDED_MODELS:
        return (
            f"press {spec!r} cannot run on the embedded model: {_TRAINED_PER_MODEL[cls]}; none exist for "
            "the embedded model, so name it only with a model they were trained for"
        )
    if cls in _TRAINED_PER_MODEL and is_gguf_source(model):  # loaded from certkv's cache: no hub name to look up
        return (
            f"press {spec!r} cannot run on model {model!r}, converted from a GGUF file: {_TRAINED_PER_MODEL[cls]}; "
            "kvpress looks them up by the model's hub name, which a converted GGUF does not have"
        )
    if cls in _PER_LAYER_BUDGETS and not nested:
        why = _PER_LAYER_BUDGETS[cls]
        if not query_aware:
            return (
                f"press {spec!r} cannot run under the question-agnostic protocol: {why}, so feeding the "
                "question over its cache fails wherever the budgets differ (kvpress's own pipeline too); "
                "use protocol query_aware: true, which feeds one token at a time"
            )
        if eager:
            return (
                f"press {spec!r} cannot run beside a press that needs eager attention (observed_attention): "
                f"{why}, and eager attention applies that mask even to one token; calibrate them in "
                "separate contracts"
            )
    return None


def _kwargs_hint(cls: type) -> str:
    """What a kvpress wrapper needs in press_kwargs, appended to a failed build's error."""
    if cls.__name__ in _WRAPS_SCORER and cls.__module__.startswith("kvpress"):
        return (
            "; it wraps a score-based press: set press_kwargs: {press: snapkv} (or another score-based "
            "press such as knorm, tova, expected_attention)"
        )
    return ""


def unknown_press_message(spec: str) -> str:
    """One line naming close matches, so a typo is fixed without reading the docs."""
    close = difflib.get_close_matches(str(spec), known_presses(), n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}?" if close else f"known presses: {', '.join(known_presses())}."
    return f"unknown press {spec!r}; {hint} An import path like package.module:Class is accepted too"


def compression_ratio_for(kv_retained: float) -> float:
    """kvpress's ``compression_ratio`` for a retention, rounded so ``1 − 0.7`` is the literal 0.3.

    Rounding gives the double a kvpress user writing the ratio by hand would pass, so kvpress's own
    ``int(n * (1 − ratio))`` budget and certkv's fast path agree.
    """
    return round(1.0 - float(kv_retained), 12)


def resolve_press_class(spec: str | type) -> type:
    """Import and return the class of a registry name or ``package.module:Class``."""
    if isinstance(spec, type):
        return spec
    target = press_info(spec).target
    if isinstance(target, type):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CertkvError(f"press {spec!r}: cannot import module {module_name!r} ({exc})") from None
    try:
        cls = getattr(module, attr)
    except AttributeError:
        raise CertkvError(f"press {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(cls, type):
        raise CertkvError(f"press {spec!r}: {target} is not a class")
    return cls


def nested_press_specs(press_kwargs: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """The inner presses of `press_kwargs` as ``(key path, spec, kwargs)``, outermost first.

    Used by contract validation to check inner press names without importing anything.
    """
    out: list[tuple[str, str, Mapping[str, Any]]] = []
    for key, value in press_kwargs.items():
        if key in PRESS_PARAMS and value is not None:
            items = [(key, value)]
        elif key in PRESS_LIST_PARAMS and isinstance(value, list):
            items = [(f"{key}.{i}", v) for i, v in enumerate(value)]
        else:
            continue
        for path, item in items:
            spec, kwargs = _split_nested(path, item)
            out.append((path, spec, kwargs))
            out.extend((f"{path}.{p}", s, k) for p, s, k in nested_press_specs(kwargs))
    return out


def press_tree(press: object) -> Iterator[object]:
    """`press` and every press built inside it (the attributes named in :data:`PRESS_PARAMS` and
    :data:`PRESS_LIST_PARAMS`), outermost first, depth first: the one walk over a constructed press
    that the engine's checks share (a wrapper's ``press``, DeferKV's ``prompt_press``,
    ComposedPress's ``presses``). Imports nothing."""
    if press is None:
        return
    yield press
    for name in PRESS_PARAMS:
        yield from press_tree(getattr(press, name, None))
    for name in PRESS_LIST_PARAMS:
        for inner in getattr(press, name, None) or ():
            yield from press_tree(inner)


def _split_nested(path: str, item: Any) -> tuple[str, Mapping[str, Any]]:
    """Read a nested press: ``"snapkv"`` or ``{press: snapkv, press_kwargs: {...}}``."""
    if isinstance(item, str):
        return item, {}
    if isinstance(item, Mapping):
        extra = set(item) - {"press", "press_kwargs"}
        if "press" not in item or extra:
            raise CertkvError(
                f"press_kwargs.{path}: a nested press is a name or a mapping with keys press and "
                f"press_kwargs, got keys {sorted(item)}"
            )
        kwargs = item.get("press_kwargs") or {}
        if not isinstance(item["press"], str) or not isinstance(kwargs, Mapping):
            raise CertkvError(f"press_kwargs.{path}: press must be a name and press_kwargs a mapping")
        return item["press"], kwargs
    raise CertkvError(f"press_kwargs.{path}: expected a press name or mapping, got {type(item).__name__}")


def instantiate(spec: str | type, press_kwargs: Mapping[str, Any] | None = None) -> Any:
    """Construct a press with `press_kwargs`, building nested presses first; sets no retention."""
    cls = resolve_press_class(spec)
    kwargs = dict(press_kwargs or {})
    for key, value in list(kwargs.items()):
        if key in PRESS_PARAMS and value is not None:
            inner_spec, inner_kwargs = _split_nested(key, value)
            kwargs[key] = instantiate(inner_spec, inner_kwargs)
        elif key in PRESS_LIST_PARAMS and isinstance(value, list):
            kwargs[key] = [instantiate(*_split_nested(f"{key}.{i}", v)) for i, v in enumerate(value)]
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        name = spec if isinstance(spec, str) else cls.__name__
        why = str(exc) or type(exc).__name__
        raise CertkvError(
            f"press {name!r} rejected press_kwargs {dict(press_kwargs or {})}: {why}{_kwargs_hint(cls)}"
        ) from None


def build_press(spec: str | type, kv_retained: float, press_kwargs: Mapping[str, Any] | None = None) -> Any:
    """Build a ready press keeping `kv_retained` of the context's KV entries.

    Sets the press's retention knob to ``1 − kv_retained`` (for wrappers the knob forwards to the
    inner press). A press without a knob is an error unless it is a class passed directly.
    """
    if not 0.0 < float(kv_retained) <= 1.0:
        raise CertkvError(f"kv_retained must lie in (0, 1], got {kv_retained}")
    knob = press_info(spec).knob if isinstance(spec, str) else "compression_ratio"
    name = spec if isinstance(spec, str) else spec.__name__
    if knob is None:
        raise CertkvError(f"press {name!r} has no setting that kv_retained maps to, so it cannot be certified by kv_retained")
    press = instantiate(spec, press_kwargs)
    *owners, attr = knob.split(".")
    target = press
    for owner in owners:
        target = getattr(target, owner, None)
        if target is None:
            raise CertkvError(f"press {name!r} needs {owner} in press_kwargs to set kv_retained")
    if not hasattr(target, attr):
        raise CertkvError(f"press {name!r} has no {knob} attribute, so kv_retained cannot be applied")
    try:
        setattr(target, attr, compression_ratio_for(kv_retained))
    except (AttributeError, ValueError, AssertionError) as exc:
        raise CertkvError(f"press {name!r}: cannot set {knob}: {exc}") from None
    return press
