"""The feature cache in DIR/cache: safetensors shards of token ids, assistant masks and fp16
features, read back through memory maps, and the key that clears it when the base changes."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from .data import Selection
from .log import log

CACHE_VERSION = 2


def save_shard(path: Path, ids: list[np.ndarray], masks: list[np.ndarray], feats: list[np.ndarray],
               meta: dict) -> None:
    from safetensors.numpy import save_file
    lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
    tensors = {"ids": np.concatenate(ids).astype(np.int32), "mask": np.concatenate(masks).astype(np.uint8),
               "hidden": np.concatenate(feats).astype(np.float16), "lengths": lengths}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)


def items_digest(items: list[np.ndarray]) -> str:
    """Identity of the source sequences of a shard (their token ids, in order)."""
    h = hashlib.sha256()
    for x in items:
        h.update(np.int64(len(x)).tobytes())
        h.update(np.ascontiguousarray(x, dtype=np.int32).tobytes())
    return h.hexdigest()[:16]


def read_shards(cache_dir: Path, prefix: str, sources: list[np.ndarray]) -> tuple[list[dict], int]:
    """The shards PREFIX-00000.safetensors... that still hold `sources` (the source sequences in
    processing order) from the start on; returns them and how many sources they cover. Later
    shards, whose sources changed (other data, a different selection), are deleted, so a run
    with more data (a larger --max-tokens or --self-distill) reuses everything before the change."""
    from safetensors import safe_open
    shards, done, stale = [], 0, False
    for path in sorted(cache_dir.glob(f"{prefix}-*.safetensors")):
        if not stale:
            with safe_open(str(path), "np") as f:
                meta = f.metadata()
            count = int(meta["count"])
            stale = (int(meta["first"]) != done or done + count > len(sources)
                     or meta.get("digest") != items_digest(sources[done:done + count]))
        if stale:
            path.unlink()
            continue
        shards.append({"path": path, "count": count})
        done += count
    return shards, done


class ShardRows:
    """The rows of one tensor stored across shard files, read through memory maps: the features
    stay in the page cache, and on disk where memory runs short, instead of in the process, so a
    run's data is bounded by the disk rather than by memory. A sequence never spans two shards."""

    def __init__(self, maps: list[np.ndarray]):
        self.maps = maps
        self.starts = np.cumsum([0] + [len(m) for m in maps])
        self.shape = (int(self.starts[-1]), maps[0].shape[1])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        k = int(np.searchsorted(self.starts, rows.start, side="right")) - 1
        a = rows.start - int(self.starts[k])
        return torch.from_numpy(np.array(self.maps[k][a:a + rows.stop - rows.start]))


def tensor_map(path: Path, name: str) -> np.ndarray:
    """A read-only memory map of one tensor of a safetensors file (8-byte header size, JSON
    header, then the tensors' bytes at their data offsets)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(size))[name]
    dtype = {"F16": np.float16, "F32": np.float32}[info["dtype"]]
    return np.memmap(path, dtype=dtype, mode="r", offset=8 + size + info["data_offsets"][0],
                     shape=tuple(info["shape"]))


def load_splits(cache_dir: Path, *prefixes: str | None) -> dict | None:
    """All sequences of the cached splits `prefixes` (None skipped), in order: ids, mask and
    offsets as flat tensors, the features (fp16; an EAGLE-3 head's are four hidden states a token)
    as ShardRows over the shard files."""
    from safetensors import safe_open
    paths = [p for prefix in prefixes if prefix for p in sorted(cache_dir.glob(f"{prefix}-*.safetensors"))]
    if not paths:
        return None
    ids, mask, lengths = [], [], []
    for path in paths:
        with safe_open(str(path), "np") as f:
            ids.append(f.get_tensor("ids").astype(np.int64))
            mask.append(f.get_tensor("mask"))
            lengths.append(f.get_tensor("lengths"))
    lengths = np.concatenate(lengths)
    return {"ids": torch.from_numpy(np.concatenate(ids)), "mask": torch.from_numpy(np.concatenate(mask)),
            "hidden": ShardRows([tensor_map(p, "hidden") for p in paths]),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), "lengths": lengths}


def prepare_cache(args, ckpt, taps: tuple[int, ...], data: Selection, cache_dir: Path) -> str:
    """Clear cached features made for another base or other generation settings; return the
    fingerprint of this exact data set, which checkpoints belong to."""
    # Features of a sequence depend on the base and the generation settings only; which sequences
    # are cached is checked shard by shard (read_shards).
    cache_key = hashlib.sha256(json.dumps(
        {"v": CACHE_VERSION, "base": ckpt.source, "cfg": ckpt.cfg.to_dict(),
         "distill": [args.distill_new_tokens, args.distill_temperature, args.seed],
         **({"taps": list(taps)} if taps else {}), **({"bf16": True} if args.bf16 else {})},
        sort_keys=True, default=str).encode()).hexdigest()[:16]
    fp = hashlib.sha256(cache_key.encode())
    for e in data.train + data.dev + data.replies:
        fp.update(e.ids.tobytes())
        fp.update(e.mask.tobytes())
    for _, p in data.distill_prompts + data.dev_prompts:
        fp.update(p.tobytes())
    manifest_path = cache_dir / "manifest.json"
    if manifest_path.exists() and json.loads(manifest_path.read_text()).get("cache_key") != cache_key:
        log("cached features are for another base or other generation settings: recomputing them")
        for f in cache_dir.glob("*.safetensors"):
            f.unlink()
    manifest_path.write_text(json.dumps({"cache_key": cache_key, "base": ckpt.source, "data": args.data,
                                         "max_tokens": args.max_tokens, "max_len": args.max_len}, indent=2))
    return fp.hexdigest()[:16]
