"""Metric writers: a JSONL file and TensorBoard event files in the workdir, and console
progress with the loss and ETA: a tqdm bar where stderr is a terminal, plain lines
(`step 50/300: loss 0.6931, 0.41 s/step, ETA 01:42`) where the output goes to a file or
a pipe, so a log holds readable lines, with no carriage returns and no bar around them.

Files: <workdir>/metrics.jsonl (one JSON object per write: {"step": s, name: value,
...}) and <workdir>/tensorboard/ (tensorboardX event files). Only the main process
writes files or prints; other processes get a writer that does nothing.

Resume: a run restarted from the checkpoint of step s rewrites the rows of the steps
after s. `read_jsonl` therefore returns one row per step, the rows of a step merged
in file order so that the latest value of every key wins (an eval row written at a
train row's step joins it). `truncate_after(s)` also removes the stale rows from the
file and hides the stale TensorBoard events (a purge marker, as tensorboardX's
`purge_step`); calling it on resume is tidy but not needed for `read_jsonl`.
Metric values must be fetchable on this host (replicated or addressable arrays).

URL workdirs (gs://, s3://, ...): object stores cannot append, so both files are kept
in memory and rewritten whole (as TensorFlow's own GCS writer does), at most every
`remote_flush_seconds` (GCS allows about one write a second to an object) and on
flush() / close(); an event file rolls over past 4 MiB to bound each upload. A run
killed between flushes loses the rows since the last one.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import sys
import time
from typing import Any, Mapping, Optional

import numpy as np
from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.proto.summary_pb2 import Summary
from tensorboardX.record_writer import masked_crc32c
from tqdm import tqdm

from t5x_like import fs
from t5x_like.train.flops import mfu

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
REMOTE_EVENT_FILE_BYTES = 4 << 20  # a URL event file rolls over past this


def _to_float(name: str, value: Any) -> float:
  """A Python float from a float / numpy / jax scalar (or size-1 array)."""
  array = np.asarray(value)
  if array.size != 1:
    raise ValueError(f"metric {name!r}: expected a scalar, got shape {array.shape}")
  return float(array.reshape(()))


def read_jsonl(path: fs.PathLike) -> list[dict[str, float]]:
  """Rows of a metrics.jsonl (a local path or a URL), one per step, sorted by step.

  Rows of the same step are merged in file order (later values win), so rows that a
  resumed run rewrote replace the interrupted run's, and an eval row written at the
  same step as a train row joins it. A torn last line (a kill mid-write) is skipped.
  FileNotFoundError if there is no file.
  """
  by_step: dict[int, dict[str, float]] = {}
  for line in fs.read_bytes(path).decode("utf-8", errors="replace").splitlines():
    line = line.strip()
    if not line:
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    by_step.setdefault(int(row["step"]), {}).update(row)
  return [by_step[s] for s in sorted(by_step)]


def _keep_rows_through(data: bytes, step: int) -> bytes:
  """The complete rows of a metrics.jsonl with step <= `step` (torn lines dropped)."""
  kept = []
  for line in data.decode("utf-8", errors="replace").splitlines():
    try:
      if int(json.loads(line)["step"]) <= step:
        kept.append(line + "\n")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
      continue  # a torn line from a killed run
  return "".join(kept).encode()


class _RemoteEventFile:
  """A TensorBoard event file at a URL, the interface of tensorboardX's EventsWriter.

  The records (TFRecord framing, as tensorboardX writes them) accumulate in memory and
  flush() uploads the whole file: object stores replace objects, they do not append.
  """

  def __init__(self, directory: str, suffix: str):
    name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}{suffix}"
    self.path = f"{directory.rstrip('/')}/{name}"
    self.size = 0
    self._records = bytearray()
    self._dirty = False
    self.write_event(Event(wall_time=time.time(), file_version="brain.Event:2"))

  def write_event(self, event: Event) -> None:
    data = event.SerializeToString()
    header = struct.pack("<Q", len(data))
    self._records += (header + struct.pack("<I", masked_crc32c(header)) + data
                      + struct.pack("<I", masked_crc32c(data)))
    self.size = len(self._records)
    self._dirty = True

  def flush(self) -> None:
    if self._dirty:
      fs.write_bytes(self.path, bytes(self._records))
      self._dirty = False

  def close(self) -> None:
    self.flush()


class MetricWriter:
  """Writes scalars to metrics.jsonl and TensorBoard, and shows progress on the console.

  total_steps: the progress total (for the ETA). is_main_process: False makes every
  method a no-op (multi-host: only process 0 writes). console: False turns progress
  off (log() still prints). bar: a tqdm bar on stderr (None: where stderr is a
  terminal); progress lines go to stdout where it is not the terminal the bar is on.
  workdir: a local path or a URL (gs://...); remote_flush_seconds: how often a URL
  workdir's files are uploaded at most.
  """

  _files_opened = 0  # per process, for unique event file names

  def __init__(self, workdir: fs.PathLike, *, total_steps: int,
               is_main_process: bool = True, console: bool = True,
               bar: Optional[bool] = None, remote_flush_seconds: float = 5.0):
    # Local: absolute. A URL stays a URL, and nothing below hands it to open / os.
    self.workdir = os.fspath(fs.resolve_path(workdir, "workdir"))
    self.remote = fs.is_url(self.workdir)
    self.total_steps = int(total_steps)
    self.is_main_process = is_main_process
    self.console = console and is_main_process
    self.show_bar = self.console and (_is_terminal(sys.stderr) if bar is None else bar)
    self.show_lines = self.console and not (self.show_bar and _is_terminal(sys.stdout))
    self._last_progress: Optional[tuple[int, float]] = None  # (step, time) of the last line
    self.jsonl_path = _join(self.workdir, JSONL_NAME)
    self.tensorboard_dir = _join(self.workdir, TENSORBOARD_DIR)
    self.remote_flush_seconds = float(remote_flush_seconds)
    self._tb = None
    self._purge_step: Optional[int] = None
    self._bar = None
    self._line_checked = False
    self._remote_jsonl: Optional[bytearray] = None  # URL: the whole file, in memory
    self._unflushed = False
    self._last_flush = -math.inf
    if is_main_process:
      fs.make_dirs(self.workdir)

  # ------------------------------------------------------------------- files
  def _tensorboard(self):
    """The event file writer, opened on first use (after a truncate_after, a new file
    that starts with the purge marker)."""
    if self._tb is None:
      # A unique suffix: event file names only carry the second, and a second writer
      # in that second would clobber.
      MetricWriter._files_opened += 1
      suffix = f".{os.getpid()}.{MetricWriter._files_opened}"
      if self.remote:
        self._tb = _RemoteEventFile(self.tensorboard_dir, suffix)
      else:
        # tensorboardX's synchronous writer (SummaryWriter queues events to a thread,
        # so its flush() does not guarantee they are on disk).
        fs.make_dirs(self.tensorboard_dir)
        self._tb = EventsWriter(os.path.join(self.tensorboard_dir, "events"), suffix)
      if self._purge_step is not None:  # as SummaryWriter(purge_step=...) marks it
        self._tb.write_event(Event(step=self._purge_step, wall_time=time.time(),
                                   session_log=SessionLog(status=SessionLog.START)))
        self._purge_step = None
    return self._tb

  def _remote_rows(self) -> bytearray:
    """URL: metrics.jsonl as it is in the store, read once (a torn last line ended)."""
    if self._remote_jsonl is None:
      try:
        data = fs.read_bytes(self.jsonl_path)
      except FileNotFoundError:
        data = b""
      self._remote_jsonl = bytearray(data)
      if data and not data.endswith(b"\n"):
        self._remote_jsonl += b"\n"
    return self._remote_jsonl

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Appends {"step": step, **scalars} to metrics.jsonl and adds each to TensorBoard.

    Values may be Python, numpy or (fetched) jax scalars. Local files are flushed on
    every call, so a killed run loses nothing it logged; URL files see flush().
    """
    if not self.is_main_process:
      return
    step = int(step)
    values = {name: _to_float(name, value) for name, value in scalars.items()}
    line = json.dumps({"step": step, **values}) + "\n"
    summary = Summary(value=[Summary.Value(tag=name, simple_value=value)
                             for name, value in values.items()])
    event = Event(step=step, wall_time=time.time(), summary=summary)
    if self.remote:
      self._remote_rows().extend(line.encode())
      self._tensorboard().write_event(event)
      self._unflushed = True
      if time.monotonic() - self._last_flush >= self.remote_flush_seconds:
        self.flush()
      return
    if not self._line_checked:  # a killed run may have left a torn last line
      self._line_checked = True
      if os.path.exists(self.jsonl_path) and os.path.getsize(self.jsonl_path):
        with open(self.jsonl_path, "rb") as f:
          f.seek(-1, os.SEEK_END)
          if f.read(1) != b"\n":
            line = "\n" + line
    with open(self.jsonl_path, "a") as f:
      f.write(line)
      f.flush()
    tb = self._tensorboard()
    tb.write_event(event)
    tb.flush()

  def flush(self) -> None:
    """Writes out what write_scalars buffered (URL workdirs; local files already are)."""
    if not (self.remote and self._unflushed):
      return
    fs.write_bytes(self.jsonl_path, bytes(self._remote_rows()))
    if self._tb is not None:
      self._tb.flush()
      if self._tb.size > REMOTE_EVENT_FILE_BYTES:  # the next event starts a new file
        self._tb = None
    self._unflushed = False
    self._last_flush = time.monotonic()

  def truncate_after(self, step: int) -> None:
    """Drops rows of steps > `step` from metrics.jsonl (atomically) and hides
    TensorBoard events of steps > `step` (purge_step = step + 1 on the next write)."""
    if not self.is_main_process:
      return
    step = int(step)
    if self.remote:
      self.flush()
      rows = self._remote_rows()
      kept = _keep_rows_through(bytes(rows), step)
      if kept != rows:
        self._remote_jsonl = bytearray(kept)
        fs.write_bytes(self.jsonl_path, kept)
    elif os.path.exists(self.jsonl_path):
      fs.write_bytes(self.jsonl_path, _keep_rows_through(fs.read_bytes(self.jsonl_path),
                                                          step))
    if self._tb is not None:  # a new event file carries the purge marker
      self._tb.close()
      self._tb = None
    self._purge_step = step + 1

  # ----------------------------------------------------------------- console
  def progress(self, step: int, loss: Optional[float] = None) -> None:
    """Moves the bar to `step` (steps done) and shows the loss (tqdm gives the ETA),
    and / or prints a progress line (the rate and ETA since the previous one).

    Both start at the first step they are given, so a resumed run's rate and ETA
    count only the steps it ran.
    """
    if not self.console:
      return
    step = int(step)
    if self.show_bar:
      if self._bar is None:
        self._bar = tqdm(total=self.total_steps, initial=step, desc="train", unit="step",
                         dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
      if loss is not None:
        self._bar.set_postfix(loss=f"{_to_float('loss', loss):.4f}", refresh=False)
      self._bar.update(step - self._bar.n)
    if self.show_lines:
      print(self._progress_line(step, loss), flush=True)

  def _progress_line(self, step: int, loss: Optional[float]) -> str:
    """`step 50/300: loss 0.6931, 0.41 s/step, ETA 01:42` (no rate on the first line)."""
    now = time.monotonic()
    parts = [] if loss is None else [f"loss {_to_float('loss', loss):.4f}"]
    if self._last_progress is not None and step > self._last_progress[0]:
      seconds = (now - self._last_progress[1]) / (step - self._last_progress[0])
      parts.append(f"{seconds:.3g} s/step")
      if self.total_steps > step:
        parts.append(f"ETA {tqdm.format_interval(seconds * (self.total_steps - step))}")
    self._last_progress = (step, now)
    return f"step {step}/{self.total_steps}" + (": " + ", ".join(parts) if parts else "")

  def log(self, msg: str) -> None:
    """Prints a line (above the progress bar, if one is shown; main process only)."""
    if not self.is_main_process:
      return
    if self._bar is not None:
      self._bar.write(msg)
    else:
      print(msg, flush=True)

  def close(self) -> None:
    """Flushes, closes the bar and the event file; safe to call twice."""
    if self.is_main_process:
      self.flush()
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _is_terminal(stream) -> bool:
  """Whether a stream is an interactive terminal (not a file, a pipe or a capture)."""
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):  # no isatty, or closed
    return False


def _join(directory: str, name: str) -> str:
  """directory/name; a URL keeps its scheme ("gs://b/run" -> "gs://b/run/name")."""
  return f"{directory.rstrip('/')}/{name}" if fs.is_url(directory) else os.path.join(
      directory, name)


def perplexity(metrics: Mapping[str, float]) -> Optional[float]:
  """exp(token_loss - token_z_loss), else exp(mlm_loss - mlm_z_loss); None without either."""
  for prefix in ("token", "mlm"):
    if f"{prefix}_loss" in metrics:
      nll = metrics[f"{prefix}_loss"] - metrics.get(f"{prefix}_z_loss", 0.0)
      return math.inf if nll > 709.0 else math.exp(nll)  # exp overflows past 709
  return None


def summarize_train_metrics(device_metrics: Mapping[str, Any], *, step_seconds: float,
                            tokens_per_step: float, flops_per_step: float, num_devices: int,
                            peak_per_device: float) -> dict[str, float]:
  """Device scalars -> floats, plus throughput and perplexity.

  Adds perplexity = exp(token_loss - token_z_loss) (decoder / encoder-decoder) or
  exp(mlm_loss - mlm_z_loss) (BERT) when those are present (the z-loss term is not
  part of the likelihood; with label smoothing it is the smoothed loss's exp),
  tokens_per_second, tflops_per_second_per_device, mfu and step_seconds.
  """
  out = {name: _to_float(name, value) for name, value in device_metrics.items()}
  ppl = perplexity(out)
  if ppl is not None:
    out["perplexity"] = ppl
  out["step_seconds"] = float(step_seconds)
  out["tokens_per_second"] = tokens_per_step / step_seconds
  out["tflops_per_second_per_device"] = flops_per_step / step_seconds / num_devices / 1e12
  out["mfu"] = mfu(flops_per_step, step_seconds, num_devices, peak_per_device)
  return out
