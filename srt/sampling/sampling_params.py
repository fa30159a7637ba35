"""Per-request sampling parameters, with SGLang's native field names and defaults.

Lifecycle: the HTTP layer builds a `SamplingParams` with `from_dict` (unknown keys are
ignored, since request bodies carry extra fields), the tokenizer manager calls `normalize()`
and then `verify(vocab_size)`, and the object travels to the scheduler inside the tokenized
request. The scheduler never mutates it; `SamplingBatchInfo` turns a batch of them into
tensors.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, NoReturn

# Below this temperature a request is greedy (argmax), exactly as if top_k were 1.
SAMPLING_EPS = 1e-6

# The limits every entry point applies (/generate, the OpenAI routes, `Engine`): `verify`
# checks them and the OpenAI request models declare the same bounds, so a value is accepted
# or refused alike everywhere.
MAX_TEMPERATURE = 2.0
MAX_PENALTY = 2.0  # |frequency_penalty|, |presence_penalty|; repetition_penalty in (0, 2]
MAX_N = 64
MAX_STOP_SEQUENCES = 16
# stop_regex (SGLang's): at most this many patterns of at most this many characters each. A
# pattern is searched in the decoded tail of the output after every token: the tail is the
# pattern's longest match in characters plus one token, at most STOP_REGEX_MAX_TAIL tokens
# (a pattern with an unbounded repeat is searched in that many).
MAX_STOP_REGEX = 16
MAX_STOP_REGEX_LEN = 256
STOP_REGEX_MAX_TAIL = 512
# logit_bias: each value is in [-MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE] (OpenAI's range),
# and exactly -MAX_LOGIT_BIAS_VALUE bans the token (OpenAI: "should result in a ban").
MAX_LOGIT_BIAS_VALUE = 100.0
# At most this many biased tokens per request. OpenAI has allowed 300; we allow more, but
# bound it because every entry is an element of each decode step's sparse bias tensors and
# a per-request loop in `SamplingBatchInfo.from_reqs`.
MAX_LOGIT_BIAS = 1024


@dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Regular expressions searched in the output's decoded tail; the first match stops it.
    stop_regex: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # OpenAI logit_bias: token id -> bias added to its logit before penalties. Sent with
    # string keys (JSON object keys are strings; `Engine` callers may use ints);
    # normalize() makes every valid key an int, and an empty map None.
    logit_bias: dict[int | str, float] | None = None
    # Structured output (carried for the grammar backend; at most one may be set).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Computed by normalize(): longest stop string, in characters (tokenizer-free bound on
    # how much text the detokenizer must hold back before it can stream).
    stop_str_max_len: int = field(default=0, repr=False)
    # Computed by normalize(): how many output tokens' text a stop_regex is searched in.
    stop_regex_tail: int = field(default=0, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a request body, ignoring keys that are not sampling fields."""
        names = {f.name for f in dataclasses.fields(cls) if f.name not in COMPUTED_FIELDS}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def normalize(self) -> None:
        """Canonicalise in place: `stop` becomes a list, greedy becomes top_k = 1, and
        `logit_bias` gets int keys (values stay as sent). Idempotent; assumes `check_types`
        passed. Keys that are not token ids are kept as sent, for `verify` to refuse."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_str_max_len = max((len(s) for s in self.stop), default=0)
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        elif self.stop_regex is not None:
            self.stop_regex = list(self.stop_regex)
        self.stop_regex_tail = stop_regex_tail(self.stop_regex)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = _normalized_logit_bias(self.logit_bias)
        if self.temperature < SAMPLING_EPS:
            # Greedy: keep temperature as sent (>= 0) but make the intent explicit.
            self.top_k = 1

    def check_types(self) -> None:
        """Raise `InvalidSamplingParam` for a field of the wrong JSON type."""
        for name, kinds in _FIELD_TYPES.items():
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            # bool is an int subclass in Python but not a number in a JSON request.
            if isinstance(value, bool) and bool not in kinds:
                _bad(name, f"must be {_type_names(kinds)}, got {value!r}")
            if not isinstance(value, kinds):
                _bad(name, f"must be {_type_names(kinds)}, got {type(value).__name__}")
        for name, item in (("stop", str), ("stop_token_ids", int), ("stop_regex", str)):
            value = getattr(self, name)
            if isinstance(value, list) and not all(
                isinstance(v, item) and not isinstance(v, bool) for v in value
            ):
                _bad(name, f"must be a list of {item.__name__}")
        if isinstance(self.logit_bias, dict) and not all(
            _is_number(v) for v in self.logit_bias.values()
        ):
            _bad("logit_bias", "must map token ids to numbers")

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidSamplingParam` (a ValueError) naming the first invalid field."""
        self.check_types()
        check_stop(self.stop)
        check_stop_regex(self.stop_regex)
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            _bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            _bad("top_k", f"must be -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            _bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                _bad(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not 0.0 < self.repetition_penalty <= MAX_PENALTY:
            _bad(
                "repetition_penalty",
                f"must be in (0, {MAX_PENALTY:g}], got {self.repetition_penalty}",
            )
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            _bad("max_new_tokens", f"must be non-negative, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            _bad("min_new_tokens", f"must be non-negative, got {self.min_new_tokens}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            _bad(
                "min_new_tokens",
                f"must be <= max_new_tokens ({self.max_new_tokens}), got {self.min_new_tokens}",
            )
        if not 1 <= self.n <= MAX_N:
            _bad("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.stop_token_ids is not None and vocab_size is not None:
            bad_ids = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad_ids:
                _bad("stop_token_ids", f"{bad_ids} out of vocabulary [0, {vocab_size})")
        if self.logit_bias is not None:
            check_logit_bias(self.logit_bias, vocab_size)
        grammars = [
            name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None
        ]
        if len(grammars) > 1:
            _bad(grammars[1], f"only one of json_schema, regex, ebnf may be set, got {grammars}")


def check_stop(stop: object) -> None:
    """Stop strings: at most `MAX_STOP_SEQUENCES`, none empty (an empty string matches at
    once, so the request would end after its first token)."""
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        return  # None, or a wrong type `check_types` reports
    if len(stops) > MAX_STOP_SEQUENCES:
        _bad("stop", f"must be at most {MAX_STOP_SEQUENCES} strings, got {len(stops)}")
    if any(s == "" for s in stops):
        _bad("stop", "must not contain an empty string (it would match at once)")


def check_stop_regex(patterns: object) -> None:
    """stop_regex: at most `MAX_STOP_REGEX` patterns, each a valid, non-empty regular
    expression of at most `MAX_STOP_REGEX_LEN` characters."""
    items = [patterns] if isinstance(patterns, str) else patterns
    if not isinstance(items, (list, tuple)):
        return  # None, or a wrong type `check_types` reports
    if len(items) > MAX_STOP_REGEX:
        _bad("stop_regex", f"must be at most {MAX_STOP_REGEX} patterns, got {len(items)}")
    for pattern in items:
        if not pattern:
            _bad("stop_regex", "must not contain an empty pattern (it would match at once)")
        if len(pattern) > MAX_STOP_REGEX_LEN:
            _bad("stop_regex", f"patterns must be at most {MAX_STOP_REGEX_LEN} characters")
        try:
            re.compile(pattern)
        except re.error as e:
            _bad("stop_regex", f"{pattern!r} is not a valid regular expression: {e}")


def stop_regex_tail(patterns: list[str] | None) -> int:
    """Output tokens whose text a stop_regex search covers: the longest match any pattern
    can have, in characters (a token is at least one), plus one token for a match that
    begins inside the token before; `STOP_REGEX_MAX_TAIL` for unbounded patterns."""
    longest = 0
    for pattern in patterns or ():
        try:
            width = re._parser.parse(pattern).getwidth()[1]  # type: ignore[attr-defined]
        except (re.error, OverflowError, RecursionError):
            width = STOP_REGEX_MAX_TAIL  # `verify` refuses what does not compile
        longest = max(longest, width)
    return min(longest + 1, STOP_REGEX_MAX_TAIL) if patterns else 0


def check_logit_bias(bias: object, vocab_size: int | None = None) -> None:
    """`logit_bias`: a map of at most `MAX_LOGIT_BIAS` token ids (decimal-integer strings, or
    ints) to numbers in [-100, 100]; ids below `vocab_size` when it is known. The OpenAI
    request model calls this without a vocabulary, `verify` with one."""
    if not isinstance(bias, dict):
        _bad("logit_bias", f"must be an object mapping token ids to numbers, got {bias!r}")
    if len(bias) > MAX_LOGIT_BIAS:
        _bad("logit_bias", f"must have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
    limit = MAX_LOGIT_BIAS_VALUE
    for key, value in bias.items():
        token = token_id(key)
        if token is None:
            _bad("logit_bias", f"keys must be token ids (decimal integers), got {key!r}")
        if token < 0:
            _bad("logit_bias", f"token ids must be non-negative, got {token}")
        if vocab_size is not None and token >= vocab_size:
            _bad("logit_bias", f"token id {token} is out of the vocabulary [0, {vocab_size})")
        if not _is_number(value) or not -limit <= value <= limit:
            _bad(
                "logit_bias",
                f"bias of token {token} must be in [-{limit:g}, {limit:g}], got {value!r}",
            )


def token_id(key: object) -> int | None:
    """A `logit_bias` key as an int: an int itself, or a string of a decimal integer
    (ASCII digits, optionally signed, as "50256" or "-1"); None for anything else.
    Negative ids parse so that the error says "must be non-negative", not "not an id"."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        return int(key)
    return None


def _normalized_logit_bias(bias: dict[int | str, float]) -> dict[int | str, float] | None:
    out: dict[int | str, float] = {}
    for key, value in bias.items():
        token = token_id(key)
        name = key if token is None else token
        if name in out:
            # "7" and "07" (or 7 and "7") name one token: which bias was meant is unclear.
            _bad("logit_bias", f"token id {name} is given more than once")
        out[name] = value
    return out or None


class InvalidSamplingParam(ValueError):
    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"invalid sampling parameter {param}: {why}")
        self.param = param


_NUMBER = (int, float)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "max_new_tokens": (int,),
    "min_new_tokens": (int,),
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": (int,),
    "min_p": _NUMBER,
    "frequency_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "repetition_penalty": _NUMBER,
    "stop": (str, list),
    "stop_token_ids": (list,),
    "stop_regex": (str, list),
    "ignore_eos": (bool,),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "no_stop_trim": (bool,),
    "n": (int,),
    "seed": (int,),
    "json_schema": (str,),
    "regex": (str,),
    "ebnf": (str,),
    "logit_bias": (dict,),
}
_OPTIONAL = {
    "max_new_tokens",
    "stop",
    "stop_regex",
    "stop_token_ids",
    "seed",
    "json_schema",
    "regex",
    "ebnf",
    "logit_bias",
}
# Fields `normalize()` computes; never read from a request.
COMPUTED_FIELDS = frozenset({"stop_str_max_len", "stop_regex_tail"})
# A decimal token id; the digit cap keeps int() clear of Python's 4300-digit limit (a longer
# key is refused as not a token id rather than raising an unexpected error).
_DECIMAL = re.compile(r"[+-]?[0-9]{1,32}")


def _is_number(value: object) -> bool:
    """int or float, not bool (a JSON `true` is not a number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _type_names(kinds: tuple[type, ...]) -> str:
    if float in kinds:
        return "a number"
    return " or ".join(k.__name__ for k in kinds)


def _bad(name: str, why: str) -> NoReturn:
    raise InvalidSamplingParam(name, why)
