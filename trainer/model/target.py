"""The frozen target model: tapped layer outputs (the drafter's context features), its embedding and LM head.

Tap semantics follow docs/method.md#target-taps and the HF convention: tapping layer i means HF
`hidden_states[i+1]`, the output of decoder layer i (hidden_states[0] is the embeddings). For every layer but the
last that is the raw residual stream; HF's hidden_states[L] is the final-norm output, so tapping the last layer
(only the tiny fallback of `default_target_layer_ids` does) gives the post-norm state, exactly as HF would.

The taps are caught with forward hooks on the tapped decoder layers instead of `output_hidden_states=True`,
which would keep all L+1 states alive (36 x S x H activations for Qwen3-8B). When the final hidden state is
not needed, the forward stops right after the highest tapped layer (skips 2 of 36 layers for Qwen3-8B).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Which target decoder layers to tap: `round(1 + i*(L-4)/(n-1))`, i = 0..n-1 (docs/method.md#target-taps).

    36 layers, 5 taps -> [1, 9, 17, 25, 33]; 64, 5 -> [1, 16, 31, 46, 61]. Python's round (half to even) is
    used, as the public reference does, so ids agree with public checkpoints on every shape.
    Defined edge cases:
    - n == 1: [L // 2] (the public reference's choice).
    - tiny targets where the formula cannot give n distinct ids inside [1, L-3] (L < n + 3): spread evenly over
      all layers, `round(i*(L-1)/(n-1))`, e.g. (2, 2) -> [0, 1], (4, 2) -> [0, 3].
    - n > L, n < 1 or L < 1: ValueError.
    """
    n, num_layers = num_draft_layers, num_target_layers
    if num_layers < 1 or n < 1:
        raise ValueError(f"need at least one target layer and one tap, got L={num_layers}, n={n}")
    if n > num_layers:
        raise ValueError(
            f"cannot tap {n} distinct layers of a {num_layers}-layer target; use fewer drafter layers "
            f"or pass explicit target_layer_ids"
        )
    if n == 1:
        return [num_layers // 2]
    if num_layers >= n + 3:
        return [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    return [round(i * (num_layers - 1) / (n - 1)) for i in range(n)]


@dataclass
class TargetOutput:
    """taps [R,S,T*H] (tapped layers concatenated low layer first); final_hidden [R,S,H] post final norm, or None."""

    taps: torch.Tensor
    final_hidden: torch.Tensor | None


class _StopForward(Exception):
    """Raised from the last needed hook to skip the target layers above the highest tap."""


def _decoder_layers(model: Any) -> nn.ModuleList:
    """The decoder layer list of an HF causal LM (plain, or a multimodal wrapper with a language model inside)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for candidate in (
        decoder,
        getattr(model, "model", None),
        getattr(getattr(model, "model", None), "language_model", None),
    ):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__} (looked for .model.layers)")


def _call_layer(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """One decoder layer's own forward (TargetModel.compile_layers compiles this, with the layer as an input)."""
    return type(layer).forward(layer, *args, **kwargs)


class TargetModel:
    """A frozen HF causal LM that yields DFlash context features.

    Contract: all parameters have requires_grad=False and the model stays in eval mode; `features` runs under
    no_grad (not inference_mode: its outputs feed the drafter's autograd graph). The embedding and LM head
    weights are exposed as-is (never resized; the MASK id must already be a row of the embedding).
    Not thread safe (forward hooks are installed per call): one TargetModel per worker thread / device.
    """

    def __init__(self, model: Any, layer_ids: list[int] | None = None, *, num_draft_layers: int = 5) -> None:
        self.model = model.eval().requires_grad_(False)  # an HF causal LM
        self.hf_config = model.config
        self._decoder = model.get_decoder()
        self._layers = _decoder_layers(model)
        self.num_layers = len(self._layers)
        self.layer_ids = (
            list(layer_ids) if layer_ids is not None else default_target_layer_ids(self.num_layers, num_draft_layers)
        )
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"target has {self.num_layers} layers (ids 0..{self.num_layers - 1}) but tapped layer "
                f"id(s) {bad} were requested; check target_layer_ids / --num-draft-layers"
            )
        if sorted(set(self.layer_ids)) != self.layer_ids:
            raise ValueError(f"target_layer_ids must be strictly increasing, got {self.layer_ids}")
        self.hidden_size = int(self.embed_weight.shape[1])
        self.vocab_size = int(self.embed_weight.shape[0])

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        layer_ids: list[int] | None = None,
        *,
        num_draft_layers: int = 5,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
    ) -> TargetModel:
        """Load a local HF checkpoint directory (no network) frozen, in `dtype`, on `device`."""
        from transformers import AutoModelForCausalLM

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"target model directory {path} has no config.json (--target-model)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        return cls(model.to(device), layer_ids, num_draft_layers=num_draft_layers)  # type: ignore[arg-type]  # .to() typed by wraps()

    @classmethod
    def from_config(
        cls,
        hf_config: Any,
        layer_ids: list[int] | None = None,
        *,
        num_draft_layers: int = 5,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> TargetModel:
        """Build a randomly initialised target from an HF config (tests, speed work). Deterministic in `seed`."""
        from transformers import AutoModelForCausalLM

        # Initialised on the device itself: HF's init of an 8B-shaped model on the CPU takes minutes (bf16 normal_
        # on the CPU is slow), on the GPU well under a second. The values depend on the device's RNG, so a CPU and
        # a GPU target of the same seed differ; each is deterministic in `seed`.
        device = torch.device(device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        return cls(model, layer_ids, num_draft_layers=num_draft_layers)

    def compile_layers(self, **compile_kwargs: Any) -> None:
        """Run every decoder layer through one compiled layer call private to this target (--target-compile).

        Eager HF runs ~30 small element-wise kernels a layer (the norms in fp32, rotary, SiLU x up, the residual
        adds) between the GEMMs: the qwen3-8b-shaped target's forward at the specforge shape ran at 417 TFLOP/s
        where its GEMMs alone reach ~600 (bench/results/pipeline.md 2026-12-05 "The target's forward alone"). One call for all layers, as the drafter's
        `call_layer`: dynamo takes the layer module as an input, so the 36 layers share one graph per input shape
        instead of one each. A private copy (trainer/core/compile_scope.py), so targets in different threads never
        share a dynamo cache. The layers' forward hooks (the taps) still run: they wrap the compiled forward.
        Compiles at the first call of each shape: the pipeline warms every target before its threads start."""
        from trainer.core.compile_scope import private_compile

        call = private_compile(_call_layer, **compile_kwargs)
        for layer in self._layers:
            layer.forward = functools.partial(call, layer)

    @property
    def embed_weight(self) -> torch.Tensor:
        """[V,H] frozen input embedding (shared with the drafter)."""
        return self.model.get_input_embeddings().weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V,H] frozen LM head (shared with the drafter's loss)."""
        return self.model.get_output_embeddings().weight

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def layer(self, index: int) -> nn.Module:
        """The frozen decoder layer `index` (model/drafter.py start_from_target copies its weights)."""
        return self._layers[index]

    @property
    def final_norm(self) -> nn.Module:
        """The frozen norm before the LM head."""
        return self._decoder.norm

    def to(self, device: str | torch.device) -> TargetModel:
        self.model.to(device)
        return self

    @torch.no_grad()
    def features(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, return_final_hidden: bool = False
    ) -> TargetOutput:
        """input_ids [R,S] (right-padded), attention_mask [R,S] -> TargetOutput(taps [R,S,T*H], final_hidden)."""
        last = self.num_layers - 1
        # Tapping the last layer means HF hidden_states[L], which is post-norm: take it from the base model output.
        hooked = [i for i in self.layer_ids if i != last]
        need_full_forward = return_final_hidden or last in self.layer_ids
        stop_after = None if need_full_forward else max(self.layer_ids)
        captured: dict[int, torch.Tensor] = {}

        def make_hook(layer_id: int) -> Any:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                captured[layer_id] = output[0] if isinstance(output, tuple) else output
                if layer_id == stop_after:
                    raise _StopForward

            return hook

        handles = [self._layers[i].register_forward_hook(make_hook(i)) for i in hooked]
        final_hidden = None
        try:
            out = self._decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            final_hidden = out.last_hidden_state  # [R,S,H] after the final norm
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if last in self.layer_ids:
            assert final_hidden is not None  # no layer stops the forward when the last one is tapped
            captured[last] = final_hidden
        taps = torch.cat([captured[i] for i in self.layer_ids], dim=-1)  # [R,S,T*H], low layer first
        return TargetOutput(taps=taps, final_hidden=final_hidden if return_final_hidden else None)
