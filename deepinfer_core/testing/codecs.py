"""Conformance suites for the recipe hook families: protocol codecs, prompt encodings and
output parsers (``deepinfer_register_protocols`` / ``_prompt_encodings`` / ``_output_parsers``).

Subclass and override the factory fixtures::

    class TestMyCodec(ProtocolCodecSuite):
        @pytest.fixture
        def codec(self):
            return MyCodec()

        @pytest.fixture
        def minimal_body(self):
            return {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    class TestMyEncoding(PromptEncodingSuite):
        @pytest.fixture
        def encoding(self): return MyEncoding()
        @pytest.fixture
        def model_config(self): return {"model_type": "my_model"}

    class TestMyParser(OutputParserSuite):
        @pytest.fixture
        def make_parser(self): return lambda: MyParser()

These check the contract every implementation shares; protocol fidelity (real SDK types,
golden prompts) is each plugin's own test.
"""

from __future__ import annotations

import json
import random
from typing import Callable

import pytest

from ..codecs import (
    ConversationRequest,
    EncodedPrompt,
    Message,
    OutputParser,
    ParsedOutput,
    PromptEncoding,
    ProtocolCodec,
    ProtocolError,
)

__all__ = ["OutputParserSuite", "PromptEncodingSuite", "ProtocolCodecSuite"]


_HTTP_METHODS = {"GET", "POST", "PUT", "PATCH", "DELETE"}


def _join(outputs: list[ParsedOutput]) -> tuple[str, str, tuple]:
    """Concatenate deltas: (content, reasoning, ((name, arguments), ...))."""
    calls = tuple((c.name, c.arguments) for o in outputs for c in o.tool_calls)
    return "".join(o.content for o in outputs), "".join(o.reasoning for o in outputs), calls


class ProtocolCodecSuite:
    """What every :class:`~deepinfer_core.codecs.ProtocolCodec` must do."""

    @pytest.fixture
    def codec(self) -> ProtocolCodec:
        pytest.fail("a ProtocolCodecSuite subclass must override the `codec` fixture")

    @pytest.fixture
    def minimal_body(self) -> dict:
        pytest.fail("a ProtocolCodecSuite subclass must override `minimal_body` (the smallest valid request)")

    @pytest.fixture
    def invalid_bodies(self, minimal_body) -> list[dict]:
        """Bodies the codec must reject; override to add protocol-specific ones."""
        return [
            {},
            {k: v for k, v in minimal_body.items() if k != "messages"},
            {**minimal_body, "messages": []},
            {**minimal_body, "messages": "hello"},
            {**minimal_body, "messages": [{"role": "no-such-role", "content": "x"}]},
            {**minimal_body, "temperature": -1},
            {**minimal_body, "temperature": "hot"},
            {**minimal_body, "max_tokens": 0},
        ]

    def test_is_a_protocol_codec(self, codec):
        assert isinstance(codec, ProtocolCodec)

    def test_name_and_routes_well_formed(self, codec):
        assert isinstance(codec.name, str) and codec.name and codec.name == codec.name.strip()
        routes = list(codec.routes)
        assert routes, "a codec serves at least one route"
        for method, path in routes:
            assert method in _HTTP_METHODS, method
            assert isinstance(path, str) and path.startswith("/"), path
        assert len(set(routes)) == len(routes), "routes must be unique"

    def test_parses_minimal_body(self, codec, minimal_body):
        request = codec.parse_request(minimal_body)
        assert isinstance(request, ConversationRequest)
        assert request.messages and all(isinstance(m, Message) for m in request.messages)

    def test_parse_does_not_mutate_body(self, codec, minimal_body):
        snapshot = json.dumps(minimal_body, sort_keys=True)
        codec.parse_request(minimal_body)
        assert json.dumps(minimal_body, sort_keys=True) == snapshot

    def test_rejects_invalid_bodies(self, codec, invalid_bodies):
        for body in invalid_bodies:
            with pytest.raises(ProtocolError):
                codec.parse_request(body)
                pytest.fail(f"accepted an invalid body: {json.dumps(body)[:300]}")

    def test_rejects_non_object_body(self, codec):
        for body in (None, [], "x", 3):
            with pytest.raises(ProtocolError):
                codec.parse_request(body)  # type: ignore[arg-type]

    def test_render_error_shape(self, codec):
        for status in (400, 404, 429, 500):
            status_out, body = codec.render_error(ProtocolError("bad thing", status=status, param="temperature"))
            assert isinstance(status_out, int) and status_out >= 400
            assert isinstance(body, dict) and body
            assert "bad thing" in json.dumps(body)

    def test_render_and_stream_are_json_serializable(self, codec, minimal_body):
        request = codec.parse_request(minimal_body)
        body = codec.render(
            request, ParsedOutput(content="hello"), {"prompt_tokens": 3, "completion_tokens": 1}, "stop"
        )
        assert "hello" in json.dumps(body)
        frames = list(
            codec.stream(request, [ParsedOutput(content="hel"), ParsedOutput(content="lo", finish_reason="stop")])
        )
        assert frames and all(isinstance(f, str) and f.endswith("\n\n") for f in frames)
        assert "hel" in "".join(frames) and "lo" in "".join(frames)


