"""Fine-tuning tasks built from any text source: authorship, acceptability, coherence.

  build_text_task("acceptability", "text:my_books/*.txt", "workdir/accept", per_class=256)
      -> workdir/accept/{train,dev,test}.csv and stats.json (also returned)

Three kinds, each a balanced classification the `finetune` command reads:

  authorship      which author wrote a passage of `passage_words` words (column text);
                  the author is a document's name up to its first "_"
                  (`carroll_alices_adventures_in_wonderland.txt` -> carroll), so the
                  classes are authors and several books of one author share a class
  acceptability   CoLA-style (Warstadt et al. 2019): a sentence as written
                  ("acceptable") or with one local corruption ("unacceptable"): two
                  neighbouring lowercase words swapped, or one function word replaced
                  by a frequent function word of another part of speech. Every chosen
                  sentence gives both versions, to the same split, so the two classes
                  hold the same words (swaps: the same bag of words exactly)
  coherence       two sentences (columns text, text_pair): consecutive in the document
                  ("consecutive") or the second drawn from elsewhere in the same
                  document, at least `min_distance` sentences away ("elsewhere"): harder
                  than BERT's next-sentence negatives, which come from other documents

Splits are held out by position, not by example: every document is cut into `regions`
regions of consecutive sentences (words for authorship), and region r goes to train
(r % 5 in 0, 1, 2), dev (3) or test (4). No sentence occurs in two splits (a sentence
seen twice in the source is kept once), and coherence negatives come from the same
split. `per_class` keeps that many training examples per label (acceptability: that
many sentences, each with both versions); dev and test are kept whole. The seed picks
that subset only (and the order of train.csv): the examples themselves are a function
of the source and the options, so runs at every label count and seed are scored on the
same dev and test.
"""

from __future__ import annotations

import collections
import csv
import json
import os
import random
import re
from typing import Optional, Sequence

from t5x_like.data.sentences import split_sentences
from t5x_like.data.sources import source_from_spec
from t5x_like.errors import UserError

KINDS = ("authorship", "acceptability", "coherence")
SPLITS = ("train", "dev", "test")
LABELS = {"acceptability": ("acceptable", "unacceptable"),
          "coherence": ("consecutive", "elsewhere")}

# Frequent function words by part of speech (unambiguous ones: no "that", "her", "as").
# A replacement takes a word of one class and puts one of another class in its place.
FUNCTION_WORDS = {
    "determiner": ("the", "a", "an", "this", "these", "those", "his", "its", "their", "my",
                   "your", "our", "every", "each"),
    "preposition": ("of", "in", "to", "with", "for", "on", "at", "from", "by", "upon",
                    "into", "about"),
    "pronoun": ("he", "she", "they", "we", "you"),
    "auxiliary": ("was", "were", "is", "had", "have", "would", "could", "will", "did",
                  "are"),
    "conjunction": ("and", "but", "or", "nor"),
}
_WORD_CLASS = {w: pos for pos, words in FUNCTION_WORDS.items() for w in words}
_LOWER_WORD = re.compile(r"[a-z]+")
_SENTENCE_END = tuple(".!?\"'”’)")


class TaskBuildError(UserError, ValueError):
  """Input that cannot make the task (too little text, too large a label count): one
  line naming the source and the option."""


def split_of_region(region: int) -> str:
  """train for regions 0, 1, 2 (mod 5), dev for 3, test for 4."""
  return SPLITS[max(0, region % 5 - 2)]


def document_sentences(text: str, *, min_words: int, max_words: int
                       ) -> list[Optional[str]]:
  """The sentences of `text` in order, whitespace normalised; None in place of one that
  is not a usable sentence (outside [min_words, max_words] words, no lowercase letter,
  or not starting with an uppercase letter or quote and ending like a sentence), so
  that neighbours in the list are neighbours in the text."""
  out: list[Optional[str]] = []
  for sentence in split_sentences(text):
    words = sentence.split()
    s = " ".join(words)
    usable = (min_words <= len(words) <= max_words and any(c.islower() for c in s)
              and (s[0].isupper() or s[0] in "\"'“‘") and s.endswith(_SENTENCE_END))
    out.append(s if usable else None)
  return out


