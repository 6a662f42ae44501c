"""A toy model trained with the course's kernels, beside the same model trained with PyTorch's SDPA.

The task needs attention and nothing else: each position must output the token one step back (position 0 its own
token), so the model has to learn, from positions alone, to put all its weight on key i - 1. One causal attention
layer (2 heads of d = 64, bf16 inside attention, fp32 elsewhere) with learned token and position embeddings.
Both runs start from the same weights and see the same batches; only the attention differs: ``"flash"`` is
``flashlab.gpu.autograd.flash_attention`` (forward and backward by the course's kernels, lse kept instead of P),
``"sdpa"`` is ``torch.nn.functional.scaled_dot_product_attention``. Their loss curves should lie on top of each
other, and both should fall from ln(vocab) towards 0.

``python -m flashlab bench train`` records both curves in data/ch8/train.json. Needs PyTorch and a GPU.
"""

from __future__ import annotations

import torch

VOCAB, N, BATCH, MODEL, HEADS = 16, 64, 32, 128, 2


class PreviousToken(torch.nn.Module):
    def __init__(self, vocab: int = VOCAB, n: int = N, model: int = MODEL, heads: int = HEADS):
        super().__init__()
        self.heads = heads
        self.tok = torch.nn.Embedding(vocab, model)
        self.pos = torch.nn.Parameter(0.5 * torch.randn(n, model))
        self.qkv = torch.nn.Linear(model, 3 * model)
        self.out = torch.nn.Linear(model, vocab)

    def forward(self, x: torch.Tensor, attention) -> torch.Tensor:
        B, n = x.shape
        h = self.tok(x) + self.pos[:n]
        q, k, v = (t.reshape(B, n, self.heads, -1).transpose(1, 2).to(torch.bfloat16).contiguous()
                   for t in self.qkv(h).chunk(3, dim=-1))
        o = attention(q, k, v).float().transpose(1, 2).reshape(B, n, -1)
        return self.out(o)


def attention_fn(name: str):
    """The attention a run uses: "flash" (the course's kernels) or "sdpa" (PyTorch), causal, default scale."""
    if name == "flash":
        from .autograd import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, True)
    if name == "sdpa":
        return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    raise ValueError(f"attention must be 'flash' or 'sdpa'; got {name!r}")


def batch(gen: torch.Generator, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, VOCAB, (BATCH, N), generator=gen, device=device)
    y = torch.cat([x[:, :1], x[:, :-1]], dim=1)  # the previous token; position 0 repeats its own
    return x, y


def train(name: str, steps: int, seed: int = 0, lr: float = 3e-3) -> list[float]:
    """Train from seed's weights on seed's batches; return the loss of every step."""
    torch.manual_seed(seed)
    model = PreviousToken().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    attn = attention_fn(name)
    losses = []
    for _ in range(steps):
        x, y = batch(gen)
        loss = torch.nn.functional.cross_entropy(model(x, attn).reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [round(float(v), 6) for v in losses]
