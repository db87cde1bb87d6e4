"""torch.nn modules built on tempokern's fused ops."""
from .ctd_loss import CTDLoss

__all__ = ["CTDLoss"]
