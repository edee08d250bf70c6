"""What a benchmark's prompts ask the model to write (``mindspec bench --workload``).

- ``continue``: a window of a held-out file, continued (corpus.heldout_prompts): the text the
  MTP modules were trained to predict, nothing to copy.
- ``edit``: a function from a held-out file, then a comment asking for the same function under
  another name, then its new ``def`` line: the output copies most of the prompt, as a code
  assistant's edit request does (the case suffix drafting is for).
- ``mixed``: continue and edit prompts alternating, half each.

Every prompt comes from the files held out of the shipped model's training.
"""
from __future__ import annotations

import ast
import textwrap

import numpy as np

from .corpus import corpus_files, heldout_prompts, read

WORKLOADS = ("continue", "edit", "mixed")
EDIT_LINES = (6, 30)  # functions of this many lines: long enough to copy, short enough for the prompt
EDIT_PROMPT_TOKENS = 384  # the longest edit prompt


def prompts_for(workload: str, tokenizer, count: int, prompt_tokens: int) -> list[list[int]]:
    if workload == "continue":
        return heldout_prompts(tokenizer, count, prompt_tokens)
    if workload == "edit":
        return edit_prompts(tokenizer, count)
    if workload == "mixed":
        cont = heldout_prompts(tokenizer, (count + 1) // 2, prompt_tokens)
        edit = edit_prompts(tokenizer, count // 2)
        return [p for pair in zip(cont, edit + [None]) for p in pair if p is not None][:count]
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")


def max_prompt_tokens(workload: str, prompt_tokens: int) -> int:
    """The longest prompt a workload makes (BOS included), for sizing the KV cache."""
    return prompt_tokens + 1 if workload == "continue" else max(prompt_tokens + 1, EDIT_PROMPT_TOKENS)


def edit_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """``count`` edit prompts (BOS first), round robin over the held-out files' functions."""
    per_file = [fs for fs in (_functions(read(p)) for p in corpus_files()[1]) if fs]
    rng = np.random.default_rng(seed)
    for fs in per_file:
        rng.shuffle(fs)
    prompts: list[list[int]] = []
    taken = [0] * len(per_file)
    while len(prompts) < count:
        progressed = False
        for i, fs in enumerate(per_file):
            while taken[i] < len(fs) and len(prompts) < count:
                name, source = fs[taken[i]]
                taken[i] += 1
                ids = [tokenizer.bos_token_id] + tokenizer.encode(edit_text(name, source), add_special_tokens=False)
                if len(ids) <= EDIT_PROMPT_TOKENS:
                    prompts.append(ids)
                    progressed = True
                    break
        if not progressed:
            raise ValueError(f"the held-out files have {len(prompts)} functions that fit an edit prompt, {count} asked")
    return prompts


def edit_text(name: str, source: str) -> str:
    """The function, the request, and the start of the answer: its def line under the new name."""
    new = f"{name}_v2"
    header = source.split("\n", 1)[0].replace(f"def {name}(", f"def {new}(", 1)
    return f"{source}\n\n\n# The same function, renamed to {new}:\n{header}\n"


def _functions(text: str) -> list[tuple[str, str]]:
    """(name, dedented source) of the functions and methods of EDIT_LINES lines, without decorators."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        length = node.end_lineno - node.lineno + 1
        if EDIT_LINES[0] <= length <= EDIT_LINES[1]:
            source = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
            if source.startswith(("def ", "async def ")) and f"def {node.name}(" in source.split("\n", 1)[0]:
                out.append((node.name, source))
    return out
