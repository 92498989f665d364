"""The DFlash drafter, the frozen target wrapper and the training attention masks.

from trainer.model import TargetModel, DrafterConfig, DFlashDrafter, build_draft_mask
"""

from trainer.model.attention import DraftMask, attend, build_draft_mask
from trainer.model.drafter import DFlashDrafter, DrafterConfig, make_block_input_ids
from trainer.model.target import TargetModel, TargetOutput, default_target_layer_ids

__all__ = [
    "DraftMask",
    "attend",
    "build_draft_mask",
    "DFlashDrafter",
    "DrafterConfig",
    "make_block_input_ids",
    "TargetModel",
    "TargetOutput",
    "default_target_layer_ids",
]
