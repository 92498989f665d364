"""`python -m trainer eval`: greedy speculative decoding with the target verifying each drafted block.

Per step: the drafter proposes up to B-1 tokens after the anchor (the last committed token); the target runs
ONE forward over [anchor, d_1 .. d_{B-1}] on its KV cache; the longest prefix where d_j equals the target's
argmax is accepted, plus the target's bonus token; the cache is cropped back to the committed length.
Reported per drafter (trained, untrained = same config freshly initialised, prompt-lookup n-gram):
- tau: mean tokens committed per verify step (accepted + 1), docs/method.md#acceptance-length; generation ends at
  the first stop id even when it is an accepted draft token (that last step still counts accepted + 1, as training's
  tau_sim and the public reference count it), so no step verifies text past the end of the answer;
- tokens per target forward: generated tokens / (verify steps + the prefill forward);
- per-slot acceptance: share of steps where slot k was accepted (slot k is accepted only if 1..k-1 were);
- DFlash2 drafters (docs/method.md#dflash2): "trained" proposes with the selector's reranking, "trained_unary"
  with each slot's plain argmax (what the selector adds, on the same prompts);
- lossless: every output must equal the target's own greedy `generate` output token for token; a mismatch
  is a failure (exit code 1).
DDTree mode (`--ddtree-budget K [--ddtree-top-k N]`, docs/method.md#ddtree; rule, mask and cache handling in
trainer.evaluation.ddtree): the trained drafter's per-slot distributions of the same block grow a tree of at most K nodes,
verified in one target forward with an ancestor-only mask; reported as method "ddtree" beside the block rows, same
prompts, same tau/lossless bookkeeping (its per-slot acceptance is per tree depth). K = B-1 with top-k 1 is block
drafting.
Cost: the drafter re-reads the whole committed context each step (O(n^2) over a generation) instead of the
public loop's incremental drafter KV cache; identical outputs, fine at evaluation lengths.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainer.data.tokenizer_utils import DataInputError, end_of_turn_ids
from trainer.evaluation.ddtree import check_options as check_ddtree_options
from trainer.evaluation.ddtree import ddtree_generate
from trainer.evaluation.verify import cut_at_stop, finish_generation
from trainer.model.dflash2 import select_block
from trainer.model.drafter import DFlashDrafter

Proposer = Callable[[list[int], torch.Tensor, int], list[int]]  # (committed ids, ctx taps [n-1,T*H], k) -> draft


class TargetRunner:
    """The HF target with a KV cache, returning logits and the drafter's taps (HF hidden_states[i+1])."""

    def __init__(self, model: Any, layer_ids: list[int]) -> None:
        from transformers import DynamicCache

        self.model, self.layer_ids, self._cache_type = model, layer_ids, DynamicCache
        self.cache = DynamicCache()
        # transformers 5.x renamed `past_key_values` to `cache`; accept either version.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    @torch.inference_mode()
    def forward(
        self, ids: list[int], position_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `ids` after the cached positions -> (logits [len,V], taps [len,T*H]). Default: consecutive
        positions under the causal mask; DDTree passes tree positions and a 4-D mask (trainer.evaluation.ddtree)."""
        device = self.model.get_input_embeddings().weight.device
        extra = {} if position_ids is None else {"position_ids": position_ids, "attention_mask": attention_mask}
        out = self.model(
            input_ids=torch.tensor([ids], device=device),
            use_cache=True,
            output_hidden_states=True,
            **{self._cache_kwarg: self.cache},
            **extra,
        )
        taps = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return out.logits[0].float(), taps

    def reset(self) -> None:
        self.cache = self._cache_type()

    def crop(self, length: int) -> None:
        """Drop cached positions >= length (the rejected draft tokens)."""
        extra = self.cache.get_seq_length() - length
        if extra > 0:
            self.cache.crop(-extra)


@dataclass
class MethodStats:
    """Totals of one drafting method over all prompts."""

    name: str
    steps: int = 0
    committed: int = 0
    generated: int = 0
    forwards: int = 0
    slot_proposed: list[int] = field(default_factory=list)
    slot_accepted: list[int] = field(default_factory=list)
    mismatches: list[int] = field(default_factory=list)  # prompt indices whose output differed
    # each prompt's verify steps and committed tokens, in prompt order: its own tau, and the tau of any group of
    # prompts (bench/real_world.py: by kind of prompt)
    prompt_steps: list[int] = field(default_factory=list)
    prompt_committed: list[int] = field(default_factory=list)
    tree_nodes: int = 0  # DDTree only: nodes verified over all steps
    tree: dict[str, Any] | None = None  # DDTree only: {"budget", "top_k"}

    def record_step(self, proposed: int, accepted: int, slots: int) -> None:
        if not self.slot_proposed:
            self.slot_proposed, self.slot_accepted = [0] * slots, [0] * slots
        self.steps, self.committed = self.steps + 1, self.committed + accepted + 1
        for k in range(proposed):
            self.slot_proposed[k] += 1
            self.slot_accepted[k] += int(k < accepted)

    def summary(self) -> dict[str, Any]:
        return {
            "tau": self.committed / max(self.steps, 1),
            "tokens_per_target_forward": self.generated / max(self.forwards, 1),
            "per_slot_acceptance": [a / p if p else None for a, p in zip(self.slot_accepted, self.slot_proposed)],
            "lossless": not self.mismatches,
            "mismatched_prompts": self.mismatches,
            "steps": self.steps,
            "generated_tokens": self.generated,
            # the counts behind the ratios, so that reports of disjoint prompt slices merge exactly (`merge_reports`)
            "committed": self.committed,
            "forwards": self.forwards,
            "slot_proposed": self.slot_proposed,
            "slot_accepted": self.slot_accepted,
            "prompt_steps": self.prompt_steps,
            "prompt_committed": self.prompt_committed,
            **({} if self.tree is None else {**self.tree, "mean_tree_nodes": self.tree_nodes / max(self.steps, 1)}),
        }


SlotLogits = Callable[[list[int], torch.Tensor, int], torch.Tensor]  # same arguments -> per-slot logits [k, V]


def drafter_proposer(
    drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, *, selector: bool = True
) -> Proposer:
    """Block drafting: each slot's argmax of `drafter_slot_logits`; a DFlash2 drafter's selector (unless
    `selector=False`) instead reranks each slot's unary top-k left to right (trainer/model/dflash2.py:
    select_block), slot j's predecessor being slot j-1's pick."""
    hidden_of = drafter_slot_hidden(drafter, embed_weight)
    head = lm_head_weight.float()
    rerank = drafter.candidate_selector if selector else None

    @torch.inference_mode()
    def propose(committed: list[int], taps: torch.Tensor, slots: int) -> list[int]:
        hidden = hidden_of(committed, taps, slots)
        logits = hidden @ head.T  # [slots, V]
        if rerank is None:
            return logits.argmax(-1).tolist()
        return select_block(rerank, logits, hidden.to(next(rerank.parameters()).dtype), committed[-1])

    return propose


def drafter_slot_logits(drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> SlotLogits:
    """Slot k's logits hidden_k @ lm_head^T for k = 1..slots (`drafter_slot_hidden`)."""
    hidden_of = drafter_slot_hidden(drafter, embed_weight)

    @torch.inference_mode()
    def slot_logits(committed: list[int], taps: torch.Tensor, slots: int) -> torch.Tensor:
        return hidden_of(committed, taps, slots) @ lm_head_weight.float().T  # [slots, V]; B-1 x V at most

    return slot_logits


