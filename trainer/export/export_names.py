"""The tensor names of an exported drafter, shared by both export forms (trainer/export/export.py writes and checks the
z-lab form, trainer/export/export_speculators.py adds the target's parts): a module below both, so neither imports the
other back.
"""

from __future__ import annotations

LAYER_TENSORS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
TOP_TENSORS = ("norm.weight", "fc.weight", "hidden_norm.weight")
# DFlash2's additions (speculators' names, trainer/model/dflash2.py): 4 per layer, 3 for the selector
DFLASH2_LAYER_TENSORS = tuple(
    f"{conv}.{name}" for conv in ("attention_conv", "mlp_conv") for name in ("base_kernel", "kernel_projection.weight")
)
DFLASH2_TOP_TENSORS = tuple(
    f"candidate_selector.{name}" for name in ("predecessor_codebook", "successor_codebook", "hidden_projection.weight")
)


def public_tensor_names(num_layers: int, arch: str = "dflash") -> list[str]:
    """The exact tensor names of a public DFlash drafter with `num_layers` layers (11 * layers + 3), or of a
    DFlash2 drafter (15 * layers + 6)."""
    per_layer = LAYER_TENSORS + (DFLASH2_LAYER_TENSORS if arch == "dflash2" else ())
    top = TOP_TENSORS + (DFLASH2_TOP_TENSORS if arch == "dflash2" else ())
    return [f"layers.{i}.{name}" for i in range(num_layers) for name in per_layer] + list(top)
