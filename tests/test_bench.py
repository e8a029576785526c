"""`t5x-like bench model | compile | bert-vs-torch` on tiny configs (`bench peer`:
test_bench_peer.py): the JSON is consistent with itself, its FLOP count agrees with a
hand count from the model dimensions and with the matmuls of the traced training step,
every family runs, bad input exits 2. (Speed itself is measured by the benchmarks,
never asserted in tests.)"""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from t5x_like import cli
from t5x_like.command_flags import load_config_file
from t5x_like.experiment import build_model_from_config, config_vocab

_TINY_BERT = ["--config", "configs/bert_cpu.py:smoke", "--config.train.batch_size=8",
              "--config.data.length=32"]


# The smoke variants' model dimensions, typed from the overrides in configs/*_cpu.py.
SMOKE_DIMS = {
    "configs/bert_cpu.py:smoke": dict(layers=2, d=64, heads=2, head_dim=32, ff=128),
    "configs/gpt_cpu.py:smoke": dict(layers=1, d=64, heads=2, head_dim=32, ff=128),
    "configs/t5_cpu.py:smoke": dict(layers=1, d=64, heads=2, head_dim=32, ff=128),
}


def hand_train_flops(config: str, vocab: int, shapes: dict) -> int:
  """Training FLOPs of one step by hand (Kaplan et al. 2020 sec. 2.1; PaLM app. B).

  2 FLOPs per multiply-add and backward = 2x forward, so 6 x weights x the tokens
  they multiply, plus 12 x layers x (query x key positions) x heads * head_dim for the
  attention scores and weighted values (full square, causal too). BERT: the MLM
  transform and tied decoder at the masked positions only, the pooler and NSP on
  [CLS]. T5 v1.1: gated MLP (3 matrices), cross-attention K/V over the encoder tokens.
  """
  dims = SMOKE_DIMS[config]
  n, d, ff = dims["layers"], dims["d"], dims["ff"]
  inner = dims["heads"] * dims["head_dim"]
  attention = 4 * d * inner  # query, key, value, output projections
  if "bert" in config:
    b, s = shapes["encoder_input_tokens"]
    p = shapes["mlm_positions"][1]
    return (6 * n * (attention + 2 * d * ff) * b * s + 12 * n * b * s * s * inner
            + 6 * (d * d + d * vocab) * b * p + 6 * (d * d + d * 2) * b)
  if "gpt" in config:
    b, t = shapes["decoder_input_tokens"]
    return (6 * n * (attention + 2 * d * ff) * b * t + 12 * n * b * t * t * inner
            + 6 * d * vocab * b * t)
  b, s = shapes["encoder_input_tokens"]
  t = shapes["decoder_input_tokens"][1]
  encoder = 6 * n * (attention + 3 * d * ff) * b * s + 12 * n * b * s * s * inner
  decoder = (6 * n * (attention + 2 * d * inner + 3 * d * ff) * b * t  # + cross Q, O
             + 6 * n * 2 * d * inner * b * s  # cross K, V over the encoder tokens
             + 12 * n * b * (t * t + t * s) * inner + 6 * d * vocab * b * t)
  return encoder + decoder


