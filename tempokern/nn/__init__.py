"""nn.Module front-ends of the fused ops."""
from .offset_bias import BiasTable, OffsetBias

__all__ = ["OffsetBias", "BiasTable"]
