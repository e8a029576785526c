"""What a finished checkpoint step directory holds, and the checksums that prove it.

A step `<step>/` is complete when orbax's commit marker, both items (state/, extra/)
and the checksum manifests of all its writers are there. Each process hashes the files
it wrote (`*/ocdbt.process_<k>/...`, `*/array_metadatas/process_<k>`; process 0 also
every shared file) once orbax has committed the step, and writes
`<step>/checksums.process_<k>.json` (tmp + rename): hashing a big checkpoint is spread
over the hosts like the writing was. A manifest lists each file's size and sha256 and
carries a digest of itself. `verify` checks every listed file (each host a share, all
agreeing) before orbax reads anything, so one flipped byte anywhere is caught and named.

Steps saved before checksums existed have no manifest and no `CHECKSUMS_KEY` in their
orbax metadata: they are read unverified (with a warning), never set aside for it.

In the checkpoints directory, a Checkpointer's own entries are step directories,
`<step>.corrupt-<ns>` (set aside) and `*.orbax-checkpoint-tmp*` (unfinished saves);
`check_entries` reports anything else and refuses one with a step's name.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import posixpath
import re
from typing import Optional

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from t5x_like.errors import UserError

log = logging.getLogger("t5x_like.checkpoint")  # one logger for checkpoint warnings

STATE, EXTRA = "state", "extra"
COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, just before the final rename
TMP_MARKER = ".orbax-checkpoint-tmp"  # an unfinished save: orbax never lists it as a step
STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's, in every step it creates
STEP_NAME = re.compile(r"^\d+$")
SET_ASIDE = re.compile(r"^\d+\.corrupt-")
ALGORITHM = "sha256"
CHECKSUMS_KEY = "t5x_like_checksums"  # in orbax's custom metadata: manifests will follow
MANIFEST = "checksums.process_{}.json"
_MANIFEST_NAME = re.compile(r"^checksums\.process_\d+\.json")
_OWNER = re.compile(r"(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)")  # orbax's per-process files
_PARALLEL_READS = 8  # hashlib releases the GIL: files hash side by side (and GCS latency hides)

# Why a listed file failed, by code (the code travels between hosts, the text does not).
MISSING, SIZE, CONTENT = 1, 2, 3
_WHY = {MISSING: "listed in the checksums but missing",
        SIZE: "size differs from the one written at save time",
        CONTENT: f"content differs from its {ALGORITHM} written at save time"}


class CorruptCheckpointError(UserError, RuntimeError):
  """A step directory that is partial or cannot be read (the message names the file).
  The trainer falls back to the step before; a command reading one checkpoint stops."""


class PartialCheckpointError(CorruptCheckpointError):
  """A step directory whose save never finished (no marker, an item or checksums missing)."""


class CheckpointDirectoryError(UserError):
  """Something not written by a Checkpointer where a checkpoint step would go."""


# ------------------------------------------------------------------------- directory
def check_entries(directory: epath.Path) -> None:
  """Warns about unfinished saves and about what in `directory` no Checkpointer wrote
  (left alone); CheckpointDirectoryError if such an entry has a step's name, since a
  save of that step would collide with it."""
  if not directory.is_dir():
    return
  unfinished, foreign = [], []
  for p in directory.iterdir():
    if TMP_MARKER in p.name:
      unfinished.append(p.name)
    elif not (SET_ASIDE.match(p.name) or (STEP_NAME.match(p.name) and p.is_dir() and any(
        (p / part).exists() for part in (COMMIT_MARKER, STATE, EXTRA, STEP_METADATA)))):
      foreign.append(p.name + ("/" if p.is_dir() else ""))
  clash = sorted(name for name in foreign if STEP_NAME.match(name.rstrip("/")))
  if clash:
    raise CheckpointDirectoryError(
        f"{directory / clash[0]} was not written by t5x_like, but a checkpoint of step "
        f"{int(clash[0].rstrip('/'))} would be saved there: move it out of {directory}")
  if jax.process_index() == 0 and unfinished:
    log.warning("checkpoints in %s: ignoring unfinished save(s) %s (interrupted, or in "
                "progress in another process)", directory, sorted(unfinished))
  if jax.process_index() == 0 and foreign:
    log.warning("checkpoints in %s: leaving alone %s (not checkpoints)", directory,
                sorted(foreign))


def missing_parts(path: epath.Path) -> Optional[str]:
  """Why `path` is not a complete step directory (orbax's part of it), or None."""
  if not path.exists():
    return f"{path} does not exist"
  if not (path / COMMIT_MARKER).exists():
    return f"no {COMMIT_MARKER}: the save did not finish"
  for item in (STATE, EXTRA):
    if not (path / item).is_dir():
      return f"item directory '{item}' is missing"
  return None


def is_finished(path: epath.Path) -> bool:
  """Whether step directory `path` finished its save (cheap: nothing is hashed)."""
  return missing_parts(path) is None and unfinished(path) is None


def verify(path: epath.Path) -> None:
  """Raises PartialCheckpointError or CorruptCheckpointError (naming the file) unless
  step directory `path` is complete and every file matches its checksum. Each host
  hashes a share of the files; all raise the same error (one collective)."""
  code, why, files, bad = 0, "", None, None
  try:
    missing = missing_parts(path)
    if missing:
      raise PartialCheckpointError(missing)
    files = listed_files(path)
  except PartialCheckpointError as e:
    code, why = 1, str(e)
  except CorruptCheckpointError as e:
    code, why = 2, str(e)
  if files:
    bad = check_share(path, files, jax.process_index(), jax.process_count())
  rows = gather_over_hosts([code, *(bad or (-1, 0))])  # [hosts, (code, file index, why)]
  worst = int(rows[:, 0].max())
  if worst:
    kind = PartialCheckpointError if worst == 1 else CorruptCheckpointError
    raise kind(why if code == worst else f"{path.name}: its checks failed on another host")
  found = rows[rows[:, 1] >= 0]
  if len(found):
    _, index, reason = found[np.argmin(found[:, 1])]
    raise CorruptCheckpointError(describe(path, files, int(index), int(reason)))
  if files is None:
    log.warning("checkpoint %s has no checksums (saved before they were written): read "
                "unverified", path)


def gather_over_hosts(values: list[int]) -> np.ndarray:
  """[process_count, len(values)] int32: every process's `values` (one collective)."""
  row = np.asarray(values, np.int32)
  if jax.process_count() == 1:
    return row[None]
  return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), -1)


