"""Regexes and EBNF grammars for the tests, with prompts, and a small recursive-descent
parser per grammar, written independently of xgrammar, that every output must satisfy."""

from __future__ import annotations

# (regex, prompt)
REGEXES = [
    (
        r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
        "What is today's date? Answer in YYYY-MM-DD format.",
    ),
    (r"\(\d{3}\) \d{3}-\d{4}", "Give me a US phone number."),
    (r"(yes|no|maybe)", "Is the sky blue? Answer yes, no or maybe."),
    (r"[a-z]{1,12}@[a-z]{1,10}\.(com|org|net)", "Give me an email address for John."),
    (r"(red|green|blue), (red|green|blue)", "Name two primary colors of light."),
    (r"[A-Z][a-z]{1,15}( [A-Z][a-z]{1,15})?", "What is the capital of France?"),
]

# Arithmetic with one to four terms; a term is a number or one parenthesized operation.
ARITH = r"""root ::= term (" " op " " term){1,3}
term ::= num | "(" num " " op " " num ")"
op ::= "+" | "-" | "*" | "/"
num ::= "0" | [1-9] [0-9]{0,2}
"""

# One to four `key=value` pairs separated by "; ".
KV = r"""root ::= pair ("; " pair){0,3}
pair ::= key "=" value
key ::= [a-z_]{1,12}
value ::= [0-9]{1,5} | "\"" [a-zA-Z0-9 ]{0,15} "\"" | "true" | "false"
"""


class _Parser:
    """Recursive descent over a string: each method consumes its production or raises."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def peek(self) -> str:
        return self.text[self.pos : self.pos + 1]

    def expect(self, literal: str) -> None:
        if not self.text.startswith(literal, self.pos):
            raise ValueError(f"expected {literal!r} at {self.pos} in {self.text!r}")
        self.pos += len(literal)

    def chars(self, allowed: str, lo: int, hi: int) -> str:
        start = self.pos
        while self.pos - start < hi and self.peek() and self.peek() in allowed:
            self.pos += 1
        if self.pos - start < lo:
            raise ValueError(f"expected {lo}+ of {allowed!r} at {start} in {self.text!r}")
        return self.text[start : self.pos]

    def end(self) -> None:
        if self.pos != len(self.text):
            raise ValueError(f"trailing text at {self.pos} in {self.text!r}")


DIGITS = "0123456789"
LOWER = "abcdefghijklmnopqrstuvwxyz"


def parse_arith(text: str) -> int:
    """Parse an ARITH expression; returns its number of terms."""
    p = _Parser(text)

    def num() -> None:
        if p.peek() == "0":
            p.expect("0")
        else:
            p.chars(DIGITS[1:], 1, 1)
            p.chars(DIGITS, 0, 2)

    def op() -> None:
        if p.peek() not in ("+", "-", "*", "/"):
            raise ValueError(f"expected an operator at {p.pos} in {text!r}")
        p.pos += 1

    def binary() -> None:
        num()
        p.expect(" ")
        op()
        p.expect(" ")
        num()

    def term() -> None:
        if p.peek() == "(":
            p.expect("(")
            binary()
            p.expect(")")
        else:
            num()

    term()
    terms = 1
    while p.peek() == " ":
        p.expect(" ")
        op()
        p.expect(" ")
        term()
        terms += 1
    p.end()
    if not 2 <= terms <= 4:
        raise ValueError(f"{terms} terms in {text!r}")
    return terms


def parse_kv(text: str) -> dict[str, str]:
    """Parse a KV list into a dict (a repeated key keeps its last value)."""
    p = _Parser(text)
    pairs: list[tuple[str, str]] = []
    while True:
        key = p.chars(LOWER + "_", 1, 12)
        p.expect("=")
        if p.peek() == '"':
            p.expect('"')
            value = p.chars(LOWER + LOWER.upper() + DIGITS + " ", 0, 15)
            p.expect('"')
        elif p.peek() in ("t", "f"):
            value = "true" if p.peek() == "t" else "false"
            p.expect(value)
        else:
            value = p.chars(DIGITS, 1, 5)
        pairs.append((key, value))
        if p.peek() != ";":
            break
        p.expect("; ")
    p.end()
    if len(pairs) > 4:
        raise ValueError(f"{len(pairs)} pairs in {text!r}")
    return dict(pairs)
