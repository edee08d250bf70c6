"""TreeShape: static trees from Medusa's tree_choices, dynamic (EAGLE-2) sizes, and their errors."""
import numpy as np
import pytest

from mindspec.modeling.draft_tree import MAX_TREE_NODES, TreeShape, TreeShapeError


def test_static_tree_levels_parents_and_ranks():
    shape = TreeShape.static([[1, 0], [0], [1], [0, 0], [0, 2], [0, 0, 1], [2]])
    assert shape.depth == 3 and shape.num_nodes == 7 and not shape.dynamic
    # depth 1: [0], [1], [2]; depth 2: [0, 0], [0, 2], [1, 0]; depth 3: [0, 0, 1]
    assert shape.candidates == (3, 3, 1)
    assert shape.expanded == (1, 2, 1)  # root; [0] and [1] have children; [0, 0] has
    assert shape.parent_of[0].tolist() == [0, 0, 0]
    assert shape.rank_of[0].tolist() == [0, 1, 2]
    assert shape.parent_of[1].tolist() == [0, 0, 1]  # [0, *] under expanded [0], [1, 0] under [1]
    assert shape.rank_of[1].tolist() == [0, 2, 0]
    assert shape.parent_of[2].tolist() == [0] and shape.rank_of[2].tolist() == [1]
    assert [c.tolist() for c in shape.chosen] == [[0, 1], [0]]
    assert shape.top_k(0) == 3 and shape.top_k(1) == 3 and shape.top_k(2) == 2
    assert shape.draft_rows == 3 and shape.lookahead == 7
    # rows: root, [0], [1], [2], [0, 0], [0, 2], [1, 0], [0, 0, 1]
    depth, rank, parents = shape.static_rows()
    assert depth.tolist() == [0, 1, 1, 1, 2, 2, 2, 3]
    assert rank.tolist() == [0, 1, 2, 0, 2, 0, 1]
    assert parents.tolist() == [-1, 0, 0, 0, 1, 1, 2, 4]


def test_chain_is_a_static_tree_of_one_path():
    shape = TreeShape.chain(3)
    assert shape.depth == 3 and shape.num_nodes == 3 and shape.expanded == (1, 1, 1)
    assert all(p.tolist() == [0] for p in shape.parent_of) and all(r.tolist() == [0] for r in shape.rank_of)


def test_dynamic_tree_sizes():
    shape = TreeShape.dynamic_tree(depth=4, topk=3, num_nodes=10)
    assert shape.dynamic and shape.expanded == (1, 3, 3, 3)
    assert shape.candidates == (3, 9, 9, 9)
    assert shape.parent_of[1].tolist() == np.repeat([0, 1, 2], 3).tolist()
    assert shape.rank_of[1].tolist() == [0, 1, 2] * 3
    assert shape.chosen == (None, None, None)
    assert shape.lookahead == max(10, 9)
    narrow = TreeShape.dynamic_tree(depth=2, topk=1, num_nodes=2)
    assert narrow.expanded == (1, 1) and narrow.candidates == (1, 1)


@pytest.mark.parametrize("choices, message", [
    ([], "non-empty list"),
    ("[[0]]", "non-empty list"),
    ([[0], []], "non-empty list of top-k ranks"),
    ([[0], [-1]], "ranks >= 0"),
    ([[0], [True]], "ranks >= 0"),
    ([[0], [0]], "appears twice"),
    ([[0, 1]], "needs its parent [0]"),
    ([[i] for i in range(MAX_TREE_NODES + 1)], f"at most {MAX_TREE_NODES}"),
])
def test_bad_tree_choices_name_the_problem(choices, message):
    with pytest.raises(TreeShapeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TreeShape.static(choices)


def test_dynamic_tree_needs_a_reachable_node_count():
    with pytest.raises(TreeShapeError, match="num_draft_tokens must be in 1..6"):
        TreeShape.dynamic_tree(depth=2, topk=2, num_nodes=7)
    with pytest.raises(TreeShapeError, match="depth >= 1"):
        TreeShape.dynamic_tree(depth=0, topk=2, num_nodes=1)