class OutputParserSuite:
    """What every :class:`~deepinfer_core.codecs.OutputParser` must do."""

    @pytest.fixture
    def make_parser(self) -> Callable[[], OutputParser]:
        pytest.fail("an OutputParserSuite subclass must override `make_parser` (a zero-argument factory)")

    @pytest.fixture
    def sample_outputs(self) -> list[str]:
        """Model outputs to replay; override with ones that exercise markers and tool calls."""
        return ["Plain answer text.", "héllo wörld 🌍\nsecond line", ""]

    def test_is_an_output_parser(self, make_parser):
        parser = make_parser()
        assert isinstance(parser, OutputParser)
        assert isinstance(parser.push("x"), ParsedOutput)
        assert isinstance(parser.finish(), ParsedOutput)

    def test_plain_text_survives(self, make_parser):
        parser = make_parser()
        content, reasoning, calls = _join([parser.push("Just some words."), parser.finish()])
        assert content + reasoning == "Just some words." and calls == ()

    @pytest.mark.parametrize("seed", range(5))
    def test_chunking_does_not_change_the_result(self, make_parser, sample_outputs, seed):
        rng = random.Random(seed)
        for text in sample_outputs:
            whole = make_parser()
            expected = _join([whole.push(text), whole.finish()])
            by_char = make_parser()
            assert _join([by_char.push(ch) for ch in text] + [by_char.finish()]) == expected
            chunked = make_parser()
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            assert _join([chunked.push(p) for p in pieces] + [chunked.finish()]) == expected


class PromptEncodingSuite:
    """What every :class:`~deepinfer_core.codecs.PromptEncoding` must do."""

    @pytest.fixture
    def encoding(self) -> PromptEncoding:
        pytest.fail("a PromptEncodingSuite subclass must override the `encoding` fixture")

    @pytest.fixture
    def model_config(self) -> dict:
        pytest.fail("a PromptEncodingSuite subclass must override `model_config` (a config it matches)")

    @pytest.fixture
    def conversation(self) -> ConversationRequest:
        return ConversationRequest(
            messages=(Message(role="system", content="Be brief."), Message(role="user", content="Hi there"))
        )

    def test_is_a_prompt_encoding(self, encoding):
        assert isinstance(encoding, PromptEncoding)
        assert isinstance(encoding.name, str) and encoding.name

    def test_matches_its_model_only(self, encoding, model_config):
        assert encoding.matches(model_config) is True
        assert encoding.matches({"model_type": "definitely_not_a_model", "architectures": ["NopeForCausalLM"]}) is False

    def test_encode_returns_token_ids(self, encoding, conversation):
        encoded = encoding.encode(conversation)
        assert isinstance(encoded, EncodedPrompt)
        assert encoded.token_ids and all(type(t) is int and t >= 0 for t in encoded.token_ids)
        assert all(type(t) is int for t in encoded.stop_token_ids)
        assert isinstance(encoded.parser_options, dict)

    def test_encode_is_deterministic(self, encoding, conversation):
        assert encoding.encode(conversation) == encoding.encode(conversation)

    def test_user_text_changes_the_ids(self, encoding, conversation):
        other = ConversationRequest(messages=conversation.messages[:-1] + (Message(role="user", content="Bye now"),))
        assert encoding.encode(other).token_ids != encoding.encode(conversation).token_ids

    def test_parser_round_trip(self, encoding, conversation):
        parser = encoding.parser(encoding.encode(conversation).parser_options)
        assert isinstance(parser, OutputParser)
        content, reasoning, calls = _join([parser.push("Hello "), parser.push("world."), parser.finish()])
        assert content + reasoning == "Hello world." and calls == ()