def agreed_steps(rows: np.ndarray) -> list[int]:
  """The steps in every row of `rows` ([hosts, n] int: each host's steps, padded with
  -1), newest first."""
  common = None
  for row in np.asarray(rows).reshape(len(rows), -1):
    steps = {int(s) for s in row if s >= 0}
    common = steps if common is None else common & steps
  return sorted(common or (), reverse=True)


def max_over_hosts(code: int) -> int:
  """The largest `code` over all processes (one collective when multi-host)."""
  return int(gather_over_hosts([code])[:, 0].max())


def steps_every_host_lists(steps: list[int]) -> list[int]:
  """Of this host's `steps`, those that every host lists, newest first: `steps` itself
  on one host, else two collectives (called by every host)."""
  steps = sorted(steps, reverse=True)
  if jax.process_count() == 1:
    return steps
  width = max_over_hosts(len(steps))
  if width == 0:
    return []
  return agreed_steps(gather_over_hosts(steps + [-1] * (width - len(steps))))


# ------------------------------------------------------------------------------ save
def seal(step_dir: epath.Path, process: int, process_count: int) -> None:
  """Hashes the files of committed `step_dir` that `process` owns; writes its manifest."""
  owned = sorted(rel for rel in _files(step_dir) if _owner(rel, process_count) == process)
  sums = _hash_all(step_dir, owned)
  body = {"algorithm": ALGORITHM, "process": process, "processes": process_count,
          "files": {rel: [size, digest] for rel, (size, digest) in zip(owned, sums)}}
  body["digest"] = _digest_of(body)
  final = step_dir / MANIFEST.format(process)
  tmp = final.parent / (final.name + ".tmp")
  tmp.write_text(json.dumps(body, sort_keys=True))
  tmp.rename(final)  # a manifest is there whole or not at all


# --------------------------------------------------------------------------- restore
def unfinished(step_dir: epath.Path) -> Optional[str]:
  """Why `step_dir`'s checksums say its save did not finish, or None (sealed, damaged,
  or saved before checksums). Cheap: reads process 0's manifest for the writer count."""
  try:
    count = _read_manifest(step_dir, 0)["processes"]
  except FileNotFoundError:
    if _expects_checksums(step_dir):
      return f"no {step_dir.name}/{MANIFEST.format(0)}: the save did not finish"
    return None
  except CorruptCheckpointError:
    return None  # damaged rather than unfinished: `listed_files` names it
  for k in range(1, count):
    if not (step_dir / MANIFEST.format(k)).exists():
      return f"no {step_dir.name}/{MANIFEST.format(k)}: the save did not finish on process {k}"
  return None


