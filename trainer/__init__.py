"""The DFlash drafter trainer (`python -m trainer <verb>`); its packages, lowest first, in
docs/architecture.md#the-trainer-top-to-bottom."""

# First, before torch and transformers: the start of a run's timeline and whether the user chose Inductor's cache.
from trainer.core import process_start as _process_start  # noqa: F401
