"""torch.nn modules built on tempokern's fused ops."""
from .offset_bias import BiasTable, OffsetBias
from .ctd_loss import CTDLoss
from .re3 import Re3Loss

__all__ = ["OffsetBias", "BiasTable", "CTDLoss"]
__all__ += ["Re3Loss"]