def drafter_slot_hidden(drafter: DFlashDrafter, embed_weight: torch.Tensor) -> SlotLogits:
    """One drafter block [anchor, MASK * (B-1)] at positions n-1.., context = taps of positions 0..n-2;
    returns slot k's final hidden state (float32) for k = 1..slots."""
    cfg = drafter.config

    @torch.inference_mode()
    def slot_hidden(committed: list[int], taps: torch.Tensor, slots: int) -> torch.Tensor:
        ctx_len = taps.shape[0]
        block = torch.tensor([committed[-1]] + [cfg.mask_token_id] * (cfg.block_size - 1), device=taps.device)
        anchors = torch.tensor([[ctx_len]], device=taps.device)
        keep = torch.ones((1, 1), dtype=torch.bool, device=taps.device)
        mask = drafter.build_mask(anchors, keep, ctx_len)
        dtype = next(drafter.parameters()).dtype
        hidden = drafter(taps[None].to(dtype), embed_weight[block][None].to(dtype), anchors, keep, mask)
        return hidden[0, 1 : slots + 1].float()  # [slots, H]

    return slot_hidden


def ngram_proposer(max_ngram: int = 3) -> Proposer:
    """Prompt lookup: find the latest earlier occurrence of the last n committed tokens (n = max..1) and
    propose what followed it."""

    def propose(committed: list[int], taps: torch.Tensor, slots: int) -> list[int]:
        for n in range(min(max_ngram, len(committed) - 1), 0, -1):
            tail = committed[-n:]
            for start in range(len(committed) - n - 1, -1, -1):
                if committed[start : start + n] == tail:
                    return committed[start + n : start + n + slots]
        return []

    return propose


