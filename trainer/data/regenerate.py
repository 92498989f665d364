"""Target regeneration for `prepare --regenerate`: batched `generate` over a shard's prompts.

Prompts are left-padded (decoder-only generation continues from the right edge) and batched in input order.
Generation stops at the first end-of-turn id (eos / `<|im_end|>`); that token is kept and supervised so the
drafter learns where answers end; an answer cut by max_new_tokens is kept as is (no end token).
Cost: one model in this process; on CPU the tiny target generates a few hundred tokens/s, on a GPU the
batch size sets throughput (KV cache memory ~ 2 * layers * batch * (prompt + new) * kv_dim * bytes).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from trainer.data.tokenizer_utils import end_of_turn_ids, padding_id, tokenize_prompt


def load_target_lm(path: str, dtype_name: str = "auto") -> tuple[Any, torch.device]:
    """The HF causal LM at `path`, in eval mode; dtype `auto`: bf16 on CUDA, fp32 on CPU (CPU bf16 matmuls are
    slow); `float32` where the data must be the fp32 model's own greedy answers (a small target on a GPU)."""
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        dtype_name, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()  # type: ignore[arg-type]  # .to() typed by wraps()
    return model, device


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask) [batch, longest prompt], each prompt at the right edge (generation continues
    there)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention[row, width - len(prompt) :] = 1
    return input_ids, attention


@torch.inference_mode()
def generate_answers(
    model: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    stops: list[int],
    pad_id: int,
    temperature: float = 0.0,
    **generate_kwargs: Any,
) -> list[list[int]]:
    """Generated ids per prompt, cut after the first end-of-turn id: one left-padded batch through `model.generate`
    (greedy at temperature 0, else sampled from torch's global generator). `generate_kwargs`: more of `generate`'s
    settings (bench/regen_speed.py times a static cache)."""
    input_ids, attention = left_pad(prompts, pad_id)
    device = next(model.parameters()).device
    sampled = temperature > 0
    output = model.generate(
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        max_new_tokens=max_new_tokens,
        do_sample=sampled,
        temperature=temperature if sampled else None,
        top_p=None,
        top_k=None,
        eos_token_id=stops,
        pad_token_id=pad_id,
        **generate_kwargs,
    )
    answers = []
    for row in output[:, input_ids.shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        answers.append(row[:cut])
    return answers


class Regenerator:
    """Holds the target and tokenizer; `shard_samples(prompts, seed)` -> [(ids, mask)] in prompt order."""

    def __init__(self, target_path: str, tokenizer: Any, options: Any) -> None:
        self.model, self.device = load_target_lm(target_path, getattr(options, "dtype", "auto"))
        self.tokenizer = tokenizer
        self.options = options
        self.stops = end_of_turn_ids(tokenizer)
        self.pad_id = padding_id(tokenizer)

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Generated ids per prompt (cut after the first end-of-turn id)."""
        torch.manual_seed(seed)
        return generate_answers(
            self.model,
            prompts,
            max_new_tokens=self.options.max_new_tokens,
            stops=self.stops,
            pad_id=self.pad_id,
            temperature=self.options.temperature,
        )

    def shard_samples(
        self, conversations: list[list[dict]], *, seed: int, label: str = ""
    ) -> list[tuple[list[int], list[int]]]:
        """One (ids, loss mask) per conversation, whose trailing assistant turns the caller has already cut
        (prepare.prompt_part): this module takes prompts, so it needs nothing back from prepare."""
        prompts = [tokenize_prompt(self.tokenizer, c, self.options.enable_thinking) for c in conversations]
        samples: list[tuple[list[int], list[int]]] = []
        batch = self.options.batch_size
        started, generated = time.monotonic(), 0
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            for prompt, answer in zip(chunk, self.generate(chunk, seed * 1_000_003 + start)):
                samples.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
                generated += len(answer)
            # Progress on stderr, one line per batch (logs stay readable in a file; no carriage returns).
            done, elapsed = min(start + batch, len(prompts)), time.monotonic() - started
            print(
                f"regenerate {label}: {done}/{len(prompts)} prompts, {generated} tokens, "
                f"{generated / max(elapsed, 1e-9):.0f} tok/s, {elapsed:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        return samples


_WORKER: Regenerator | None = None  # a worker process's own (`start_worker`)


def start_worker(tokenizer_path: str, options: Any, threads: int, parent: int) -> None:
    """A `prepare --regenerate --num-workers N` worker process: its threads, the tokenizer and target loaded once;
    it ends with `parent` (trainer/core/parent_watch.py)."""
    from transformers import AutoTokenizer

    from trainer.core.parent_watch import end_with_parent

    global _WORKER
    end_with_parent(parent)
    torch.set_num_threads(threads)
    _WORKER = Regenerator(options.target_model, AutoTokenizer.from_pretrained(tokenizer_path), options)


def worker_shard(conversations: list[list[dict]], seed: int, label: str) -> list[tuple[list[int], list[int]]]:
    """`Regenerator.shard_samples` in a worker process (after `start_worker`)."""
    assert _WORKER is not None, "start_worker runs first (the pool's initializer)"
    return _WORKER.shard_samples(conversations, seed=seed, label=label)


def worker_threads(workers: int, cores: int | None = None) -> int:
    """Intra-op threads of each of `workers` processes: `choose_threads`' share, at least one (one thread cannot
    spin against the others: two processes of one thread each use both of 2 cores)."""
    return max(1, choose_threads(cores) // workers)


def choose_threads(cores: int | None = None) -> int:
    """Intra-op threads for CPU generation and training: half the cores (one on a 2-core machine). Under load, two
    OpenMP threads on the 2-core machine ran 7x slower than one (they spin against other processes), and the load
    changes during a long run, so a choice made from the load at start is no safer than this fixed one."""
    import os

    return max(1, (cores or os.cpu_count() or 1) // 2)
