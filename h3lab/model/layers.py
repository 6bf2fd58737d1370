"""Parameter holders and block forwards of `H3Transformer`, written against the runtime op table.

The module tree mirrors Diffusers' `MiniMaxH3Transformer3DModel` so state-dict keys are identical
(`attn.to_out.0`, `ff.net.0.proj`, `ff.net.2`, `adaln_proj.linear`, ...). The holders (`Linear`, `RMSNorm`) only own
parameters: they have no forward, so nothing can call `nn.Linear`/`nn.RMSNorm` arithmetic by accident. Every
arithmetic step is an `ops.<name>(..., point=...)` call; reshapes, chunk, views and the released dtype casts are
plain torch. Each block's forward follows Diffusers' statement order, so `off` mode is bit-equal to it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import NUM_MODALITIES
from .hooks import BLOCK_POINTS, REFINER_POINTS, HookRegistry


class Run:
    """What one forward threads through the blocks: the op table, the hook registry (None when empty) and the
    canonical key order of the packed document (None = packed order; only the block stack's attention uses it —
    the token refiner attends over the text rows alone)."""

    __slots__ = ("ops", "hooks", "key_order")

    def __init__(self, ops, hooks: HookRegistry | None, key_order: torch.Tensor | None = None):
        self.ops = ops
        self.hooks = hooks
        self.key_order = key_order


def norm_modulate(run: Run, x: torch.Tensor, norm: "RMSNorm", scale: torch.Tensor, shift: torch.Tensor,
                  index: torch.Tensor, norm_point: str, point: str) -> torch.Tensor:
    """AdaLN pre-norm: `modulate(rms_norm(x), scale, shift, index)`. With no hook registered and neither op
    overridden it is one fused op call (`norm_modulate`, traced at `point`), whose strict kernel reproduces the
    bytes of the two strict kernels; otherwise the two ops run apart and both hook points fire."""
    ops, hooks = run.ops, run.hooks
    if hooks is None and ops.fusable("rms_norm", "modulate"):
        return ops.norm_modulate(x, norm.weight, norm.eps, scale, shift, index, point=point)
    h = ops.rms_norm(x, norm.weight, norm.eps, point=norm_point)
    if hooks:
        h = hooks.fire(norm_point, h)
    h = ops.modulate(h, scale, shift, index, point=point)
    if hooks:
        h = hooks.fire(point, h)
    return h


# ------------------------------------------------------------------------------------------- parameter holders
class Linear(nn.Module):
    """weight (out, in) [+ bias (out,)], initialised like `nn.Linear`. No forward: use `ops.linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's init; on the meta device these are no-ops.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """weight (dim,) = ones and eps, like `nn.RMSNorm`. No forward: use `ops.rms_norm`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def extra_repr(self) -> str:
        return f"({self.weight.shape[0]},), eps={self.eps}"


class _SwiGLUProj(nn.Module):
    """`ff.net.0`: holds `proj` (dim -> 2*ffn_dim, output [value; gate])."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.proj = Linear(dim, 2 * ffn_dim, bias=False)


class FeedForward(nn.Module):
    """`ff.net = [SwiGLU proj, dropout(0) slot, down proj]`; the Identity keeps Diffusers' key index `net.2`."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.net = nn.ModuleList([_SwiGLUProj(dim, ffn_dim), nn.Identity(), Linear(ffn_dim, dim, bias=False)])

    def forward(self, run: Run, x: torch.Tensor, pt: dict[str, str]) -> torch.Tensor:
        ops, hooks = run.ops, run.hooks
        h = ops.linear(x, self.net[0].proj.weight, point=pt["ffn_up"])  # (B, S, 2*ffn) [value; gate]
        if hooks:
            h = hooks.fire(pt["ffn_up"], h)
        h = ops.swiglu(h, point=pt["swiglu"])  # (B, S, ffn)
        if hooks:
            h = hooks.fire(pt["swiglu"], h)
        h = ops.linear_tree(h, self.net[2].weight, point=pt["ffn_down"])  # (B, S, hidden)
        if hooks:
            h = hooks.fire(pt["ffn_down"], h)
        return h


class Attention(nn.Module):
    """Full self-attention over one packed document: q/k/v projections hidden -> heads*head_dim (wider than hidden
    in the release), per-head RMS q/k norm, optional partial RoPE (after the norm), O-projection back to hidden."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, qk_norm_eps: float):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = Linear(hidden_size, inner, bias=False)
        self.to_k = Linear(hidden_size, inner, bias=False)
        self.to_v = Linear(hidden_size, inner, bias=False)
        self.norm_q = RMSNorm(head_dim, qk_norm_eps)
        self.norm_k = RMSNorm(head_dim, qk_norm_eps)
        self.to_out = nn.ModuleList([Linear(inner, hidden_size, bias=False)])  # Diffusers' to_out.1 is dropout(0)

    def forward(self, run: Run, x: torch.Tensor, pt: dict[str, str], rope: tuple | None = None) -> torch.Tensor:
        ops, hooks = run.ops, run.hooks
        q = ops.linear(x, self.to_q.weight, point=pt["q"])  # (B, S, inner)
        if hooks:
            q = hooks.fire(pt["q"], q)
        k = ops.linear(x, self.to_k.weight, point=pt["k"])
        if hooks:
            k = hooks.fire(pt["k"], k)
        v = ops.linear(x, self.to_v.weight, point=pt["v"])
        if hooks:
            v = hooks.fire(pt["v"], v)
        q = q.unflatten(-1, (self.heads, -1))  # (B, S, H, D)
        k = k.unflatten(-1, (self.heads, -1))
        v = v.unflatten(-1, (self.heads, -1))

        q = ops.rms_norm(q, self.norm_q.weight, self.norm_q.eps, point=pt["q_norm"])
        if hooks:
            q = hooks.fire(pt["q_norm"], q)
        k = ops.rms_norm(k, self.norm_k.weight, self.norm_k.eps, point=pt["k_norm"])
        if hooks:
            k = hooks.fire(pt["k_norm"], k)
        if rope is not None:  # transformer blocks only; the token refiner has no positions
            cos, sin = rope  # (S, rotary_dim) float32 each
            q = ops.rope(q, cos, sin, point=pt["q_rope"])
            if hooks:
                q = hooks.fire(pt["q_rope"], q)
            k = ops.rope(k, cos, sin, point=pt["k_rope"])
            if hooks:
                k = hooks.fire(pt["k_rope"], k)

        # Keys in canonical order over the packed document (blocks); the refiner's text document keeps its own order.
        key_order = run.key_order if rope is not None else None
        o = ops.attention(q, k, v, key_order, point=pt["attention"])  # (B, S, H, D)
        if hooks:
            o = hooks.fire(pt["attention"], o)
        o = o.flatten(2, 3).type_as(q)  # (B, S, inner); Diffusers' type_as (a no-op: attention keeps q's dtype)
        o = ops.linear_tree(o, self.to_out[0].weight, point=pt["o_proj"])  # (B, S, hidden)
        if hooks:
            o = hooks.fire(pt["o_proj"], o)
        return o


# ------------------------------------------------------------------------------------------------------ blocks
class RefinerBlock(nn.Module):
    """Token refiner block: x + attn(norm1(x)), then x + ff(norm2(x)). Rows are the text rows."""

    def __init__(self, config, index: int):
        super().__init__()
        c = config
        self.norm1 = RMSNorm(c.hidden_size, c.norm_eps)
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = RMSNorm(c.hidden_size, c.norm_eps)
        self.ff = FeedForward(c.hidden_size, c.ffn_dim)
        self.pt = {s: f"refiner.{index}.{s}" for s, _ in REFINER_POINTS}

    def forward(self, run: Run, x: torch.Tensor) -> torch.Tensor:
        ops, hooks, pt = run.ops, run.hooks, self.pt
        h = ops.rms_norm(x, self.norm1.weight, self.norm1.eps, point=pt["norm1"])
        if hooks:
            h = hooks.fire(pt["norm1"], h)
        h = self.attn(run, h, pt)
        x = ops.add(x, h, point=pt["residual1"])
        if hooks:
            x = hooks.fire(pt["residual1"], x)
        h = ops.rms_norm(x, self.norm2.weight, self.norm2.eps, point=pt["norm2"])
        if hooks:
            h = hooks.fire(pt["norm2"], h)
        h = self.ff(run, h, pt)
        x = ops.add(x, h, point=pt["residual2"])
        if hooks:
            x = hooks.fire(pt["residual2"], x)
        return x


class TokenRefiner(nn.Module):
    """`token_refiner`: the refiner blocks and their final norm (the loop lives in `H3Transformer.forward`, which
    owns gradient checkpointing)."""

    def __init__(self, config):
        super().__init__()
        self.refiner_blocks = nn.ModuleList([RefinerBlock(config, i) for i in range(config.num_refiner_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.final_norm_eps)


class AdaLNModulation(nn.Module):
    """`adaln_proj`: temb (T, time_embed_dim) -> table (T*3, 6*hidden), row `timestep_index*3 + tag`, columns
    [shift_msa | scale_msa | gate_msa | shift_mlp | scale_mlp | gate_mlp]."""

    def __init__(self, time_embed_dim: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.linear = Linear(time_embed_dim, 6 * hidden_size * NUM_MODALITIES, bias=True)

    def forward(self, run: Run, temb: torch.Tensor, name: str) -> tuple[torch.Tensor, ...]:
        ops, hooks = run.ops, run.hooks
        # silu at temb's precision (float32: time_embedder is a float32 module), only its result cast to the
        # projection's dtype: a rounding before the activation would bias every block identically at every step.
        a = ops.silu(temb, point=name).to(self.linear.weight.dtype)
        table = ops.linear(a, self.linear.weight, self.linear.bias, point=name)  # (T, 3*6*hidden)
        table = table.view(-1, 6 * self.hidden_size)  # (T*3, 6*hidden)
        if hooks:
            table = hooks.fire(name, table)
        return table.chunk(6, dim=-1)


class TransformerBlock(nn.Module):
    """MiniMax-H3 block: AdaLN-modulated pre-norm attention and SwiGLU FFN with gated residuals; the six
    modulation vectors of each row are gathered from the (timestep, modality) table with `adaln_indices`."""

    def __init__(self, config, index: int):
        super().__init__()
        c = config
        self.norm1 = RMSNorm(c.hidden_size, c.norm_eps)
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps)
        self.norm2 = RMSNorm(c.hidden_size, c.norm_eps)
        self.ff = FeedForward(c.hidden_size, c.ffn_dim)
        self.adaln_proj = AdaLNModulation(c.time_embed_dim, c.hidden_size)
        self.pt = {s: f"blocks.{index}.{s}" for s, _, _ in BLOCK_POINTS}

    def forward(
        self,
        run: Run,
        x: torch.Tensor,  # (B, S, hidden)
        temb: torch.Tensor,  # (T, time_embed_dim) float32
        adaln_indices: torch.Tensor,  # (S,) int64 = timestep_index*3 + tag
        cos: torch.Tensor,  # (S, rotary_dim) float32
        sin: torch.Tensor,
    ) -> torch.Tensor:
        ops, hooks, pt = run.ops, run.hooks, self.pt
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(run, temb, pt["adaln_table"])

        h = norm_modulate(run, x, self.norm1, scale_msa, shift_msa, adaln_indices, pt["norm1"], pt["modulate1"])
        h = self.attn(run, h, pt, (cos, sin))
        x = ops.gated_residual(x, gate_msa, adaln_indices, h, point=pt["residual1"])
        if hooks:
            x = hooks.fire(pt["residual1"], x)

        h = norm_modulate(run, x, self.norm2, scale_mlp, shift_mlp, adaln_indices, pt["norm2"], pt["modulate2"])
        h = self.ff(run, h, pt)
        x = ops.gated_residual(x, gate_mlp, adaln_indices, h, point=pt["residual2"])
        if hooks:
            x = hooks.fire(pt["residual2"], x)
        return x


class TimestepMLP(nn.Module):
    """`time_embedder`: linear_1 (freq_dim -> time_embed_hidden_dim), silu, linear_2 (-> time_embed_dim)."""

    def __init__(self, freq_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.linear_1 = Linear(freq_dim, hidden_dim, bias=True)
        self.linear_2 = Linear(hidden_dim, out_dim, bias=True)


class RotaryTable(nn.Module):
    """`rope`: the shared `inv_freq` (rope_freq_dim,) float32 buffer, non-persistent (recomputed, never loaded)."""

    def __init__(self, rope_freq_dim: int, rope_theta: float):
        super().__init__()
        self.rope_freq_dim, self.rope_theta = rope_freq_dim, rope_theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        # 1 / theta^(2i / (2F)), i = 0..F-1, float32 — the released formula, term for term.
        f = self.rope_freq_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32, device=device) / (2 * f)))


class AdaLNOut(nn.Module):
    """`norm_out`: RMS norm plus a per-timestep [shift | scale] table (T, 2*hidden) from `linear`."""

    def __init__(self, hidden_size: int, time_embed_dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.linear = Linear(time_embed_dim, 2 * hidden_size, bias=True)
