"""Acceptance length: block (eval) and tree (ddtree) speculative decoding against a target."""
