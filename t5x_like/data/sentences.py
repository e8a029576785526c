"""A rule-based sentence splitter that needs no downloads.

`split_sentences(doc)` returns contiguous substrings covering the document, so
`"".join(split_sentences(doc)) == doc` always holds. Whitespace between two sentences
is attached to the START of the following one ("Hi. There." -> ["Hi.", " There."]):
with sentencepiece's "▁" marking a preceding space, every sentence then begins with a
word-start piece, and decoding the concatenated tokens of a document gives back the
document exactly.

Rules, in order:
  1. a blank line (paragraph break) always ends a sentence;
  2. a run of . ! ? (plus closing quotes / brackets) followed by whitespace and an
     uppercase letter, a digit or an opening quote / bracket ends a sentence, unless
     the run is a single "." after a known abbreviation (Mr. Dr. St. ...) or a
     single-letter initial (H. G. Wells);
  3. any piece still longer than `max_chars` is cut at its last whitespace before the
     limit (or hard at the limit when there is none), so no piece is huge.
Whitespace left at the very end of a document stays with the last sentence.
"""

from __future__ import annotations

import re

# Lowercase, without the dot. "etc" is left out on purpose: it usually ends a sentence.
ABBREVIATIONS = frozenset("""
  mr mrs ms messrs mme mlle dr st jr sr prof rev revd hon gen col capt cpt lt sgt cmdr
  adm maj gov pres supt esq mt ft no nos vol vols ch chap fig figs pp op cf vs viz
  jan feb mar apr jun jul aug sep sept oct nov dec inc ltd co corp dept univ
""".split())

OPENERS = frozenset("\"'“‘([_")
# Sentence-final punctuation, closing quotes/brackets, then the whitespace after them.
_END = re.compile(r"[.!?]+[\"'”’)\]_]*(\s+)")
# A blank line: only spaces/tabs between two newlines (a literal "\n" first: fast scan).
_PARAGRAPH = re.compile(r"\n[ \t]*\n")
_WORD_BEFORE = re.compile(r"(\w+)$")
_LAST_SPACE = re.compile(r"(?<=\S)\s")


def split_sentences(doc: str, *, max_chars: int = 2000) -> list[str]:
  """Sentences of `doc`: contiguous substrings, "".join(result) == doc.

  Returns [] for "" and [doc] for a document without any boundary.
  """
  if not doc:
    return []
  cuts = sorted(_paragraph_cuts(doc) | _sentence_cuts(doc))
  starts = [0] + cuts
  ends = cuts + [len(doc)]
  pieces = []
  for start, end in zip(starts, ends):
    if end - start > max_chars:
      pieces.extend(_split_long(doc, start, end, max_chars))
    else:
      pieces.append(doc[start:end])
  return pieces


def _paragraph_cuts(doc: str) -> set[int]:
  """Cut positions (start of the whitespace) at blank lines followed by more text."""
  text_end = len(doc.rstrip())  # a cut needs some text after it
  cuts = set()
  for m in _PARAGRAPH.finditer(doc):
    cut = m.start()
    while cut > 0 and doc[cut - 1] in " \t":  # trailing spaces go with the break
      cut -= 1
    if 0 < cut and m.end() < text_end:
      cuts.add(cut)
  return cuts


def _sentence_cuts(doc: str) -> set[int]:
  """Cut positions (start of the whitespace) after sentence-final punctuation."""
  cuts = set()
  n = len(doc)
  for m in _END.finditer(doc):
    nxt = m.end()
    if nxt >= n:
      continue
    c = doc[nxt]
    if not (c.isupper() or c.isdigit() or c in OPENERS):
      continue
    punct = doc[m.start():m.start(1)]
    if punct == "." and _is_abbreviation(doc, m.start()):
      continue
    cuts.add(m.start(1))
  return cuts


def _is_abbreviation(doc: str, dot: int) -> bool:
  """Whether the word just before doc[dot] == '.' is an abbreviation or an initial."""
  word = _WORD_BEFORE.search(doc, max(0, dot - 12), dot)
  if word is None:
    return False
  w = word.group(1)
  return (len(w) == 1 and w.isalpha()) or w.lower() in ABBREVIATIONS


def _split_long(doc: str, start: int, end: int, max_chars: int) -> list[str]:
  """doc[start:end] in pieces of at most max_chars, cut where whitespace begins."""
  pieces = []
  while end - start > max_chars:
    limit = start + max_chars
    cut = None
    for m in _LAST_SPACE.finditer(doc, start + 1, limit + 1):
      cut = m.start()
    if cut is None or cut <= start:
      cut = limit
    pieces.append(doc[start:cut])
    start = cut
  pieces.append(doc[start:end])
  return pieces
