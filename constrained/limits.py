"""Caps on what a constraint may ask of the grammar compiler, checked before it compiles.

A compile cannot be interrupted once it runs (xgrammar's compiler is native code with no
cancellation), so a grammar that would take minutes must be refused up front. Each cap
bounds what makes compile time grow; `python -m bench.grammar_compile --probe KIND SIZE`
measures a shape with the default model's vocabulary:

- nesting (`deep-array`): time and memory grow steeply with depth; twenty levels (OpenAI
  allows ten) cost nothing measurable.
- optional properties (`optional-properties`): time grows faster than their number, and
  multiplies when such objects nest, so the cap counts them across the whole schema, where
  the worst shape under it is one flat object. Required properties are cheap, and so are
  enums, anyOf lists, `maxLength` and `format`.
- size: the byte cap bounds long enums, regexes and EBNF grammars; a regex
  (`regex-alternations`) costs up to a few seconds however long.
- not capped: each `pattern` of a schema is compiled on its own, so many bounded
  character-class repetitions (`--regex '[a-z]{1,20}'` times their number) add up. A schema
  under every cap can therefore still compile for a minute or more; it then holds one
  compile thread until it ends, and its request fails at the compile timeout. The walk
  counts patterns so that such a schema never counts as small.

Depth counts the schemas nested in one another that hold further schemas (objects,
arrays, combinators, conditionals); a leaf such as `{"type": "string"}` adds nothing, and a
`$ref` counts as the schema it names. A recursive `$ref` is legal (a tree node's children)
and adds nothing once it is already being expanded, so the walk always ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

DEFAULT_MAX_BYTES = 65536
DEFAULT_MAX_DEPTH = 20
DEFAULT_MAX_PROPERTIES = 1000

# Keywords whose value is one schema, a list of schemas, or a name -> schema mapping.
_ONE_SCHEMA = (
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAP = ("properties", "patternProperties", "dependentSchemas")
_DEFINITIONS = ("$defs", "definitions")


class GrammarSize(NamedTuple):
    """What a constraint that passed the caps asks of the compiler."""

    bytes: int
    properties: int = 0  # object properties of a JSON schema; 0 for regex and EBNF
    patterns: int = 0  # `pattern` and `patternProperties` regexes of a JSON schema


class GrammarLimitError(ValueError):
    """A constraint over one of the caps; `field` is the sampling parameter that carried it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    max_bytes: int = DEFAULT_MAX_BYTES
    max_depth: int = DEFAULT_MAX_DEPTH
    max_properties: int = DEFAULT_MAX_PROPERTIES

    @classmethod
    def from_server_args(cls, args: Any) -> GrammarLimits:
        return cls(
            max_bytes=args.grammar_max_schema_bytes,
            max_depth=args.grammar_max_depth,
            max_properties=args.grammar_max_properties,
        )


def check_grammar_limits(field: str, spec: str, limits: GrammarLimits) -> GrammarSize:
    """The size of `spec` (the value of `field`: json_schema, regex or ebnf); raise
    `GrammarLimitError` if it is over a cap. A schema that is not valid JSON passes: the
    compiler reports it."""
    size = len(spec.encode())
    if size > limits.max_bytes:
        raise GrammarLimitError(
            field,
            f"`{field}` is {size} bytes; this server accepts at most {limits.max_bytes} "
            "(--grammar-max-schema-bytes).",
        )
    if field != "json_schema":
        return GrammarSize(size)
    try:
        schema = json.loads(spec)
    except RecursionError:  # nested past what the JSON reader (and any compiler) can follow
        raise GrammarLimitError(
            field,
            f"`{field}` nests too deeply to be read; this server accepts at most "
            f"{limits.max_depth} levels (--grammar-max-depth).",
        ) from None
    except ValueError:
        return GrammarSize(size)
    walk = _SchemaWalk(schema, field, limits)
    try:
        walk.run()
    except RecursionError:  # a chain of `$ref` aliases longer than Python's stack
        raise _too_deep(field, limits) from None
    return GrammarSize(size, walk.properties, walk.patterns)


