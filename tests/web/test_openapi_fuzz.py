"""Schemathesis against /openapi.json on a running server: no input, valid or not, gets a 5xx;
what the document forbids is refused with a 4xx; every response matches the document."""
from __future__ import annotations

import pytest
import requests

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,  # noqa: E402
                                         response_schema_conformance, status_code_conformance)

from .conftest import running_server  # noqa: E402

N_CTX = 256


# llama-server's paths without /v1 serve the same views as these: fuzzed once, there
SAME_VIEW = {"/chat/completions": "/v1/chat/completions", "/responses": "/v1/responses", "/completions": "/completion",
             "/embedding": "/embeddings"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a request that sets no limit (Responses, llama-server's n_predict -1) answers a few tokens, not
    # up to the context's end: the fuzz is about what is accepted and how it is answered
    # with a --slot-save-path, so that the slot actions answer (without one they are llama-server's 501)
    tmp = tmp_path_factory.mktemp("fuzz")
    with running_server(tmp, "--n-ctx", str(N_CTX), "--n-slots", "2", "--max-tokens-default", "16",
                        "--slot-save-path", str(tmp / "slots")) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_openapi_document_names_the_endpoints(server):
    doc = requests.get(server.url + "/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics",
            "/tokenize", "/detokenize", "/v1/embeddings", "/v1/responses", "/v1/messages",
            "/api/chat"} <= set(doc["paths"])
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["max_tokens"]["maximum"] == N_CTX


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]


def operations(api_schema):
    for result in api_schema.get_all_operations():
        op = result.ok()
        if op.path not in SAME_VIEW:
            yield op


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_no_server_errors_and_conformant_responses(api_schema, server, mode):
    """Data that fits the document must not crash the server; data that does not must be a 4xx.
    (Schemathesis's own pytest plugin does not load under pytest 9, so its strategies are driven
    with hypothesis directly.)"""
    for op in operations(api_schema):
        if mode == "negative" and not op.body:
            continue  # no body (GET, DELETE), and any string is a well-formed path parameter: nothing to get wrong

        @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
        @settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck),
                  derandomize=True, database=None)
        def run(case):
            response = case.call(timeout=120)
            case.validate_response(response, checks=CHECKS)

        run()
        # and the server keeps serving
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
