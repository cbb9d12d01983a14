"""Accuracy against test resolution: `vitlab resolution`.

The paper's central move is a change of resolution between pretraining and fine-tuning (section 3.2);
this shows what resolution does to a trained model. Each checkpoint is scored on its data's
validation split at every test size, its position embeddings resampled in memory to the new token
grid (and, with `--patch-sizes`, its patch kernel PI-resized), no training. The data module is the
one `vitlab validate` builds (the checkpoint's recorded data settings, `--data` as `--data_path`,
`img_size` set to the test size) and the score ViTClassifier's own val/acc1 and val/loss, so a row's
top-1 is what `vitlab validate --data.img_size=S` gives. With `--run` the fine-tuned checkpoint's best
size is recorded in it as its test size (`--record` does so for each `--ckpt`; `--no-record` never),
which predict, explain, export and `load_pretrained` then use.

    vitlab resolution --ckpt runs/finetune/checkpoints/last.ckpt --sizes 32,48,64,96,128
    vitlab resolution --ckpt A.ckpt --data DATA_A --ckpt B.ckpt --data DATA_B --sizes 32,64 --out figs
    vitlab resolution --run runs/finetune      # after `make finetune`: the source and the fine-tuned model

One job per module: `data` (the data module rebuilt at a size), `score` (ViTClassifier's evaluation),
`sweep` (rows over sizes), `report` (table, JSON, figure), `choose` (the test size, recorded),
`finetune` (`--run`, within the run's limit_val_batches), `cli` (the arguments).
"""

from vitlab.analysis.resolution.choose import choose_test_size, record_choice
from vitlab.analysis.resolution.cli import main
from vitlab.analysis.resolution.data import datamodule_for, recorded
from vitlab.analysis.resolution.finetune import finetune_report, run_limit
from vitlab.analysis.resolution.report import figure, format_table, write_report
from vitlab.analysis.resolution.score import evaluation_module, score
from vitlab.analysis.resolution.sweep import Row, around, sweep

__all__ = [
    "Row", "around", "choose_test_size", "datamodule_for", "evaluation_module", "figure", "finetune_report",
    "format_table", "main", "record_choice", "recorded", "run_limit", "score", "sweep", "write_report",
]
