"""Row masks along drafts equal the masks of fresh matchers fed each row's prefix (xgrammar as
the reference, without our walk and rollbacks), for chains, trees, refused drafts and a stop
token; the matcher ends where it started."""
import numpy as np
import pytest
import torch

from mindspec.config.defaults import DEFAULT_MODEL_DIR
from mindspec.plugins.structured_output.grammars import GrammarCompilerCache, StructuredOutputError
from mindspec.plugins.structured_output.row_masks import accepted_prefix_length, fill_row_masks
from mindspec.text_generator.sampling.sampler import unpack_bitmask
from mindspec.text_generator.tokenizer import load_tokenizer

EOS = 1
SCHEMA = ('{"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, '
          '"n": {"type": "integer"}}, "required": ["name", "n"]}')


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def grammars(tok):
    return GrammarCompilerCache(tok.hf_tokenizer, 4096, [EOS])


def _reference(grammars, key, prefix):
    """[V] bool from a fresh matcher fed ``prefix`` (None: it refuses a token of it)."""
    m = grammars.matcher(key)
    for t in prefix:
        if not m.accept_token(t):
            return None
    mask = torch.zeros(1, 128, dtype=torch.int32)
    m.fill_next_token_bitmask(mask)
    return unpack_bitmask(mask, 4096)[0]


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_chain_rows_equal_fresh_matchers(tok, grammars):
    key = ("json_schema", SCHEMA)
    drafts = _ids(tok, '{"name": "ab", "n": 12}')
    committed = drafts[:3]
    m = grammars.matcher(key)
    for t in committed:
        assert m.accept_token(t)
    rest = drafts[3:]
    prefixes = [rest[:j] for j in range(len(rest) + 1)]
    bitmask = torch.zeros(len(prefixes), 128, dtype=torch.int32)
    fill_row_masks(m, prefixes, bitmask, 0)
    got = unpack_bitmask(bitmask, 4096)
    for row, prefix in enumerate(prefixes):
        assert torch.equal(got[row], _reference(grammars, key, committed + prefix)), row
    assert got[-1].nonzero().flatten().tolist() == [EOS]  # the object is complete: only the stop token
    # the matcher was left at the committed state
    assert torch.equal(_fill(m), _reference(grammars, key, committed))


def _fill(m):
    mask = torch.zeros(1, 128, dtype=torch.int32)
    m.fill_next_token_bitmask(mask)
    return unpack_bitmask(mask, 4096)[0]


def test_tree_rows_and_refused_drafts(tok, grammars):
    key = ("regex", r"(cat|car|dog)s?")
    c, a, t, r, d = (_ids(tok, x)[0] for x in "catrd")
    prefixes = [[], [c], [c, a], [c, a, t], [c, a, r], [d], [c, d], [c, d, a]]  # a tree, paths in any order
    m = grammars.matcher(key)
    bitmask = torch.zeros(len(prefixes), 128, dtype=torch.int32)
    fill_row_masks(m, prefixes, bitmask, 0)
    got = unpack_bitmask(bitmask, 4096)
    for row, prefix in enumerate(prefixes):
        ref = _reference(grammars, key, prefix)
        if ref is None:  # refused: the mask of its longest accepted prefix
            n = accepted_prefix_length(grammars.matcher(key), prefix)
            ref = _reference(grammars, key, prefix[:n])
        assert torch.equal(got[row], ref), prefix
    assert torch.equal(_fill(m), _reference(grammars, key, []))


def test_rows_after_a_stop_token_keep_every_token(tok, grammars):
    key = ("choice", '["yes", "no"]')
    yes = _ids(tok, "yes")
    m = grammars.matcher(key)
    prefixes = [yes, yes + [EOS]]
    bitmask = torch.zeros(2, 128, dtype=torch.int32)
    bitmask[1] = -1
    fill_row_masks(m, prefixes, bitmask, 0)
    assert unpack_bitmask(bitmask, 4096)[0].nonzero().flatten().tolist() == [EOS]
    assert bool(unpack_bitmask(bitmask, 4096)[1].all())
    assert not m.is_terminated() and torch.equal(_fill(m), _reference(grammars, key, []))


def test_accepted_prefix_length(tok, grammars):
    key = ("regex", "[0-9]+")
    m = grammars.matcher(key)
    digits, word = _ids(tok, "12"), _ids(tok, "x")
    assert accepted_prefix_length(m, digits + word + digits) == len(digits)
    assert accepted_prefix_length(m, digits + [EOS]) == len(digits) + 1
    assert accepted_prefix_length(m, word) == 0
    assert torch.equal(_fill(m), _reference(grammars, key, []))


@pytest.mark.parametrize("key, message", [
    (("json_schema", '{"type": "objectx"}'), 'invalid json_schema: Unsupported type "objectx"'),
    (("regex", "a("), "invalid regex: Regex parsing error at position 3"),
    (("grammar", "root ::= foo"), 'invalid grammar: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
])
def test_bad_formats_name_their_field(grammars, key, message):
    with pytest.raises(StructuredOutputError, match="^" + message) as info:
        grammars.compile(key)
    assert info.value.field == key[0]


def test_compiled_grammars_are_cached(grammars):
    key = ("regex", "[a-z]{3}")
    assert grammars.compile(key) is grammars.compile(key)


def test_unpack_bitmask_matches_bits():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, 70)) < 0.5
    words = np.zeros((3, 3), dtype=np.int64)
    for r, t in zip(*np.nonzero(allowed)):
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    assert torch.equal(unpack_bitmask(bitmask, 70), torch.from_numpy(allowed))


def test_bounded_json_strings_refuse_control_characters(grammars):
    """JSON forbids raw control characters in strings; xgrammar's bounded-string class lets them
    through unless the grammar is mended (grammars.py)."""
    key = ("json_schema", '{"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, '
                          '"b": {"type": "string", "minLength": 1}}, "required": ["a", "b"]}')
    for doc, valid in [('{"a": "x\x0b", "b": "y"}', False),
                       ('{"a": "x", "b": "\x01"}', False), ('{"a": "xyz", "b": "yes"}', True)]:
        m = grammars.matcher(key)
        assert (m.accept_string(doc) and m.accept_token(EOS)) == valid, doc
