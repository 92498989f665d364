"""The speculators form of an export (`python -m trainer export --format speculators`): a drafter that vLLM's
`speculators` library (checked against 0.9.0) loads with `DFlashDraftModel.from_pretrained(DIR)`.

What differs from the z-lab form (docs/method.md#export-formats):
- `config.json` is a `DFlashSpeculatorConfig`: the drafter's Qwen3 shape under `transformer_layer_config`, and
  `aux_hidden_state_layer_ids`, `block_size`, `mask_token_id`, `draft_vocab_size`, `sliding_window_non_causal`,
  `speculators_config` (algorithm, greedy proposal of B-1 tokens, the verifier) at the top level.
- A tap is written as a speculators layer id, `target_layer_id + 1` (`speculators_layer_ids`): speculators counts
  HF `hidden_states` indices (0 = the embeddings), z-lab and this trainer count decoder layers. Every tap is
  written, a tap on the target's last layer too (speculators' own z-lab converter drops that one by default).
- It is self-contained: besides the 11 * layers + 3 drafter tensors, `model.safetensors` holds the target's
  embedding (`embed_tokens.weight`), LM head (`lm_head.weight`) and final norm (`verifier_norm.weight`).
  `verifier_lm_head.weight` (a second copy of the LM head that speculators uses only for training targets, and
  never saves itself) is left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.data.tokenizer_utils import DataInputError
from trainer.export.export_names import public_tensor_names
from trainer.model.attention import FULL, SLIDING
from trainer.model.drafter import CONFIG_NAME, WEIGHTS_NAME, DFlashDrafter, DrafterConfig

SPECULATORS_VERSION = "0.9.0"  # the release whose loader tests/trainer/test_export_speculators.py runs
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_norm.weight")

# Where a target checkpoint keeps each part (plain causal LMs first, then multimodal wrappers' language models).
EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_NAMES = ("lm_head.weight", "model.language_model.lm_head.weight")
NORM_NAMES = ("model.norm.weight", "model.language_model.norm.weight")


def speculators_layer_ids(target_layer_ids: list[int]) -> list[int]:
    """Our tap ids (decoder layer i, whose output is HF `hidden_states[i+1]`) -> speculators'
    `aux_hidden_state_layer_ids` (HF `hidden_states` indices): i + 1 each, none dropped."""
    return [int(i) + 1 for i in target_layer_ids]


def speculators_tensor_names(num_layers: int, arch: str = "dflash") -> list[str]:
    """Every tensor of a speculators-form export: the z-lab names (of `arch`) plus the three target parts."""
    return public_tensor_names(num_layers, arch) + list(TARGET_TENSORS)


@dataclass
class TargetParts:
    """The target's embedding [V,H], LM head [V,H] and final-norm weight [H], as stored by the target."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: torch.Tensor
    architectures: list[str]

    def check(self, config: DrafterConfig) -> None:
        """DataInputError unless these parts fit the drafter (vocabulary and hidden size)."""
        shape = (config.vocab_size, config.hidden_size)
        for name, tensor, want in (
            ("embedding", self.embed, shape),
            ("LM head", self.lm_head, shape),
            ("final norm", self.norm, (config.hidden_size,)),
        ):
            if tuple(tensor.shape) != want:
                raise DataInputError(
                    f"the target's {name} has shape {tuple(tensor.shape)}, the drafter needs {want}",
                    hint="pass the --target-model the drafter was trained against",
                )


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded through the index, or one model.safetensors)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / WEIGHTS_NAME
    if not single.is_file():
        raise DataInputError(
            f"target model {directory} has no model.safetensors(.index.json)",
            hint="--target-model takes a local Hugging Face model directory with safetensors weights",
        )
    from safetensors import safe_open

    with safe_open(str(single), "pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def target_parts_from_dir(directory: str | Path) -> TargetParts:
    """Read only the embedding, LM head (the embedding when tied) and final norm of a local HF model directory;
    the decoder layers are never loaded (an 8B target's three parts are ~2.5 GB of its 16)."""
    from safetensors import safe_open

    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise DataInputError(
            f"target model {directory} is not a model directory (no config.json)",
            hint="--target-model takes a local Hugging Face model directory",
        )
    hf_config = json.loads(config_file.read_text())
    files = _weight_files(directory)

    def read(candidates: tuple[str, ...]) -> torch.Tensor | None:
        name = next((n for n in candidates if n in files), None)
        if name is None:
            return None
        with safe_open(str(files[name]), "pt") as handle:
            return handle.get_tensor(name)

    embed, lm_head, norm = read(EMBED_NAMES), read(LM_HEAD_NAMES), read(NORM_NAMES)
    text_config = hf_config.get("text_config") or hf_config
    if lm_head is None and (text_config.get("tie_word_embeddings") or hf_config.get("tie_word_embeddings")):
        lm_head = embed  # a tied head is the embedding itself
    if embed is None or lm_head is None or norm is None:
        missing = [what for what, t in (("embedding", embed), ("LM head", lm_head), ("final norm", norm)) if t is None]
        raise DataInputError(
            f"target model {directory}: cannot find its {', '.join(missing)} "
            f"(looked for {EMBED_NAMES + LM_HEAD_NAMES + NORM_NAMES})"
        )
    return TargetParts(embed, lm_head, norm, list(hf_config.get("architectures") or []))


def target_parts_from_model(model: Any) -> TargetParts:
    """The embedding, LM head and final norm of an HF causal LM in memory (a tiny-preset target rebuilt from its
    run's recorded config: trainer/export/export.py rebuilt_tiny_target)."""
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        raise DataInputError(f"cannot find the final norm of {type(model).__name__} (looked for .model.norm)")
    return TargetParts(
        model.get_input_embeddings().weight.detach(),
        model.get_output_embeddings().weight.detach(),
        norm.weight.detach(),
        list(getattr(model.config, "architectures", None) or [type(model).__name__]),
    )


def speculators_config(
    config: DrafterConfig, *, verifier: str | None, verifier_architectures: list[str], dtype: torch.dtype
) -> dict[str, Any]:
    """The `DFlashSpeculatorConfig` dict (speculators 0.9 field names and types) for a drafter.

    Full-attention layers are always bidirectional inside the block in speculators, so a drafter trained with
    `causal_in_block.full_attention` cannot be expressed: DataInputError. `sliding_window_non_causal` is the
    inverse of our `causal_in_block.sliding_attention`."""
    if config.causal_in_block[FULL]:
        raise DataInputError(
            "this drafter's full-attention layers are causal inside the block; speculators' DFlash model only "
            "has bidirectional full-attention blocks",
            hint="export it with --format zlab (its config records causal_in_block)",
        )
    hf = config.to_hf_dict()
    layer_config = {
        key: hf[key]
        for key in (
            "model_type",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "hidden_act",
            "attention_bias",
            "attention_dropout",
            "rms_norm_eps",
            "rope_parameters",
            "vocab_size",
            "max_position_embeddings",
            "initializer_range",
            "tie_word_embeddings",
            "layer_types",
            "sliding_window",
            "use_sliding_window",
        )
    }
    dflash2 = config.arch == "dflash2"
    return {
        "architectures": ["DFlash2DraftModel" if dflash2 else "DFlashDraftModel"],
        "speculators_model_type": config.arch,  # "dflash" | "dflash2" (DFlash2SpeculatorConfig)
        **config.dflash2_fields(),  # conv_kernel_size, conv_group_size, selector_rank, selector_top_k
        "speculators_version": SPECULATORS_VERSION,
        "dtype": str(dtype).removeprefix("torch."),
        "transformer_layer_config": layer_config,
        "draft_vocab_size": config.vocab_size,  # the full vocabulary: no t2d/d2t mapping
        "target_hidden_size": None,  # the drafter's hidden size is the target's
        "block_size": config.block_size,
        "aux_hidden_state_layer_ids": speculators_layer_ids(config.target_layer_ids),
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": not config.causal_in_block[SLIDING],
        "sample_from_anchor": False,  # slot 0 is the anchor (the bonus token); slots 1..B-1 are drafted
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": config.arch,
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": config.block_size - 1,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }


def save_speculators(drafter: DFlashDrafter, parts: TargetParts, directory: Path, *, verifier: str | None) -> None:
    """Write config.json + model.safetensors of the speculators form into `directory` (made if absent).
    Every tensor is stored in the drafter's dtype: the target's parts are cast to it (bf16 -> fp32 is exact)."""
    from safetensors.torch import save_file

    config = drafter.config
    parts.check(config)
    dtype = next(drafter.parameters()).dtype
    tensors = {name: t.detach().contiguous().cpu() for name, t in drafter.state_dict().items()}
    for name, tensor in zip(TARGET_TENSORS, (parts.embed, parts.lm_head, parts.norm)):
        tensors[name] = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
    # A target with tied embeddings (SmolLM2, Llama-3.2-1B) hands the same tensor as embedding and LM head, which
    # safetensors refuses to store twice; the speculators form keeps both (its config says untied), so the head is
    # a copy of the same values.
    head, embed = tensors[TARGET_TENSORS[1]], tensors[TARGET_TENSORS[0]]
    if head.untyped_storage().data_ptr() == embed.untyped_storage().data_ptr():
        tensors[TARGET_TENSORS[1]] = head.clone()
    assert sorted(tensors) == sorted(speculators_tensor_names(config.num_hidden_layers, config.arch))
    directory.mkdir(parents=True, exist_ok=True)
    text = speculators_config(config, verifier=verifier, verifier_architectures=parts.architectures, dtype=dtype)
    (directory / CONFIG_NAME).write_text(json.dumps(text, indent=2) + "\n")
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})


__all__ = [
    "SPECULATORS_VERSION",
    "TARGET_TENSORS",
    "TargetParts",
    "speculators_layer_ids",
    "speculators_tensor_names",
    "target_parts_from_dir",
    "speculators_config",
    "save_speculators",
]
