"""Fine-tuning: task data, tokenizers (sentencepiece and BERT WordPiece), task types,
the FinetuneModel (model contract: the train step trains it), metrics, the runner. Its
data comes from the caller (task_data); the benchmarks are one source,
t5x_like/benchmarks/, which this package never imports; experiments on top,
t5x_like/studies/.

  task       the Task interface: parse a row, encode it, head, loss, metrics
  tasks/     the task types, one file each, and their registry (TASKS, make_task)
  data       CSV / JSONL -> a task's Examples (read_examples, DataError)
  task_data  TaskData, the seam to a run's data source: its task, splits, checks and
             outputs after evaluation
  splits     the CSV / JSONL files' TaskData (FileTaskData)
  wordpiece  BERT's BasicTokenizer + WordPiece from a vocab.txt
  tokenizer  one small interface over both (as_tokenizer)
  encoding   the encodings tasks build on (BERT pairs, GPT pairs, text to text), and
             EncodedRows: encoded rows for the training loader
  heads      the classification head and the weighted label losses
  model      FinetuneModel: backbone + the task's head, load_backbone, loss_fn, predict
  evaluate   dev predictions (multi-host) and metrics
  loop       `finetune(config, workdir)` on the shared step runner (train/runner.py)
"""

import importlib

# The names below load their module on first use (PEP 562), so that importing a
# submodule (the finetune command's flags, the workdir lock taken before jax) does not
# import jax through the model.
_EXPORTS = {
    "DataError": "data", "Dataset": "data", "read_examples": "data",
    "encode_examples": "encoding", "label_targets": "encoding",
    "FinetuneModel": "model", "Example": "task", "Task": "task",
    "TASKS": "tasks", "make_task": "tasks",
    "SentencePieceTokenizer": "tokenizer", "Tokenizer": "tokenizer",
    "as_tokenizer": "tokenizer", "WordPieceTokenizer": "wordpiece",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
