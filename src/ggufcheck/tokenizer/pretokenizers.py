"""Pre-tokenizers of byte-level BPE vocabularies, as a table keyed by ``tokenizer.ggml.pre``.

A GGUF does not store its pre-tokenizer regex; it stores a name (``tokenizer.ggml.pre``)
that llama.cpp maps to a list of regexes in ``src/llama-vocab.cpp``
(``llm_tokenizer_bpe``'s constructor) and to a few flags (``llama_vocab::impl::load``).
This table holds those facts as data. The regexes are llama.cpp's (which adapt the
``tokenizer.json`` originals: ``(?i:'s|...)`` is spelled ``'[sS]|...`` because C++
``std::regex`` has no inline flags), so ggufcheck splits text the way llama.cpp does.

Splitting semantics (llama.cpp ``unicode_regex_split``): the regexes are applied one
after the other; each one splits every fragment left by the previous one into its matches
*and* the unmatched stretches between them ("isolated" behaviour), so a fragment boundary
is never crossed by a later regex and lookaheads stop at it.

Python-specific spellings: ECMAScript ``$`` (end of the fragment) is written ``\\Z``
here, because Python's ``$`` also matches before a final newline.

One llama.cpp quirk is reproduced on purpose: a regex without ``\\p{..}`` classes runs
in llama.cpp on text whose non-ASCII whitespace was replaced by U+000B (so that ``\\s``
matches it), which also hides those characters from literal ranges such as DeepSeek's
``[\\u0800-\\u4e00]`` (it contains U+2028). :func:`split` does the same substitution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ggufcheck.errors import Unavailable

# -- the regexes (llama-vocab.cpp, llm_tokenizer_bpe::llm_tokenizer_bpe) ------------------

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# GPT-2's regex; llama.cpp's spelling lacks the final "|\s+" but its custom splitter
# (unicode_regex_split_custom_gpt2) implements it, and so does GPT-2's original.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_JAIS2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
    r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
# DeepSeek LLM (deepseek-llm): its letter class is the literal list from tokenizer.json
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-"
    "\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00"
    "-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-"
    "\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13"
    "-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_DEEPSEEK3_MAIN = (
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o (o200k): llama.cpp rewrites [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] as "a letter that is
# not a-z" because its std::regex fallback sees every non-ASCII letter as one class.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS + "?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


@dataclass(frozen=True)
class PreTokenizer:
    """One row: the regexes llama.cpp applies in order, and the flags the name sets."""

    kind: str  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_* without the prefix
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a whole pre-token that is in the vocab is emitted as is
    add_bos: bool = False  # default when tokenizer.ggml.add_bos_token is absent
    bos_absent: bool = False  # no default BOS id (chatglm / glm4: only metadata gives one)
    names: tuple[str, ...] = field(default=())


# Rows: (kind, names, regexes, flags). Names and flags from llama_vocab::impl::load.
_ROWS: tuple[PreTokenizer, ...] = (
    PreTokenizer(
        "DEFAULT",
        (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
        names=("default", ""),
    ),
    PreTokenizer(
        "GPT2",
        (_GPT2,),
        names=(
            "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
            "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais", "trillion",
            "granite-docling", "exaone4", "jina-v1-en", "jina-v2-code", "roberta-bpe",
        ),
    ),
    PreTokenizer(  # digits split one by one, then GPT-2
        "STARCODER",
        (r"\p{N}", _GPT2),
        names=("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
    ),
    PreTokenizer(
        "LLAMA3",
        (_LLAMA3,),
        ignore_merges=True,
        add_bos=True,
        names=("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
    ),
    PreTokenizer("DBRX", (_LLAMA3,), names=("dbrx", "smaug-bpe")),
    PreTokenizer("CHATGLM4", (_LLAMA3,), bos_absent=True, names=("chatglm-bpe",)),
    PreTokenizer("GLM4", (_LLAMA3,), bos_absent=True, ignore_merges=True, names=("glm4", "glm5")),
    PreTokenizer("JAIS2", (_JAIS2,), names=("jais-2",)),
    PreTokenizer(
        "QWEN2",
        (_QWEN2,),
        names=("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open"),
    ),
    PreTokenizer("QWEN35", (_QWEN35,), names=("qwen35",)),
    PreTokenizer(
        "DEEPSEEK_LLM",
        (
            r"[\r\n]",
            r"\s?[" + _DEEPSEEK_LLM_LETTERS + r"]+",
            r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+\Z",
            r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
            r"\p{N}+",
        ),
        names=("deepseek-llm",),
    ),
    PreTokenizer(
        "DEEPSEEK_CODER",
        (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}"),
        names=("deepseek-coder",),
    ),
    PreTokenizer(
        "DEEPSEEK3_LLM",
        (r"\p{N}{1,3}", r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK3_MAIN),
        names=("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
    ),
    PreTokenizer(
        "FALCON",
        (
            r"[\p{P}\$\+<=>\^~\|`]+",
            _GPT2,  # llama.cpp's string is the GPT-2 one, so its custom GPT-2 splitter runs
            r"[0-9][0-9][0-9]",
        ),
        names=("falcon",),
    ),
    PreTokenizer("GPT4O", (_GPT4O,), names=("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")),
    PreTokenizer("TEKKEN", (_TEKKEN,), ignore_merges=True, add_bos=True, names=("tekken",)),
    PreTokenizer("BLOOM", (_BLOOM,), names=("poro-chat", "bloom", "gpt3-finnish")),
    PreTokenizer("VIKING", (_BLOOM, r"\p{N}"), names=("viking",)),
    PreTokenizer(
        "SEED_CODER",
        (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
        names=("seed-coder",),
    ),
    PreTokenizer(
        "UFAKZEKA",
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
        names=("ufakzeka",),
    ),
    PreTokenizer("GROK_2", (_QWEN2,), names=("grok-2",)),
    PreTokenizer(
        "BAILINGMOE",
        (
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
        names=("bailingmoe", "bailingmoe2", "llada-moe"),
    ),
    PreTokenizer(
        "MINICPM5",
        (
            r"\p{N}{1,3}",
            _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        ignore_merges=True,
        names=("minicpm5",),
    ),
    PreTokenizer(
        "EXAONE_MOE",
        (
            _CONTRACTIONS
            + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
            r"|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
        names=("exaone-moe",),
    ),
    PreTokenizer("LAGUNA", (r"[^\n]+|[\n]+", _QWEN2), names=("laguna",)),
    PreTokenizer(
        "SPARK2_5",
        (
            r"\p{N}{1,3}",
            r"[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        ),
        names=("spark2_5",),
    ),
)

# Names llama.cpp knows but ggufcheck does not split like it yet (custom C++ splitters or
# \p{Lu}-style classes that llama.cpp approximates): an explicit "unsupported" message.
UNSUPPORTED = {
    "kimi-k2": "custom Han-aware splitter in llama.cpp's unicode.cpp",
    "afmoe": "custom digit-grouping splitter in llama.cpp's unicode.cpp",
    "tiny_aya": "digit grouping regex approximated by a custom splitter in llama.cpp",
    "cohere2moe": "digit grouping regex approximated by a custom splitter in llama.cpp",
    "superbpe": "zero-width split regex",
    "youtu": "\\p{Lu}/\\p{Ll} classes that llama.cpp collapses to \\p{L}",
    "chameleon": "image-token regexes",
    "gemma4": "SentencePiece-style BPE on raw UTF-8 (tokenizer model 'gemma4')",
    "granite-embed-multi-311m": "SentencePiece-style BPE on raw UTF-8",
    "sarvam-moe": "SentencePiece-style BPE on raw UTF-8",
    "granite-embed-multi-97m": "GPT-4o regex with \\p{M}",
    "whitespace": "whitespace tokenizer model",
}

PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: row for row in _ROWS for name in row.names}


@lru_cache(maxsize=None)
def _compiled(regexes: tuple[str, ...]) -> tuple[Any, ...]:
    try:
        import regex  # the third-party module: \p{L} classes and Unicode-aware \s
    except ImportError:
        raise Unavailable(
            "byte-level BPE tokenization needs the 'regex' package (for \\p{L} classes)",
            tip="pip install regex",
        ) from None
    return tuple(regex.compile(r) for r in regexes)


# non-ASCII White_Space characters (llama.cpp unicode_set_whitespace) -> U+000B
_WIDE_WHITESPACE = str.maketrans(
    {c: "\x0b" for c in (0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000)}
)


def split(text: str, regexes: tuple[str, ...]) -> list[str]:
    """Split ``text`` into pre-tokens: each regex in turn isolates its matches."""
    fragments = [text] if text else []
    for pattern, compiled in zip(regexes, _compiled(regexes)):
        wide = "\\p{" not in pattern  # llama.cpp's std::wregex path (see module docstring)
        out: list[str] = []
        for fragment in fragments:
            start = 0
            target = fragment.translate(_WIDE_WHITESPACE) if wide else fragment
            for m in compiled.finditer(target):
                if m.start() > start:
                    out.append(fragment[start : m.start()])
                if m.end() > m.start():
                    out.append(fragment[m.start() : m.end()])
                start = m.end()
            if start < len(fragment):
                out.append(fragment[start:])
        fragments = out
    return fragments
