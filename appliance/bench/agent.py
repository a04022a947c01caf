"""The agent replay of `appliance bench`: conversations like a coding agent's (a long system
prompt with tools, then turns that each add a tool call and its result and resend everything),
interleaved turn by turn; a cold request at a follow-up's depth to compare against; and, with
--agent-restart, each conversation's next turn after the server restarts."""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..store import ResultCell
from . import prompt_sets
from .client import CellFailed
from .context import CHAT, BenchOptions, Context, once
from .session import Step, Variant, nonce, served_cell

AGENT_SYSTEM = (
    "You are a coding agent working in a Python repository. Work in small steps: read the files "
    "you need with read_file, search with search_code, run the tests with run_shell, and change "
    "files with write_file. After each tool result, say in one sentence what you learned and call "
    "the next tool. Never guess a file's contents; read it first.\n\n"
    "Project notes follow.\n\n")


class Agent:
    """One replayed agent conversation: a long system prompt with tools, then turns that each
    append a tool call and its result of a few hundred tokens and resend everything."""

    def __init__(self, ctx: Context, o: BenchOptions, index: int, tools: Sequence[dict]) -> None:
        rng = random.Random(1000 + index)
        notes = prompt_sets.filler(ctx.prompts.chars_for(o.agent_system_tokens), seed=rng.randrange(1 << 30))
        self.tools = list(tools)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"[{nonce()}] " + AGENT_SYSTEM + notes},
            {"role": "user", "content": "The test suite fails in the storage module. Find out why and fix it."}]
        self.index, self.o, self.ctx, self.rng = index, o, ctx, rng

    def add_turn(self, turn: int) -> None:
        call_id = f"call_{self.index}_{turn}"
        path = f"src/storage/part_{turn}.py"
        # content "" rather than none: templates that print message.content (SmolLM2's, rendered
        # by llama-cpp-python's server) need the field
        self.messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]})
        body = prompt_sets.filler(self.ctx.prompts.chars_for(self.o.agent_turn_tokens),
                                  seed=self.rng.randrange(1 << 30))
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": f"# {path}\n{body}"})

    def body(self, messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        # a fixed amount of decode per turn (the reply is replaced by the next tool call anyway)
        return {"messages": messages or self.messages, "tools": self.tools,
                "max_tokens": self.o.agent_reply_tokens, "temperature": 0, "ignore_eos": True}


def agent_steps(ctx: Context, v: Variant, o: BenchOptions) -> list[Step]:
    """Conversations interleaved turn by turn, then a cold request at the first follow-up's and
    the last turn's depth (the same conversation behind a fresh nonce) to compare against."""
    if o.agent_conversations < 1 or o.agent_turns < 1:
        return []
    # the tool-calls set's tools, read_file (which every turn calls) first; --agent-tools keeps N
    tools = next(p.tools for p in prompt_sets.load("tool-calls").prompts if p.tools)[:o.agent_tools]
    agents = once(lambda: [Agent(ctx, o, i, tools) for i in range(o.agent_conversations)])
    steps = []
    for turn in range(o.agent_turns):
        for c in range(o.agent_conversations):
            def run(c: int = c, turn: int = turn) -> list[ResultCell]:
                agent = agents()[c]
                extra = {"cell": "agent", "conversation": c, "turn": turn}
                if turn > 0:
                    agent.add_turn(turn)
                    if o.agent_tool_ms:   # the tool's run time: the server is idle meanwhile
                        time.sleep(o.agent_tool_ms / 1000)
                        extra["tool_ms"] = o.agent_tool_ms
                cell, _, _ = served_cell(v, CHAT, agent.body(), ctx.sampler, prompt_set="agent", kind="agent",
                                         cache_on=True, extra=extra)
                return [cell]
            steps.append(Step(f"agent c{c} turn {turn}", 0, v.label, "served", run))
    if o.agent_restart:
        steps += _restart_steps(ctx, v, o, agents)
    for turn in sorted({min(1, o.agent_turns - 1), o.agent_turns - 1}):
        def cold(turn: int = turn) -> list[ResultCell]:
            agent = agents()[0]
            # the conversation as it stood at that turn, behind a new nonce: nothing of it is cached
            upto = 2 + 2 * turn
            messages = [dict(m) for m in agent.messages[:upto]]
            messages[0]["content"] = f"[{nonce()}] " + messages[0]["content"]
            cell, _, _ = served_cell(v, CHAT, agent.body(messages), ctx.sampler, prompt_set="agent",
                                     kind="agent-cold", extra={"cell": f"agent cold turn {turn}", "turn": turn})
            return [cell]
        steps.append(Step(f"agent cold turn {turn}", 0, v.label, "served", cold))
    return steps


def _restart_steps(ctx: Context, v: Variant, o: BenchOptions, agents: Callable[[], list[Agent]]) -> list[Step]:
    """Restart the server (its prompt states go to disk at SIGTERM), then each conversation's
    next turn: what a saved conversation costs after a restart."""
    def restart() -> list[ResultCell]:
        if v.target.server is not None:
            v.target.server.restart()
        elif v.target.restart_command:
            v.target.restart_with(v.target.restart_command)
        else:
            raise CellFailed("--agent-restart against a server the bench did not start needs its restart "
                             "command (--restart-command for --url, --against-restart-command for --against)")
        return []
    steps = [Step("agent restart", 0, v.label, "served", restart)]
    turn = o.agent_turns
    for c in range(o.agent_conversations):
        def run(c: int = c) -> list[ResultCell]:
            agent = agents()[c]
            agent.add_turn(turn)
            cell, _, _ = served_cell(v, CHAT, agent.body(), ctx.sampler, prompt_set="agent", kind="agent-restart",
                                     cache_on=True, extra={"cell": "agent after restart", "conversation": c,
                                                           "turn": turn})
            return [cell]
        steps.append(Step(f"agent c{c} turn {turn} after restart", 0, v.label, "served", run))
    return steps