def regions_of(n: int, regions: int) -> list[int]:
  """The region (0 .. regions-1) of each of n consecutive items, in equal runs."""
  return [i * regions // n for i in range(n)] if n else []


def corrupt(sentence: str, rng: random.Random, kinds: Sequence[str]) -> Optional[tuple[str, str]]:
  """(corrupted sentence, "swap" | "replace"), or None when no kind applies.

  swap: two neighbouring words, both lowercase letters only and different, exchanged;
  replace: a function word (FUNCTION_WORDS) replaced by one of another class. Neither
  touches the first word, so capitals never move."""
  words = sentence.split()
  options = []
  if "swap" in kinds:
    swaps = [i for i in range(1, len(words) - 1) if _LOWER_WORD.fullmatch(words[i])
             and _LOWER_WORD.fullmatch(words[i + 1]) and words[i] != words[i + 1]]
    if swaps:
      options.append(("swap", swaps))
  if "replace" in kinds:
    replaces = [i for i in range(1, len(words)) if words[i] in _WORD_CLASS]
    if replaces:
      options.append(("replace", replaces))
  if not options:
    return None
  kind, positions = rng.choice(options)
  i = rng.choice(positions)
  if kind == "swap":
    words[i], words[i + 1] = words[i + 1], words[i]
  else:
    other = [w for pos, ws in FUNCTION_WORDS.items() if pos != _WORD_CLASS[words[i]]
             for w in ws]
    words[i] = rng.choice(other)
  return " ".join(words), kind


def _usable_sentences(source, *, min_words: int, max_words: int) -> list[list[Optional[str]]]:
  """Per document, its sentences (document_sentences) with None also in place of a
  sentence met before, in this document or an earlier one."""
  seen: set[str] = set()
  docs = []
  for d in range(len(source)):
    text = source[d]
    sentences = document_sentences(text, min_words=min_words, max_words=max_words)
    for i, s in enumerate(sentences):
      if s is not None:
        if s in seen:
          sentences[i] = None
        seen.add(s)
    docs.append(sentences)
  return docs


def _acceptability(docs, rng, *, regions: int, corruptions: Sequence[str]):
  rows = {s: [] for s in SPLITS}
  counts = collections.Counter()
  for sentences in docs:
    where = regions_of(len(sentences), regions)
    for i, s in enumerate(sentences):
      if s is None:
        continue
      bad = corrupt(s, rng, corruptions)
      if bad is None:
        counts["no_corruption"] += 1
        continue
      counts[bad[1]] += 1
      group = len(rows[split_of_region(where[i])])
      rows[split_of_region(where[i])] += [(group, (s, "acceptable")),
                                          (group, (bad[0], "unacceptable"))]
  return rows, dict(counts)


def _coherence(docs, rng, *, regions: int, min_distance: int):
  rows = {s: [] for s in SPLITS}
  for sentences in docs:
    where = regions_of(len(sentences), regions)
    by_split = collections.defaultdict(list)  # split -> positions of usable sentences
    for i, s in enumerate(sentences):
      if s is not None:
        by_split[split_of_region(where[i])].append(i)
    for split, positions in by_split.items():
      # Disjoint consecutive pairs inside one region: (i, i + 1), i taken in steps of 2.
      firsts, i = [], None
      usable = set(positions)
      for p in positions:
        if p + 1 in usable and where[p] == where[p + 1] and (i is None or p > i + 1):
          firsts.append(p)
          i = p
      rng.shuffle(firsts)
      half = len(firsts) // 2
      for n, p in enumerate(firsts[:2 * half]):
        if n < half:
          second, label = sentences[p + 1], "consecutive"
        else:
          q = _far_position(positions, p, min_distance, rng)
          if q is None:
            continue
          second, label = sentences[q], "elsewhere"
        rows[split].append((len(rows[split]), (sentences[p], second, label)))
  for split in SPLITS:  # balanced: a negative without a far sentence left one over
    have = collections.Counter(row[-1] for _, row in rows[split])
    least, seen = min(have.values(), default=0), collections.Counter()
    kept = []
    for group, row in rows[split]:
      seen[row[-1]] += 1
      if seen[row[-1]] <= least:
        kept.append((group, row))
    rows[split] = kept
  return rows, {}


def _far_position(positions: list[int], p: int, min_distance: int,
                  rng: random.Random) -> Optional[int]:
  """A random one of `positions` at least min_distance from p (None if there is none);
  a few random draws first, the full scan only when they miss."""
  for _ in range(8):
    q = rng.choice(positions)
    if abs(q - p) >= min_distance:
      return q
  far = [q for q in positions if abs(q - p) >= min_distance]
  return rng.choice(far) if far else None


def _authorship(source, names, rng, *, regions: int, passage_words: int):
  by_label: dict[str, dict[str, list]] = collections.defaultdict(
      lambda: {s: [] for s in SPLITS})
  for d, name in enumerate(names):
    words = " ".join(source[d].split()).split()  # no line breaks: layout, not text
    label = name.split("_", 1)[0]
    where = regions_of(len(words), regions)
    run: list[str] = []
    for i, w in enumerate(words):
      run.append(w)
      end = i + 1 == len(words) or where[i + 1] != where[i]
      if len(run) == passage_words:
        by_label[label][split_of_region(where[i])].append(" ".join(run))
        run = []
      elif end:
        run = []
  if len(by_label) < 2:
    raise TaskBuildError(f"authorship needs at least two authors; the documents give"
                         f" {sorted(by_label) or 'none'} (an author is a document's name up"
                         " to its first '_')")
  rows = {s: [] for s in SPLITS}
  for split in SPLITS:
    least = min(len(v[split]) for v in by_label.values())  # balanced: the rarest class
    for label in sorted(by_label):
      chosen = sorted(rng.sample(range(len(by_label[label][split])), least))
      rows[split] += [(len(rows[split]) + k, (by_label[label][split][j], label))
                      for k, j in enumerate(chosen)]
  return rows, {}


def _keep_per_class(rows, per_class: int, rng: random.Random, spec: str, unit: str):
  """Groups of training rows, shuffled, taken while every label stays <= per_class."""
  groups = collections.defaultdict(list)
  for group, row in rows:
    groups[group].append(row)
  available = collections.Counter(row[-1] for _, row in rows)
  short = {label: n for label, n in available.items() if n < per_class}
  if short:
    label, n = min(short.items(), key=lambda kv: kv[1])
    raise TaskBuildError(f"--per_class {per_class}: source {spec!r} gives only {n} training"
                         f" {unit} of label {label!r}")
  order = sorted(groups)
  rng.shuffle(order)
  kept, counts = [], collections.Counter()
  for g in order:
    add = collections.Counter(row[-1] for row in groups[g])
    if all(counts[label] + n <= per_class for label, n in add.items()):
      kept += [(g, row) for row in groups[g]]
      counts += add
  return kept


def build_text_task(kind: str, source_spec: str, out_dir: str, *,
                    per_class: int = 0, seed: int = 0, regions: int = 10,
                    min_words: int = 6, max_words: int = 40, passage_words: int = 32,
                    min_distance: int = 20,
                    corruptions: Sequence[str] = ("swap", "replace")) -> dict:
  """Builds task `kind` (module docstring) from the documents of `source_spec` into
  out_dir/{train,dev,test}.csv and out_dir/stats.json; returns the statistics.

  per_class: 0 keeps every training example. Nothing is written unless the whole task
  can be built (TaskBuildError otherwise: too little text for a split, too large a
  per_class, too few authors); a bad spec raises the source's DataSourceError."""
  if kind not in KINDS:
    raise TaskBuildError(f"unknown task kind {kind!r}; expected one of {', '.join(KINDS)}")
  if regions < 5:
    raise TaskBuildError(f"--regions {regions}: need at least 5 (3 train, 1 dev, 1 test)")
  if per_class < 0:
    raise TaskBuildError(f"--per_class {per_class}: expected 0 (all) or a positive count")
  bad = set(corruptions) - {"swap", "replace"}
  if not corruptions or bad:
    raise TaskBuildError(f"corruptions {list(corruptions)}: expected swap and/or replace")
  source = source_from_spec(source_spec)
  # The examples (corruptions, negatives, balancing) do not depend on the seed: it only
  # picks the --per_class subset, so every seed and count is scored on one dev and test.
  rng = random.Random(f"{kind}:examples")
  if kind == "authorship":
    names = [os.path.splitext(os.path.basename(source.location(d)))[0]
             for d in range(len(source))]
    rows, extra = _authorship(source, names, rng, regions=regions,
                              passage_words=passage_words)
    unit = "passages"
  else:
    docs = _usable_sentences(source, min_words=min_words, max_words=max_words)
    if kind == "acceptability":
      rows, extra = _acceptability(docs, rng, regions=regions, corruptions=corruptions)
      unit = "sentences"
    else:
      rows, extra = _coherence(docs, rng, regions=regions, min_distance=min_distance)
      unit = "sentence pairs"
  labels = list(LABELS[kind]) if kind in LABELS else sorted(
      {row[-1] for split in rows.values() for _, row in split})
  for split in SPLITS:
    have = collections.Counter(row[-1] for _, row in rows[split])
    missing = [label for label in labels if not have[label]]
    if missing:
      raise TaskBuildError(
          f"source {source_spec!r} is too small for the {kind} task: its {split} split has"
          f" no example of {missing[0]!r} ({sum(have.values())} {unit} in all); give more"
          " text")
  full_train = collections.Counter(row[-1] for _, row in rows["train"])
  if per_class:
    # Acceptability: a sentence's two versions are one group, one example of each label.
    rows["train"] = _keep_per_class(rows["train"], per_class,
                                    random.Random(f"{kind}:{seed}:per_class"), source_spec,
                                    unit)
  shuffled = {}
  for split in SPLITS:
    split_rows = [row for _, row in rows[split]]
    random.Random(f"{kind}:{seed if split == 'train' else 0}:{split}").shuffle(split_rows)
    shuffled[split] = split_rows
  stats = dict(
      kind=kind, source=source_spec, documents=len(source), labels=labels, seed=seed,
      per_class=per_class or "all", regions=regions,
      **({"passage_words": passage_words} if kind == "authorship" else
         {"min_words": min_words, "max_words": max_words}),
      **({"min_distance": min_distance} if kind == "coherence" else {}),
      **({"corruptions": extra} if kind == "acceptability" else {}),
      available_train=dict(sorted(full_train.items())),
      splits={split: dict(examples=len(r), **{label: sum(1 for x in r if x[-1] == label)
                                              for label in labels})
              for split, r in shuffled.items()})
  _write(out_dir, kind, shuffled, stats)
  return stats


def _write(out_dir: str, kind: str, rows: dict[str, list[tuple]], stats: dict) -> None:
  header = ["text", "text_pair", "label"] if kind == "coherence" else ["text", "label"]
  os.makedirs(out_dir, exist_ok=True)
  for split, split_rows in rows.items():
    path = os.path.join(out_dir, f"{split}.csv")
    with open(path + ".tmp", "w", encoding="utf-8", newline="") as f:
      writer = csv.writer(f)
      writer.writerow(header)
      writer.writerows(split_rows)
    os.replace(path + ".tmp", path)
  with open(os.path.join(out_dir, "stats.json"), "w", encoding="utf-8") as f:
    json.dump(stats, f, indent=1)
    f.write("\n")
