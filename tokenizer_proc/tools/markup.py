"""What the parsers share: the calls they find, and how much of a text to hold back
while it may still turn into a marker."""

import json
import uuid
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One parsed call: `arguments` is JSON text (an object), as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_wire(self, index: int) -> dict:
        """The call as a StreamChunk carries it; `index` counts the choice's calls."""
        return {"index": index, "id": self.id, "name": self.name,
                "arguments": self.arguments}


def make_call(name, arguments) -> ToolCall | None:
    """A call from a parsed name and arguments (an object, or JSON text of one);
    None if they are not a string and an object."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `markers`: they
    wait for the next text before being passed on."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