def dot_flops(jaxpr) -> int:
  """2 x multiply-adds of every dot_general in `jaxpr`, nested jaxprs included (a scan's
  body counted `length` times)."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
      lhs, rhs = (v.aval.shape for v in eqn.invars)
      rhs_free = [s for i, s in enumerate(rhs) if i not in rhs_contract + rhs_batch]
      total += 2 * math.prod(lhs) * math.prod(rhs_free)
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          total += times * dot_flops(sub)
  return total


def _run(capsys, argv):
  code = cli.main(argv)
  captured = capsys.readouterr()
  return code, (json.loads(captured.out) if code == 0 else None), captured.err


@pytest.mark.parametrize("config,decode", [pytest.param("configs/bert_cpu.py:smoke", False,
                                                        marks=pytest.mark.long),
                                           pytest.param("configs/gpt_cpu.py:smoke", True,
                                                        marks=pytest.mark.slow),
                                           pytest.param("configs/t5_cpu.py:smoke", True,
                                                        marks=pytest.mark.long)])
def test_bench_model_reports_consistent_figures(capsys, config, decode):
  code, out, err = _run(capsys, ["bench", "model", "--config", config, "--steps", "3",
                                 "--warmup", "1", "--config.train.batch_size=8"])
  assert code == 0, err
  train = out["train"]
  assert len(train["step_seconds"]) == 3
  assert train["step_seconds_median"] == pytest.approx(sorted(train["step_seconds"])[1],
                                                       abs=1e-5)
  shapes = out["batch_shapes"]
  # tokens: every position of the encoder and decoder inputs
  assert train["tokens_per_step"] == sum(shapes[k][0] * shapes[k][1] for k in shapes
                                         if k in ("encoder_input_tokens",
                                                  "decoder_input_tokens"))
  seconds = train["step_seconds_median"]
  assert train["tokens_per_second"] == pytest.approx(train["tokens_per_step"] / seconds,
                                                     rel=5e-3)
  # The FLOPs: the hand count from the model dimensions, exactly (same conventions) ...
  c = load_config_file(config)
  model = build_model_from_config(c, config_vocab(c).vocab_size)
  cfg = model.config
  dims = SMOKE_DIMS[config]
  assert (cfg.family, cfg.num_layers, cfg.d_model) == (out["family"], out["layers"],
                                                       out["d_model"])
  assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.dim_per_head, cfg.d_ff) == (
      dims["layers"], dims["d"], dims["heads"], dims["head_dim"], dims["ff"])
  shapes = {k: tuple(v) for k, v in shapes.items()}
  want = hand_train_flops(config, cfg.vocab_size, shapes)
  assert train["model_flops_per_step"] == pytest.approx(want, rel=1e-9)
  # ... and the matmuls the model's forward + backward really runs, counted in its
  # jaxpr: within 1% (the bias gradients are summed over the tokens by small matmuls,
  # under 0.2% here; T5 has no biases and matches exactly).
  batch = {k: jax.ShapeDtypeStruct(v, jnp.int32) for k, v in shapes.items()}
  grad = jax.grad(lambda p, b: model.loss_fn(p, b, None)[0])
  traced = dot_flops(jax.make_jaxpr(grad)(model.param_shapes(shapes), batch).jaxpr)
  assert train["model_flops_per_step"] == pytest.approx(traced, rel=0.01)
  peaks = out["peak_flops_per_device"]
  assert peaks["bfloat16"] > 0 and peaks["float32"] > 0
  mfu = want / seconds / (out["num_devices"] * peaks[out["dtype"]] * 1e12)
  assert train["mfu"] == pytest.approx(mfu, rel=0.01, abs=1e-4)
  assert train["compile_seconds"] > 0
  assert train["xla_memory_per_device"]["total_bytes"] > 0
  assert out["peak_memory_bytes"] > 0
  # The roofline on this CPU (measured peak and bandwidth; fake devices share the cores,
  # so it is an estimate here, not a bound): its MFU ceiling and the MFU reached are
  # against the same peak, so their ratio is the bound over the measured step.
  bound = train["roofline"]
  assert bound["chip"]["peak_flops"] == pytest.approx(peaks[out["dtype"]] * 1e12, abs=1e8)
  assert bound["seconds"] > 0 and bound["memory_seconds"] > 0
  assert train["measured_over_bound"] == pytest.approx(seconds / bound["seconds"], rel=1e-2)
  assert train["mfu"] / bound["mfu_ceiling"] == pytest.approx(bound["seconds"] / seconds,
                                                               rel=0.02)
  assert ("decode" in out) == decode
  if decode:
    assert out["decode"]["cache_length"] == shapes["decoder_input_tokens"][1]
    assert out["decode"]["tokens_per_second"] == pytest.approx(
        8 / out["decode"]["step_seconds_median"], rel=5e-3)


@pytest.mark.long
def test_bench_compile_reports_each_depth(capsys):
  code, out, err = _run(capsys, ["bench", "compile", *_TINY_BERT, "--layers", "1,3"])
  assert code == 0, err
  rows = out["compile"]
  assert [r["layers"] for r in rows] == [1, 3]
  assert rows[1]["params"] > rows[0]["params"]
  assert all(r["compile_seconds"] > 0 for r in rows)


@pytest.mark.long
def test_bench_bert_vs_torch_runs_both_frameworks(capsys):
  code, out, err = _run(capsys, ["bench", "bert-vs-torch", *_TINY_BERT, "--steps", "1",
                                 "--rounds", "2", "--warmup", "1"])
  assert code == 0, err
  for name in ("ours_bfloat16", "ours_float32", "torch_bfloat16", "torch_float32"):
    assert len(out[name]["step_seconds"]) == 2
    # A few steps of training from random init on the same batches: both losses near
    # ln(V) plus ln(2) (MLM + NSP).
    assert 3.0 < out[name]["last_loss"] < 15.0
  # Both frameworks start from our initial weights: the same first loss (float32 to
  # rounding, the bf16 autocast and our bf16 matmuls within their precision).
  assert out["torch_float32"]["first_loss"] == pytest.approx(out["ours_float32"]["first_loss"],
                                                             rel=1e-5)
  assert out["torch_bfloat16"]["first_loss"] == pytest.approx(
      out["ours_bfloat16"]["first_loss"], rel=1e-2)
  ratio = out["ours_bfloat16"]["tokens_per_second"] / out["torch_bfloat16"]["tokens_per_second"]
  assert out["ratios"]["ours_bfloat16_over_torch_bfloat16"] == pytest.approx(ratio, rel=1e-2)


@pytest.mark.parametrize("argv,message", [
    (["bench", "bert-vs-torch", "--config", "configs/gpt_cpu.py:smoke"], "needs a BERT config"),
    (["bench", "model", "--config", "configs/bert_cpu.py:smoke", "--steps", "0"], "steps=0"),
    (["bench", "compile", "--config", "configs/bert_cpu.py:smoke", "--layers", "0"],
     "layers=[0]"),
    (["bench", "model"], "--config required"),
    (["bench", "models"], "invalid choice: 'models'"),
])
def test_bench_bad_input_exits_2(capsys, argv, message):
  code, _, err = _run(capsys, argv)
  assert code == 2
  assert message in err


@pytest.mark.long
def test_console_command_runs_with_huge_pages_and_leaves_out_an_absent_tpu():
  """The installed `t5x-like` restarts itself with glibc's huge-page tunable (cli.py);
  the bench records its environment. With libtpu installed (the test extra) on a host
  with no TPU and no NVIDIA GPU, it runs on the CPU without starting libtpu's backend,
  whose start-up errors would fill stderr."""
  from t5x_like import cli
  exe = os.path.join(os.path.dirname(sys.executable), "t5x-like")
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "JAX_PLATFORMS")}
  out = subprocess.run([exe, "bench", "model", "--config", "configs/bert_cpu.py:smoke",
                        "--steps", "1", "--warmup", "0", "--config.train.batch_size=8"],
                       capture_output=True, text=True, env=env, check=True)
  name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
  supported = name == "glibc" and tuple(map(int, version.split(".")[:2])) >= (2, 35)
  result = json.loads(out.stdout)
  assert ("glibc.malloc.hugetlb=1" in result["glibc_tunables"]) == supported
  if not cli.accelerator_present():
    assert result["platform"] == "cpu"
    assert "TPU" not in out.stderr, out.stderr


@pytest.mark.long
def test_bench_data_prepared_reports_each_size(capsys):
  """`bench data --prepared` on two tiny synthetic corpora: the same tokens whatever the
  worker count, start-up figures for both verification modes, a working objective."""
  code, out, err = _run(capsys, ["bench", "data", "--objective", "span_corruption",
                                 "--prepared", "--sizes", "0.3,0.6"])
  assert code == 0, err
  sizes = out["sizes"]
  assert list(sizes) == ["0.3MB", "0.6MB"]
  for row in sizes.values():
    assert row["text_documents"] > 20
    prepare = row["prepare"]
    assert prepare["workers_1"]["tokens"] == prepare["workers_2"]["tokens"] > 0
    for mode in ("startup_blocks", "startup_full"):
      figures = row[mode]
      assert 0 < figures["open_seconds"] <= figures["to_first_batch_seconds"]
      assert figures["tokens"] == prepare["workers_1"]["tokens"]
      assert figures["tokens_per_second_per_core"] > 0
  assert sizes["0.6MB"]["text_bytes"] > 1.5 * sizes["0.3MB"]["text_bytes"]
