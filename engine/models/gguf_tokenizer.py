"""Rebuild a Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) from GGUF metadata.

llama.cpp stores a byte-level BPE tokenizer as its vocabulary (`tokenizer.ggml.tokens`, by id),
its merges, per-token types (3 = control, i.e. special) and a *name* for the pre-tokenizer
(`tokenizer.ggml.pre`) rather than the pre-tokenizer itself. Each supported name maps to the
pre-tokenizer of the Hugging Face tokenizer that llama.cpp's converter recognised by that name;
an unknown name is refused, since a guessed split would tokenize differently from the model's
training without any visible error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

from engine.models.gguf_header import GGUFError
from engine.models.gguf_spm import spm_tokenizer_json

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED, UNKNOWN = 3, 4, 2  # llama.cpp token types

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen 3.5: Qwen 2's, with combining marks (\p{M}) kept inside words
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's default BPE split (GGUFs whose converter named no known pre-tokenizer)
_DEFAULT_SPLITS = [
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
]
# DeepSeek LLM (7B/67B): newlines, Latin/Greek/Cyrillic... letters, ASCII and full-width
# punctuation, trailing spaces, CJK runs, digit runs, each split out in turn (the code points
# that Unicode normalization would fold, e.g. U+1F7D, U+2126, U+212A, are written as escapes)
_DEEPSEEK_LLM_SPLITS = [
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ\U00010400-\U0001044f𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
]
# DeepSeek V3 / R1: digits in threes, CJK runs, then a Llama 3-like split
_DEEPSEEK_V3_SPLITS = [
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
]
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
            "use_regex": use_regex}  # fmt: skip


def _split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
            "invert": False}  # fmt: skip


def _splits(patterns: list[str]) -> dict:
    """Each regex splits the pieces the previous one left (llama.cpp's `regex_exprs`), then
    GPT-2's byte mapping."""
    steps = [_split(p) for p in patterns]
    return {"type": "Sequence", "pretokenizers": [*steps, _byte_level(False)]}


# tokenizer.ggml.pre -> (normalizer, pre-tokenizer, BPE ignore_merges), as in tokenizer.json.
PRE_TOKENIZERS: dict[str, tuple[dict | None, dict, bool]] = {
    # GPT-2's byte-level regex (also what a plain `ByteLevel` pre-tokenizer does)
    "gpt-2": (None, _byte_level(True), False),
    # SmolLM / StarCoder: every digit alone, then GPT-2's regex
    "smollm": (
        None,
        {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)],
        },
        False,
    ),  # fmt: skip
    "llama-bpe": (
        None,
        {"type": "Sequence", "pretokenizers": [_split(_LLAMA3_SPLIT), _byte_level(False)]},
        True,
    ),
    "qwen2": (
        {"type": "NFC"},
        {"type": "Sequence", "pretokenizers": [_split(_QWEN2_SPLIT), _byte_level(False)]},
        False,
    ),
    "qwen35": (
        {"type": "NFC"},
        {"type": "Sequence", "pretokenizers": [_split(_QWEN35_SPLIT), _byte_level(False)]},
        False,
    ),
    "default": (None, _splits(_DEFAULT_SPLITS), False),
    "deepseek-llm": (None, _splits(_DEEPSEEK_LLM_SPLITS), False),
    "deepseek-v3": (None, _splits(_DEEPSEEK_V3_SPLITS), False),
}


def _value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    return value


def _post_processor(meta: dict[str, Any], tokens: list[str], fallback: dict | None) -> dict | None:
    """BOS / EOS added around every encoded text when the GGUF says so (add_bos/add_eos)."""
    ends = []
    for name in ("bos", "eos"):
        token_id = _value(meta, f"tokenizer.ggml.{name}_token_id")
        if _value(meta, f"tokenizer.ggml.add_{name}_token", False) and token_id is not None:
            ends.append((name, tokens[token_id], token_id))
    if not ends:
        return fallback
    bos = [{"SpecialToken": {"id": t, "type_id": 0}} for n, t, _ in ends if n == "bos"]
    eos = [{"SpecialToken": {"id": t, "type_id": 0}} for n, t, _ in ends if n == "eos"]
    return {
        "type": "TemplateProcessing",
        "single": [*bos, {"Sequence": {"id": "A", "type_id": 0}}, *eos],
        "pair": [*bos, {"Sequence": {"id": "A", "type_id": 0}}, *eos,
                 *bos, {"Sequence": {"id": "B", "type_id": 1}}, *eos],
        "special_tokens": {t: {"id": t, "ids": [i], "tokens": [t]} for _, t, i in ends},
    }  # fmt: skip


def tokenizer_json(meta: dict[str, Any]) -> dict:
    """The `tokenizers` JSON document of the GGUF's tokenizer: byte-level BPE (`gpt2`) or
    SentencePiece (`llama`, rebuilt by `engine.models.gguf_spm`)."""
    model = _value(meta, "tokenizer.ggml.model")
    tokens: list[str] = list(_value(meta, "tokenizer.ggml.tokens"))
    types: list[int] = _value(meta, "tokenizer.ggml.token_type") or [1] * len(tokens)
    unk_id = _value(meta, "tokenizer.ggml.unknown_token_id")
    if model == "llama":
        scores = _value(meta, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        # llama.cpp's default for SentencePiece vocabularies is to add the space prefix
        prefix = bool(_value(meta, "tokenizer.ggml.add_space_prefix", True))
        return spm_tokenizer_json(tokens, scores, types, prefix, unk_id,
                                  _post_processor(meta, tokens, None))  # fmt: skip
    if model != "gpt2":
        raise GGUFError(
            f"GGUF tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' and "
            "SentencePiece 'llama' are)"
        )
    pre = _value(meta, "tokenizer.ggml.pre")
    if pre is None:  # files from before llama.cpp named pre-tokenizers
        log.warning("GGUF names no pre-tokenizer (tokenizer.ggml.pre): assuming GPT-2's")
        pre = "gpt-2"
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported "
            f"(supported: {', '.join(PRE_TOKENIZERS)})"
        )
    normalizer, pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    merges = [m.split(" ", 1) for m in _value(meta, "tokenizer.ggml.merges", [])]
    added = [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": types[i] == CONTROL}
        for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)
    ]  # fmt: skip
    byte_level_post: dict = {"type": "ByteLevel", "add_prefix_space": True,
                             "trim_offsets": False, "use_regex": True}  # fmt: skip
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": _post_processor(meta, tokens, byte_level_post),
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },  # fmt: skip
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokens[unk_id]
            if unk_id is not None and types[unk_id] == UNKNOWN
            else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": ignore_merges,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": merges,
        },
    }


def tokenizer_config(meta: dict[str, Any], model_max_length: int) -> dict:
    """tokenizer_config.json: special tokens, add-BOS/EOS flags and the chat template."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_value(meta, "tokenizer.ggml.add_eos_token", False)),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        token_id = _value(meta, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{name}_token"] = tokens[token_id]
    template = _value(meta, "tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer(meta: dict[str, Any], out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json for the GGUF's tokenizer into out_dir."""
    document = tokenizer_json(meta)
    (out_dir / "tokenizer.json").write_text(json.dumps(document, ensure_ascii=False))
    config = tokenizer_config(meta, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
