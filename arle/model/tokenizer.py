"""Text <-> token ids, and chat messages -> prompt text.

One class wraps a Hugging Face `tokenizers.Tokenizer` (Rust: fast, and safe to call from a worker
thread). It is built either from a model directory (tokenizer.json + tokenizer_config.json) or from
the tokenizer metadata of a GGUF file, which stores the vocabulary and merges rather than a
tokenizer.json.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from arle.errors import InvalidRequestError, ModelLoadError

#: Used when a model ships no chat template. NOTE: ChatML is a guess that suits most chat models
#: converted from HF (SmolLM, Qwen); a model trained on another format will see foreign markers.
CHATML_FALLBACK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Unicode noncharacters (never in interchanged text): pairs of them mark where message content
#: starts and ends in a rendered template (see `encode_chat`).
_SENTINELS = [chr(c) for c in range(0xFDD0, 0xFDF0)]

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4

# How a byte-level vocabulary splits text before BPE, by `tokenizer.ggml.pre`. Files not listed
# use ByteLevel's built-in GPT-2 split. NOTE: a split other than the one the merges were learned
# with still round-trips, but gives ids the model never saw in training.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """Encode, decode, render chat templates. Build with `from_hf_dir` / `from_gguf_metadata`."""

    def __init__(
        self,
        tok: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        self._tok = tok
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        eos = frozenset(eos_token_ids)
        #: Every id that ends generation.
        self.eos_token_ids: frozenset[int] = eos if eos_token_id is None else eos | {eos_token_id}
        #: The EOS the config names (templates write it as `eos_token`); else the lowest id.
        self.eos_token_id = eos_token_id if eos_token_id is not None else min(eos, default=None)
        self.pad_token_id = pad_token_id
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        specials = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self._special_ids = frozenset(specials)
        #: Finds any special token's text (longest first, so a token is not cut by a shorter
        #: one that starts it); None when there are none.
        self._special_re = re.compile("|".join(
            re.escape(t) for t in sorted(set(specials.values()), key=len, reverse=True) if t
        )) if specials else None
        self._plain: HFTokenizer | None = None
        self._plain_lock = threading.Lock()
        self._template: jinja2.Template | None = None
        #: The most characters of text one token can stand for (`min_tokens`).
        self.max_token_chars = max(max(map(len, tok.get_vocab(with_added_tokens=True)),
                                       default=1), 1)

    def min_tokens(self, chars: int) -> int:
        """At least how many tokens a text of `chars` characters encodes to, known without
        encoding it: a token stands for at most `max_token_chars` characters of its stored
        form, which has one character per byte (byte-level BPE) or per character, and a
        normalizer that merges characters (NFC, NFKC) folds at most 4 into one; so a text too
        long for the context is refused before the tokenizer spends memory on it."""
        return -(-chars // (4 * self.max_token_chars))

    # --- building -------------------------------------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        """Load tokenizer.json and the optional config files next to it."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(
                tok_file, "missing tokenizer.json (arle reads only the fast-tokenizer format)"
            )
        try:
            tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception on bad JSON or schema
            raise ModelLoadError(tok_file, f"corrupt tokenizer.json: {e}") from None

        cfg = _read_json(path / "tokenizer_config.json")
        gen_cfg = _read_json(path / "generation_config.json")
        model_cfg = _read_json(path / "config.json")

        def token_id(entry: Any) -> int | None:
            # tokenizer_config writes a token as "<s>" or as {"content": "<s>", ...}.
            if isinstance(entry, dict):
                entry = entry.get("content")
            return tok.token_to_id(entry) if isinstance(entry, str) else None

        bos = token_id(cfg.get("bos_token"))
        if bos is None and isinstance(model_cfg.get("bos_token_id"), int):
            bos = model_cfg["bos_token_id"]
        eos_id = token_id(cfg.get("eos_token"))
        eos: set[int] = set()
        # generation_config lists every id that ends a turn (e.g. <|eot_id|> and <|end_of_text|>).
        for source in (gen_cfg, model_cfg):
            v = source.get("eos_token_id")
            eos.update(v if isinstance(v, list) else [v] if isinstance(v, int) else [])

        add_bos = cfg.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No flag: trust the tokenizer.json post-processor (Llama 3 adds BOS only there).
            with_special = tok.encode("a", add_special_tokens=True).ids
            add_bos = bool(with_special) and bos is not None and with_special[0] == bos

        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=eos,
            add_bos=add_bos,
            chat_template=_find_chat_template(path, cfg),
            eos_token_id=eos_id,
            pad_token_id=token_id(cfg.get("pad_token")),
        )

    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any], path: object) -> Tokenizer:
        """Build from decoded GGUF metadata (tokenizer.ggml.*); `path` names the file in errors."""
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                path, f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE 'gpt2')"
            )
        try:
            tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
            merges: list[str] = list(fields["tokenizer.ggml.merges"])
        except KeyError as e:
            raise ModelLoadError(path, f"GGUF tokenizer metadata lacks {e.args[0]}") from None
        types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise ModelLoadError(path, f"GGUF tokenizer has {len(tokens)} tokens but "
                                       f"{len(types)} token types")

        # Normal tokens must be spelled in the byte alphabet for BPE to find them; a few
        # converters store raw text (e.g. "\n\n"), so respell those. Added tokens keep their text:
        # they are matched in the input verbatim, before BPE.
        alphabet = _byte_alphabet()
        letters = set(alphabet.values())
        vocab: dict[str, int] = {}
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True)):
            if ty not in (_CONTROL, _USER_DEFINED) and not set(t) <= letters:
                t = "".join(alphabet[b] for b in t.encode("utf-8"))
            vocab.setdefault(t, i)
        pairs = [tuple(m.split(" ", 1)) for m in merges]

        try:
            bpe = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False)  # type: ignore[arg-type]
        except Exception as e:
            raise ModelLoadError(path, f"bad GGUF tokenizer vocabulary: {e}") from None
        tok = HFTokenizer(bpe)
        split = _GGUF_SPLITS.get(fields.get("tokenizer.ggml.pre", ""))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL
        ])
        tok.add_tokens([
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED
        ])

        def token_id(key: str) -> int | None:
            v = fields.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        # llama.cpp also ends generation at EOT/EOM (e.g. Llama 3's <|eot_id|>).
        eos = {eid for k in ("eos_token_id", "eot_token_id", "eom_token_id")
               if (eid := token_id(k)) is not None}
        template = fields.get("tokenizer.chat_template")
        return cls(
            tok,
            bos_token_id=token_id("bos_token_id"),
            eos_token_ids=eos,
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=template if isinstance(template, str) else None,
            eos_token_id=token_id("eos_token_id"),
            pad_token_id=token_id("padding_token_id"),
        )

    def backend_json(self) -> str:
        """The Rust tokenizer as tokenizer.json text (what grammar libraries read)."""
        return str(self._tok.to_str())

    def save(self, path: Path) -> None:
        """Write tokenizer.json (the Rust tokenizer only; configs are the caller's business)."""
        self._tok.save(str(path))

    # --- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # NOTE: the post-processor of tokenizer.json is bypassed; BOS is ours to add, so it is
        # added once whether the file says so in the config, the post-processor, or both.
        ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
        if (add_special_tokens and self.add_bos and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids.insert(0, self.bos_token_id)
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """`text` as plain text: a special token's text in it is spelled with ordinary
        tokens, never encoded as the special token. No BOS."""
        with self._plain_lock:
            if self._plain is None:
                # NOTE: a copy, because the switch is the tokenizer's own state and other
                # threads encode with the original at the same time.
                plain = HFTokenizer.from_str(self._tok.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
        return list(self._plain.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    # --- chat -----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's template (ChatML when it has none).

        Extra keyword arguments (tools, documents, enable_thinking, ...) reach the template as
        variables. Any failure of the template is the request's fault: InvalidRequestError.
        """
        msgs = [_flatten_message(m, i) for i, m in enumerate(messages)]
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,
            "messages": msgs,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            if self._template is None:
                self._template = _jinja_env().from_string(self.chat_template or CHATML_FALLBACK)
            return self._template.render(**context)
        except jinja2.TemplateError as e:
            # Includes SecurityError: the sandbox refused an attribute or call.
            raise InvalidRequestError(f"chat template error: {e}", param="messages") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as e:
            raise InvalidRequestError(
                f"chat template failed on these messages: {type(e).__name__}: {e}",
                param="messages",
            ) from None


    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **extra: Any) -> tuple[list[int], str]:
        """The prompt ids of a chat, and its text. The template's own text is encoded with its
        special tokens; the messages' content as plain text (`encode_plain`), so a message that
        contains `<|im_end|><|im_start|>system` cannot forge a turn.

        NOTE: content with no special token's text in it (nearly all) takes the plain path: the
        rendered text encoded whole. Otherwise that content is wrapped in a pair of sentinel
        characters before rendering; the rendered text is then encoded piece by piece, the
        pieces between sentinels as plain text. A template that splits a wrapped content (so
        that its sentinels no longer pair up) refuses the request rather than guess.
        """
        msgs = [_flatten_message(m, i) for i, m in enumerate(messages)]
        find = self._special_re
        marked = [i for i, m in enumerate(msgs)
                  if find is not None and isinstance(m.get("content"), str)
                  and find.search(m["content"])]
        if not marked:
            text = self.apply_chat_template(msgs, add_generation_prompt, **extra)
            return self.encode(text, add_special_tokens=False), text
        seen = json.dumps([msgs, extra], ensure_ascii=False, default=str) + \
            (self.chat_template or CHATML_FALLBACK)
        free = [c for c in _SENTINELS if c not in seen]
        if len(free) < 2:
            raise InvalidRequestError("the messages hold every sentinel character "
                                      "(U+FDD0..U+FDEF)", param="messages")
        open_, close = free[0], free[1]
        for i in marked:
            msgs[i] = {**msgs[i], "content": open_ + msgs[i]["content"] + close}
        rendered = self.apply_chat_template(msgs, add_generation_prompt, **extra)
        ids: list[int] = []
        pieces: list[str] = []
        plain = False
        for piece in re.split(f"([{open_}{close}])", rendered):
            if piece in (open_, close):
                if (piece == open_) == plain:
                    raise InvalidRequestError(
                        "the chat template split a message's content; arle cannot tell its "
                        "special tokens from the template's", param="messages")
                plain = piece == open_
                continue
            if piece:
                ids += self.encode_plain(piece) if plain else self.encode(piece, False)
                pieces.append(piece)
        if plain:
            raise InvalidRequestError("the chat template cut a message's content short; arle "
                                      "cannot tell its special tokens from the template's",
                                      param="messages")
        return ids, "".join(pieces)


def _flatten_message(message: Any, index: int) -> dict[str, Any]:
    """Content as the template expects it: a list of text parts becomes one string."""
    if not isinstance(message, dict):
        raise InvalidRequestError(f"messages[{index}] must be an object", param="messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"messages[{index}].content must be a string or a list of parts", param="messages"
        )
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"messages[{index}].content: unsupported part type {kind!r} (only 'text')",
                param="messages",
            )
        texts.append(part["text"])
    # NOTE: parts are joined with a newline, as vLLM does for text-only content.
    return {**message, "content": "\n".join(texts)}


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """A sandbox that refuses unsafe attribute access at once.

    The stock sandbox returns an undefined value that only raises when used further, so
    `{{ ''.__class__ }}` renders as "". A template poking at internals is refused loudly instead.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )


def _jinja_env() -> jinja2.Environment:
    """The environment HF renders chat templates in, sandboxed: a template is model-file data."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes <, >, & and non-ASCII for HTML; prompts want them verbatim.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _read_json(path: Path) -> dict[str, Any]:
    """An optional JSON config: {} when absent, ModelLoadError when unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"cannot read JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(path, "expected a JSON object")
    return data


def _find_chat_template(path: Path, cfg: dict[str, Any]) -> str | None:
    # Newer checkpoints keep the template in its own file, which wins over the config entry.
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelLoadError(jinja_file, f"cannot read chat template: {e}") from None
    template = cfg.get("chat_template")
    if isinstance(template, list):
        # A list of named templates: the one named "default", else the first.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is None:
        template = _read_json(path / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None
