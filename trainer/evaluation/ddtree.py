"""DDTree: a draft TREE from one drafter block's per-slot distributions, verified in ONE target forward.

Growth rule (exact). Slot d of the block (d = 1..D, D = the slots allowed this step) gives log-probabilities
lp_d = log_softmax(hidden_d @ lm_head^T). Because the drafter fills all slots in parallel, slot d's distribution
does not depend on the tokens chosen at earlier depths, so a path t_1..t_d scores S = lp_1(t_1) + ... + lp_d(t_d)
(the log of the product of the per-slot probabilities). The candidates at depth d are slot d's `top_k` tokens
(rank 1 = most likely; equal probabilities keep torch.topk's order). The tree is grown best-first:
a max-heap of frontier nodes starts with rank 1 of slot 1 under the root (the anchor); each pop adds the node with
the highest S (ties: the node pushed first) and pushes (a) its next-ranked sibling (same parent, rank r+1 of the
same slot) and (b) its first child (rank 1 of slot d+1, if d < D). Stop after `budget` nodes (root excluded).
Since every lp <= 0, a prefix scores >= its extensions and a rank-r sibling >= rank r+1, so the result is exactly
the `budget` highest-scoring paths (a prefix-closed set; ties aside), and the pop order does not depend on
`budget`: a larger budget gives a SUPERSET tree for the same distributions (the per-step monotonicity the tests
rely on). `top_k` never matters beyond `budget` (a rank-r node needs r-1 siblings popped first). With top_k = 1
the tree is the linear chain of each slot's argmax, i.e. block drafting.

Verification. The anchor (the last committed token, not yet in the target's KV cache) and the N tree nodes go
through the target in one forward after the cached prefix of n-1 positions: position ids n-1 for the anchor and
n-1+depth for a node; a 4-D additive float mask [1, 1, 1+N, n+N] (0 = attend, dtype-min = blocked), where every
query sees the whole cached prefix, the anchor, its ancestors and itself. Format choice: transformers 5.x
(`masking_utils._preprocess_mask_arguments`) passes any 4-D tensor through unchanged; the sdpa integration
takes a float or bool mask but eager attention ADDS the mask to the scores, so only an additive float mask in
the model's dtype works for both (checked against 5.17 and 5.24). Flash-attention and flex back ends ignore or
reject such a mask: refused. Cost: a custom mask keeps sdpa off its flash kernel (memory-efficient/math kernel
instead) and the mask is (1+N) x (n+N) in the model dtype, e.g. 65 x 4160 x 2 B = 0.5 MB at n = 4096, N = 64.
Acceptance: from the root, follow the child whose token equals the target's argmax at the current node; the
path plus the target's argmax at its end (bonus) is committed. The KV entries of the accepted nodes are moved
to sit right after the anchor and the rest cropped (an in-place gather per layer; O(layers * kept) copies).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import torch

from trainer.data.tokenizer_utils import DataInputError
from trainer.evaluation.verify import cut_at_stop, finish_generation


@dataclass
class DraftTree:
    """Nodes in pop (best-first) order, so a parent always precedes its children. parent -1 = the root (anchor)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, node: int) -> list[int]:
        """Node indices from depth 1 down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]


def check_options(budget: int | None, top_k: int | None, model: Any = None) -> None:
    """DataInputError (a ValueError) for a non-positive budget or top-k, a top-k without a budget, or a `model`
    whose attention back end cannot apply the 4-D ancestor mask. budget None = DDTree off."""
    hint = "e.g. --ddtree-budget 16 (the block size minus one with --ddtree-top-k 1 is block drafting)"
    if budget is None:
        if top_k is not None:
            raise DataInputError("--ddtree-top-k needs --ddtree-budget", hint=hint)
        return
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise DataInputError(
            f"--ddtree-budget {budget} must be a positive number of tree nodes (the root not counted)", hint=hint
        )
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise DataInputError(f"--ddtree-top-k {top_k} must be a positive number of candidates per depth", hint=hint)
    if model is not None and not supports_tree_mask(model):
        backend = model.config._attn_implementation
        raise DataInputError(
            f"DDTree needs eager or sdpa attention; the target uses {backend}",
            hint="load the target with attn_implementation='sdpa'",
        )


def build_tree(slot_log_probs: torch.Tensor, budget: int, top_k: int | None = None) -> DraftTree:
    """Best-first tree over `slot_log_probs` [D, V] (row d-1 = slot d) under `budget` nodes (module docstring)."""
    check_options(budget, top_k)
    depth_limit, vocab = slot_log_probs.shape
    tree = DraftTree([], [], [], [])
    if depth_limit == 0:
        return tree
    k = min(top_k or budget, budget, vocab)
    top = slot_log_probs.float().topk(k, dim=-1)  # [D, k]: one sort per step, not per node
    values, ids = top.values.tolist(), top.indices.tolist()
    counter = 0  # heap tie-break: first pushed pops first
    # entry: (-score, counter, depth, rank, parent, parent_score)
    frontier = [(-values[0][0], counter, 1, 0, -1, 0.0)]
    while frontier and len(tree) < budget:
        neg_score, _, depth, rank, parent, parent_score = heapq.heappop(frontier)
        node = len(tree)
        tree.tokens.append(ids[depth - 1][rank])
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(-neg_score)
        if rank + 1 < k:
            counter += 1
            heapq.heappush(
                frontier,
                (-(parent_score + values[depth - 1][rank + 1]), counter, depth, rank + 1, parent, parent_score),
            )
        if depth < depth_limit:
            counter += 1
            heapq.heappush(frontier, (neg_score - values[depth][0], counter, depth + 1, 0, node, -neg_score))
    return tree


def tree_attention_mask(tree: DraftTree, cached: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, 1+N, cached+1+N]: query 0 = the anchor, query 1+i = node i; each sees the cached
    prefix, the anchor, its ancestors and itself."""
    size = 1 + len(tree)
    allowed = torch.zeros((size, cached + size), dtype=torch.bool)
    allowed[:, : cached + 1] = True  # prefix + anchor: seen by all
    for node, parent in enumerate(tree.parents):
        row = 1 + node
        if parent >= 0:
            allowed[row, cached + 1 :] = allowed[1 + parent, cached + 1 :]  # parents precede children: row is final
        allowed[row, cached + row] = True
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def accept(tree: DraftTree, choice: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance. `choice[0]` = the target's argmax after the anchor, `choice[1+i]` after node i.
    Returns (accepted node indices root->leaf, bonus token)."""
    children: dict[int, dict[int, int]] = {}
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault(parent, {})[token] = node  # siblings have distinct tokens (ranks)
    path, current = [], -1
    while (nxt := children.get(current, {}).get(choice[1 + current])) is not None:
        path.append(nxt)
        current = nxt
    return path, choice[1 + current]


def supports_tree_mask(model: Any) -> bool:
    """Only eager and sdpa attention apply a custom additive 4-D mask (flash ignores it, flex wants a BlockMask)."""
    return getattr(model.config, "_attn_implementation", "eager") in ("eager", "sdpa")


@torch.inference_mode()
def keep_cache_rows(cache: Any, start: int, rows: list[int]) -> None:
    """Keep cache positions [0, start) + `rows` (absolute, increasing, all >= start), packed in order; drop the rest.
    Uses `cache.layers[i].keys/values` ([batch, kv_heads, seq, head_dim]; transformers >= 4.56, so 5.17 and 5.24)."""
    index = None
    for layer in cache.layers:
        if index is None:
            index = torch.tensor(rows, dtype=torch.long, device=layer.keys.device)
        kept = len(rows)
        # index_select gathers into a new tensor before the write: no overlap hazard
        layer.keys[:, :, start : start + kept] = layer.keys.index_select(2, index)
        layer.values[:, :, start : start + kept] = layer.values.index_select(2, index)
    extra = cache.get_seq_length() - (start + len(rows))
    if extra > 0:
        cache.crop(-extra)


def ddtree_generate(
    runner: Any,
    prompt: list[int],
    slot_logits: Any,
    *,
    budget: int,
    top_k: int | None,
    slots: int,
    max_new_tokens: int,
    stops: set[int],
    stats: Any,
) -> list[int]:
    """Greedy speculative decoding of one prompt with DDTree verification; the same contract and bookkeeping as
    `trainer.evaluation.eval.speculative_generate` (tau = accepted + 1 per verify step, stop ids end the answer even inside
    an accepted path, per-depth acceptance in `stats`). `slot_logits(committed, taps, depth) -> [depth, V]`."""
    runner.reset()
    logits, taps = runner.forward(prompt)
    committed = prompt + [int(logits[-1].argmax())]
    forwards = 1
    while len(committed) - len(prompt) < max_new_tokens and committed[-1] not in stops:
        depth = min(slots, max_new_tokens - (len(committed) - len(prompt)) - 1)
        log_probs = (
            torch.log_softmax(slot_logits(committed, taps, depth)[:depth].float(), dim=-1)
            if depth > 0
            else torch.empty((0, 1))
        )
        tree = build_tree(log_probs, budget, top_k)
        n = len(committed)
        dtype = next(runner.model.parameters()).dtype
        mask = tree_attention_mask(tree, n - 1, dtype, taps.device)
        positions = torch.tensor([[n - 1] + [n - 1 + d for d in tree.depths]], device=taps.device)
        logits, new_taps = runner.forward([committed[-1]] + tree.tokens, position_ids=positions, attention_mask=mask)
        forwards += 1
        path, bonus = accept(tree, logits.argmax(-1).tolist())
        new_tokens, accepted, proposed = cut_at_stop(
            [tree.tokens[i] for i in path] + [bonus], len(path), max(tree.depths, default=0), stops
        )
        rows = [0] + [1 + i for i in path[: len(new_tokens) - 1]]  # anchor + kept nodes (forward row ids)
        committed += new_tokens
        taps = torch.cat([taps, new_taps[rows]])  # committed positions only
        keep_cache_rows(runner.cache, n - 1, [n - 1 + r for r in rows])
        stats.record_step(proposed, accepted, slots)
        stats.tree_nodes += len(tree)
    return finish_generation(committed, len(prompt), max_new_tokens, stops, stats, forwards)
