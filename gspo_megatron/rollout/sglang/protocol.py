"""SGLang 0.5.23 native HTTP API: request bodies and response parsing, with no I/O.

Facts this module relies on (read from sglang 0.5.23's source, `srt/entrypoints/http_server.py`,
`srt/managers/io_struct.py`, `srt/managers/tokenizer_manager.py`):

- POST /generate takes `input_ids` (one list per sample for a batch), `sampling_params` (one dict
  per sample; SGLang's names: max_new_tokens, temperature, top_p, top_k (-1 = off),
  stop_token_ids, sampling_seed), `return_logprob`, `logprob_start_len=-1` (output tokens only)
  and `return_routed_experts`. A batch answers a JSON list in input order; each item has
  `output_ids` and `meta_info` with `finish_reason` ({"type": "stop" | "length" | "abort", ...}),
  `output_token_logprobs` ([logprob, token_id, text] triples) and, when asked and the server was
  started with --enable-return-routed-experts, `routed_experts`: base64 of int32
  [prompt_len + output_len - 1, num_hidden_layers, top_k]. `meta_info.cached_tokens`: how many
  of the input_ids the radix cache held (tokenizer_manager.py, from the scheduler's
  `cached_tokens`), beside `prompt_tokens`.
- We never use `n` > 1: SGLang expands a batch with n as `input_ids * n` (sample-major order) and
  all n copies share one sampling_seed. One batch entry per sample keeps the order explicit and
  gives every sample its own seed; the radix cache still shares each prompt's prefill.
- `sampling_seed` only takes effect on a server started with --enable-deterministic-inference;
  such a server seeds every unseeded sample with 42, so we always send distinct seeds.
- Errors come back as 400/500 with one of {"error": {"message"}}, {"error": "..."},
  {"message": ...} (ErrorResponse, weight updates: {"success": false, "message"}), or
  {"detail": ...}.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from gspo_megatron.rollout.base import FinishReason, SamplingParams, WeightsNotLoadedError

_SEED_MOD = 2**63


class SGLangError(RuntimeError):
    """Base class: something went wrong talking to an SGLang server (the URL is in the text)."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url


class SGLangConnectionError(SGLangError):
    """The server could not be reached (refused, reset, DNS) after all retries. `request_sent`
    is False when no attempt got as far as a connection (the server cannot have acted on it)."""

    def __init__(self, message: str, url: str | None = None, *, request_sent: bool = True) -> None:
        super().__init__(message, url)
        self.request_sent = request_sent


class SGLangTimeoutError(SGLangError):
    """A request did not answer within its timeout."""


class SGLangHTTPError(SGLangError):
    """The server answered with a non-2xx status; `status` and `reason` hold its answer."""

    def __init__(self, message: str, url: str | None, status: int, reason: str) -> None:
        super().__init__(message, url)
        self.status = status
        self.reason = reason


class SGLangProtocolError(SGLangError):
    """The server answered 2xx but the body is not what SGLang 0.5.23 sends (malformed JSON, a
    missing field, log-prob ids that differ from the output ids, a wrong routed-experts size)."""


class WeightUpdateError(SGLangError, WeightsNotLoadedError):
    """A weight update failed; the message carries the server's reason. The server may hold
    partially updated weights (SGLang says so itself): it is fenced until a full update."""


@dataclass
class GenerateOutput:
    """One parsed /generate result."""

    output_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: str | None
    routed_experts: np.ndarray | None
    cached_tokens: int | None = None  # input tokens the server's prefix cache held (None: unsaid)


def sample_seeds(base_seed: int, count: int) -> list[int]:
    """Distinct per-sample seeds `base_seed + k` (mod 2**63, SGLang's int64 range)."""
    return [(base_seed + k) % _SEED_MOD for k in range(count)]


def sampling_params_dict(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """SGLang's `sampling_params` for one sample (its field names, nothing it would reject)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    if seed is not None:
        out["sampling_seed"] = int(seed)
    return out


def generate_body(
    prompts: Sequence[Sequence[int]],
    seeds: Sequence[int | None],
    params: SamplingParams,
    *,
    return_routed_experts: bool,
    max_new_tokens: Sequence[int] | None = None,
) -> dict[str, Any]:
    """A batched /generate body: one entry per sample (a prompt repeated once per sample).
    `max_new_tokens`: per sample, when they differ (continued partial rollouts); default
    `params.max_new_tokens`."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    budgets = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else max_new_tokens
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(budgets)} max_new_tokens")
    if not prompts:
        raise ValueError("a /generate batch needs at least one prompt")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; SGLang rejects empty input_ids")
    body: dict[str, Any] = {
        "input_ids": [[int(t) for t in p] for p in prompts],
        "sampling_params": [
            sampling_params_dict(replace(params, max_new_tokens=m), s)
            for s, m in zip(seeds, budgets, strict=True)
        ],
        "return_logprob": True,
        "logprob_start_len": -1,
    }
    if return_routed_experts:
        body["return_routed_experts"] = True
    return body


def decode_json(raw: bytes, url: str) -> Any:
    """Parse a response body, naming the URL and showing the start of the body on failure."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        head = raw[:200].decode("utf-8", errors="replace")
        raise SGLangProtocolError(
            f"malformed JSON from {url}: {e}; body starts with {head!r}", url
        ) from e


def error_reason(raw: bytes) -> str:
    """The server's own words from an error body, in any of SGLang's error shapes."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:500] or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return text[:500]


