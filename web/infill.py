"""llama-server's /infill: fill-in-the-middle code completion for models with FIM tokens. The
body's prefix, suffix, cursor line and other files are laid out as llama-server's
format_prompt_infill lays them out; the request is then served as /completion's
(llamaserver.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from appliance.engine.process import EngineClient
from appliance.engine.runners.base import FimTokens

from .serving import need

# llama-server's prompt (format_prompt_infill). The prefix and suffix get a budget of
# llama-server's default batch, 3:1 (at most half a small context); the extra context fills what
# the context has left after them and twice the reply's budget, its most recent part kept.
FIM_BATCH = 2048
REPO, FILE, SNIPPET = "myproject\n", "filename\n", "\n\n--- snippet ---\n\n"


@dataclass(frozen=True)
class Infill:
    prefix: str
    suffix: str
    prompt: str                          # the text before the cursor on its line: after the prefix
    extra: tuple[tuple[str, str], ...]   # (filename, text) of other files' chunks

    @staticmethod
    def read(body: dict[str, Any]) -> Infill:
        for name in ("input_prefix", "input_suffix"):
            need(isinstance(body.get(name), str), f"'{name}' is required: a string", name)
        prompt, extra = body.get("prompt", ""), body.get("input_extra")
        extra = [] if extra is None else extra
        need(isinstance(prompt, str), "'prompt' must be a string", "prompt")
        need(isinstance(extra, list), "'input_extra' must be a list of {\"filename\", \"text\"}", "input_extra")
        chunks = []
        for i, c in enumerate(extra):
            where = f"input_extra[{i}]"
            need(isinstance(c, dict) and isinstance(c.get("text"), str), f"{where}.text must be a string",
                 f"{where}.text")
            need(isinstance(c.get("filename", ""), str), f"{where}.filename must be a string", f"{where}.filename")
            chunks.append((c.get("filename", "tmp"), c["text"]))
        return Infill(body["input_prefix"], body["input_suffix"], prompt, tuple(chunks))

    def texts(self) -> list[str]:
        """Every text the layout tokenizes (without special tokens), once each."""
        names = [f"{name}\n" for name, _ in self.extra]
        return list(dict.fromkeys([self.prefix, self.suffix, REPO, FILE, SNIPPET, *names,
                                   *(text for _, text in self.extra)]))

    def layout(self, fim: FimTokens, tok: Mapping[str, Sequence[int]], prompt: Sequence[int],
               bos: int | None, n_ctx: int, n_predict: int) -> list[int]:
        """llama-server's prompt, prefix-suffix-middle: the other files in the repo-level pattern,
        then [PRE]prefix prompt [SUF]suffix [MID]; the reply continues the prompt. (llama-server
        puts the BOS after the other files; here it starts the sequence.)"""
        budget = min(FIM_BATCH, n_ctx // 2)
        prefix = list(tok[self.prefix])
        prefix = prefix[len(prefix) - min(len(prefix), 3 * (budget // 4)):]
        suffix = list(tok[self.suffix])[:max(0, budget // 4 - (2 + len(prompt)))]
        middle = [fim.pre, *prefix, *prompt, fim.suf, *suffix, fim.mid]
        extra = self._extra(fim, tok)
        reply = n_predict if n_predict > 0 else budget // 4
        n_extra = min(len(extra), max(0, n_ctx - len(middle) - (bos is not None) - 2 * reply))
        return ([bos] if bos is not None else []) + extra[len(extra) - n_extra:] + middle

    def _extra(self, fim: FimTokens, tok: Mapping[str, Sequence[int]]) -> list[int]:
        out = [fim.rep, *tok[REPO]] if fim.rep is not None else []
        for name, text in self.extra:
            out += [fim.sep, *tok[f"{name}\n"]] if fim.sep is not None else list(tok[SNIPPET])
            out += tok[text]
        return out + ([fim.sep, *tok[FILE]] if fim.sep is not None else [])


def infill_ids(engine: EngineClient, body: dict[str, Any], n_predict: int) -> list[int]:
    """The /infill body's prompt as token ids, laid out as llama-server lays it out."""
    info = engine.info
    missing = [name for name in ("pre", "suf", "mid") if getattr(info.fim, name) is None]
    need(not missing, f"this model has no fill-in-the-middle tokens (FIM_{', FIM_'.join(m.upper() for m in missing)} "
         "missing): /infill needs a code model that has them", "input_prefix")
    infill = Infill.read(body)
    texts = infill.texts()
    ids = engine.tokenize_many([(t, False, False) for t in texts] + [(infill.prompt, False, True)])
    return infill.layout(info.fim, dict(zip(texts, ids)), ids[-1], info.bos_id if info.add_bos else None,
                         info.n_ctx, n_predict)
