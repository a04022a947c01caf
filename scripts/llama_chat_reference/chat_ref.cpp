// llama.cpp's chat layer as llama-server drives it, one request per stdin line, one JSON answer per stdout line:
// common_chat_templates_init + common_chat_templates_apply (tools/server/server-common.cpp's
// oaicompat_chat_params_parse), then, when a "reply" is given, common_chat_parse on it with the parser
// params llama-server builds from the apply result (server-schema.cpp: common_chat_parser_params(params),
// reasoning_format, generation_prompt, params.parser loaded into the arena when non-empty).
//
// in:  {"template": PATH, "bos", "eos", "messages": [...], "tools"?, "tool_choice"?: "auto|required|none",
//       "parallel_tool_calls"?: bool (default: the template's caps, as llama-server),
//       "reasoning_format"?: "none|deepseek|deepseek-legacy|auto" (default deepseek, llama-server's),
//       "enable_thinking"?: bool (default: on where the template supports it, as llama-server),
//       "kwargs"?: {chat_template_kwargs}, "add_generation_prompt"?: bool (default true),
//       "continue_final_message"?: false|true|"reasoning_content"|"content", "json_schema"?: {...},
//       "reply"?: "model text", "partial"?: bool}
// out: {"prompt", "format", "generation_prompt", "grammar", "grammar_lazy", "grammar_triggers": [{"type","value"}],
//       "preserved_tokens", "additional_stops", "supports_thinking", "thinking_start_tag", "thinking_end_tags",
//       "inputs": {"enable_thinking", "parallel_tool_calls"} (as resolved), "message"?: {"content", "reasoning_content", "tool_calls": [{"name","arguments","id"}]}}
//      or the apply facts with "error" and "error_stage": "parse" where common_chat_parse throws,
//      or {"error", "error_stage": "apply"|"request"} where the request or common_chat_templates_apply throws.
#include "chat.h"
#include "common.h"
#include "log.h"
#include <nlohmann/json.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <unistd.h>
using json = nlohmann::ordered_json;

static const char * trigger_type_name(common_grammar_trigger_type t) {
    switch (t) {
        case COMMON_GRAMMAR_TRIGGER_TYPE_TOKEN:        return "token";
        case COMMON_GRAMMAR_TRIGGER_TYPE_WORD:         return "word";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN:      return "pattern";
        case COMMON_GRAMMAR_TRIGGER_TYPE_PATTERN_FULL: return "pattern_full";
    }
    return "?";
}

static json msg_json(const common_chat_msg & m) {
    json calls = json::array();
    for (const auto & c : m.tool_calls) {
        calls.push_back({{"name", c.name}, {"arguments", c.arguments}, {"id", c.id}});
    }
    return {{"content", m.content}, {"reasoning_content", m.reasoning_content}, {"tool_calls", calls}};
}

