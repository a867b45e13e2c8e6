"""Wire protocol: golden bytes per schema version, round trips, bounds, add-only evolution."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.tree import SparseDist, TokenTree
from shared.wire import (
    SCHEMA_VERSION,
    Cancel,
    CandidateTrees,
    DraftedTree,
    DraftJob,
    DraftRequest,
    FinishReason,
    Heartbeat,
    MalformedMessageError,
    RequestError,
    Submit,
    Tokens,
    UnknownMessageTypeError,
    VerifiedRequest,
    VerifyJob,
    VerifyRequest,
    VerifyResult,
    WireMessage,
    decode_entry,
    message_types,
)
from shared.wire import streams as names
from shared.wire.codec import (
    MAX_FEATURE_COLS,
    MAX_FEATURE_ROWS,
    MAX_PAYLOAD_BYTES,
    MAX_STR_BYTES,
    pack_matrix_f16,
    pack_payload,
)


def make_tree() -> TokenTree:
    return TokenTree.build(
        [7, 11, 12, 13],
        [-1, 0, 0, 1],
        [0.0, -0.5, -1.25, -0.25],
        [-1, 0, 0, -1],
        [SparseDist(np.array([11, 12, 3]), np.array([0.5, 0.25, 0.25]))],
    )


GREEDY = SamplingParams(max_tokens=8)
SAMPLED = SamplingParams(
    temperature=0.75,
    top_p=0.5,
    top_k=40,
    seed=42,
    max_tokens=64,
    stop_token_ids=(2, 5),
    ignore_eos=True,
)


def canonical_v1() -> dict[str, WireMessage]:
    """One message of every type, as schema version 1 encodes it (frozen: see GOLDEN_V1)."""
    return {
        "submit": Submit(
            "req-1",
            (1, 2, 300),
            SAMPLED,
            "augury:out:gw-1",
            1700000000.5,
            priority=-1,
            tpot_slo_ms=50.0,
            draft_model="tiny",
            speculate=True,
        ),
        "cancel": Cancel("req-1"),
        "tokens": Tokens(
            "req-1", 3, 5, (9, 10), FinishReason.STOP, drafts=1, draft_tokens=4, accepted_tokens=1
        ),
        "error": RequestError("req-1", "invalid_request", "top_p must be in (0, 1]", "top_p"),
        "heartbeat": Heartbeat(
            "drafter", "host-1", "0", 1700000000.0, 1700000001.0, "tiny", capacity=8, in_flight=2
        ),
        "draft_job": DraftJob(
            4,
            (
                DraftRequest("req-1", 3, 10, (9, 10), DraftMethod("chain", k=4), GREEDY, 42),
                DraftRequest(
                    "req-2", 0, 0, (1, 2), DraftMethod("static", expansion=(2, 1)), SAMPLED, 7
                ),
            ),
            release=("req-0",),
        ),
        "candidate_trees": CandidateTrees(
            4,
            "tiny",
            "host-1",
            1.5,
            (
                DraftedTree("req-1", 3, make_tree()),
                DraftedTree("req-2", 0, None, "out_of_sync"),
            ),
        ),
        "verify_job": VerifyJob(
            5,
            (
                VerifyRequest("req-1", 3, SAMPLED, 42, 54, tree=make_tree()),
                VerifyRequest("req-2", 0, GREEDY, 7, 8, chunk=(1, 2), chunk_is_last=True),
            ),
            release=("req-0",),
        ),
        "verify_result": VerifyResult(
            5,
            2.5,
            (
                VerifiedRequest("req-1", 3, (11, 13), 4, None),
                VerifiedRequest("req-2", 0, (), 9, FinishReason.LENGTH),
            ),
        ),
    }


# Payload bytes (`b`) of canonical_v1(), as schema version 1 wrote them. Never edit these: a
# later version adds GOLDEN_V2 beside them, and v1 bytes must keep decoding.
GOLDEN_V1: dict[str, str] = {
    "submit": (
        "89aa726571756573745f6964a57265712d31a670726f6d7074c40c01000000020000002c010000a873616d70"
        "6c696e6787ab74656d7065726174757265cb3fe8000000000000a5746f705f70cb3fe0000000000000a5746f"
        "705f6b28a4736565642aaa6d61785f746f6b656e7340ae73746f705f746f6b656e5f696473c4080200000005"
        "000000aa69676e6f72655f656f73c3a87265706c795f746faf6175677572793a6f75743a67772d31ac617272"
        "6976616c5f74696d65cb41d954fc40200000a87072696f72697479ffab74706f745f736c6f5f6d73cb404900"
        "0000000000ab64726166745f6d6f64656ca474696e79a973706563756c617465c3"
    ),
    "cancel": (
        "82aa726571756573745f6964a57265712d31a6726561736f6eb3636c69656e745f646973636f6e6e6563746564"
    ),
    "tokens": (
        "88aa726571756573745f6964a57265712d31a47374657003a66f666673657405a9746f6b656e5f696473c408"
        "090000000a000000a666696e697368a473746f70a664726166747301ac64726166745f746f6b656e7304af61"
        "636365707465645f746f6b656e7301"
    ),
    "error": (
        "84aa726571756573745f6964a57265712d31a4636f6465af696e76616c69645f72657175657374a76d657373"
        "616765b7746f705f70206d75737420626520696e2028302c20315da5706172616da5746f705f70"
    ),
    "heartbeat": (
        "88a773657276696365a764726166746572a77265706c696361a6686f73742d31a463656c6ca130aa73746172"
        "7465645f6174cb41d954fc40000000a773656e745f6174cb41d954fc40400000a56d6f64656ca474696e79a8"
        "636170616369747908a9696e5f666c6967687402"
    ),
    "draft_job": (
        "83ae6d6963726f5f62617463685f696404a7656e74726965739287aa726571756573745f6964a57265712d31"
        "a47374657003a8626173655f6c656e0aaa6e65775f746f6b656e73c408090000000a000000a66d6574686f64"
        "82a66d6574686f64a5636861696ea66c656e67746804a873616d706c696e6787ab74656d7065726174757265"
        "cb0000000000000000a5746f705f70cb3ff0000000000000a5746f705f6b00a473656564c0aa6d61785f746f"
        "6b656e7308ae73746f705f746f6b656e5f696473c400aa69676e6f72655f656f73c2a4736565642a87aa7265"
        "71756573745f6964a57265712d32a47374657000a8626173655f6c656e00aa6e65775f746f6b656e73c40801"
        "00000002000000a66d6574686f6482a66d6574686f64a6737461746963a9657870616e73696f6ec408020000"
        "0001000000a873616d706c696e6787ab74656d7065726174757265cb3fe8000000000000a5746f705f70cb3f"
        "e0000000000000a5746f705f6b28a4736565642aaa6d61785f746f6b656e7340ae73746f705f746f6b656e5f"
        "696473c4080200000005000000aa69676e6f72655f656f73c3a47365656407a772656c6561736591a5726571"
        "2d30"
    ),
    "candidate_trees": (
        "85ae6d6963726f5f62617463685f696404a56d6f64656ca474696e79a77265706c696361a6686f73742d31a8"
        "64726166745f6d73cb3ff8000000000000a7656e74726965739284aa726571756573745f6964a57265712d31"
        "a47374657003a47472656587a6746f6b656e73c410070000000b0000000c0000000d000000a7706172656e74"
        "73c410ffffffff000000000000000001000000a46c6f6771c4200000000000000000000000000000e0bf0000"
        "00000000f4bf000000000000d0bfab70726f706f73616c5f6f66c410ffffffff0000000000000000ffffffff"
        "ae70726f706f73616c5f73697a6573c40403000000ac70726f706f73616c5f696473c40c0b0000000c000000"
        "03000000ae70726f706f73616c5f70726f6273c418000000000000e03f000000000000d03f000000000000d0"
        "3fa56572726f72c084aa726571756573745f6964a57265712d32a47374657000a474726565c0a56572726f72"
        "ab6f75745f6f665f73796e63"
    ),
    "verify_job": (
        "83ae6d6963726f5f62617463685f696405a7656e74726965739289aa726571756573745f6964a57265712d31"
        "a47374657003a873616d706c696e6787ab74656d7065726174757265cb3fe8000000000000a5746f705f70cb"
        "3fe0000000000000a5746f705f6b28a4736565642aaa6d61785f746f6b656e7340ae73746f705f746f6b656e"
        "5f696473c4080200000005000000aa69676e6f72655f656f73c3a4736565642aae6d61785f6e65775f746f6b"
        "656e7336a56368756e6bc400ab6368756e6b5f737461727400ad6368756e6b5f69735f6c617374c2a4747265"
        "6587a6746f6b656e73c410070000000b0000000c0000000d000000a7706172656e7473c410ffffffff000000"
        "000000000001000000a46c6f6771c4200000000000000000000000000000e0bf000000000000f4bf00000000"
        "0000d0bfab70726f706f73616c5f6f66c410ffffffff0000000000000000ffffffffae70726f706f73616c5f"
        "73697a6573c40403000000ac70726f706f73616c5f696473c40c0b0000000c00000003000000ae70726f706f"
        "73616c5f70726f6273c418000000000000e03f000000000000d03f000000000000d03f89aa72657175657374"
        "5f6964a57265712d32a47374657000a873616d706c696e6787ab74656d7065726174757265cb000000000000"
        "0000a5746f705f70cb3ff0000000000000a5746f705f6b00a473656564c0aa6d61785f746f6b656e7308ae73"
        "746f705f746f6b656e5f696473c400aa69676e6f72655f656f73c2a47365656407ae6d61785f6e65775f746f"
        "6b656e7308a56368756e6bc4080100000002000000ab6368756e6b5f737461727400ad6368756e6b5f69735f"
        "6c617374c3a474726565c0a772656c6561736591a57265712d30"
    ),
    "verify_result": (
        "83ae6d6963726f5f62617463685f696405a97665726966795f6d73cb4004000000000000a7656e7472696573"
        "9286aa726571756573745f6964a57265712d31a47374657003a86163636570746564c4080b0000000d000000"
        "a5626f6e757304a666696e697368c0a56572726f72c086aa726571756573745f6964a57265712d32a4737465"
        "7000a86163636570746564c400a5626f6e757309a666696e697368a66c656e677468a56572726f72c0"
    ),
}


# Hidden-state features of two positions, H = 4 (float16; exact in binary).
FEATURES = np.array([[0.5, -1.0, 2.0, 0.0], [1.5, -0.25, 3.0, 0.125]], dtype=np.float16)


def added_in_v1() -> dict[str, WireMessage]:
    """Messages using the optional fields added within version 1 (written only when set, so
    canonical_v1() still encodes as GOLDEN_V1): Submit.slo_class; Tokens.draft_model and the
    SLO statistics of a request's last Tokens; the target's hidden-state features of
    DraftRequest.features and VerifiedRequest.features."""
    return {
        "draft_job": DraftJob(
            4,
            (
                DraftRequest(
                    "req-1",
                    3,
                    10,
                    (9, 10),
                    DraftMethod("chain", k=4),
                    GREEDY,
                    42,
                    features=FEATURES,
                ),
            ),
        ),
        "verify_result": VerifyResult(
            5, 2.5, (VerifiedRequest("req-1", 3, (11,), 4, None, features=FEATURES),)
        ),
        "submit": Submit(
            "req-1", (1, 2, 300), GREEDY, "augury:out:gw-1", 1700000000.5, slo_class="standard"
        ),
        "tokens": Tokens(
            "req-1",
            3,
            5,
            (9, 10),
            FinishReason.STOP,
            drafts=1,
            draft_tokens=4,
            accepted_tokens=1,
            draft_model="tiny",
            slo_class="standard",
            tpot_slo_ms=120.0,
            tpot_ms=87.5,
        ),
    }


# Payload bytes of added_in_v1(): frozen like GOLDEN_V1.
GOLDEN_V1_ADDED: dict[str, str] = {
    "draft_job": (
        "83ae6d6963726f5f62617463685f696404a7656e74726965739188aa726571756573745f6964a57265712d31"
        "a47374657003a8626173655f6c656e0aaa6e65775f746f6b656e73c408090000000a000000a66d6574686f64"
        "82a66d6574686f64a5636861696ea66c656e67746804a873616d706c696e6787ab74656d7065726174757265"
        "cb0000000000000000a5746f705f70cb3ff0000000000000a5746f705f6b00a473656564c0aa6d61785f746f"
        "6b656e7308ae73746f705f746f6b656e5f696473c400aa69676e6f72655f656f73c2a4736565642aa8666561"
        "747572657383a4726f777302a4636f6c7304a464617461c410003800bc00400000003e00b400420030a77265"
        "6c6561736590"
    ),
    "verify_result": (
        "83ae6d6963726f5f62617463685f696405a97665726966795f6d73cb4004000000000000a7656e7472696573"
        "9187aa726571756573745f6964a57265712d31a47374657003a86163636570746564c4040b000000a5626f6e"
        "757304a666696e697368c0a56572726f72c0a8666561747572657383a4726f777302a4636f6c7304a4646174"
        "61c410003800bc00400000003e00b400420030"
    ),
    "submit": (
        "8aaa726571756573745f6964a57265712d31a670726f6d7074c40c01000000020000002c010000a873616d70"
        "6c696e6787ab74656d7065726174757265cb0000000000000000a5746f705f70cb3ff0000000000000a5746f"
        "705f6b00a473656564c0aa6d61785f746f6b656e7308ae73746f705f746f6b656e5f696473c400aa69676e6f"
        "72655f656f73c2a87265706c795f746faf6175677572793a6f75743a67772d31ac6172726976616c5f74696d"
        "65cb41d954fc40200000a87072696f7269747900ab74706f745f736c6f5f6d73c0ab64726166745f6d6f6465"
        "6cc0a973706563756c617465c3a9736c6f5f636c617373a87374616e64617264"
    ),
    "tokens": (
        "8caa726571756573745f6964a57265712d31a47374657003a66f666673657405a9746f6b656e5f696473c408"
        "090000000a000000a666696e697368a473746f70a664726166747301ac64726166745f746f6b656e7304af61"
        "636365707465645f746f6b656e7301ab64726166745f6d6f64656ca474696e79a9736c6f5f636c617373a873"
        "74616e64617264ab74706f745f736c6f5f6d73cb405e000000000000a774706f745f6d73cb4055e000000000"
        "00"
    ),
}


def entry_of(type_name: str, payload: bytes, version: bytes = b"1") -> dict[bytes, bytes]:
    """Fields as redis-py returns them (bytes keys)."""
    return {b"v": version, b"t": type_name.encode(), b"b": payload}


def assert_same_tree(a: TokenTree | None, b: TokenTree | None) -> None:
    assert (a is None) == (b is None)
    if a is None or b is None:
        return
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.parents, b.parents)
    np.testing.assert_array_equal(a.logq, b.logq)
    np.testing.assert_array_equal(a.proposal_of, b.proposal_of)
    assert len(a.proposals) == len(b.proposals)
    for pa, pb in zip(a.proposals, b.proposals, strict=True):
        np.testing.assert_array_equal(pa.ids, pb.ids)
        np.testing.assert_array_equal(pa.probs, pb.probs)
    assert a.tokens.dtype == np.int64 and a.parents.dtype == np.int32
    assert a.logq.dtype == np.float64 and a.proposal_of.dtype == np.int32


# ---- golden bytes ------------------------------------------------------------------------------


def test_every_message_type_has_a_golden_v1_entry() -> None:
    assert SCHEMA_VERSION == 1
    assert set(GOLDEN_V1) == set(message_types()) == set(canonical_v1())


@pytest.mark.parametrize("type_name", sorted(GOLDEN_V1))
def test_v1_encoding_matches_golden_bytes(type_name: str) -> None:
    entry = canonical_v1()[type_name].to_entry()
    assert entry == {"v": b"1", "t": type_name.encode(), "b": bytes.fromhex(GOLDEN_V1[type_name])}


@pytest.mark.parametrize("type_name", sorted(GOLDEN_V1))
def test_golden_v1_bytes_decode_to_the_canonical_message(type_name: str) -> None:
    decoded = decode_entry(entry_of(type_name, bytes.fromhex(GOLDEN_V1[type_name])))
    expected = canonical_v1()[type_name]
    assert type(decoded) is type(expected)
    assert decoded.to_entry() == expected.to_entry()


def test_golden_decode_restores_values_not_just_bytes() -> None:
    submit = decode_entry(entry_of("submit", bytes.fromhex(GOLDEN_V1["submit"])))
    assert submit == canonical_v1()["submit"]
    assert isinstance(submit, Submit) and submit.sampling.stop_token_ids == (2, 5)
    job = decode_entry(entry_of("verify_job", bytes.fromhex(GOLDEN_V1["verify_job"])))
    assert isinstance(job, VerifyJob)
    assert_same_tree(job.entries[0].tree, make_tree())
    assert job.entries[1].chunk == (1, 2) and job.entries[1].tree is None
    result = decode_entry(entry_of("verify_result", bytes.fromhex(GOLDEN_V1["verify_result"])))
    assert isinstance(result, VerifyResult)
    assert result.entries[0].new_tokens == (11, 13, 4)
    assert result.entries[1].finish is FinishReason.LENGTH


@pytest.mark.parametrize("type_name", sorted(GOLDEN_V1_ADDED))
def test_added_fields_match_golden_bytes_and_decode_back(type_name: str) -> None:
    message = added_in_v1()[type_name]
    golden = bytes.fromhex(GOLDEN_V1_ADDED[type_name])
    assert message.to_entry() == {"v": b"1", "t": type_name.encode(), "b": golden}
    assert decode_entry(entry_of(type_name, golden)) == message


# A VerifyJob whose tree entry carries VerifyRequest.context_len (added within version 1).
GOLDEN_V1_CONTEXT_LEN = (
    "83ae6d6963726f5f62617463685f696405a7656e7472696573918aaa726571756573745f6964a57265712d31a4"
    "7374657003a873616d706c696e6787ab74656d7065726174757265cb0000000000000000a5746f705f70cb3ff0"
    "000000000000a5746f705f6b00a473656564c0aa6d61785f746f6b656e7308ae73746f705f746f6b656e5f6964"
    "73c400aa69676e6f72655f656f73c2a47365656401ae6d61785f6e65775f746f6b656e7308a56368756e6bc400"
    "ab6368756e6b5f737461727400ad6368756e6b5f69735f6c617374c2a47472656587a6746f6b656e73c4040400"
    "0000a7706172656e7473c404ffffffffa46c6f6771c4080000000000000000ab70726f706f73616c5f6f66c404"
    "ffffffffae70726f706f73616c5f73697a6573c400ac70726f706f73616c5f696473c400ae70726f706f73616c"
    "5f70726f6273c400ab636f6e746578745f6c656e11a772656c6561736590"
)


def test_a_trees_context_len_matches_golden_bytes_and_decodes_back() -> None:
    entry = VerifyRequest("req-1", 3, GREEDY, 1, 8, tree=TokenTree.root_only(4), context_len=17)
    golden = bytes.fromhex(GOLDEN_V1_CONTEXT_LEN)
    assert VerifyJob(5, (entry,)).to_entry()["b"] == golden
    job = decode_entry(entry_of("verify_job", golden))
    assert isinstance(job, VerifyJob) and job.entries[0].context_len == 17
    # written only when set: the canonical job (no context_len) still encodes as GOLDEN_V1
    assert (
        "context_len"
        not in msgpack.unpackb(canonical_v1()["verify_job"].to_entry()["b"])["entries"][0]
    )
    with pytest.raises(ValueError):  # a chunk has no root
        VerifyRequest("req-1", 3, GREEDY, 1, 8, chunk=(1, 2), context_len=2)


# A VerifyJob whose tree and chunk entries both carry VerifyRequest.want_features (added within
# version 1).
GOLDEN_V1_WANT_FEATURES = (
    "83ae6d6963726f5f62617463685f696405a7656e7472696573928baa726571756573745f6964a57265712d31a4"
    "7374657003a873616d706c696e6787ab74656d7065726174757265cb0000000000000000a5746f705f70cb3ff0"
    "000000000000a5746f705f6b00a473656564c0aa6d61785f746f6b656e7308ae73746f705f746f6b656e5f6964"
    "73c400aa69676e6f72655f656f73c2a47365656401ae6d61785f6e65775f746f6b656e7308a56368756e6bc400"
    "ab6368756e6b5f737461727400ad6368756e6b5f69735f6c617374c2a47472656587a6746f6b656e73c4040400"
    "0000a7706172656e7473c404ffffffffa46c6f6771c4080000000000000000ab70726f706f73616c5f6f66c404"
    "ffffffffae70726f706f73616c5f73697a6573c400ac70726f706f73616c5f696473c400ae70726f706f73616c"
    "5f70726f6273c400ab636f6e746578745f6c656e11ad77616e745f6665617475726573c38aaa72657175657374"
    "5f6964a57265712d32a47374657000a873616d706c696e6787ab74656d7065726174757265cb00000000000000"
    "00a5746f705f70cb3ff0000000000000a5746f705f6b00a473656564c0aa6d61785f746f6b656e7308ae73746f"
    "705f746f6b656e5f696473c400aa69676e6f72655f656f73c2a47365656407ae6d61785f6e65775f746f6b656e"
    "7308a56368756e6bc4080100000002000000ab6368756e6b5f737461727400ad6368756e6b5f69735f6c617374"
    "c2a474726565c0ad77616e745f6665617475726573c3a772656c6561736590"
)


def want_features_job() -> VerifyJob:
    tree = VerifyRequest(
        "req-1", 3, GREEDY, 1, 8, tree=TokenTree.root_only(4), context_len=17, want_features=True
    )
    chunk = VerifyRequest("req-2", 0, GREEDY, 7, 8, chunk=(1, 2), want_features=True)
    return VerifyJob(5, (tree, chunk))


def test_want_features_matches_golden_bytes_and_decodes_back() -> None:
    golden = bytes.fromhex(GOLDEN_V1_WANT_FEATURES)
    assert want_features_job().to_entry()["b"] == golden
    job = decode_entry(entry_of("verify_job", golden))
    assert isinstance(job, VerifyJob)
    assert [e.want_features for e in job.entries] == [True, True]
    assert job.entries[0].context_len == 17 and job.entries[1].chunk == (1, 2)


def test_golden_v1_bytes_decode_without_features() -> None:
    job = decode_entry(entry_of("verify_job", bytes.fromhex(GOLDEN_V1["verify_job"])))
    assert isinstance(job, VerifyJob)
    assert [e.want_features for e in job.entries] == [False, False]
    result = decode_entry(entry_of("verify_result", bytes.fromhex(GOLDEN_V1["verify_result"])))
    assert isinstance(result, VerifyResult)
    assert [e.features for e in result.entries] == [None, None]
    drafts = decode_entry(entry_of("draft_job", bytes.fromhex(GOLDEN_V1["draft_job"])))
    assert isinstance(drafts, DraftJob)
    assert [e.features for e in drafts.entries] == [None, None]


def test_unset_added_fields_are_not_written() -> None:
    plain = Tokens("req-1", 3, 5, (9, 10), FinishReason.STOP)
    assert set(msgpack.unpackb(plain.to_entry()["b"])) == {
        "request_id", "step", "offset", "token_ids", "finish", "drafts", "draft_tokens",
        "accepted_tokens",
    }  # fmt: skip
    assert "slo_class" not in msgpack.unpackb(canonical_v1()["submit"].to_entry()["b"])
    for type_name, name in [
        ("draft_job", "features"),
        ("verify_job", "want_features"),
        ("verify_result", "features"),
    ]:
        entries = msgpack.unpackb(canonical_v1()[type_name].to_entry()["b"])["entries"]
        assert all(name not in e for e in entries), type_name


# ---- round trips -------------------------------------------------------------------------------

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=64).map(tuple)
nonempty_ids = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=64).map(tuple)
request_ids = st.text(min_size=1, max_size=128)
sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(0, 1000),
    seed=st.none() | st.integers(0, 2**63 - 1),
    max_tokens=st.integers(1, 1 << 20),
    stop_token_ids=token_ids,
    ignore_eos=st.booleans(),
)


@st.composite
def token_trees(draw: st.DrawFn) -> TokenTree:
    n = draw(st.integers(1, 24))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    num_proposals = draw(st.integers(0, 3))
    proposals = []
    for _ in range(num_proposals):
        ids = draw(st.lists(st.integers(0, 50_000), min_size=1, max_size=5, unique=True))
        probs = np.asarray(
            draw(st.lists(st.floats(0.01, 1.0), min_size=len(ids), max_size=len(ids)))
        )
        proposals.append(SparseDist(np.asarray(ids), probs / probs.sum()))
    proposal_of = [-1] + [
        draw(st.integers(-1, num_proposals - 1)) if num_proposals else -1 for _ in range(1, n)
    ]
    return TokenTree.build(
        draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        parents,
        [0.0] + draw(st.lists(st.floats(-30.0, 0.0), min_size=n - 1, max_size=n - 1)),
        proposal_of,
        proposals,
    )


def round_trip(message: WireMessage) -> WireMessage:
    entry = message.to_entry()
    decoded = type(message).from_entry({k.encode(): v for k, v in entry.items()})
    assert decoded.to_entry() == entry  # re-encoding is byte-identical
    return decoded


@settings(max_examples=60, deadline=None)
@given(
    request_id=request_ids,
    prompt=nonempty_ids,
    sampling=sampling_params,
    priority=st.integers(-(2**31), 2**31),
    slo=st.none() | st.floats(0.5, 1e4),
    draft=st.none() | st.text(max_size=64),
    speculate=st.booleans(),
    slo_class=st.none() | st.text(min_size=1, max_size=64),
)
def test_submit_round_trips(
    request_id: str,
    prompt: tuple[int, ...],
    sampling: SamplingParams,
    priority: int,
    slo: float | None,
    draft: str | None,
    speculate: bool,
    slo_class: str | None,
) -> None:
    submit = Submit(
        request_id,
        prompt,
        sampling,
        "augury:out:g",
        1.7e9,
        priority,
        slo,
        draft,
        speculate,
        slo_class,
    )
    assert round_trip(submit) == submit


@settings(max_examples=60, deadline=None)
@given(tree=token_trees())
def test_token_trees_round_trip_exactly(tree: TokenTree) -> None:
    job = VerifyJob(1, (VerifyRequest("r", 2, GREEDY, 3, 4, tree=tree),))
    decoded = round_trip(job)
    assert isinstance(decoded, VerifyJob)
    assert_same_tree(decoded.entries[0].tree, tree)
    candidates = round_trip(CandidateTrees(1, "m", "x", 0.5, (DraftedTree("r", 2, tree),)))
    assert isinstance(candidates, CandidateTrees)
    assert_same_tree(candidates.entries[0].tree, tree)


@pytest.mark.parametrize(
    "method",
    [
        DraftMethod("chain", k=6),
        DraftMethod("static", expansion=(3, 2, 2, 1)),
        DraftMethod("beam", depth=5, width=3),
        DraftMethod("dynamic", budget=64, max_size=64, max_depth=8, max_width=4),
        DraftMethod("chain", k=3, min_path_prob=0.25),
    ],
)
def test_every_drafting_method_round_trips(method: DraftMethod) -> None:
    job = DraftJob(9, (DraftRequest("r", 1, 5, (4,), method, SAMPLED, 11),))
    decoded = round_trip(job)
    assert decoded == job


@settings(max_examples=40, deadline=None)
@given(
    tokens=token_ids,
    finish=st.none() | st.sampled_from(FinishReason),
    stats=st.tuples(st.integers(0, 1), st.integers(0, 64), st.integers(0, 64)),
)
def test_tokens_and_results_round_trip(
    tokens: tuple[int, ...], finish: FinishReason | None, stats: tuple[int, int, int]
) -> None:
    out = Tokens("r", 7, 12, tokens, finish, *stats)
    assert round_trip(out) == out
    named = Tokens("r", 7, 12, tokens, finish, *stats, draft_model="draft-s")
    assert round_trip(named) == named
    last = Tokens(
        "r", 7, 12, tokens, finish, *stats, slo_class="urgent", tpot_slo_ms=12.5, tpot_ms=0.0
    )
    assert round_trip(last) == last
    measured_only = Tokens("r", 7, 12, tokens, finish, *stats, tpot_ms=30.25)
    assert round_trip(measured_only) == measured_only
    result = VerifyResult(3, 1.25, (VerifiedRequest("r", 7, tokens, 5, finish, None),))
    assert round_trip(result) == result


@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (3, 16), (5, 64)])
def test_features_round_trip_exactly(shape: tuple[int, int]) -> None:
    rows = shape[0]
    features = np.random.default_rng(rows * shape[1]).standard_normal(shape).astype(np.float16)
    if features.size:
        features.flat[0] = np.inf  # non-finite values travel as they are
        features.flat[-1] = np.nan
    verified = VerifiedRequest("r", 7, (5,) * max(rows - 1, 0), features=features)
    draft = DraftRequest(
        "r", 7, 9, (4,) * rows, DraftMethod("chain", k=2), GREEDY, 1, features=features
    )
    result = round_trip(VerifyResult(3, 1.25, (verified,)))
    drafts = round_trip(DraftJob(2, (draft,)))
    assert result == VerifyResult(3, 1.25, (verified,)) and drafts == DraftJob(2, (draft,))
    assert isinstance(result, VerifyResult) and isinstance(drafts, DraftJob)
    for decoded in (result.entries[0].features, drafts.entries[0].features):
        assert decoded is not None and decoded.dtype == np.float16 and decoded.shape == shape
        assert decoded.flags.writeable and decoded.flags.c_contiguous
        np.testing.assert_array_equal(decoded, features)  # NaN equals NaN here
        assert decoded.tobytes() == features.tobytes()


def test_features_compare_by_value() -> None:
    def entry(features: np.ndarray | None) -> VerifiedRequest:
        return VerifiedRequest("r", 1, (3,), 4, features=features)

    assert entry(FEATURES) == entry(FEATURES.copy())
    assert entry(FEATURES) != entry(FEATURES + np.float16(1))
    assert entry(FEATURES) != entry(None) and entry(None) == entry(None)
    assert hash(entry(FEATURES)) == hash(entry(FEATURES.copy()))


def test_oversized_features_are_refused_by_the_writer() -> None:
    with pytest.raises(ValueError, match="at most"):
        pack_matrix_f16(np.zeros((MAX_FEATURE_ROWS + 1, 1), np.float16))
    with pytest.raises(ValueError, match="2-D"):
        pack_matrix_f16(np.zeros(4, np.float16))


def test_entry_fields_may_be_str_keys_and_values() -> None:
    entry = Cancel("r").to_entry()
    as_str = {"v": "1", "t": "cancel", "b": entry["b"]}
    assert decode_entry(as_str) == Cancel("r")


# ---- rejection ---------------------------------------------------------------------------------


class _Boom:
    fired = False

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_Boom.fire, ())

    @staticmethod
    def fire() -> None:
        _Boom.fired = True


def test_pickle_payloads_are_rejected_and_never_run() -> None:
    for payload in (pickle.dumps(_Boom()), pickle.dumps({"request_id": "r"}, protocol=2)):
        with pytest.raises(MalformedMessageError):
            decode_entry(entry_of("cancel", payload))
    assert not _Boom.fired


def test_unknown_type_raises_its_own_error() -> None:
    with pytest.raises(UnknownMessageTypeError, match="frobnicate"):
        decode_entry(entry_of("frobnicate", pack_payload({})))


@pytest.mark.parametrize(
    "fields",
    [
        {b"t": b"cancel", b"b": b"\x80"},  # no version
        {b"v": b"1", b"b": b"\x80"},  # no type
        {b"v": b"1", b"t": b"cancel"},  # no payload
        {b"v": b"0", b"t": b"cancel", b"b": b"\x80"},
        {b"v": b"-1", b"t": b"cancel", b"b": b"\x80"},
        {b"v": b"one", b"t": b"cancel", b"b": b"\x80"},
        {b"v": b"1", b"t": b"\xff\xfe", b"b": b"\x80"},
    ],
)
def test_bad_envelopes_are_malformed(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(MalformedMessageError):
        decode_entry(fields)


def cancel_payload(**fields: object) -> bytes:
    return msgpack.packb({"request_id": "r", **fields}, use_bin_type=True)


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        (b"", "undecodable"),
        (cancel_payload()[:-1], "undecodable"),  # truncated
        (cancel_payload() + b"\x00", "undecodable"),  # trailing data
        (msgpack.packb([1, 2]), "not a map"),
        (msgpack.packb({"request_id": 5}), "request_id: expected str"),
        (msgpack.packb({"reason": "x"}), "request_id: missing"),
        (msgpack.packb({"request_id": b"raw"}, use_bin_type=True), "expected str"),
        (msgpack.packb({"request_id": "r", "reason": msgpack.ExtType(5, b"x")}), "ext type"),
        (msgpack.packb({"request_id": ""}), "request ids"),
        (msgpack.packb({1: "r"}), "undecodable"),  # non-string map key
        (b"\x81\xaarequest_id\xa2\xff\xfe", "undecodable"),  # bad utf-8
    ],
)
def test_malformed_payloads_name_the_problem(payload: bytes, problem: str) -> None:
    with pytest.raises(MalformedMessageError, match=problem):
        decode_entry(entry_of("cancel", payload))


def test_oversized_payloads_and_fields_are_rejected_before_use() -> None:
    with pytest.raises(MalformedMessageError, match="exceeds"):
        decode_entry(entry_of("cancel", b"\x80" * (MAX_PAYLOAD_BYTES + 1)))
    huge_string = msgpack.packb({"request_id": "x" * (MAX_STR_BYTES + 1)})
    with pytest.raises(MalformedMessageError, match="undecodable"):
        decode_entry(entry_of("cancel", huge_string))
    long_id = msgpack.packb({"request_id": "x" * 129})
    with pytest.raises(MalformedMessageError, match="longer than 128"):
        decode_entry(entry_of("cancel", long_id))
    # a 32-bit array header claiming 2^30 items, without the items
    with pytest.raises(MalformedMessageError):
        decode_entry(entry_of("cancel", b"\xdd\x40\x00\x00\x00"))


def golden_fields(type_name: str) -> dict[str, object]:
    return msgpack.unpackb(bytes.fromhex(GOLDEN_V1[type_name]), raw=False)


def repack(type_name: str, **changes: object) -> dict[bytes, bytes]:
    fields = golden_fields(type_name)
    fields.update(changes)
    return entry_of(type_name, msgpack.packb(fields, use_bin_type=True))


@pytest.mark.parametrize(
    ("type_name", "changes", "problem"),
    [
        ("submit", {"prompt": b"\x01\x00\x00"}, "not a whole number"),
        ("submit", {"prompt": b"\xff\xff\xff\xff"}, "token ids must be >= 0"),
        ("submit", {"prompt": b""}, "at least one token"),
        ("submit", {"prompt": [1, 2]}, "prompt: expected bytes"),
        ("submit", {"priority": True}, "priority: expected int"),
        ("submit", {"sampling": {"temperature": 9.0}}, "sampling"),
        ("submit", {"slo_class": "x" * 65}, "slo_class: longer than 64"),
        ("submit", {"slo_class": ""}, "SLO class names are 1 to 64"),
        ("submit", {"slo_class": 3}, "slo_class: expected str"),
        ("tokens", {"tpot_ms": -1.0}, "tpot_ms must be >= 0"),
        ("tokens", {"tpot_ms": float("nan")}, "tpot_ms must be >= 0"),
        ("tokens", {"tpot_slo_ms": 0}, "tpot_slo_ms must be positive"),
        ("tokens", {"tpot_slo_ms": "fast"}, "tpot_slo_ms: expected float or int"),
        ("tokens", {"step": -1}, "step: must be >= 0"),
        ("tokens", {"finish": "exploded"}, "unknown finish reason"),
        ("draft_job", {"entries": ["x"]}, r"entries\[0\]: expected map"),
        ("verify_result", {"verify_ms": "slow"}, "verify_ms: expected float or int"),
    ],
)
def test_bad_field_values_are_malformed(
    type_name: str, changes: dict[str, object], problem: str
) -> None:
    with pytest.raises(MalformedMessageError, match=problem):
        decode_entry(repack(type_name, **changes))


def test_invalid_trees_are_malformed() -> None:
    fields = golden_fields("verify_job")
    tree = fields["entries"][0]["tree"]
    tree["parents"] = np.array([-1, 2, 0, 1], dtype="<i4").tobytes()  # child before parent
    with pytest.raises(MalformedMessageError, match="topological"):
        decode_entry(entry_of("verify_job", msgpack.packb(fields, use_bin_type=True)))
    tree["parents"] = np.array([-1, 0, 0], dtype="<i4").tobytes()  # wrong length
    with pytest.raises(MalformedMessageError, match="differ in length"):
        decode_entry(entry_of("verify_job", msgpack.packb(fields, use_bin_type=True)))


def test_negative_bonus_token_is_malformed() -> None:
    fields = golden_fields("verify_result")
    fields["entries"][0]["bonus"] = -3
    with pytest.raises(MalformedMessageError, match=r"entries\[0\].bonus"):
        decode_entry(entry_of("verify_result", msgpack.packb(fields, use_bin_type=True)))


def test_unknown_drafting_method_is_malformed() -> None:
    fields = golden_fields("draft_job")
    fields["entries"][0]["method"] = {"method": "oracle"}
    with pytest.raises(MalformedMessageError, match="unknown drafting method"):
        decode_entry(entry_of("draft_job", msgpack.packb(fields, use_bin_type=True)))


def features_map(rows: object = 2, cols: object = 4, data: object = None) -> dict[str, object]:
    raw = FEATURES.tobytes() if data is None else data
    return {"rows": rows, "cols": cols, "data": raw}


@pytest.mark.parametrize(
    ("features", "problem"),
    [
        (features_map(data=FEATURES.tobytes()[:-1]), "15 bytes do not hold 2 x 4"),
        (features_map(rows=3), "16 bytes do not hold 3 x 4"),
        (features_map(rows=MAX_FEATURE_ROWS + 1, cols=0, data=b""), "at most"),
        (features_map(rows=0, cols=MAX_FEATURE_COLS + 1, data=b""), "at most"),
        (features_map(rows=2**40, cols=2**40), "at most"),
        (features_map(rows=-1), r"features.rows: must be >= 0"),
        (features_map(cols=True), r"features.cols: expected int"),
        (features_map(rows=2.0), r"features.rows: expected int"),
        (features_map(data=[1, 2]), r"features.data: expected bytes"),
        ({"rows": 2, "cols": 4}, r"features.data: missing"),
        ({"cols": 4, "data": FEATURES.tobytes()}, r"features.rows: missing"),
        (FEATURES.tobytes(), "features: expected dict"),
        ([[0.5, 1.0]], "features: expected dict"),
        ("0.5", "features: expected dict"),
    ],
)
def test_malformed_features_are_refused(features: object, problem: str) -> None:
    result = golden_fields("verify_result")
    result["entries"][0]["features"] = features  # two rows fit an entry with one accepted token
    with pytest.raises(MalformedMessageError, match=problem):
        decode_entry(entry_of("verify_result", msgpack.packb(result, use_bin_type=True)))
    drafts = golden_fields("draft_job")
    drafts["entries"][0]["features"] = features  # base_len 10, two new tokens: two rows
    with pytest.raises(MalformedMessageError, match=problem):
        decode_entry(entry_of("draft_job", msgpack.packb(drafts, use_bin_type=True)))


def test_draft_features_with_the_wrong_row_count_are_malformed() -> None:
    fields = golden_fields("draft_job")
    fields["entries"][1]["features"] = features_map()  # base_len 0, two new tokens: one row
    with pytest.raises(MalformedMessageError, match="features need 1 rows"):
        decode_entry(entry_of("draft_job", msgpack.packb(fields, use_bin_type=True)))


@pytest.mark.parametrize(
    ("base_len", "features", "problem"),
    [
        (0, FEATURES, "need 1 rows"),  # the first prompt token has no preceding position
        (5, FEATURES[:1], "need 2 rows"),
        (5, np.zeros((3, 4), np.float16), "need 2 rows"),
        (0, FEATURES[:1].astype(np.float32), "2-D float16"),
        (5, FEATURES.astype(np.float64), "2-D float16"),
        (5, FEATURES.reshape(-1), "2-D float16"),
        (5, FEATURES.reshape(2, 2, 2), "2-D float16"),
        (5, FEATURES.tolist(), "2-D float16"),
    ],
)
def test_draft_request_refuses_features_of_the_wrong_shape_or_dtype(
    base_len: int, features: object, problem: str
) -> None:
    method = DraftMethod("chain", k=2)
    with pytest.raises(ValueError, match=problem):
        DraftRequest("r", 1, base_len, (9, 10), method, GREEDY, 1, features=features)


def test_draft_features_have_a_row_per_preceding_position() -> None:
    method = DraftMethod("chain", k=2)
    prompt = DraftRequest("r", 0, 0, (9, 10), method, GREEDY, 1, features=FEATURES[1:])
    later = DraftRequest("r", 1, 5, (9, 10), method, GREEDY, 1, features=FEATURES)
    assert prompt.features is not None and later.features is not None


def test_verified_request_refuses_features_that_are_not_a_float16_matrix() -> None:
    for features in (FEATURES.astype(np.float32), FEATURES.reshape(-1), FEATURES.tolist()):
        with pytest.raises(ValueError, match="2-D float16"):
            VerifiedRequest("r", 1, (3,), 4, features=features)


def test_verify_entry_needs_exactly_one_of_chunk_and_tree() -> None:
    with pytest.raises(ValueError, match="either"):
        VerifyRequest("r", 0, GREEDY, 1, 1)
    with pytest.raises(ValueError, match="either"):
        VerifyRequest("r", 0, GREEDY, 1, 1, chunk=(1,), tree=make_tree())


# ---- add-only evolution ------------------------------------------------------------------------


def test_unknown_fields_from_a_newer_writer_are_ignored() -> None:
    newer = repack("submit", lookahead_hint=3, routing={"zone": "b"})
    newer[b"v"] = b"2"
    assert decode_entry(newer) == canonical_v1()["submit"]


def test_fields_with_defaults_may_be_missing() -> None:
    fields = golden_fields("submit")
    for name in ("priority", "tpot_slo_ms", "draft_model", "speculate"):
        del fields[name]
    submit = decode_entry(entry_of("submit", msgpack.packb(fields, use_bin_type=True)))
    assert isinstance(submit, Submit)
    assert (submit.priority, submit.tpot_slo_ms, submit.draft_model, submit.speculate) == (
        0,
        None,
        None,
        True,
    )
    assert submit.slo_class is None
    tokens = msgpack.unpackb(bytes.fromhex(GOLDEN_V1["tokens"]), raw=False)
    minimal = {k: tokens[k] for k in ("request_id", "step", "offset", "token_ids")}
    decoded = decode_entry(entry_of("tokens", msgpack.packb(minimal, use_bin_type=True)))
    assert decoded == Tokens("req-1", 3, 5, (9, 10))
    assert isinstance(decoded, Tokens)
    assert (decoded.slo_class, decoded.tpot_slo_ms, decoded.tpot_ms) == (None, None, None)


def test_from_entry_of_the_wrong_class_is_refused() -> None:
    with pytest.raises(MalformedMessageError, match="expected submit"):
        Submit.from_entry(Cancel("r").to_entry())


# ---- stream names ------------------------------------------------------------------------------


def test_stream_names() -> None:
    assert names.requests_stream("0") == "augury:{0}:requests"
    assert names.draft_stream("0", "tiny", "h-1") == "augury:{0}:draft:tiny:h-1"
    assert names.candidates_stream("0") == "augury:{0}:candidates"
    assert names.verify_stream("0") == "augury:{0}:verify"
    assert names.results_stream("0") == "augury:{0}:results"
    assert names.output_stream("0", "gw-1") == "augury:{0}:out:gw-1"
    assert names.dead_letter_stream("augury:{0}:verify") == "augury:{0}:verify:dead"
    assert names.heartbeat_key("0", "drafter", "h-1") == "augury:{0}:hb:drafter:h-1"


def test_every_key_of_a_cell_is_in_the_cells_hash_slot() -> None:
    from redis.crc import key_slot

    cell = "c7"
    keys = [
        names.requests_stream(cell),
        names.draft_stream(cell, "tiny", "h-1"),
        names.candidates_stream(cell),
        names.verify_stream(cell),
        names.results_stream(cell),
        names.output_stream(cell, "gw-1"),
        names.dead_letter_stream(names.verify_stream(cell)),
        names.heartbeat_key(cell, "drafter", "h-1"),
        names.scheduler_lease_key(cell),
        names.scheduler_output_key(cell, "r1"),
        names.scheduler_finished_key(cell),
        names.profile_key(cell, "target"),
    ]
    assert {key_slot(key.encode()) for key in keys} == {key_slot(cell.encode())}


def test_only_gateway_output_streams_of_the_cell_are_reply_targets() -> None:
    from shared.wire.streams import output_stream, output_stream_replica

    assert output_stream_replica("0", output_stream("0", "gw-1")) == "gw-1"
    for name in (
        output_stream("1", "gw-1"),
        "augury:{0}:out:",
        "augury:{0}:requests",
        "other",
        "augury:{0}:out:a:b",
        "x:augury:{0}:out:g",
    ):
        assert output_stream_replica("0", name) is None, name
