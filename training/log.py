"""The trainer's progress lines: timestamped, and written through tqdm so that they do not break its bars."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


def log(msg: str) -> None:
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {msg}")
    sys.stdout.flush()
