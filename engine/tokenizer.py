"""The model's tokenizer: `tokenizer.json` through the `tokenizers` library, plus tokenizer_config.json.

Behaves as Hugging Face's PreTrainedTokenizerFast does for the same folder, which the tests check:
`encode` runs the tokenizer.json post-processor (Llama's adds BOS), chat prompts are rendered with the
folder's jinja2 `chat_template` and encoded without special tokens (the template writes its own BOS),
and `decode` skips special tokens.

`max_token_bytes` bounds a prompt's token count from below without encoding it (engine.validation): no token of a
lossless BPE covers more than that many bytes of the text it encodes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.api import EngineError, RequestError


class Tokenizer:
    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise EngineError(f"{path} is missing; the engine needs a fast tokenizer (tokenizer.json) in engine.model_dir", code="model_missing")
        config_path = model_dir / "tokenizer_config.json"
        config = _read_config(config_path) if config_path.is_file() else {}
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
            raise EngineError(f"{path} is not a tokenizer the tokenizers library reads ({e}); download it again",
                              code="model_invalid") from e
        self._setup(tok, config)

    @classmethod
    def from_tokenizer(cls, tok: HFTokenizer, config: dict | None = None) -> Tokenizer:
        """One over a `tokenizers` object built in memory, with tokenizer_config.json's fields in `config`."""
        self = cls.__new__(cls)
        self._setup(tok, config or {})
        return self

    def _setup(self, tok: HFTokenizer, config: dict) -> None:
        self._tok = tok
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        self.special_tokens = {name: _token_text(config.get(name)) for name in names}  # the chat template sees these
        self.bos_token_id = self._id_of(self.special_tokens["bos_token"])
        self.eos_token_id = self._id_of(self.special_tokens["eos_token"])
        self.chat_template: str | None = config.get("chat_template")
        self._template: jinja2.Template | None = None
        spec = json.loads(tok.to_str())
        self._byte_decoder = _byte_level_decoder() if _decoder_type(spec) == "ByteLevel" else None
        self._added_ids = set(self._tok.get_added_tokens_decoder())  # special/added tokens are literal text
        # The most bytes of input text one token can stand for; None when no such bound holds (module docstring)
        self.max_token_bytes: int | None = max_token_bytes(spec)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (OpenAI's logprobs `bytes`); may be part of a UTF-8 character. An id the
        tokenizer does not know (real checkpoints pad the model's vocabulary past the tokenizer's, e.g. to a multiple
        of 64, and the padding rows' logits may still win) stands for no bytes; `decode` skips such ids too."""
        piece = self._tok.id_to_token(token_id) if token_id >= 0 else None
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        if _is_byte_piece(piece):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece marks spaces with U+2581

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        """Render a chat with the model's template, as HF's apply_chat_template(tokenize=False) does."""
        if self.chat_template is None:
            raise RequestError("this model has no chat_template in tokenizer_config.json; send prompt or input_ids instead", code="no_chat_template")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template rejected the messages: {e}; fix the messages' roles or content", code="invalid_messages") from e

    def encode_chat(self, messages: Sequence[dict]) -> list[int]:
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)


_MAX_HELD = 8  # tokens IncrementalDetokenizer waits on for a character to complete


class IncrementalDetokenizer:
    """Text of a growing list of generated ids, extended one token at a time.

    Decoding token by token goes wrong in two ways: a byte-level token can end inside a UTF-8
    character (decoding it alone gives U+FFFD), and SentencePiece decoders drop the leading space of
    a text's first piece. So each step decodes a short window starting a few tokens back (`_prefix`)
    and emits only what the new tokens add beyond the window's old text, holding back a trailing
    U+FFFD until the character is complete (the scheme of HF's TextStreamer and vLLM).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # window start
        self._read = 0  # ids before this are already in `text`

    def push(self, token_id: int) -> str:
        """Append one token; return the text it completes (may be empty)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self._prefix : self._read])
        after = self.tokenizer.decode(self.ids[self._prefix :])
        # A character is at most 4 bytes and a token at least one: held longer than _MAX_HELD tokens, the trailing
        # U+FFFD is bytes no character completes (a run of lone continuation bytes), and waiting on made each push
        # decode the whole run again (8,192 such tokens: 2.6 s of the engine's thread).
        if len(after) > len(before) and not after.endswith("\ufffd"):
            end = len(self.ids)
        elif len(self.ids) - self._read > _MAX_HELD:
            # The start of a character the last tokens may still finish stays held: given out as U+FFFD, the character
            # that came next was never given (its text as long as the U+FFFD's), and a stop string holding it missed.
            end = len(self.ids) - self._unfinished_tokens()
            after = self.tokenizer.decode(self.ids[self._prefix : end])
        else:
            return ""
        new = after[len(before) :]
        self.text += new
        self._prefix, self._read = self._read, end
        return new

    def _unfinished_tokens(self) -> int:
        """How many of the last held tokens carry an unfinished UTF-8 character's bytes (a lead byte and fewer
        continuation bytes than it announces): at most 3 bytes, so at most 3 tokens that have bytes, and never all."""
        held = [self.tokenizer.token_bytes(i) for i in self.ids[self._read :]]
        tail = b"".join(held[-4:])[-3:]
        unfinished = 0
        for n in range(1, len(tail) + 1):
            lead = tail[-n]
            if lead >= 0xC0:  # 110xxxxx, 1110xxxx, 11110xxx announce 2, 3, 4 bytes
                unfinished = n if n < (2 if lead < 0xE0 else 3 if lead < 0xF0 else 4) else 0
                break
            if lead < 0x80:
                break
        tokens = 0
        while unfinished > 0 and tokens < len(held) - 1:
            tokens += 1
            unfinished -= len(held[-tokens])
        return tokens


