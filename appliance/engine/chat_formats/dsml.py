"""DeepSeek V3.2 / V4's DSML calls, as llama.cpp reads them (common/parsers/deepseek.cpp):

    <think>reasoning</think>content

    <｜DSML｜function_calls>                                  (V4: tool_calls)
    <｜DSML｜invoke name="f">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

A parameter is string="true" where its schema may be a string (its text is the value), else
string="false" and its text is JSON; required parameters come first, in the schema's order.
Thinking is opened by the generation prompt; a reply may go from its reasoning straight into
the calls, without </think>.
"""
from __future__ import annotations

import json
from typing import ClassVar

from .base import Call, Context, Format, Parsed, dump_args, schema_types
from .json_grammar import Lark, allowed, q, some, value
from .jsoncalls import SPACE, Cursor, Fail, Short, closed_args, held_text

DSML = "｜DSML｜"
THINK = ("<think>", "</think>")


class Dsml(Format):
    name: ClassVar[str] = "deepseek-dsml"
    think = THINK
    block: ClassVar[str] = "function_calls"

    @classmethod
    def detect(cls, src: str) -> bool:
        return "dsml_token" in src and "DSML" in src and ("function_calls" in src or "tool_calls" in src)

    def __init__(self, block: str | None = None) -> None:
        if block:
            self.block = block

    @property
    def fc(self) -> tuple[str, str]:
        return f"<{DSML}{self.block}>", f"</{DSML}{self.block}>"

    @property
    def markers(self) -> tuple[str, ...]:           # type: ignore[override]
        return (self.fc[0],)

    def grammar(self, ctx: Context, choice: str) -> str | None:
        return _grammar(self, ctx, choice)

    def parse(self, text: str, ctx: Context, partial: bool) -> Parsed:
        out = Parsed()
        opened = ctx.thinking_open and ctx.extract_reasoning
        src = THINK[0] + text if opened else text
        cur = Cursor(src)
        fc = self.fc[0]
        if opened:
            cur.pos = len(THINK[0])
            delims = (THINK[1], fc, "\n\n" + fc) if ctx.tools else (THINK[1],)
            body, found = cur.until(*delims)
            if not found:
                out.reasoning = held_text(body, partial, delims)
                return out
            out.reasoning = body if body.strip(SPACE) else ""
            if src.startswith(THINK[1], cur.pos):
                cur.pos += len(THINK[1])
            elif not self._calls(cur, ctx, partial, out, src):
                cur.pos = len(THINK[0])                       # not calls after all: reasoning to </think>
                body, found = cur.until(THINK[1])
                out.reasoning = held_text(body, partial and not found, (THINK[1],))
                if not found:
                    return out
                cur.pos += len(THINK[1])
            else:
                return out
        if not ctx.tools:
            out.content = held_text(src[cur.pos:], partial)
            return out
        body, found = cur.until("\n\n" + fc, fc)
        out.content = held_text(body, partial and not found, ("\n\n" + fc, fc))
        if found and not self._calls(cur, ctx, partial, out, src):
            out.content += held_text(src[cur.pos:], partial)      # llama.cpp throws: the rest stays content
        return out

    def _calls(self, cur: Cursor, ctx: Context, partial: bool, out: Parsed, src: str) -> bool:
        """Reads the calls block at the cursor (after whitespace) into `out`; False, and `out`
        as it was, where the text is not one (llama.cpp's parser fails there)."""
        start, calls = cur.pos, []
        cur.call = None
        cur.space()
        try:
            cur.need(self.fc[0])
            cur.space()
            while True:
                calls.append(self._invoke(cur, ctx))
                save = cur.pos
                cur.space()
                if not ctx.parallel or not cur.opt(f"<{DSML}invoke"):
                    cur.pos = save
                    break
                cur.pos = save
                cur.space()
            cur.space()
            cur.need(self.fc[1])
            if cur.pos < len(src):
                raise Fail
        except Fail:
            cur.pos = start
            return False
        except Short:
            if cur.call is not None:
                if not partial:
                    cur.call.arguments = closed_args(cur.call.arguments)
                calls.append(cur.call)
            elif not partial and not calls:
                out.content += src[start:]
                return True
        out.calls.extend(calls)
        return True

    def _invoke(self, cur: Cursor, ctx: Context) -> Call:
        cur.call = None
        cur.need(f'<{DSML}invoke name="')
        names = [n for n in ctx.tools if cur.src.startswith(n + '">\n', cur.pos)]
        if not names:
            rest = cur.src[cur.pos:]
            if any((n + '">\n').startswith(rest) for n in ctx.tools):
                raise Short
            raise Fail
        name = names[0]
        cur.pos += len(name) + 3
        schema = ctx.tools[name] or {}
        props = schema.get("properties") or {}
        required = [p for p in props if p in (schema.get("required") or [])]
        members: list[str] = []
        call = cur.call = Call(name, "{", closed=False)
        for i, p in enumerate(required):
            if i:
                cur.space()
            members.append(self._param(cur, p, props[p]))
            call.arguments = "{" + ",".join(members)
        optional = [p for p in props if p not in required]
        while optional:
            save = cur.pos
            cur.space()
            got = None
            for p in optional:
                try:
                    got = self._param(cur, p, props[p])
                    break
                except Fail:
                    continue
            if got is None:
                cur.pos = save
                break
            members.append(got)
            call.arguments = "{" + ",".join(members)
        cur.space()
        cur.need(f"</{DSML}invoke>")
        cur.call = None
        return Call(name, "{" + ",".join(members) + "}")

    def _param(self, cur: Cursor, name: str, schema) -> str:
        is_string = "string" in schema_types(schema)
        save = cur.pos
        if not cur.lit(f'<{DSML}parameter name="{name}" string="{"true" if is_string else "false"}">'):
            cur.pos = save
            raise Fail
        end = f"</{DSML}parameter>"
        raw, found = cur.until(end)
        if not found:
            raise Short
        cur.pos += len(end)
        if is_string:
            return f"{json.dumps(name)}:{dump_args(raw)}"
        try:
            value = json.loads(raw)
        except ValueError:
            raise Fail from None
        return f"{json.dumps(name)}:{dump_args(value)}"


