"""One tree speculation step on the device: draft a tree per sequence, verify it in one forward.

Draft step d (0..D-1) runs one MTP stage over two kinds of rows per sequence:

- *window* rows: cache entries of tokens already verified (step 0: seed 000's window, whose last
  row, the lm_head row, holds the fed token; MTP Vanilla's later steps: the entries its module d
  pairs with verified tokens). A window's last row holds the *root*: its output feeds the next
  step's depth-1 nodes (MTP Eagle has no window after step 0; step 0's root output feeds every step).
- *tree* rows: every expanded node of depth 1..d, in blocks by depth (``TreeShape.expanded``),
  each attending to the window, the context and its own ancestors (a tree mask). A node of
  depth e takes its token and the stage output of its parent (the previous step's row for the
  parent: MTP Vanilla's module d-1 for the same path; MTP Eagle recomputes the shallower blocks
  with the one module, since attention reaches only this forward's rows through the tree mask).

Candidates of depth d+1 are the top-k tokens of step d's logits at the expanded depth-d nodes,
scored by cumulative draft log-probability; the tree verified is ``TreeShape``'s selection. The
main model then runs [root, nodes...] per sequence at positions n-1 + depth with the
ancestor-or-self mask. Everything here is torch on the model's device: the tree structure
reaches the host once, with the verification's logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from mindspec.backend import LatentCache
from mindspec.modeling.draft_tree import TreeShape
from mindspec.modeling.forward_metadata import DeviceInputs, ModelInputs, to_device


@dataclass
class TreeStepHost:
    """One draft step as the drafter plugin builds it (plugins/mtp/tree_inputs.py)."""

    module_idx: int
    inputs: ModelInputs  # window rows then tree rows per sequence
    window_src: np.ndarray  # [T] previous step's row feeding each window row, -1 on tree rows
    window_lens: np.ndarray  # [B]
    tree_first: np.ndarray  # [B] flat row of each sequence's first tree row
    root_src: np.ndarray  # [B] see TreeDraftStep
    tree_visible: np.ndarray  # [B, R] bool: tree rows their descendants may attend (see TreeDraftStep)

    def to_device(self, device) -> "TreeDraftStep":
        def tensor(a):
            return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

        return TreeDraftStep(self.module_idx, to_device(self.inputs, device), tensor(self.window_src),
                             tensor(self.window_lens), tensor(self.tree_first), tensor(self.root_src),
                             torch.from_numpy(np.ascontiguousarray(self.tree_visible)).to(device))


@dataclass
class TreeDraftStep:
    """One draft step's device inputs (built on the host by the drafter plugin)."""

    module_idx: int
    inputs: DeviceInputs  # window rows then tree rows per sequence; tree rows' tokens are filled here
    window_src: torch.Tensor  # [T] row of the previous step's output feeding each window row (-1: tree row)
    window_lens: torch.Tensor  # [B] window rows per sequence (the last holds the root)
    tree_first: torch.Tensor  # [B] flat row of each sequence's first tree row
    root_src: torch.Tensor  # [B] the previous step's root row; past its rows: the appended root (eagle) or zeros
    # [B, R] bool: False for a row whose entry lies before position 0 (MTP Vanilla, a sequence
    # shorter than the path): it writes nothing and its descendants do not attend to it
    tree_visible: torch.Tensor


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, N + 1] row 0: the fed token, then the nodes in breadth-first order
    parents: torch.Tensor  # [B, N + 1] parent row of each row (-1: the root)
    depths: torch.Tensor  # [B, N + 1] drafts before the row's token (0: the root)


