"""Patches a copy of llama.cpp's tests/test-chat.cpp so that every template case it runs through
`peg_test_builder::run()` (the `peg_tester("models/templates/X.jinja").test(INPUT)...run()` cases of
test_template_output_peg_parsers, test_lfm2_parser's included) appends one JSON line to the file named by
$HARVEST_OUT: the template file, the request (messages, tools as OpenAI JSON, tool_choice,
parallel_tool_calls, reasoning_format, enable_thinking, add_generation_prompt, continue_final_message,
json_schema), the input, is_partial, the message the test expects, which expect setters built it, and
the test's own verdict (an exception stops that case only; the run goes on). Its main runs
test_template_output_peg_parsers alone; the tests that need llama-server's code are cut. build.sh runs it.

    python harvest_patch.py L/tests/test-chat.cpp OUT.cpp
"""
from __future__ import annotations

import sys

WRITER = r'''
// ---- harvest (added by scripts/llama_chat_reference/harvest_patch.py) ----
#include <nlohmann/json.hpp>
#include <cstdlib>
static void harvest_write(const std::string & path, const peg_test_case & tc0,
                          const std::vector<std::string> & setters, const std::string & err) {
    using hjson = nlohmann::ordered_json;
    const char * out = std::getenv("HARVEST_OUT");
    if (!out) return;
    peg_test_case tc = tc0;
    if (tc.params.messages.empty()) tc.params.messages = { message_user };  // as test_peg_parser does
    auto name = path.substr(path.rfind('/') + 1);
    name = name.substr(0, name.size() - 6);  // .jinja
    hjson calls = hjson::array();
    for (const auto & c : tc.expect.tool_calls) calls.push_back({{"name", c.name}, {"arguments", c.arguments}, {"id", c.id}});
    const char * cont = "none";
    switch (tc.params.continue_final_message) {
        case COMMON_CHAT_CONTINUATION_NONE: cont = "none"; break;
        case COMMON_CHAT_CONTINUATION_AUTO: cont = "auto"; break;
        case COMMON_CHAT_CONTINUATION_REASONING: cont = "reasoning_content"; break;
        case COMMON_CHAT_CONTINUATION_CONTENT: cont = "content"; break;
    }
    const char * choice = tc.params.tool_choice == COMMON_CHAT_TOOL_CHOICE_REQUIRED ? "required"
                        : tc.params.tool_choice == COMMON_CHAT_TOOL_CHOICE_NONE ? "none" : "auto";
    hjson kwargs = hjson::object();
    for (const auto & [k, v] : tc.params.chat_template_kwargs) kwargs[k] = hjson::parse(v);
    hjson rec = {
        {"template", name},
        {"messages", hjson::parse(common_chat_msgs_to_json_oaicompat(tc.params.messages).dump())},
        {"tools", hjson::parse(common_chat_tools_to_json_oaicompat(tc.params.tools).dump())},
        {"tool_choice", choice},
        {"parallel_tool_calls", tc.params.parallel_tool_calls},
        {"reasoning_format", common_reasoning_format_name(tc.params.reasoning_format)},
        {"enable_thinking", tc.params.enable_thinking},
        {"chat_template_kwargs", kwargs},
        {"add_generation_prompt", tc.params.add_generation_prompt},
        {"continue_final_message", cont},
        {"json_schema", tc.params.json_schema.empty() ? hjson() : hjson::parse(tc.params.json_schema)},
        {"input", tc.input},
        {"is_partial", tc.is_partial},
        {"expect", {{"content", tc.expect.content}, {"reasoning_content", tc.expect.reasoning_content},
                    {"tool_calls", calls}}},
        {"expect_setters", setters},
        {"test_error", err.empty() ? hjson() : hjson(err)},
    };
    FILE * f = std::fopen(out, "a");
    auto s = rec.dump(-1, ' ', false, hjson::error_handler_t::replace);
    std::fprintf(f, "%s\n", s.c_str());
    std::fclose(f);
}
// ---- end harvest ----
'''


def patch(src: str) -> str:
    def sub(old: str, new: str, count: int = 1) -> None:
        nonlocal src
        if src.count(old) != count:
            raise SystemExit(f"harvest_patch: expected {count} of {old!r}, found {src.count(old)}")
        src = src.replace(old, new)

    def cut(start: str, stop: str) -> None:
        nonlocal src
        i, j = src.index(start), src.index(stop)
        src = src[:i] + src[j:]

    sub("// Fluent builder for PEG parser tests\nclass peg_test_builder;",
        WRITER + "\n// Fluent builder for PEG parser tests\nclass peg_test_builder;")
    sub("    peg_tester &  tester_;\n    peg_test_case tc_;\n",
        "    peg_tester &  tester_;\n    peg_test_case tc_;\n    std::vector<std::string> setters_;\n")
    for setter in ("expect", "expect_content", "expect_reasoning", "expect_tool_calls"):
        head = f"    peg_test_builder & {setter}("
        i = src.index(head)
        j = src.index("{\n", i) + 2
        src = src[:j] + f'        setters_.push_back("{setter}");\n' + src[j:]
    sub("        test_peg_parser(tester_.tmpls_.get(), [this](peg_test_case & t) { t = tc_; }, tester_.detailed_debug_);\n",
        "        std::string harvest_err;\n"
        "        try {\n"
        "            test_peg_parser(tester_.tmpls_.get(), [this](peg_test_case & t) { t = tc_; }, tester_.detailed_debug_);\n"
        "        } catch (const std::exception & e) {\n"
        "            harvest_err = e.what();\n"
        "        }\n"
        "        harvest_write(tester_.template_path(), tc_, setters_, harvest_err);\n")
    # only test_template_output_peg_parsers runs: the tests that need llama-server's code go (its headers
    # pull in mtmd and httplib), and main runs the template cases alone, every one of them
    sub('#include "../tools/server/server-chat.h"\n', "")
    cut("static void test_convert_responses_to_chatcmpl() {", "// Shared LFM2 parser cases")
    cut("static void test_reasoning_budget_tokens_per_request() {", "static void test_reasoning_effort_caps() {")
    i = src.index("int main(int argc, char ** argv) {")
    src = src[:i] + ("int main() {\n    test_template_output_peg_parsers(false);\n"
                     "    std::cout << \"\\n[chat] template cases done\" << '\\n';\n    return 0;\n}\n")
    return src


if __name__ == "__main__":
    src = open(sys.argv[1], encoding="utf-8").read()
    open(sys.argv[2], "w", encoding="utf-8").write(patch(src))