def _read_config(path: Path) -> dict:
    """tokenizer_config.json's fields; EngineError (model_invalid) naming the file when it holds no JSON object."""
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, OSError) as e:
        raise EngineError(f"{path} is not readable JSON ({e}); download or re-save the model folder's file",
                          code="model_invalid") from e
    if not isinstance(config, dict):
        raise EngineError(f"{path} holds a JSON {type(config).__name__}, not an object; download or re-save the model "
                          f"folder's file", code="model_invalid")
    return config


def _token_text(value: object) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _decoder_type(spec: dict) -> str | None:
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "Sequence":
        types = {d.get("type") for d in decoder.get("decoders", [])}
        return "ByteLevel" if "ByteLevel" in types else None
    return decoder.get("type")


def max_token_bytes(spec: dict) -> int | None:
    """The most UTF-8 bytes of input text one token of this tokenizer (tokenizer.json's fields) can cover, or None when
    it cannot be bounded. A text of B bytes then encodes to at least ceil(B / max_token_bytes) tokens.

    The bound holds only where every byte of the text ends up inside some token and no step shrinks the text:
    - a BPE model (a WordLevel or WordPiece model maps a whole unknown word, of any length, to one unk token);
    - byte-level (every byte has a token of the 256-character alphabet; a piece's chars stand for one byte each, so
      "\u0120the" covers 4 bytes, not 5) or SentencePiece-style with byte_fallback (every byte has a <0xXX> token; a
      piece counts as written, U+2581 as the 3 bytes of a literal one, which bounds the 1-byte space it also stands for);
    - pre-tokenizers that only split (a WhitespaceSplit drops every space: a megabyte of them is no token at all);
    - normalizers that only add or lengthen text (Prepend, a Replace of a string by one no shorter): NFC or Lowercase
      can shorten text (a Hangul syllable's 3 jamo, 9 bytes, compose to 3), and the bound is not worth a guess;
    - added tokens that swallow no whitespace beside them (lstrip/rstrip take any run of it), and no truncation."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("truncation") is not None or not _lengthens(spec.get("normalizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    pre = _flatten(spec.get("pre_tokenizer"))
    if any(not _keeps_text(p) for p in pre):
        return None
    if any(p.get("type") == "ByteLevel" for p in pre):
        alphabet = _byte_level_decoder()
        if not all(c in vocab for c in alphabet):  # a byte without a token becomes <unk> or nothing
            return None
        pieces = (sum(1 if c in alphabet else len(c.encode()) for c in piece) for piece in vocab)
    elif model.get("byte_fallback") and all(p.get("type") != "ByteLevel" for p in pre):
        if not all(f"<0x{b:02X}>" in vocab for b in range(256)):
            return None
        pieces = (1 if _is_byte_piece(piece) else len(piece.encode()) for piece in vocab)
    else:
        return None
    return max([*pieces, *(len(a.get("content", "").encode()) for a in added)], default=None)


def _flatten(part: dict | None) -> list[dict]:
    if not part:
        return []
    if part.get("type") == "Sequence":
        inner = part.get("pretokenizers", part.get("normalizers"))
        return [q for p in inner or [] for q in _flatten(p)] if isinstance(inner, list) else [part]
    return [part]


def _keeps_text(pre: dict) -> bool:
    """A pre-tokenizer that splits the text without dropping any of it (Split's `Removed` drops what it matches)."""
    kind = pre.get("type")
    if kind in ("Split", "Punctuation"):
        return pre.get("behavior") != "Removed"
    return kind in ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")


def _lengthens(normalizer: dict | None) -> bool:
    """Whether a normalizer never makes text shorter in UTF-8 bytes (so it cannot fit more input into a token)."""
    for part in _flatten(normalizer):
        kind = part.get("type")
        if kind == "Replace":
            pattern = part.get("pattern") or {}
            if "String" not in pattern or len(str(part.get("content", "")).encode()) < len(str(pattern["String"]).encode()):
                return False
        elif kind != "Prepend":
            return False
    return True


def _is_byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable char -> the byte it stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Chat templates come with model folders, i.e. from outside: render them sandboxed, with the same
    # settings and helpers HF gives them so that templates written for HF render identically.
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