def ancestor_mask(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """parents [B, R] (parent row of each row, -1: none) -> [B, R, R] bool: row i may attend
    row j when j is i or one of its ancestors (at most ``depth`` generations up)."""
    b, r = parents.shape
    cols = torch.arange(r, device=parents.device)
    mask = (cols[:, None] == cols[None, :]).expand(b, r, r)
    up = cols.expand(b, r)
    for _ in range(depth):  # no early exit: the step stays free of host reads (captured, compiled)
        up = torch.where(up >= 0, parents.gather(1, up.clamp_min(0)), up)  # one generation further
        mask = mask | (up[:, :, None] == cols)  # up = -1 matches no column
    return mask


def step_mask(anc: torch.Tensor, window_lens: torch.Tensor, max_q: int) -> torch.Tensor:
    """[B, max_q, max_q] mask among a step's new rows: window rows causal, tree rows see every
    window row of their sequence and their ancestors (anc [B, R, R]); rows past a sequence's
    window and tree rows (padding) see its window."""
    b, r, _ = anc.shape
    w = window_lens[:, None, None]
    i = torch.arange(max_q, device=anc.device)[None, :, None]
    j = torch.arange(max_q, device=anc.device)[None, None, :]
    ti, tj = (i - w), (j - w)
    in_tree = (ti >= 0) & (ti < r) & (tj >= 0) & (tj < r)
    tree = anc.gather(1, ti.clamp(0, r - 1).expand(b, max_q, r))  # [B, max_q, R]
    tree = tree.gather(2, tj.clamp(0, r - 1).expand(b, max_q, max_q))
    return ((i < w) & (j <= i)) | ((ti >= 0) & (j < w)) | (in_tree & tree)


class TreeDrafter:
    """Draft steps and selection of one tree step (stateless between steps)."""

    def __init__(self, model, shape: TreeShape, eagle: bool):
        self.model = model
        self.shape = shape
        self.eagle = eagle
        self.device = model.backend.device
        self.parent_of = [torch.from_numpy(p).to(self.device) for p in shape.parent_of]
        self.rank_of = [torch.from_numpy(r).to(self.device) for r in shape.rank_of]
        self.chosen = [None if c is None else torch.from_numpy(c).to(self.device) for c in shape.chosen]
        self.block_first = np.concatenate([[0], np.cumsum(shape.expanded[1:])]).astype(np.int64)  # tree row of X_e
        self.offsets = np.concatenate([[0], np.cumsum(shape.candidates)]).astype(np.int64)  # flat index of depth d's
        self.depth_of = torch.from_numpy(np.repeat(np.arange(1, shape.depth + 1), shape.candidates)).to(self.device)

    def draft(self, steps: list[TreeDraftStep], first_hidden: torch.Tensor,
              caches: list[LatentCache]) -> tuple[torch.Tensor, ...]:
        """-> candidates per depth: tokens, scores, and the expanded candidates (see ``select``)."""
        shape, s0 = self.shape, steps[0]
        out = self._run(s0, s0.inputs.input_ids, first_hidden, None, caches)
        num_seqs = len(s0.window_lens)
        logits = out.logits.view(num_seqs, 1, -1)  # [B, E_0 = 1, V]
        root = out.hidden_states[s0.inputs.lm_head_indices]  # [B, H] step 0's root output (eagle)
        appended = root if self.eagle else torch.zeros_like(root)  # the row root_src points past the previous step's
        prev, prev_step = out.hidden_states, s0
        score = torch.zeros(num_seqs, 1, device=self.device)
        tokens, scores, exp_idx = [], [], []
        rows = _TreeRows(num_seqs, self.device)
        for d in range(1, shape.depth + 1):
            top_lp, top_ids = torch.log_softmax(logits.float(), dim=-1).topk(shape.top_k(d - 1), dim=-1)
            pe, rk = self.parent_of[d - 1], self.rank_of[d - 1]
            tokens.append(top_ids[:, pe, rk])  # [B, C_d]
            scores.append(score[:, pe] + top_lp[:, pe, rk])
            if d == shape.depth:
                break
            chosen = self.chosen[d - 1]
            idx = scores[-1].topk(shape.expanded[d], dim=-1).indices if chosen is None \
                else chosen.expand(num_seqs, -1)  # [B, E_d]
            exp_idx.append(idx)
            score = scores[-1].gather(1, idx)
            # block d's parents: the root (d = 1) or block d-1's node pe[idx]
            rows.add(tokens[-1].gather(1, idx), None if d == 1 else int(self.block_first[d - 2]) + pe[idx])
            step = steps[d]
            ids, src = rows.inputs(step, prev_step)
            anc = rows.visible(step.tree_visible)
            mask = step_mask(anc, step.window_lens, max(step.inputs.meta.q_lens_host))
            hidden = torch.cat([prev, appended])
            # the last step feeds no other: only its expanded rows run past attention
            out = self._run(step, ids, hidden[src], mask, caches, last=d == shape.depth - 1)
            logits = out.logits.view(num_seqs, shape.expanded[d], -1)
            prev, prev_step = out.hidden_states, step
        return tokens, scores, exp_idx

    def select(self, tokens, scores, exp_idx) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The nodes verified, breadth first: (tokens [B, N], parent rows [B, N] in 0..N, the
        root being row 0, depths [B, N] >= 1)."""
        shape = self.shape
        num_seqs = tokens[0].shape[0]
        flat_tokens, flat_scores = torch.cat(tokens, dim=1), torch.cat(scores, dim=1)  # [B, sum C]
        parent_flat = [torch.full((num_seqs, shape.candidates[0]), -1, dtype=torch.long, device=self.device)]
        for d in range(2, shape.depth + 1):  # depth d's parent: the expanded node exp_idx[d-2][parent_of]
            parent_flat.append(int(self.offsets[d - 2]) + exp_idx[d - 2][:, self.parent_of[d - 1]])
        parent_flat = torch.cat(parent_flat, dim=1)  # [B, sum C]
        if shape.dynamic:  # best scores; ties keep the shallower (a parent before its children)
            order = torch.sort(flat_scores, dim=1, descending=True, stable=True).indices[:, : shape.num_nodes]
            chosen = order.sort(dim=1).values  # breadth first
        else:
            chosen = torch.arange(flat_tokens.shape[1], device=self.device).expand(num_seqs, -1)
        row_of = torch.zeros_like(parent_flat)
        row_of.scatter_(1, chosen, torch.arange(1, shape.num_nodes + 1, device=self.device).expand(num_seqs, -1))
        parents = parent_flat.gather(1, chosen)
        parent_rows = torch.where(parents < 0, torch.zeros_like(parents), row_of.gather(1, parents.clamp_min(0)))
        return flat_tokens.gather(1, chosen), parent_rows, self.depth_of[chosen]

    def _run(self, step: TreeDraftStep, ids: torch.Tensor, hidden: torch.Tensor, mask: Optional[torch.Tensor],
             caches: list[LatentCache], last: bool = False):
        meta = step.inputs.meta
        meta.tree_mask = mask
        self.model.backend.prepare(meta)
        return self.model.forward_mtp(step.module_idx, ids, hidden, step.inputs.positions, caches, meta,
                                      step.inputs.lm_head_indices, lm_rows_out=last)


class _TreeRows:
    """The tree rows of the draft steps so far, grown by one block of expanded nodes per step:
    their tokens, parents (row within the tree rows, -1: the root) and ancestor mask."""

    def __init__(self, num_seqs: int, device):
        self.tokens = torch.zeros(num_seqs, 0, dtype=torch.long, device=device)
        self.parents = torch.zeros(num_seqs, 0, dtype=torch.long, device=device)
        self.anc = torch.zeros(num_seqs, 0, 0, dtype=torch.bool, device=device)
        self.device = device

    def add(self, tokens: torch.Tensor, parents: Optional[torch.Tensor]) -> None:
        """tokens [B, E] of the next block; parents [B, E] rows of the previous block (None: the root)."""
        b, e = tokens.shape
        r = self.tokens.shape[1]
        if parents is None:
            parents = torch.full_like(tokens, -1)
            inherited = torch.zeros(b, e, r, dtype=torch.bool, device=self.device)
        else:
            inherited = self.anc.gather(1, parents[:, :, None].expand(b, e, r))  # [B, E, R] the parent's ancestors
        eye = torch.eye(e, dtype=torch.bool, device=self.device).expand(b, e, e)
        top = torch.cat([self.anc, torch.zeros(b, r, e, dtype=torch.bool, device=self.device)], dim=2)
        self.anc = torch.cat([top, torch.cat([inherited, eye], dim=2)], dim=1)
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        self.parents = torch.cat([self.parents, parents], dim=1)

    def inputs(self, step: TreeDraftStep, prev_step: TreeDraftStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Step d's input tokens and the row of the previous step's output (or of the appended
        root row) feeding each of its rows."""
        flat = (step.tree_first[:, None] + torch.arange(self.tokens.shape[1], device=self.device)).reshape(-1)
        ids = step.inputs.input_ids.clone()
        ids[flat] = self.tokens.reshape(-1)
        parent_src = torch.where(self.parents < 0, step.root_src[:, None], prev_step.tree_first[:, None] + self.parents)
        src = step.window_src.clone()
        src[flat] = parent_src.reshape(-1)
        return ids, src

    def visible(self, tree_visible: torch.Tensor) -> torch.Tensor:
        """The ancestor mask less the rows a step hides (entries before position 0)."""
        r = self.anc.shape[1]
        return self.anc & (tree_visible[:, None, :] | torch.eye(r, dtype=torch.bool, device=self.device))


def verify_tree(model, drafter: TreeDrafter, main: DeviceInputs, steps: list[TreeDraftStep],
                first_hidden: torch.Tensor, caches: list[LatentCache]):
    """Draft the trees, then the main model over [root, nodes] per sequence -> (ModelOutput with
    logits of every row, DraftTree)."""
    tokens, scores, exp_idx = drafter.draft(steps, first_hidden, caches)
    node_tokens, node_parents, node_depths = drafter.select(tokens, scores, exp_idx)
    num_seqs = node_tokens.shape[0]
    root_ids = main.input_ids.view(num_seqs, -1)[:, :1]
    zero = torch.zeros_like(root_ids)
    tree = DraftTree(tokens=torch.cat([root_ids, node_tokens], dim=1),
                     parents=torch.cat([zero - 1, node_parents], dim=1),
                     depths=torch.cat([zero, node_depths], dim=1))
    meta = main.meta
    meta.tree_mask = ancestor_mask(tree.parents, drafter.shape.depth)
    model.backend.prepare(meta)
    positions = main.positions + tree.depths.reshape(-1)  # host positions are n-1 on every row
    out = model.forward(tree.tokens.reshape(-1), positions, caches, meta, main.lm_head_indices)
    return out, tree
