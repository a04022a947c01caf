// llama-server's rendering of a chat request (common_chat_templates_init + common_chat_templates_apply,
// Jinja on, as server-context.cpp and server-common.cpp call them): argv[1] a template file; stdin
// {"messages", "tools"?, "add_generation_prompt"?, "kwargs"?, "bos", "eos", "reasoning": -1|0|1}; stdout the prompt.
#include "chat.h"
#include "common.h"
#include <nlohmann/json.hpp>
#include <fstream>
#include <iostream>
#include <sstream>
using json = nlohmann::ordered_json;
static int run(char ** argv) {
    std::ifstream f(argv[1]);
    std::stringstream ss; ss << f.rdbuf();
    json in = json::parse(std::cin);
    auto tmpls = common_chat_templates_init(nullptr, ss.str(), in.value("bos", ""), in.value("eos", ""));
    common_chat_templates_inputs inputs;
    inputs.use_jinja = true;
    inputs.messages = common_chat_msgs_parse_oaicompat(common_json::parse(in.at("messages").dump()));
    if (in.contains("tools")) {
        inputs.tools = common_chat_tools_parse_oaicompat(common_json::parse(in.at("tools").dump()));
    }
    inputs.add_generation_prompt = in.value("add_generation_prompt", true);
    int reasoning = in.value("reasoning", -1);
    // server-context.cpp: thinking on unless --reasoning off, where the template supports it
    inputs.enable_thinking = reasoning != 0 && common_chat_templates_support_enable_thinking(tmpls.get());
    if (reasoning == 1) inputs.chat_template_kwargs["enable_thinking"] = "true";
    if (reasoning == 0) inputs.chat_template_kwargs["enable_thinking"] = "false";
    if (in.contains("kwargs")) {
        for (auto & [k, v] : in.at("kwargs").items()) inputs.chat_template_kwargs[k] = v.dump();
    }
    // server-common.cpp: the enable_thinking kwarg overrides the default
    auto it = inputs.chat_template_kwargs.find("enable_thinking");
    if (it != inputs.chat_template_kwargs.end()) inputs.enable_thinking = it->second == "true";
    auto params = common_chat_templates_apply(tmpls.get(), inputs);
    std::cout << params.prompt;
    return 0;
}

int main(int, char ** argv) {
    try {
        return run(argv);
    } catch (const std::exception & e) {   // the template (or the request) refused: llama-server answers an error
        std::cerr << e.what() << "\n";
        return 2;
    }
}
