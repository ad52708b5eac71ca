"""SentencePiece GGUF tokenizers (`tokenizer.ggml.model = llama`): rebuilt from the pieces,
scores and types llama.cpp stores, they encode and decode exactly like the `sentencepiece`
library on a model proto built from the same pieces.

The vocabulary is a real SentencePiece BPE model trained here on local text (byte fallback,
user-defined and control pieces), in both space-prefix settings: Llama 2 / Mistral add one,
Gemma does not. The real Gemma 3 vocabulary (262,144 pieces) is checked the same way in
tests/test_gemma3.py.
"""

from __future__ import annotations

import inspect
import io
import json
import re
from pathlib import Path

import gguf_files as gf
import numpy as np
import pytest
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as pb
from tokenizers import Tokenizer

from engine.models.resolve import resolve_target

USER_DEFINED = ["<start_of_turn>", "<end_of_turn>", "\n\n", "    "]
CONTROL = ["<ctl>"]

CORPUS = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing   ",
    "whitespace    runs\t\ttabs\n\n\nnewlines \n  mixed",
    "Digits: 0 7 42 1234567890 3.14159 -12e10 0x1F",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fib(n-2)\n",
    "class A(B):\n\tpass  # comment\r\nx = {'k': [1, 2], \"s\": None}",
    "unicode: naïve café, Ελληνικά, 日本語のテキスト, math ∑∫√, ü",
    "emoji 🙂👍🏽 and a rare one 🦩 (byte fallback)",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "control mid-text<ctl>and after <ctl> done",
    "<ctl>",
    "",
    " ",
    "a  b   c    d",
    "'quotes' don't we'll I'M",
]


def train(add_dummy_prefix: bool) -> bytes:
    """A SentencePiece BPE model proto trained on this repository's own Python sources."""
    import engine.models.gguf as module

    text = inspect.getsource(inspect) + inspect.getsource(module) + inspect.getsource(json)
    lines = [line for line in text.splitlines() if line.strip()][:3000]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=out, vocab_size=700, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, user_defined_symbols=USER_DEFINED,
        control_symbols=CONTROL, add_dummy_prefix=add_dummy_prefix,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, pad_id=3, minloglevel=2,
    )  # fmt: skip
    return out.getvalue()


def gguf_tokenizer_metadata(proto: bytes, add_space_prefix: bool) -> dict:
    """`tokenizer.*` as llama.cpp's converter writes it for a SentencePiece model."""
    model = pb.ModelProto()
    model.ParseFromString(proto)
    pieces = [p.piece for p in model.pieces]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": pieces,
        "tokenizer.ggml.scores": [float(p.score) for p in model.pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in model.pieces],
        "tokenizer.ggml.bos_token_id": pieces.index("<s>"),
        "tokenizer.ggml.eos_token_id": pieces.index("</s>"),
        "tokenizer.ggml.unknown_token_id": pieces.index("<unk>"),
        "tokenizer.ggml.padding_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


def reference_processor(meta: dict) -> spm.SentencePieceProcessor:
    """The `sentencepiece` library on a model proto built from the GGUF's own pieces."""
    model = pb.ModelProto()
    for piece, score, kind in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                  meta["tokenizer.ggml.token_type"]):  # fmt: skip
        model.pieces.add(piece=piece, score=score, type=kind)
    model.trainer_spec.model_type = pb.TrainerSpec.BPE
    model.trainer_spec.byte_fallback = True
    model.trainer_spec.unk_id = meta["tokenizer.ggml.unknown_token_id"]
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = meta["tokenizer.ggml.add_space_prefix"]
    model.normalizer_spec.remove_extra_whitespaces = False
    model.normalizer_spec.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=model.SerializeToString())