def _too_deep(field: str, limits: GrammarLimits) -> GrammarLimitError:
    return GrammarLimitError(
        field,
        f"`{field}` nests schemas more than {limits.max_depth} levels deep; this server "
        f"accepts at most {limits.max_depth} (--grammar-max-depth).",
    )


class _SchemaWalk:
    """One pass over a schema: the deepest nesting (stopping as soon as it passes the cap)
    and the number of properties. Each `$ref` target is walked once and its depth kept."""

    def __init__(self, root: Any, field: str, limits: GrammarLimits) -> None:
        self.root = root
        self.field = field
        self.limits = limits
        self.properties = 0
        self.patterns = 0
        self.ref_depths: dict[str, int] = {}
        self.expanding: set[str] = set()

    def run(self) -> None:
        self.ref_depth("#", 0)  # the root, as `#`: a `$ref` back to it is then recursion
        # Definitions no path reaches may still be compiled: walk them from the top level.
        if not isinstance(self.root, dict):
            return
        for keyword in _DEFINITIONS:
            defs = self.root.get(keyword)
            for name in defs if isinstance(defs, dict) else ():
                self.ref_depth(f"#/{keyword}/{_escape(name)}", 0)

    def depth(self, node: Any, above: int) -> int:
        """Levels of nesting from `node` down, `above` levels below the root."""
        if not isinstance(node, dict):
            return 0
        props = node.get("properties")
        if isinstance(props, dict):
            self.count_properties(len(props))
        self.patterns += isinstance(node.get("pattern"), str)
        pattern_props = node.get("patternProperties")
        self.patterns += len(pattern_props) if isinstance(pattern_props, dict) else 0
        ref = node.get("$ref")
        inner = self.ref_depth(ref, above) if isinstance(ref, str) else 0
        children = _subschemas(node)
        if not children:
            return inner
        level = above + 1
        if level > self.limits.max_depth:
            raise _too_deep(self.field, self.limits)
        deepest = max(self.depth(child, level) for child in children)
        return max(inner, 1 + deepest)

    def count_properties(self, n: int) -> None:
        self.properties += n
        if self.properties > self.limits.max_properties:
            raise GrammarLimitError(
                self.field,
                f"`{self.field}` has more than {self.limits.max_properties} object properties; "
                f"this server accepts at most {self.limits.max_properties} "
                "(--grammar-max-properties).",
            )

    def ref_depth(self, ref: str, above: int) -> int:
        if ref in self.ref_depths:
            depth = self.ref_depths[ref]
            if above + depth > self.limits.max_depth:
                raise _too_deep(self.field, self.limits)
            return depth
        if ref in self.expanding:  # recursion: the grammar refers back, it does not nest
            return 0
        target = _resolve(self.root, ref)
        self.expanding.add(ref)
        try:
            depth = self.depth(target, above)
        finally:
            self.expanding.discard(ref)
        self.ref_depths[ref] = depth
        return depth


def _subschemas(node: dict[str, Any]) -> list[Any]:
    out: list[Any] = []
    for key in _ONE_SCHEMA:
        value = node.get(key)
        if isinstance(value, dict):
            out.append(value)
    for key in _SCHEMA_LIST:
        value = node.get(key)
        if isinstance(value, list):
            out.extend(v for v in value if isinstance(v, dict))
    for key in _SCHEMA_MAP:
        value = node.get(key)
        if isinstance(value, dict):
            out.extend(v for v in value.values() if isinstance(v, dict))
    return out


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def _resolve(root: Any, ref: str) -> Any:
    """The schema a local `$ref` (`#`, `#/$defs/Name`, any JSON pointer) names, or None
    for one this walk cannot follow (a remote URI: the compiler refuses those itself)."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
