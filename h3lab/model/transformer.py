"""`H3Transformer`: MiniMax-H3's token refiner, block stack and heads, written once against the runtime op table.

Contract:
- State-dict keys are exactly Diffusers' `MiniMaxH3Transformer3DModel` keys, in the same order; `rope.inv_freq` is a
  non-persistent float32 buffer.
- `forward(...)` has Diffusers' signature and semantics and returns the plain tuple `(video, audio)`. In `off` mode
  on CPU the output bytes equal Diffusers' for the same weights, under both dtype policies.
- Every arithmetic step goes through `ops = runtime.ops(...)`, created at the start of each forward and made the
  current table (`runtime.use_ops`) for the forward's duration, together with the hook registry (`use_hooks`, None
  when no hook is registered). Every projection, norm, block and head is a *called* module at its Diffusers path
  (`layers.py`: the module boundary), so outside code may replace, wrap or hook any of them; modules dispatch
  through `runtime.current_ops()`. Reshapes, chunk, views and the released cast points are plain torch and sit at
  the call sites, so a wrapper receives the input already cast. The cast points, as released: each input is cast to
  its projection's parameter dtype; the text stream sets the packed dtype; the timestep MLP input is cast to
  `time_embedder`'s dtype; silu runs on the float32 `temb` and only its result is cast to each AdaLN linear's dtype;
  the `norm_out` result is cast to the heads' dtype.
- Dtype policy: `H3Transformer(config, dtype_policy="released" | "float32")`, or `apply_dtype_policy(policy)` on a
  built model (see `precision.py`). Use it rather than `model.to(dtype)`, which would also cast `inv_freq`.
- Gradient checkpointing: `model.gradient_checkpointing = True` checkpoints each refiner block and each transformer
  block with `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` while grad is enabled, as Diffusers does.
  The replay in backward does not append to the runtime trace (the forward's records are the trace); it re-enters
  the forward's op table and hook registry, since backward runs outside the forward's context (and, on CUDA, on
  autograd's own thread). The checkpoint saves and restores the RNG state around the replay (torch's default), except
  inside `checkpoint_rng_state(False)`: the training step's CUDA graph (`h3lab.training.step_graph`) captures the
  step there, since reading the CUDA RNG state is refused during a capture; the model draws no random numbers, so
  the bytes are the same either way.
- Hooks (`hooks.py`): `hook_points()`, `add_hook(fn, names=None)` -> handle with `.remove()`, `recomputing`.
  `model.hook_context` is a plain dict owned by the caller (the denoise loop sets e.g. `{"step": 3}` before a
  forward) for hooks that hold the model to read; the model never reads or mutates it. During a checkpoint replay in
  backward it is temporarily set back to the object that was current when that forward ran.
- Meta construction for loading: `with torch.device("meta"): H3Transformer(cfg)`, load with `assign=True`, then
  `model.reset_buffers(device)` recomputes `inv_freq` (it is not in the state dict). `from_pretrained` delegates to
  `h3lab.checkpoint.loader.load_transformer`.
- `model.fingerprint` (default "") is written into the runtime trace of every forward.
- The checked forward goes through `h3lab.execution.graphs.run`: the execution context's graph policy (`h3lab.execution.context`) decides
  whether it is a CUDA graph's capture or replay or the eager forward itself; the model never looks at the mode.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.utils.checkpoint
from torch import nn

from ..execution import context, graphs, runtime
from ..config import NUM_MODALITIES, H3Config
from .hooks import HookFn, HookPoint, HookRegistry, HookSite, hook_points, use_hooks
from .inputs import ModelInputError, check_inputs, check_key_order
from .layers import AdaLNOut, Linear, RotaryTable, TimestepMLP, TokenRefiner, TransformerBlock
from .precision import check_policy, policy_dtype

def checkpoint_rng_state(preserve: bool):
    """Whether the enclosed forwards' gradient checkpoints save and restore the RNG state (default True; see the
    module contract)."""
    return context.use_flag("checkpoint_rng", preserve, "checkpoint_rng_state")


class H3Transformer(nn.Module):
    """MiniMax-H3 transformer over one packed text/video/audio sequence (see the module docstring)."""

    def __init__(self, config: H3Config, dtype_policy: str = "released"):
        super().__init__()
        if not isinstance(config, H3Config):
            raise TypeError(f"config is a {type(config).__name__}: must be an h3lab.H3Config")
        check_policy(dtype_policy)
        c = config
        self.config = c
        # Registration order = Diffusers' state-dict order.
        self.proj_in = Linear(c.video_patch_dim, c.hidden_size, point="video_proj_in")
        self.audio_proj_in = Linear(c.audio_in_channels, c.hidden_size, point="audio_proj_in")
        self.context_embedder = Linear(c.text_dim, c.hidden_size, point="text_proj_in")
        self.time_embedder = TimestepMLP(c.freq_dim, c.time_embed_hidden_dim, c.time_embed_dim)
        self.rope = RotaryTable(c.rope_freq_dim, c.rope_theta)
        self.token_refiner = TokenRefiner(c)
        self.transformer_blocks = nn.ModuleList([TransformerBlock(c, i) for i in range(c.num_layers)])
        self.norm_out = AdaLNOut(c.hidden_size, c.time_embed_dim, c.final_norm_eps)
        self.proj_out = Linear(c.hidden_size, c.video_patch_dim, point="video_head")
        self.audio_proj_out = Linear(c.hidden_size, c.audio_in_channels, point="audio_head")
        for name in ("video_proj_in", "audio_proj_in", "text_proj_in", "pack", "time_sinusoid", "video_head",
                     "audio_head", "video_out", "audio_out"):
            setattr(self, f"hook_{name}", HookSite(name))

        self.gradient_checkpointing = False
        self.fingerprint = ""
        self.hook_context: dict = {}
        self.recomputing = False
        self._points = hook_points(c)
        self._hooks = HookRegistry(self._points)
        self.dtype_policy = "float32"
        self.apply_dtype_policy(dtype_policy)

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls, path, subfolder: str | None = None, device=None, dtype_policy: str = "released"
    ) -> "H3Transformer":
        """Load a snapshot root or component folder (see `h3lab.checkpoint.loader.load_transformer`)."""
        from ..checkpoint.loader import load_transformer

        return load_transformer(cls, path, subfolder=subfolder, device=device, dtype_policy=dtype_policy)

    def apply_dtype_policy(self, policy: str) -> "H3Transformer":
        """Cast parameters in place to `policy` ("released": FP32_MODULES float32, the rest bfloat16; "float32").
        Parameter objects are kept (`param.data` is replaced, as `Module.to` does); `inv_freq` stays float32."""
        check_policy(policy)
        with torch.no_grad():
            for name, param in self.named_parameters():
                dtype = policy_dtype(name, policy)
                if param.dtype != dtype:
                    param.data = param.data.to(dtype)
        self.dtype_policy = policy
        return self

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the non-persistent `rope.inv_freq` (float32) on `device` (default: where `proj_in` lives).
        The loader calls this after materialising a meta-constructed model."""
        if device is None:
            device = self.proj_in.weight.device
        self.rope.inv_freq = self.rope.compute_inv_freq(device)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------------------------------------- hooks
    def hook_points(self) -> tuple[HookPoint, ...]:
        """Every hook point, in execution order (docs/ARCHITECTURE.md)."""
        return self._points

    def hooked_points(self) -> frozenset[str]:
        """Names of the points some registered hook fires at (empty when none is registered)."""
        return self._hooks.hooked_points()

    def add_hook(self, fn: HookFn, names: Iterable[str] | None = None):
        """Register `fn(point, tensor) -> tensor | None` at every point (or only at `names`); returns a handle
        whose `.remove()` unregisters it."""
        return self._hooks.add(fn, names)

    # ----------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        hidden_states: torch.Tensor,  # (B, Nv, video_patch_dim) rows in video_indices order
        audio_hidden_states: torch.Tensor,  # (B, Na, audio_in_channels)
        encoder_hidden_states: torch.Tensor,  # (B, Nt, text_dim)
        timestep: torch.Tensor,  # (T,) distinct timesteps in [0, 1]
        timestep_indices: torch.Tensor,  # (S,) int64 into timestep
        token_tags: torch.Tensor,  # (S,) int64: 0 video, 1 text, 2 audio
        position_ids: torch.Tensor,  # (S, 3) t, h, w
        video_indices: torch.Tensor,  # (Nv,) int64 packed positions
        audio_indices: torch.Tensor,  # (Na,)
        text_indices: torch.Tensor,  # (Nt,)
        attention_kwargs: dict | None = None,
        return_dict: bool = False,
        key_order: torch.Tensor | None = None,  # (S,) int64 canonical key order (PackedLayout.key_order())
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Video (B, Nv, video_patch_dim) and audio (B, Na, audio_in_channels) velocities, rows in index order.

        `key_order` (an h3lab extension of Diffusers' signature): the packed position of canonical row 0, 1, ...;
        the block stack's attention visits keys in that order. None (the default, and what a canonical layout
        gives) is packed order. Passing a consistently permuted layout together with its `key_order` makes every
        packed-row intermediate permute with the rows and leaves the selected outputs byte-identical in strict mode.

        `attention_kwargs` and `return_dict` exist only so Diffusers' denoise loop can call this model unchanged
        (it passes `attention_kwargs=None, return_dict=False`): there are no LoRA layers, so a LoRA scale other than
        1 is refused, and the result is always the plain tuple."""
        if attention_kwargs and any(k != "scale" or v != 1.0 for k, v in attention_kwargs.items()):
            raise ModelInputError(
                f"attention_kwargs={attention_kwargs!r}: H3Transformer has no LoRA layers; only None or scale=1.0"
            )
        if return_dict:
            raise ModelInputError(
                "return_dict=True: H3Transformer.forward always returns the plain tuple (video, audio)"
            )
        check_inputs(
            self.config, hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices,
            token_tags, position_ids, video_indices, audio_indices, text_indices,
        )
        inv_freq = self.rope.inv_freq
        if inv_freq.is_meta or inv_freq.dtype != torch.float32:
            raise ModelInputError(
                f"rope.inv_freq is {inv_freq.dtype} on {inv_freq.device}: must be float32 on a real device "
                "(call model.reset_buffers(device) after loading; cast with apply_dtype_policy, not .to(dtype))"
            )
        if key_order is not None:
            check_key_order(key_order, position_ids)
        args = (hidden_states, audio_hidden_states, encoder_hidden_states, timestep, timestep_indices, token_tags,
                position_ids, video_indices, audio_indices, text_indices, key_order)
        return graphs.run(self, args, self._run_ops)  # the context's graph policy: a graph or the eager forward

    def _run_ops(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """One traced forward of checked inputs: a fresh op table and the hook registry made current."""
        ops = runtime.ops(device=args[0].device, fingerprint=self.fingerprint)
        hooks = self._hooks if self._hooks else None
        with runtime.use_ops(ops), use_hooks(hooks):
            return self._forward(ops, hooks, *args)

    def _forward(self, ops, hooks, hidden_states, audio_hidden_states, encoder_hidden_states, timestep,
                 timestep_indices, token_tags, position_ids, video_indices, audio_indices, text_indices, key_order):
        """The forward body, run inside `use_ops(ops)` / `use_hooks(hooks)` (checked inputs)."""
        seq_len = position_ids.shape[0]

        # 1. Per-modality input projections, each input cast to its projection's dtype (float32 video/audio heads,
        # bfloat16 context_embedder in the release).
        video = self.hook_video_proj_in(self.proj_in(hidden_states.to(self.proj_in.weight.dtype)))
        audio = self.hook_audio_proj_in(self.audio_proj_in(audio_hidden_states.to(self.audio_proj_in.weight.dtype)))
        text = self.hook_text_proj_in(
            self.context_embedder(encoder_hidden_states.to(self.context_embedder.weight.dtype))
        )

        # 2. Token refiner over the text rows, then its final norm.
        for block in self.token_refiner.refiner_blocks:
            text = self._run_block(ops, hooks, block, text)
        refiner = self.token_refiner
        text = refiner.hook_final_norm(refiner.final_norm(text))

        # 3. Packed buffer (B, S, hidden) in the text stream's dtype; video/audio rows cast to it.
        x = self.hook_pack(ops.pack_rows(
            seq_len, (text_indices, text), (video_indices, video), (audio_indices, audio), point="pack"
        ))

        # 4. One timestep embedding per distinct noise level: float32 sinusoid, cast to time_embedder's dtype.
        temb = self.hook_time_sinusoid(ops.timestep_embedding(timestep, self.config.freq_dim, point="time_sinusoid"))
        temb = self.time_embedder(temb.to(self.time_embedder.linear_1.weight.dtype))  # (T, time_embed_dim)

        # 5. RoPE tables (S, 2*3*rope_freq_dim) float32, shared by every block. Layouts build positions in float64;
        # the released rope casts them to float32 first, so the cast sits here, before the op, in every mode.
        rotary_emb = self.rope(position_ids.to(torch.float32))

        # 6. Block stack; each row reads AdaLN table row timestep_index*3 + tag (integer index arithmetic).
        # One tensor per layout (`runtime.derived`): the strict kernels' index caches then hit across forwards, and a
        # CUDA graph capture finds the index and its validated metadata built.
        adaln_indices = runtime.derived((timestep_indices, token_tags), "adaln_indices",
                                        lambda: timestep_indices * NUM_MODALITIES + token_tags)
        for block in self.transformer_blocks:
            x = self._run_block(ops, hooks, block, x, temb, adaln_indices, rotary_emb, key_order)

        # 7. Output norm, modulated per row from the per-timestep [shift | scale] table, at the stack's precision;
        # 8. both heads over every packed row (float32 in the release: cast to proj_out's dtype), then row selection.
        x = self.norm_out(x, temb, timestep_indices).to(self.proj_out.weight.dtype)
        video = self.hook_video_head(self.proj_out(x))  # (B, S, video_patch_dim)
        audio = self.hook_audio_head(self.audio_proj_out(x))
        video = self.hook_video_out(ops.select_rows(video, video_indices, point="video_out"))  # (B, Nv, patch_dim)
        audio = self.hook_audio_out(ops.select_rows(audio, audio_indices, point="audio_out"))  # (B, Na, channels)
        return video, audio

    def _run_block(self, ops: runtime.Ops, hooks, block: nn.Module, *args) -> torch.Tensor:
        """One refiner or transformer block (called as a module, so outside code may wrap or hook it), checkpointed
        while grad is enabled and `gradient_checkpointing` is set."""
        if not (torch.is_grad_enabled() and self.gradient_checkpointing):
            return block(*args)
        calls, hook_context = [0], self.hook_context

        def replayable(*inputs) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 1:
                return block(*inputs)
            # Replay during backward (outside the forward's contexts, possibly on another thread): the same op table
            # (same mode and overrides) made current again, the same hooks seeing the forward's hook_context, but no
            # second trace.
            saved = ops.record, self.hook_context
            ops.record, self.recomputing, self.hook_context = False, True, hook_context
            try:
                with runtime.use_ops(ops), use_hooks(hooks):
                    return block(*inputs)
            finally:
                (ops.record, self.hook_context), self.recomputing = saved, False

        return torch.utils.checkpoint.checkpoint(replayable, *args, use_reentrant=False,
                                                 preserve_rng_state=context.current().checkpoint_rng)
