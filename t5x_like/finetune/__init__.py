"""Fine-tuning: task data, tokenizers (sentencepiece and BERT WordPiece), task types,
the FinetuneModel (model contract: the train step trains it), metrics.

  task       the Task interface: parse a row, encode it, head, loss, metrics
  tasks/     the task types, one file each, and their registry (TASKS, make_task)
  data       CSV / JSONL -> a task's Examples (read_examples, DataError)
  wordpiece  BERT's BasicTokenizer + WordPiece from a vocab.txt
  tokenizer  one small interface over both (as_tokenizer)
  encoding   the encodings tasks build on (BERT pairs, GPT pairs, text to text), and
             EncodedRows: encoded rows for the training loader
  heads      the classification head and the weighted label losses
  model      FinetuneModel: backbone + the task's head, load_backbone, loss_fn, predict
  evaluate   dev predictions (multi-host) and metrics
  loop       `finetune(config, workdir)` on the shared step runner (train/runner.py)
"""

from t5x_like.finetune.data import DataError, Dataset, read_examples
from t5x_like.finetune.encoding import encode_examples, label_targets
from t5x_like.finetune.model import FinetuneModel
from t5x_like.finetune.task import Example, Task
from t5x_like.finetune.tasks import TASKS, make_task
from t5x_like.finetune.tokenizer import SentencePieceTokenizer, Tokenizer, as_tokenizer
from t5x_like.finetune.wordpiece import WordPieceTokenizer

__all__ = [
    "DataError", "Dataset", "Example", "read_examples", "encode_examples", "label_targets",
    "FinetuneModel", "Task", "TASKS", "make_task", "SentencePieceTokenizer", "Tokenizer",
    "as_tokenizer", "WordPieceTokenizer",
]
