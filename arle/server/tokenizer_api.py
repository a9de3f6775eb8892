"""The tokenizer over HTTP, in vLLM's shapes: POST /tokenize, POST /detokenize and
GET /tokenizer_info. lm-eval's `local-completions` finds these and then tokenizes through the
server (its `remote` tokenizer backend), so it needs no tokenizer files and no Hub access."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

from arle.errors import InvalidRequestError
from arle.model.tokenizer import Tokenizer
from arle.server.protocol import _STRICT, ChatMessage


class TokenizeRequest(BaseModel):
    """A text prompt, or chat messages rendered by the model's template (as the chat route
    renders them)."""

    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass


def tokenize(tok: Tokenizer, req: TokenizeRequest, max_model_len: int) -> dict[str, Any]:
    if req.messages is not None:
        text = tok.apply_chat_template([m.model_dump(exclude_none=True) for m in req.messages],
                                       add_generation_prompt=req.add_generation_prompt)
        ids = tok.encode(text, add_special_tokens=False)
    else:
        assert req.prompt is not None
        ids = tok.encode(req.prompt, req.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                           "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = [tok.id_to_token(t) for t in ids]
    return out


def detokenize(tok: Tokenizer, req: DetokenizeRequest) -> dict[str, Any]:
    if any(not 0 <= t < tok.vocab_size for t in req.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {tok.vocab_size})", param="tokens")
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


def tokenizer_info(tok: Tokenizer, max_model_len: int) -> dict[str, Any]:
    """What a client needs to tokenize like the server: the special tokens and the template."""
    return {"tokenizer_class": "arle", "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "pad_token": None, "add_bos_token": tok.add_bos, "chat_template": tok.chat_template,
            "model_max_length": max_model_len, "vocab_size": tok.vocab_size}