def _grammar(fmt: Dsml, ctx: Context, choice: str) -> str | None:
    """The whole reply under a forced choice (json_grammar.py's contract), as deepseek.cpp's
    grammar is: where the prompt opened thinking, the reasoning up to </think> (then content up to
    the calls) or straight into the calls; else content up to the calls. Each invoke has its
    required parameters in the schema's order, then optional ones in any order; a string
    parameter's value is any text up to its closing tag, any other a JSON value of its schema."""
    names = allowed(ctx.tools, choice)
    if not names:
        return None
    g = Lark()
    w = g.ws
    end = q(f"</{DSML}parameter>")
    invokes = []
    for n in names:
        schema = ctx.tools[n] or {}
        props = schema.get("properties") or {}
        params = {}
        for p, sub in props.items():
            is_string = "string" in schema_types(sub)
            head = q(f'<{DSML}parameter name="{p}" string="{"true" if is_string else "false"}">')
            params[p] = f"{head} {g.upto(f'</{DSML}parameter>')}" if is_string else f"{head} {value(sub)} {end}"
        required = [params[p] for p in props if p in (schema.get("required") or [])]
        optional = [params[p] for p in props if p not in (schema.get("required") or [])]
        body = f" {w} ".join(required) + (f" ({w} ({' | '.join(optional)}))*" if optional else "")
        invokes.append(f'{q(f"<{DSML}invoke name={chr(34)}{n}{chr(34)}>{chr(10)}")} {body} {w} {q(f"</{DSML}invoke>")}')
    g.choice("invoke", invokes)
    g.add("calls", f"{w} {some('invoke', ctx.parallel, w)} {w} {q(fmt.fc[1])}")
    said = f"{g.upto(fmt.fc[0])} calls"
    if not (ctx.thinking_open and ctx.extract_reasoning):
        return g.text(said)
    return g.text(f"{g.upto(THINK[1])} {said} | {g.upto(fmt.fc[0])} calls")


class DsmlV4(Dsml):
    name = "deepseek-v4-dsml"
    block = "tool_calls"

    @classmethod
    def detect(cls, src: str) -> bool:
        return super().detect(src) and "function_calls" not in src


FAMILIES = [DsmlV4, Dsml]
