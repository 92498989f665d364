"""Run by the speculators environment (speculators_env.py), not by pytest: load an export with speculators' own
loader and compute its draft logits on a fixed batch.

    python speculators_forward.py EXPORT_DIR BATCH.pt OUT.pt

BATCH.pt holds `hidden_states` [1,S,T*H] (the target's tapped features), `input_ids` [1,S], `loss_mask` [1,S]
(1 exactly at the anchors, so speculators' random anchor choice has one outcome) and `num_anchors`.

The export is loaded twice with `DFlashDraftModel.from_pretrained`:
- `alone`, with `output_loading_info=True`: the loader's key report. On that path speculators 0.9 skips its
  verifier fill (its from_pretrained receives a (model, info) tuple and finds no `load_verifier_weights` on it),
  so the embedding, LM head and verifier norm are the export's own: the file alone must make a working model.
- `filled`, the plain call: as serving and fine-tuning load it, the verifier's parts (re)loaded from the
  config's `verifier.name_or_path` over the file's.
OUT.pt gets, for each, `logits` [1,N*B,V] and `anchors` [N] of `_backbone_forward` (the forward's path up to the
draft logits, before its loss), and the checkpoint's and the model's tensor names, the names of parameters not
finite after loading, whether the three target parts equal the file's, and the model's taps.
A `dflash2` export (config `speculators_model_type`) loads with `DFlash2DraftModel`; its report adds the candidate
selector's output on the same path: `candidates` [1,N*B,k] (the unary top-k, as its serving `select` takes them)
and `candidate_scores` [1,N*B,k] (`score_candidates` with the teacher-forced predecessors of `_predecessor_ids`).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from safetensors.torch import load_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

TARGET_PARTS = ("embed_tokens.weight", "lm_head.weight", "verifier_norm.weight")


def draft(model: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """logits [1,N*B,V] and anchors [N] of the model's own forward path on the batch (DFlash2: and the selector's
    candidates and scores)."""
    hidden_states = batch["hidden_states"]
    with torch.no_grad():
        hidden, logits, _, _, block_indices = model._backbone_forward(
            hidden_states=hidden_states,
            input_ids=batch["input_ids"],
            loss_mask=batch["loss_mask"],
            # only feeds the training targets (through verifier_norm and verifier_lm_head), not the logits
            verifier_last_hidden_states=torch.zeros(1, hidden_states.shape[1], model.hidden_size),
            document_ids=torch.zeros_like(batch["input_ids"]),
            max_anchors=int(batch["num_anchors"]),
        )
        out = {"logits": logits, "anchors": block_indices[:: model.block_size]}  # block n: anchor_n + 0..B-1
        selector = getattr(model, "candidate_selector", None)
        if selector is not None:
            predecessors = model._predecessor_ids(batch["input_ids"], block_indices).reshape(1, -1)
            candidates, scores = selector.select(logits, hidden, predecessors)
            out.update(candidates=candidates, candidate_scores=scores)
    return out


def report(model: Any, batch: dict[str, torch.Tensor], file_tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = model.float().eval()
    state = model.state_dict()
    return {
        **draft(model, batch),
        "model_keys": sorted(state),
        "not_finite": sorted(n for n, t in state.items() if t.is_floating_point() and not t.isfinite().all()),
        "target_parts_equal": {n: bool(torch.equal(state[n].float(), file_tensors[n].float())) for n in TARGET_PARTS},
        "aux_hidden_state_layer_ids": list(model.target_layer_ids),
        "fc_in_features": model.fc.in_features,
    }


def main(export_dir: str, batch_file: str, out_file: str) -> None:
    batch = torch.load(batch_file)
    file_tensors = load_file(f"{export_dir}/model.safetensors")

    with open(f"{export_dir}/config.json") as handle:
        dflash2 = json.load(handle)["speculators_model_type"] == "dflash2"
    model_class = DFlash2DraftModel if dflash2 else DFlashDraftModel
    config_class = DFlash2SpeculatorConfig if dflash2 else DFlashSpeculatorConfig

    def config() -> DFlashSpeculatorConfig:
        loaded = config_class.from_pretrained(export_dir)
        # speculators defaults to flex attention with a torch.compile'd block-mask builder (a CPU Inductor build
        # here); "sdpa" runs the same mask predicate (its create_mask) as a dense boolean mask.
        loaded.transformer_layer_config._attn_implementation = "sdpa"
        return loaded

    alone, info = model_class.from_pretrained(export_dir, config=config(), output_loading_info=True)
    filled = model_class.from_pretrained(export_dir, config=config())
    torch.save(
        {
            "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
            "file_keys": sorted(file_tensors),
            "alone": report(alone, batch, file_tensors),
            "filled": report(filled, batch, file_tensors),
        },
        out_file,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
