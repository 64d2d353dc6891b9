"""The batch endpoints and what each means: the one owner of that knowledge.

Validation, token estimates, prefix fingerprints, the n-choices expansion and the CLI's dry run
all ask this table instead of keeping their own lists of paths.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchEndpoint:
    path: str
    # Where a body's prompt is: "messages" (chat), "prompt" (completions) or "input".
    prompt_key: str
    # Whether the endpoint generates tokens (an output limit, output tokens billed).
    produces_output: bool
    # Whether a body may leave out `model` (the fleet then picks its default).
    model_optional: bool = False
    # Whether `n` choices may be sent as n requests of one choice each (jobs.execution.n_choices).
    expands_n: bool = False


CHAT = BatchEndpoint("/v1/chat/completions", "messages", produces_output=True, expands_n=True)
COMPLETIONS = BatchEndpoint("/v1/completions", "prompt", produces_output=True, expands_n=True)
EMBEDDINGS = BatchEndpoint("/v1/embeddings", "input", produces_output=False)
RESPONSES = BatchEndpoint("/v1/responses", "input", produces_output=True)
MODERATIONS = BatchEndpoint("/v1/moderations", "input", produces_output=False, model_optional=True)

BATCH_ENDPOINTS: dict[str, BatchEndpoint] = {e.path: e for e in (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MODERATIONS)}


def batch_endpoint(path: str) -> BatchEndpoint:
    """What a path means. Batches are created only for BATCH_ENDPOINTS; another path (a line
    checked for a server of another kind) is read like completions: a `prompt`, an output."""
    return BATCH_ENDPOINTS.get(path) or BatchEndpoint(path, "prompt", produces_output=True)
