"""Modules of `H3Transformer`: projections, norms and block forwards, written against the runtime op table.

The module tree mirrors Diffusers' `MiniMaxH3Transformer3DModel` so state-dict keys and module paths are identical
(`attn.to_out.0`, `ff.net.0.proj`, `ff.net.2`, `adaln_proj.linear`, ...): a parallel plan, a LoRA target list or an
offload map names the same modules here as there.

The module boundary:
- `Linear` is an `nn.Linear` (peft, DTensor parallel styles and accelerate's hooks recognise it) whose `forward(x)`
  is one op-table call: `runtime.current_ops().linear(x, weight, bias, point=self.point)`, or `linear_tree` for the
  row-parallel projections (`tree=True`: `attn.to_out.0`, `ff.net.2`). `RMSNorm` is an `nn.RMSNorm` whose
  forward is `ops.rms_norm(x, weight, eps, point=self.point)`. Neither ever runs nn.Linear / nn.RMSNorm arithmetic.
  `point` is the trace point (the hook point the result is exposed at; the time MLP's two linears share
  `time_mlp`). The caller casts the input (the released cast points: each input to its projection's dtype, the AdaLN
  activations to the AdaLN linear's dtype, the final norm to the heads' dtype); inside the block stack the stream
  already has the weights' dtype.
- Every module is *called* (`self.to_q(x)`), so outside code may replace it (`block.attn.to_q = Wrapper(to_q)`) or
  attach torch forward / pre-forward hooks to it. An inserted module dispatches through the same table
  (`runtime.current_ops()`) and names its own trace records `<wrapped point>.<suffix>` (e.g. `blocks.0.q.lora_a`).
- Hook points fire in one line at the site that computes the value, `q = self.hook_q(self.to_q(x))`, after the
  module call: a point shows what the next op consumes, so a wrapper's output is what the hook sees.
- Non-module ops (modulate, rope, attention, residuals, swiglu, silu) are `ops.<name>(..., point=...)` calls on the
  block's table; reshapes, chunk, views and the released dtype casts are plain torch. Each block's forward follows
  Diffusers' statement order, so `off` mode is bit-equal to it.
- The AdaLN pre-norm (`norm_modulate`) is one fused op when nothing could observe the norm in between: no hook
  registered, neither op overridden, and the norm module is this file's `RMSNorm`, unwrapped and without torch hooks.
  The switchable fusions (`runtime.use_fusions`, off by default) follow the same rule: `qk_norm_rope` (the Q/K
  norms and RoPE of a block's attention, traced at `q_rope`) and `residual_norm_modulate` (the attention's gated
  residual and the FFN's pre-norm, traced at `modulate2`). A registered hook, an override of one of the ops or a
  replaced / hooked norm module runs the unfused ops, so every hook point still fires; the fused strict kernels give
  the unfused chain's bytes, so the choice never changes a result.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from ..execution import runtime
from ..config import NUM_MODALITIES
from .hooks import HookSite, active_hooks


# ---------------------------------------------------------------------------------------------- module boundary
class Linear(nn.Linear):
    """A projection (weight (out, in) [+ bias (out,)], `nn.Linear`'s init) whose forward dispatches through the op
    table of the current forward: `linear`, or `linear_tree` when `tree` (the strict 8-chunk K tree)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, point: str = "",
                 tree: bool = False):
        super().__init__(in_features, out_features, bias)
        self.point = point
        self.tree = tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = runtime.current_ops()
        op = ops.linear_tree if self.tree else ops.linear
        return op(x, self.weight, self.bias, point=self.point)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, point={self.point!r}" + (", tree=True" if self.tree else "")


class RMSNorm(nn.RMSNorm):
    """RMS norm over the last axis (weight (dim,) = ones, eps) whose forward is the op table's `rms_norm`."""

    def __init__(self, dim: int, eps: float, *, point: str = ""):
        super().__init__(dim, eps=eps)
        self.point = point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return runtime.current_ops().rms_norm(x, self.weight, self.eps, point=self.point)


def _plain(module: nn.Module, cls: type) -> bool:
    """`module` is exactly `cls`, with its own forward and no torch hooks: calling it is the op it stands for. (An
    instance `forward` that is the class's own bound method counts as plain: accelerate leaves one on removal.)"""
    own = module.__dict__.get("forward")
    return type(module) is cls and (own is None or getattr(own, "__func__", None) is cls.forward) and not (
        module._forward_hooks or module._forward_pre_hooks
        or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
    )


