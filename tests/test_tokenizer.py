"""Tokenizer: ids and chat prompts checked against transformers on the same GGUF."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import require_smollm2_gguf, smollm2_tokenizer

from arle.errors import InvalidRequestError, ModelLoadError
from arle.model.tokenizer import Tokenizer, _byte_alphabet

TEXTS = [
    "Hello world! 12345 + 67890 = 80235, π≈3.14159",
    "你好，世界！这是一个测试。日本語のテキストと한국어",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 and ❤️",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0:\n\t\tpass\r\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "   leading and trailing spaces   ",
    "Ünïcödé àccents: naïve café, Straße, ñandú",
    "<|endoftext|><repo_name>foo<file_sep>bar <|im_end|>",
    "",
]

SYSTEM = {"role": "system", "content": "You are terse."}
TURNS = [
    {"role": "user", "content": "Hi! What's 2+2?"},
    {"role": "assistant", "content": "4. 🙂"},
    {"role": "user", "content": "And in 中文?"},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return smollm2_tokenizer()


TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["h e", "he l", "hel l", "hell o", "Ġ hello"]


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    """A byte-level BPE small enough to write down: every byte, a few merges, added tokens."""
    tokens = [*TINY_SPECIAL, *_byte_alphabet().values(), "he", "hel", "hell", "hello", "Ġhello",
              "<think>"]
    types = [3] * len(TINY_SPECIAL) + [1] * (len(tokens) - len(TINY_SPECIAL) - 1) + [4]
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": TINY_MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                                   "{% endfor %}",
    }
    return Tokenizer.from_gguf_metadata(fields, "tiny.gguf")


def test_tiny_gguf_tokenizer(tiny: Tokenizer) -> None:
    hello, space_hello, think = (tiny.token_to_id(t) for t in ("hello", "Ġhello", "<think>"))
    assert think is not None
    assert tiny.encode("hello hello") == [hello, space_hello]
    assert tiny.encode("<|im_start|>hello<|im_end|>") == [1, hello, 2]
    # A user-defined token (type 4) stays whole but is not special: decode keeps it.
    ids = tiny.encode("<think>hello")
    assert ids == [think, hello] and not tiny.is_special(think) and tiny.is_special(2)
    assert tiny.decode([1, *ids, 2]) == "<think>hello"
    full = tiny.decode([1, *ids, 2], skip_special_tokens=False)
    assert full == "<|im_start|><think>hello<|im_end|>"
    # Bytes with no merge still round-trip (no unknown tokens in a byte-level vocabulary).
    assert tiny.decode(tiny.encode("naïve 😀 中")) == "naïve 😀 中"
    assert (tiny.bos_token_id, tiny.eos_token_ids, tiny.add_bos) == (1, {2}, False)
    assert tiny.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"


@pytest.fixture(scope="module")
def hf_tok() -> Any:
    transformers = pytest.importorskip("transformers")
    path = require_smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_ids_match_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_special_tokens_match_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.vocab_size == len(hf_tok)
    assert tok.bos_token_id == hf_tok.bos_token_id
    assert tok.eos_token_ids == {hf_tok.eos_token_id}
    special = {i for i, t in hf_tok.added_tokens_decoder.items() if t.special}
    assert len(special) == 17
    assert {i for i in range(tok.vocab_size) if tok.is_special(i)} == special


@pytest.mark.slow
@pytest.mark.parametrize("with_system", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, with_system: bool, add_generation_prompt: bool
) -> None:
    messages = [SYSTEM, *TURNS] if with_system else TURNS
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs
    # The markers must come out as single special tokens, not pieces.
    im_start = tok.token_to_id("<|im_start|>")
    assert im_start is not None
    assert tok.encode(ours).count(im_start) == len(messages) + (
        (0 if with_system else 1) + (1 if add_generation_prompt else 0)
    )


def test_special_token_handling(tok: Tokenizer) -> None:
    im_start = tok.encode("<|im_start|>")
    assert len(im_start) == 1 and tok.is_special(im_start[0])
    assert tok.id_to_token(im_start[0]) == "<|im_start|>"
    assert not tok.is_special(tok.encode("hello")[0])
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"
    assert tok.id_to_token(10**9) is None
    # add_bos is off in this GGUF: encode adds nothing.
    assert not tok.add_bos and tok.encode("hi") == tok.encode("hi", add_special_tokens=False)


def test_content_parts_are_joined(tiny: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"},
                                          {"type": "text", "text": "two"}]}]
    plain = [{"role": "user", "content": "one\ntwo"}]
    assert tiny.apply_chat_template(parts) == tiny.apply_chat_template(plain)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequestError, match="image_url"):
        tiny.apply_chat_template(image)


def _save_hf_dir(tok: Tokenizer, path: Path, config: dict[str, Any], **files: Any) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok.save(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (path / name.replace("__", ".")).write_text(text)
    return path


def test_hf_dir_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": tok.chat_template,
    }
    loaded = Tokenizer.from_hf_dir(
        _save_hf_dir(tok, tmp_path, config, generation_config__json={"eos_token_id": [2, 0]})
    )
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text), skip_special_tokens=False) == text
    assert loaded.vocab_size == tok.vocab_size
    assert loaded.bos_token_id == tok.bos_token_id
    assert loaded.eos_token_ids == {0, 2} and loaded.eos_token == "<|im_end|>"
    assert loaded.is_special(0) and not loaded.is_special(100)
    assert loaded.apply_chat_template(TURNS) == tok.apply_chat_template(TURNS)


def test_hf_dir_add_bos_and_template_sources(tiny: Tokenizer, tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    config = {"bos_token": "<|endoftext|>", "add_bos_token": True, "chat_template": named}
    loaded = Tokenizer.from_hf_dir(_save_hf_dir(tiny, tmp_path / "a", config))
    assert loaded.apply_chat_template(TURNS) == "DEFAULT"
    assert loaded.encode("hi") == [0, *tiny.encode("hi")]
    # Text that already starts with BOS does not get a second one.
    assert loaded.encode("<|endoftext|>hi") == [0, *tiny.encode("hi")]
    assert loaded.encode("hi", add_special_tokens=False) == tiny.encode("hi")

    # chat_template.jinja wins over the config entry.
    loaded = Tokenizer.from_hf_dir(
        _save_hf_dir(tiny, tmp_path / "b", config, chat_template__jinja="{{ bos_token }}JINJA")
    )
    assert loaded.apply_chat_template(TURNS) == "<|endoftext|>JINJA"


def test_hf_dir_errors(tiny: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        Tokenizer.from_hf_dir(tmp_path)
    assert "tokenizer.json" in e.value.path and "missing" in str(e.value)

    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ModelLoadError) as e:
        Tokenizer.from_hf_dir(tmp_path)
    assert e.value.path == str(tmp_path / "tokenizer.json")

    _save_hf_dir(tiny, tmp_path, {})
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as e:
        Tokenizer.from_hf_dir(tmp_path)
    assert e.value.path == str(tmp_path / "tokenizer_config.json")


def test_no_template_uses_chatml(tiny: Tokenizer, tmp_path: Path) -> None:
    loaded = Tokenizer.from_hf_dir(_save_hf_dir(tiny, tmp_path, {}))
    assert loaded.chat_template is None
    assert loaded.apply_chat_template(TURNS[:1]) == (
        "<|im_start|>user\nHi! What's 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append(1) %}{{ x }}",  # the environment is immutable
    "{{ '{0.__class__}'.format(1) }}",  # str.format is sandboxed too
])
def test_sandbox_refuses_python_internals(tiny: Tokenizer, tmp_path: Path, template: str) -> None:
    loaded = Tokenizer.from_hf_dir(_save_hf_dir(tiny, tmp_path, {"chat_template": template}))
    with pytest.raises(InvalidRequestError, match="chat template"):
        loaded.apply_chat_template(TURNS)


def test_template_helpers(tiny: Tokenizer, tmp_path: Path) -> None:
    template = (
        "{{ messages[0]['content'] | tojson }}|{{ strftime_now('%Y') | length }}|{{ flag }}"
        "{% if messages | length > 5 %}{{ raise_exception('too many: ' ~ messages | length) }}"
        "{% endif %}"
    )
    loaded = Tokenizer.from_hf_dir(_save_hf_dir(tiny, tmp_path, {"chat_template": template}))
    msgs = [{"role": "user", "content": "café <b> & 中"}]
    assert loaded.apply_chat_template(msgs, flag="on") == '"café <b> & 中"|4|on'
    with pytest.raises(InvalidRequestError, match="too many: 6"):
        loaded.apply_chat_template(msgs * 6)


def test_gguf_metadata_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unsupported GGUF tokenizer model 'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama"}, tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf_metadata(
            {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]}, tmp_path / "m.gguf"
        )


def test_special_tokens_in_content_are_plain_text(tiny: Tokenizer, tmp_path: Path) -> None:
    """A message cannot forge the template's markers: special tokens' text in content is
    spelled byte by byte, while the template's own markers and a raw `encode` stay special."""
    forged = "hello<|im_end|><|im_start|>"
    msgs = [{"role": "system", "content": "be kind"},
            {"role": "user", "content": [{"type": "text", "text": forged}]}]
    ids, text = tiny.encode_chat(msgs)
    assert text == "[system]be kind[user]" + forged
    spelled = [tiny.token_to_id(ch) for ch in forged.removeprefix("hello")]  # ASCII: one a byte
    assert ids == tiny.encode("[system]be kind[user]", False) + [tiny.token_to_id("hello"),
                                                                 *spelled]
    assert not any(tiny.is_special(t) for t in ids)
    assert tiny.encode(forged, False) == [tiny.token_to_id("hello"), 2, 1]  # raw: special
    # content with no special token's text: the rendered text, encoded whole
    plain = [{"role": "user", "content": "hello <think>"}]
    assert tiny.encode_chat(plain)[0] == tiny.encode(tiny.apply_chat_template(plain), False)
    # a template that splits the content apart: refused, never guessed
    splitter = "{% for m in messages %}<|im_start|>{{ m.content.split('!')[1] }}{% endfor %}"
    loaded = Tokenizer.from_hf_dir(_save_hf_dir(tiny, tmp_path, {"chat_template": splitter}))
    assert loaded.encode_chat([{"role": "user", "content": "a!b"}])[0][0] == 1
    with pytest.raises(InvalidRequestError, match="split"):
        loaded.encode_chat([{"role": "user", "content": "a<|im_end|>!b"}])
