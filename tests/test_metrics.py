"""Metric writers: JSONL rows, TensorBoard event files (read back with an independent
TFRecord reader), resume rewrites, the non-main process, and the step summary."""

import glob
import json
import math
import os
import re
import struct

import fsspec.implementations.memory
import jax.numpy as jnp
import numpy as np
import pytest
from etils.epath import backend as epath_backend
from tensorboardX.proto import event_pb2

from t5x_like.train.metrics import MetricWriter, read_jsonl, summarize_train_metrics


def _crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli), bit by bit: slow and obviously right."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc ^= byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  crc = _crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_events(logdir):
  """All Events of the TFRecord event files under logdir, checksums verified."""
  events = []
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    offset = 0
    while offset < len(data):
      header = data[offset:offset + 8]
      (length,) = struct.unpack("<Q", header)
      (length_crc,) = struct.unpack("<I", data[offset + 8:offset + 12])
      assert length_crc == _masked_crc(header)
      payload = data[offset + 12:offset + 12 + length]
      (payload_crc,) = struct.unpack("<I", data[offset + 12 + length:offset + 16 + length])
      assert payload_crc == _masked_crc(payload)
      events.append(event_pb2.Event.FromString(payload))
      offset += 16 + length
  return events


def _scalars(logdir):
  """tag -> [(step, value)] in file order."""
  out = {}
  for event in _read_events(logdir):
    for value in event.summary.value:
      out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


def _raw_rows(path):
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


class _MemoryBucket(fsspec.implementations.memory.MemoryFileSystem):
  """An in-memory stand-in for gcsfs with its own store (tests/test_workdir.py runs the
  real gcsfs against a GCS emulator)."""

  protocol = ("gs", "gcs")

  def __init__(self):
    super().__init__(skip_instance_cache=True)
    self.store, self.pseudo_dirs = {}, [""]


def test_url_workdir_goes_through_fsspec_never_local_files(tmp_path, monkeypatch):
  """A gs:// workdir: rows and events land in the bucket (whole files rewritten, as
  object stores do not append), read_jsonl reads them back, and nothing local appears."""
  bucket = _MemoryBucket()
  monkeypatch.setattr(epath_backend.fsspec_backend, "fs", lambda path: bucket)
  monkeypatch.chdir(tmp_path)
  with MetricWriter("gs://b/run", total_steps=3, console=False,
                    remote_flush_seconds=0) as writer:
    writer.write_scalars(1, {"loss": 2.5})
    writer.write_scalars(2, {"loss": 2.25})
    assert read_jsonl("gs://b/run/metrics.jsonl") == [{"step": 1, "loss": 2.5},
                                                      {"step": 2, "loss": 2.25}]
    writer.truncate_after(1)
    writer.write_scalars(2, {"loss": 2.0})
  assert [json.loads(line) for line in bucket.cat_file("gs://b/run/metrics.jsonl").splitlines()
          ] == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}]
  events = sorted(k for k in bucket.store if "/tensorboard/events.out.tfevents." in k)
  assert len(events) == 2  # the second one starts with the purge marker
  assert os.listdir(tmp_path) == []


def test_jsonl_rows_and_tensorboard_scalars(tmp_path):
  with MetricWriter(str(tmp_path), total_steps=10, console=False) as writer:
    writer.write_scalars(1, {"loss": np.float32(2.5), "learning_rate": 1e-4})
    writer.write_scalars(2, {"loss": jnp.asarray(2.25), "mfu": 0.125})
  rows = _raw_rows(tmp_path / "metrics.jsonl")
  assert rows == [{"step": 1, "loss": 2.5, "learning_rate": 1e-4},
                  {"step": 2, "loss": 2.25, "mfu": 0.125}]
  assert read_jsonl(str(tmp_path / "metrics.jsonl")) == rows
  scalars = _scalars(str(tmp_path / "tensorboard"))
  assert scalars["loss"] == [(1, 2.5), (2, 2.25)]
  assert scalars["mfu"] == [(2, 0.125)]
  assert scalars["learning_rate"][0][0] == 1
  assert scalars["learning_rate"][0][1] == pytest.approx(1e-4)


def test_files_are_flushed_on_every_write(tmp_path):
  """A run killed after a write (no close) has already written the row and event."""
  writer = MetricWriter(str(tmp_path), total_steps=10, console=False)
  writer.write_scalars(3, {"loss": 1.5})
  assert read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 3, "loss": 1.5}]
  assert _scalars(str(tmp_path / "tensorboard"))["loss"] == [(3, 1.5)]
  writer.close()


