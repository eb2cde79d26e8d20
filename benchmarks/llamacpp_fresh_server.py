"""llama-cpp-python's OpenAI server (``python -m llama_cpp.server``) answering every request from an empty KV cache.

llama-cpp-python keeps the previous request's KV cache and evaluates only what follows the longest
prefix a new prompt shares with it (every chat prompt shares the template's system turn; a repeated
prompt shares all but its last token). The kept part was computed in other batches, and its
kernels' sums depend on the batch, so the same request can be answered differently after a
different request: measured on SmolLM2-135M (f16 cache), the same prompt asked twice in a row
gave two answers. certkv's probe catches it ("the reference moved") and stops the calibration, as
it should: a reference whose answer depends on its traffic is not one reference. llama.cpp's own
``llama-server`` turns the reuse off per request (``"cache_prompt": false``); this server has no
such setting, so this launcher empties the cache before each completion, and each answer depends
on its request alone. Run it as ``python -m benchmarks.llamacpp_fresh_server ARGS`` with the
arguments of ``llama_cpp.server``.
"""

from __future__ import annotations


def main() -> None:
    import llama_cpp
    from llama_cpp.server.__main__ import main as serve

    create = llama_cpp.Llama.create_completion

    def create_from_empty_cache(self, *args, **kwargs):
        self.reset()  # n_tokens = 0: generate() finds no prefix to reuse and evaluates the whole prompt
        return create(self, *args, **kwargs)

    llama_cpp.Llama.create_completion = create_from_empty_cache
    serve()


if __name__ == "__main__":
    main()
