"""Bookkeeping shared by block (trainer.evaluation.eval) and tree (trainer.evaluation.ddtree) speculative decoding: where an answer
ends inside a verify step, and how a finished generation is cut and counted."""

from __future__ import annotations

from typing import Any


def cut_at_stop(new_tokens: list[int], accepted: int, proposed: int, stops: set[int]) -> tuple[list[int], int, int]:
    """Tokens one verify step commits, cut after the first stop id, with (accepted, proposed) cut to match.

    The answer ends at the first stop id, also when it is an ACCEPTED draft token: nothing after it is output,
    so no further verify step runs and slots past it are not counted (they lie past the end of the text,
    exactly like the invalid slots of training's tau_sim). Without this the loop went on verifying garbage
    after the answer until max_new_tokens and those steps pulled tau down."""
    stop_at = next((i for i, t in enumerate(new_tokens) if t in stops), None)
    if stop_at is None:
        return new_tokens, accepted, proposed
    return new_tokens[: stop_at + 1], min(accepted, stop_at + 1), min(proposed, stop_at + 1)


def finish_generation(
    committed: list[int], prompt_len: int, max_new_tokens: int, stops: set[int], stats: Any, forwards: int
) -> list[int]:
    """The generated ids (cut after the first stop id and at max_new_tokens); adds them and the target
    forwards to `stats` (a trainer.evaluation.eval.MethodStats)."""
    generated = committed[prompt_len:]
    cut = next((i + 1 for i, t in enumerate(generated) if t in stops), len(generated))
    generated = generated[: min(cut, max_new_tokens)]
    stats.generated += len(generated)
    stats.forwards += forwards
    return generated