def norm_modulate(ops: runtime.Ops, x: torch.Tensor, norm: nn.Module, scale: torch.Tensor, shift: torch.Tensor,
                  index: torch.Tensor, norm_site: HookSite, site: HookSite) -> torch.Tensor:
    """AdaLN pre-norm: `modulate(norm(x), scale, shift, index)`. With no hook registered, neither op overridden and
    `norm` a plain `RMSNorm`, it is one fused op call (`norm_modulate`, traced at `site`), whose strict kernel
    reproduces the bytes of the two strict kernels; otherwise the norm module runs, then modulate, and both points
    fire."""
    if active_hooks() is None and ops.fusable("rms_norm", "modulate") and _plain(norm, RMSNorm):
        return ops.norm_modulate(x, norm.weight, norm.eps, scale, shift, index, point=site.name)
    h = norm_site(norm(x))
    return site(ops.modulate(h, scale, shift, index, point=site.name))


# ------------------------------------------------------------------------------------------------------ layers
class _SwiGLUProj(nn.Module):
    """`ff.net.0`: holds `proj` (dim -> 2*ffn_dim, output [value; gate])."""

    def __init__(self, dim: int, ffn_dim: int, point: str):
        super().__init__()
        self.proj = Linear(dim, 2 * ffn_dim, bias=False, point=point)