def test_rewritten_steps_read_back_once_latest_wins(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  first = MetricWriter(str(tmp_path), total_steps=6, console=False)
  for step in range(1, 6):  # interrupted run: steps 1..5, last checkpoint at 3
    first.write_scalars(step, {"loss": 10.0 + step})
  first.write_scalars(5, {"eval_loss": 9.0})  # an eval row at a train row's step
  with open(path, "a") as f:
    f.write('{"step": 6, "lo')  # killed mid-write
  first.close()
  resumed = MetricWriter(str(tmp_path), total_steps=6, console=False)
  for step in range(4, 7):
    resumed.write_scalars(step, {"loss": 20.0 + step})
  resumed.close()
  rows = read_jsonl(path)
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert [r["loss"] for r in rows] == [11.0, 12.0, 13.0, 24.0, 25.0, 26.0]
  assert rows[4]["eval_loss"] == 9.0  # merged into step 5's row


def test_truncate_after_drops_stale_rows_and_purges_tensorboard(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  first = MetricWriter(str(tmp_path), total_steps=6, console=False)
  for step in range(1, 6):
    first.write_scalars(step, {"loss": 10.0 + step})
  with open(path, "a") as f:
    f.write('{"step": 6, "lo')
  first.close()
  resumed = MetricWriter(str(tmp_path), total_steps=6, console=False)
  resumed.truncate_after(3)
  assert [r["step"] for r in _raw_rows(path)] == [1, 2, 3]
  resumed.write_scalars(4, {"loss": 24.0})
  resumed.close()
  assert [(r["step"], r["loss"]) for r in _raw_rows(path)] == [
      (1, 11.0), (2, 12.0), (3, 13.0), (4, 24.0)]
  # TensorBoard hides events at steps >= purge_step of the run written before it.
  purges = [e for e in _read_events(str(tmp_path / "tensorboard"))
            if e.HasField("session_log") and e.session_log.status == e.session_log.START]
  assert [e.step for e in purges] == [4]


def test_non_main_process_writes_nothing(tmp_path, capsys):
  workdir = tmp_path / "w"
  writer = MetricWriter(str(workdir), total_steps=5, is_main_process=False)
  writer.write_scalars(1, {"loss": 1.0})
  writer.progress(1, 1.0)
  writer.log("hello")
  writer.truncate_after(0)
  writer.close()
  assert not workdir.exists()
  captured = capsys.readouterr()
  assert captured.out == "" and captured.err == ""


def test_progress_bar_shows_loss_and_log_prints(tmp_path, capsys):
  writer = MetricWriter(str(tmp_path), total_steps=8, bar=True)  # as on a terminal
  writer.progress(2, 3.14159)
  writer.progress(4, jnp.asarray(2.5))
  writer.log("eval mlm_accuracy 0.5")
  assert writer._bar.n == 4 and writer._bar.total == 8
  writer.close()
  captured = capsys.readouterr()
  assert "loss=2.5000" in captured.err
  assert "4/8" in captured.err
  assert "eval mlm_accuracy 0.5" in captured.out + captured.err


def test_progress_to_a_file_or_pipe_is_plain_lines(tmp_path, capsys):
  """Output captured (not a terminal): no bar, no carriage return; one line per call,
  the log's lines between them as they came."""
  writer = MetricWriter(str(tmp_path), total_steps=8)
  writer.progress(1, 3.14159)
  writer.progress(4, jnp.asarray(2.5))
  writer.log("step 4: dev accuracy=0.5000")
  writer.progress(8, 2.0)
  writer.close()
  captured = capsys.readouterr()
  assert writer._bar is None and captured.err == "" and "\r" not in captured.out
  lines = captured.out.splitlines()
  assert lines[0] == "step 1/8: loss 3.1416"
  assert re.fullmatch(r"step 4/8: loss 2.5000, [0-9.e-]+ s/step, ETA \d\d:\d\d", lines[1])
  assert lines[2] == "step 4: dev accuracy=0.5000"
  assert re.fullmatch(r"step 8/8: loss 2.0000, [0-9.e-]+ s/step", lines[3])
  assert len(lines) == 4


def test_no_bar_without_console(tmp_path, capsys):
  writer = MetricWriter(str(tmp_path), total_steps=8, console=False)
  writer.progress(2, 1.0)
  writer.log("a line")
  writer.close()
  captured = capsys.readouterr()
  assert captured.err == ""
  assert captured.out == "a line\n"


def test_rejects_non_scalar_metric(tmp_path):
  writer = MetricWriter(str(tmp_path), total_steps=1, console=False)
  with pytest.raises(ValueError, match="'loss'"):
    writer.write_scalars(1, {"loss": np.ones(3)})
  writer.close()


def test_summarize_train_metrics_arithmetic():
  device = {"loss": jnp.asarray(2.0), "token_loss": jnp.asarray(2.0, jnp.float32),
            "token_z_loss": np.float32(0.25), "grad_norm": jnp.asarray(1.5)}
  out = summarize_train_metrics(device, step_seconds=0.5, tokens_per_step=1024,
                                flops_per_step=4e12, num_devices=8, peak_per_device=2e12)
  assert all(type(v) is float for v in out.values())
  assert out["loss"] == 2.0 and out["grad_norm"] == 1.5
  assert out["perplexity"] == pytest.approx(math.exp(1.75))
  assert out["tokens_per_second"] == 2048.0
  assert out["tflops_per_second_per_device"] == pytest.approx(4e12 / 0.5 / 8 / 1e12)
  assert out["mfu"] == pytest.approx(4e12 / (0.5 * 8 * 2e12))
  assert out["step_seconds"] == 0.5


def test_summarize_bert_perplexity_from_mlm_loss_and_overflow():
  out = summarize_train_metrics({"mlm_loss": 3.0, "nsp_loss": 0.7}, step_seconds=1.0,
                                tokens_per_step=1, flops_per_step=1.0, num_devices=1,
                                peak_per_device=1.0)
  assert out["perplexity"] == pytest.approx(math.exp(3.0))
  out = summarize_train_metrics({"token_loss": 1e4}, step_seconds=1.0, tokens_per_step=1,
                                flops_per_step=1.0, num_devices=1, peak_per_device=1.0)
  assert out["perplexity"] == math.inf
  out = summarize_train_metrics({"nsp_loss": 0.7}, step_seconds=1.0, tokens_per_step=1,
                                flops_per_step=1.0, num_devices=1, peak_per_device=1.0)
  assert "perplexity" not in out

