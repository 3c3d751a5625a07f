"""Tokenizer and chat template of an artifact, with `tokenizers` and `jinja2` only.

The runtime does not import transformers: it is heavy to import and its tokenizer classes change
between releases, while tokenizer.json and a Jinja chat template are stable formats.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise(message):
    raise jinja2.TemplateError(message)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's bytes_to_unicode), inverted."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


BYTE_LEVEL = _byte_level_alphabet()


class ChatTokenizer:
    def __init__(self, directory: Path):
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel"
        self._added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        self.bos_token = self._token_text(config.get("bos_token"))
        self.eos_token = self._token_text(config.get("eos_token"))
        template_path = directory / "chat_template.jinja"
        source = template_path.read_text() if template_path.exists() else config.get("chat_template")
        self.chat_template = None
        if source:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.chat_template = env.from_string(source)

    @staticmethod
    def _token_text(value):
        return value.get("content") if isinstance(value, dict) else value

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(map(int, ids)), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (an added or special token: its text), as OpenAI's logprobs
        give them: a token may hold part of a character."""
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.id_to_token(int(token_id)) or ""
        if self._byte_level:
            return bytes(BYTE_LEVEL[c] for c in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):  # SentencePiece's byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if self.chat_template is None:
            raise ValueError("this artifact's tokenizer has no chat template; use generate() with a plain prompt")
        text = self.chat_template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        # The template already spells out the special tokens, as transformers assumes too.
        return self.encode(text, add_special_tokens=False)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: ChatTokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    def push(self, ids, final: bool = False) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:  # a multi-byte character split across tokens
            return ""
        delta, self.emitted = text[self.emitted:], len(text)
        return delta


class StopStrings:
    """Feed text deltas; get back what is safe to release and whether a stop string was reached.
    Holds back the longest tail that could still become a stop string, so a stop string split
    across deltas is never half-released; the text is cut where the first one starts."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit = False

    def push(self, delta: str) -> str:
        if not self.stops:
            return delta
        self.pending += delta
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            out, self.pending = self.pending[:min(found)], ""
            return out
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:n]):
                    keep = n
                    break
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
