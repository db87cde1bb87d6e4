"""torch.nn modules built on tempokern's fused ops."""
from .offset_bias import BiasTable, OffsetBias
from .ctd_loss import CTDLoss

__all__ = ["OffsetBias", "BiasTable", "CTDLoss"]
from .film import FiLM, TimeEmbedding

__all__ += ["TimeEmbedding", "FiLM"]
