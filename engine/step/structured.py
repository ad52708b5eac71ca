"""Structured output: JSON schemas, JSON objects, regexes and Lark grammars as per-token masks
(llguidance), per row and per verify position.

A request's `SamplingParams.structured` names the constraint; `GrammarCompiler` (one per
engine, built on the target's tokenizer) checks it at admission (a bad schema is a 400 naming
the field) and gives each row a `RowGrammar`, a matcher that only ever holds the row's
committed tokens. Under speculation (vLLM's scheme, PR #14702):

- a row's drafts are cut at the first token the grammar rejects (`RowGrammar.cut`, which does
  not advance the matcher), so a verify never spends positions on impossible tokens;
- every verify position gets its mask, the bonus position included (`RowGrammar.masks`: the
  matcher walks the drafts and is rolled back to the committed tokens before it returns);
- the committed tokens (accepted drafts and the bonus, all sampled under their masks) advance
  it (`RowGrammar.commit`). A grammar that reaches its end allows only EOS, so the request
  finishes with `stop` at the next token.

Sampling a masked position is sampling the constrained distribution (the target's, renormalised
over the allowed tokens), so speculation stays lossless for it exactly as for plain sampling.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import mlx.core as mx
import msgspec
import numpy as np

from engine.errors import InvalidRequest

KINDS = ("json_schema", "json_object", "regex", "grammar")


class StructuredOutput(msgspec.Struct, kw_only=True, frozen=True):
    """What the output must match: `kind` one of KINDS; `spec` the JSON schema (as JSON
    text), the regex or the Lark grammar (unused for json_object)."""

    kind: str
    spec: str = ""
    # json_schema: refuse schema keywords llguidance does not implement (False: ignore them)
    strict: bool = False
    param: str = "structured_outputs"  # the request field a compile error names


# JSON as `json.dumps` writes it: no free whitespace (a model may otherwise wander in it for
# its whole budget; what a schema allows is unchanged).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar for a constraint (raises InvalidRequest naming its field)."""
    try:
        if structured.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS
            )
        if structured.kind == "json_schema":
            schema = json.loads(structured.spec)
            if not isinstance(schema, dict):
                raise InvalidRequest("a JSON schema must be an object", param=structured.param)
            options = {**JSON_OPTIONS, "lenient": not structured.strict}
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if structured.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(structured.spec)
        if structured.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(structured.spec)
    except InvalidRequest:
        raise
    except Exception as exc:  # llguidance raises ValueError and others on bad input
        raise InvalidRequest(f"invalid {structured.kind}: {exc}", param=structured.param) from None
    raise InvalidRequest(f"unknown structured output kind {structured.kind!r}",
                         param=structured.param)  # fmt: skip


def _hf_tokenizer(tokenizer: Any) -> Any:
    """The Hugging Face fast tokenizer (inside mlx-lm's TokenizerWrapper, or given)."""
    import transformers

    if isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
        return tokenizer
    return getattr(tokenizer, "_tokenizer", tokenizer)


class GrammarCompiler:
    """The engine's llguidance tokenizer (built once: about a second on a 49k vocabulary) and
    the per-request compile step."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        import llguidance.hf

        eos = sorted(eos_token_ids)
        self.eos = frozenset(eos)
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(
            _hf_tokenizer(tokenizer), n_vocab=vocab_size, eos_token=eos[0] if eos else None
        )

    def check(self, structured: StructuredOutput) -> str:
        """Compile now (at admission: errors are the request's 400); return the grammar."""
        grammar = grammar_text(structured)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            raise InvalidRequest(f"invalid {structured.kind}: {messages[0]}",
                                 param=structured.param)  # fmt: skip
        return grammar

    def matcher(self, structured: StructuredOutput) -> RowGrammar:
        matcher = llguidance.LLMatcher(self.tokenizer, self.check(structured), log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"invalid {structured.kind}: {matcher.get_error()}",
                                 param=structured.param)  # fmt: skip
        return RowGrammar(matcher, self.vocab_size, self.eos)


class RowGrammar:
    """One row's matcher, holding exactly the row's committed tokens between steps."""

    __slots__ = ("eos", "matcher", "vocab", "words")

    def __init__(self, matcher: Any, vocab_size: int, eos: frozenset[int] = frozenset()) -> None:
        self.matcher = matcher
        self.eos = eos
        self.vocab = vocab_size
        self.words = (vocab_size + 31) // 32

    def cut(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the grammar rejects (the matcher does not move),
        and before any EOS: a draft EOS would stop the matcher, which cannot be rolled back
        from there (and the request ends at it anyway; the verify may still sample it)."""
        if not drafts:
            return drafts
        drafts = drafts[: self.matcher.validate_tokens(drafts)]
        for i, token in enumerate(drafts):
            if token in self.eos:
                return drafts[:i]
        return drafts

    def masks(self, drafts: Sequence[int], width: int | None = None) -> np.ndarray:
        """Bitmasks [width, words] (int32, llguidance's layout): position j's allowed tokens
        after the committed ones and drafts[:j], for j in 0..len(drafts) (the last is the
        bonus position); rows past that repeat it (padding, never committed). `drafts` must
        have passed `cut`."""
        n = len(drafts) + 1
        width = n if width is None else width
        out = np.empty((width, self.words), dtype=np.int32)
        matcher = self.matcher
        for j in range(n):
            row = out[j]
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if j < n - 1 and not matcher.consume_token(drafts[j]):
                raise RuntimeError(f"a cut draft was rejected: {matcher.get_error()}")
        if n > 1 and not matcher.rollback(n - 1):
            raise RuntimeError("grammar rollback failed")
        out[n:] = out[n - 1]
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance over committed tokens (each sampled under its mask)."""
        if self.matcher.is_stopped():
            return  # the EOS that ended the grammar is in; the request stops with it
        for token in tokens:
            if not self.matcher.consume_token(token):
                error = self.matcher.get_error()
                raise RuntimeError(f"a committed token broke the grammar: {error}")
            if self.matcher.is_stopped():
                return

    @property
    def finished(self) -> bool:
        return self.matcher.is_stopped()


def _rows(mask: np.ndarray, width: int) -> np.ndarray:
    """`width` rows of a row's bitmasks: cut, or padded with its last (a padded verify's
    positions past the row's depth are never committed)."""
    if len(mask) >= width:
        return mask[:width]
    return np.concatenate([mask, np.repeat(mask[-1:], width - len(mask), axis=0)])


def allowed(masks: Sequence[np.ndarray | None], widths: Sequence[int],
            vocab: int) -> mx.array | None:  # fmt: skip
    """[N, vocab] bool: the tokens each position may take (request b owns the next
    `widths[b]` positions; `masks[b]` its bitmasks, at least that many rows, or None: all).
    None when no request is constrained."""
    rows = [None if m is None else _rows(m, w) for m, w in zip(masks, widths)]
    if all(m is None for m in rows):
        return None
    full = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    stacked = np.concatenate(
        [m if m is not None else np.repeat(full, w, axis=0) for m, w in zip(rows, widths)]
    )
    # unpacked on the host (numpy's unpackbits: a few us a row); MLX's CPU shifts cost ~80 us
    keep = np.unpackbits(stacked.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    return mx.array(keep.view(np.bool_))
