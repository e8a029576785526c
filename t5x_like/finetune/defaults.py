"""The fine-tuning config schema: every key, its default and its meaning.

  t5x-like finetune --config configs/finetune_books.py:bert --workdir DIR \
      --config.init.checkpoint=workdir/bert_books

The backbone is named by a pretraining config (init.config: its model and vocabulary
sections, so the architecture always matches what `t5x-like train` wrote) and
initialised from that run's checkpoint (init.checkpoint), or at random when
init.checkpoint is "", or from a Hugging Face checkpoint directory (init.hf: the
architecture and tokenizer come from it, vocab.txt for BERT; init.hf_random: its
architecture at random).
"""

from __future__ import annotations

import ml_collections

from t5x_like.finetune.tasks import task_options
from t5x_like.train.defaults import default_config as default_train_config


def default_finetune_config() -> ml_collections.ConfigDict:
  pretrain = default_train_config()
  c = ml_collections.ConfigDict()
  c.seed = 0

  # Where the backbone comes from.
  c.init = ml_collections.ConfigDict()
  c.init.config = ""  # pretraining config "file.py[:arg]" (model + vocab sections)
  # Where init.config is "": the config.py that train saved in init.checkpoint's
  # workdir, else this one (the benchmark configs: BERT-base / T5 base); see backbone.py.
  c.init.default_config = ""
  c.init.checkpoint = ""  # its train workdir / checkpoints dir / step dir; "" = random init
  c.init.step = -1  # checkpoint step; -1 = the latest
  # Or: a Hugging Face checkpoint directory (instead of init.config): config.json,
  # model.safetensors (and vocab.txt for BERT), saved in any form (BertModel,
  # BertForPreTraining, BertForSequenceClassification, GPT2Model, T5EncoderModel, ...):
  # what the task reads loads (BERT's pooler where it has one), the log says what is
  # skipped and what starts at random (docs/models-and-data.md).
  c.init.hf = ""
  c.init.hf_random = False  # True: init.hf's architecture and tokenizer, random weights
  # ModelConfig fields (t5x_like/models/config.py) that replace the backbone's, not its
  # shapes: dropout_rate, attention_dropout_rate, dtype, remat_policy, ... One per flag,
  # --config.init.model_overrides.dropout_rate=0.0, or all at once as a dict,
  # --config.init.model_overrides="{'dropout_rate': 0.0, 'attention_dropout_rate': 0.0}".
  c.init.model_overrides = ml_collections.ConfigDict()

  # The task and its files; the other task.* keys are the options of the task types
  # (the fields of each Task in t5x_like/finetune/tasks/, with their defaults).
  c.task = ml_collections.ConfigDict()
  c.task.name = "classification"  # one of t5x_like.finetune.tasks.TASKS
  c.task.train_file = ""  # CSV (header row) or JSONL
  c.task.dev_file = ""
  c.task.test_file = ""  # optional: scored once at the end (test_* in final_metrics.json)
  c.task.update(task_options())

  # Or a benchmark task (t5x_like/benchmarks/registry.py), read from its own files or a
  # TFDS build: it sets the task type and columns; task.train_file / dev_file are then unused.
  c.benchmark = ml_collections.ConfigDict()
  c.benchmark.name = ""  # e.g. "glue/cola", "super_glue/cb", "squad/v1.1"
  # The benchmark's own files (GLUE's glue_data/ with CoLA/train.tsv ..., SuperGLUE's
  # BoolQ/train.jsonl ..., SQuAD's train-v1.1.json ...) or a TFDS data dir holding its
  # build; "" = $TFDS_DATA_DIR or ~/tensorflow_datasets.
  c.benchmark.data_dir = ""
  c.benchmark.predict_test = True  # predict the test splits, write the submission files
  c.benchmark.max_train_examples = 0  # > 0: the first N training examples only
  c.benchmark.max_eval_examples = 0  # > 0: the first N of each dev / test split
  # > 0: this fraction of train (drawn by holdout_seed) is held out and scored as the
  # dev split, trained on the rest; dev and test are not read (finetune-suite --lr_grid).
  c.benchmark.holdout_fraction = 0.0
  c.benchmark.holdout_seed = 0

  # Tokenizer: "" = the pretraining config's vocabulary (init.hf: its vocab.txt or
  # spiece.model); else a sentencepiece .model or a WordPiece vocab.txt path.
  c.tokenizer = ml_collections.ConfigDict()
  c.tokenizer.vocab = ""
  c.tokenizer.lowercase = True  # WordPiece only

  c.train = ml_collections.ConfigDict()
  c.train.batch_size = 32
  c.train.num_steps = 300  # 0 = from train.epochs
  # With num_steps = 0: this many passes over the training rows the run reads (its train
  # file or split, after max_train_examples / holdout), at most max_steps (0 = no cap).
  c.train.epochs = 0.0
  c.train.max_steps = 0
  c.train.microbatches = 1
  c.train.log_every = 20
  c.train.eval_every = 100  # dev metrics every N steps and at the end; 0 = end only
  c.train.checkpoint_every = 0  # 0 = only the final state

  c.optimizer = pretrain.optimizer
  c.optimizer.learning_rate = 5e-5
  c.optimizer.warmup_steps = 30
  # > 0: the warmup is this fraction of the run's steps (known once the train split is
  # read; warmup_steps must be 0 then).
  c.optimizer.warmup_fraction = 0.0
  # Layer-wise lr decay (finetune/layer_decay.py): the head and top layer at the rate,
  # each layer below x layer_decay, the embeddings slowest; 1 = off.
  c.optimizer.layer_decay = 1.0
  c.mesh = pretrain.mesh
  return c


def cpu_recipe_config(backbone: str, smoke: bool) -> ml_collections.ConfigDict:
  """The classification recipe of the shipped configs for the tasks `t5x-like task` builds
  (configs/finetune_books.py, configs/text_tasks.py) on a CPU backbone, as the book and
  text-task experiments chose it. A product default, not the lab's: no study imports it.

  backbone: the pretraining config, "file.py:arg" (configs/bert_cpu.py or t5_cpu.py).
  AdamW at 1e-3, 30 warmup steps then linear decay, weight decay 0.01, 300 steps of 32,
  a single text mean-pooled without the pooler (docs/book-task.md, docs/text-tasks.md);
  smoke (tests): 10 steps of 8.
  """
  c = default_finetune_config()
  c.init.config = backbone
  c.task.name = "classification"
  c.task.pooling = "mean"
  c.task.pooler = False
  c.train.batch_size = 32
  c.train.num_steps = 300
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 1e-3
  c.optimizer.schedule = "linear"
  c.optimizer.warmup_steps = 30
  c.optimizer.weight_decay = 0.01
  if smoke:
    c.train.num_steps = 10
    c.train.batch_size = 8
  return c
