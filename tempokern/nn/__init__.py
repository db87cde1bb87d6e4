"""torch.nn modules built on tempokern's fused ops."""
from .offset_bias import BiasTable, OffsetBias
from .ctd_loss import CTDLoss
from .re3 import Re3Loss
from .tmrl import (MatryoshkaCKALoss, MatryoshkaDistillLoss, TemporalProjector, TemporalSubspaceLoss, TMRLLoss,
                   temporal_pool)

__all__ = ["OffsetBias", "BiasTable", "CTDLoss"]
__all__ += ["Re3Loss"]
__all__ += ["TemporalProjector", "temporal_pool", "TemporalSubspaceLoss", "MatryoshkaDistillLoss", "MatryoshkaCKALoss",
            "TMRLLoss"]
