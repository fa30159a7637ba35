"""A suffix automaton over token ids, built online, for drafts that continue a repeated text.

The automaton of a text has one state per class of substrings that end at the same set of
positions; `link` points to the state of the longest suffix that ends at more positions.
Two lookups give drafts:
- `repeated_suffix()`: the longest suffix of the text that also occurs earlier (the state
  linked from the last one), and where that earlier occurrence ends, so the draft is what
  followed it;
- `longest_match(tokens)`: the longest suffix of another sequence that occurs anywhere in
  this text (a walk with suffix-link fallbacks), for a corpus of other requests' outputs.

Both return an end position inside the text (`first_end`, the first occurrence's); the draft
is `text[end + 1 : end + 1 + k]`. Appending a token is amortized O(1) (Blumer et al.'s
construction), so a request's automaton grows with its output at no real cost.
"""

from __future__ import annotations


class SuffixAutomaton:
    __slots__ = ("first_end", "last", "length", "link", "next", "text")

    def __init__(self, tokens: list[int] | None = None) -> None:
        self.text: list[int] = []
        # Per state: its transitions, its suffix link, its longest substring's length and the
        # end position of that substring's first occurrence.
        self.next: list[dict[int, int]] = [{}]
        self.link: list[int] = [-1]
        self.length: list[int] = [0]
        self.first_end: list[int] = [-1]
        self.last = 0
        for t in tokens or ():
            self.append(t)

    def __len__(self) -> int:
        return len(self.text)

    def append(self, token: int) -> None:
        pos = len(self.text)
        self.text.append(token)
        cur = self._new_state(self.length[self.last] + 1, pos)
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
        if p == -1:
            self.link[cur] = 0
        else:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = self._new_state(self.length[p] + 1, self.first_end[q])
                self.next[clone] = dict(self.next[q])
                self.link[clone] = self.link[q]
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = clone
                self.link[cur] = clone
        self.last = cur

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.append(t)

    def _new_state(self, length: int, first_end: int) -> int:
        self.next.append({})
        self.link.append(-1)
        self.length.append(length)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def repeated_suffix(self) -> tuple[int, int]:
        """(length, end) of the longest suffix of the text that also ends at an earlier
        position, `end` being the first such position; (0, -1) when none does."""
        state = self.link[self.last] if self.last else -1
        if state <= 0:
            return 0, -1
        return self.length[state], self.first_end[state]

    def longest_match(self, tokens: list[int]) -> tuple[int, int]:
        """(length, end) of the longest suffix of `tokens` found in the text, `end` being where
        an occurrence of it ends in the text; (0, -1) when not even its last token is."""
        state, matched = 0, 0
        for t in tokens:
            while state and t not in self.next[state]:
                state = self.link[state]
                matched = self.length[state]
            nxt = self.next[state].get(t)
            if nxt is None:
                state, matched = 0, 0
            else:
                state, matched = nxt, matched + 1
        if matched == 0:
            return 0, -1
        return matched, self.first_end[state]

    def continuation(self, end: int, k: int) -> list[int]:
        """Up to k tokens of the text after position `end`."""
        return self.text[end + 1 : end + 1 + k]
