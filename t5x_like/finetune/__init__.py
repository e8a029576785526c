"""Fine-tuning: task data, tokenizers (sentencepiece and BERT WordPiece), example
encoding, heads, the FinetuneModel (model contract: the train step trains it), metrics.

  data       CSV / JSONL -> Examples (DataConfig, read_examples, DataError)
  wordpiece  BERT's BasicTokenizer + WordPiece from a vocab.txt
  tokenizer  one small interface over both (as_tokenizer)
  encoding   Examples -> int32 batch features per task and family
  heads      classification / tagging / span heads and their losses
  model      FinetuneModel: backbone + head, load_backbone, loss_fn, logits, predict
  metrics    accuracy, macro F1, SQuAD exact match and token F1
"""

from t5x_like.finetune.data import DataConfig, DataError, Dataset, Example, read_examples
from t5x_like.finetune.encoding import encode_examples, label_targets, span_text
from t5x_like.finetune.model import FinetuneModel
from t5x_like.finetune.tokenizer import SentencePieceTokenizer, Tokenizer, as_tokenizer
from t5x_like.finetune.wordpiece import WordPieceTokenizer

__all__ = [
    "DataConfig", "DataError", "Dataset", "Example", "read_examples", "encode_examples",
    "label_targets", "span_text", "FinetuneModel", "SentencePieceTokenizer", "Tokenizer",
    "as_tokenizer", "WordPieceTokenizer",
]
