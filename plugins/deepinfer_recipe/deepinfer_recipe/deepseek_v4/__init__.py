"""DeepSeek V4 prompt encoding and output parsing."""

from .encoding import DeepSeekV4Encoding, make_parser, normalize_effort
from .front import new_parser
from .parser import DeepSeekV4Parser
from .reference_messages import conversation_from_reference

__all__ = [
    "DeepSeekV4Encoding",
    "DeepSeekV4Parser",
    "conversation_from_reference",
    "make_parser",
    "new_parser",
    "normalize_effort",
]
