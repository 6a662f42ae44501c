"""``python -m flashlab bench train``: a toy model trained with the course's kernels and with PyTorch SDPA.

The model of ``flashlab.gpu.toytrain``, trained for --steps from the same seed with each attention: both loss
curves. Rows: pass "train", written to data/ch8/train.json. Needs PyTorch.
"""

from __future__ import annotations

import argparse
import sys

from . import gpu_main, record_parser, training_kernel_hashes
from .backward import OUT_DIR


def run(args: argparse.Namespace, rows: list[dict]) -> None:
    """The toy model of flashlab.gpu.toytrain, trained with the course's kernels and with SDPA (same seed)."""
    from ..gpu import toytrain

    curves = {}
    for name in ("flash", "sdpa"):
        curves[name] = toytrain.train(name, args.steps)
        rows.append({"pass": "train", "impl": name, "steps": args.steps, "batch": toytrain.BATCH, "n": toytrain.N,
                     "heads": toytrain.HEADS, "d": toytrain.MODEL // toytrain.HEADS, "vocab": toytrain.VOCAB,
                     "dtype": "bfloat16", "causal": True, "losses": curves[name], "final_loss": curves[name][-1]})
        print(f"  {name:<6} loss {curves[name][0]:.3f} -> {curves[name][-1]:.4f} after {args.steps} steps", flush=True)
    gap = max(abs(a - b) for a, b in zip(curves["flash"], curves["sdpa"], strict=True))
    print(f"  max |loss(flash) - loss(sdpa)| over the steps: {gap:.2e}")


def format_rows(rows: list[dict]) -> str:
    """Plain text, one line per training run: first and last loss."""
    return "\n".join(f"{r['impl']:<16} loss {r['losses'][0]:.3f} -> {r['final_loss']:.4f} after {r['steps']} steps"
                     for r in rows)


def parser() -> argparse.ArgumentParser:
    """The command line of this run (--repeat and --warmup are accepted but nothing is timed)."""
    p = record_parser("train", __doc__.splitlines()[0], name="train", out=OUT_DIR)
    p.add_argument("--steps", type=int, default=200, help="optimiser steps")
    return p


def _needs_torch(args: argparse.Namespace) -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("bench train needs PyTorch (the toy model is a torch module)") from None


def main(argv: list[str] | None = None) -> int:
    """Train both models; print the losses; write data/ch8/NAME.json unless --no-write."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return gpu_main("train", argv, parser(), run, format_rows, prepare=_needs_torch,
                    extra_provenance=training_kernel_hashes)