class FeedForward(nn.Module):
    """`ff.net = [SwiGLU proj, dropout(0) slot, down proj]`; the Identity keeps Diffusers' key index `net.2`."""

    def __init__(self, dim: int, ffn_dim: int, prefix: str):
        super().__init__()
        self.net = nn.ModuleList([
            _SwiGLUProj(dim, ffn_dim, prefix + "ffn_up"), nn.Identity(),
            Linear(ffn_dim, dim, bias=False, point=prefix + "ffn_down", tree=True),
        ])
        self.hook_ffn_up, self.hook_swiglu, self.hook_ffn_down = (
            HookSite(prefix + s) for s in ("ffn_up", "swiglu", "ffn_down")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hook_ffn_up(self.net[0].proj(x))  # (B, S, 2*ffn) [value; gate]
        h = self.hook_swiglu(runtime.current_ops().swiglu(h, point=self.hook_swiglu.name))  # (B, S, ffn)
        return self.hook_ffn_down(self.net[2](h))  # (B, S, hidden)


class Attention(nn.Module):
    """Full self-attention over one packed document: q/k/v projections hidden -> heads*head_dim (wider than hidden
    in the release), per-head RMS q/k norm, optional partial RoPE (after the norm), O-projection back to hidden."""

    def __init__(self, hidden_size: int, heads: int, head_dim: int, qk_norm_eps: float, prefix: str, rope: bool):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = Linear(hidden_size, inner, bias=False, point=prefix + "q")
        self.to_k = Linear(hidden_size, inner, bias=False, point=prefix + "k")
        self.to_v = Linear(hidden_size, inner, bias=False, point=prefix + "v")
        self.norm_q = RMSNorm(head_dim, qk_norm_eps, point=prefix + "q_norm")
        self.norm_k = RMSNorm(head_dim, qk_norm_eps, point=prefix + "k_norm")
        # Diffusers' to_out.1 is dropout(0).
        self.to_out = nn.ModuleList([Linear(inner, hidden_size, bias=False, point=prefix + "o_proj", tree=True)])
        names = ["q", "k", "v", "q_norm", "k_norm", "attention", "o_proj"] + (["q_rope", "k_rope"] if rope else [])
        for s in names:
            setattr(self, f"hook_{s}", HookSite(prefix + s))

    def _fuses_qk(self, ops: runtime.Ops) -> bool:
        """Q/K norm and RoPE as one op (`qk_norm_rope`): the fusion is on, no hook is registered, neither op is
        overridden and both norms are plain `RMSNorm`s of one epsilon."""
        return (ops.fuses("qk_norm_rope") and active_hooks() is None and _plain(self.norm_q, RMSNorm)
                and _plain(self.norm_k, RMSNorm) and self.norm_q.eps == self.norm_k.eps)

    def forward(self, x: torch.Tensor, rotary_emb: tuple | None = None,
                key_order: torch.Tensor | None = None) -> torch.Tensor:
        ops = runtime.current_ops()
        q = self.hook_q(self.to_q(x))  # (B, S, inner)
        k = self.hook_k(self.to_k(x))
        v = self.hook_v(self.to_v(x))
        # Heads counted from the width (B, S, H, D): a tensor-parallel rank whose to_q/k/v hold whole heads of its
        # own (h3lab.distributed) sees its H/tp heads; one process sees all H.
        q = q.unflatten(-1, (-1, self.head_dim))
        k = k.unflatten(-1, (-1, self.head_dim))
        v = v.unflatten(-1, (-1, self.head_dim))

        if rotary_emb is not None and self._fuses_qk(ops):
            cos, sin = rotary_emb  # (S, rotary_dim) float32 each
            q, k = ops.qk_norm_rope(q, k, self.norm_q.weight, self.norm_k.weight, self.norm_q.eps, cos, sin,
                                    point=self.hook_q_rope.name)
        else:
            q = self.hook_q_norm(self.norm_q(q))
            k = self.hook_k_norm(self.norm_k(k))
            if rotary_emb is not None:  # transformer blocks only; the token refiner has no positions
                cos, sin = rotary_emb  # (S, rotary_dim) float32 each
                q = self.hook_q_rope(ops.rope(q, cos, sin, point=self.hook_q_rope.name))
                k = self.hook_k_rope(ops.rope(k, cos, sin, point=self.hook_k_rope.name))

        # Keys in canonical order over the packed document (blocks); the refiner's text document keeps its own order.
        o = self.hook_attention(ops.attention(q, k, v, key_order, point=self.hook_attention.name))  # (B, S, H, D)
        o = o.flatten(2, 3).type_as(q)  # (B, S, inner); Diffusers' type_as (a no-op: attention keeps q's dtype)
        return self.hook_o_proj(self.to_out[0](o))  # (B, S, hidden)


# ------------------------------------------------------------------------------------------------------ blocks
class RefinerBlock(nn.Module):
    """Token refiner block: x + attn(norm1(x)), then x + ff(norm2(x)). Rows are the text rows."""

    def __init__(self, config, index: int):
        super().__init__()
        c, p = config, f"refiner.{index}."
        self.norm1 = RMSNorm(c.hidden_size, c.norm_eps, point=p + "norm1")
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps, p, rope=False)
        self.norm2 = RMSNorm(c.hidden_size, c.norm_eps, point=p + "norm2")
        self.ff = FeedForward(c.hidden_size, c.ffn_dim, p)
        self.hook_norm1, self.hook_residual1, self.hook_norm2, self.hook_residual2 = (
            HookSite(p + s) for s in ("norm1", "residual1", "norm2", "residual2")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = runtime.current_ops()
        h = self.attn(self.hook_norm1(self.norm1(x)))
        x = self.hook_residual1(ops.add(x, h, point=self.hook_residual1.name))
        h = self.ff(self.hook_norm2(self.norm2(x)))
        return self.hook_residual2(ops.add(x, h, point=self.hook_residual2.name))


class TokenRefiner(nn.Module):
    """`token_refiner`: the refiner blocks and their final norm (the loop lives in `H3Transformer.forward`, which
    owns gradient checkpointing)."""

    def __init__(self, config):
        super().__init__()
        self.refiner_blocks = nn.ModuleList([RefinerBlock(config, i) for i in range(config.num_refiner_layers)])
        self.final_norm = RMSNorm(config.hidden_size, config.final_norm_eps, point="refiner.final_norm")
        self.hook_final_norm = HookSite("refiner.final_norm")


class AdaLNModulation(nn.Module):
    """`adaln_proj`: temb (T, time_embed_dim) -> table (T*3, 6*hidden), row `timestep_index*3 + tag`, columns
    [shift_msa | scale_msa | gate_msa | shift_mlp | scale_mlp | gate_mlp]; returns the six column chunks."""

    def __init__(self, time_embed_dim: int, hidden_size: int, point: str):
        super().__init__()
        self.hidden_size = hidden_size
        self.linear = Linear(time_embed_dim, 6 * hidden_size * NUM_MODALITIES, bias=True, point=point)
        self.hook_adaln_table = HookSite(point)

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # silu at temb's precision (float32: time_embedder is a float32 module), only its result cast to the
        # projection's dtype: a rounding before the activation would bias every block identically at every step.
        a = runtime.current_ops().silu(temb, point=self.linear.point).to(self.linear.weight.dtype)
        table = self.linear(a).view(-1, 6 * self.hidden_size)  # (T, 3*6*hidden) -> (T*3, 6*hidden)
        return self.hook_adaln_table(table).chunk(6, dim=-1)


class TransformerBlock(nn.Module):
    """MiniMax-H3 block: AdaLN-modulated pre-norm attention and SwiGLU FFN with gated residuals; the six
    modulation vectors of each row are gathered from the (timestep, modality) table with `adaln_indices`.
    `forward(x, temb, adaln_indices, rotary_emb, key_order=None)`: Diffusers' block signature plus the canonical
    key order of the packed document (None = packed order)."""

    def __init__(self, config, index: int):
        super().__init__()
        c, p = config, f"blocks.{index}."
        self.norm1 = RMSNorm(c.hidden_size, c.norm_eps, point=p + "norm1")
        self.attn = Attention(c.hidden_size, c.num_attention_heads, c.attention_head_dim, c.qk_norm_eps, p, rope=True)
        self.norm2 = RMSNorm(c.hidden_size, c.norm_eps, point=p + "norm2")
        self.ff = FeedForward(c.hidden_size, c.ffn_dim, p)
        self.adaln_proj = AdaLNModulation(c.time_embed_dim, c.hidden_size, p + "adaln_table")
        for s in ("norm1", "modulate1", "residual1", "norm2", "modulate2", "residual2"):
            setattr(self, f"hook_{s}", HookSite(p + s))

    def forward(
        self,
        x: torch.Tensor,  # (B, S, hidden)
        temb: torch.Tensor,  # (T, time_embed_dim) float32
        adaln_indices: torch.Tensor,  # (S,) int64 = timestep_index*3 + tag
        rotary_emb: tuple[torch.Tensor, torch.Tensor],  # cos, sin (S, rotary_dim) float32
        key_order: torch.Tensor | None = None,  # (S,) int64 canonical key order
    ) -> torch.Tensor:
        ops = runtime.current_ops()
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaln_proj(temb)

        h = norm_modulate(ops, x, self.norm1, scale_msa, shift_msa, adaln_indices, self.hook_norm1, self.hook_modulate1)
        h = self.attn(h, rotary_emb, key_order)
        if ops.fuses("residual_norm_modulate") and active_hooks() is None and _plain(self.norm2, RMSNorm):
            # the attention residual and the FFN pre-norm as one op: the stream is written once, never read back
            x, h = ops.residual_norm_modulate(x, gate_msa, adaln_indices, h, self.norm2.weight, self.norm2.eps,
                                              scale_mlp, shift_mlp, point=self.hook_modulate2.name)
        else:
            x = self.hook_residual1(ops.gated_residual(x, gate_msa, adaln_indices, h, point=self.hook_residual1.name))
            h = norm_modulate(ops, x, self.norm2, scale_mlp, shift_mlp, adaln_indices, self.hook_norm2,
                              self.hook_modulate2)
        h = self.ff(h)
        return self.hook_residual2(ops.gated_residual(x, gate_mlp, adaln_indices, h, point=self.hook_residual2.name))


class TimestepMLP(nn.Module):
    """`time_embedder`: linear_1 (freq_dim -> time_embed_hidden_dim), silu, linear_2 (-> time_embed_dim); all three
    ops trace at `time_mlp`, where the result is exposed. The caller casts the sinusoid to linear_1's dtype."""

    def __init__(self, freq_dim: int, hidden_dim: int, out_dim: int):
        super().__init__()
        self.linear_1 = Linear(freq_dim, hidden_dim, bias=True, point="time_mlp")
        self.linear_2 = Linear(hidden_dim, out_dim, bias=True, point="time_mlp")
        self.hook_time_mlp = HookSite("time_mlp")

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        h = runtime.current_ops().silu(self.linear_1(t), point="time_mlp")
        return self.hook_time_mlp(self.linear_2(h))  # (T, time_embed_dim)


class RotaryTable(nn.Module):
    """`rope`: the shared `inv_freq` (rope_freq_dim,) float32 buffer, non-persistent (recomputed, never loaded);
    `forward(position_ids (S, 3) float32)` -> the (cos, sin) tables (S, 2*3*rope_freq_dim) float32."""

    def __init__(self, rope_freq_dim: int, rope_theta: float):
        super().__init__()
        self.rope_freq_dim, self.rope_theta = rope_freq_dim, rope_theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)
        self.hook_rope_cos, self.hook_rope_sin = HookSite("rope_cos"), HookSite("rope_sin")

    def compute_inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        # 1 / theta^(2i / (2F)), i = 0..F-1, float32 — the released formula, term for term.
        f = self.rope_freq_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, 2 * f, 2, dtype=torch.float32, device=device) / (2 * f)))

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One op produces both tables; it traces at rope_cos.
        cos, sin = runtime.current_ops().rope_table(position_ids, self.inv_freq, point=self.hook_rope_cos.name)
        return self.hook_rope_cos(cos), self.hook_rope_sin(sin)


class AdaLNOut(nn.Module):
    """`norm_out`: RMS norm plus a per-timestep [shift | scale] table (T, 2*hidden) from `linear`;
    `forward(x, temb, timestep_indices)` -> the modulated stream (Diffusers' `norm_out` signature)."""

    def __init__(self, hidden_size: int, time_embed_dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, point="final_norm")
        self.linear = Linear(time_embed_dim, 2 * hidden_size, bias=True, point="final_table")
        self.hook_final_table, self.hook_final_norm, self.hook_final_modulate = (
            HookSite(s) for s in ("final_table", "final_norm", "final_modulate")
        )

    def forward(self, x: torch.Tensor, temb: torch.Tensor, timestep_indices: torch.Tensor) -> torch.Tensor:
        ops = runtime.current_ops()
        a = ops.silu(temb, point=self.linear.point).to(self.linear.weight.dtype)
        shift, scale = self.hook_final_table(self.linear(a)).chunk(2, dim=-1)  # (T, 2*hidden)
        return norm_modulate(ops, x, self.norm, scale, shift, timestep_indices, self.hook_final_norm,
                             self.hook_final_modulate)

