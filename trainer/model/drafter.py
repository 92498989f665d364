"""The DFlash drafter (docs/method.md#drafter-model), in one readable file.

    taps [R,S,T*H] --fc--> [R,S,H] --hidden_norm--> ctx [R,S,H]             (computed once, shared by all layers)
    block_embeds [R,N*B,H] = embed([x_anchor, MASK, ..., MASK] per block)   (frozen target embedding, outside)
    for each layer:  x = x + attn(input_layernorm(x), ctx)                    queries: block tokens only
                     x = x + mlp(post_attention_layernorm(x))                 the context is never updated
    hidden = norm(x) [R,N*B,H]  -> the frozen target LM head (the loss, outside)

KV injection: every layer's keys/values are [k_proj(ctx) ; k_proj(block)] (context first), k_norm applied to
both, RoPE at absolute positions (context at 0..S-1, block n's token j at anchors[n]+j). The attention mask
(which context each block sees, in-block causality, sliding windows) lives in attention.py.

State-dict names are exactly the public DFlash checkpoint names (no embedding, no lm_head, no buffers):
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`,
`norm.weight`, `fc.weight`, `hidden_norm.weight`: 11 per layer + 3.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from trainer.model.attention import FULL, LAYER_TYPES, SLIDING, Backend, DraftMask, attend, build_draft_mask
from trainer.model.dflash2 import ARCHS, BlockConv, CandidateSelector
from trainer.model.target import default_target_layer_ids

CONFIG_NAME = "config.json"
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
WEIGHTS_NAME = "model.safetensors"


def _default_causal_in_block() -> dict[str, bool]:
    # The public reference: full layers bidirectional inside the block, sliding layers causal
    # (docs/method.md#drafter-model).
    return {FULL: False, SLIDING: True}


@dataclass
class DrafterConfig:
    """Shape and DFlash settings of a drafter; `validate()` runs on construction and raises ValueError."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    layer_types: list[str] = field(default_factory=list)  # empty -> all "full_attention"
    sliding_window: int | None = None
    causal_in_block: dict[str, bool] = field(default_factory=_default_causal_in_block)
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    # DFlash2 (trainer/model/dflash2.py): "dflash2" adds the block convolutions and the candidate selector
    arch: str = "dflash"
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.causal_in_block = {**_default_causal_in_block(), **self.causal_in_block}
        self.validate()

    def validate(self) -> None:
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "num_target_layers",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"drafter {name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor plus at least one MASK slot), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"(0..{self.vocab_size - 1}); use a reserved id that exists in the target's "
                f"embedding (never resize it)"
            )
        ids = self.target_layer_ids
        if not ids or sorted(set(ids)) != ids:
            raise ValueError(f"target_layer_ids must be a non-empty strictly increasing list, got {ids}")
        if ids[0] < 0 or ids[-1] >= self.num_target_layers:
            raise ValueError(f"target_layer_ids {ids} do not fit a {self.num_target_layers}-layer target")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for lt in self.layer_types:
            if lt not in LAYER_TYPES:
                raise ValueError(f"unknown layer type {lt!r}; expected one of {LAYER_TYPES}")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < self.block_size):
            raise ValueError(
                f"sliding layers need sliding_window >= block_size ({self.block_size}), got {self.sliding_window}"
            )
        unknown = set(self.causal_in_block) - set(LAYER_TYPES)
        if unknown:
            raise ValueError(f"causal_in_block has unknown layer types {sorted(unknown)}")
        if self.arch not in ARCHS:
            raise ValueError(f"unknown drafter arch {self.arch!r}; expected one of {ARCHS}")
        if self.arch == "dflash2":
            if not 1 <= self.conv_kernel_size <= self.block_size:
                raise ValueError(
                    f"conv_kernel_size must be 1..block_size ({self.block_size}), got {self.conv_kernel_size}"
                )
            if self.conv_group_size < 1 or self.hidden_size % self.conv_group_size:
                raise ValueError(
                    f"conv_group_size must divide hidden_size ({self.hidden_size}), got {self.conv_group_size}"
                )
            if self.selector_rank < 1:
                raise ValueError(f"selector_rank must be >= 1, got {self.selector_rank}")
            if not 1 <= self.selector_top_k <= self.vocab_size:
                raise ValueError(f"selector_top_k must be 1..vocab_size ({self.vocab_size}), got {self.selector_top_k}")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def check_target(self, *, num_target_layers: int, hidden_size: int, vocab_size: int) -> None:
        """Raise ValueError unless this drafter fits a target of the given shape."""
        if hidden_size != self.hidden_size:
            raise ValueError(
                f"drafter hidden_size {self.hidden_size} != target hidden size {hidden_size}: "
                f"the drafter shares the target's embedding and LM head"
            )
        if self.target_layer_ids[-1] >= num_target_layers:
            raise ValueError(f"target has {num_target_layers} layers but the drafter taps {self.target_layer_ids}")
        if num_target_layers != self.num_target_layers:
            raise ValueError(
                f"drafter was configured for a {self.num_target_layers}-layer target, "
                f"this target has {num_target_layers}"
            )
        if vocab_size != self.vocab_size or not 0 <= self.mask_token_id < vocab_size:
            raise ValueError(
                f"drafter vocab_size {self.vocab_size} / mask_token_id {self.mask_token_id} do not fit "
                f"the target's {vocab_size}-row embedding"
            )

    @classmethod
    def for_target(
        cls,
        target: Any,
        *,
        num_hidden_layers: int,
        block_size: int,
        mask_token_id: int,
        target_layer_ids: list[int] | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        causal_in_block: dict[str, bool] | None = None,
    ) -> DrafterConfig:
        """A drafter shaped like the target (as the published drafters are). `target` is a TargetModel or an HF
        config. Taps default to `default_target_layer_ids(L, num_hidden_layers)`."""
        hf = getattr(target, "hf_config", target)
        hf = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        heads = hf.num_attention_heads
        rope = getattr(hf, "rope_parameters", None) or {}
        num_target_layers = getattr(target, "num_layers", hf.num_hidden_layers)
        config = cls(
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            vocab_size=getattr(target, "vocab_size", hf.vocab_size),
            block_size=block_size,
            target_layer_ids=target_layer_ids or default_target_layer_ids(num_target_layers, num_hidden_layers),
            num_target_layers=num_target_layers,
            mask_token_id=mask_token_id,
            rms_norm_eps=getattr(hf, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 1_000_000.0))),
            layer_types=list(layer_types or []),
            sliding_window=sliding_window,
            causal_in_block=dict(causal_in_block or {}),
            max_position_embeddings=getattr(hf, "max_position_embeddings", 40960),
        )
        config.check_target(
            num_target_layers=num_target_layers, hidden_size=hf.hidden_size, vocab_size=config.vocab_size
        )
        return config

    def dflash2_fields(self) -> dict[str, int]:
        """The four DFlash2 settings under speculators' field names (empty for a DFlash drafter)."""
        if self.arch != "dflash2":
            return {}
        return {
            "conv_kernel_size": self.conv_kernel_size,
            "conv_group_size": self.conv_group_size,
            "selector_rank": self.selector_rank,
            "selector_top_k": self.selector_top_k,
        }

    def to_hf_dict(self) -> dict[str, Any]:
        """The public config.json: a Qwen3 config plus the DFlash fields the public loaders read (a DFlash2
        drafter: `DFlash2DraftModel`, and `arch` plus its four settings in `dflash_config`)."""
        extra: dict[str, Any] = {"arch": self.arch, **self.dflash2_fields()} if self.arch != "dflash" else {}
        return {
            "architectures": ["DFlash2DraftModel" if self.arch == "dflash2" else "DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "tie_word_embeddings": False,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": SLIDING in self.layer_types,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "target_layer_ids": list(self.target_layer_ids),
                "mask_token_id": self.mask_token_id,
                "block_size": self.block_size,
                "causal_in_block": dict(self.causal_in_block),
                **extra,
            },
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        """Inverse of to_hf_dict; also reads public DFlash configs (rope_theta at top level or in rope_parameters,
        target_layer_ids derived from num_target_layers when absent). Unrelated HF keys are ignored."""
        dflash = d.get("dflash_config") or {}
        try:
            num_layers, num_target_layers = int(d["num_hidden_layers"]), int(d["num_target_layers"])
            heads = int(d["num_attention_heads"])
            # int(None) of a missing field raises the TypeError reported below
            block_size = int(d.get("block_size", dflash.get("block_size")))  # type: ignore[arg-type]
            mask_token_id = int(dflash.get("mask_token_id", d.get("mask_token_id")))  # type: ignore[arg-type]
            rope = d.get("rope_parameters") or {}
            return cls(
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=num_layers,
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
                vocab_size=int(d["vocab_size"]),
                block_size=block_size,
                target_layer_ids=list(
                    dflash.get("target_layer_ids") or default_target_layer_ids(num_target_layers, num_layers)
                ),
                num_target_layers=num_target_layers,
                mask_token_id=mask_token_id,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta") or rope.get("rope_theta", 1_000_000.0)),
                layer_types=list(d.get("layer_types") or []),
                sliding_window=d.get("sliding_window"),
                causal_in_block=dict(dflash.get("causal_in_block") or {}),
                max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
                initializer_range=float(d.get("initializer_range", 0.02)),
                arch=str(dflash.get("arch", "dflash")),
                **{k: int(dflash[k]) for k in _DFLASH2_KEYS if k in dflash},
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a DFlash drafter config (missing or invalid field: {exc})") from exc


# ----------------------------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in float32, scale in the input dtype (bit-compatible with HF Qwen3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.parts(x)[0]

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normalised x in x's dtype, before the weight; the per-row rstd [..., 1] in float32): DFlash2's input
        convolution (dflash2.NormedConv) recomputes them from x and rstd in its backward."""
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * rstd).to(x.dtype), rstd


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] int -> cos, sin [..., head_dim] in float32 (HF 'default' RoPE, half-rotation layout).
    inv_freq is recomputed here rather than kept as a buffer: a buffer would be cast to bf16 by module.to()."""
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponent)  # [D/2]
    freqs = positions[..., None].float() * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [R,h,L,D], cos/sin [R,1,L,D] float32 (cast to x's dtype first, as HF does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DrafterAttention(nn.Module):
    """Queries from the block tokens; keys/values from [context ; block tokens] (KV injection)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor | tuple[torch.Tensor, ...],
        ctx: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
        mask: DraftMask,
        layer_type: str,
    ) -> torch.Tensor:
        # x: normed block tokens [R,Q,H], or DFlash2's three views of them, for q, k and v (BlockConv.prepare)
        xq, xk, xv = x if isinstance(x, tuple) else (x, x, x)
        R, Q, _ = xq.shape
        S = ctx.shape[1]  # ctx: context features [R,S,H]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(xq).view(R, Q, hq, d)).transpose(1, 2)  # [R,hq,Q,D]
        # Context re-projected by this layer's own k/v; k_norm on context keys too. Separate GEMMs + cat of the
        # (narrower, GQA) k/v rather than one GEMM over cat([ctx, x]): the cat copies hkv*d instead of H columns.
        # (q/k/v as one GEMM over concatenated weights was measured: no net gain, bench/results/step.md 2026-12-02 "The last 8-15 ms of the 8B seed step".)
        k = torch.cat([self.k_proj(ctx).view(R, S, hkv, d), self.k_proj(xk).view(R, Q, hkv, d)], dim=1)
        v = torch.cat([self.v_proj(ctx).view(R, S, hkv, d), self.v_proj(xv).view(R, Q, hkv, d)], dim=1)
        k = self.k_norm(k).transpose(1, 2)  # [R,hkv,S+Q,D]
        v = v.transpose(1, 2)  # [R,hkv,S+Q,D]
        q, k = apply_rope(q, *rope_q), apply_rope(k, *rope_k)
        out = attend(q, k, v, mask, layer_type)  # [R,hq,Q,D]
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, hq * d))


class DrafterMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
        xg, xu = x if isinstance(x, tuple) else (x, x)  # DFlash2: one view for each GEMM (BlockConv.prepare)
        return self.down_proj(F.silu(self.gate_proj(xg)) * self.up_proj(xu))


class DrafterLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer over the block tokens; the context only enters through attention's k/v."""

    def __init__(self, cfg: DrafterConfig, layer_type: str) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention_conv: BlockConv | None = None
        self.mlp_conv: BlockConv | None = None
        if cfg.arch == "dflash2":
            conv = {
                "block_size": cfg.block_size,
                "kernel_size": cfg.conv_kernel_size,
                "group_size": cfg.conv_group_size,
            }
            self.attention_conv = BlockConv(cfg.hidden_size, **conv)
            self.mlp_conv = BlockConv(cfg.hidden_size, **conv)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_k: tuple[torch.Tensor, torch.Tensor],
        mask: DraftMask,
    ) -> torch.Tensor:
        if self.attention_conv is None or self.mlp_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask, self.layer_type)
            return x + self.mlp(self.post_attention_layernorm(x))
        # DFlash2: the block convolution around each sublayer (its input after the norm, its output before the add)
        # (fanout: one view of the convolved input per GEMM that reads it, q/k/v and gate/up: BlockConv.prepare)
        h, delta = self.attention_conv.prepare(x, self.input_layernorm, fanout=3)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, rope_q, rope_k, mask, self.layer_type), delta)
        h, delta = self.mlp_conv.prepare(x, self.post_attention_layernorm, fanout=2)
        return x + self.mlp_conv.finish(self.mlp(h), delta)


