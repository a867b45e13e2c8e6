"""Encodings of the value types messages carry: sampling options, token trees, drafting methods.

Each is also a `Kind` of the declared-field codec (`SAMPLING`, `TREE`, ...): these values have a
shape of their own (flattened arrays, fields that depend on a method's kind), not a flat struct.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shared.values.logprobs import TokenLogprobs
from shared.values.methods import DraftMethod
from shared.values.sampling import (
    MAX_LOGPROBS,
    MAX_STRUCTURED_SPEC_CHARS,
    SamplingParams,
    StructuredOutput,
    TokenHistory,
)
from shared.values.steps import FinishReason
from shared.values.tree import SparseDist, TokenTree
from shared.wire.codec import PayloadReader, pack_floats, pack_ints, pack_matrix_f16
from shared.wire.schema import Value

MAX_TREE_NODES = 1 << 16


def finish_payload(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def read_finish(fields: PayloadReader, name: str) -> FinishReason | None:
    value = fields.optional_text(name, max_len=32)
    if value is None:
        return None
    try:
        return FinishReason(value)
    except ValueError:
        fields.fail(name, f"unknown finish reason {value!r}")


# ---- sampling parameters -------------------------------------------------------------------


def sampling_payload(params: SamplingParams) -> dict[str, Any]:
    return {
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "seed": params.seed,
        "max_tokens": int(params.max_tokens),
        "stop_token_ids": pack_ints(params.stop_token_ids),
        "ignore_eos": bool(params.ignore_eos),
    } | _processor_payload(params)


def _processor_payload(params: SamplingParams) -> dict[str, Any]:
    """The processors and logprobs, each written only when set: a request without them
    encodes byte for byte as before."""
    payload: dict[str, Any] = {}
    for name, neutral in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
        ("min_p", 0.0),
    ):
        if getattr(params, name) != neutral:
            payload[name] = float(getattr(params, name))
    if params.min_tokens:
        payload["min_tokens"] = int(params.min_tokens)
    if params.logit_bias:
        payload["logit_bias_ids"] = pack_ints([t for t, _ in params.logit_bias])
        payload["logit_bias_values"] = pack_floats([b for _, b in params.logit_bias])
    if params.logprobs is not None:
        payload["logprobs"] = int(params.logprobs)
    if params.prompt_logprobs is not None:
        payload["prompt_logprobs"] = int(params.prompt_logprobs)
    if params.structured is not None:
        payload["structured_kind"] = params.structured.kind
        payload["structured_spec"] = params.structured.spec
    return payload


def read_sampling(fields: PayloadReader) -> SamplingParams:
    bias_ids = fields.tokens("logit_bias_ids", ())
    bias_values = fields.float_array("logit_bias_values") if bias_ids else np.zeros(0)
    if len(bias_ids) != len(bias_values):
        fields.fail("logit_bias_values", "one bias per id of logit_bias_ids")
    return fields.build(
        SamplingParams,
        temperature=fields.number("temperature"),
        top_p=fields.number("top_p"),
        top_k=fields.integer("top_k"),
        seed=fields.optional_integer("seed"),
        max_tokens=fields.integer("max_tokens"),
        stop_token_ids=fields.tokens("stop_token_ids"),
        ignore_eos=fields.flag("ignore_eos"),
        presence_penalty=fields.number("presence_penalty", 0.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0),
        repetition_penalty=fields.number("repetition_penalty", 1.0),
        min_p=fields.number("min_p", 0.0),
        min_tokens=fields.integer("min_tokens", 0, minimum=0),
        logit_bias=tuple(zip(bias_ids, bias_values.tolist(), strict=True)),
        logprobs=fields.optional_integer("logprobs"),
        prompt_logprobs=fields.optional_integer("prompt_logprobs"),
        structured=_read_structured(fields),
    )


def _read_structured(fields: PayloadReader) -> StructuredOutput | None:
    kind = fields.optional_text("structured_kind", max_len=32)
    if kind is None:
        return None
    spec = fields.text("structured_spec", "", max_len=MAX_STRUCTURED_SPEC_CHARS)
    return fields.build(StructuredOutput, kind, spec)


# ---- token histories and logprobs --------------------------------------------------------------


def history_payload(history: TokenHistory) -> dict[str, Any]:
    """The tokens of a request whose sampling reads them (penalties, min_tokens)."""
    return {
        "output_len": int(history.output_len),
        "output": pack_ints(history.output),
        "prompt": pack_ints(history.prompt),
        "end_ids": pack_ints(history.end_ids),
    }


def read_optional_history(fields: PayloadReader, name: str = "history") -> TokenHistory | None:
    sub = fields.optional_sub(name)
    if sub is None:
        return None
    return sub.build(
        TokenHistory,
        output_len=sub.integer("output_len", minimum=0),
        output=sub.tokens("output", ()),
        prompt=sub.tokens("prompt", ()),
        end_ids=sub.tokens("end_ids", ()),
    )


def logprobs_payload(logprobs: TokenLogprobs) -> dict[str, Any]:
    """Values as float64 bytes, top lists flattened row by row."""
    width = len(logprobs.top_ids[0]) if len(logprobs) else 0
    return {
        "values": pack_floats(logprobs.logprobs),
        "top_width": width,
        "top_ids": pack_ints([t for row in logprobs.top_ids for t in row]),
        "top_values": pack_floats([v for row in logprobs.top_logprobs for v in row]),
    }


def read_optional_logprobs(fields: PayloadReader, key: str = "logprobs") -> TokenLogprobs | None:
    sub = fields.optional_sub(key)
    if sub is None:
        return None
    values = sub.float_array("values").tolist()
    width = sub.integer("top_width", minimum=0)
    if width > MAX_LOGPROBS:
        sub.fail("top_width", f"at most {MAX_LOGPROBS}")
    ids = sub.int_array("top_ids").tolist()
    top = sub.float_array("top_values").tolist()
    if len(ids) != len(values) * width or len(top) != len(ids):
        sub.fail("top_ids", f"{len(values)} rows of {width} alternatives expected")
    rows = range(0, len(ids), width) if width else [0] * len(values)
    return sub.build(
        TokenLogprobs,
        tuple(values),
        tuple(tuple(ids[r : r + width]) for r in rows),
        tuple(tuple(top[r : r + width]) for r in rows),
    )


# ---- token trees -----------------------------------------------------------------------------


def tree_payload(tree: TokenTree) -> dict[str, Any]:
    """Flat arrays as packed little-endian bytes; proposals flattened (sizes, ids, probs)."""
    return {
        "tokens": pack_ints(tree.tokens),
        "parents": pack_ints(tree.parents),
        "logq": pack_floats(tree.logq),
        "proposal_of": pack_ints(tree.proposal_of),
        "proposal_sizes": pack_ints([len(p.ids) for p in tree.proposals]),
        "proposal_ids": pack_ints(np.concatenate([p.ids for p in tree.proposals] or [[]])),
        "proposal_probs": pack_floats(np.concatenate([p.probs for p in tree.proposals] or [[]])),
    }


def read_tree(fields: PayloadReader) -> TokenTree:
    tokens = fields.int_array("tokens")
    if len(tokens) > MAX_TREE_NODES:
        fields.fail("tokens", f"a tree has at most {MAX_TREE_NODES} nodes")
    if tokens.size and tokens.min() < 0:
        fields.fail("tokens", "token ids must be >= 0")
    sizes = fields.int_array("proposal_sizes")
    ids = fields.int_array("proposal_ids")
    probs = fields.float_array("proposal_probs")
    if np.any(sizes < 0) or int(sizes.sum()) != len(ids) or len(ids) != len(probs):
        fields.fail("proposal_sizes", "proposal sizes do not match the ids and probs")
    bounds = np.cumsum(np.concatenate([[0], sizes]))
    proposals = [
        SparseDist(ids=ids[a:b].copy(), probs=probs[a:b].copy())
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    tree = TokenTree(
        tokens=tokens,
        parents=fields.int_array("parents").astype(np.int32),
        logq=fields.float_array("logq"),
        proposal_of=fields.int_array("proposal_of").astype(np.int32),
        proposals=proposals,
    )
    fields.build(tree.validate)
    return tree


def optional_tree_payload(tree: TokenTree | None) -> dict[str, Any] | None:
    return None if tree is None else tree_payload(tree)


def read_optional_tree(fields: PayloadReader, name: str) -> TokenTree | None:
    sub = fields.optional_sub(name)
    return None if sub is None else read_tree(sub)


# ---- drafting methods ------------------------------------------------------------------------


def method_payload(method: DraftMethod) -> dict[str, Any]:
    """Only the fields of the method's kind travel (and min_path_prob when set)."""
    payload: dict[str, Any] = {"method": method.kind}
    match method.kind:
        case "chain":
            payload["length"] = method.k
        case "static":
            payload["expansion"] = pack_ints(method.expansion)
        case "beam":
            payload.update(depth=method.depth, width=method.width)
        case "dynamic":
            payload.update(
                max_nodes=method.max_size, max_depth=method.max_depth, max_width=method.max_width
            )
    if method.min_path_prob > 0:
        payload["min_path_prob"] = float(method.min_path_prob)
    return payload