def speculative_generate(
    runner: TargetRunner,
    prompt: list[int],
    propose: Proposer,
    *,
    slots: int,
    max_new_tokens: int,
    stops: set[int],
    stats: MethodStats,
) -> list[int]:
    """Greedy speculative decoding of one prompt; returns the generated ids (cut after the first stop id)."""
    runner.reset()
    logits, taps = runner.forward(prompt)
    committed = prompt + [int(logits[-1].argmax())]
    forwards = 1
    while len(committed) - len(prompt) < max_new_tokens and committed[-1] not in stops:
        budget = min(slots, max_new_tokens - (len(committed) - len(prompt)) - 1)
        draft = propose(committed, taps, budget)[:budget] if budget > 0 else []
        n = len(committed)
        logits, new_taps = runner.forward([committed[-1]] + draft)  # positions n-1 .. n-1+len(draft)
        forwards += 1
        choice = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(draft) and draft[accepted] == choice[accepted]:
            accepted += 1
        new_tokens, accepted, proposed = cut_at_stop(draft[:accepted] + [choice[accepted]], accepted, len(draft), stops)
        committed += new_tokens
        taps = torch.cat([taps, new_taps[: len(new_tokens)]])  # committed positions only
        runner.crop(n - 1 + len(new_tokens))
        stats.record_step(proposed, accepted, slots)
    return finish_generation(committed, len(prompt), max_new_tokens, stops, stats, forwards)


