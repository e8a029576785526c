"""One filesystem layer for every path the commands take: local paths, relative or
absolute, and URLs (gs://, s3://, ...) through etils epath (fsspec backends).

  resolve_path("workdir/bert")        -> epath.Path("/abs/cwd/workdir/bert")
  resolve_path("gs://bucket/run")     -> epath.Path("gs://bucket/run")

Local paths are made absolute once, at the command line, so that every library below
(orbax needs absolute paths) sees the same directory whatever the current directory
later is. A URL is never handed to os.path / open: a local folder named "gs:" is a bug.
"""

from __future__ import annotations

import os
import re
from typing import Union

from etils import epath

from t5x_like.errors import UserError

# Schemes etils epath routes to a filesystem (fsspec: gcsfs, s3fs, adlfs, huggingface_hub).
URL_SCHEMES = ("gs", "s3", "az", "hf")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

PathLike = Union[str, os.PathLike]


def url_scheme(path: PathLike) -> str | None:
  """'gs' for 'gs://b/x'; None for a local path."""
  match = _URL.match(os.fspath(path))
  return match.group(1).lower() if match else None


def is_url(path: PathLike) -> bool:
  return url_scheme(path) is not None


def resolve_path(path: PathLike, what: str = "path") -> epath.Path:
  """`path` as an epath.Path: local paths absolute (~ expanded), URLs as they are.

  what: how the error names the path (e.g. "--workdir"). UserError for an empty path or
  a URL scheme no filesystem here serves.
  """
  text = os.fspath(path)
  if not text:
    raise UserError(f"{what}: an empty path")
  scheme = url_scheme(text)
  if scheme is None:
    return epath.Path(os.path.abspath(os.path.expanduser(text)))
  if scheme == "file":
    return epath.Path(os.path.abspath(text[len("file://"):]))
  if scheme not in URL_SCHEMES:
    raise UserError(f"{what}={text!r}: unsupported URL scheme {scheme!r}; use a local path"
                    f" or one of {', '.join(s + '://' for s in URL_SCHEMES)}")
  return epath.Path(text)


# ------------------------------------------------------------ files, local or URL
# Small whole-file operations for the workdir's own files (metrics, the lock). Local
# paths go through os; URLs through the fsspec filesystem that epath uses for them (so a
# test that swaps that filesystem swaps it here too). Object stores have no folders and
# no append: a file is written whole, and each write replaces the object atomically.


def fsspec_filesystem(path: PathLike):
  """The fsspec filesystem that serves a URL (gcsfs for gs://, s3fs for s3://, ...)."""
  from etils.epath import backend  # pylint: disable=g-import-not-at-top
  return backend.fsspec_backend.fs(os.fspath(path))


def make_dirs(path: PathLike) -> None:
  """A local folder and its parents; nothing for a URL (an object store has no folders,
  and gcsfs would create a missing bucket rather than fail on a typo). UserError when
  the path is a file or cannot be created."""
  if is_url(path):
    return
  try:
    os.makedirs(path, exist_ok=True)
  except (FileExistsError, NotADirectoryError, PermissionError) as e:
    what = "is a file, not a directory" if os.path.isfile(path) else (
        f"cannot be created ({e.strerror}: {e.filename})")
    raise UserError(f"{os.fspath(path)}: {what}") from None


def read_bytes(path: PathLike) -> bytes:
  """The file's bytes, read afresh (no listing cache); FileNotFoundError if absent."""
  if not is_url(path):
    with open(path, "rb") as f:
      return f.read()
  return fsspec_filesystem(path).cat_file(os.fspath(path))


def exists(path: PathLike) -> bool:
  """Whether the file is there, by reading it afresh (no listing cache: a URL's
  listing may lag a write); for small files such as a run's final_metrics.json."""
  try:
    read_bytes(path)
    return True
  except FileNotFoundError:
    return False


def write_bytes(path: PathLike, data: bytes) -> None:
  """Replaces the file with `data` atomically: a reader sees the old or the new bytes."""
  text = os.fspath(path)
  if is_url(text):
    fsspec_filesystem(text).pipe_file(text, bytes(data))
    return
  tmp = f"{text}.tmp.{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  os.replace(tmp, text)


def create_exclusive(path: PathLike, data: bytes) -> None:
  """Writes a new file; FileExistsError if it exists. Atomic locally (a hard link of a
  complete temporary file, safe on NFS too) and on filesystems that implement fsspec's
  mode="create" (gcsfs: a generation-0 precondition; s3fs: If-None-Match); others check
  then write, which two writers in the same instant can both pass."""
  text = os.fspath(path)
  if is_url(text):
    fsspec_filesystem(text).pipe_file(text, bytes(data), mode="create")
    return
  tmp = f"{text}.tmp.{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(data)
  try:
    os.link(tmp, text)  # fails with FileExistsError if `text` exists, never half-written
  finally:
    os.unlink(tmp)


def remove(path: PathLike) -> None:
  """Deletes the file; nothing if it is absent."""
  text = os.fspath(path)
  try:
    if is_url(text):
      fsspec_filesystem(text).rm_file(text)
    else:
      os.unlink(text)
  except FileNotFoundError:
    pass
