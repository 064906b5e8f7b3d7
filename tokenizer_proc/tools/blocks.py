"""Incremental splitting of a model's text into content and tool calls, for formats
whose calls sit between a start marker and an end marker (or the end of the text).

A call is passed on once its block is complete and parses: a block that does not
parse is passed on as content, markup and all, so nothing the model wrote is lost.
Whitespace between calls (and around them, when the reply is only calls) is dropped."""

from .markup import ToolCall, held_back


class BlockParser:
    """Subclasses set START (markers that open a block), END (the marker that closes
    one; None: it runs to the end of the text) and `parse(body)`: the calls a
    complete block holds, or None if it is malformed."""

    START: tuple[str, ...] = ()
    END: str | None = None

    def __init__(self, tools: list[dict] | None = None):
        self.tools = tools or []
        self._buf = ""          # outside: unsent text; inside: the block's body so far
        self._opener = ""       # the marker that opened the current block
        self._inside = False
        self._quiet = True      # at the start or after a call: whitespace waits
        self._ws = ""
        self.calls = 0          # calls found so far

    def parse(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """More text of the reply: the content and the calls it completes."""
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while self._step(out, calls):
            pass
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the reply: a block left open is parsed as it stands."""
        out: list[str] = []
        calls: list[ToolCall] = []
        if self._inside:
            self._close(self._buf, "", out, calls)
        else:
            self._emit(self._buf, out)
        self._buf = ""
        if not self.calls:
            out.append(self._ws)
        return "".join(out), calls

    def find_start(self, text: str) -> tuple[int, int] | None:
        """Where a block opens in unsent text: (position, length of its marker)."""
        hits = [(i, len(m)) for m in self.START if (i := text.find(m)) >= 0]
        return min(hits) if hits else None

    def hold(self, text: str) -> int:
        """How much of the end of unsent text to keep for the next feed."""
        return held_back(text, self.START)

    def _step(self, out: list[str], calls: list[ToolCall]) -> bool:
        """One move of the state machine; False when it needs more text."""
        if not self._inside:
            found = self.find_start(self._buf)
            if found is None:
                cut = len(self._buf) - self.hold(self._buf)
                self._emit(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                return False
            at, length = found
            self._emit(self._buf[:at], out)
            self._opener, self._buf = self._buf[at:at + length], self._buf[at + length:]
            self._inside = True
            return True
        end = -1 if self.END is None else self._buf.find(self.END)
        if end < 0:
            return False
        body, self._buf = self._buf[:end], self._buf[end + len(self.END):]
        self._close(body, self.END, out, calls)
        return True

    def _close(self, body: str, closer: str, out: list[str], calls: list[ToolCall]) -> None:
        self._inside = False
        parsed = self.parse(body)
        if not parsed:
            self._emit(self._opener + body + closer, out)
            return
        calls += parsed
        self.calls += len(parsed)
        self._ws, self._quiet = "", True

    def _emit(self, text: str, out: list[str]) -> None:
        if self._quiet:
            self._ws += text
            if not self._ws.strip():
                return
            text, self._ws, self._quiet = self._ws, "", False
        out.append(text)
