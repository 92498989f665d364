"""A tiny, fully synthetic world for tests and `trainer demo`: corpus, tokenizer and target model.

The corpus is "walks": a prompt `walk <mode> from <word>` answered by `<word> <next> <next> ...`, where
`next` follows one fixed random *cyclic* permutation of the word list per mode. Why this shape:
- a random-weight target's greedy output falls into short loops that a prompt-lookup n-gram drafter
  predicts perfectly, which would make the acceptance comparison meaningless; a target trained on walks
  answers with long non-repeating word sequences (one cycle covers every word, longer than an answer);
- the answer is learnable: each next word is a function of (mode, current word), so a drafter that reads
  the target's context features (which encode the mode) can predict several words ahead;
- no word of an answer after the first is in the prompt, so prompt lookup has little to copy.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
MODES = ("north", "south", "east")


def walk_words(count: int = 40, seed: int = 7) -> list[str]:
    """`count` distinct pronounceable 3-letter words (letters only: one BPE pre-token each)."""
    rng = random.Random(seed)
    pool = sorted({c + v + d for c in CONSONANTS for v in VOWELS for d in CONSONANTS})
    return rng.sample(pool, count)


class WalkWorld:
    """The walk grammar: `prompt(mode, start)`, `answer(mode, start)`, `conversations(n, seed)`."""

    def __init__(self, num_words: int = 40, answer_words: int = 16, seed: int = 7) -> None:
        self.words = walk_words(num_words, seed)
        self.answer_words = answer_words
        rng = random.Random(seed + 1)
        self.successor: dict[str, dict[str, str]] = {}
        for mode in MODES:
            cycle = self.words[:]
            rng.shuffle(cycle)  # one cycle through every word: no repeats within an answer
            self.successor[mode] = {cycle[i]: cycle[(i + 1) % len(cycle)] for i in range(len(cycle))}

    def prompt(self, mode: str, start: str) -> str:
        return f"walk {mode} from {start}"

    def answer(self, mode: str, start: str) -> str:
        words = [start]
        while len(words) < self.answer_words:
            words.append(self.successor[mode][words[-1]])
        return " ".join(words) + " ."

    def conversations(self, count: int, seed: int) -> list[list[dict]]:
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            mode, start = rng.choice(MODES), rng.choice(self.words)
            out.append(
                [
                    {"role": "user", "content": self.prompt(mode, start)},
                    {"role": "assistant", "content": self.answer(mode, start)},
                ]
            )
        return out

    def texts(self) -> list[str]:
        """Text covering every word in every role, for training the tokenizer."""
        lines = []
        for mode in MODES:
            for start in self.words:
                lines.append(self.prompt(mode, start) + "\n" + self.answer(mode, start))
        return lines * 3


def build_tiny_target(
    out_dir: str | Path,
    tokenizer: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> Any:
    """A random-weight Qwen3ForCausalLM sized to the tokenizer, saved with the tokenizer to `out_dir`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(  # type: ignore[call-arg]  # rope_theta: a keyword of 4.x, taken into rope_parameters by 5.x
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    model = Qwen3ForCausalLM(config).eval()
    save_target(model, tokenizer, out_dir)
    return model


def save_target(model: Any, tokenizer: Any, out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def pretrain_target(
    model: Any,
    tokenizer: Any,
    conversations: list[list[dict]],
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 3e-3,
    log=None,
) -> dict[str, float]:
    """Teach the tiny target the walk grammar by next-token CE on whole chat-formatted conversations.

    A fixed step count (not wall time: on a busy machine a time budget silently leaves the target untrained,
    and an untrained target's looping output makes every acceptance figure meaningless); ~300 steps learn
    the grammar at hidden 64 (about 80 ms a step on one core). Returns {"steps", "loss"}. All rows share one length (same template, fixed answer length) so no padding.
    """
    from trainer.data.tokenizer_utils import tokenize_conversation

    rows = [tokenize_conversation(tokenizer, c, False)[0] for c in conversations]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    data = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        data[i, : len(r)] = torch.tensor(r)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    generator = torch.Generator().manual_seed(0)
    done, loss_value = 0, float("nan")
    while done < steps:
        batch = data[torch.randint(0, len(rows), (batch_size,), generator=generator)]
        labels = batch.masked_fill(batch == pad, -100)
        loss = model(input_ids=batch, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        done, loss_value = done + 1, float(loss.detach())
        if log and done % 100 == 0:
            log(f"target pretrain step {done}: loss {loss_value:.3f}")
    model.eval()
    return {"steps": done, "loss": loss_value}
