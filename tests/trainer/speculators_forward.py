"""Run by the speculators environment (speculators_env.py), not by pytest: load an export with speculators' own
loader and compute its draft logits on a fixed batch.

    python speculators_forward.py EXPORT_DIR BATCH.pt OUT.pt

BATCH.pt holds `hidden_states` [1,S,T*H] (the target's tapped features), `input_ids` [1,S], `loss_mask` [1,S]
(1 exactly at the anchors, so speculators' random anchor choice has one outcome) and `num_anchors`. OUT.pt gets
`logits` [1,N*B,V] and `anchors` [N] from `DFlashDraftModel._backbone_forward` (the forward's path up to the draft
logits, before its loss), the loader's report (`loading_info`), the checkpoint's tensor names (`file_keys`), the
model's state-dict names (`model_keys`), the names of parameters left NaN (speculators' mark for "never loaded"),
and whether the three target parts loaded equal the file's (`target_parts_equal`).
"""

from __future__ import annotations

import sys

import torch
from safetensors.torch import load_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig


def main(export_dir: str, batch_file: str, out_file: str) -> None:
    batch = torch.load(batch_file)
    config = DFlashSpeculatorConfig.from_pretrained(export_dir)
    # speculators defaults to flex attention with a torch.compile'd block-mask builder (a CPU Inductor build
    # here); "sdpa" runs the same mask predicate (its create_mask) as a dense boolean mask.
    config.transformer_layer_config._attn_implementation = "sdpa"
    model, info = DFlashDraftModel.from_pretrained(export_dir, config=config, output_loading_info=True)
    model = model.float().eval()
    file_tensors = load_file(f"{export_dir}/model.safetensors")
    state = model.state_dict()
    parts = {"embed_tokens.weight", "lm_head.weight", "verifier_norm.weight"}
    hidden_states = batch["hidden_states"]
    with torch.no_grad():
        _, logits, _, _, block_indices = model._backbone_forward(
            hidden_states=hidden_states,
            input_ids=batch["input_ids"],
            loss_mask=batch["loss_mask"],
            # only feeds the training targets (through verifier_norm and verifier_lm_head), not the logits
            verifier_last_hidden_states=torch.zeros(1, hidden_states.shape[1], model.hidden_size),
            document_ids=torch.zeros_like(batch["input_ids"]),
            max_anchors=int(batch["num_anchors"]),
        )
    anchors = block_indices[:: model.block_size]  # block n's positions are anchor_n + 0..B-1
    torch.save(
        {
            "logits": logits,
            "anchors": anchors,
            "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
            "file_keys": sorted(file_tensors),
            "model_keys": sorted(state),
            "nan_parameters": sorted(n for n, t in state.items() if t.is_floating_point() and t.isnan().any()),
            "target_parts_equal": {n: bool(torch.equal(state[n].float(), file_tensors[n].float())) for n in parts},
            "aux_hidden_state_layer_ids": list(model.target_layer_ids),
            "fc_in_features": model.fc.in_features,
        },
        out_file,
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
