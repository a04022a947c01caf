// never called by render: common.cpp refers to them for model loading and sampling
#include "common.h"
#include "sampling.h"
#include "speculative.h"
#include "fit.h"
#include <cstdlib>
common_params common_base_params_to_speculative(const common_params &) { std::abort(); }
void common_sampler_free(common_sampler *) { std::abort(); }
llama_sampler * common_sampler_get(const common_sampler *) { std::abort(); }
common_sampler * common_sampler_init(const llama_model *, common_params_sampling &) { std::abort(); }
std::vector<common_sampler_type> common_sampler_types_from_names(const std::vector<std::string> &) { std::abort(); }
common_params_fit_status common_fit_params(const char *, llama_model_params *, llama_context_params *, float *,
        llama_model_tensor_buft_override *, size_t *, uint32_t, const common_fit_extra_model *, ggml_log_level) { std::abort(); }
