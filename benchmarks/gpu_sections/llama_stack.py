"""The 4-layer Llama-3.1-8B-shaped decoder the `stack` and `decode` sections time: hidden 4096, MLP 14336, 32 heads,
8 KV heads, RoPE theta 5e5, SDPA, RMSNorm, SwiGLU; random weights. The layer sizes are arguments, so the same model
runs small on CPU (tests/benchmarks)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from jetrl_precision import convert_to_fp8, get_recipe
from jetrl_precision.rmsnorm import fuse_rmsnorm
from jetrl_precision.swiglu import fuse_swiglu, set_dy_quantization

__all__ = ["RMSNorm", "Attn", "MLP", "Block", "Stack", "build_stack"]


class RMSNorm(nn.Module):
    def __init__(self, h, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _rot(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attn(nn.Module):
    def __init__(self, h, nh, nkv):
        super().__init__()
        self.nh, self.nkv, self.hd = nh, nkv, h // nh
        self.q_proj = nn.Linear(h, nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(nh * self.hd, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        q, k = q * cos + _rot(q) * sin, k * cos + _rot(k) * sin
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=s > 1)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, h=4096, i=14336, nh=32, nkv=8):
        super().__init__()
        self.input_layernorm = RMSNorm(h)
        self.self_attn = Attn(h, nh, nkv)
        self.post_attention_layernorm = RMSNorm(h)
        self.mlp = MLP(h, i)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Stack(nn.Module):
    """4 Llama-3.1-8B decoder layers (hidden 4096, MLP 14336, 32 heads, 8 KV heads), random weights."""

    def __init__(self, n_layers=4, **block):
        super().__init__()
        self.layers = nn.ModuleList(Block(**block) for _ in range(n_layers))
        self._rope = {}

    def rope(self, s, device, dtype, start=0):
        key = (s, start, dtype)
        if key not in self._rope:
            inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, device=device).float() / 128))
            pos = torch.arange(start, start + s, device=device).float()
            f = torch.outer(pos, inv)
            emb = torch.cat((f, f), dim=-1)
            self._rope[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._rope[key]

    def forward(self, x, start=0):
        cos, sin = self.rope(x.shape[1], x.device, x.dtype, start)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def build_stack(variant, seed=0):
    """variant: "bf16" or "jet_fp8/<gemm backend>", optionally with ":" and "+"-joined modes: "unfused" keeps the
    plain MLP (no fused SwiGLU), "separate" runs q/k/v and gate/up as their own GEMMs (no stacked projections),
    "plainnorm" keeps the plain RMSNorms (no norm fused with its consumers' quantization), "plaindy" leaves the
    stacked gate/up GEMM's dY to its own quantizer (the SwiGLU backward does not write Q(dY))."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Stack().to(torch.bfloat16)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    if variant != "bf16":
        recipe_name, backend = variant.split("/")
        backend, _, mode = backend.partition(":")
        modes = set(mode.split("+")) if mode else set()
        convert_to_fp8(model, dataclasses.replace(get_recipe(recipe_name), gemm_backend=backend), fuse_swiglu=False,
                       fuse_projections="separate" not in modes, fuse_rmsnorm=False)
        # What convert_to_fp8 does for HF Llama/Qwen MLPs and norms (this file's classes join by name).
        if "unfused" not in modes:
            fuse_swiglu(model, classes=[MLP])
            set_dy_quantization(model, "plaindy" not in modes)
        if "plainnorm" not in modes:
            fuse_rmsnorm(model, classes=[RMSNorm])
    return model