static json handle(const json & in) {
    std::string stage = "request";
    json out = json::object();
    try {
        std::ifstream f(in.at("template").get<std::string>());
        if (!f) throw std::runtime_error("cannot read template " + in.at("template").get<std::string>());
        std::stringstream ss; ss << f.rdbuf();
        stage = "apply";
        auto tmpls = common_chat_templates_init(nullptr, ss.str(), in.value("bos", ""), in.value("eos", ""));
        stage = "request";
        auto caps = common_chat_templates_get_caps(tmpls.get());

        common_chat_templates_inputs inputs;
        inputs.use_jinja = true;
        inputs.messages = common_chat_msgs_parse_oaicompat(common_json::parse(in.at("messages").dump()));
        if (in.contains("tools") && !in.at("tools").is_null()) {
            inputs.tools = common_chat_tools_parse_oaicompat(common_json::parse(in.at("tools").dump()));
        }
        inputs.tool_choice = common_chat_tool_choice_parse_oaicompat(in.value("tool_choice", std::string("auto")));
        inputs.parallel_tool_calls = in.value("parallel_tool_calls", caps["supports_parallel_tool_calls"]);
        inputs.add_generation_prompt = in.value("add_generation_prompt", true);
        if (in.contains("continue_final_message")) {
            inputs.continue_final_message =
                common_chat_continuation_parse(common_json::parse(in.at("continue_final_message").dump()));
        }
        if (in.contains("json_schema") && !in.at("json_schema").is_null()) {
            inputs.json_schema = in.at("json_schema").dump();
        }
        inputs.reasoning_format = common_reasoning_format_from_name(in.value("reasoning_format", std::string("deepseek")));
        // server-context.cpp: thinking on where the template supports it (--reasoning auto)
        if (in.contains("enable_thinking")) {
            inputs.enable_thinking = in.at("enable_thinking").get<bool>();
        } else {
            inputs.enable_thinking = common_chat_templates_support_enable_thinking(tmpls.get());
        }
        if (in.contains("kwargs")) {
            for (auto & [k, v] : in.at("kwargs").items()) inputs.chat_template_kwargs[k] = v.dump();
        }
        // server-common.cpp: the enable_thinking kwarg overrides the default
        auto it = inputs.chat_template_kwargs.find("enable_thinking");
        if (it != inputs.chat_template_kwargs.end()) {
            if (it->second == "true") inputs.enable_thinking = true;
            else if (it->second == "false") inputs.enable_thinking = false;
            else if (!it->second.empty() && it->second[0] == '"')
                throw std::invalid_argument("invalid type for \"enable_thinking\" (expected boolean, got string)");
        }

        stage = "apply";
        auto params = common_chat_templates_apply(tmpls.get(), inputs);
        json triggers = json::array();
        for (const auto & t : params.grammar_triggers) {
            triggers.push_back({{"type", trigger_type_name(t.type)}, {"value", t.value}});
        }
        out = {
            {"prompt", params.prompt},
            {"format", common_chat_format_name(params.format)},
            {"generation_prompt", params.generation_prompt},
            {"grammar", params.grammar},
            {"grammar_lazy", params.grammar_lazy},
            {"grammar_triggers", triggers},
            {"preserved_tokens", params.preserved_tokens},
            {"additional_stops", params.additional_stops},
            {"supports_thinking", params.supports_thinking},
            {"thinking_start_tag", params.thinking_start_tag},
            {"thinking_end_tags", params.thinking_end_tags},
            {"inputs", {{"enable_thinking", inputs.enable_thinking}, {"parallel_tool_calls", inputs.parallel_tool_calls}}},
        };
        if (in.contains("reply") && !in.at("reply").is_null()) {
            stage = "parse";
            // server-common.cpp / server-schema.cpp: chat_format, reasoning_format, generation_prompt, chat_parser
            common_chat_parser_params pp(params);
            pp.reasoning_format = inputs.reasoning_format;
            pp.reasoning_in_content = false;  // not streaming
            pp.is_continuation = inputs.continue_final_message != COMMON_CHAT_CONTINUATION_NONE;
            if (!params.parser.empty()) {
                pp.parser.load(params.parser);
            }
            auto msg = common_chat_parse(in.at("reply").get<std::string>(), in.value("partial", false), pp);
            out["message"] = msg_json(msg);
        }
    } catch (const std::exception & e) {
        out["error"] = e.what();
        out["error_stage"] = stage;
    }
    return out;
}

int main() {
    // llama.cpp's LOG() writes to stdout: keep stdout for the answers alone
    int answer_fd = dup(1);
    dup2(2, 1);
    FILE * answers = fdopen(answer_fd, "w");
    common_log_set_verbosity_thold(-1);
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) continue;
        json out;
        try {
            out = handle(json::parse(line));
        } catch (const std::exception & e) {
            out = {{"error", e.what()}, {"error_stage", "request"}};
        }
        std::string s = out.dump(-1, ' ', false, json::error_handler_t::replace);
        fwrite(s.data(), 1, s.size(), answers);
        fputc('\n', answers);
        fflush(answers);
    }
    return 0;
}