def read_method(fields: PayloadReader) -> DraftMethod:
    """A dynamic tree's node limit is per request; the drafter scales its budget to the batch."""
    name = fields.text("method", max_len=32)
    min_path_prob = fields.number("min_path_prob", default=0.0)
    if name == "static":
        expansion = fields.tokens("expansion")
        if len(expansion) > 64:
            fields.fail("expansion", "at most 64 levels")
        return fields.build(
            DraftMethod, "static", expansion=tuple(expansion), min_path_prob=min_path_prob
        )
    if name == "chain":
        return fields.build(
            DraftMethod, "chain", k=fields.integer("length"), min_path_prob=min_path_prob
        )
    if name == "beam":
        return fields.build(
            DraftMethod,
            "beam",
            depth=fields.integer("depth"),
            width=fields.integer("width"),
            min_path_prob=min_path_prob,
        )
    if name == "dynamic":
        nodes = fields.integer("max_nodes")
        return fields.build(
            DraftMethod,
            "dynamic",
            budget=nodes,
            max_size=nodes,
            max_depth=fields.integer("max_depth"),
            max_width=fields.integer("max_width"),
            min_path_prob=min_path_prob,
        )
    fields.fail("method", f"unknown drafting method {name!r}")


# ---- as kinds of the declared-field codec ----------------------------------------------------

FINISH = Value(finish_payload, read_finish)
SAMPLING = Value(sampling_payload, lambda fields, name: read_sampling(fields.sub(name)))
METHOD = Value(method_payload, lambda fields, name: read_method(fields.sub(name)))
TREE = Value(optional_tree_payload, read_optional_tree)
LOGPROBS = Value(logprobs_payload, read_optional_logprobs)  # sparse fields only: never None
HISTORY = Value(history_payload, read_optional_history)  # sparse fields only: never None
FEATURES = Value(pack_matrix_f16, lambda fields, name: fields.optional_f16_matrix(name))