def map_finish_reason(raw: Any, url: str) -> FinishReason:
    """SGLang's finish_reason object -> stop / length / abort."""
    if not isinstance(raw, dict) or raw.get("type") not in ("stop", "length", "abort"):
        raise SGLangProtocolError(
            f"unexpected meta_info.finish_reason {raw!r} from {url} "
            "(expected an object with type stop, length or abort)",
            url,
        )
    return raw["type"]


def decode_routed_experts(
    encoded: Any, num_tokens: int, num_layers: int, top_k: int, url: str
) -> np.ndarray:
    """base64 int32 -> [num_tokens, num_layers, top_k], checking the size."""
    if not isinstance(encoded, str):
        raise SGLangProtocolError(
            f"meta_info.routed_experts from {url} is {type(encoded).__name__}, expected a base64 "
            "string",
            url,
        )
    try:
        buf = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as e:
        raise SGLangProtocolError(f"meta_info.routed_experts from {url} is not base64: {e}") from e
    flat = np.frombuffer(buf, dtype=np.int32)
    expected = num_tokens * num_layers * top_k
    if flat.size != expected:
        raise SGLangProtocolError(
            f"meta_info.routed_experts from {url} holds {flat.size} int32 values, expected "
            f"{num_tokens} tokens x {num_layers} layers x top_k {top_k} = {expected}; check "
            "routed_experts_layers / routed_experts_top_k against the model config",
            url,
        )
    return flat.reshape(num_tokens, num_layers, top_k).copy()


def parse_generate_item(
    item: Any,
    prompt_len: int,
    url: str,
    *,
    routed_experts_shape: tuple[int, int] | None,
) -> GenerateOutput:
    """Parse one /generate result; `routed_experts_shape` = (layers, top_k) when routes were
    asked for, else None."""
    if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
        raise SGLangProtocolError(
            f"/generate result from {url} is not an object with meta_info: {str(item)[:200]}", url
        )
    meta = item["meta_info"]
    output_ids = item.get("output_ids")
    if not isinstance(output_ids, list) or not all(isinstance(t, int) for t in output_ids):
        raise SGLangProtocolError(f"/generate result from {url} has no integer output_ids", url)
    finish = map_finish_reason(meta.get("finish_reason"), url)
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise SGLangProtocolError(
            f"/generate result from {url} has no meta_info.output_token_logprobs "
            "(was return_logprob sent?)",
            url,
        )
    logprobs: list[float] = []
    lp_ids: list[int] = []
    for triple in triples:
        if (
            not isinstance(triple, list)
            or len(triple) < 2
            or not isinstance(triple[0], int | float)
            or not isinstance(triple[1], int)
        ):
            raise SGLangProtocolError(
                f"output_token_logprobs entry {triple!r} from {url} is not [logprob, token_id, "
                "text]",
                url,
            )
        logprobs.append(float(triple[0]))
        lp_ids.append(triple[1])
    if lp_ids != output_ids:
        raise SGLangProtocolError(
            f"output_token_logprobs token ids differ from output_ids in a result from {url}: "
            f"{len(lp_ids)} log-probs for {len(output_ids)} tokens (first ids {lp_ids[:8]} vs "
            f"{output_ids[:8]})",
            url,
        )
    routed = None
    if routed_experts_shape is not None:
        encoded = meta.get("routed_experts")
        if encoded is None:
            if output_ids or finish != "abort":
                raise SGLangProtocolError(
                    f"{url} returned no meta_info.routed_experts; start the server with "
                    "--enable-return-routed-experts",
                    url,
                )
        else:
            layers, top_k = routed_experts_shape
            num_tokens = prompt_len + len(output_ids) - 1
            routed = decode_routed_experts(encoded, num_tokens, layers, top_k, url)
    version = meta.get("weight_version")
    cached = meta.get("cached_tokens")
    if cached is not None and (
        not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached <= prompt_len
    ):
        raise SGLangProtocolError(
            f"meta_info.cached_tokens {cached!r} from {url} is not a count within the "
            f"{prompt_len} input tokens",
            url,
        )
    return GenerateOutput(
        output_ids=list(output_ids),
        logprobs=logprobs,
        finish_reason=finish,
        weight_version=None if version is None else str(version),
        routed_experts=routed,
        cached_tokens=cached,
    )


def parse_generate_response(
    body: Any,
    prompt_lens: Sequence[int],
    url: str,
    *,
    routed_experts_shape: tuple[int, int] | None,
) -> list[GenerateOutput]:
    """Parse a batched /generate answer (a list, one item per sample, in order)."""
    if not isinstance(body, list):
        raise SGLangProtocolError(
            f"/generate from {url} answered {type(body).__name__} for a batch, expected a list",
            url,
        )
    if len(body) != len(prompt_lens):
        raise SGLangProtocolError(
            f"/generate from {url} answered {len(body)} results for {len(prompt_lens)} samples",
            url,
        )
    return [
        parse_generate_item(item, n, url, routed_experts_shape=routed_experts_shape)
        for item, n in zip(body, prompt_lens, strict=True)
    ]
