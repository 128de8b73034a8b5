"""The ``deepseek_v4`` prompt encoding: conversation -> exact reference prompt -> token ids.

Rendering lives in :mod:`.prompt` (layout) and :mod:`.tokens` (injection-safe ids); this module
maps a protocol-neutral :class:`ConversationRequest` onto them and names the output parser.

Reasoning effort follows DeepSeek's API: thinking is on unless the request turns it off;
``minimal``/``low`` -> low, ``medium``/``high``/``xhigh`` -> high, ``max`` -> max, ``none`` ->
thinking off. Only ``max`` changes the prompt (an instruction right after BOS, in thinking mode
only, as in the reference). The parser starts in reasoning exactly when the prompt ends with
``<think>`` (not after a prefix continuation, a task token or a trailing reminder's text).
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_core.codecs import ConversationRequest, EncodedPrompt, OutputParser

from ..common import EFFORT_LEVELS
from .dsml import V4_TAGS, DsmlTags
from .front import new_parser
from .prompt import RenderOptions, attach_request_level, opens_thinking, render_parts
from .tokens import EOS, Part, SegmentTokenizer, load_segment_tokenizer, prompt_text

PARSER_NAME = "deepseek_v4"


def normalize_effort(effort: str | None) -> str:
    """Map an API effort name onto the three levels the model knows (default high)."""
    if effort is None:
        return "high"
    try:
        return EFFORT_LEVELS[effort]
    except KeyError:
        raise ValueError(
            f"unknown reasoning effort {effort!r}; expected one of {', '.join(EFFORT_LEVELS)}, none"
        ) from None


def render_options(conversation: ConversationRequest, tags: DsmlTags = V4_TAGS) -> RenderOptions:
    thinking = conversation.thinking is not False and conversation.reasoning_effort != "none"
    effort = "high" if conversation.reasoning_effort == "none" else normalize_effort(conversation.reasoning_effort)
    return RenderOptions(thinking=thinking, effort=effort, tags=tags)


@dataclass
class DeepSeekV4Encoding:
    """PromptEncoding for DeepSeek-V4 models (``model_type == "deepseek_v4"``)."""

    tokenizer_path: str | None = None
    tags: DsmlTags = V4_TAGS
    name: str = "deepseek_v4"

    def matches(self, model_config: dict) -> bool:
        architectures = model_config.get("architectures") or ()
        return model_config.get("model_type") == "deepseek_v4" or "DeepseekV4ForCausalLM" in architectures

    # -- rendering --------------------------------------------------------------------------
    def parts(self, conversation: ConversationRequest) -> list[Part]:
        messages = attach_request_level(conversation.messages, conversation.tools, conversation.response_format)
        return render_parts(messages, render_options(conversation, self.tags))

    def render(self, conversation: ConversationRequest) -> str:
        """The prompt string DeepSeek's reference encoder produces for this conversation."""
        return prompt_text(self.parts(conversation))

    # -- PromptEncoding ---------------------------------------------------------------------
    @property
    def tokenizer(self) -> SegmentTokenizer:
        return load_segment_tokenizer(self.tokenizer_path)

    def encode(self, conversation: ConversationRequest) -> EncodedPrompt:
        tokenizer = self.tokenizer
        parts = self.parts(conversation)
        ids = tokenizer.encode_parts(parts)
        return EncodedPrompt(
            token_ids=tuple(ids),
            stop_token_ids=(tokenizer.marker_id(EOS),),
            parser_options={
                "parser": PARSER_NAME,
                "thinking": opens_thinking(parts),
                "dsml_calls_tag": self.tags.calls,
                "stop": tuple(conversation.stop),
            },
        )

    def parser(self, options: dict | None = None) -> OutputParser:
        return make_parser(options or {})

    def warm_up(self) -> str:
        """What the first request would otherwise wait for, done at server start-up (in the
        background; see ``deepinfer_core.serve.conversation``): the tokenizer's load. The
        server's parser streams tool calls as they are written, so it reads every piece in
        Python and never uses the C front (``new_parser`` without ``stream_calls``): nothing
        is compiled here. Returns what it did, for the log."""
        self.tokenizer
        return "the V4 tokenizer is loaded"


def make_parser(options: dict) -> OutputParser:
    """Factory registered under ``deepseek_v4``: options from :meth:`DeepSeekV4Encoding.encode`."""
    from .dsml import V4_1_TAGS

    tags = V4_1_TAGS if options.get("dsml_calls_tag") == V4_1_TAGS.calls else V4_TAGS
    return new_parser(
        thinking=bool(options.get("thinking", True)), tags=tags, stop=tuple(options.get("stop", ())), stream_calls=True
    )
