"""Walking a grammar matcher through draft tokens: one mask per verification row, and the
longest accepted prefix the format allows. The matcher is left where it started."""
from __future__ import annotations

from typing import Any

import torch


def full_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 host bitmask with every token allowed (xgrammar's layout)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_row_masks(matcher: Any, prefixes: list[list[int]], bitmask: torch.Tensor, first_row: int) -> None:
    """Row ``first_row + i`` of ``bitmask`` gets the mask of the state after ``prefixes[i]``.
    Rows in tree or chain order share their paths' common prefixes (a chain's rows: the drafts
    before each, one token longer each time, so each draft is accepted once). A row whose
    prefix the format refuses cannot be reached: it gets the mask of the longest prefix the
    format accepts, and a row past the end (a stop token) keeps all tokens."""
    path: list[int] = []
    for i, prefix in enumerate(prefixes):
        common = _common_length(path, prefix)
        if len(path) > common:
            matcher.rollback(len(path) - common)
            del path[common:]
        for token in prefix[common:]:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                break
            path.append(int(token))
        if not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, first_row + i)
    if path:
        matcher.rollback(len(path))


def accepted_prefix_length(matcher: Any, tokens: list[int]) -> int:
    """How many leading ``tokens`` the format accepts from the matcher's state (which is kept)."""
    n = 0
    for token in tokens:
        if matcher.is_terminated() or not matcher.accept_token(int(token)):
            break
        n += 1
    if n:
        matcher.rollback(n)
    return n


def _common_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