# ---------------------------------------------------------------------------------------------------- the model


def call_layer(
    layer: nn.Module,
    x: torch.Tensor,
    ctx: torch.Tensor,
    rope_q: tuple[torch.Tensor, torch.Tensor],
    rope_k: tuple[torch.Tensor, torch.Tensor],
    mask: DraftMask,
) -> torch.Tensor:
    """One layer's forward; the unit a replica compiles (all layers of one type share its graph)."""
    return layer(x, ctx, rope_q, rope_k, mask)


def embed_context(fc: nn.Module, hidden_norm: nn.Module, ctx_features: torch.Tensor) -> torch.Tensor:
    """taps [R,S,T*H] -> ctx [R,S,H] in fc's output dtype: the unit a replica compiles for the context (the fc
    GEMM plus one fused norm; eager, the norm alone is ~7 passes over a [R*S, H] fp32 copy forward and more
    backward).

    The cast back: RMSNorm's fp32 weight promotes its output to fp32, but ctx only feeds the layers' k/v
    projections, which autocast casts to bf16 anyway, so a bf16 ctx gives the same forward bit for bit and
    halves ctx's memory (qwen3-8b seed: 0.8 -> 0.4 GB) and the traffic of its gradient, which autograd sums
    over the layers outside any compiled graph (measured: 2.2 ms per step of fp32 adds)."""
    features = fc(ctx_features)
    return hidden_norm(features).to(features.dtype)


