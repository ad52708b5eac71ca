"""Stop conditions for one request: EOS / stop token ids, stop strings and max_tokens.

Speculative steps commit several tokens at once; `StopChecker.add` takes the whole run and
cuts it at the first token that ends the request, so a stop inside a block ends exactly where
plain decoding would have ended.
"""

from __future__ import annotations

from typing import Any

from engine.step.sampling import SamplingParams


def eos_ids_of(tokenizer: Any | None) -> set[int]:
    """The tokenizer's end-of-sequence token ids (none without a tokenizer): the one place
    the engine, the single-request loop and a loaded pair read them."""
    return set(getattr(tokenizer, "eos_token_ids", None) or ())


class StopChecker:
    """Tracks a request's generated tokens and text and decides when it is finished."""

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: set[int] | frozenset[int] = frozenset(),
        tokenizer: Any | None = None,
    ) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)
        self.detokenizer = tokenizer.detokenizer if tokenizer is not None else None
        if self.detokenizer is not None:
            self.detokenizer.reset()
        self.longest_stop = max((len(s) for s in params.stop), default=0)
        if params.stop and self.detokenizer is None:
            raise ValueError("stop strings need a tokenizer to detokenize the output")
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._stop_text: str | None = None  # text cut at a stop string

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        if self._stop_text is not None:
            return self._stop_text
        return self.detokenizer.text if self.detokenizer is not None else ""

    def add(self, tokens: list[int]) -> list[int]:
        """Record newly committed tokens; return those that belong to the output.

        Stops at the first token that finishes the request: a stop/EOS token (kept in the ids,
        not in the text), the token that completes a stop string, or the max_tokens-th token.
        """
        accepted: list[int] = []
        for token in tokens:
            if self.finished:
                break
            self.token_ids.append(token)
            accepted.append(token)
            if token in self.stop_ids:
                self._finish("stop")
                break
            if self.detokenizer is not None:
                self._add_text(token)
                if self.finished:
                    break
            if len(self.token_ids) >= self.params.max_tokens:
                self._finish("length")
        return accepted

    def _add_text(self, token: int) -> None:
        before = len(self.detokenizer.text)
        self.detokenizer.add_token(token)
        if not self.params.stop:
            return
        text = self.detokenizer.text
        window_start = max(0, before - self.longest_stop + 1)
        hits = [i for s in self.params.stop if (i := text.find(s, window_start)) >= 0]
        if hits:
            self._stop_text = text[: min(hits)]
            self._finish("stop")

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        if self.detokenizer is not None and self._stop_text is None:
            self.detokenizer.finalize()
