"""Small offline backbones: a character-vocabulary tokenizer built from a corpus (Classical
Chinese is one character per token, as in bert-base-chinese) and a randomly initialised BERT."""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Optional

SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def build_char_tokenizer(texts: Iterable[str], *, min_count: int = 1, max_size: Optional[int] = None):
    """A fast BERT-style tokenizer whose vocabulary is every character of `texts` (seen at least
    min_count times, most frequent first), plus the five BERT special tokens.

    Built from a `tokenizers.Tokenizer` object, not from a vocab file: transformers 5 ignores
    `BertTokenizerFast(vocab_file=...)` silently. The result's size is checked here."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    counts = Counter()
    for t in texts:
        counts.update(ch for ch in t if not ch.isspace())
    chars = [c for c, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if n >= min_count]
    if max_size is not None:
        chars = chars[:max(0, max_size - len(SPECIAL))]
    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.NFC()
    # one token per character, whatever the script (Latin letters too, so nothing becomes [UNK] wholesale)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Split("", behavior="isolated")])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    if len(fast) != len(vocab):
        raise RuntimeError(f"character tokenizer has {len(fast)} tokens, expected {len(vocab)}")
    probe = chars[:3]
    if probe and fast("".join(probe), add_special_tokens=False)["input_ids"] != [vocab[c] for c in probe]:
        raise RuntimeError("character tokenizer does not split text into single characters")
    return fast


def tiny_bert(vocab_size: int, *, hidden: int = 64, layers: int = 2, heads: int = 2,
              intermediate: int = 128, max_position: int = 256, seed: Optional[int] = None):
    """A randomly initialised BertModel (no pooler) small enough to train on 2 CPU cores."""
    import torch
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, intermediate_size=intermediate,
                     max_position_embeddings=max_position, hidden_dropout_prob=0.1,
                     attention_probs_dropout_prob=0.1)
    if seed is not None:
        torch.manual_seed(seed)
    return BertModel(cfg, add_pooling_layer=False)
