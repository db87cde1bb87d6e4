"""Models on transformers backbones: CTDEncoder and small offline backbones for tests/demo.

Needs the `transformers` and `safetensors` packages (imported when used)."""
from .checkpoint import load_chunqiu_ctd, load_encoder, save_encoder
from .encoder import CTDEncoder, CTDOutput, Encoded, pool
from .levels import LevelSpec, calendar_levels
from .tiny import build_char_tokenizer, tiny_bert
from .minilm import minilm_path, resolve_backbone

__all__ = ["CTDEncoder", "CTDOutput", "Encoded", "LevelSpec", "calendar_levels", "pool", "save_encoder",
           "load_encoder", "load_chunqiu_ctd", "build_char_tokenizer", "tiny_bert"]
__all__ += ["minilm_path", "resolve_backbone"]
from .tmrl import TMRLEncoder, TMRLOutput, load_tmrl

__all__ += ["TMRLEncoder", "TMRLOutput", "load_tmrl"]
