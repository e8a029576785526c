"""`t5x-like data prepare`: a config's data.source, tokenized once with its vocabulary
into a prepared corpus (data/prepare.py, data/prepared.py).

  t5x-like data prepare --config FILE[:ARG] --out DIR [--runner DirectRunner]
      [--num_workers 4] [--num_shards N] [--overwrite] [-- BEAM_PIPELINE_OPTIONS...]

Everything after `--` goes to Beam's pipeline options (Dataflow: --project, --region,
--temp_location, ...). Prints a JSON summary.
"""

from __future__ import annotations

import json
import os

from absl import flags
from ml_collections import config_flags

from t5x_like.command_flags import parse_flags
from t5x_like.data.prepare import DOCS_PER_SHARD, RUNNERS, run_prepare
from t5x_like.errors import UserError
from t5x_like.experiment import config_vocab


def _flags(args: list[str]) -> flags.FlagValues:
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "experiment config file[:arg]",
                                  flag_values=fv, lock_config=True, sys_argv=args)
  flags.DEFINE_string("out", None, "folder of the prepared corpus (local or gs://)",
                      flag_values=fv)
  flags.DEFINE_enum("runner", "DirectRunner", list(RUNNERS), "Beam runner", flag_values=fv)
  flags.DEFINE_integer("num_workers", min(4, os.cpu_count() or 1),
                       "DirectRunner worker processes", flag_values=fv)
  flags.DEFINE_integer("num_shards", None, f"shards (default: one per {DOCS_PER_SHARD}"
                       " source documents)", flag_values=fv)
  flags.DEFINE_bool("overwrite", False, "replace the contents of a non-empty --out",
                    flag_values=fv)
  return fv


def main(argv: list[str]) -> int:
  beam_args: list[str] = []
  if "--" in argv:
    cut = argv.index("--")
    argv, beam_args = argv[:cut], argv[cut + 1:]
  fv = parse_flags("data prepare", argv, _flags, doc=__doc__)
  if not fv.out:
    raise UserError("data prepare: give --out DIR (local or gs://)")
  config = fv.config
  if config.data.get("mixture", ""):
    raise UserError(f"data.mixture={config.data.mixture!r}: `data prepare` prepares one raw"
                    " source; prepare each with --config.data.mixture='' and"
                    " --config.data.source=SPEC (a recipe's `raw` variant does that)")
  manifest = run_prepare(config.data.source, config_vocab(config), fv.out,
                         held_out_fraction=config.data.eval_fraction, runner=fv.runner,
                         num_workers=fv.num_workers, num_shards=fv.num_shards,
                         overwrite=fv.overwrite, beam_args=beam_args)
  summary = {"out": fv.out, "source": manifest["source"], "runner": manifest["runner"],
             "shards": len(manifest["shard_ranges"]), "seconds": manifest["seconds"],
             **{f"{split}_{k}": v for split, t in manifest["totals"].items()
                for k, v in t.items()},
             "bad_input": manifest["bad_input"]}
  print(json.dumps(summary, indent=1))
  return 0
