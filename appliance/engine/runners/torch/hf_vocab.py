"""A Hugging Face checkpoint's tokenizer as a vocab-only GGUF, so its text goes through the same
`vocab.Vocab` (llama.cpp's tokenizer) as a GGUF model's: one tokenizer code path for the
engine, whatever the weights came from.

The file is what llama.cpp's converter writes for a byte-level BPE tokenizer (Llama 3, Qwen,
SmolLM): the token texts with their types (added tokens marked special are control tokens),
padding tokens up to the embedding's rows, the merges, the special token ids, add-BOS and the
chat template (`gguf.SpecialVocab` reads those), and the model's hyperparameters (llama.cpp
reads them even for a vocab-only load). llama.cpp also needs the name of the pre-tokenizer
(the regex that splits text before BPE), which tokenizer.json does not carry: each candidate is
tried by tokenizing a probe text with it and with Hugging Face's own `tokenizers` library, and
the first that agrees token for token is kept, as llama.cpp's converter checks a hash of the
same. None agreeing is a load error, never a silently different tokenization.

The file is written once per tokenizer (keyed by the tokenizer files' hash) under the data
directory's `vocab/`.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Mapping

import gguf

from ....errors import ModelLoadError

log = logging.getLogger("appliance.torch")

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "generation_config.json")
# llama.cpp pre-tokenizer names, most common first (llama-vocab.cpp knows these and more)
PRE = ("llama-bpe", "qwen2", "smollm", "gpt-2", "default", "qwen35", "deepseek-v3", "deepseek-llm", "gpt-4o",
       "llama4", "tekken", "olmo", "dbrx", "starcoder", "falcon", "stablelm2", "command-r", "refact", "kimi-k2",
       "glm4", "exaone", "superbpe", "seed-coder", "pixtral", "smaug-bpe", "deepseek-coder", "bloom", "jais")
# text that tells pre-tokenizers apart: runs of spaces, tabs and newlines, digit runs of every
# length, contractions in both cases, punctuation runs, accents, Cyrillic, CJK, emoji with joiners
PROBE = ("\n \n\n \t\t \t\n   \n    x\n1 12 123 1234 12345 123456 1234567 3.14 1..2 1...2\n"
         "It's done, isn't it? We'LL see; they'd've said 'NO'. I'M sure you'RE right!!! ???...\n"
         "«Ça va?» naïve café — привет мир, Ελλάδα. 東京では3時に会いましょう。我爱北京天安门123\n"
         "def f(x):\n\treturn x**2  # ok\n    if a>=b: pass\n```\n----====****    \n"
         "🚀 👩‍💻 🦙🦙 ✅\u200d  end")


def vocab_file(model_dir: Path, meta: Mapping[str, Any], n_vocab: int, cache_dir: Path) -> Path:
    """The vocab-only GGUF of `model_dir`'s tokenizer (written on first use), `meta` the
    model's GGUF-style hyperparameters, `n_vocab` its embedding rows."""
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise ModelLoadError(f"{model_dir}: no tokenizer.json (a fast Hugging Face tokenizer is needed)")
    h = hashlib.sha256(f"{n_vocab}".encode())
    for name in FILES:
        if (model_dir / name).is_file():
            h.update(name.encode() + (model_dir / name).read_bytes())
    out = Path(cache_dir) / f"{h.hexdigest()[:24]}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    want = _hf_ids(model_dir)
    tmp = out.with_suffix(".tmp")
    for pre in candidates(model_dir):
        write(tmp, model_dir, meta, n_vocab, pre)
        if _llama_ids(tmp) == want:
            tmp.replace(out)
            log.info("%s: tokenizer converted with llama.cpp's %r pre-tokenizer: %s", model_dir, pre, out)
            return out
    tmp.unlink(missing_ok=True)
    raise ModelLoadError(f"{model_dir}: none of llama.cpp's pre-tokenizers ({', '.join(PRE)}) splits text "
                         "as this tokenizer does, so its text cannot be tokenized faithfully here")


def candidates(model_dir: Path) -> list[str]:
    """Every known pre-tokenizer, the one tokenizer.json's pre_tokenizer suggests first."""
    pre = json.dumps(json.loads((model_dir / "tokenizer.json").read_text()).get("pre_tokenizer"))
    first = []
    if '"Digits"' in pre and '"individual_digits": true' in pre:
        first.append("smollm")
    if r"\\p{N}{1,3}" in pre:
        first.append("llama-bpe")
    if r"\\p{N}|" in pre or r"\\p{N}| " in pre:
        first.append("qwen2")
    return first + [p for p in PRE if p not in first]


def write(path: Path, model_dir: Path, meta: Mapping[str, Any], n_vocab: int, pre: str) -> None:
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    model, decoder = tj.get("model") or {}, tj.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel":
        raise ModelLoadError(f"{model_dir}: only byte-level BPE tokenizers (Llama 3, Qwen, SmolLM) are converted; "
                             f"this one is {model.get('type')} with a {decoder.get('type')} decoder")
    texts = {int(i): t for t, i in model["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in texts}
    for t in tj.get("added_tokens") or []:
        texts[int(t["id"])] = t["content"]
        types[int(t["id"])] = gguf.TokenType.CONTROL if t.get("special") else gguf.TokenType.USER_DEFINED
    size = max(n_vocab, max(texts) + 1)
    tokens = [texts.get(i, f"[PAD{i}]") for i in range(size)]
    toktypes = [types.get(i, gguf.TokenType.UNUSED) for i in range(size)]
    w = gguf.GGUFWriter(str(path), str(meta["general.architecture"]))
    for key, value in meta.items():
        if key != "general.architecture":
            _add(w, key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(toktypes)
    gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=size).add_to_gguf(w, quiet=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()


def _add(w: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    else:
        w.add_string(key, str(value))


def _hf_ids(model_dir: Path) -> list[int]:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ModelLoadError("a Hugging Face checkpoint's tokenizer is checked with the `tokenizers` package, "
                             "which is not installed: pip install 'appliance[torch]'") from None
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROBE, add_special_tokens=False).ids


def _llama_ids(path: Path) -> list[int] | None:
    """The probe tokenized by llama.cpp with this vocab file; None when llama.cpp refuses it."""
    import llama_cpp as L

    from ..vocab import Vocab, load_model

    try:
        model = load_model(path, vocab_only=True)
    except ModelLoadError:
        return None
    try:
        return Vocab(model).tokenize(PROBE, add_special=False, parse_special=False)
    finally:
        L.llama_model_free(model)