def finish_hidden(norm: nn.Module, x: torch.Tensor, keep: torch.Tensor, block_size: int) -> torch.Tensor:
    """The final norm, with padded blocks' rows zeroed (nothing downstream may depend on their arbitrary
    anchors): x [R,N*B,H], keep [R,N] -> [R,N*B,H]. Compiled per replica like embed_context."""
    x = norm(x)
    return x * keep.repeat_interleave(block_size, dim=1)[:, :, None].to(x.dtype)


class DFlashDrafter(nn.Module):
    """The trainable drafter: layers, fc, hidden_norm, norm. Embedding and LM head belong to the target."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DrafterLayer(config, lt) for lt in config.layer_types)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(config.num_taps * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.candidate_selector: CandidateSelector | None = None
        if config.arch == "dflash2":
            self.candidate_selector = CandidateSelector(
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                rank=config.selector_rank,
                top_k=config.selector_top_k,
                init_std=config.initializer_range,
            )
        # Training-time memory option (not part of the checkpoint format): recompute layer activations in backward.
        self.activation_checkpointing = False
        # How a layer is called: plain by default; a replica's trainer installs its private compiled copy of
        # `call_layer` (trainer/core/compile_scope.py: one dynamo cache per replica, never shared across threads).
        self.layer_call: Callable[..., torch.Tensor] = call_layer
        self.context_call: Callable[..., torch.Tensor] = embed_context
        self.output_call: Callable[..., torch.Tensor] = finish_hidden
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """HF-style init (normal(0, initializer_range) linears, unit norms); draws from torch's global RNG. A
        drafter built on the meta device (for its shapes: preflight.expected_shapes) has no values to draw, and
        the first normal_ on a meta tensor costs ~1.4 s of CPU (torch loads its reference ops): skipped."""
        if self.fc.weight.is_meta:
            return
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        for module in self.modules():  # DFlash2's own inits after the generic one: identity convolutions
            if isinstance(module, (BlockConv, CandidateSelector)):
                module.reset_parameters()

    def build_mask(
        self,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        ctx_len: int,
        *,
        backend: Backend = "dense",
        doc_ids: torch.Tensor | None = None,
    ) -> DraftMask:
        """build_draft_mask with this drafter's block size, window, in-block causality and layer types."""
        cfg = self.config
        return build_draft_mask(
            anchors,
            keep,
            ctx_len,
            cfg.block_size,
            sliding_window=cfg.sliding_window,
            causal_full=cfg.causal_in_block[FULL],
            causal_sliding=cfg.causal_in_block[SLIDING],
            backend=backend,
            doc_ids=doc_ids,
            layer_types=cfg.layer_types,
        )

    def forward(
        self,
        ctx_features: torch.Tensor,
        block_embeds: torch.Tensor,
        anchors: torch.Tensor,
        keep: torch.Tensor,
        mask: DraftMask | Backend,
    ) -> torch.Tensor:
        """ctx_features [R,S,T*H], block_embeds [R,N*B,H], anchors [R,N] int64, keep [R,N] bool, and either the
        mask built for the same anchors/keep/S or the back-end to build it for ("flex" | "dense") -> hidden
        [R,N*B,H] after the final norm; rows of padded blocks are exactly 0.

        Given a back-end, the mask is built here after the context's fc GEMM has been queued: the build is
        host-bound (~2-3 ms at the 8B seed shape, bench attention's `build ms`), and a training step starts with
        the GPU idle after the last step's sync, so the GPU now runs the fc GEMM (~10 ms) meanwhile."""
        cfg = self.config
        R, S, F_in = ctx_features.shape
        N, B = anchors.shape[1], cfg.block_size
        if F_in != cfg.num_taps * cfg.hidden_size:
            raise ValueError(f"ctx_features has {F_in} features, expected {cfg.num_taps} taps x {cfg.hidden_size}")
        if block_embeds.shape != (R, N * B, cfg.hidden_size):
            raise ValueError(f"block_embeds must be {(R, N * B, cfg.hidden_size)}, got {tuple(block_embeds.shape)}")

        ctx = self.context_call(self.fc, self.hidden_norm, ctx_features)  # [R,S,H], never updated below
        if isinstance(mask, str):
            mask = self.build_mask(anchors, keep, S, backend=mask)
        if (mask.ctx_len, mask.num_blocks, mask.block_size) != (S, N, B):
            raise ValueError(
                f"mask was built for S={mask.ctx_len}, N={mask.num_blocks}, B={mask.block_size}; "
                f"inputs have S={S}, N={N}, B={B}"
            )
        offsets = torch.arange(B, device=anchors.device)
        pos_blk = (anchors[:, :, None] + offsets).reshape(R, N * B)  # [R,Q]  anchor+j
        pos_ctx = torch.arange(S, device=anchors.device)  # [S]    0..S-1
        cos_q, sin_q = rope_cos_sin(pos_blk, cfg.head_dim, cfg.rope_theta)  # [R,Q,D]
        cos_c, sin_c = rope_cos_sin(pos_ctx, cfg.head_dim, cfg.rope_theta)  # [S,D]
        rope_q = (cos_q[:, None], sin_q[:, None])  # [R,1,Q,D]
        rope_k = (
            torch.cat([cos_c.expand(R, 1, S, -1), rope_q[0]], dim=2),  # [R,1,S+Q,D]
            torch.cat([sin_c.expand(R, 1, S, -1), rope_q[1]], dim=2),
        )

        x = block_embeds  # [R,Q,H]
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Keep only each layer's input; recompute its activations in backward (~1/3 more layer FLOPs).
                x = torch.utils.checkpoint.checkpoint(
                    self.layer_call, layer, x, ctx, rope_q, rope_k, mask, use_reentrant=False
                )
            else:
                x = self.layer_call(layer, x, ctx, rope_q, rope_k, mask)
        return self.output_call(self.norm, x, keep, B)

    # ------------------------------------------------------------------------------------- public checkpoint I/O

    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json + model.safetensors in the public DFlash format (25 tensors for 2 layers; DFlash2 adds
        4 per layer and 3 for the selector)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_NAME).write_text(json.dumps(self.config.to_hf_dict(), indent=2) + "\n")
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> DFlashDrafter:
        """Load a public-format drafter; ValueError on missing files or tensors of the wrong name/shape."""
        from safetensors.torch import load_file

        directory = Path(directory)
        if not (directory / CONFIG_NAME).is_file() or not (directory / WEIGHTS_NAME).is_file():
            raise ValueError(f"{directory} is not a drafter checkpoint (needs {CONFIG_NAME} and {WEIGHTS_NAME})")
        model = cls(DrafterConfig.from_hf_dict(json.loads((directory / CONFIG_NAME).read_text())))
        state = load_file(str(directory / WEIGHTS_NAME), device=str(device))
        own = model.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        wrong = [n for n in own if n in state and state[n].shape != own[n].shape]
        if missing or unexpected or wrong:
            raise ValueError(
                f"drafter checkpoint {directory} does not match its config: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}, wrong shape {wrong[:3]}"
            )
        model.load_state_dict(state)
        return model.to(device)


