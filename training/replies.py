"""Replies files: the compact format training.distill writes its self-distilled replies in, and
the training examples a run takes from them (--replies)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from models.train_data import Example, is_dev

FORMAT = "eagle2-distilled-replies"


def read(path: Path) -> dict:
    """A replies file: {"manifest", "conversation_ids", "prompts", "replies"} (lists of id lists)."""
    with np.load(path, allow_pickle=False) as f:
        manifest = json.loads(str(f["manifest"]))
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{path} is not a replies file of this project (format {manifest.get('format')!r})")

        def unflatten(name):
            ends = np.cumsum(f[f"{name}_lengths"])
            return [a.astype(np.int64).tolist() for a in np.split(f[f"{name}_ids"], ends[:-1])] if len(ends) else []
        return {"manifest": manifest, "conversation_ids": f["conversation_ids"].tolist(),
                "prompts": unflatten("prompt"), "replies": unflatten("reply")}


def write(path: Path, manifest: dict, ids: list[str], prompt: list[list[int]], reply: list[list[int]]) -> None:
    """Atomically: the .npz, then its manifest beside it."""
    dtype = np.uint16 if manifest["vocab_size"] <= 1 << 16 else np.int32

    def flat(seqs):
        return np.asarray([t for s in seqs for t in s], dtype), np.asarray([len(s) for s in seqs], np.int32)
    (p_ids, p_len), (r_ids, r_len) = flat(prompt), flat(reply)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, manifest=np.asarray(json.dumps(manifest)), conversation_ids=np.asarray(ids, dtype=str),
                        prompt_ids=p_ids, prompt_lengths=p_len, reply_ids=r_ids, reply_lengths=r_len)
    os.replace(tmp, path)
    path.with_suffix(".json").write_text(json.dumps(manifest, indent=1) + "\n")


def replies_file(arg: str) -> tuple[Path, int]:
    """--replies FILE[@START] -> (FILE, START)."""
    path, at, start = arg.rpartition("@")
    if at and start.isdigit():
        return Path(path), int(start)
    return Path(arg), 0


def read_replies(files: list[tuple[Path, int]], dev_percent: float, max_len: int) -> list[Example]:
    """The examples of replies files (training.distill) from each one's START-th reply on, those of
    held-out conversations left out."""
    out = []
    for path, start in files:
        r = read(path)
        for cid, prompt, reply in list(zip(r["conversation_ids"], r["prompts"], r["replies"]))[start:]:
            if is_dev(cid, dev_percent) or not reply:
                continue
            ids = np.asarray(prompt + reply, np.int32)[:max_len]
            mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(reply), np.uint8)])[:max_len]
            out.append(Example(cid, ids, mask))
    return out
