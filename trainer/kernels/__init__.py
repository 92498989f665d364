"""Every Triton kernel and its fitting rules (triton_fit), with their torch fallbacks. Imports nothing else of the trainer."""