def make_block_input_ids(
    input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> torch.Tensor:
    """[x_anchor, MASK, ..., MASK] per block: input_ids [R,S], anchors [R,N] -> [R,N*B] int64.
    Padded anchors only need to be inside 0..S-1 (their blocks are masked out)."""
    R, N = anchors.shape
    ids = torch.full((R, N, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = torch.gather(input_ids, 1, anchors.clamp(0, input_ids.shape[1] - 1))
    return ids.reshape(R, N * block_size)


__all__ = [
    "DrafterConfig",
    "DFlashDrafter",
    "make_block_input_ids",
    "RMSNorm",
    "rope_cos_sin",
    "apply_rope",
    "call_layer",
    "embed_context",
    "finish_hidden",
]


@torch.no_grad()
def calibrated_output_norm(
    drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, mask_token_id: int
) -> float:
    """Set the final norm's weight (every element) so that a normalised hidden state along the MASK token's
    embedding gives logits of standard deviation 1 through the LM head; returns the value.

    Why: at init the block's residual stream is mostly the MASK embedding, which flows through the final norm
    to the LM head. Where the target's embeddings are anisotropic (SmolLM2-135M: rows share a mean of norm 2.2
    out of 3.2, tied to the LM head), that direction gives logits of std ~16 at weight 1, a first loss of ~55
    and gradient norms in the hundreds, which the clip then turns into a slow start; a random direction gives
    std ~2.4. Computed from frozen weights, one GEMV: no data, any target."""
    direction = embed_weight[mask_token_id].float()
    direction = direction / direction.pow(2).mean().sqrt().clamp_min(1e-12)
    spread = float((lm_head_weight.float() @ direction).std())
    value = 1.0 / max(spread, 1e-6)
    drafter.norm.weight.fill_(value)
    return value


def init_output_norm(
    drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, cfg: Any
) -> None:
    """`--output-norm-init calibrated` for a freshly initialised drafter (never a resumed or --init-from one)."""
    value = calibrated_output_norm(
        drafter,
        embed_weight.to(drafter.norm.weight.device),
        lm_head_weight.to(drafter.norm.weight.device),
        cfg.mask_token_id,
    )
    print(
        f"drafter output norm initialised to {value:.4f} (--output-norm-init calibrated)", file=sys.stderr, flush=True
    )


# A draft layer's weights and the target layer's of the same name (Qwen3 and Llama decoder layers); Qwen3's q/k norms
# are copied where the target has them (Llama has none: the drafter's stay ones).
LAYER_WEIGHTS = (
    *(f"self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj")),
    *(f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")),
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
OPTIONAL_LAYER_WEIGHTS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


@torch.no_grad()
def start_from_target(drafter: DFlashDrafter, target: Any) -> str:
    """`--drafter-init target`: draft layer i starts as the target's layer d + 1 + i, where d is the deepest tap;
    the final norm as the target's final norm; `fc` as the identity on the deepest tap's slice of the taps (zeros on
    the others) and `hidden_norm` as layer d + 1's input norm, so that the context's keys and values are that
    layer's own. DFlash2's convolutions and selector keep their identity init. Returns the line to log.

    Why: at `make demo-real`'s budget (512 answers, 400 steps) the drafter is limited by how fast it learns, not by
    its size; the target's last layers already map the residual stream to the next tokens (bench/results/quality.md
    2026-12-07 "`make demo-real`'s drafter started from the target's last layers"). `target`: a TargetModel (its
    `layer(i)` and `final_norm`); shapes were checked by the pre-flight (preflight.check_target_start)."""
    cfg = drafter.config
    deepest = max(cfg.target_layer_ids)
    for i, layer in enumerate(drafter.layers):
        source = target.layer(deepest + 1 + i)
        theirs = dict(source.named_parameters())
        for name in (*LAYER_WEIGHTS, *(n for n in OPTIONAL_LAYER_WEIGHTS if n in theirs)):
            if name not in theirs:
                raise ValueError(f"--drafter-init target: the target's layer {deepest + 1 + i} has no {name}")
            layer.get_parameter(name).copy_(theirs[name])
    drafter.norm.weight.copy_(target.final_norm.weight)
    slot, hidden = cfg.target_layer_ids.index(deepest), cfg.hidden_size
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, slot * hidden : (slot + 1) * hidden].copy_(torch.eye(hidden))
    drafter.hidden_norm.weight.copy_(target.layer(deepest + 1).input_layernorm.weight)
    first, last = deepest + 1, deepest + len(drafter.layers)
    layers = f"layer {first}" if first == last else f"layers {first}-{last}"
    return f"drafter init: the target's {layers} and final norm; fc reads tap {deepest} (--drafter-init target)"
