"""Benchmarks: scripts that print a table and write JSON. Speed is reported as ratios measured side by side."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def sync(device) -> None:
    """Wait for the device's queued work (a CUDA device; nothing to wait for elsewhere), so that a
    timer read after it counts that work."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def write_json(path: Path, args: argparse.Namespace, **fields) -> None:
    """A bench's JSON: the torch version, its arguments as given, then `fields`."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                                **fields}, indent=2))
