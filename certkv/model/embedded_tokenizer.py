"""Builds the embedded model's tokenizer from :mod:`certkv.requests.vocabulary`.

The tokenizer is a `tokenizers` WordLevel model behind a Metaspace pre-tokenizer, so that
`transformers.AutoTokenizer` loads it from the package folder with no network. It is built once
by `python -m certkv.model.embedded_tokenizer` (the training script does it too) and shipped as data.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from certkv.requests.vocabulary import SPACE, SPECIAL_TOKENS, vocabulary

if TYPE_CHECKING:
    from tokenizers import Tokenizer

#: The embedded model's weights, config and tokenizer: package data of certkv itself.
EMBEDDED_DIR = Path(__file__).resolve().parents[1] / "embedded"


def build_tokenizer() -> Tokenizer:
    """Return a `tokenizers.Tokenizer` for the closed vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Newlines (kvpress appends one to every question) and edge whitespace carry no token.
    tok.normalizer = normalizers.Sequence(
        [normalizers.Replace("\n", " "), normalizers.Replace("\t", " "), normalizers.Strip()]
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=True),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(behavior="isolated"),
        ]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="always", split=True)
    return tok


def save_tokenizer(directory: Path = EMBEDDED_DIR) -> None:
    """Write tokenizer.json and the transformers config files into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


if __name__ == "__main__":
    save_tokenizer()
    print(f"wrote tokenizer to {EMBEDDED_DIR}")
