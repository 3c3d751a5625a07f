"""The device a run trains on, and the precision of its matmuls there."""
from __future__ import annotations

import torch

from models.cpu import bf16_matmuls


def training_device(args) -> torch.device:
    """--device, checked: CUDA must be there, and --bf16 on a CPU needs native bf16 matmuls.
    Sets torch's CPU threads to --threads first (0: torch's default)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to torch")
    if args.bf16 and device.type == "cpu" and not bf16_matmuls():
        raise SystemExit("--bf16: this CPU has neither AMX nor AVX512-BF16, so torch would emulate bf16 "
                         "(slower than fp32); train without --bf16")
    return device


def precision(device, bf16: bool):
    """The autocast context of the base's forward and the head's training steps: bf16 matmuls with
    --bf16 (fp32 weights, optimizer state and evaluation), else nothing."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)
