"""The course's kernels as a PyTorch autograd function (over DLPack, no copies), so they can train a model.

``flash_attention(q, k, v, causal=False, scale=None)`` takes CUDA tensors (batch, heads, n, d) in float16 or
bfloat16 (k and v may have fewer heads: GQA), runs ``flashlab.gpu.attention`` forward, keeps q, k, v, o and the
logsumexp for the backward — not P — and runs ``flashlab.gpu.attention_backward`` when autograd asks. PyTorch is
imported only when this module is; the rest of the package never needs it.
"""

from __future__ import annotations

import torch

import flashlab.gpu as fgpu


def _to_cupy(t: torch.Tensor):
    import cupy as cp

    t = t.detach().contiguous()  # DLPack refuses tensors that require grad; autograd tracks them outside
    if t.dtype == torch.bfloat16:  # CuPy has no bfloat16: the raw bits travel as uint16 (see flashlab.gpu)
        return cp.from_dlpack(t.view(torch.int16)).view(cp.uint16)
    return cp.from_dlpack(t)


def _to_torch(x, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:  # through int16, a dtype both libraries know fully
        import cupy as cp

        return torch.from_dlpack(x.view(cp.int16)).view(torch.bfloat16)
    return torch.from_dlpack(x)


class FlashAttention(torch.autograd.Function):
    """Forward and backward by the course's CUDA kernels; saves o and lse, recomputes P in the backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float | None):
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"flash_attention takes float16 or bfloat16 CUDA tensors; got {q.dtype}")
        bf16 = q.dtype == torch.bfloat16
        o, lse = fgpu.attention(*(_to_cupy(x) for x in (q, k, v)), causal=causal, scale=scale, bf16=bf16)
        out = _to_torch(o, q.dtype)
        ctx.save_for_backward(q, k, v, out, torch.from_dlpack(lse))
        ctx.causal, ctx.scale, ctx.bf16 = causal, scale, bf16
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        grads = fgpu.attention_backward(*(_to_cupy(x) for x in (q, k, v, o)), _to_cupy(lse), _to_cupy(do),
                                        causal=ctx.causal, scale=ctx.scale, bf16=ctx.bf16)
        return (*(_to_torch(g, q.dtype) for g in grads), None, None)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Attention by the course's kernels, differentiable with respect to q, k and v."""
    return FlashAttention.apply(q, k, v, causal, scale)
