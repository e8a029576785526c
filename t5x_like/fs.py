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
