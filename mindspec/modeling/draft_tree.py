"""The shape of a draft tree: which nodes each draft step expands and how many candidates it makes.

A tree of depth D grows one level per draft step. Step d (0..D-1) runs the drafter over the
*expanded* nodes of depth d (the root, the fed last token, at depth 0) and takes the top-k tokens
of each one's distribution as the *candidates* of depth d+1. Every sequence of a batch has a tree
of the same shape sizes, so each step has static row counts:

- static (Medusa's ``tree_choices``): a node is a path of top-k ranks, ``[0, 1]`` = the second
  candidate of the first candidate. Every node is a candidate; the expanded nodes are those with
  children. The tree is the same for every sequence and step.
- dynamic (EAGLE-2): each expanded node makes ``topk`` candidates; the ``topk`` candidates of
  depth d with the highest cumulative draft log-probability are expanded; the tree verified is
  the ``num_nodes`` candidates of any depth with the highest cumulative log-probability (a child's
  is at most its parent's, so the best nodes always include their ancestors).

A chain of K drafts is the static tree ``[[0], [0, 0], ...]``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

MAX_TREE_NODES = 64  # verification rows per sequence less the fed token


class TreeShapeError(ValueError):
    """A tree description that cannot be drafted."""


@dataclass(frozen=True)
class TreeShape:
    depth: int  # D: draft steps, the longest path of drafts
    expanded: tuple[int, ...]  # [D] E_d: nodes of depth d a draft step runs over (E_0 = 1: the root)
    # per depth d = 1..D (index d - 1): of each candidate, its parent's index among the expanded
    # nodes of depth d - 1 and its rank in that parent's top-k
    parent_of: tuple[np.ndarray, ...]
    rank_of: tuple[np.ndarray, ...]
    # per depth d = 1..D-1 (index d - 1): the candidates expanded ([E_d] indices), None: the E_d
    # with the highest scores (dynamic)
    chosen: tuple[Optional[np.ndarray], ...]
    num_nodes: int  # N: nodes verified besides the root
    dynamic: bool

    @property
    def key(self) -> tuple:
        """The shape by value, hashable (a compiled or captured tree step is specialised on it)."""
        def arrays(xs):
            return tuple(None if x is None else tuple(int(v) for v in x) for x in xs)

        return (self.depth, self.expanded, arrays(self.parent_of), arrays(self.rank_of), arrays(self.chosen),
                self.num_nodes, self.dynamic)

    @property
    def candidates(self) -> tuple[int, ...]:
        """[D] C_d: candidates of depth d = 1..D."""
        return tuple(len(p) for p in self.parent_of)

    def top_k(self, d: int) -> int:
        """How many tokens step d takes from each distribution (the highest rank it uses + 1)."""
        return int(self.rank_of[d].max()) + 1

    @property
    def draft_rows(self) -> int:
        """Tree rows of the deepest draft step: every expanded node of depth 1..D-1."""
        return sum(self.expanded[1:])

    @property
    def lookahead(self) -> int:
        """KV positions past the last token a tree step writes: its verification rows and the
        drafter's tree rows (decode_inputs: they sit after the sequence's entries)."""
        return max(self.num_nodes, self.draft_rows)

    def static_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A static tree's verification rows, breadth first, row 0 the root: (depth [N + 1], each
        node's top-k rank [N], parent row [N + 1], -1 for the root)."""
        offsets = np.concatenate([[0], np.cumsum(self.candidates)])
        parents = [np.full(1, -1), np.zeros(self.candidates[0], dtype=np.int64)]  # the root; depth 1's
        for d in range(2, self.depth + 1):  # the expanded parent's row: 1 + its candidate index at depth d-1
            parents.append(1 + offsets[d - 2] + self.chosen[d - 2][self.parent_of[d - 1]])
        depth = np.concatenate([[0], np.repeat(np.arange(1, self.depth + 1), self.candidates)])
        return depth.astype(np.int64), np.concatenate(self.rank_of), np.concatenate(parents).astype(np.int64)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def static(cls, choices: Sequence[Sequence[int]]) -> "TreeShape":
        paths = _validated_paths(choices)
        depth = max(len(p) for p in paths)
        by_depth = [[p for p in paths if len(p) == d] for d in range(1, depth + 1)]
        with_children = {p[:-1] for p in paths}
        expanded_paths = [[()]] + [[p for p in level if p in with_children] for level in by_depth[:-1]]
        parent_of, rank_of, chosen = [], [], []
        for d, level in enumerate(by_depth, start=1):
            parents = {p: i for i, p in enumerate(expanded_paths[d - 1])}
            parent_of.append(np.array([parents[p[:-1]] for p in level], dtype=np.int64))
            rank_of.append(np.array([p[-1] for p in level], dtype=np.int64))
            if d < depth:
                chosen.append(np.array([i for i, p in enumerate(level) if p in with_children], dtype=np.int64))
        return cls(depth=depth, expanded=tuple(len(e) for e in expanded_paths), parent_of=tuple(parent_of),
                   rank_of=tuple(rank_of), chosen=tuple(chosen), num_nodes=len(paths), dynamic=False)

    @classmethod
    def dynamic_tree(cls, depth: int, topk: int, num_nodes: int) -> "TreeShape":
        if depth < 1 or topk < 1:
            raise TreeShapeError(f"a dynamic tree needs depth >= 1 and topk >= 1, got {depth} and {topk}")
        expanded, parent_of, rank_of = [1], [], []
        for d in range(1, depth + 1):
            parent_of.append(np.repeat(np.arange(expanded[-1], dtype=np.int64), topk))
            rank_of.append(np.tile(np.arange(topk, dtype=np.int64), expanded[-1]))
            if d < depth:
                expanded.append(min(topk, len(parent_of[-1])))
        total = sum(len(p) for p in parent_of)
        if not 1 <= num_nodes <= min(total, MAX_TREE_NODES):
            raise TreeShapeError(f"num_draft_tokens must be in 1..{min(total, MAX_TREE_NODES)} for depth {depth} "
                                 f"and tree_topk {topk} (the tree makes {total} candidates), got {num_nodes}")
        return cls(depth=depth, expanded=tuple(expanded), parent_of=tuple(parent_of), rank_of=tuple(rank_of),
                   chosen=(None,) * (depth - 1), num_nodes=num_nodes, dynamic=True)

    @classmethod
    def chain(cls, k: int) -> "TreeShape":
        return cls.static([[0] * d for d in range(1, k + 1)])


def _validated_paths(choices: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Medusa's tree_choices as tuples, sorted by depth then path; every prefix must be a node."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise TreeShapeError(f"tree_choices must be a non-empty list of paths such as [[0], [1], [0, 0]], got {choices!r}")
    paths = []
    for c in choices:
        ok = isinstance(c, (list, tuple)) and len(c) > 0 and all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in c)
        if not ok:
            raise TreeShapeError(f"tree_choices: each path is a non-empty list of top-k ranks >= 0, got {c!r}")
        paths.append(tuple(c))
    if len(set(paths)) != len(paths):
        raise TreeShapeError("tree_choices: a path appears twice")
    if len(paths) > MAX_TREE_NODES:
        raise TreeShapeError(f"tree_choices: at most {MAX_TREE_NODES} nodes, got {len(paths)}")
    known = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in known:
            raise TreeShapeError(f"tree_choices: path {list(p)} needs its parent {list(p[:-1])} in the tree")
    return sorted(paths, key=lambda p: (len(p), p))
