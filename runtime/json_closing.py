"""The shortest text that completes a JSON prefix: what a reply constrained to JSON must still say to
end as a whole value, so that it can be made to say it before max_tokens runs out
(runtime/constraints.py).

An incremental scanner of compact JSON (no whitespace outside strings, as the grammar emits it):
a stack of open containers and what the next character may be. The completion closes an open
string, gives a dangling key or a missing value `null`, completes a partial number or literal, and
closes the containers innermost first. Feeding a prefix of the completion leaves the rest of it
as the completion.
"""
from __future__ import annotations

# What the scanner expects next.
VALUE, VALUE_OR_END, KEY, KEY_OR_END, KEY_STRING, AFTER_KEY, STRING, NUMBER, LITERAL, AFTER_VALUE, DONE = range(11)
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
NUMBER_CHARS = frozenset("0123456789+-.eE")


class JsonPrefix:
    __slots__ = ("stack", "mode", "escape", "hex_left", "rest", "last")

    def __init__(self):
        self.stack: list[str] = []
        self.mode = VALUE
        self.escape = False     # a backslash was the last character of a string
        self.hex_left = 0       # hex digits a \u escape still needs
        self.rest = ""          # what a partial literal still needs
        self.last = ""          # a partial number's last character

    def copy(self) -> JsonPrefix:
        other = JsonPrefix.__new__(JsonPrefix)
        other.stack, other.mode, other.escape = list(self.stack), self.mode, self.escape
        other.hex_left, other.rest, other.last = self.hex_left, self.rest, self.last
        return other

    def feed(self, text: str) -> JsonPrefix:
        for ch in text:
            self._char(ch)
        return self

    def _value_done(self) -> None:
        self.mode = AFTER_VALUE if self.stack else DONE

    def _char(self, ch: str) -> None:
        mode = self.mode
        if mode in (STRING, KEY_STRING):
            if self.hex_left:
                self.hex_left -= 1
            elif self.escape:
                self.escape = False
                self.hex_left = 4 if ch == "u" else 0
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                if mode == KEY_STRING:
                    self.mode = AFTER_KEY
                else:
                    self._value_done()
        elif mode == NUMBER:
            if ch in NUMBER_CHARS:
                self.last = ch
            else:
                self._value_done()
                self._char(ch)
        elif mode == LITERAL:
            self.rest = self.rest[1:]
            if not self.rest:
                self._value_done()
        elif mode in (VALUE, VALUE_OR_END):
            if ch == "{":
                self.stack.append("{")
                self.mode = KEY_OR_END
            elif ch == "[":
                self.stack.append("[")
                self.mode = VALUE_OR_END
            elif ch == '"':
                self.mode = STRING
            elif ch in LITERALS:
                self.mode, self.rest = LITERAL, LITERALS[ch]
            elif ch == "]" and mode == VALUE_OR_END:
                self.stack.pop()
                self._value_done()
            elif ch in NUMBER_CHARS:
                self.mode, self.last = NUMBER, ch
        elif mode in (KEY, KEY_OR_END):
            if ch == '"':
                self.mode = KEY_STRING
            elif ch == "}" and mode == KEY_OR_END:
                self.stack.pop()
                self._value_done()
        elif mode == AFTER_KEY:
            if ch == ":":
                self.mode = VALUE
        elif mode == AFTER_VALUE:
            if ch == ",":
                self.mode = KEY if self.stack[-1] == "{" else VALUE
            elif ch in "}]":
                self.stack.pop()
                self._value_done()

    def completion(self) -> str:
        """The shortest text after which the prefix is one whole JSON value (an object, where nothing
        was written yet: what a JSON-object reply must be)."""
        mode = self.mode
        if mode == VALUE and not self.stack:
            return "{}"
        escape = "0" * self.hex_left if self.hex_left else "n" if self.escape else ""
        head = {VALUE: "null", KEY: '"":null', KEY_STRING: escape + '":null', AFTER_KEY: ":null",
                STRING: escape + '"', NUMBER: "0" if self.last in "+-.eE" else "", LITERAL: self.rest}.get(mode, "")
        return head + "".join("}" if c == "{" else "]" for c in reversed(self.stack))
