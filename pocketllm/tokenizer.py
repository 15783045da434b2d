"""Text <-> token ids: load a model directory's tokenizer.json, or build a byte-level one.

Token ids are the engine's interface; text is a layer on top of them that needs the optional
`tokenizers` package (pip install "pocketllm[text]"), imported only when a tokenizer is loaded.

Random-weight checkpoints carry a byte-level tokenizer without merges, so any UTF-8 text
round-trips and ids 0..255 are the bytes themselves: "é" encodes to [195, 169]. The EOS id
becomes the special token "<|endoftext|>" when it is 256 or more, or a byte that never occurs
in UTF-8 (0xC0, 0xC1, 0xF5..0xFF: the tiny presets' EOS 255); decoding with
skip_special_tokens=True, as `LLM.generate` does, turns it into "". An EOS that is a byte UTF-8
can contain stays that byte, since text needs it. Ids from 256 up to the vocabulary size are
the special tokens "<|extra_N|>" (N = the id), which decode to "" as well. As in any Hugging Face
tokenizer, those special tokens' literal text in a prompt encodes to their ids.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

from .config import CheckpointError, read_json_object

if TYPE_CHECKING:
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
EOS_TOKEN = "<|endoftext|>"
NUM_BYTES = 256
# Bytes no UTF-8 text contains: an EOS id among them can be a special token without taking a byte from text.
NON_UTF8_BYTES = frozenset([0xC0, 0xC1, *range(0xF5, NUM_BYTES)])
# Qwen's ChatML turns, so the presets' checkpoints can be chatted with (`LLM.chat`, the server).
CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                   "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                   "{% endif %}")


@overload
def load_tokenizer(model_dir: str | Path, required: Literal[True]) -> Tokenizer: ...
@overload
def load_tokenizer(model_dir: str | Path, required: bool = False) -> Tokenizer | None: ...
def load_tokenizer(model_dir: str | Path, required: bool = False) -> Tokenizer | None:
    """The directory's tokenizer.json as a `tokenizers.Tokenizer`.

    Token ids need neither the file nor the package, so without one of them this returns None;
    with `required` (a text prompt) it raises instead: ValueError naming the directory when the
    file is missing, ImportError naming the extra to install when the package is. A file that does
    not load is a CheckpointError naming it.
    """
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        if required:
            raise ValueError(f"text prompts need a {TOKENIZER_FILE} in the model directory {model_dir}, "
                             f"which has none; pass prompt_tokens (token ids) instead")
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        if required:
            raise ImportError(f"text prompts need the tokenizers package to read {path}: "
                              f"pip install 'pocketllm[text]'") from exc
        return None
    try:
        return Tokenizer.from_file(str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # the tokenizers package's own error (a Rust panic included): which file, why
        read_json_object(path)  # not JSON, or not an object: the precise reason
        raise CheckpointError(f"{path}: not a tokenizer the tokenizers package can load ({exc})") from None


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet, indexed by byte: the printable character the ByteLevel
    pre-tokenizer emits for each byte (printable Latin-1 bytes stand for themselves, the other
    68 bytes map to U+0100 onwards, in byte order)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(NUM_BYTES, 2 * NUM_BYTES))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(NUM_BYTES)]


@functools.cache
def _byte_values() -> dict[str, int]:
    """The byte each symbol of GPT-2's byte-level alphabet stands for."""
    return {c: b for b, c in enumerate(_byte_symbols())}


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for. A byte-level BPE token's symbols map back to their bytes, so a
    token inside a multibyte character gives its own bytes (its decoded text alone would be U+FFFD);
    a token of another vocabulary gives its decoded text as UTF-8."""
    symbol = tokenizer.id_to_token(token_id) or ""
    values = _byte_values()
    if symbol and all(c in values for c in symbol):
        return bytes(values[c] for c in symbol)
    return str(tokenizer.decode([token_id], skip_special_tokens=False)).encode("utf-8")



def vocab_bytes(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes in text (`token_bytes`, the byte table built once), for ids 0..vocab_size-1
    (the model's vocabulary, which may be wider than the tokenizer's): b"" for a special token and
    for an id the tokenizer lacks, which no text contains (what xgrammar takes as special)."""
    values = {c: b for b, c in enumerate(_byte_symbols())}
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    vocab = [b""] * vocab_size
    for symbol, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i >= vocab_size or i in special:
            continue
        vocab[i] = bytes(values[c] for c in symbol) if symbol and all(c in values for c in symbol) else \
            str(tokenizer.decode([i], skip_special_tokens=False)).encode("utf-8")
    return vocab

def byte_level_tokenizer_files(vocab_size: int, eos_token_ids: Sequence[int],
                               model_max_length: int) -> dict[str, dict[str, Any]] | None:
    """tokenizer.json and tokenizer_config.json contents (file name -> JSON) of the byte-level
    tokenizer described in the module docstring, for `tokenizers` and `transformers.AutoTokenizer`;
    None when vocab_size < 256, which cannot hold every byte."""
    if vocab_size < NUM_BYTES:
        return None
    symbols = _byte_symbols()
    first_eos = eos_token_ids[0] if eos_token_ids else None
    vocab: dict[str, int] = {}
    added_tokens = []
    for i in range(vocab_size):
        if i < NUM_BYTES and not (i in eos_token_ids and i in NON_UTF8_BYTES):
            vocab[symbols[i]] = i
            continue
        content = EOS_TOKEN if i == first_eos else f"<|extra_{i}|>"
        vocab[content] = i
        added_tokens.append({"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer: dict[str, Any] = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens, "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "model_max_length": model_max_length, "chat_template": CHATML_TEMPLATE}
    if EOS_TOKEN in vocab:
        config["eos_token"] = EOS_TOKEN
    return {TOKENIZER_FILE: tokenizer, TOKENIZER_CONFIG_FILE: config}
