"""A runner that writes a scripted reply: a real vocabulary (a tiny GGUF's, read by llama.cpp as
the engine reads it) and no model. Each slot's next token after its prompt is the next of the
script, so a reply in a model's own format (its markers special tokens of the vocabulary) goes
through the detokenizer, the output parser, the stream and the dialects as a model's would.

A forced tool choice's grammar masks the logits before sampling: a script the grammar does not
allow comes out as another token, so a test that gets its script back proves the grammar let it
through, special tokens included.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import llama_cpp as L
import numpy as np

from appliance.engine.runners.base import RunnerInfo, Span
from appliance.engine.runners.vocab import Vocab, load_model


class ScriptedRunner:
    def __init__(self, path: Path, n_ctx: int = 2048) -> None:
        self.model = load_model(path, vocab_only=True)
        self.text = Vocab(self.model)
        facts = self.text.facts()
        self.info = RunnerInfo(
            backend="scripted", model_path=str(path), model_name=path.stem, arch="llama",
            n_vocab=facts["n_vocab"], n_ctx=n_ctx, n_ctx_train=n_ctx, n_slots=1, eog_ids=facts["eog_ids"],
            bos_id=facts["bos_id"], add_bos=False, chat_template=facts["chat_template"],
            bos_text=facts["bos_text"] or "", eos_text=facts["eos_text"] or "", kv_bytes=0)
        self.eog = min(facts["eog_ids"])
        self.script: list[int] = []
        self.kv: list[int] = []
        self.prompt_len = 0

    def say(self, reply: str, prompt_len: int) -> list[int]:
        """The reply to the next prompt (of `prompt_len` tokens): its tokens (markers as the
        special tokens they are), then EOG."""
        self.script = self.tokenize(reply, add_special=False, parse_special=True) + [self.eog]
        self.prompt_len = prompt_len
        return self.script

    def kv_fingerprint(self) -> str:
        return f"scripted|{self.info.model_path}"

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return self.text.tokenize(text, add_special, parse_special)

    def detokenize(self, ids: Sequence[int]) -> bytes:
        return self.text.detokenize(ids)

    def guidance_tokenizer(self):
        return self.text.guidance_tokenizer()

    def forward(self, spans: Sequence[Span]) -> list[np.ndarray]:
        for s in spans:
            self.kv[s.start_pos:] = list(s.tokens)
        return [script_rows(self, s, np.empty((s.n_logits, self.info.n_vocab), np.float32)) for s in spans]

    def truncate(self, slot: int, n_keep: int) -> None:
        del self.kv[n_keep:]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        pass

    def save(self, slot: int) -> bytes:   # one slot: its tokens are its state
        return np.asarray(self.kv, np.int32).tobytes()

    def restore(self, slot: int, blob: bytes) -> None:
        self.kv = np.frombuffer(blob, np.int32).tolist()

    def kv_used(self, slot: int) -> int:
        return len(self.kv)

    def close(self) -> None:
        L.llama_model_free(self.model)


def script_rows(runner, s: Span, rows: np.ndarray) -> np.ndarray:
    """`rows` (span `s`'s logits) made to pick the script's next tokens: the reply token each row
    predicts, counted from the end of the prompt."""
    rows[:] = -10.0
    for r in range(s.n_logits):
        at = s.start_pos + len(s.tokens) - s.n_logits + r + 1 - runner.prompt_len
        rows[r, runner.script[min(max(at, 0), len(runner.script) - 1)]] = 10.0
    return rows


class ReplayRunner:
    """A real runner made to write a script: every forward runs on the model (the prefill, the
    KV cache and their times are real), then its logits pick the script's tokens. An agent's
    session on the real model, its replies scripted: what the prompt cache serves of each turn
    and how long each takes (scripts/agent_turns.py)."""

    def __init__(self, inner) -> None:
        self.inner, self.info = inner, inner.info
        self.eog = min(inner.info.eog_ids)
        self.script: list[int] = []
        self.prompt_len = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    say = ScriptedRunner.say

    def forward(self, spans: Sequence[Span]) -> list[np.ndarray]:
        return [script_rows(self, s, np.array(rows, np.float32)) for s, rows in zip(spans, self.inner.forward(spans))]
