"""torch.nn modules built on tempokern's fused ops."""
from .offset_bias import BiasTable, OffsetBias
from .ctd_loss import CTDLoss
from .matryoshka import MatryoshkaInfoNCE

__all__ = ["OffsetBias", "BiasTable", "CTDLoss", "MatryoshkaInfoNCE"]
