"""BERT-base / BERT-large pretraining with the paper's recipe (Devlin et al. 2019, A.2).

  t5x-like data prepare --config configs/bert_pretrain.py:base,raw --out gs://BUCKET/prepared/wiki
  t5x-like data prepare --config configs/bert_pretrain.py:base,raw \
      --config.data.source='text:/data/books/*.txt' --out gs://BUCKET/prepared/books
  t5x-like train --config configs/bert_pretrain.py:base,corpus=gs://BUCKET/prepared/wiki,books=gs://BUCKET/prepared/books \
      --workdir gs://BUCKET/bert-base
  t5x-like train --config configs/bert_pretrain.py:large --workdir gs://BUCKET/bert-large
  t5x-like train --config configs/bert_pretrain.py:base,local --workdir /tmp/b  (CPU smoke)
  t5x-like plan  --config configs/bert_pretrain.py:base --topology v3-32

Batch 256 for 1M steps as one run of two phases: 90% at length 128 (20 predictions per
sequence), then 10% at length 512 (80), resuming from the phase-1 checkpoint. AdamW
lr 1e-4 (decoupled weight decay 0.01, not on norms or biases; no bias correction, as
the reference code), 10k warmup steps then linear decay to 0, clipping at 1.0,
dropout 0.1. BERT-base ran on 4 Cloud TPUs (16 chips: v3-32, 32 JAX devices),
BERT-large on 16 (64 chips: v3-128); both meshes are pure data parallel (8 and 2 rows
per device).

Data: the paper's mixture (section 3.1) of English Wikipedia (2,500M words) and
BooksCorpus (800M words), as data.mixture (data/mixture.py) of two prepared corpora:
Wikipedia from TFDS prepared once into `corpus`, and your own books text (BooksCorpus
is not in TFDS) prepared into `books`. rates=size (default) mixes them by their
training tokens, as concatenating them did in the paper; rates=paper fixes the
paper's 2500:800 (0.76 / 0.24) whatever your books corpus holds. `raw` names the raw
Wikipedia source (one source, no mixture), which is what `data prepare` reads; the
`local` variant mixes two halves of the embedded corpus the same way. Vocabulary: set
data.vocab to a 30,522-piece BERT sentencepiece model
(`t5x-like vocab train --family bert --vocab-size 30522 ...`); the model keeps the
paper's 30,522 embedding rows either way.
"""

from t5x_like.train.defaults import default_config, parse_arg, smoke_schedule

_SIZES = {"base": "bert-base", "large": "bert-large"}
# (Wikipedia, books) rates: by training tokens, or the paper's words (millions).
_RATES = {"size": ("size", "size"), "paper": (2500, 800)}
# The local variant's stand-ins for Wikipedia and BooksCorpus: halves of the embedded corpus.
_LOCAL_WIKI = "austen_pride_and_prejudice,dickens_a_tale_of_two_cities,melville_moby_dick"
_LOCAL_BOOKS = "carroll_alices_adventures_in_wonderland,wells_the_time_machine"


def get_config(arg: str = "base"):
  a = parse_arg(arg, size="base", local=False, raw=False,
                corpus="gs://YOUR_BUCKET/prepared/wikipedia-en-bert",
                books="gs://YOUR_BUCKET/prepared/books-bert", rates="size")
  if a.size not in _SIZES:
    raise ValueError(f"configs/bert_pretrain.py: size {a.size!r}; known: {sorted(_SIZES)}")
  if a.rates not in _RATES:
    raise ValueError(f"configs/bert_pretrain.py: rates {a.rates!r}; known: {sorted(_RATES)}")
  c = default_config()
  c.model.preset = _SIZES[a.size]
  c.model.overrides = dict(vocab_size=30522, max_position_embeddings=512,
                           dropout_rate=0.1, attention_dropout_rate=0.1)
  c.model.dtype = "bfloat16"
  c.model.scan_layers = True
  # Save only matmul outputs for the backward pass and recompute the rest: measured on
  # CPU (`t5x-like bench model`), the scanned step is faster with it than without remat.
  c.model.remat_policy = "dots"

  # Training reads the corpora prepared once by `t5x-like data prepare`
  # (docs/prepared-corpora.md), mixed; `:SIZE,raw` names the raw Wikipedia source,
  # which is what `data prepare` reads.
  wiki_rate, books_rate = _RATES[a.rates]
  if a.raw:
    c.data.source = "tfds:wikipedia/20230601.en:train#text"
  else:
    c.data.mixture = f"prepared:{a.corpus}={wiki_rate},prepared:{a.books}={books_rate}"
  c.data.objective = "bert_mlm"
  c.data.length = 128
  c.data.options = dict(max_predictions_per_seq=20, nsp=True)
  c.data.eval_fraction = 0.001

  c.train.batch_size = 256
  c.train.num_steps = 1_000_000
  c.train.phases = (
      dict(until_step=900_000, length=128, options=dict(max_predictions_per_seq=20)),
      dict(until_step=1_000_000, length=512, options=dict(max_predictions_per_seq=80)),
  )
  c.train.log_every = 100
  c.train.eval_every = 10_000
  c.train.eval_batches = 20
  c.train.checkpoint_every = 5_000

  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 1e-4
  c.optimizer.schedule = "linear"
  c.optimizer.warmup_steps = 10_000
  c.optimizer.weight_decay = 0.01
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.999, 1e-6
  c.optimizer.bias_correction = False
  c.optimizer.clip_norm = 1.0

  c.mesh.data = -1  # v3-32: 32 devices x 8 rows; v3-128: 128 x 2
  if a.local:
    _local(c, a.rates)
  return c


def _local(c, rates: str):
  """A CPU-sized copy: same objective, phases and optimizer; tiny model and steps."""
  c.model.overrides = dict(num_layers=2, d_model=64, num_heads=2, d_ff=128,
                           max_position_embeddings=128, dropout_rate=0.1,
                           attention_dropout_rate=0.1)
  c.model.dtype = "float32"
  if c.data.mixture:  # the same mixture shape on the embedded corpus
    wiki_rate, books_rate = _RATES[rates]
    c.data.mixture = f"embedded:{_LOCAL_WIKI}={wiki_rate},embedded:{_LOCAL_BOOKS}={books_rate}"
  else:
    c.data.source = "embedded"
  c.data.eval_fraction = 0.02
  smoke_schedule(c)
  c.train.phases = (
      dict(until_step=16, length=64, options=dict(max_predictions_per_seq=10)),
      dict(until_step=20, length=128, options=dict(max_predictions_per_seq=20)),
  )
  c.data.options = dict(max_predictions_per_seq=10, nsp=True)