@torch.inference_mode()
def greedy_reference(model: Any, prompt: list[int], max_new_tokens: int, stops: list[int], pad_id: int) -> list[int]:
    """The target's own greedy output (HF generate), cut after the first stop id."""
    device = model.get_input_embeddings().weight.device
    out = model.generate(
        torch.tensor([prompt], device=device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=stops,
        pad_token_id=pad_id,
    )
    generated = out[0, len(prompt) :].tolist()
    cut = next((i + 1 for i, t in enumerate(generated) if t in stops), len(generated))
    return generated[:cut]


def check_drafter_fits(drafter: DFlashDrafter, model: Any) -> None:
    """DataInputError unless the drafter's taps exist in the target and its hidden size equals the target's."""
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    try:
        drafter.config.check_target(
            num_target_layers=int(text_config.num_hidden_layers),
            hidden_size=int(text_config.hidden_size),
            vocab_size=int(model.get_input_embeddings().weight.shape[0]),
        )
    except ValueError as exc:
        raise DataInputError(
            f"drafter does not fit the target: {exc}", hint="evaluate the drafter with the target it was trained for"
        ) from None


def evaluate(
    model: Any,
    drafter: DFlashDrafter,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    block_size: int | None = None,
    stops: list[int],
    pad_id: int,
    baselines: bool = True,
    trained: bool = True,
    seed: int = 0,
    ddtree_budget: int | None = None,
    ddtree_top_k: int | None = None,
    progress: Callable[[str], None] | None = None,
    references: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Run trained (+ untrained and n-gram baselines) over `prompts`; returns the report dict. `trained=False`: the
    baselines alone (they need only `drafter`'s config, so they can run while the drafter trains). With
    `ddtree_budget` the trained drafter is also run in DDTree mode (method "ddtree", same prompts).
    `progress(line)` hears of each stage and, at most every 10 s, of the prompts done (a real target on a CPU
    takes minutes here). `references`: the target's own greedy answers to `prompts`, when the caller has them
    (`greedy_references`; one list serves every drafter evaluated on the same prompts)."""
    check_ddtree_options(ddtree_budget, ddtree_top_k, model)
    check_drafter_fits(drafter, model)
    block = block_size or drafter.config.block_size
    if not 2 <= block <= drafter.config.block_size:
        raise DataInputError(
            f"--block-size {block} must be in 2..{drafter.config.block_size} (the drafter's block size)"
        )
    slots = block - 1
    runner = TargetRunner(model, drafter.config.target_layer_ids)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    common: dict[str, Any] = {"slots": slots, "max_new_tokens": max_new_tokens, "stops": set(stops)}

    def block_mode(propose: Proposer) -> Callable[[list[int], MethodStats], list[int]]:
        return lambda prompt, stats: speculative_generate(runner, prompt, propose, stats=stats, **common)

    if not (trained or baselines):
        raise ValueError("evaluate: neither the trained drafter nor the baselines asked for")
    methods: dict[str, tuple[Callable[[list[int], MethodStats], list[int]], dict[str, Any] | None]] = {}
    if trained:
        methods["trained"] = (block_mode(drafter_proposer(drafter.eval(), embed, head)), None)
    if trained and drafter.candidate_selector is not None:  # DFlash2: the drafter without its selector's reranking
        methods["trained_unary"] = (block_mode(drafter_proposer(drafter, embed, head, selector=False)), None)
    if baselines:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            untrained = DFlashDrafter(drafter.config).to(embed.device).eval()
        methods["untrained"] = (block_mode(drafter_proposer(untrained, embed, head)), None)
        methods["ngram"] = (block_mode(ngram_proposer()), None)
    if ddtree_budget is not None and trained:
        slot_logits = drafter_slot_logits(drafter, embed, head)
        methods["ddtree"] = (
            lambda prompt, stats: ddtree_generate(
                runner, prompt, slot_logits, budget=ddtree_budget, top_k=ddtree_top_k, stats=stats, **common
            ),
            {"budget": ddtree_budget, "top_k": ddtree_top_k},
        )
    ticker = Ticker(progress, len(prompts))
    if references is None:
        references = greedy_references(model, prompts, max_new_tokens, stops, pad_id, ticker)
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "block_size": block,
        "max_new_tokens": max_new_tokens,
        "methods": {},
    }
    for name, (generate, tree) in methods.items():
        stats = MethodStats(name, tree=tree)
        for index, (prompt, reference) in enumerate(zip(prompts, references)):
            steps, committed = stats.steps, stats.committed
            if generate(prompt, stats) != reference:
                stats.mismatches.append(index)
            stats.prompt_steps.append(stats.steps - steps)
            stats.prompt_committed.append(stats.committed - committed)
            ticker.tick(name)
        report["methods"][name] = stats.summary()
    report["lossless"] = all(m["lossless"] for m in report["methods"].values())
    return report


def merge_reports(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of `evaluate` over the prompts of `parts` in order, from the reports of consecutive slices of them
    (evaluated apart, e.g. in several processes): every count summed, every ratio recomputed, mismatched prompt
    indices shifted to the whole list's. Block mode only (a DDTree report's tree statistics are not merged)."""
    merged: dict[str, Any] = {k: v for k, v in parts[0].items() if k != "methods"}
    merged["prompts"], merged["methods"] = sum(p["prompts"] for p in parts), {}
    for name in parts[0]["methods"]:
        stats, offset = MethodStats(name), 0
        for part in parts:
            m = part["methods"][name]
            if "budget" in m:
                raise ValueError("merge_reports: DDTree reports are not merged")
            stats.steps, stats.committed = stats.steps + m["steps"], stats.committed + m["committed"]
            stats.generated, stats.forwards = stats.generated + m["generated_tokens"], stats.forwards + m["forwards"]
            for mine, theirs in (
                (stats.slot_proposed, m["slot_proposed"]),
                (stats.slot_accepted, m["slot_accepted"]),
            ):
                mine.extend([0] * (len(theirs) - len(mine)))
                for k, count in enumerate(theirs):
                    mine[k] += count
            stats.mismatches += [offset + i for i in m["mismatched_prompts"]]
            stats.prompt_steps += m["prompt_steps"]
            stats.prompt_committed += m["prompt_committed"]
            offset += part["prompts"]
        merged["methods"][name] = stats.summary()
    merged["lossless"] = all(m["lossless"] for m in merged["methods"].values())
    return merged


def greedy_references(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    stops: list[int],
    pad_id: int,
    ticker: Ticker | None = None,
) -> list[list[int]]:
    """The target's own greedy answer to each prompt (what every lossless check compares against)."""
    answers = []
    for prompt in prompts:
        answers.append(greedy_reference(model, prompt, max_new_tokens, stops, pad_id))
        if ticker is not None:
            ticker.tick("target's own greedy answers")
    return answers


class Ticker:
    """Progress lines for `evaluate`: the first and last prompt of each stage, and at most one line every 10 s."""

    def __init__(self, say: Callable[[str], None] | None, total: int, every_s: float = 10.0) -> None:
        import time

        self.say, self.total, self.every_s, self.clock = say, total, every_s, time.monotonic
        self.stage, self.done, self.last = "", 0, 0.0

    def tick(self, stage: str) -> None:
        if self.say is None:
            return
        if stage != self.stage:
            self.stage, self.done = stage, 0
        self.done += 1
        now = self.clock()
        if self.done in (1, self.total) or now - self.last >= self.every_s:
            self.last = now
            self.say(f"eval {stage}: {self.done}/{self.total} prompts")


def format_table(report: dict[str, Any]) -> str:
    """The acceptance table: one row per method."""
    lines = [f"{'method':<13} {'tau':>6} {'tok/fwd':>8} {'lossless':>8}  per-slot acceptance"]
    for name, m in report["methods"].items():
        slots = " ".join("  - " if a is None else f"{a:.2f}" for a in m["per_slot_acceptance"])
        lines.append(
            f"{name:<13} {m['tau']:>6.2f} {m['tokens_per_target_forward']:>8.2f} "
            f"{'yes' if m['lossless'] else 'NO':>8}  {slots}"
        )
        if "budget" in m:
            lines[-1] += (
                f"  (trained drafter, tree budget {m['budget']}, top-k {m['top_k'] or 'any'}, "
                f"{m['mean_tree_nodes']:.1f} nodes/step)"
            )
    return "\n".join(line.rstrip() for line in lines)  # a last slot never reached ("  - ") left a trailing blank


def main(argv: list[str] | None = None) -> int:
    from trainer.data.prepare import _on_off, load_records, prompt_part
    from trainer.data.regenerate import load_target_lm
    from trainer.data.tokenizer_utils import tokenize_prompt
    from trainer.export.export import load_drafter

    parser = argparse.ArgumentParser(prog="python -m trainer eval", description=__doc__.splitlines()[0])
    parser.add_argument("--target-model", required=True, help="HF model directory of the target (verifier)")
    parser.add_argument("--drafter", required=True, help="exported drafter directory (public DFlash format)")
    parser.add_argument("--prompts", required=True, help="JSONL like prepare's input; trailing answers are ignored")
    parser.add_argument("--block-size", type=int, default=None, help="default: the drafter's")
    parser.add_argument(
        "--max-new-tokens", type=int, default=128, help="tokens generated per prompt at most (default: %(default)s)"
    )
    parser.add_argument(
        "--enable-thinking",
        type=_on_off,
        default=None,
        metavar="on|off",
        help="the chat template's thinking mode (default: the template's own)",
    )
    parser.add_argument("--limit", type=int, default=None, help="evaluate only the first N prompts (default: all)")
    parser.add_argument(
        "--no-baselines",
        action="store_true",
        help="skip the untrained-drafter and n-gram baselines (default: run them)",
    )
    parser.add_argument("--json", default=None, help="also write the report to this file (default: stdout only)")
    parser.add_argument(
        "--ddtree-budget",
        type=int,
        default=None,
        metavar="K",
        help="also run DDTree with the trained drafter: at most K tree nodes per verify step (default: no DDTree)",
    )
    parser.add_argument(
        "--ddtree-top-k",
        type=int,
        default=None,
        metavar="N",
        help="DDTree candidates per depth (default: unlimited, i.e. the budget decides)",
    )
    args = parser.parse_args(argv)
    try:
        check_ddtree_options(args.ddtree_budget, args.ddtree_top_k)  # bad numbers fail before any loading
        from transformers import AutoTokenizer

        drafter = load_drafter(args.drafter)
        tokenizer = AutoTokenizer.from_pretrained(args.target_model)
        records, _ = load_records(args.prompts, skip_bad=False)
        prompts = [tokenize_prompt(tokenizer, prompt_part(r), args.enable_thinking) for r in records[: args.limit]]
        model, device = load_target_lm(args.target_model)
        report = evaluate(
            model,
            drafter.to(device),
            prompts,
            max_new_tokens=args.max_new_tokens,
            block_size=args.block_size,
            stops=end_of_turn_ids(tokenizer),
            pad_id=tokenizer.pad_token_id or 0,
            baselines=not args.no_baselines,
            ddtree_budget=args.ddtree_budget,
            ddtree_top_k=args.ddtree_top_k,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        )
    except DataInputError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    print(format_table(report), file=sys.stderr)
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text + "\n")
    print(text)
    if not report["lossless"]:
        print(
            "error: lossless check failed: speculative output differs from the target's greedy output", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