def reference_encode(sp: spm.SentencePieceProcessor, text: str) -> list[int]:
    """SentencePiece never reads a control piece from text; llama.cpp and transformers do,
    and encode each run between them on its own (a space prefix each, when the model adds
    one). So: split on the control pieces, encode the runs with sentencepiece. With a space
    prefix, user-defined pieces split runs the same way (llama.cpp's behaviour, see
    engine/models/gguf_spm.py); without one, sentencepiece itself matches them."""
    prefix = sp.encode(" x")[:1] != sp.encode("x")[:1]  # the model adds a dummy prefix
    specials = CONTROL + (USER_DEFINED if prefix else [])
    ids: list[int] = []
    for part in re.split(f"({'|'.join(map(re.escape, specials))})", text):
        if part in specials:
            ids.append(sp.piece_to_id(part))
        elif part:
            ids += sp.encode(part)
    return ids


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-prefix"])
def converted(request, tmp_path_factory):
    """(reference processor, the converted model directory) for a llama GGUF whose tokenizer
    is the trained SentencePiece model."""
    prefix = request.param
    meta = gguf_tokenizer_metadata(train(prefix), prefix)
    root = tmp_path_factory.mktemp("spm")
    patch = pytest.MonkeyPatch()
    patch.setenv("FLASHBATCH_CACHE_DIR", str(root / "cache"))
    vocab = len(meta["tokenizer.ggml.tokens"])
    source = gf.build_source(root / "src", "llama", seed=3, vocab_size=vocab)
    path = gf.write_float_gguf(root / "m.gguf", gf.llama_cpp_tensors(source),
                               {**gf.model_metadata(source), **meta})  # fmt: skip
    yield reference_processor(meta), resolve_target(path), meta
    patch.undo()


def test_encodes_like_sentencepiece(converted):
    sp, directory, meta = converted
    rebuilt = Tokenizer.from_file(str(directory / "tokenizer.json"))
    byte_ids = {i for i, t in enumerate(meta["tokenizer.ggml.token_type"]) if t == 6}
    user_ids = {sp.piece_to_id(p) for p in USER_DEFINED}
    seen_bytes = seen_user = False
    for text in CORPUS:
        expected = reference_encode(sp, text)
        assert rebuilt.encode(text, add_special_tokens=False).ids == expected, repr(text)
        bos = meta["tokenizer.ggml.bos_token_id"]
        assert rebuilt.encode(text).ids == [bos, *expected]  # add_bos_token
        seen_bytes |= bool(byte_ids & set(expected))
        seen_user |= bool(user_ids & set(expected))
    assert seen_bytes and seen_user  # the corpus reaches byte fallback and user pieces


def test_decodes_like_sentencepiece(converted):
    sp, directory, _ = converted
    rebuilt = Tokenizer.from_file(str(directory / "tokenizer.json"))
    for text in CORPUS:
        ids = sp.encode(text)  # no control pieces: sentencepiece decodes those to nothing
        assert rebuilt.decode(ids, skip_special_tokens=False) == sp.decode(ids), repr(text)
    ids = reference_encode(sp, CORPUS[10])
    assert rebuilt.decode(ids, skip_special_tokens=True) == sp.decode(ids)


def test_mlx_lm_loads_the_rebuilt_tokenizer(converted):
    from mlx_lm import load

    sp, directory, meta = converted
    _, tokenizer = load(str(directory))
    text = CORPUS[5]
    expected = [meta["tokenizer.ggml.bos_token_id"], *reference_encode(sp, text)]
    assert tokenizer.encode(text) == expected
    assert tokenizer.eos_token_id == meta["tokenizer.ggml.eos_token_id"]
    assert tokenizer.bos_token == "<s>" and tokenizer.pad_token == "<pad>"
    # mlx-lm's streaming detokenizer gives back the text
    detok = tokenizer.detokenizer
    detok.reset()
    for token in sp.encode(CORPUS[7]):
        detok.add_token(token)
    detok.finalize()
    assert detok.text == sp.decode(sp.encode(CORPUS[7]))


def test_an_unknown_tokenizer_model_is_refused(tmp_path):
    from engine.models.gguf_header import GGUFError
    from engine.models.gguf_tokenizer import tokenizer_json

    with pytest.raises(GGUFError, match="tokenizer model 'bert'"):
        tokenizer_json({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    assert np  # numpy metadata arrays are accepted too
    assert Path(tmp_path).exists()
