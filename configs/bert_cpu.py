"""BERT MLM + NSP on the embedded corpus, small enough for a laptop CPU.

  t5x-like train --config configs/bert_cpu.py --workdir /tmp/bert     (~6 min, 2 cores)
  t5x-like train --config configs/bert_cpu.py:smoke --workdir /tmp/b  (seconds; tests)
  t5x-like train --config configs/bert_cpu.py:mini --workdir /tmp/bm  (~60 min, 2 cores)

`mini`: bert-mini (L4 H256 A4) on 128-token sequences, 10,000 steps of 32: the one-hour
pretraining of the text-task experiments (docs/text-tasks.md).
"""

from t5x_like.train.defaults import default_config, smoke_schedule


def get_config(arg: str = ""):
  c = default_config()
  c.model.preset = "bert-tiny"  # L2 H128 A2
  c.model.overrides = dict(max_position_embeddings=64, dropout_rate=0.1,
                           attention_dropout_rate=0.1)
  c.model.dtype = "bfloat16"  # bf16 matmuls with float32 accumulation; params float32
  c.data.objective = "bert_mlm"
  c.data.length = 64  # short sequences keep the CPU run near 6 steps/s
  c.data.options = dict(max_predictions_per_seq=10, nsp_negatives="other_document")
  smoke_schedule(c)
  c.train.batch_size = 32
  c.train.num_steps = 2000
  c.train.log_every = 50
  c.train.eval_every = 500
  c.train.eval_batches = 8
  c.train.checkpoint_every = 500
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 2e-3
  c.optimizer.schedule = "linear"
  c.optimizer.warmup_steps = 300
  if arg == "smoke":
    _shrink(c)
  elif arg == "mini":
    c.model.preset = "bert-mini"  # L4 H256 A4
    c.model.overrides = dict(max_position_embeddings=128, dropout_rate=0.1,
                             attention_dropout_rate=0.1)
    c.data.length = 128
    # NotNext from another document (BERT); same_document: from elsewhere in A's book
    c.data.options = dict(max_predictions_per_seq=20, nsp_negatives="other_document")
    c.train.num_steps = 10_000  # ~3 steps/s on 2 cores
    c.train.eval_every = 2000
    c.train.checkpoint_every = 1000
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 500
  elif arg == "glue":
    c.model.overrides = dict(max_position_embeddings=128, dropout_rate=0.1,
                             attention_dropout_rate=0.1)
    c.data.length = 128
    c.data.options = dict(max_predictions_per_seq=20, nsp_negatives="other_document")
    c.train.num_steps = 12_000
    c.train.eval_every = 3000
    c.train.checkpoint_every = 1000
    c.optimizer.warmup_steps = 500
  elif arg:
    raise ValueError(f"configs/bert_cpu.py: unknown variant {arg!r} (expected '', 'smoke',"
                     " 'mini' or 'glue')")
  return c


def _shrink(c):
  """A few tiny steps: for tests and a first look."""
  c.model.overrides = dict(max_position_embeddings=64, d_model=64, num_heads=2, d_ff=128,
                           dropout_rate=0.0, attention_dropout_rate=0.0)
  c.model.dtype = "float32"  # bit-exact resume tests run in float32
  c.data.options = dict(max_predictions_per_seq=10, nsp_negatives="other_document")
  smoke_schedule(c)