def listed_files(step_dir: epath.Path) -> Optional[dict[str, tuple[int, str]]]:
  """{relative path: (bytes, hex digest)} over every manifest; None for a step saved
  before checksums. PartialCheckpointError when a manifest is missing,
  CorruptCheckpointError (naming it) when one is damaged."""
  why = unfinished(step_dir)
  if why:
    raise PartialCheckpointError(why)
  try:
    first = _read_manifest(step_dir, 0)
  except FileNotFoundError:
    return None
  files: dict[str, tuple[int, str]] = {}
  for manifest in [first] + [_read_manifest(step_dir, k) for k in range(1, first["processes"])]:
    files.update({rel: (int(size), str(digest))
                  for rel, (size, digest) in manifest["files"].items()})
  return files


def check_share(step_dir: epath.Path, files: dict[str, tuple[int, str]], share: int,
                shares: int) -> Optional[tuple[int, int]]:
  """(index in sorted(files), why code) of the first of this share's files that does not
  match, or None. The files are split over `shares` hosts by size, the same way on each."""
  names = sorted(files)
  loads, mine = [0] * shares, []
  for i in sorted(range(len(names)), key=lambda i: (-files[names[i]][0], names[i])):
    host = loads.index(min(loads))
    loads[host] += files[names[i]][0] + 4096  # a file costs a read even when it is tiny
    if host == share:
      mine.append(i)
  mine.sort()
  for i, got in zip(mine, _hash_all(step_dir, [names[i] for i in mine])):
    want = files[names[i]]
    if got != want:
      return i, (MISSING if got is None else SIZE if got[0] != want[0] else CONTENT)
  return None


def describe(step_dir: epath.Path, files: dict[str, tuple[int, str]], index: int,
             why: int) -> str:
  """'<step>/<file>: why' for the file `check_share` reported."""
  return f"{step_dir.name}/{sorted(files)[index]}: {_WHY[why]}"


# ------------------------------------------------------------------------- internals
def _files(step_dir: epath.Path) -> list[str]:
  """Every file under `step_dir` (relative, '/'-separated) but the manifests."""
  out = []
  base = _without_scheme(step_dir)
  for root, _, names in step_dir.walk():  # one listing per directory, also on GCS
    prefix = posixpath.relpath(_without_scheme(root), base)  # walk may drop "gs://"
    out += [name if prefix == "." else f"{prefix}/{name}"
            for name in names if not _MANIFEST_NAME.match(name)]
  return out


def _without_scheme(path) -> str:
  return os.fspath(path).split("://", 1)[-1]


def _owner(rel: str, process_count: int) -> int:
  """The process that wrote `rel` (0 for shared files: process 0 finalizes them)."""
  match = _OWNER.search(rel)
  owner = int(match.group(1)) if match else 0
  return owner if owner < process_count else 0


def _hash_all(step_dir: epath.Path, rels: list[str]) -> list[Optional[tuple[int, str]]]:
  if not rels:
    return []
  with concurrent.futures.ThreadPoolExecutor(min(_PARALLEL_READS, len(rels))) as pool:
    return list(pool.map(lambda rel: _hash_file(step_dir / rel), rels))


def _hash_file(path: epath.Path) -> Optional[tuple[int, str]]:
  """(bytes, hex digest), or None when the file is gone."""
  try:
    with path.open("rb") as f:
      digest = hashlib.file_digest(f, ALGORITHM)
      return f.tell(), digest.hexdigest()
  except FileNotFoundError:
    return None


def _digest_of(body: dict) -> str:
  text = json.dumps({k: v for k, v in body.items() if k != "digest"}, sort_keys=True)
  return hashlib.new(ALGORITHM, text.encode()).hexdigest()


def _read_manifest(step_dir: epath.Path, process: int) -> dict:
  path = step_dir / MANIFEST.format(process)
  name = f"{step_dir.name}/{path.name}"
  try:
    body = json.loads(path.read_bytes().decode())
    ok = (isinstance(body, dict) and body.get("digest") == _digest_of(body)
          and body.get("process") == process and isinstance(body.get("files"), dict)
          and isinstance(body.get("processes"), int))
  except FileNotFoundError:
    raise
  except (OSError, ValueError) as e:
    raise CorruptCheckpointError(f"{name}: unreadable ({type(e).__name__})") from e
  if not ok:
    raise CorruptCheckpointError(f"{name}: does not match its own digest (damaged)")
  return body


def _expects_checksums(step_dir: epath.Path) -> bool:
  """Whether orbax's step metadata says this step was saved with checksums (an
  unreadable one says yes: better set aside than trusted)."""
  try:
    meta = json.loads((step_dir / STEP_METADATA).read_text())
    return CHECKSUMS_KEY in (meta.get("custom_metadata") or {})
  except (OSError, ValueError, AttributeError):
    return True
