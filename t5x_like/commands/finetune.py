"""`t5x-like finetune --config configs/<file>.py[:arg] --workdir DIR [--config.key=value ...]`.

Fine-tunes the backbone named by config.init on config.task (finetune/defaults.py) and
prints the final dev metrics. SIGTERM or Ctrl-C saves a checkpoint and stops (exit 143
or 130, 128 + the signal's number; rerun to resume). Exit status 2 on bad input (a bad
data row names its file and line), 1 on a non-finite loss. Multi-host: every process
runs the same command with the train command's flags (--num_processes, --process_id,
--coordinator_address or --distributed=auto).

The backbone (init.*; docs/commands.md):
  init.checkpoint   a `train` workdir (or its checkpoints/ or a step directory); its
                    config.py names the architecture. "" = random initialisation
  init.config       the pretraining config FILE.py[:ARG]; "" = the workdir's config.py,
                    else init.default_config (the benchmark configs: BERT-base / T5 base).
                    The random arm of a run's architecture:
                    --config.init.config=WORKDIR/config.py without init.checkpoint
  init.hf           or a Hugging Face checkpoint directory, in any form it was saved
                    (BertModel, BertForSequenceClassification, GPT2Model, ...): what the
                    task reads loads, and the log says what is skipped and what starts
                    at random (docs/models-and-data.md)
  init.hf_random    true: init.hf's architecture and tokenizer, random weights
  init.model_overrides  ModelConfig fields that keep the weights' shapes (dropout_rate,
                    dtype, ...): --config.init.model_overrides.dropout_rate=0.0 each, or
                    --config.init.model_overrides="{'dropout_rate': 0.0, ...}"
  init.step, init.default_config
The task: task.* (task.name, task.train_file, task.dev_file, task.max_length, ...).
A benchmark instead of files (configs/glue.py, superglue.py, squad.py set them):
  benchmark.name                 "glue/cola", "super_glue/cb", "squad/v1.1", ...
  benchmark.data_dir             the benchmark's own files (GLUE's glue_data/ with
                                 CoLA/train.tsv ...) or a TFDS data dir ("" =
                                 $TFDS_DATA_DIR or ~/tensorflow_datasets)
  benchmark.predict_test         predict the test splits, write the submission files
  benchmark.max_train_examples   > 0: the first N training examples only
  benchmark.max_eval_examples    > 0: the first N examples of each dev / test split
  benchmark.holdout_fraction     > 0: this fraction of train is held out and scored as
                                 the dev split (finetune-suite --lr_grid)
  benchmark.holdout_seed         the seed that draws the held-out examples
The steps: train.num_steps, or with train.num_steps=0 train.epochs passes over the
training rows read, at most train.max_steps (the benchmark configs count epochs so;
the log says the steps chosen); optimizer.warmup_fraction: a warmup of that share.
Every key with its default: t5x_like/finetune/defaults.py.
"""

from __future__ import annotations

import json
import sys

from absl import flags
from ml_collections import config_flags

from t5x_like.command_flags import lock_flags, parse_flags
from t5x_like.host_loss.distributed import define_distributed_flags, initialize_distributed
from t5x_like.train.preemption import exit_at_once_on_interrupt
from t5x_like.train.workdir_lock import command_lock


def _flags(argv: list[str]) -> flags.FlagValues:
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "fine-tuning config file[:arg]",
                                  flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_string("workdir", None, "checkpoints, metrics and dev predictions",
                      flag_values=fv)
  define_distributed_flags(fv)
  return fv


def main(argv: list[str]) -> int:
  # The lock before the config file is loaded (it may import jax through the libraries
  # it names) and before jax starts: a second finetune on the workdir is refused at once.
  with exit_at_once_on_interrupt("finetune"), command_lock(lock_flags(argv)) as lock:
    fv = parse_flags("finetune", argv, _flags, required=("config", "workdir"), doc=__doc__)
    return _finetune(fv, lock)


def _finetune(fv: flags.FlagValues, lock) -> int:
  initialize_distributed(fv, "finetune")
  from t5x_like.benchmarks.task_data import task_data
  from t5x_like.errors import NonFiniteLossError
  from t5x_like.finetune.loop import finetune
  from t5x_like.plan.remat import resolve_remat
  try:  # a UserError (config, rows, backbone, checkpoint) is reported by t5x_like.cli
    # The command picks the data source (a benchmark's or the task files) and hands the
    # run plan/'s remat chooser (model.remat_policy="auto"): finetune/ imports neither.
    final = finetune(fv.config, fv.workdir, data=task_data(fv.config),
                     choose_remat=resolve_remat, lock=lock)
  except NonFiniteLossError as e:
    print(f"t5x-like finetune: {e}", file=sys.stderr)
    return 1
  if final.status == "stopped":
    print(f"stopped by {final.stopped_by} at step {final.step}: checkpoint saved; exit"
          f" {final.exit_code}: rerun the same command to resume", flush=True)
    return final.exit_code
  print("final dev metrics: " + json.dumps(final), flush=True)
  return final.exit_code
