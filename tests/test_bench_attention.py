"""`t5x-like bench attention` on this CPU: the command of the GPU check (docs/speed.md,
"On a GPU"), here over the explicit, XLA and (interpret-mode) Pallas kernels."""

import json

import pytest

from t5x_like import cli


@pytest.mark.long
def test_bench_attention_checks_every_kernel_here(capsys):
  code = cli.main(["bench", "attention", "--batch", "1", "--length", "128", "--heads", "2",
                   "--kv_heads", "1", "--head_dim", "16", "--steps", "1", "--dtype", "float32",
                   "--interpret_pallas"])
  assert code == 0
  result = json.loads(capsys.readouterr().out)
  assert set(result["kernels"]) == {"explicit", "xla", "pallas"}
  assert "needs a GPU" in result["skipped"]["cudnn"]
  for kernel, cases in result["kernels"].items():
    assert set(cases) == {"padding", "packing", "causal", "causal_packing", "prefix"}
    for case, errors in cases.items():
      for name in ("out", "dq", "dk", "dv", "dbias"):
        assert errors[name] <= 1e-5, (kernel, case, name, errors)
      assert errors["fwd_bwd_ms"] > 0
  dropout = result["dropout"]["explicit"]
  assert abs(dropout["dropped_fraction"] - dropout["rate"]) < 4 * dropout["sigma"]
  assert abs(dropout["mean_ratio"] - 1) < 0.02
  assert dropout["same_key_same_mask"] and dropout["other_key_other_mask"]


def test_bench_attention_bad_shape_is_one_line(capsys):
  assert cli.main(["bench", "attention", "--heads", "3", "--kv_heads", "2"]) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and "kv_heads=2 must divide heads=3" in err
