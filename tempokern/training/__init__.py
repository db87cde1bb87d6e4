"""Training and evaluation of CTDEncoder models (needs transformers + safetensors)."""
from .data import (add_window_queries, block_split_of_rank, load_dataset, training_pairs, with_block_splits,
                   zztj_demo_dataset)
from .evaluate import METRIC_KEYS, evaluate_model, markdown_table
from ..nn.calendar_ce import calendar_ce
from .trainer import VARIANTS, CTDConfig, CTDTrainer, CTDResult, apply_variant, train_ctd

__all__ = ["CTDConfig", "CTDTrainer", "CTDResult", "VARIANTS", "train_ctd", "apply_variant", "evaluate_model",
           "markdown_table", "METRIC_KEYS", "calendar_ce", "load_dataset", "zztj_demo_dataset",
           "with_block_splits", "add_window_queries", "block_split_of_rank", "training_pairs"]
from .tmrl import TMRL_VARIANTS, TMRLConfig, TMRLResult, TMRLTrainer, evaluate_dims, runs_by_dim, train_tmrl

__all__ += ["TMRLConfig", "TMRLTrainer", "TMRLResult", "TMRL_VARIANTS", "train_tmrl", "evaluate_dims", "runs_by_dim"]
from .re3 import Re3Config, Re3Example, Re3Trainer, examples_from_dataset, examples_from_synth, re3_eval, train_re3

__all__ += ["Re3Config", "Re3Example", "Re3Trainer", "train_re3", "examples_from_synth", "examples_from_dataset",
            "re3_eval"]
