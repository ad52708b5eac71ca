"""Rebuild a SentencePiece tokenizer (`tokenizer.ggml.model = llama`) as a `tokenizers` JSON.

llama.cpp stores a SentencePiece vocabulary as its pieces, scores and types (1 normal,
2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) plus the `add_space_prefix` flag.
These models (Llama 2, Mistral 7B, Gemma 1-3) are SentencePiece *BPE*: starting from single
characters, the adjacent pair whose concatenation is the highest-scoring piece merges first.
That is a `tokenizers` BPE model whose merges are every pair of pieces that concatenate to a
piece, ranked by that piece's score (the rebuild transformers' converters do from a .model):
- user-defined pieces are atomic, matched in the raw text before anything else (SentencePiece's
  prefix matcher, llama.cpp's special-token pass): added tokens, not normalized. With a space
  prefix, the run after one gets its own prefix, as llama.cpp does (SentencePiece prefixes only
  the start of the text; Llama 2 and Mistral, the prefixed vocabularies, have no user-defined
  pieces);
- control pieces (<bos>, <eos>, <start_of_turn> in some vocabularies) are special added tokens:
  SentencePiece itself never reads them from text, but llama.cpp and transformers do (a chat
  template writes them), and then each text run between them is its own segment;
- a character outside the vocabulary becomes its UTF-8 bytes (`<0xNN>` pieces, byte fallback),
  or `<unk>` without them;
- spaces become U+2581 ("▁"), and with `add_space_prefix` each segment starts with one (as
  llama.cpp does after a special token); decoding turns them back and drops that one space.
`tests/test_gguf_spm.py` checks all of it against the `sentencepiece` library.
"""

from __future__ import annotations

from typing import Any

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def spm_merges(pieces: list[str], scores: list[float], types: list[int]) -> list[list[str]]:
    """Every (left, right) pair of mergeable pieces whose concatenation is a mergeable piece,
    best merged piece first (highest score, then lowest id), then by the pair's ids."""
    mergeable = {p: i for i, p in enumerate(pieces) if types[i] in (NORMAL, USER_DEFINED)}
    ranked = []
    for piece, merged_id in mergeable.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            left_id, right_id = mergeable.get(left), mergeable.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[merged_id], merged_id, left_id, right_id, left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def spm_tokenizer_json(
    pieces: list[str],
    scores: list[float],
    types: list[int],
    add_space_prefix: bool,
    unk_id: int | None,
    post_processor: dict | None,
) -> dict[str, Any]:
    """The `tokenizers` document of a SentencePiece BPE vocabulary (see the module doc)."""
    byte_fallback = any(t == BYTE for t in types)
    added = [
        {"id": i, "content": piece, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": types[i] == CONTROL}
        for i, piece in enumerate(pieces) if types[i] in (CONTROL, USER_DEFINED)
    ]  # fmt: skip
    replace_space = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
    normalizer: dict = (
        {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": SPACE}, replace_space]}
        if add_space_prefix
        else replace_space
    )
    decoders: list[dict] = [
        {"type": "Replace", "pattern": {"String": SPACE}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if add_space_prefix:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    if unk_id is None and UNKNOWN in types:
        unk_id = types.index(UNKNOWN)
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": None,
        "post_processor": post_processor,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": pieces[unk_id] if unk_id is not None else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": byte_fallback,
            "ignore_merges": False,
            "vocab": {piece: i for i, piece in enumerate(pieces)},
            "merges": spm_merges(pieces, scores, types),
        },
    }
