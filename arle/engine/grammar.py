"""A request's grammar, compiled into the matcher the executor's sampler follows.

The library is llguidance (Rust, no Python dependencies): a grammar is a JSON schema, a Lark
grammar or a regex; a matcher is one request's position in it. It computes each step's token
mask lazily, in tens of microseconds, with no ahead-of-time pass over the vocabulary.

NOTE (EOS): the matcher's tokenizer knows the engine's end-of-generation ids as its EOS: the mask
allows them only where the grammar accepts, so an output that ends by EOS always parses. An
output cut by max_tokens (finish_reason "length") may be incomplete, as with OpenAI.
"""

from __future__ import annotations

import threading
from typing import Any

from arle.engine.request import Grammar
from arle.errors import InvalidRequestError
from arle.model.tokenizer import Tokenizer

#: JSON as OpenAI writes it in structured outputs: no whitespace between tokens. NOTE: a model
#: free to add whitespace can loop on it forever (small and random models do); strings stay free.
_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar for `grammar` (its top-level JSON); InvalidRequestError naming the
    grammar's parameter when it cannot be built."""
    import llguidance

    try:
        if grammar.kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(
                grammar.source, defaults=_JSON_OPTIONS))  # type: ignore[arg-type]
        if grammar.kind == "json_object":
            return str(llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_OPTIONS))  # type: ignore[arg-type]
        if grammar.kind == "lark":
            return str(llguidance.LLMatcher.grammar_from_lark(str(grammar.source)))
        if grammar.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(str(grammar.source)))
    except Exception as e:  # NOTE: whatever the library raises, the grammar is the request's
        raise InvalidRequestError(f"invalid {grammar.param}: {e}", param=grammar.param) from None
    raise InvalidRequestError(f"unknown grammar kind {grammar.kind!r}", param=grammar.param)


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it (built on first use: ~0.25 s for a
    49k vocabulary), and a matcher per constrained request."""

    def __init__(self, tokenizer: Tokenizer, model_vocab_size: int = 0) -> None:
        self._tokenizer = tokenizer
        #: NOTE: the matcher's masks are as wide as the model's vocabulary, which may be padded
        #: past the tokenizer's (the executors' bitmask rows are that wide; ids past the
        #: tokenizer's are never allowed)
        self._n_vocab = max(tokenizer.vocab_size, model_vocab_size)
        self._ll: Any = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance

                tok = self._tokenizer
                # NOTE: the Rust tokenizer's own JSON, so a GGUF vocabulary works as well as a
                # tokenizer.json; every id that ends generation counts as EOS.
                self._ll = llguidance.LLTokenizer(
                    tok.backend_json(), n_vocab=self._n_vocab,
                    eos_token=sorted(tok.eos_token_ids))
            return self._ll

    def matcher(self, grammar: Grammar) -> Any:
        """A fresh matcher for one request (call it off the event loop: it may take
        milliseconds); InvalidRequestError naming the grammar's parameter if it is invalid."""
        import llguidance

        if not self._tokenizer.eos_token_ids:
            raise InvalidRequestError("this model has no end-of-generation token, so a "
                                      "constrained output could not end", param=grammar.param)
        text = grammar_text(grammar)
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {grammar.param}: {matcher.get_error()}",
                                      param=grammar.param)
        return matcher
