"""Tree drafting on the device against brute-force references: the ancestor and step masks, and
the trees TreeDrafter builds (static and dynamic, MTP Vanilla and Eagle row routing) with a toy
attention-free drafter whose outputs depend only on each row's token, input hidden state and
module, so a recursive walk over paths predicts every candidate."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mindspec.modeling.draft_tree import TreeShape
from mindspec.modeling.tree_speculation import TreeDrafter, ancestor_mask, step_mask
from mindspec.models.deepseekv2.flash_causal_deepseekv2 import ModelOutput
from mindspec.plugins.mtp import decode_inputs as di
from mindspec.plugins.mtp import tree_inputs as ti

VOCAB, HIDDEN, MODULES = 13, 6, 4


def _brute_ancestors(parents):
    r = len(parents)
    m = np.eye(r, dtype=bool)
    for i in range(r):
        j = parents[i]
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def test_ancestor_mask_matches_walking_up():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3, 2, 6], [-1, 0, 1, 2, 3, 4, 5, 6]])
    got = ancestor_mask(parents, depth=7)
    for b in range(2):
        assert np.array_equal(got[b].numpy(), _brute_ancestors(parents[b].tolist()))
    # with too few generations the deepest ancestors are missing
    assert not ancestor_mask(parents, depth=2)[1, 7, 0]


def test_step_mask_window_causal_tree_rows_see_window_and_ancestors():
    anc = ancestor_mask(torch.tensor([[-1, -1, 0], [-1, 0, 1]]), 2)  # two sequences, 3 tree rows each
    window = torch.tensor([2, 0])
    mask = step_mask(anc, window, max_q=5)
    for b in range(2):
        w = window[b]
        for i in range(w + 3):
            for j in range(w + 3):
                if i < w:
                    want = j <= i
                else:
                    want = j < w or (j >= w and bool(anc[b, i - w, j - w]))
                assert bool(mask[b, i, j]) == want, (b, i, j)


class ToyDrafter:
    """forward_mtp without attention: h = tanh(hidden + E[token] + module), logits = h @ W[module]."""

    def __init__(self, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        self.heads = torch.randn(MODULES, HIDDEN, VOCAB, generator=g) * 3
        self.backend = SimpleNamespace(device=torch.device("cpu"), prepare=lambda meta: None)

    def out(self, token, hidden, module):
        return torch.tanh(hidden + self.embed[token] + module)

    def forward_mtp(self, module_idx, ids, hidden, positions, caches, meta, lm_head_indices, lm_rows_out=False):
        h = self.out(ids, hidden, module_idx)
        return ModelOutput(logits=(h[lm_head_indices] @ self.heads[module_idx]), hidden_states=h)


def _reference_tree(toy, shape, eagle, tokens, main_hidden, n):
    """Per sequence: [(path tokens, depth, parent index or -1)] in the drafter's row order."""

    def out_at(module, entry, path):
        """Module ``module``'s output at MTP entry ``entry`` along ``path`` (MTP Vanilla)."""
        j = entry + 1 + module  # the token the entry pairs
        tok = tokens[j] if j <= n - 1 else path[j - n]
        hidden = main_hidden[entry] if module == 0 else out_at(module - 1, entry, path)
        return toy.out(torch.tensor(tok), hidden, module)

    def eagle_out(path):
        h = toy.out(torch.tensor(tokens[n - 1]), main_hidden[n - 2], 0)
        for tok in path:
            h = toy.out(torch.tensor(tok), h, 0)
        return h

    def logits(path):  # the distribution that expands the node at ``path``
        d = len(path)
        h = eagle_out(path) if eagle else out_at(d, n - 2, path)
        return torch.log_softmax(h @ toy.heads[0 if eagle else d], dim=-1)

    # candidates per depth: (path, score, parent candidate index or -1), expanded in shape order
    expanded = [((), 0.0, -1)]
    levels = []
    for d in range(1, shape.depth + 1):
        cands = []
        for parent_e, rank in zip(shape.parent_of[d - 1], shape.rank_of[d - 1]):
            path, score, _ = expanded[parent_e]
            lp = logits(path)
            top = lp.topk(shape.top_k(d - 1))
            cands.append((path + (int(top.indices[rank]),), score + float(top.values[rank]), path))
        levels.append(cands)
        if d < shape.depth:
            if shape.chosen[d - 1] is None:
                order = sorted(range(len(cands)), key=lambda i: -cands[i][1])[: shape.expanded[d]]
            else:
                order = shape.chosen[d - 1].tolist()
            expanded = [cands[i] for i in order]
    flat = [c for level in levels for c in level]
    if shape.dynamic:
        keep = sorted(sorted(range(len(flat)), key=lambda i: -flat[i][1])[: shape.num_nodes])
    else:
        keep = list(range(len(flat)))
    paths = [flat[i][0] for i in keep]
    row = {p: r + 1 for r, p in enumerate(paths)}
    return [(p, len(p), row.get(p[:-1], 0)) for p in paths]


@pytest.mark.parametrize("eagle", [False, True], ids=["vanilla", "eagle"])
@pytest.mark.parametrize("shape", [
    TreeShape.static([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 1]]),
    TreeShape.dynamic_tree(depth=3, topk=3, num_nodes=8),
    TreeShape.dynamic_tree(depth=2, topk=4, num_nodes=11),
], ids=["static", "dynamic", "dynamic_wide"])
def test_drafted_trees_match_a_walk_over_paths(shape, eagle):
    toy = ToyDrafter()
    rng = np.random.default_rng(0)
    lengths = [9, 14, 7]
    tokens = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    main_hidden = [torch.randn(n, HIDDEN) for n in lengths]
    num_tokens = np.array(lengths, dtype=np.int64)
    last_accepted = np.array([1, 3, 2], dtype=np.int64)
    layout = di.decode_layout(num_tokens, last_accepted, shape.depth, "eagle" if eagle else "vanilla",
                              np.zeros(3, dtype=np.int64))
    tables = np.arange(3 * 8, dtype=np.int32).reshape(3, 8)
    tails = [t[di.window_offset(int(start)):] for t, start in zip(tokens, layout.start)]
    steps = ti.draft_steps(tails, layout, tables, 4, shape, eagle, np.zeros(3, dtype=np.int64), 99)
    seq_idx, positions = ti.hidden_positions(layout)
    first_hidden = torch.stack([main_hidden[b][p] for b, p in zip(seq_idx, positions)])
    drafter = TreeDrafter(toy, shape, eagle)
    got = drafter.select(*drafter.draft([s.to_device("cpu") for s in steps], first_hidden, []))
    node_tokens, parents, depths = (t.numpy() for t in got)
    for b in range(3):
        want = _reference_tree(toy, shape, eagle, tokens[b], main_hidden[b], lengths[b])
        assert [p[-1] for p, _, _ in want] == node_tokens[b].tolist()
        assert [d for _, d, _ in want] == depths[b].tolist()
        assert [r for _, _, r in want] == parents[b].tolist()
