"""Configuration: frozen dataclasses built once from flags > APPLIANCE_* env > defaults.

This is the only module that reads the environment (with data_dir.py, its XDG lookup). Every field of `EngineConfig` and
`ServerConfig` is a command-line flag (`--n-slots`) and an environment variable
(`APPLIANCE_N_SLOTS`) by flags.py; the field holds its help text, so `appliance serve --help`
documents every setting by construction.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Mapping

from .chat_templates import BUILTIN, REASONING, REASONING_FORMATS, default_kwargs, load_template
from .adapters import AdapterSettings
from .spec_settings import SpeculationSettings
from .compute_settings import THREAD_WAITS, LlamaCppSettings
from .data_dir import default_data_dir
from .device_settings import DeviceCheckSettings
from .endpoints import parse_endpoints, parse_split
from .flags import ENV_PREFIX, flag, listed, opt, values_of
from .mcp.settings import ToolSettings
from .rope import AUTO_N_CTX, DEFAULT_N_CTX, check_flags


@dataclass(frozen=True)
class EngineConfig(SpeculationSettings, AdapterSettings, DeviceCheckSettings):
    """What the engine process needs to load a model and schedule requests (the LoRA flags: adapters.py;
    speculation's: spec_settings.py)."""

    model: str | None = opt(None, "GGUF file to serve (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    model_alias: str | None = opt(None, "model names, comma-separated: the first is its id, each reaches it (default: the file name without .gguf)")
    tags: str | None = opt(None, "the model's tags, comma-separated, listed by /v1/models (llama-server's; informational)")
    engine: str = opt("auto", "model runner: llamacpp, torch (the own runner) or auto (llama.cpp unless tune --engines chose torch)")
    torch_dtype: str = opt("auto", "torch runner: weight and matmul dtype, auto | bfloat16 | float16 | "
                           "float32 (auto: bfloat16 on a GPU or a CPU with bf16 instructions, else float32)")
    torch_int4: bool = opt(True, "torch runner on a CPU in bfloat16: keep Q4-Q8 and K-quant weights at their stored bits (the "
                           "CPU kernels' int4 matmul with AVX512-BF16; else torch's int4 kernel, Q4/Q8 only; off: dequantize)")
    torch_device: str = opt("auto", "torch runner: device, auto | cpu | cuda | cuda:N")
    torch_kernels: str = opt("auto", "torch runner: auto | triton | off. GGUF block weights (Q4_0, Q4_1, "
                             "Q8_0, MXFP4, NVFP4) kept as stored on the device and multiplied by the "
                             "Triton kernels of kernels/ (auto: on a CUDA device when Triton is installed; "
                             "triton: required, on a CPU only under TRITON_INTERPRET=1; off: dequantized)")
    torch_graphs: str = opt("auto", "torch runner with its kernels: decode steps as CUDA graphs, one per batch "
                            "bucket, auto | eager | off (auto: on a CUDA device for a dense model; eager: the same "
                            "fixed-shape step without capture, a check that runs on a CPU; off: the ordinary forward)")
    torch_cpu_kernels: str = opt("auto", "torch runner on a CPU: auto | cpp | ops. cpp: C++ kernels built once per machine "
                                 "for RMSNorm, RoPE, SwiGLU, the int4 matmul (AVX512-BF16) and the attention of steps and "
                                 "verifies (each row alone, over its own keys); ops: torch ops; auto: cpp when they build (the "
                                 "attention where it fits the model), else ops; a first build does not hold the engine's "
                                 "start: torch ops serve until the engine, next idle, moves to the kernels (cpp waits for it)")
    expert_cache: str = opt("auto", "torch runner, MoE models: SLOTS | auto | off. Routed experts stay in "
                            "host memory and a device cache of SLOTS experts, shared by the layers, holds "
                            "the ones the router uses most (auto: a cache only when the experts do not fit "
                            "on a discrete GPU, sized to what does; off: every expert on the device)")
    expert_compute: str = opt("auto", "torch runner with an expert cache: where an expert the cache lacks is "
                              "computed, auto (the measured cost model: a few rows on the CPU, a long "
                              "prefill chunk copied in) | cpu | device (always copied in: keeps the "
                              "runner exact on a GPU)")
    n_ctx: int = opt(DEFAULT_N_CTX, "context positions per slot (prompt + output; --kv-unified: of the pool); 0 = the model's trained context; "
                     "auto = the longest that fits this host's memory with --n-slots and --kv-type, up to the "
                     "trained context or what --rope-scaling reaches (the default is at most the trained context; "
                     "past it needs --rope-scaling)", words={"auto": AUTO_N_CTX})
    n_slots: int = opt(4, "sequences decoded together; the KV pool is n_slots x n_ctx positions (--kv-unified: n_ctx)")
    rope_scaling: str | None = opt(None, "RoPE scaling, none | linear | yarn (default: the GGUF's, else none); "
                                   "a --n-ctx past the trained context needs one")
    rope_scale: float | None = opt(None, "RoPE context factor N (default: the GGUF's, else --n-ctx / the original context)")
    rope_freq_base: float | None = opt(None, "RoPE base frequency (default: the GGUF's rope.freq_base)")
    rope_freq_scale: float | None = opt(None, "RoPE frequency scaling factor, 1 / --rope-scale (give one of them)")
    yarn_orig_ctx: int | None = opt(None, "YaRN: the original context (default: the GGUF's, else its trained context)")
    yarn_ext_factor: float | None = opt(None, "YaRN: extrapolation mix factor, 0..1 (default: 1 with yarn, else 0)")
    yarn_attn_factor: float | None = opt(None, "YaRN: attention magnitude, only with --yarn-ext-factor 0 (default 1)")
    yarn_beta_fast: float | None = opt(None, "YaRN: low correction dimension (default: 32)")
    yarn_beta_slow: float | None = opt(None, "YaRN: high correction dimension (default: 1)")
    n_threads: int = opt(0, "threads for decode (0 = physical cores)")
    n_threads_batch: int = opt(0, "threads for prefill (0 = same as --n-threads)")
    n_batch: int = opt(512, "most tokens passed to one llama_decode call")
    n_ubatch: int = opt(512, "physical micro-batch size inside llama.cpp")
    prefill_chunk: int = opt(512, "prefill chunk, aligned to absolute positions: a long prompt holds others one chunk at most")
    step_token_budget: int = opt(1024, "most prompt tokens prefilled in one scheduler step, over all slots")
    stream_interval_ms: int = opt(40, "a stream's tokens leave the engine at most this often (its first at once; 0: every step)")
    flash_attn: bool = opt(False, "use llama.cpp's flash attention")
    thread_wait: str = opt("auto", "how the compute threads (OpenMP's) wait at a barrier: spin (libgomp's default: "
                           "fastest alone, 10-100x slower beside another busy process) | passive (sleep at once: a good "
                           "neighbour, ~2.4x slower alone here) | auto (the tuned plan's choice for the model, else spin)")
    n_gpu_layers: str = opt("auto", "llama.cpp: layers on the GPU, N | all | auto (auto: the fit planner "
                            "puts the most that fits there, experts leaving it first; see `appliance fit`)")
    cpu_moe: bool = opt(False, "llama.cpp: keep every routed expert in host memory")
    n_cpu_moe: int | None = opt(None, "llama.cpp: keep the routed experts of the first N layers in host memory")
    override_tensor: str | None = opt(None, "llama.cpp: REGEX=DEVICE[,REGEX=DEVICE...]: tensors whose name "
                                      "matches go to DEVICE (CPU, GPU0, or llama.cpp's CUDA0, Vulkan0...); "
                                      "the first match wins (llama-server's -ot)")
    kv_type: str = opt("f16", "llama.cpp: K and V cache type, f16 | q8_0 | q4_0 (quantised types turn on "
                       "flash attention, which llama.cpp needs for them)")
    kv_unified: bool = opt(False, "llama.cpp: one KV pool of --n-ctx positions that any slot's request may fill (llama-server's "
                           "--kv-unified); bits then depend on the pool's layout (speculation needs --speculate-inexact)")
    main_gpu: int = opt(0, "llama.cpp: the GPU that holds the layers (by index among GPUs)")
    rpc: str | None = opt(None, "llama.cpp: HOST:PORT[,...] of `appliance worker`s whose devices hold layers (several-machines.md)")
    tensor_split: str | None = opt(None, "llama.cpp: the GPUs' shares of the layers, e.g. 3,1, the workers' first (default: by memory)")
    prompt_cache: str = opt("on", "on | off | fast: keep each slot's prompt KV after a request and reuse its longest "
                            "common prefix. on: exactly (to the token where the runner proves at start that any "
                            "chunk computes as the grid's, else in whole --prefill-chunk blocks), so a hit gives the "
                            "cold answer; fast: to the token, replies included, as llama-server does, and responses "
                            "that reused more than exact reuse would say cache_reuse: inexact", switch=True)
    cache_ram_bytes: int = opt(2 * 1024**3, "bytes of saved prompt states kept in RAM when their slot is needed "
                               "for other work (0 = no RAM tier)")
    cache_dir: str | None = opt(None, "directory of the prompt cache's disk tier, which survives restarts "
                                "(default: $XDG_DATA_HOME/appliance/prompt-cache)")
    cache_disk_bytes: int = opt(8 * 1024**3, "bytes of saved prompt states kept on disk (0 = no disk tier)")
    slot_save_path: str | None = opt(None, "directory of llama-server's slot save/restore files (POST /slots/ID; 501 without it)")
    probe_cache: str | None = opt(None, "directory of start-up probe results a restart reads back (default: off)")
    plan: str | None = opt(None, "tuned plan written by `appliance tune` (default: plan.json in the data "
                           "directory, when present); 'off' to use the fixed defaults")
    mmproj: str | None = opt(None, "vision projector GGUF (mmproj) loaded beside the model by llama.cpp's mtmd")
    mmproj_offload: bool = opt(True, "the projector on the GPU when there is one (--no-mmproj-offload: on the CPU)")
    embedding_model: str | None = opt(None, "an embedding GGUF served beside the chat models for /v1/embeddings "
                                      "and Ollama's /api/embed, named by its file name (a request naming no "
                                      "model gets it); 'chat': the chat models answer embeddings themselves, "
                                      "with the mean of their last hidden states (llama.cpp runner)")
    pooling: str | None = opt(None, "the embedding model's pooling, none | mean | cls | last (llama-server's "
                              "--pooling; default: its GGUF's); none answers llama-server's /embeddings with a "
                              "vector per token, and OpenAI's and Ollama's with their mean")
    max_queue: int = opt(64, "requests that may wait for a slot; past this the API answers 503")
    max_tokens_default: int = opt(0, "max_tokens when a request gives none (0 = up to the context limit)")
    max_choices: int = opt(4, "most choices (OpenAI's n) one request may ask for, each from one prefill of the "
                           "prompt in a slot of its own, so never more than --n-slots (more is a 400)")
    seed: int | None = opt(None, "sampling seed for requests that give none, so the same request gets "
                           "the same reply (default: a random seed per request)")
    chat_template: str | None = opt(None, "chat template in place of the model's own: a built-in name ("
                                    + ", ".join(BUILTIN) + ") or a Jinja file; serve's is the default "
                                    "model's (another model's comes from settings.toml)")
    chat_template_kwargs: str | None = opt(None, "JSON object of chat template variables every request gets, "
                                           "e.g. '{\"enable_thinking\": false}'; a request's own "
                                           "chat_template_kwargs win key by key")
    reasoning: str = opt("auto", "thinking, on | off | auto (llama-server's --reasoning): the template's enable_thinking "
                         "for every request (a request's chat_template_kwargs win); auto: the template's default")
    reasoning_format: str = opt("auto", "none | deepseek | auto (llama-server's): reasoning in reasoning_content "
                                "(deepseek, auto) or left in the content with its tags (none); a request's own wins")

    def __post_init__(self) -> None:
        if isinstance(self.prompt_cache, bool):  # EngineConfig(prompt_cache=False), as before it had modes
            object.__setattr__(self, "prompt_cache", "on" if self.prompt_cache else "off")
        _require(self.prompt_cache in ("on", "off", "fast"), "prompt_cache must be on, off or fast")
        _require(self.reasoning in REASONING and self.reasoning_format in REASONING_FORMATS,
                 "reasoning must be on, off or auto; reasoning_format none, deepseek or auto")
        _require(self.pooling in (None, "none", "mean", "cls", "last"), "pooling must be none, mean, cls or last")
        _require(self.engine in ("llamacpp", "torch", "auto"), "engine must be llamacpp, torch or auto")
        _require(self.thread_wait in ("auto", *THREAD_WAITS), f"thread_wait must be auto, {' or '.join(THREAD_WAITS)}")
        _require(self.torch_dtype in ("auto", "bfloat16", "float16", "float32"), "torch_dtype must be auto, bfloat16, float16 or float32")
        _require(self.torch_kernels in ("auto", "triton", "off"), "torch_kernels must be auto, triton or off")
        _require(self.torch_graphs in ("auto", "eager", "off"), "torch_graphs must be auto, eager or off")
        _require(self.torch_cpu_kernels in ("auto", "cpp", "ops"), "torch_cpu_kernels must be auto, cpp or ops")
        from .fit.experts import COMPUTE, parse_setting

        parse_setting(self.expert_cache)  # raises for a value that is no count, auto or off
        _require(self.expert_compute in COMPUTE, "expert_compute must be auto, cpu or device")
        _require(self.engine == "torch" or (self.expert_cache, self.expert_compute) == ("auto", "auto"),
                 "--expert-cache and --expert-compute apply to the torch runner, --engine torch (llama.cpp: "
                 "--n-cpu-moe, --override-tensor)")
        self.check_speculation()
        _require(self.n_slots >= 1 and self.max_choices >= 1, "n_slots and max_choices must be at least 1")
        _require(self.n_ctx >= 0 or self.n_ctx == AUTO_N_CTX, "n_ctx must be 0 (the model's), auto or positive")
        check_flags(self)
        _require(self.n_batch >= 1 and self.n_ubatch >= 1, "n_batch and n_ubatch must be positive")
        _require(1 <= self.prefill_chunk <= self.n_batch, f"prefill_chunk must be between 1 and n_batch ({self.n_batch})")
        _require(self.step_token_budget >= 1, "step_token_budget must be positive")
        _require(self.kv_type in ("f16", "q8_0", "q4_0"), "kv_type must be f16, q8_0 or q4_0")
        _require(self.engine != "torch" or (self.kv_type, self.kv_unified) == ("f16", False),
                 "--kv-type and --kv-unified apply to the llama.cpp runner only")
        _require(not (self.cpu_moe and self.n_cpu_moe is not None), "give --cpu-moe or --n-cpu-moe, not both")
        _require(self.n_cpu_moe is None or self.n_cpu_moe >= 0, "n_cpu_moe must not be negative")
        _require(self.main_gpu >= 0, "main_gpu must not be negative")
        if self.rpc:
            parse_endpoints(self.rpc)        # raises for a bad address
        if self.tensor_split:
            parse_split(self.tensor_split)   # raises for bad shares
        _require(self.n_gpu_layers in ("auto", "all") or self.n_gpu_layers.isdigit(),
                 f"n_gpu_layers must be a number, all or auto, not {self.n_gpu_layers!r}")
        # raise for a malformed --override-tensor, an unknown template name, an unreadable file, bad Jinja, a bad mode
        self.tensor_overrides(), self.template_override(), self.template_kwargs(), self.check_device_check()
        listed(self.model_alias, "--model-alias"), listed(self.tags, "--tags"), self.check_adapters()
        _require(self.max_queue >= 0 and self.max_tokens_default >= 0 and self.n_threads >= 0 and self.n_threads_batch >= 0
                 and self.stream_interval_ms >= 0, "counts must not be negative")

    @property
    def prompt_cache_on(self) -> bool:
        return self.prompt_cache != "off"

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_data_dir() / "prompt-cache"

    def resolved_plan(self) -> tuple[Path | None, bool]:
        """The plan file to read and whether it was named explicitly (None: plans are off)."""
        if self.plan is not None and self.plan.strip().lower() == "off":
            return None, True
        if self.plan:
            return Path(self.plan).expanduser(), True
        return default_data_dir() / "plan.json", False

    def tensor_overrides(self) -> tuple[tuple[str, str], ...]:
        """--override-tensor as (regex, device) pairs, split on commas as llama-server does."""
        from .fit.overrides import parse_overrides

        return parse_overrides((self.override_tensor or "").split(","))

    def template_override(self) -> tuple[str, str] | None:
        """--chat-template as (where it comes from: builtin:NAME or file:PATH, its Jinja source)."""
        return load_template(self.chat_template) if self.chat_template else None

    def template_kwargs(self) -> dict[str, Any]:
        """Every request's template variables: --chat-template-kwargs with --reasoning's enable_thinking."""
        return default_kwargs(self.chat_template_kwargs, self.reasoning)

    def resolved_threads(self) -> tuple[int, int]:
        import psutil
        n = self.n_threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1
        return n, self.n_threads_batch or n

    def llamacpp(self) -> LlamaCppSettings:
        """llama.cpp's settings: threads resolved (0: physical cores), n_ubatch at most n_batch."""
        threads, threads_batch = self.resolved_threads()
        return LlamaCppSettings(n_threads=threads, n_threads_batch=threads_batch, n_batch=self.n_batch,
                                n_ubatch=min(self.n_ubatch, self.n_batch), flash_attn=self.flash_attn)

    def with_llamacpp(self, s: LlamaCppSettings) -> EngineConfig:  # this config with llama.cpp's flags set to s
        return dataclasses.replace(self, **s.as_dict())


@dataclass(frozen=True)
class ServerConfig(ToolSettings):
    """What the HTTP server needs (the MCP tools' flags: mcp/settings.py)."""
    host: str = opt("127.0.0.1", "addresses to bind, comma-separated (127.0.0.1,::1: both loopbacks; "
                    "0.0.0.0 exposes the server to the network)")
    port: int = opt(8080, "port to listen on")
    api_key: str | None = opt(None, "require 'Authorization: Bearer KEY' on every route but the pages and "
                              "/health, which without it tells the status only")
    cors_origins: str = opt("", "comma-separated origins whose pages may use the server besides its own, "
                            "this machine's (localhost, 127.0.0.1, 0.0.0.0, [::1], any port) and apps' "
                            "(app://, file://, ...); '*' any, one '*' a pattern; any other Origin: 403")
    http_threads: int = opt(64, "HTTP worker threads (more than slots + queue, so waiting clients never block /health)")
    slots: bool = opt(True, "answer llama-server's GET /slots, each slot's state (--no-slots: 501, as llama-server's)")
    image_urls: float = opt(0.0, "seconds to fetch an http(s) image URL, at most --max-body-bytes (0: data: URIs only)")
    max_body_bytes: int = opt(8 * 1024 * 1024, "largest request body accepted (413 past it)")
    max_connections: int = opt(1000, "open client connections at most; at the limit, a new one closes the "
                               "connection quiet longest among those with no request running")
    request_timeout: float = opt(60.0, "seconds a client may take to send a whole request, headers and "
                                 "body, from its first byte (408 and closed past it)")
    send_timeout: float = opt(60.0, "seconds a reply may wait for a client that reads none of it; past "
                              "it the connection is closed and its request cancelled, freeing its slot")
    engine_start_timeout: float = opt(300.0, "seconds to wait for the engine to load at start")
    shutdown_grace: float = opt(30.0, "seconds SIGTERM waits for in-flight requests")
    keepalive_s: float = opt(5.0, "seconds between SSE comment lines while a streamed request "
                             "waits for its first token (queued, prefilling, or its model loading); 0 = off")
    library: str | None = opt(None, "the model library's directory, where `appliance pull` puts models "
                              "(default: $XDG_DATA_HOME/appliance/models)")
    models_dir: str = opt("", "comma-separated directories whose GGUF models are served too (without --model)")
    default_model: str | None = opt(None, "the model a request without 'model' gets, loaded at start "
                                    "(default: the embedded model)")
    default_model_fallback: bool = opt(False, "with several models served, a request for a name no model "
                                       "has gets the default model instead of a 404 (with one model served, "
                                       "any name gets it)")
    max_loaded: int = opt(0, "most models loaded at once; a request for another unloads the least "
                          "recently used idle one (0 = as many as fit in memory)")
    idle_unload: float = opt(0.0, "seconds a model stays loaded after its last request when the request "
                             "gave no keep_alive (0 = until it must make room)")
    conversations_db: str | None = opt(None, "SQLite file for the chat page's conversations (default: conversations.db in the data directory)")
    tool_steps: int = opt(8, "tool rounds a chat job may run in one turn; at the limit it ends, saying so, its last calls not run")
    host_report: str | None = opt(None, "show this saved 'appliance hostcheck --json' output on the "
                                  "host page instead of checking this host")
    log_level: str = opt("info", "logging level: debug, info, warning, error")

    def __post_init__(self) -> None:
        _require(bool(self.hosts()), "host must name at least one address")
        _require(0 <= self.port <= 65535, "port must be between 0 and 65535")
        _require(self.http_threads >= 1, "http_threads must be positive")
        _require(self.max_body_bytes >= 1024, "max_body_bytes must be at least 1024")
        _require(self.max_connections >= 16, "max_connections must be at least 16")
        _require(self.request_timeout > 0 and self.send_timeout > 0, "request_timeout and send_timeout must be positive")
        _require(min(self.max_loaded, self.idle_unload, self.tool_steps) >= 0, "max_loaded, idle_unload, tool_steps must not be negative")
        self.check_tools()   # a malformed --mcp, --mcp-auto-approve, timeout or bound
        _require(self.log_level.lower() in ("debug", "info", "warning", "error"),
                 "log_level must be one of debug, info, warning, error")

    def hosts(self) -> tuple[str, ...]:
        """The addresses --host names, without brackets ("[::1]" is "::1")."""
        return tuple(h.strip().strip("[]") for h in self.host.split(",") if h.strip().strip("[]"))

    def loopback_only(self) -> bool:
        """Whether every bound address is a loopback one (then Host headers must be local)."""
        return all(_is_loopback(h) for h in self.hosts())

    def exposure(self) -> str | None:
        """The warning for a server that gives the network everything: an address other than
        loopback bound and no API key. None when it does not."""
        if self.api_key or self.loopback_only():
            return None
        return (f"--host {self.host} is reachable from the network and no --api-key is set: anyone who "
                "can reach this port can use the API and read the stored conversations, the host report, "
                "the benchmark results and /metrics. Set --api-key KEY (or APPLIANCE_API_KEY), or bind "
                "--host 127.0.0.1")

    def resolved_conversations_db(self) -> Path:
        """The configured file, or conversations.db in the appliance's XDG data directory."""
        if self.conversations_db:
            return Path(self.conversations_db).expanduser()
        return default_data_dir() / "conversations.db"


@dataclass(frozen=True)
class StoreConfig:
    """Where bench and sweep keep their results."""

    db_path: str | None = opt(None, "SQLite file for benchmark results (default: $XDG_DATA_HOME/appliance/results.db)")

    def resolved_db_path(self, env: Mapping[str, str] | None = None) -> Path:
        """The configured file, or results.db in the appliance's XDG data directory."""
        if self.db_path:
            return Path(self.db_path).expanduser()
        return default_data_dir(env) / "results.db"


@dataclass(frozen=True)
class Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    given: frozenset[str] = frozenset()      # the fields set by a flag or the environment
    adjusted: tuple[str, ...] = ()           # what fit_engine moved to meet them, for the log at start


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# (a setting, the one it may not exceed, why)
AT_MOST = (("prefill_chunk", "n_batch", "a prompt chunk is one llama_decode"),
           ("n_ubatch", "n_batch", "llama.cpp's micro-batch is a piece of its batch"))


def fit_engine(values: Mapping[str, Any], given: Collection[str]) -> tuple[EngineConfig, tuple[str, ...]]:
    """The EngineConfig of `values` (the rest at their defaults), where a setting the user did not
    give (not in `given`: a default, or a value it followed before) that would contradict one
    given (AT_MOST) follows it instead, and a line for the log saying so for each. Only two given
    settings that contradict each other are a ValueError, naming both flags."""
    fitted = {f.name: f.default for f in dataclasses.fields(EngineConfig)} | dict(values)
    notes = []
    for small, big, why in AT_MOST:
        if fitted[small] <= fitted[big]:
            continue
        if small not in given:
            fitted[small] = fitted[big]
            notes.append(f"{small} follows {flag(big)}: {fitted[big]}")
        elif big not in given:
            fitted[big] = fitted[small]
            notes.append(f"{big} follows {flag(small)}: {fitted[small]}")
        else:
            raise ValueError(f"{flag(small)} {fitted[small]} is larger than {flag(big)} {fitted[big]} ({why}): "
                             f"give a smaller {flag(small)}, a larger {flag(big)}, or only one of them")
    return EngineConfig(**fitted), tuple(notes)


def load(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Build the config: flags win over APPLIANCE_* environment variables, which win over defaults,
    which follow what was given where they would contradict it (`fit_engine`)."""
    flags = flags or {}
    env = os.environ if env is None else env
    given = frozenset(f.name for cls in (EngineConfig, ServerConfig, StoreConfig) for f in dataclasses.fields(cls)
                      if flags.get(f.name) is not None or ENV_PREFIX + f.name.upper() in env)
    engine, adjusted = fit_engine(values_of(EngineConfig, flags, env), given)
    return Config(engine=engine, server=ServerConfig(**values_of(ServerConfig, flags, env)),
                  store=StoreConfig(**values_of(StoreConfig, flags, env)), given=given, adjusted=adjusted)
