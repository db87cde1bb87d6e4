"""Models on transformers backbones: CTDEncoder and small offline backbones for tests/demo.

Needs the `transformers` and `safetensors` packages (imported when used)."""
from .checkpoint import load_chunqiu_ctd, save_encoder
from .encoder import CTDEncoder, CTDOutput, Encoded, pool
from .levels import LevelSpec, calendar_levels
from .tiny import build_char_tokenizer, tiny_bert
from .minilm import minilm_path, resolve_backbone


def load_encoder(path, calendar=None, **kw) -> CTDEncoder:
    """A CTDEncoder saved by CTDEncoder.save / save_encoder (:meth:`CTDEncoder.load`)."""
    return CTDEncoder.load(path, calendar, **kw)


__all__ = ["CTDEncoder", "CTDOutput", "Encoded", "LevelSpec", "calendar_levels", "pool", "save_encoder",
           "load_encoder", "load_chunqiu_ctd", "build_char_tokenizer", "tiny_bert"]
__all__ += ["minilm_path", "resolve_backbone"]
from .tmrl import TMRLEncoder, TMRLOutput, load_tmrl

__all__ += ["TMRLEncoder", "TMRLOutput", "load_tmrl"]
from .re3 import Re3Encoder

__all__ += ["Re3Encoder"]
from .time_heads import TimeParserHeads

__all__ += ["TimeParserHeads"]
