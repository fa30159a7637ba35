"""Twenty JSON schemas, each with a prompt that asks for that content.

Bounds keep a 135M model inside 256 new tokens: strings have maxLength <= 20 and arrays
maxItems <= 4.
"""

from __future__ import annotations

from typing import Any

S20 = {"type": "string", "maxLength": 20}
S12 = {"type": "string", "maxLength": 12}


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A closed object; every property is required unless `required` says otherwise."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    (
        "a person with a name and an age",
        obj({"name": S20, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    ),
    (
        "a book: its title, author and publication year",
        obj(
            {
                "title": S20,
                "author": S20,
                "year": {"type": "integer", "minimum": 1500, "maximum": 2025},
            }
        ),
    ),
    (
        "a product with a name, a price in dollars and whether it is in stock",
        obj(
            {
                "name": S20,
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
            }
        ),
    ),
    (
        "the weather today: a condition (sunny, cloudy, rainy or snowy) and the temperature",
        obj(
            {
                "condition": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                "temperature_c": {"type": "integer", "minimum": -50, "maximum": 50},
            }
        ),
    ),
    (
        "a shopping list with up to four items",
        obj({"items": {"type": "array", "items": S20, "minItems": 1, "maxItems": 4}}),
    ),
    (
        "a user account: a username of lowercase letters and an email address",
        obj(
            {
                "username": {"type": "string", "pattern": "^[a-z]{3,12}$"},
                "email": {
                    "type": "string",
                    "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org|net)$",
                },
            }
        ),
    ),
    (
        "a company with its name and its headquarters address (street, city, country)",
        obj({"name": S20, "address": obj({"street": S20, "city": S20, "country": S20})}),
    ),
    (
        "a team of two or three people, each with a name and a role",
        obj(
            {
                "team": {
                    "type": "array",
                    "items": obj({"name": S12, "role": S12}),
                    "minItems": 2,
                    "maxItems": 3,
                }
            }
        ),
    ),
    (
        "a point in 2D space with x and y coordinates",
        obj({"x": {"type": "number"}, "y": {"type": "number"}}),
    ),
    (
        "a traffic light state: its color and whether it is blinking",
        obj({"color": {"enum": ["red", "yellow", "green"]}, "blinking": {"type": "boolean"}}),
    ),
    (
        "a movie: its title, its genres (one to three) and its rating out of 10",
        obj(
            {
                "title": S20,
                "genres": {
                    "type": "array",
                    "items": {"enum": ["action", "comedy", "drama", "horror", "sci-fi"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "rating": {"type": "integer", "minimum": 1, "maximum": 10},
            }
        ),
    ),
    (
        "a date with year, month and day",
        obj(
            {
                "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                "month": {"type": "integer", "minimum": 1, "maximum": 12},
                "day": {"type": "integer", "minimum": 1, "maximum": 31},
            }
        ),
    ),
    (
        "a phone contact: a name and a phone number like 555-123-4567",
        obj({"name": S20, "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{3}-[0-9]{4}$"}}),
    ),
    (
        "a server configuration: host, port and whether TLS is enabled",
        obj(
            {
                "host": S20,
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "tls": {"type": "boolean"},
            }
        ),
    ),
    (
        "a recipe with a name and up to four ingredients, each with a name and a quantity",
        obj(
            {
                "name": S20,
                "ingredients": {
                    "type": "array",
                    "items": obj(
                        {"item": S12, "grams": {"type": "integer", "minimum": 1, "maximum": 1000}}
                    ),
                    "minItems": 1,
                    "maxItems": 4,
                },
            }
        ),
    ),
    (
        "an animal: its species, its number of legs and whether it can fly",
        obj(
            {
                "species": S20,
                "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                "can_fly": {"type": "boolean"},
            }
        ),
    ),
    (
        "a student with a name and a grid of test scores (two rows of two numbers)",
        obj(
            {
                "name": S12,
                "scores": {
                    "type": "array",
                    "items": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 100},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "minItems": 2,
                    "maxItems": 2,
                },
            }
        ),
    ),
    (
        "a task with a title, a priority (low, medium or high) and an optional note",
        obj(
            {
                "title": S20,
                "priority": {"enum": ["low", "medium", "high"]},
                "note": S20,
            },
            required=["title", "priority"],
        ),
    ),
    (
        "a city with its name, its population and whether it is a capital",
        obj(
            {
                "city": S20,
                "population": {"type": "integer", "minimum": 0, "maximum": 50000000},
                "capital": {"type": "boolean"},
            }
        ),
    ),
    (
        "an order: an id, a status, and up to three line items with a product and a count",
        obj(
            {
                "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "status": {"enum": ["pending", "shipped", "delivered"]},
                "lines": {
                    "type": "array",
                    "items": obj(
                        {
                            "product": S12,
                            "count": {"type": "integer", "minimum": 1, "maximum": 9},
                        }
                    ),
                    "minItems": 1,
                    "maxItems": 3,
                },
                "meta": obj({"gift": {"type": "boolean"}, "rush": {"type": "boolean"}}),
            }
        ),
    ),
]
